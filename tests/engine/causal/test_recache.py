"""A prompt switch with a KV re-cache (``VideoSession.set_prompt(context, recache=True)``; LongLive's, compared with
LongLive's own pipeline in ``test_recache_longlive.py`` when its checkout is there): what it re-caches, what it
keeps, and references that need no outside code.

* which frames: every frame held while the stream is within the window, then the ring's frames (the sinks kept);
  before any chunk nothing (a report of 0 frames);
* the clean latents a session keeps for it are the chunks' (and a prefill's) latents of the window's frames;
* a re-cache over one chunk is that chunk's prefill under the new prompt (the same forward: one chunk, bidirectional
  within itself, at the clean-context timestep), so continuing after it equals a session started from that chunk;
* under ``rope="cache"`` with sinks after eviction, the re-cached K/V equal an explicit computation: the sinks'
  K/V from their own forward under the old prompt, then one forward over the ring's frames at their cache
  positions (right after the sinks) attending to the sinks and to each other;
* int8 / int4 KV: equal to bf16 until a frame ages out into the quantized ring; a re-cache of frames held there
  rewrites their quantized slots (quantized again).
"""

from __future__ import annotations

import pytest
import torch

from fewstep.engine import load_dit
from fewstep.engine.backends import DEFAULT_BACKENDS
from fewstep.engine.causal import CausalConfig, VideoSession
from fewstep.engine.rope import RopeFreqs

H, W = 32, 48  # px: a 4x6 latent, 2x3 tokens per frame
CHUNK = 3


@pytest.fixture(scope="module")
def wan():
    return load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=2)


def _ctx(seed: int) -> torch.Tensor:
    return torch.randn(1, 9, 4096, generator=torch.Generator().manual_seed(seed))


def _session(wan, window, sinks=0, rope="absolute", context_seed=1, **config) -> VideoSession:
    return VideoSession(
        wan, _ctx(context_seed), H, W, CausalConfig(CHUNK, window, sinks, rope=rope, **config), 3
    )


def _latents(chunks) -> torch.Tensor:
    return torch.cat([c.latents for c in chunks], dim=2)


def test_recache_before_any_chunk_reports_nothing_and_changes_nothing(wan):
    switched = _session(wan, 9, 3)
    report = switched.set_prompt(_ctx(2), recache=True)
    assert (report.frames, report.start_frame) == (0, 0)
    queued = _session(wan, 9, 3)
    queued.control("prompt", _ctx(2), recache=True)
    first = next(queued.chunks(1))
    assert (first.recache.frames, first.recache.start_frame) == (0, 0)
    assert [(c.kind, c.chunk, c.recache) for c in first.controls] == [("prompt", 0, True)]
    want = _latents(_session(wan, 9, 3, context_seed=2).chunks(2))
    assert torch.equal(_latents(switched.chunks(2)), want)
    assert torch.equal(torch.cat([first.latents, _latents(queued.chunks(1))], dim=2), want)


@pytest.mark.parametrize("window, sinks", [(6, 0), (9, 3)])
def test_recache_frames_are_the_window_then_the_ring(wan, window, sinks):
    """A re-cache at every chunk boundary: min(frames, window) frames from 0 while the stream is within the
    window, then the ring's ``window - sinks`` newest frames; the pending chunk is committed first."""
    session = _session(wan, window, sinks)
    for k in range(1, 6):
        next(session.chunks(1))
        frames = k * CHUNK
        report = session.set_prompt(_ctx(1 + k % 2), recache=True)
        assert session.cache.frames_committed == frames
        if frames <= window:
            assert (report.start_frame, report.frames) == (0, frames)
        else:
            assert (report.start_frame, report.frames) == (frames - (window - sinks), window - sinks)
        assert report.seconds > 0


