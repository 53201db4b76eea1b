"""Wan 2.1 text-to-video DiT (Wan-Video/Wan2.1), bidirectional and causal (CausVid / Self-Forcing students).

``Wan.forward(x, timestep, context)`` has the reference semantics: ``x [B, 16, F, H, W]`` latent video in the
model's space, ``timestep [B]`` (or per frame ``[B, F]``, as causal students use) on the 0..1000 scale,
``context [B, L, 4096]`` umT5 tokens (zero-padded to ``text_len`` = 512 as the reference does). It returns the
flow velocity ``[B, 16, F, H, W]`` in float32.

Causal generation passes a KV-cache view (``kv``) and the absolute frame index of ``x``'s first frame
(``start_frame``); attention is then bidirectional inside the chunk and reaches earlier frames only through the
cache. RoPE positions come from the cache in that case (it decides how positions are assigned).

The forward is three stages, ``finish(run_blocks(embed(...)))`` on a :class:`WanHidden` state, so code outside
the model (a step cache) can run part of the block stack; the model imports none of it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ..backends import DEFAULT_BACKENDS, Backends
from ..ops import Linear
from ..rope import RopeFreqs, rope_freqs
from .staged import StagedHidden, StagedModel
from .wan_layers import Head, WanAttentionBlock


@dataclass(frozen=True)
class WanParams:
    dim: int = 1536
    ffn_dim: int = 8960
    num_heads: int = 12
    num_layers: int = 30
    in_dim: int = 16
    out_dim: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    text_len: int = 512
    patch_size: tuple[int, int, int] = (1, 2, 2)
    eps: float = 1e-6
    theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def axes_dim(self) -> tuple[int, int, int]:
        """RoPE split of a head between (frame, row, column), as the reference computes it."""
        d = self.head_dim
        return (d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6))

    @property
    def latent_channels(self) -> int:
        return self.in_dim


PRESETS: dict[str, WanParams] = {
    # Wan-Video/Wan2.1 wan/configs/wan_t2v_1_3B.py and wan_t2v_14B.py
    "wan2.1-1.3b": WanParams(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30),
    "wan2.1-14b": WanParams(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40),
    # Tests: the real interface widths (umT5 4096, 16 latent channels) around a tiny trunk.
    "wan-tiny": WanParams(dim=64, ffn_dim=128, num_heads=2, num_layers=2),
    # Benchmarks on the CPU: Wan's head size (128) at a width a CPU runs quickly.
    "wan-mid": WanParams(dim=512, ffn_dim=1536, num_heads=4, num_layers=4),
}


def sinusoidal_embedding(dim: int, position: torch.Tensor) -> torch.Tensor:
    """``[N] -> [N, dim]`` (cos half first), computed in float64 as the reference does."""
    half = dim // 2
    position = position.to(torch.float64)
    sinusoid = torch.outer(
        position, torch.pow(10000, -torch.arange(half, device=position.device).to(position).div(half))
    )
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1)


class Wan(StagedModel):
    family = "wan"
    block_stacks = ("blocks",)

    def __init__(self, params: WanParams):
        super().__init__()
        if params.dim % params.num_heads or params.head_dim % 2:
            raise ValueError(f"dim {params.dim} must split into {params.num_heads} heads of even size")
        self.params = params
        p = params
        self.patch_embedding = nn.Conv3d(p.in_dim, p.dim, kernel_size=p.patch_size, stride=p.patch_size)
        self.text_embedding = nn.Sequential(
            Linear(p.text_dim, p.dim), nn.GELU(approximate="tanh"), Linear(p.dim, p.dim)
        )
        self.time_embedding = nn.Sequential(Linear(p.freq_dim, p.dim), nn.SiLU(), Linear(p.dim, p.dim))
        self.time_projection = nn.Sequential(nn.SiLU(), Linear(p.dim, p.dim * 6))
        self.blocks = nn.ModuleList(
            WanAttentionBlock(p.dim, p.ffn_dim, p.num_heads, p.eps) for _ in range(p.num_layers)
        )
        self.head = Head(p.dim, p.out_dim, p.patch_size, p.eps)

    # -- pieces the causal generator reuses ---------------------------------------------------------------------
    def embed_context(self, context: torch.Tensor) -> torch.Tensor:
        """umT5 tokens ``[B, L, 4096]`` zero-padded to ``text_len`` and embedded (what cross-attention reads)."""
        p = self.params
        if context.shape[1] > p.text_len:
            raise ValueError(f"context has {context.shape[1]} tokens; Wan takes at most {p.text_len}")
        pad = context.new_zeros(context.shape[0], p.text_len - context.shape[1], context.shape[2])
        dtype = self.patch_embedding.weight.dtype
        return self.text_embedding(torch.cat([context, pad], dim=1).to(dtype))

    def grid(self, x: torch.Tensor) -> tuple[int, int, int]:
        """Token grid (frames, rows, columns) of a latent video ``[B, C, F, H, W]``."""
        pt, ph, pw = self.params.patch_size
        return x.shape[2] // pt, x.shape[3] // ph, x.shape[4] // pw

    def rope(self, grid: tuple[int, int, int], start_frame: int = 0, device=None) -> RopeFreqs:
        """Rotations for a token grid whose first frame has position ``start_frame`` (see :meth:`frame_rope`)."""
        f, h, w = grid
        return self.frame_rope(torch.arange(start_frame, start_frame + f, device=device), (h, w))

    def frame_rope(self, frame_positions: torch.Tensor, grid_hw: tuple[int, int]) -> RopeFreqs:
        """Rotations for whole frames ``[F]`` at the given frame positions, each an ``h x w`` token grid.

        Angles and their cos / sin in float64 as the reference computes them, the tables rounded to float32
        once here (a forward or a cache chunk builds them once, every layer and head reuses them), the rotation
        in float32: within float32 rounding of the reference's float64 rotation (``tests/test_rope_precision``).
        """
        h, w = grid_hw
        f = frame_positions.shape[0]
        ids = torch.stack(
            (
                frame_positions.view(f, 1, 1).expand(f, h, w),
                torch.arange(h, device=frame_positions.device).view(1, h, 1).expand(f, h, w),
                torch.arange(w, device=frame_positions.device).view(1, 1, w).expand(f, h, w),
            ),
            dim=-1,
        ).reshape(1, f * h * w, 3)
        return rope_freqs(
            ids, self.params.axes_dim, self.params.theta, dtype=torch.float32, angle_dtype=torch.float64
        )

    def time_embed(self, timestep: torch.Tensor, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``timestep [B]`` or ``[B, F]`` -> (``e [B, F, C]``, ``e0 [B, F, 6, C]``), float32."""
        if timestep.ndim == 1:
            timestep = timestep[:, None].expand(-1, frames)
        b = timestep.shape[0]
        emb = sinusoidal_embedding(self.params.freq_dim, timestep.reshape(-1)).float()
        e = self.time_embedding(emb)
        e0 = self.time_projection(e).unflatten(1, (6, self.params.dim))
        return e.view(b, frames, -1), e0.view(b, frames, 6, -1)

    def unpatchify(self, tokens: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        f, h, w = grid
        pt, ph, pw = self.params.patch_size
        c = self.params.out_dim
        x = tokens.view(tokens.shape[0], f, h, w, pt, ph, pw, c)
        x = torch.einsum("bfhwpqrc->bcfphqwr", x)
        return x.reshape(tokens.shape[0], c, f * pt, h * ph, w * pw)

    # -- stages (engine.models.staged), so a step cache can run part of the stack -------------------------------
    def embed(
        self,
        x: torch.Tensor,
        timestep: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        context_embedded: torch.Tensor | None = None,
        start_frame: int = 0,
        kv=None,
        cross_kv=None,
        freqs: RopeFreqs | None = None,
        backends: Backends = DEFAULT_BACKENDS,
    ) -> WanHidden:
        """Inputs (as :meth:`forward`) -> the residual stream before block 0."""
        dtype = self.patch_embedding.weight.dtype
        grid = self.grid(x)
        frames = grid[0]
        # [B, C, F*T] -> [B, F*T, C] stored token-major: a transposed view kept channel-major layout through every
        # residual add of the stack (each a strided read mixed with contiguous operands, plus a copy per norm)
        # Each batch row is embedded on its own: a row's result must not depend on what shares its batch (for a
        # batch of several rows the convolution and the small time-embedding GEMMs pick other blockings, which
        # round differently). A session pool batches video streams whose chunks must equal their solo runs; for
        # batch 1 this is the one call it always was.
        patches = torch.cat([self.patch_embedding(row) for row in x.to(dtype).split(1)])
        tokens = patches.flatten(2).transpose(1, 2).float().contiguous()
        timestep = timestep.to(x.device)
        if timestep.ndim == 0 or timestep.shape[0] == 1 or x.shape[0] == 1:
            e, e0 = self.time_embed(timestep, frames)
        else:
            rows = [self.time_embed(t, frames) for t in timestep.split(1)]
            e, e0 = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        ctx = context_embedded if context_embedded is not None else self.embed_context(context)
        if freqs is None:
            freqs = self.rope(grid, start_frame, x.device) if kv is None else kv.query_rope()
        return WanHidden(tokens, e, e0, freqs, ctx, grid, kv, cross_kv, backends=backends)

    def run_block(self, h: WanHidden, index: int) -> None:
        """Block ``index``, with that layer's view of the causal KV cache and of the text keys/values."""
        h.tokens = self.blocks[index](
            h.tokens, h.e0, h.freqs, h.ctx, h.grid[0],
            kv=None if h.kv is None else h.kv.layer(index),
            cross_kv=None if h.cross_kv is None else h.cross_kv.layer(index),
            backends=h.backends,
        )  # fmt: skip

    def finish(self, h: WanHidden) -> torch.Tensor:
        """The head and unpatchify: velocity ``[B, C, F, H, W]`` in float32."""
        return self.unpatchify(self.head(h.tokens, h.e, h.grid[0], h.backends), h.grid).float()

    def forward(
        self,
        x: torch.Tensor,
        timestep: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        context_embedded: torch.Tensor | None = None,
        start_frame: int = 0,
        kv=None,
        cross_kv=None,
        freqs: RopeFreqs | None = None,
        block_runner=None,
        backends: Backends = DEFAULT_BACKENDS,
    ) -> torch.Tensor:
        """Velocity for ``x [B, C, F, H, W]``; see the module docstring.

        ``kv``: a causal KV cache prepared for this chunk (``kv.query_rope()`` gives the queries' rotations,
        ``kv.layer(i).attend(q, k, v)`` runs layer ``i``'s attention); ``cross_kv``: a per-prompt cache of the
        text keys/values. ``freqs`` overrides the query rotations. ``context_embedded`` skips the text embedding
        when the caller already holds it. ``block_runner(model, hidden) -> hidden``, when given, runs the block
        stack in place of ``run_blocks`` (a step cache's hook). ``backends``: how this run computes attention,
        norms and RoPE (``engine.backends``).
        """
        h = self.embed(
            x, timestep, context, context_embedded=context_embedded, start_frame=start_frame, kv=kv,
            cross_kv=cross_kv, freqs=freqs, backends=backends,
        )  # fmt: skip
        return self.run_stages(h, block_runner)


@dataclass
class WanHidden(StagedHidden):
    """The residual stream between two stages of one forward (tokens float32 ``[B, F*T, C]``)."""

    tokens: torch.Tensor
    e: torch.Tensor  # [B, F, C] time embedding (the head's modulation)
    e0: torch.Tensor  # [B, F, 6, C] the blocks' modulation
    freqs: RopeFreqs
    ctx: torch.Tensor
    grid: tuple[int, int, int]
    kv: object = None
    cross_kv: object = None

    @property
    def stream(self) -> torch.Tensor:
        return self.tokens

    def with_stream(self, tokens: torch.Tensor) -> WanHidden:
        return dataclasses.replace(self, tokens=tokens)


def tokens_per_frame(params: WanParams, height: int, width: int) -> int:
    """Tokens of one latent frame of ``height x width`` latent pixels."""
    return (height // params.patch_size[1]) * (width // params.patch_size[2])


def wan_velocity(
    model: Wan,
    x: torch.Tensor,
    sigma: torch.Tensor,
    cond,
    block_runner=None,
    backends: Backends = DEFAULT_BACKENDS,
) -> torch.Tensor:
    """Family adapter: velocity at noise level ``sigma [B]`` (flow, timestep = 1000 * sigma)."""
    return model(x, sigma * 1000.0, cond.context, block_runner=block_runner, backends=backends)


__all__ = ["PRESETS", "Wan", "WanHidden", "WanParams", "tokens_per_frame", "wan_velocity"]
