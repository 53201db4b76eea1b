"""Long-run memory: a causal stream of 200 chunks keeps the process's resident memory flat once its window is full
(issue 15). The sizes are the smallest that still decode frames worth keeping: an accumulating session would
hold about 20 MiB more at the end than after the window filled."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os

import pytest
import torch

from fewstep.engine import load_dit, load_tiny_vae
from fewstep.engine.causal import CausalConfig, VideoSession

CHUNKS = 200
MARGIN_MIB = 8  # allocator noise stays well below this; 180 chunks of kept frames are ~20 MiB


def _rss_mib() -> float:
    """Resident memory after handing freed heap memory back to the OS: live memory, whatever earlier tests in this
    process freed (glibc keeps freed pages otherwise, and would hide growth by reusing them)."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.slow
def test_a_200_chunk_stream_keeps_rss_flat_after_the_window_fills():
    model = load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=2)
    vae = load_tiny_vae("dummy:taew2_1", device="cpu", dtype=torch.float32)
    context = torch.randn(1, 4, 4096, generator=torch.Generator().manual_seed(1))
    config = CausalConfig(chunk_frames=1, window_frames=2, steps=1)
    session = VideoSession(model, context, 48, 48, config, seed=0, tiny_vae=vae)
    frames_seen = 0
    for i, chunk in enumerate(session.chunks(CHUNKS)):
        frames_seen += chunk.frames.shape[1]  # the consumer looks at each chunk, then drops it
        if i == 20:  # the window has long been full, every buffer allocated
            settled = _rss_mib()
    grown = _rss_mib() - settled
    assert frames_seen == 4 * CHUNKS - 3
    assert session.stats.chunks_generated == CHUNKS
    assert grown < MARGIN_MIB, f"resident memory grew {grown:.1f} MiB over {CHUNKS - 21} chunks"
