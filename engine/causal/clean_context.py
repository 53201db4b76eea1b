"""The clean-context pass: how a generated chunk becomes context for the chunks after it.

A causal student (CausVid, Self-Forcing) denoises a chunk in a few steps, each of which writes the chunk's
keys and values into the KV cache from a *noisy* input. Those are not what later chunks should attend to: once
the chunk is denoised, the model runs once more on the clean latents at the timestep ``context_noise`` (0 in
Self-Forcing: the clean chunk itself) and that forward's keys and values are the ones the cache keeps. Then
:meth:`KVCache.commit` moves the cache on to the next chunk.

:class:`~.session.VideoSession` defers this pass until the next chunk starts (a stream that stops never pays
for it; one continued later gets the same video), and reports its time as ``ChunkResult.commit_seconds``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .kv_cache import KVCache

# ``velocity(latents, timestep, start_frame)``: one forward of the model over a chunk, writing its K/V
ChunkForward = Callable[[torch.Tensor, float, int], torch.Tensor]


def clean_context_pass(
    forward: ChunkForward, cache: KVCache, clean: torch.Tensor, context_noise: float
) -> None:
    """Write the K/V of the denoised chunk ``clean [B, C, F, h, w]`` (the chunk after the committed frames) at
    timestep ``context_noise`` and commit them: the next chunk sees them from its first step on."""
    forward(clean, context_noise, cache.frames_committed)
    cache.commit()