def test_clean_latents_are_the_window_frames(wan):
    session = _session(wan, 9, 3)
    start = torch.randn(1, 16, 4, 4, 6, generator=torch.Generator().manual_seed(5))  # a lone frame + a block
    session.prefill(start)
    assert torch.equal(session.clean.read(range(0, 4)), start)
    video = torch.cat([start, _latents(session.chunks(4))], dim=2)  # frames 0..15, the last chunk pending
    assert torch.equal(session.clean.read(range(7, 16)), video[:, :, 7:16])
    with pytest.raises(ValueError, match=r"frames \[6\] are no longer kept"):
        session.clean.read(range(6, 8))


@pytest.mark.parametrize("window, sinks, rope", [(6, 0, "absolute"), (9, 3, "absolute"), (9, 3, "cache")])
def test_recache_over_one_chunk_equals_a_prefill_of_it(wan, window, sinks, rope):
    """After one chunk a re-cache recomputes exactly that chunk (bidirectional within itself, at the clean-context
    timestep): a prefill of its latents under the new prompt. Continuing both gives the same video (under
    ``rope="cache"`` the re-cached sinks' unrotated copies are taken again)."""
    switched = _session(wan, window, sinks, rope)
    first = next(switched.chunks(1)).latents
    noise_state = switched.generator.get_state()
    assert switched.set_prompt(_ctx(2), recache=True).frames == CHUNK
    started = _session(wan, window, sinks, rope, context_seed=2)
    started.prefill(first)
    started.generator.set_state(noise_state)
    got, want = _latents(switched.chunks(3)), _latents(started.chunks(3))
    assert (got - want).abs().max().item() <= 1e-5  # an eager re-cache forward against the chunk step


def _unrotated(keys: torch.Tensor, positions: list[int], wan, grid_hw) -> torch.Tensor:
    """``keys [B, F*T, H, D]`` rotated at frame ``positions``, rotated back."""
    freqs = wan.frame_rope(torch.tensor(positions), grid_hw)
    return DEFAULT_BACKENDS.apply_rope(keys, RopeFreqs(freqs.cos, -freqs.sin))


class _ExplicitKV:
    """A ``kv`` for one plain forward over frames at ``positions``: each layer attends to ``prefix[i]`` (rotated
    keys and values of earlier frames) and to the forward's own keys, which it records in ``kv``."""

    def __init__(self, wan, positions, grid_hw, prefix=None):
        self.freqs = wan.frame_rope(torch.tensor(positions), grid_hw)
        self.prefix, self.kv = prefix, []

    def query_rope(self):
        return self.freqs

    def layer(self, index):
        self.index = index
        return self

    def attend(self, q, k, v, backends):
        k = backends.apply_rope(k, self.freqs)
        self.kv.append((k, v))
        if self.prefix is not None:
            sink_k, sink_v = self.prefix[self.index]
            k, v = torch.cat((sink_k, k), dim=1), torch.cat((sink_v, v), dim=1)
        return backends.attention(q, k, v)


def test_recache_under_cache_rope_with_sinks_equals_explicit_forward(wan):
    window, sinks = 9, 3
    session = _session(wan, window, sinks, rope="cache")
    video = _latents(session.chunks(5))  # frames 0..14: frames 3..8 evicted, the ring holds 9..14
    report = session.set_prompt(_ctx(2), recache=True)
    ring = range(report.start_frame, report.start_frame + report.frames)
    assert ring == range(9, 15)
    grid_hw, t = session.grid_hw, session.cache.tokens_per_frame

    def forward(frames, positions, context, prefix=None):
        kv = _ExplicitKV(wan, positions, grid_hw, prefix)
        x = video[:, :, frames.start : frames.stop]
        timestep = torch.zeros(1, len(frames))
        wan(x, timestep, context_embedded=wan.embed_context(context), kv=kv)
        return kv.kv

    sink_kv = forward(range(0, sinks), list(range(sinks)), _ctx(1))  # as committed, under the old prompt
    ring_kv = forward(ring, list(range(sinks, window)), _ctx(2), prefix=sink_kv)  # at cache positions
    held = {frame: slot for frame, kind, slot in session.cache.slots.held()}
    rows = torch.cat([torch.arange(held[f] * t, (held[f] + 1) * t) for f in ring])
    for i, ((sink_k, sink_v), (want_k, want_v)) in enumerate(zip(sink_kv, ring_kv)):
        keys, values = session.cache._layer_kv(i)
        stored_k = _unrotated(keys[:, rows], list(ring), wan, grid_hw)  # ring keys: at their absolute index
        assert (stored_k - _unrotated(want_k, list(range(sinks, window)), wan, grid_hw)).abs().max() <= 1e-5
        assert (values[:, rows] - want_v).abs().max() <= 1e-5
        stored_sinks = getattr(session.cache, f"sink_k{i}")  # the sinks' unrotated copies: kept
        assert (stored_sinks - _unrotated(sink_k, list(range(sinks)), wan, grid_hw)).abs().max() <= 1e-5
        assert (values[:, : sinks * t] - sink_v).abs().max() <= 1e-5


