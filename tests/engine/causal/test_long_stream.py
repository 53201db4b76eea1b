"""Long-run memory: a causal stream of 200 chunks keeps the process's resident memory flat once its window is full
(issue 15). The sizes are the smallest that still decode frames worth keeping: an accumulating session would
hold about 20 MiB more at the end than after the window filled."""

from __future__ import annotations

import pytest
import torch
from memory_probe import settled_rss_mib

from fewstep.engine import load_dit, load_tiny_vae
from fewstep.engine.causal import CausalConfig, VideoSession

CHUNKS = 200
MARGIN_MIB = 8  # allocator noise stays well below this; 180 chunks of kept frames are ~20 MiB


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
            settled = settled_rss_mib()
    grown = settled_rss_mib() - settled
    assert frames_seen == 4 * CHUNKS - 3
    assert session.stats.chunks_generated == CHUNKS
    assert grown < MARGIN_MIB, f"resident memory grew {grown:.1f} MiB over {CHUNKS - 21} chunks"
