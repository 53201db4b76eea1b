"""Prompt switches of a causal video session: CausVid's (the cross-attention cache only) and LongLive's, with a
KV re-cache (NVlabs/LongLive v1.0, ``InteractiveCausalInferencePipeline._recache_after_switch``).

Without a re-cache the new prompt only reaches the next chunks through cross-attention: the window's keys and
values still carry the old prompt, so it lingers for up to a window of frames. With a re-cache, at the switch the
K/V of the frames in the window are recomputed from their clean latents under the new prompt, one forward over
those frames at the clean-context timestep (``kv_cache.recache``: which frames, what they attend to, the sinks),
and generation continues. Its cost, one forward over up to ``window_frames`` frames against a chunk step's
``chunk_frames``, is reported per switch (:class:`RecacheReport`) and measured in ``bench/interactive_video.py``.

The re-cache runs eagerly on the plain model (its frame count is not a chunk's: a compiled or captured step is
neither recompiled nor recaptured). A session switching with a re-cache first commits its pending chunk under the
old prompt (LongLive's loop runs that clean-context pass before the switch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import InputError
from .kv_cache import CleanFrames, KVCache, RecacheView, recache_frames


@dataclass(frozen=True)
class RecacheReport:
    frames: int  # latent frames whose K/V were recomputed (0: nothing generated yet)
    start_frame: int
    seconds: float


def check_recache(cache: KVCache, clean: CleanFrames, pending_frames: int, where: str | None = None) -> None:
    """Refuse a re-cache whose frames' clean latents are not kept, before anything changes (checked when the
    switch is sent: the frames a re-cache needs only move forward, so one that can run now can run at the next
    boundary). Only a session resumed from a version 1 snapshot (which does not save them) lacks them, until it has
    generated a window of frames."""
    frames = recache_frames(cache, pending_frames)
    if not clean.holds(frames):
        missing = [f for f in frames if clean.frames[f % clean.window_frames] != f]
        raise InputError(
            "recache",
            f"the clean latents of frames {missing[0]}-{missing[-1]} are not kept (a session resumed from a "
            "version 1 snapshot does not have them); switch without recache, or after "
            f"{clean.window_frames} more generated frames",
            where,
        )


def recache_window(
    model, cache: KVCache, clean: CleanFrames, context_embedded: torch.Tensor, cross, context_noise: float,
    grid_hw: tuple[int, int], rope_fn, backends, block_runner=None,
) -> RecacheReport:  # fmt: skip
    """Recompute the K/V of the window's frames under ``context_embedded`` (whose text K/V ``cross`` holds)."""
    t0 = time.perf_counter()
    frames = recache_frames(cache)
    if not len(frames):
        return RecacheReport(0, frames.start, 0.0)
    x = clean.read(frames)
    view = RecacheView(cache, frames, grid_hw, rope_fn)
    dtype = torch.float32
    t = torch.full((x.shape[0], len(frames)), float(context_noise), dtype=dtype, device=x.device)
    model(
        x, t, context_embedded=context_embedded, kv=view, cross_kv=cross, block_runner=block_runner,
        backends=backends,
    )  # fmt: skip
    cache.recached(frames)
    return RecacheReport(len(frames), frames.start, time.perf_counter() - t0)