def _frame_kv(session, layer: int, frame: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V a session's cache holds for ``frame`` in ``layer`` (dequantized from the quantized ring)."""
    cache, t = session.cache, session.cache.tokens_per_frame
    kind, slot = {f: (k, s) for f, k, s in cache.slots.held()}[frame]
    rows = slice(slot * t, (slot + 1) * t)
    if kind == "full":
        return tuple(x[:, rows].clone() for x in cache._layer_kv(layer))
    return tuple(
        DEFAULT_BACKENDS.dequantize_kv(*(p[:, rows] for p in q.parts()), cache.storage.bits, torch.float32)
        for q in cache._layer_quant(layer)
    )


# relative to the largest value: the quantization error of a frame's K/V (measured ~0.004 int8, ~0.06 int4), less
# than what the switch changes in the last layer's (~0.03 int8, ~0.11 int4: the first layer's K/V see no prompt)
@pytest.mark.parametrize("kv_dtype, error", [("int8", 0.01), ("int4", 0.08)])
def test_recache_with_quantized_kv(wan, kv_dtype, error):
    """Window 12 with 3 sinks: 6 full-precision ring frames and 3 quantized. A re-cache at frame 6 (no frame
    quantized yet) and the chunk after it equal bf16; the chunk at 9 quantizes frames 3..5. A re-cache at 15
    (frames 6..8 in the quantized ring) rewrites their quantized slots: what they hold then is the bf16 session's
    re-cached K/V within the quantization error, and no longer what they held before."""
    bf16, quant = _session(wan, 12, 3), _session(wan, 12, 3, kv_dtype=kv_dtype)
    videos = {}
    for name, session in (("bf16", bf16), ("quant", quant)):
        out = list(session.chunks(2))
        session.set_prompt(_ctx(2), recache=True)
        out += list(session.chunks(1))
        videos[name] = _latents(out)
    assert quant.cache.frames_quantized == 0
    assert (videos["quant"] - videos["bf16"]).abs().max().item() <= 1e-6
    for session in (bf16, quant):
        list(session.chunks(2))  # frames 9..14: frames 3..5, then 6..8 age out into the quantized ring
    assert quant.cache.frames_quantized == 6
    last = wan.params.num_layers - 1
    before = _frame_kv(quant, last, 6)
    reports = [s.set_prompt(_ctx(1), recache=True) for s in (bf16, quant)]
    assert [(r.start_frame, r.frames) for r in reports] == [(6, 9)] * 2
    for frame in range(6, 9):
        for layer in range(wan.params.num_layers):
            for got, want in zip(_frame_kv(quant, layer, frame), _frame_kv(bf16, layer, frame)):
                assert (got - want).abs().max().item() <= error * want.abs().max().item()
    after = _frame_kv(quant, last, 6)
    assert all((a - b).abs().max().item() > error * b.abs().max().item() for a, b in zip(after, before))
    got, want = _latents(quant.chunks(2)), _latents(bf16.chunks(2))
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() <= error * want.abs().max().item()
