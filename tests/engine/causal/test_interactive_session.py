"""Interactive sessions (issue 32) composed with what exists: the control channel, compile / CUDA-graph capture,
LoRA, a sharded run, memory, and bad input of a prefill, a fed input video and the controls.

The reference comparisons (Self-Forcing's prefill, LongLive's re-cache, StreamDiffusionV2's video to video) live
in their own opt-in tests; here every check is against another session of this engine: a control equals the
same change made directly, a compiled / LoRA / sharded session equals the plain one.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch
from compile_doubles import EMULATED
from memory_probe import settled_rss_mib

from fewstep.engine import InputError, load_dit, open_model
from fewstep.engine.causal import CausalConfig, VideoSession
from fewstep.engine.causal.controls import AppliedControl
from fewstep.engine.causal.recipe import open_session
from fewstep.engine.causal.session import check_session_fits, session_bytes
from fewstep.engine.causal.video_to_video import MAX_QUEUED_CHUNKS
from fewstep.engine.compile import attach_compile

H, W = 32, 48  # px: a 4x6 latent, 2x3 tokens per frame
LATENT_HW = (H // 8, W // 8)
CONFIG = CausalConfig(chunk_frames=2, window_frames=6, sink_frames=1, steps=2)


class StopError(Exception):
    """What a host's Cancel raises from ``before_forward`` (here: the test's own)."""


@pytest.fixture(scope="module")
def wan():
    return load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=2)


def _ctx(seed=1, tokens=9):
    return torch.randn(1, tokens, 4096, generator=torch.Generator().manual_seed(seed))


def _latents(frames, seed=7, channels=16, batch=1, hw=LATENT_HW):
    return torch.randn(batch, channels, frames, *hw, generator=torch.Generator().manual_seed(seed))


def _session(model, config=CONFIG, seed=3, context=None, **kwargs):
    return VideoSession(model, _ctx() if context is None else context, H, W, config, seed, **kwargs)


def _video(chunks) -> torch.Tensor:
    return torch.cat([c.latents for c in chunks], dim=2)


# -- 1. controls -----------------------------------------------------------------------------------------------------
def test_a_newer_prompt_replaces_a_queued_older_one_which_is_never_applied(wan):
    stale, newer = _ctx(5), _ctx(6)
    session = _session(wan)
    first = session.run(1)[0]
    session.control("prompt", stale, recache=True)
    sequence = session.control("prompt", newer)
    (chunk,) = session.run(1)
    assert chunk.controls == (AppliedControl("prompt", sequence, 1, False, 1, ""),)
    assert chunk.recache is None  # the stale prompt's re-cache was never run
    expected = _session(wan)
    assert torch.equal(expected.run(1)[0].latents, first.latents)
    expected.set_prompt(newer)
    assert torch.equal(expected.run(1)[0].latents, chunk.latents)
    assert list(session.controls.applied) == [chunk.controls[0]] and session.controls.pending() == []


def test_each_applied_control_reports_the_chunk_it_took_effect_at(wan):
    session = _session(wan)
    session.run(2)
    prompt = session.control("prompt", _ctx(5), recache=True)
    seed = session.control("seed", 11)
    (third,) = session.run(1)
    (fourth,) = session.run(1)
    assert [(c.kind, c.sequence, c.chunk, c.recache) for c in third.controls] == [
        ("prompt", prompt, 2, True), ("seed", seed, 2, False)
    ]  # fmt: skip
    assert third.index == 2 and fourth.controls == () and fourth.recache is None
    # a re-cache at chunk 2: the window's 4 committed frames (the pending chunk committed first)
    assert third.recache.frames == 4 and third.recache.start_frame == 0
    assert (
        third.controls[0].detail.startswith("re-cached 4 frames in ")
        and third.controls[1].detail == "seed 11"
    )
    assert [c.chunk for c in session.controls.applied] == [2, 2]


def test_a_control_put_from_another_thread_mid_chunk_takes_effect_at_the_next_boundary(wan):
    """The control arrives while chunk 1 is denoising (between its two steps): chunk 1 is exactly the chunk of a
    session without it, and the prompt takes effect at chunk 2, as a switch made between chunks 1 and 2."""
    other = _ctx(5)
    session = _session(wan)
    sent = []

    def send_mid_chunk(chunk, step):
        if (chunk, step) == (1, 1) and not sent:
            # a request thread of a live server
            thread = threading.Thread(
                target=lambda: sent.append(session.control("prompt", other, recache=True))
            )
            thread.start()
            thread.join()

    got = list(session.chunks(3, before_forward=send_mid_chunk))
    expected = _session(wan)
    want = expected.run(2)
    expected.set_prompt(other, recache=True)
    want += expected.run(1)
    assert len(sent) == 1 and torch.equal(_video(got), _video(want))
    assert got[1].controls == () and [(c.sequence, c.chunk) for c in got[2].controls] == [(sent[0], 2)]
    assert got[2].recache.frames == 4


def test_a_seed_control_draws_a_fresh_sessions_noise_from_its_chunk_on(wan):
    """Defined as: the noise drawn from the chunk a ``seed s`` control takes effect at on (the start noise and the
    DMD re-noise of every step) is, draw for draw, the noise a fresh session of seed ``s`` draws from its chunk 0
    (the generator is reseeded at the boundary). The video differs: the KV cache holds the earlier chunks."""
    config = CausalConfig(chunk_frames=2, window_frames=6, steps=2)

    def recording(session):
        draws = []
        noise = session._noise
        session._noise = lambda shape: draws.append(noise(shape)) or draws[-1]
        return draws

    session = _session(wan, config)
    session.run(2)
    draws = recording(session)
    session.control("seed", 11)
    (chunk,) = session.run(2)[:1]
    fresh = _session(wan, config, seed=11)
    fresh_draws = recording(fresh)
    fresh.run(2)
    assert len(draws) == len(fresh_draws) == 2 * 2  # per chunk: the start noise and one re-noise
    assert all(torch.equal(a, b) for a, b in zip(draws, fresh_draws))
    assert session.seed == 11 and chunk.controls[0].detail == "seed 11"
    # and the same as reseeding directly between chunks
    direct = _session(wan, config)
    direct.run(2)
    direct.generator.manual_seed(11)
    assert torch.equal(direct.run(1)[0].latents, chunk.latents)


def test_a_strength_control_toggles_video_to_video(wan):
    inputs = _latents(4)
    session = _session(wan)
    session.feed(inputs)
    session.control("strength", 0.5)
    a, b = session.run(2)
    session.control("strength", None)
    (c,) = session.run(1)
    assert (a.mode, a.strength, b.mode, c.mode, c.strength) == ("v2v", 0.5, "v2v", "t2v", None)
    assert [x.detail for x in a.controls + c.controls] == ["strength 0.5", "text to video"]
    direct = _session(wan)
    direct.feed(inputs)
    direct.set_strength(0.5)
    want = direct.run(2)
    direct.set_strength(None)
    want += direct.run(1)
    assert torch.equal(_video([a, b, c]), _video(want))


@pytest.mark.parametrize(
    "kind, value, name, problem",
    [
        ("volume", 3, "control", r"unknown control 'volume'; expected prompt, strength or seed"),
        ("strength", float("nan"), "strength", r"expected a finite number"),
        ("strength", 0.0, "strength", r"0.0 is not in \(0, 1\]"),
        ("strength", 1.5, "strength", r"1.5 is not in \(0, 1\]"),
        ("seed", -1, "seed", r"expected an integer in \[0, 2\^64 - 1\], got -1"),
        ("seed", 2.5, "seed", r"expected an integer in \[0, 2\^64 - 1\], got 2.5"),
        ("prompt", torch.zeros(1, 4, 768), "context", r"conditioning is \[1, 4, 768\]; Wan expects umT5"),
    ],
)
def test_invalid_controls_are_refused_naming_the_input(wan, kind, value, name, problem):
    session = _session(wan, where="FewStepCausalContinue")
    with pytest.raises(InputError, match=rf"^FewStepCausalContinue: input '{name}': .*{problem}"):
        session.control(kind, value)
    assert session.controls.pending() == []  # nothing queued


def test_controls_applied_before_an_interrupted_chunk_stay_applied_and_are_reported_next(wan):
    other = _ctx(5)
    session = _session(wan)
    session.run(1)
    sequence = session.control("prompt", other, recache=True)

    def stop_at_first_step(chunk, step):
        if step == 0:
            raise StopError

    with pytest.raises(StopError):
        list(session.chunks(1, before_forward=stop_at_first_step))
    assert session.controls.pending() == [] and session.frames_generated == 2
    (chunk,) = session.run(1)
    assert [(c.sequence, c.chunk) for c in chunk.controls] == [(sequence, 1)]
    assert chunk.recache is not None and chunk.recache.frames == 2
    expected = _session(wan)
    expected.run(1)
    expected.set_prompt(other, recache=True)
    assert torch.equal(expected.run(1)[0].latents, chunk.latents)


@pytest.mark.parametrize("stop_at", ["commit", "recache"])
def test_an_interruption_while_controls_apply_requeues_them_and_the_video_is_unchanged(wan, stop_at):
    """A prompt switch with re-cache runs two forwards at the boundary (the pending chunk's commit, the re-cache):
    a Cancel before either requeues that control and the ones after it (the seed); the next chunk applies them,
    and the video equals an uninterrupted one."""
    other = _ctx(5)
    session = _session(wan)
    session.run(1)
    prompt = session.control("prompt", other, recache=True)
    seed = session.control("seed", 11)
    calls = []

    def stop(chunk, step):
        calls.append(step)
        if step is None and len(calls) == (1 if stop_at == "commit" else 2):
            raise StopError

    with pytest.raises(StopError):
        list(session.chunks(1, before_forward=stop))
    assert [(c.kind, c.sequence) for c in session.controls.pending()] == [("prompt", prompt), ("seed", seed)]
    (chunk,) = session.run(1)
    assert [(c.kind, c.sequence, c.chunk, c.replaced) for c in chunk.controls] == [
        ("prompt", prompt, 1, 0), ("seed", seed, 1, 0)
    ]  # fmt: skip
    expected = _session(wan)
    expected.run(1)
    expected.set_prompt(other, recache=True)
    expected.generator.manual_seed(11)
    assert torch.equal(expected.run(1)[0].latents, chunk.latents)


def test_a_newer_control_sent_during_an_interrupted_boundary_wins_and_counts_the_stale_one(wan):
    session = _session(wan)
    session.run(1)
    session.control("seed", 11)
    session.control("prompt", _ctx(5), recache=True)
    newer = []

    def stop_at_recache(chunk, step):  # the re-cache's forward: a newer seed arrives, then Cancel
        if step is None and not newer:
            newer.append(session.control("seed", 12))
        elif step is None:
            raise StopError

    with pytest.raises(StopError):
        list(session.chunks(1, before_forward=stop_at_recache))
    # the prompt was interrupted (requeued); the stale seed 11 (applied after the prompt) was never applied
    assert [(c.kind, c.value if c.kind == "seed" else None) for c in session.controls.pending()] == [
        ("prompt", None), ("seed", 12)
    ]  # fmt: skip
    (chunk,) = session.run(1)
    seeds = [c for c in chunk.controls if c.kind == "seed"]
    assert [(c.sequence, c.replaced) for c in seeds] == [(newer[0], 1)] and session.seed == 12


# -- 5. bad inputs ---------------------------------------------------------------------------------------------------
NODE = "FewStepCausalVideoSampler"


@pytest.mark.parametrize(
    "latents, problem",
    [
        (_latents(2, channels=8), r"8 latent channels; this Wan model takes 16 \(Wan 2.1 VAE latents\)"),
        (
            _latents(2, hw=(4, 4)),
            r"latents of batch 1 and 4x4 latent pixels; this session is batch 1 at 4x6 ",
        ),
        (_latents(2, batch=2), r"latents of batch 2 and 4x6 latent pixels; this session is batch 1 at 4x6 "),
        (torch.zeros(1, 16, 1, 1, 4, 6), r"latents \[1, 16, 1, 1, 4, 6\]; expected \[batch, 16, frames"),
        (torch.full((1, 16, 1, 4, 6), float("nan")), r"latents must be finite floating-point values"),
        (torch.ones(1, 16, 1, 4, 6, dtype=torch.int64), r"latents must be finite floating-point values"),
        ([[0.0]], r"latents list; expected \[batch, 16, frames, 4, 6\]"),
        (_latents(0), r"the start latent holds no frames"),
    ],
    ids=["channels", "size", "batch", "ndim", "nan", "integer", "not-a-tensor", "no-frames"],
)
def test_a_bad_start_latent_is_refused_naming_the_node_and_input(wan, latents, problem):
    session = _session(wan, where=NODE)
    with pytest.raises(InputError, match=rf"^{NODE}: input 'start_latent': {problem}"):
        session.prefill(latents)
    assert session.frames_generated == 0 and session.cache.frames_committed == 0
    assert torch.equal(session.run(1)[0].latents, _session(wan).run(1)[0].latents)  # still usable, unchanged


def test_a_start_latent_that_does_not_split_into_chunks_is_refused():
    model = load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=2)
    session = _session(model, CausalConfig(chunk_frames=3, window_frames=9), where=NODE)
    with pytest.raises(
        InputError,
        match=rf"^{NODE}: input 'start_latent': 2 latent frames do not split into the session's chunks of 3: "
        r"a start takes a whole number of chunks \(3, 6, \.\.\. frames: video extension\) or one frame more "
        r"\(1, 4, 7, \.\.\.: an image",
    ):
        session.prefill(_latents(2))
    assert session.prefill(_latents(4)).blocks == (1, 3)  # then a good one is taken


def test_a_start_latent_after_chunks_is_refused(wan):
    session = _session(wan, where=NODE)
    session.run(1)
    with pytest.raises(
        InputError,
        match=rf"^{NODE}: input 'start_latent': the session has generated 2 frames already; a start latent is "
        r"only taken before the first chunk \(start a new session\)",
    ):
        session.prefill(_latents(2))
    prefilled = _session(wan)
    prefilled.prefill(_latents(2))
    with pytest.raises(InputError, match=r"input 'start_latent': the session has generated 2 frames already"):
        prefilled.prefill(_latents(2))  # a second prefill is a prefill after frames too


@pytest.mark.parametrize(
    "latents, problem",
    [
        (
            _latents(2, channels=4),
            r"input latents are \[1, 4, 2, 4, 6\]; this session takes \[1, 16, frames, 4, 6\]",
        ),
        (
            _latents(2, hw=(6, 4)),
            r"input latents are \[1, 16, 2, 6, 4\]; this session takes \[1, 16, frames, 4, 6\]",
        ),
        (_latents(2)[:, :, 0], r"input latents are \[1, 16, 4, 6\]; this session takes"),
        ("video.mp4", r"input latents are str; this session takes"),
        (torch.full((1, 16, 2, 4, 6), float("inf")), r"input latents must be finite floating-point values"),
    ],
    ids=["channels", "size", "ndim", "not-a-tensor", "inf"],
)
def test_bad_input_video_latents_are_refused_whole(wan, latents, problem):
    session = _session(wan, where=NODE)
    with pytest.raises(InputError, match=rf"^{NODE}: input 'input_video': {problem}"):
        session.feed(latents)
    assert len(session.inputs) == 0


def test_a_video_to_video_chunk_without_its_input_is_refused_and_the_session_goes_on(wan):
    inputs = _latents(4)
    session = _session(wan, where=NODE)
    session.set_strength(0.6)
    session.feed(inputs[:, :, :1])
    with pytest.raises(
        InputError,
        match=rf"^{NODE}: input 'input_video': chunk 0 restyles an input chunk \(video to video at strength 0.6\) "
        r"but 1 of its 2 input latent frames are queued; feed the input first",
    ):
        session.run(1)
    assert session.frames_generated == 0 and len(session.inputs) == 1
    session.feed(inputs[:, :, 1:])
    got = session.run(2)
    fed = _session(wan)
    fed.set_strength(0.6)
    fed.feed(inputs)
    assert [c.mode for c in got] == ["v2v", "v2v"] and torch.equal(_video(got), _video(fed.run(2)))


# -- 4. memory -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config",
    [CONFIG, CausalConfig(chunk_frames=3, window_frames=8, sink_frames=2, kv_dtype="int8", steps=2)],
    ids=["bf16", "int8-sinks"],
)
def test_the_session_estimate_counts_the_clean_latents_exactly(wan, config):
    session = _session(wan, config)
    p = wan.params
    parts = session_bytes(p, 1, H, W, config, session.dtype, 6, p.num_heads)
    assert parts["clean latents"] == session.clean.nbytes == 4 * 16 * config.window_frames * 4 * 6
    assert parts["KV window"] == session.cache.nbytes
    before = session.clean.nbytes
    session.prefill(_latents(config.chunk_frames))
    session.run(4)  # past the window: a ring, never more
    assert session.clean.nbytes == before


def test_the_input_video_queue_is_bounded_and_refuses_over_capacity_whole(wan):
    session = _session(wan, where=NODE)
    capacity = MAX_QUEUED_CHUNKS * CONFIG.chunk_frames
    assert session.feed(_latents(capacity - 1)) == capacity - 1
    with pytest.raises(
        InputError,
        match=rf"^{NODE}: input 'input_video': 2 more input frames do not fit: {capacity - 1} of {capacity} are "
        rf"queued \({MAX_QUEUED_CHUNKS} chunks ahead of the generation\); send them after the next chunks",
    ):
        session.feed(_latents(2))
    assert len(session.inputs) == capacity - 1  # nothing of the refused input was queued
    held = session.inputs.nbytes
    assert held == (capacity - 1) * 16 * 4 * 6 * 4 and session.nbytes >= held  # counted with the session
    session.feed(_latents(1))
    session.set_strength(0.5)
    session.run(1)
    assert len(session.inputs) == capacity - CONFIG.chunk_frames  # a chunk takes its frames
    assert session.feed(_latents(2)) == 2


def test_a_session_whose_clean_latents_and_kv_do_not_fit_is_refused_before_allocating(wan, monkeypatch):
    """A budget that holds everything but the clean latents: refused, with the clean latents listed."""
    import fewstep.engine.preflight.budget as budget

    p = wan.params
    config = CausalConfig(chunk_frames=2, window_frames=200, steps=2)  # the KV window is the largest part
    parts = session_bytes(p, 1, H, W, config, torch.float32, 6, p.num_heads)
    total = sum(parts.values())

    def small(usable):
        return lambda device=None: types.SimpleNamespace(
            usable=usable, device=torch.device("cpu"), holdings=()
        )

    monkeypatch.setattr(budget, "memory_budget", small(total - parts["clean latents"]))
    with pytest.raises(
        InputError,
        match=rf"^{NODE}: input 'window_frames': this needs about .* \(KV window .*, clean latents .*\) but only "
        r".* of available host memory can be used on cpu; refused before allocating",
    ):
        _session(wan, config, where=NODE)
    with pytest.raises(InputError, match=r"clean latents"):
        check_session_fits(parts, "cpu")
    monkeypatch.setattr(budget, "memory_budget", small(total))
    assert check_session_fits(parts, "cpu") == total
    _session(wan, config)  # fits exactly


def test_a_long_stream_with_recache_switches_and_input_video_keeps_rss_flat():
    """50 chunks of one frame (window 2): every chunk restyles a fed input frame and switches the prompt with a
    re-cache, every 3rd reseeds; resident memory settles once the window is full. An input queue,
    a control log or a re-cache that kept its tensors would grow by far more than the margin."""
    model = load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=2)
    config = CausalConfig(chunk_frames=1, window_frames=2, sink_frames=1, steps=1)
    prompts = [_ctx(seed, tokens=4) for seed in range(3)]
    session = VideoSession(model, prompts[0], 32, 32, config, seed=0)
    session.set_strength(0.7)
    frame = torch.randn(1, 16, 1, 4, 4, generator=torch.Generator().manual_seed(3))
    recaches = 0
    for i in range(50):
        session.feed(frame)
        session.control("prompt", prompts[i % 3], recache=True)
        if i % 3 == 2:
            session.control("seed", i)
        (chunk,) = session.run(1)
        recaches += chunk.recache is not None
        if i == 15:  # the window full, every buffer allocated
            settled = settled_rss_mib()
    grown = settled_rss_mib() - settled
    assert recaches == 50 and session.stats.chunks_generated == 50 and len(session.inputs) == 0
    assert len(session.controls.applied) == session.controls.applied.maxlen  # a bounded log
    assert grown < 8, f"resident memory grew {grown:.1f} MiB over 34 chunks"


# -- 2. compile / CUDA-graph capture ---------------------------------------------------------------------------------
def _interactive_stream(handle, interactive=True, config=CONFIG):
    """Through ``open_session`` (the run composes the handle's compile feature): a prefill of a lone first frame
    and a whole chunk, 3 chunks, a prompt switch with re-cache, 2 chunks, a queued re-cache switch, 1 chunk; not
    ``interactive``: the same chunks and switches without the prefill and the re-caches; then 2 chunks of video
    to video. Returns (latents of
    every chunk, the compile run's telemetry or None)."""
    session, run = open_session(handle, _ctx(), H, W, config, 3)
    if interactive:
        session.prefill(_latents(3))
    chunks = session.run(3)
    session.set_prompt(_ctx(5), recache=interactive)
    chunks += session.run(2)
    session.control("prompt", _ctx(6), recache=interactive)
    chunks += session.run(1)
    assert (chunks[-1].recache is not None) == interactive
    session.feed(_latents(4, seed=8))  # then video to video, in both
    session.control("strength", 0.6)
    chunks += session.run(2)
    assert [c.mode for c in chunks[-3:]] == ["t2v", "v2v", "v2v"]
    return [c.latents for c in chunks], None if run is None else run.finish()


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4"])
def test_a_prefill_and_recaches_replay_the_captured_step_without_a_new_capture(kv_dtype):
    """CUDA graphs (emulated on the CPU, tests/compile_doubles.py): the whole-chunk prefill block and every chunk
    replay the step captured for their key; the lone first frame and the re-caches run eagerly on the plain
    model, so they add no key (nor does video to video, its own sigmas in the same step): the same warm-ups and
    captures as the stream without them (2: the filling and the full window; a new prompt is copied into the
    cross-attention cache's tensors, whose addresses the key holds, so a switch replays the same graphs), no miss,
    one replay more (the prefill's chunk block), and the video equals the eager session's bit for bit."""
    handle = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32, seed=2)
    config = CausalConfig(chunk_frames=2, window_frames=6, sink_frames=1, steps=2, kv_dtype=kv_dtype)
    eager, _ = _interactive_stream(handle, config=config)
    graphed = attach_compile(handle, "off", "whole", graph_segments=EMULATED)
    got, telemetry = _interactive_stream(graphed, config=config)
    assert all(torch.equal(a, b) for a, b in zip(got, eager))
    g = telemetry.graphs
    graphed = attach_compile(handle, "off", "whole", graph_segments=EMULATED)
    _, plain = _interactive_stream(graphed, False, config)
    p = plain.graphs
    assert (g.warmups, g.captures, g.misses) == (p.warmups, p.captures, p.misses) == (2, 2, 0)
    assert g.hits == p.hits + 1 and not g.refused and not p.refused


@pytest.mark.slow
def test_a_prefill_and_recaches_do_not_recompile_the_compiled_step():
    """torch.compile of the whole step (static shapes): the interactive stream compiles the masked step and the
    unmasked one once each, as a plain stream does, with no recompile (a lone frame or a re-cache through the
    compiled step would be a new shape), and equals eager."""
    torch._dynamo.reset()
    handle = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32, seed=2)
    eager, _ = _interactive_stream(handle)
    got, telemetry = _interactive_stream(attach_compile(handle, "full", backend="eager", dynamic=False))
    assert max((a - b).abs().max().item() for a, b in zip(got, eager)) <= 1e-4
    assert [(f.name, f.recompile_reason) for f in telemetry.frames] == [
        ("causal_step_filling", None), ("causal_step_full", None)
    ]  # fmt: skip
    assert telemetry.graph_breaks == {}


# -- 3. LoRA and a sharded run ---------------------------------------------------------------------------------------
def _every_interactive_part(session, between=lambda: None):
    """A prefill (lone frame and a chunk), a re-cache switch, a queued one, V2V chunks; ``between`` runs
    before each of them (another handle using the shared model)."""
    between()
    session.prefill(_latents(3))
    chunks = session.run(1)
    between()
    session.set_prompt(_ctx(5), recache=True)
    chunks += session.run(1)
    between()
    session.feed(_latents(4, seed=8))
    session.control("prompt", _ctx(6), recache=True)
    session.control("strength", 0.6)
    chunks += session.run(2)
    assert [c.mode for c in chunks] == ["t2v", "t2v", "v2v", "v2v"] and chunks[2].recache is not None
    return _video(chunks)


def test_prefill_recache_and_v2v_of_a_lora_handle_use_the_merged_weights(tmp_path):
    """The LoRA session equals a plain session on weights merged by hand, though the base handle runs the shared
    model before each part (which restores the base weights): each part merges the LoRA again."""
    from test_lora import write_lora

    from fewstep.engine.lora import apply_lora

    wan = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32, seed=2)
    deltas = write_lora(tmp_path / "w.safetensors", wan.model, scale=0.3)
    merged = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32, seed=2)
    with torch.no_grad():
        for key, delta in deltas.items():
            merged.model.get_parameter(key).add_(delta)
    want = _every_interactive_part(VideoSession(merged.model, _ctx(), H, W, CONFIG, 3))

    def base_run():
        base, _ = open_session(wan, _ctx(), H, W, CONFIG, 3)
        base.run(1)

    lora, _ = open_session(apply_lora(wan, tmp_path / "w.safetensors", 1.0), _ctx(), H, W, CONFIG, 3)
    got = _every_interactive_part(lora, base_run)
    assert (got - want).abs().max() <= 1e-5
    base_only = _every_interactive_part(open_session(wan, _ctx(), H, W, CONFIG, 3)[0])  # restores the base
    assert (got - base_only).abs().max() > 1e-3  # the LoRA changes the video


