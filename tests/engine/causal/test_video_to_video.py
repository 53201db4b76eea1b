"""Video to video, streamed (``engine.causal.video_to_video``; ``VideoSession.feed`` / ``set_strength``): the
sigmas and the noising of an input chunk, strength 1 against text to video, the missing clean-context pass, the
input queue's bounds and errors, a chunk without input, an interrupted chunk, and switching modes mid-stream.

Their equality with StreamDiffusionV2's own loop is ``test_v2v_streamdiffusionv2.py`` (opt-in)."""

from __future__ import annotations

import math

import pytest
import torch

from fewstep.engine import InputError, load_dit
from fewstep.engine.causal import CausalConfig, VideoSession
from fewstep.engine.causal.video_to_video import (
    MAX_QUEUED_CHUNKS,
    InputFrames,
    check_strength,
    noised_input,
    v2v_sigmas,
)
from fewstep.engine.sampling import schedule_sigmas

H, W = 32, 48  # px: a 4x6 latent, 2x3 tokens per frame
LATENT = (H // 8, W // 8)
WHERE = "FewStep Causal Video Sampler"


@pytest.fixture(scope="module")
def wan():
    return load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=2)


def _ctx(seed=1):
    return torch.randn(1, 9, 4096, generator=torch.Generator().manual_seed(seed))


def _inputs(frames, seed=5):
    return torch.randn(1, 16, frames, *LATENT, generator=torch.Generator().manual_seed(seed))


def _session(wan, chunk=2, window=8, where=None, **kw):
    return VideoSession(wan, _ctx(), H, W, CausalConfig(chunk, window, **kw), seed=3, where=where)


def _close(a, b, tol=1e-6):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.tensor(b), atol=tol), a


# -- sigmas and noising ------------------------------------------------------------------------------------------
def test_v2v_sigmas_start_at_strength_and_keep_the_schedule_below_it():
    dmd = schedule_sigmas("wan-dmd-4step")  # [1, .9375, .8333, .625, 0]
    _close(v2v_sigmas(dmd, 0.9), [0.9, 0.8333333, 0.625, 0.0])
    _close(v2v_sigmas(dmd, 0.7), [0.7, 0.625, 0.0])
    _close(v2v_sigmas(dmd, 0.1), [0.1, 0.0])  # below every sigma: one step
    assert torch.equal(v2v_sigmas(dmd, 1.0), dmd)  # strength 1: text to video's sigmas
    # a strength equal to a sigma of the schedule: the schedule's tail from there (no doubled step)
    assert torch.equal(v2v_sigmas(dmd, float(dmd[2])), dmd[2:])
    # StreamDiffusionV2's list comes back whole at its first sigma, for any of its step counts
    for steps in (1, 2, 4):
        v2v = schedule_sigmas("wan-v2v-4step", steps)
        assert torch.equal(v2v_sigmas(v2v, float(v2v[0])), v2v)
    assert v2v_sigmas(dmd, 0.9).dtype == torch.float32


def test_noised_input_interpolates_input_and_noise():
    x, n = _inputs(2, seed=1), _inputs(2, seed=2)
    assert torch.equal(noised_input(x, 0.25, n), 0.75 * x + 0.25 * n)
    assert torch.equal(noised_input(x, 1.0, n), n)  # strength 1 keeps nothing of the input


@pytest.mark.parametrize(
    "value, problem",
    [
        (0, "0.0 is not in (0, 1]: the share of noise an input chunk is restyled from"),
        (1.5, "1.5 is not in (0, 1]"),
        (-0.2, "-0.2 is not in (0, 1]"),
        (math.nan, "expected a finite number, got nan"),
        (math.inf, "expected a finite number, got inf"),
        ("0.5", "expected a number in (0, 1], got '0.5'"),
        (True, "expected a number in (0, 1], got True"),
    ],
)
def test_bad_strength_names_the_input(wan, value, problem):
    with pytest.raises(InputError) as err:
        check_strength(value)
    assert str(err.value).startswith(f"input 'strength': {problem}")
    session = _session(wan, where=WHERE)
    for call in (session.set_strength, lambda v: session.control("strength", v)):
        with pytest.raises(InputError) as err:
            call(value)
        assert str(err.value).startswith(f"{WHERE}: input 'strength': {problem}")
    assert session.strength is None and session.controls.take() == []


