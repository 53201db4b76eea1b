"""The no-cache reference: every denoising step recomputes the whole prefix with a block-causal mask.

It consumes the random generator exactly as :class:`~.session.VideoSession` does, so with the same seed the two
must produce the same video. Each forward runs the model over all earlier chunks (clean, at the context
timestep) plus the current noisy chunk, with per-frame timesteps and a frame-level mask: a query frame sees the
key frames its own chunk sees (:meth:`WindowSpec.visible`). RoPE as ``config.rope`` says, computed directly:
absolute positions, or (``"cache"``) for every query chunk its queries and all the keys rotated at the cache
positions that chunk reads them at (:meth:`WindowSpec.cache_position`), keys rotated anew for every chunk (what
the cache's rotate-once scheme must equal). Used by the tests and by the benchmark that compares cached against
uncached generation.
"""

from __future__ import annotations

import torch

from ..rope import RopeFreqs
from ..sampling import sample_dmd, schedule_sigmas
from .kv_cache import WindowSpec
from .session import CausalConfig


class MaskedPrefix:
    """A ``kv`` view for full-sequence forwards: absolute RoPE and a boolean token mask."""

    def __init__(self, freqs, mask: torch.Tensor):
        self.freqs, self.mask = freqs, mask

    def query_rope(self):
        return self.freqs

    def layer(self, index: int):
        return self

    def attend(self, q, k, v, backends):
        return backends.attention(q, backends.apply_rope(k, self.freqs).type_as(q), v, mask=self.mask)


class CachePositionPrefix:
    """A ``kv`` view for full-sequence forwards at cache-relative RoPE positions: attention per query chunk, its
    queries and every key rotated at the positions that chunk reads them at."""

    def __init__(self, rope_fn, window: WindowSpec, frames: int, grid_hw, mask: torch.Tensor, device=None):
        c = window.chunk_frames
        self.rows = mask.shape[0] // frames * c  # tokens of a chunk
        starts = range(0, frames, c)

        def positions(frame_range, start):
            return torch.tensor([window.cache_position(f, start) for f in frame_range], device=device)

        queries = [rope_fn(positions(range(start, start + c), start), grid_hw) for start in starts]
        self.freqs = RopeFreqs(
            torch.cat([q.cos for q in queries], dim=1), torch.cat([q.sin for q in queries], dim=1)
        )
        self.key_freqs = [rope_fn(positions(range(frames), start), grid_hw) for start in starts]
        self.mask = mask

    def query_rope(self):
        return self.freqs

    def layer(self, index: int):
        return self

    def attend(self, q, k, v, backends):
        out = []
        for i, freqs in enumerate(self.key_freqs):
            rows = slice(i * self.rows, (i + 1) * self.rows)
            keys = backends.apply_rope(k, freqs).type_as(q)
            out.append(backends.attention(q[:, rows], keys, v, mask=self.mask[rows]))
        return torch.cat(out, dim=1)


def frame_mask(window: WindowSpec, frames: int, tokens_per_frame: int, device=None) -> torch.Tensor:
    c = window.chunk_frames
    vis = torch.tensor(
        [[window.visible((q // c) * c, k) for k in range(frames)] for q in range(frames)], device=device
    )
    return vis.repeat_interleave(tokens_per_frame, 0).repeat_interleave(tokens_per_frame, 1)


@torch.inference_mode()
def recompute_video(model, context, height, width, n_chunks, config: CausalConfig | None = None, seed=0):
    """Latents ``[B, C, n_chunks * chunk, h, w]`` generated without any cache."""
    config = config or CausalConfig()
    window = config.window
    p = model.params
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(int(seed))
    b, c = context.shape[0], config.chunk_frames
    h, w = height // 8, width // 8
    tpf = (h // p.patch_size[1]) * (w // p.patch_size[2])
    shape = (b, p.in_dim, c, h, w)
    sigmas = schedule_sigmas(config.schedule, config.steps).to(device)
    ctx = model.embed_context(context.to(device))
    clean: list[torch.Tensor] = []

    def noise():
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32)

    for chunk in range(n_chunks):
        start = chunk * c
        frames = start + c
        grid_hw = (h // p.patch_size[1], w // p.patch_size[2])
        mask = frame_mask(window, frames, tpf, device)
        if config.rope == "cache":
            view = CachePositionPrefix(model.frame_rope, window, frames, grid_hw, mask, device)
        else:
            view = MaskedPrefix(model.rope((frames, *grid_hw), 0, device), mask)

        def denoised(x, sigma, start=start, frames=frames, view=view, **_):
            video = torch.cat([*clean, x], dim=2)
            t = torch.full((b, frames), float(config.context_noise), device=device)
            t[:, start:] = sigma[0] * 1000.0
            v = model(video, t, context_embedded=ctx, kv=view)[:, :, start:]
            return x - sigma.view(-1, 1, 1, 1, 1) * v

        x0 = sample_dmd(denoised, sigmas[0] * noise(), sigmas, noise_sampler=lambda *_: noise(), disable=True)
        clean.append(x0)
    return torch.cat(clean, dim=2).float().cpu()