# a rank of a two-process sequence-parallel run (gloo, CPU): the session every worker of a pool opens
# (RunOptions.sharding), a whole-chunk prefill then chunks of video to video; rank 0 saves its latents
_RANK = """
import sys, torch, torch.distributed as dist
from fewstep.engine import open_model
from fewstep.engine.causal import CausalConfig
from fewstep.engine.causal.recipe import open_session
from fewstep.engine.parallel.mesh import SequenceMesh
from fewstep.engine.parallel.sharding import CausalSharding
from fewstep.engine.run import RunOptions
rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
handle = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32, seed=2)
g = torch.Generator().manual_seed
got = {}
for degrees in ((2, 1), (1, 2)):
    mesh = SequenceMesh.build(*degrees, torch.device("cpu"))
    options = RunOptions(compile=False, step_cache=False, sharding=CausalSharding(mesh))
    config = CausalConfig(chunk_frames=2, window_frames=6, sink_frames=1, steps=2)
    session, _ = open_session(handle, torch.randn(1, 9, 4096, generator=g(1)), 32, 48, config, 3, options=options)
    session.prefill(torch.randn(1, 16, 4, 4, 6, generator=g(7)))
    session.feed(torch.randn(1, 16, 6, 4, 6, generator=g(8)))
    session.set_strength(0.6)
    got[str(degrees)] = torch.cat([c.latents for c in session.chunks(3)], dim=2)
if rank == 0:
    torch.save(got, out)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_whole_chunk_prefill_and_video_to_video_on_two_ranks_equal_one_process(wan, tmp_path):
    """Ulysses and ring over two gloo processes: each rank's session (its share of heads or tokens) takes the
    start latent and the input video whole; rank 0's chunks equal the single-process session's."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store, out = tmp_path / "store", tmp_path / "out.pt"
    ranks = [
        subprocess.Popen([sys.executable, "-c", _RANK, str(rank), str(store), str(out)], env=env)
        for rank in range(2)
    ]
    try:
        assert [p.wait(timeout=240) for p in ranks] == [0, 0]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    got = torch.load(out)
    assert sorted(got) == ["(1, 2)", "(2, 1)"]
    local = _session(wan)
    local.prefill(_latents(4))
    local.feed(_latents(6, seed=8))
    local.set_strength(0.6)
    want = _video(local.run(3))
    for degrees, latents in got.items():
        assert (latents - want).abs().max() <= 1e-4, degrees