# -- strength 1, forwards ------------------------------------------------------------------------------------------
def test_strength_one_first_chunk_equals_text_to_video_exactly(wan):
    """Text to video draws ``sigma_0 * noise``; video to video ``(1 - s) x + s noise``: at s = 1 the same start,
    the same sigmas and the same draws, so the first chunk is the same bit for bit. Later chunks differ: a
    text-to-video chunk's K/V are committed by a clean-context pass, a video-to-video chunk's are its last step's."""
    t2v = _session(wan)
    v2v = _session(wan)
    v2v.set_strength(1.0)
    v2v.feed(_inputs(4))
    t2v_chunks, v2v_chunks = t2v.run(2), v2v.run(2)
    assert torch.equal(v2v_chunks[0].latents, t2v_chunks[0].latents)
    assert (v2v_chunks[0].mode, v2v_chunks[0].strength, t2v_chunks[0].mode) == ("v2v", 1.0, "t2v")
    assert not torch.equal(v2v_chunks[1].latents, t2v_chunks[1].latents)


def _count_forwards(model):
    calls = []
    return calls, model.register_forward_pre_hook(lambda *_: calls.append(1))


def test_a_v2v_chunk_is_its_steps_without_a_clean_context_pass(wan):
    """Per chunk: text to video runs its steps plus the deferred clean-context pass (at the next chunk's start);
    video to video its steps only, at every strength (the steps below the strength)."""
    steps = len(schedule_sigmas("wan-dmd-4step")) - 1
    t2v = _session(wan)
    calls, hook = _count_forwards(wan)
    try:
        t2v.run(3)
        assert len(calls) == 3 * steps + 2  # the last chunk's pass waits for a next chunk
        for strength, per_chunk in ((1.0, steps), (0.9, steps - 1), (0.7, steps - 2)):
            calls.clear()
            v2v = _session(wan)
            v2v.set_strength(strength)
            v2v.feed(_inputs(6))
            v2v.run(3)
            assert len(calls) == 3 * per_chunk, strength
        # text to video, then video to video: the pending text-to-video chunk is committed at the switch
        calls.clear()
        mixed = _session(wan)
        mixed.run(1)
        mixed.feed(_inputs(2))
        mixed.set_strength(1.0)
        mixed.run(1)
        assert len(calls) == steps + 1 + steps
    finally:
        hook.remove()


# -- the input queue ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "latents, problem",
    [
        (
            torch.zeros(1, 16, 2, 4),
            "input latents are [1, 16, 2, 4]; this session takes [1, 16, frames, 4, 6]",
        ),
        (
            torch.zeros(1, 4, 2, 4, 6),
            "input latents are [1, 4, 2, 4, 6]; this session takes [1, 16, frames, 4, 6]",
        ),
        (torch.zeros(1, 16, 2, 8, 6), "input latents are [1, 16, 2, 8, 6]; this session takes"),
        (torch.zeros(2, 16, 2, 4, 6), "input latents are [2, 16, 2, 4, 6]; this session takes [1, 16"),
        ([1.0], "input latents are list; this session takes [1, 16, frames, 4, 6] (batch, Wan 2.1 latent"),
        (
            torch.zeros(1, 16, 2, 4, 6, dtype=torch.int64),
            "input latents must be finite floating-point values",
        ),
        (torch.full((1, 16, 2, 4, 6), math.nan), "input latents must be finite floating-point values"),
        (torch.full((1, 16, 2, 4, 6), math.inf), "input latents must be finite floating-point values"),
    ],
)
def test_bad_input_latents_are_refused_and_nothing_is_queued(wan, latents, problem):
    session = _session(wan, where=WHERE)
    session.feed(_inputs(1))
    with pytest.raises(InputError) as err:
        session.feed(latents)
    assert str(err.value).startswith(f"{WHERE}: input 'input_video': {problem}")
    assert len(session.inputs) == 1


