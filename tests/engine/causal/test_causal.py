"""Causal chunk-by-chunk video: the KV cache against a no-cache reference, memory, sessions, bad input."""

from __future__ import annotations

import pytest
import torch

from fewstep.engine import InputError, load_dit, load_tiny_vae
from fewstep.engine.causal import CausalConfig, KVCache, SessionStore, VideoSession, WindowSpec
from fewstep.engine.causal.kv_cache import KVStorage
from fewstep.engine.causal.reference import recompute_video

H, W = 32, 48  # px: a 4x6 latent, 2x3 tokens per frame


@pytest.fixture(scope="module")
def wan():
    return load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=2)


def _ctx(seed=1, tokens=9):
    return torch.randn(1, tokens, 4096, generator=torch.Generator().manual_seed(seed))


def _video(model, config, chunks, seed=3, context=None):
    session = VideoSession(model, _ctx() if context is None else context, H, W, config, seed)
    return torch.cat([c.latents for c in session.run(chunks)], dim=2), session


@pytest.mark.parametrize(
    "config",
    [
        CausalConfig(chunk_frames=2, window_frames=8),  # the window covers the whole video
        CausalConfig(chunk_frames=2, window_frames=8, rope="absolute"),
        CausalConfig(chunk_frames=3, window_frames=12, steps=2),
        CausalConfig(chunk_frames=2, window_frames=5, sink_frames=1, rope="absolute"),  # sinks + eviction
        CausalConfig(chunk_frames=2, window_frames=6, sink_frames=2, rope="absolute"),
        CausalConfig(chunk_frames=2, window_frames=4),  # eviction without sinks: relative positions are exact
        CausalConfig(chunk_frames=1, window_frames=3, sink_frames=1, rope="absolute"),
        # cache-relative RoPE with sinks: the reference rotates every key anew per chunk at its cache position
        CausalConfig(chunk_frames=2, window_frames=5, sink_frames=1),
        CausalConfig(chunk_frames=2, window_frames=6, sink_frames=2),
        CausalConfig(chunk_frames=1, window_frames=3, sink_frames=1),
        CausalConfig(chunk_frames=3, window_frames=7, sink_frames=4, steps=2),  # sinks span two chunks
    ],
)
def test_cached_generation_equals_the_no_cache_reference(wan, config):
    chunks = 8 // config.chunk_frames if config.chunk_frames != 3 else 3
    cached, _ = _video(wan, config, chunks)
    reference = recompute_video(wan, _ctx(), H, W, chunks, config, seed=3)
    assert cached.shape == reference.shape
    assert (cached - reference).abs().max() <= 1e-4


def test_cache_positions_stay_bounded_with_sinks(wan):
    """Relative RoPE with sinks: identical to absolute positions until the first eviction, bounded afterwards."""
    rel = CausalConfig(chunk_frames=2, window_frames=5, sink_frames=1, rope="cache")
    ab = CausalConfig(chunk_frames=2, window_frames=5, sink_frames=1, rope="absolute")
    a, session = _video(wan, rel, 6)
    b, _ = _video(wan, ab, 6)
    assert torch.allclose(a[:, :, :4], b[:, :, :4], atol=1e-5)  # frames 0-3: nothing evicted yet
    assert not torch.allclose(a[:, :, 6:], b[:, :, 6:], atol=1e-3)  # the sink's distance is kept short
    cache = session.cache
    start = cache.frames_committed
    positions = [rel.window.cache_position(f, start) for f in range(start - 2, start + 2)]
    assert max(positions) < rel.window_frames


def _kv_pointers(cache: KVCache) -> list[int]:
    views = [cache.layer(i) for i in range(cache.layers)]
    return [t.data_ptr() for view in views for t in (view.keys, view.values)]


