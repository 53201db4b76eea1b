"""Sequential per-frame denoising: the stream batch's baseline (no buffer, one frame group at a time).

Each group runs its T steps back to back, one forward of ``fb`` rows per step (plus the CFG rows of the mode),
with the stream's own sigmas, noise and prompts, so its result is what the stream batch must reproduce. The
benchmark times it against :meth:`StreamBatch.run`.
"""

from __future__ import annotations

import math
import time

import torch

from .guidance import advance
from .pipeline import StreamBatch, check_frames


def denoise_sequential(stream: StreamBatch, latents: torch.Tensor) -> torch.Tensor:
    """x0 of one group ``[fb, C, h, w]`` (model latent space) after its T steps, run one after another."""
    c = stream.config
    fb = c.frame_buffer_size
    sig = stream.sigmas.to(stream.device)
    latents = latents.to(stream.device, torch.float32)
    with torch.inference_mode():
        x = (1 - sig[0]) * latents + sig[0] * stream.noise[0]
        ref = latents.clone()
        x0 = x
        for k in range(c.steps):
            sigma = sig[k].expand(fb).reshape(-1, 1, 1, 1)
            first = k == 0
            v_c, v_u = stream.model_velocities(x, sigma, stream.uncond_rows(fb, first))
            v = stream.guided(x, sigma, ref, v_c, v_u, first)
            noise_next = stream.noise[k + 1] if k + 1 < c.steps else torch.zeros_like(x)
            x0, x = advance(c.sampler, x, sigma, sig[k + 1].expand(fb).reshape(-1, 1, 1, 1), v, noise_next)
    return x0


def run_sequential(stream: StreamBatch, frames: torch.Tensor) -> torch.Tensor:
    """A clip ``[N, 3, H, W]`` -> ``[N, 3, H, W]``, each group encoded, denoised on its own and decoded (no
    similarity filter). Time spent is added to ``stream.stats`` as for :meth:`StreamBatch.run`."""
    frames = check_frames(frames, geometry=stream.geometry)
    fb = stream.config.frame_buffer_size
    n = frames.shape[0]
    groups = math.ceil(n / fb)
    if groups * fb > n:
        frames = torch.cat([frames, frames[-1:].expand(groups * fb - n, -1, -1, -1)])
    stream.reset()
    outs = []
    for g in range(groups):
        t0 = time.perf_counter()
        latents = stream.encode_frames(frames[g * fb : (g + 1) * fb])
        t1 = time.perf_counter()
        x0 = denoise_sequential(stream, latents)
        t2 = time.perf_counter()
        outs.append(stream.decode_latents(x0).float().cpu())
        t3 = time.perf_counter()
        stream.stats.seconds_encode += t1 - t0
        stream.stats.seconds_dit += t2 - t1
        stream.stats.seconds_decode += t3 - t2
        stream.stats.groups_in += 1
        stream.stats.groups_out += 1
    return torch.cat(outs)[:n]