def test_the_queue_holds_eight_chunks_ahead_and_refuses_more_whole(wan):
    session = _session(wan, chunk=2, where=WHERE)
    capacity = MAX_QUEUED_CHUNKS * 2
    assert session.feed(_inputs(capacity - 1)) == capacity - 1
    with pytest.raises(InputError) as err:
        session.feed(_inputs(2))
    assert str(err.value) == (
        f"{WHERE}: input 'input_video': 2 more input frames do not fit: {capacity - 1} of {capacity} are queued "
        f"({MAX_QUEUED_CHUNKS} chunks ahead of the generation); send them after the next chunks"
    )
    assert len(session.inputs) == capacity - 1  # the refused latents were not partly queued
    assert session.feed(_inputs(1)) == 1
    session.set_strength(0.5)
    session.run(1)  # a chunk takes its frames: room for one more chunk
    assert len(session.inputs) == capacity - 2
    assert session.feed(_inputs(2)) == 2


def test_queued_frames_are_copies_in_order():
    queue = InputFrames(1, 16, LATENT, chunk_frames=2)
    x = _inputs(3)
    queue.push(x)
    x.zero_()  # the caller's tensor is its own again
    assert queue.ready()
    assert torch.equal(queue.peek(), _inputs(3)[:, :, :2]) and len(queue) == 3
    assert torch.equal(queue.take(), _inputs(3)[:, :, :2]) and len(queue) == 1
    assert not queue.ready()


# -- a chunk without input, an interrupted chunk -------------------------------------------------------------------
def test_a_chunk_without_queued_input_is_refused_and_the_session_stays_usable(wan):
    reference = _session(wan)
    reference.set_strength(0.8)
    reference.feed(_inputs(4))
    want = torch.cat([c.latents for c in reference.run(2)], dim=2)

    session = _session(wan, where=WHERE)
    session.set_strength(0.8)
    with pytest.raises(InputError) as err:
        session.run(1)
    assert str(err.value) == (
        f"{WHERE}: input 'input_video': chunk 0 restyles an input chunk (video to video at strength 0.8) but 0 "
        "of its 2 input latent frames are queued; feed the input first"
    )
    session.feed(_inputs(4)[:, :, :1])
    with pytest.raises(InputError, match="but 1 of its 2 input latent frames are queued"):
        session.run(1)
    assert session.frames_generated == 0 and len(session.inputs) == 1
    session.feed(_inputs(4)[:, :, 1:])
    got = torch.cat([c.latents for c in session.run(2)], dim=2)
    assert torch.equal(got, want)


def test_an_interrupted_v2v_chunk_keeps_its_input_and_resumes_to_the_same_video(wan):
    inputs = _inputs(6)
    reference = _session(wan)
    reference.set_strength(0.9)
    reference.feed(inputs)
    want = torch.cat([c.latents for c in reference.run(3)], dim=2)

    session = _session(wan)
    session.set_strength(0.9)
    session.feed(inputs)
    got = [c.latents for c in session.run(1)]

    def stop_at_second_step(chunk, step):
        if step == 1:
            raise KeyboardInterrupt  # a host's Cancel

    with pytest.raises(KeyboardInterrupt):
        session.run(1, before_forward=stop_at_second_step)
    assert len(session.inputs) == 4 and session.frames_generated == 2  # chunk 1's input is still queued
    got += [c.latents for c in session.run(2)]
    assert torch.equal(torch.cat(got, dim=2), want)


# -- switching modes -----------------------------------------------------------------------------------------------
def test_text_to_video_then_video_to_video_then_text_to_video_mid_stream(wan):
    session = _session(wan, chunk=2, window=6, sink_frames=2, rope="absolute")
    first = session.run(1)
    session.feed(_inputs(4))
    session.set_strength(0.6)
    middle = session.run(2)
    session.control("strength", None)  # back to text to video at the next chunk boundary
    last = session.run(2)
    chunks = first + middle + last
    assert [c.mode for c in chunks] == ["t2v", "v2v", "v2v", "t2v", "t2v"]
    assert [c.strength for c in chunks] == [None, 0.6, 0.6, None, None]
    assert [c.start_frame for c in chunks] == [0, 2, 4, 6, 8]  # the window evicts past 6 frames
    assert [(a.kind, a.chunk, a.detail) for a in last[0].controls] == [("strength", 3, "text to video")]
    assert len(session.inputs) == 0
    assert all(bool(torch.isfinite(c.latents).all()) for c in chunks)