def _sharded_session(model_handle, where=NODE):
    """A session on a run sharded over a one-rank mesh (in this process): what a worker's session checks."""
    from fewstep.engine.parallel.mesh import SequenceMesh
    from fewstep.engine.parallel.sharding import CausalSharding
    from fewstep.engine.run import RunOptions

    mesh = SequenceMesh(1, 1, 0, {}, torch.device("cpu"))
    options = RunOptions(compile=False, step_cache=False, sharding=CausalSharding(mesh))
    session, _ = open_session(model_handle, _ctx(), H, W, CONFIG, 3, where=where, options=options)
    return session


def test_a_sharded_session_refuses_a_lone_frame_prefill_and_a_recache_clearly():
    handle = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32, seed=2)
    session = _sharded_session(handle)
    refusal = r"^{}: input 'session': {} runs a forward that is not a chunk's shape, which a sharded worker pool does not run; use one worker$"
    with pytest.raises(
        InputError, match=refusal.format(NODE, "a start latent of one frame more than whole chunks")
    ):
        session.prefill(_latents(3))
    assert session.frames_generated == 0
    session.run(1)
    with pytest.raises(InputError, match=refusal.format(NODE, "a prompt switch with recache")):
        session.set_prompt(_ctx(5), recache=True)
    with pytest.raises(InputError, match=refusal.format(NODE, "a prompt switch with recache")):
        session.control("prompt", _ctx(5), recache=True)  # refused when sent, not at every later chunk
    assert session.controls.pending() == []
    session.control("prompt", _ctx(5))  # a switch without re-cache is taken
    (chunk,) = session.run(1)
    assert [c.kind for c in chunk.controls] == ["prompt"]