def test_kv_memory_is_preallocated_flat_and_accounted(wan):
    config = CausalConfig(chunk_frames=2, window_frames=6, sink_frames=2)
    session = VideoSession(wan, _ctx(), H, W, config, seed=0)
    pointers = _kv_pointers(session.cache)
    p, tokens = wan.params, 6  # 2x3 tokens per latent frame
    per_token = 2 * p.dim * p.num_layers * 4  # K and V, every layer, fp32, no GQA
    assert session.cache.bytes_per_token() == per_token
    used = []
    # rope="cache" with sinks: the window's K/V plus an unrotated copy of the sinks' keys (half a K/V token each)
    total = (config.window_frames * per_token + config.sink_frames * per_token // 2) * tokens
    for chunk in session.chunks(8):
        assert chunk.kv_bytes == session.cache.nbytes == total
        used.append(chunk.kv_bytes_used)
    # the sinks' copies are taken when the chunk after them begins
    assert used == [2 * tokens * per_token, 5 * tokens * per_token] + [7 * tokens * per_token] * 6
    assert pointers == _kv_pointers(session.cache)  # written in place


def test_continued_session_equals_one_long_generation(wan):
    config = CausalConfig(chunk_frames=2, window_frames=4, sink_frames=1)
    whole, _ = _video(wan, config, 5)
    session = VideoSession(wan, _ctx(), H, W, config, seed=3)
    parts = (
        [c.latents for c in session.run(2)]
        + [c.latents for c in session.run(1)]
        + [c.latents for c in session.run(2)]
    )
    assert torch.allclose(torch.cat(parts, dim=2), whole, atol=1e-6)


def test_prompt_switch_changes_only_what_follows(wan):
    config = CausalConfig(chunk_frames=2, window_frames=8)
    same, _ = _video(wan, config, 4)
    session = VideoSession(wan, _ctx(), H, W, config, seed=3)
    first = [c.latents for c in session.run(2)]
    session.set_prompt(_ctx(seed=99, tokens=5))
    after = [c.latents for c in session.run(2)]
    switched = torch.cat(first + after, dim=2)
    assert torch.allclose(switched[:, :, :4], same[:, :, :4], atol=1e-6)
    assert not torch.allclose(switched[:, :, 4:], same[:, :, 4:], atol=1e-3)


def test_bidirectional_single_chunk_equals_causal_chunk(wan):
    x = torch.randn(1, 16, 3, 4, 6, generator=torch.Generator().manual_seed(4))
    ctx = _ctx()
    t = torch.full((1, 3), 750.0)
    bidirectional = wan(x, t, ctx)
    cache = KVCache(
        wan.params.num_layers,
        1,
        6,
        wan.params.num_heads,
        wan.params.head_dim,
        KVStorage(WindowSpec(3, 6)),
        torch.float32,
        "cpu",
    )
    cache.begin(0, 3, (2, 3), wan.frame_rope)
    causal = wan(x, t, ctx, kv=cache)
    assert torch.allclose(bidirectional, causal, atol=1e-5)


def test_streamed_frames_equal_decoding_the_whole_video(wan):
    vae = load_tiny_vae("dummy:taew2_1", device="cpu", dtype=torch.float32)
    session = VideoSession(
        wan, _ctx(), H, W, CausalConfig(chunk_frames=2, window_frames=6), seed=0, tiny_vae=vae
    )
    results = session.run(3)
    streamed = torch.cat([r.frames for r in results], dim=1)
    raw = torch.cat([r.raw for r in results], dim=2)
    whole = vae.decode(vae.raw_to_latent(raw))
    assert streamed.shape == whole.shape == (1, 4 * 6 - 3, 3, H, W)
    assert (streamed - whole).abs().max() <= 1e-5
    assert session.stats.first_chunk_seconds == results[0].seconds > 0


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (
            dict(chunk_frames=3, window_frames=2),
            r"input 'window_frames': the window \(2 latent frames\) is smaller than a chunk \(3\)",
        ),
        (
            dict(chunk_frames=2, window_frames=4, sink_frames=4),
            r"input 'sink_frames': 4 sink frames do not fit a window of 4",
        ),
        (
            dict(chunk_frames=3, window_frames=4, sink_frames=2),
            r"input 'window_frames': the window \(4\) must hold the 2 sink frames and a chunk of 3",
        ),
    ],
)
def test_bad_windows(wan, kwargs, pattern):
    with pytest.raises(InputError, match=pattern):
        VideoSession(wan, _ctx(), H, W, CausalConfig(**kwargs), where="test")


def test_bad_sizes_conditioning_and_vae(wan):
    with pytest.raises(InputError, match=r"input 'height': 40 px is not a positive multiple of 16"):
        VideoSession(wan, _ctx(), 40, W)
    with pytest.raises(
        InputError, match=r"input 'context': conditioning is \[1, 9, 768\]; Wan expects umT5 tokens"
    ):
        VideoSession(wan, torch.zeros(1, 9, 768), H, W)
    with pytest.raises(InputError, match=r"input 'tiny_vae': taef1 decodes 16-channel image latents"):
        VideoSession(wan, _ctx(), H, W, tiny_vae=load_tiny_vae("dummy:taef1"))


def test_disposed_and_evicted_sessions(wan):
    store = SessionStore(max_sessions=2)
    keys = [
        store.add(VideoSession(wan, _ctx(), H, W, CausalConfig(chunk_frames=2, window_frames=4)))
        for _ in range(3)
    ]
    with pytest.raises(InputError, match=f"input 'session': {keys[0]} is no longer available: .*evicted"):
        store.get(keys[0], "FewStepCausalContinue")
    live = store.get(keys[1])
    store.dispose(keys[1])
    assert live.disposed
    with pytest.raises(InputError, match="disposed"):
        list(live.chunks(1))
    one_session_bytes = store.get(keys[2]).nbytes
    small = SessionStore(max_sessions=10, max_bytes=int(1.5 * one_session_bytes))
    a = small.add(VideoSession(wan, _ctx(), H, W, CausalConfig(chunk_frames=2, window_frames=4)))
    small.add(VideoSession(wan, _ctx(), H, W, CausalConfig(chunk_frames=2, window_frames=4)))
    assert len(small) == 1 and pytest.raises(InputError, small.get, a)
