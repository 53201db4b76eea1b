"""Sink re-positioning (``rope="cache"`` with sinks): the sinks' keys follow the window.

Queries and non-sink keys are rotated at their absolute frame index in both RoPE modes, keys once, when they are
written (see the package docstring: cache positions differ from absolute ones by one offset ``o``, the same for
the chunk and every retained non-sink frame). Only a sink ``s`` must move: it sits at ``s + o``, and ``o`` moves
when the window slides, at most once a chunk. :meth:`SinkKeys.reposition` then rewrites the sinks' keys, one pass
over the sink frames of every layer, from an unrotated copy of them (taken once, when the sinks are committed), so
the rounding of a sink never accumulates over a long stream.
"""

from __future__ import annotations

import torch

from .... import kernels
from ...backends import Backends
from .window import WindowSpec


class SinkKeys:
    """Host state of the sinks' key copies: how many sink frames are copied, and the offset the sink slots' keys
    are rotated at. The tensors (each layer's key buffer and sink-key copy) are the cache's, passed per call;
    ``backends``: the run's (its kernel mode and its record of kernel fallbacks, for the rotations)."""

    def __init__(self, window: WindowSpec, tokens_per_frame: int, backends: Backends):
        self.window, self.tokens_per_frame, self.backends = window, tokens_per_frame, backends
        self.copied = 0  # sink frames whose unrotated keys are in the copies
        self.offset = 0  # the offset the sink slots' keys are rotated at

    def reposition(
        self,
        chunk_start: int,
        frames_committed: int,
        keys: list[torch.Tensor],
        copies: list[torch.Tensor],
        grid_hw: tuple[int, int],
        rope_fn,
        frames: int | None = None,
    ) -> None:
        """Copy (unrotated) the sink keys committed since the last chunk, then rotate every sink's keys to
        ``s + o`` for this chunk's offset ``o`` when it moved (at most once a chunk, one pass over the sink
        frames, always from the copies: no rounding accumulates)."""
        t, device = self.tokens_per_frame, keys[0].device
        mode, fallbacks = self.backends.kernel_mode, self.backends.kernel_fallbacks
        committed = min(self.window.sink_frames, frames_committed)
        if committed > self.copied:
            # written by their chunk's queries' rotation, at their absolute index (o is 0 while a sink is written)
            written = rope_fn(torch.arange(self.copied, committed, device=device), grid_hw)
            rows = slice(self.copied * t, committed * t)
            for layer_keys, copy in zip(keys, copies):
                unrotated = kernels.apply_rope(
                    layer_keys[:, rows], written.cos, -written.sin, mode=mode, fallbacks=fallbacks
                )
                copy[:, rows].copy_(unrotated)
            self.copied = committed
        offset = self.window.cache_offset(chunk_start, frames)
        if offset == self.offset or not self.copied:
            return
        n = self.copied  # offset > 0 only once every sink is committed (and copied)
        freqs = rope_fn(torch.arange(n, device=device) + offset, grid_hw)
        for layer_keys, copy in zip(keys, copies):
            rotated = kernels.apply_rope(
                copy[:, : n * t], freqs.cos, freqs.sin, mode=mode, fallbacks=fallbacks
            )
            layer_keys[:, : n * t].copy_(rotated)
        self.offset = offset