@pytest.mark.parametrize("stop_at", [2, 3], ids=["after-the-lone-frame", "after-a-chunk-block"])
@pytest.mark.parametrize(
    "config", [CONFIG, CausalConfig(chunk_frames=2, window_frames=5, sink_frames=1, kv_dtype="int8", steps=2)]
)
def test_an_interrupted_prefill_leaves_the_session_unstarted_and_a_new_prefill_equals_an_uninterrupted_one(
    wan, config, stop_at
):
    """A Cancel between the prefill's forwards (of a lone frame and two chunk blocks): the session is as before
    the prefill (no frame, no clean latent kept), so the host can prefill it again; the video then equals an
    uninterrupted one's (the sink's copy and the int8 tier are taken again)."""
    session = _session(wan, config, where=NODE)
    calls = []

    def stop(chunk, step):
        calls.append((chunk, step))
        if len(calls) == stop_at:
            raise StopError

    with pytest.raises(StopError):
        session.prefill(_latents(5), before_forward=stop)
    assert calls == [(0, None)] * stop_at
    assert session.frames_generated == 0 and session.clean.frames == [None] * config.window_frames
    assert session.prefill(_latents(5)).blocks == (1, 2, 2)
    uninterrupted = _session(wan, config)
    uninterrupted.prefill(_latents(5))
    assert torch.equal(_video(session.run(3)), _video(uninterrupted.run(3)))
