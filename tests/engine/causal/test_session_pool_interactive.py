"""Interactive sessions in the session pool (issue 32): prefill, video to video, prompt switches with a KV re-cache
and controls, per session inside a batched tick.

Each pool session equals its solo :class:`VideoSession` given the same inputs at the same chunk boundaries, bit
for bit (``torch.equal``): the pool's rows compute nothing that depends on the other rows (as for text to video,
``test_session_pool.py``), a prefill and a re-cache are solo forwards on the session's own slot, and a video-to-video
row's start latents and sigmas are the solo session's formulas (``session.chunk_start`` / ``chunk_sigmas``).
Mixed batches: text to video and video to video at two strengths in one tick run as one batch per sigma list;
a video-to-video session without input is skipped and reported, not an error. A suspend / resume in between
continues exactly."""

from __future__ import annotations

import pytest
import torch

from fewstep.engine import InputError, load_dit, load_tiny_vae
from fewstep.engine.causal import CausalConfig, VideoSession
from fewstep.engine.causal.session_pool import SessionPool

H, W = 32, 48  # px: a 4x6 latent, 2x3 tokens per frame
CONFIGS = {
    "bf16-sink1-cache": CausalConfig(chunk_frames=2, window_frames=6, sink_frames=1),
    "int8-absolute": CausalConfig(
        chunk_frames=2, window_frames=6, kv_dtype="int8", keep_recent_chunks=0, rope="absolute", steps=3
    ),  # fmt: skip
    # the re-cache re-quantizes the frames of the int4 ring it recomputes, in the session's slot
    "int4-sink1-cache": CausalConfig(
        chunk_frames=2, window_frames=6, sink_frames=1, kv_dtype="int4", steps=2
    ),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """wan-tiny's GEMMs are tiny: a second intra-op thread only spins on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def wan():
    return load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=2)


@pytest.fixture(scope="module")
def taew():
    return load_tiny_vae("dummy:taew2_1", device="cpu", dtype=torch.float32)


def _ctx(seed=1, tokens=9):
    return torch.randn(1, tokens, 4096, generator=torch.Generator().manual_seed(seed))


def _latents(seed: int, frames: int) -> torch.Tensor:
    return torch.randn(1, 16, frames, H // 8, W // 8, generator=torch.Generator().manual_seed(seed))


# A plan: what a client does to a session; run on a solo session and on a pool session, the videos must agree.
# "prefill": start latents; "steps": {chunk index: [actions before that chunk]}; an action is one of
# ("feed", latents), ("strength", s), ("prompt", context, recache), ("control", kind, value, recache).
def _plan(seed, prompt, chunks, prefill=None, steps=None):
    return {"seed": seed, "prompt": prompt, "chunks": chunks, "prefill": prefill, "steps": steps or {}}


def _v2v_steps(strength, chunks, c, seed):
    """Video to video at ``strength`` from chunk 0, an input chunk fed before each chunk."""
    steps = {i: [("feed", _latents(seed + i, c))] for i in range(chunks)}
    steps[0].insert(0, ("strength", strength))
    return steps


def _act(target, session, action):
    """Do ``action`` on a solo session (``target`` is the session) or a pool session (``target`` is the pool)."""
    kind, *args = action
    call = (lambda name, *a, **k: getattr(target, name)(*a, **k)) if target is session else (
        lambda name, *a, **k: getattr(target, name)(session, *a, **k))  # fmt: skip
    if kind == "feed":
        call("feed", args[0])
    elif kind == "strength":
        call("set_strength", args[0])
    elif kind == "prompt":
        call("set_prompt", _ctx(args[0]), recache=args[1])
    else:
        call("control", args[0], _ctx(args[1]) if args[0] == "prompt" else args[1], recache=args[2])


def _solo(model, config, plan, tiny_vae=None):
    session = VideoSession(model, _ctx(plan["prompt"]), H, W, config, plan["seed"], tiny_vae)
    prefill = None if plan["prefill"] is None else session.prefill(plan["prefill"])
    out = []
    for i in range(plan["chunks"]):
        for action in plan["steps"].get(i, ()):
            _act(session, session, action)
        out += session.run(1)
    return out, prefill


class PlanDriver:
    """Drives pool sessions by their plans: before a session's chunk ``i`` is due, its actions for ``i`` are
    done (once); every tick's chunks are taken at once."""

    def __init__(self, pool: SessionPool):
        self.pool, self.plans, self.got, self.reports, self.prepared, self.prefills = pool, {}, {}, [], {}, {}

    def join(self, plan):
        session = self.pool.join(_ctx(plan["prompt"]), seed=plan["seed"], chunks=plan["chunks"])
        self.plans[session.key], self.got[session.key] = plan, []
        if plan["prefill"] is not None:
            self.prefills[session.key] = self.pool.prefill(session, plan["prefill"])
        return session

    def _prepare(self, session):
        i = session.stats.chunks_generated
        plan = self.plans.get(session.key)
        if plan is None or self.prepared.get(session.key) == i:
            return
        self.prepared[session.key] = i
        for action in plan["steps"].get(i, ()):
            _act(self.pool, session, action)

    def tick(self):
        for session in list(self.pool.sessions.values()):
            if session.state == "active" and session.ready:
                self._prepare(session)
        report = self.pool.tick()
        self.reports.append(report)
        for key, chunk in report.chunks.items():
            self.got[key].append(chunk)
        for session in list(self.pool.sessions.values()):
            session.take()
        return report


def _controls(chunk):
    """What a chunk reports of its controls and re-cache, without the measured seconds."""
    controls = [(a.kind, a.sequence, a.chunk, a.recache, a.replaced, a.detail.split(" in ")[0])
                for a in chunk.controls]  # fmt: skip
    recache = None if chunk.recache is None else (chunk.recache.frames, chunk.recache.start_frame)
    return controls, recache


def _assert_equal(got, reference, label):
    assert [c.index for c in got] == [c.index for c in reference], label
    for chunk, ref in zip(got, reference):
        where = (label, chunk.index)
        assert chunk.start_frame == ref.start_frame, where
        assert (chunk.mode, chunk.strength) == (ref.mode, ref.strength), where
        assert _controls(chunk) == _controls(ref), where
        diff = (chunk.latents - ref.latents).abs().max().item()
        assert torch.equal(chunk.latents, ref.latents), (where, diff)
        if ref.frames is not None:
            assert torch.equal(chunk.frames, ref.frames), where


def _mixed_plans(c):
    return {
        "t2v": _plan(3, 1, 4),
        "v2v-0.6": _plan(4, 2, 4, steps=_v2v_steps(0.6, 4, c, 100)),
        "v2v-0.35": _plan(5, 3, 4, steps=_v2v_steps(0.35, 4, c, 200)),
        # image to video, then a prompt switch with a re-cache and a reseed
        "prefilled": _plan(
            6,
            4,
            4,
            prefill=_latents(300, 1 + c),
            steps={
                2: [("prompt", 7, True)],
                3: [("control", "seed", 11, False)],
            },
        ),  # fmt: skip
        # text to video, then a strength control: video to video at 0.6 from chunk 2 (the "v2v-0.6" group)
        "switches-to-v2v": _plan(
            8,
            5,
            4,
            steps={
                2: [("feed", _latents(400, c)), ("control", "strength", 0.6, False)],
                3: [
                    ("feed", _latents(401, c)),
                    ("control", "prompt", 9, True),
                    ("control", "prompt", 10, True),
                ],
            },
        ),  # fmt: skip
    }


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mixed_batches_every_interactive_pool_session_equals_its_solo_session(wan, name):
    config = CONFIGS[name]
    c = config.chunk_frames
    plans = _mixed_plans(c)
    pool = SessionPool(wan, H, W, config, max_sessions=5, buckets=(1, 2, 4))
    drive = PlanDriver(pool)
    keys = {label: drive.join(plan).key for label, plan in plans.items()}
    for _ in range(4):
        drive.tick()
    for label, plan in plans.items():
        reference, prefill = _solo(wan, config, plan)
        _assert_equal(drive.got[keys[label]], reference, label)
        if prefill is not None:
            got = drive.prefills[keys[label]]
            assert (got.frames, got.blocks) == (prefill.frames, prefill.blocks) == (1 + c, (1, c))
    # one batch per sigma list: text to video (t2v, prefilled, switches-to-v2v), then 0.6, then 0.35; from chunk 2
    # on "switches-to-v2v" restyles at 0.6 and runs in that batch
    assert [(r.batches, r.strengths) for r in drive.reports] == [
        ((3, 1, 1), (None, 0.6, 0.35)),
        ((3, 1, 1), (None, 0.6, 0.35)),
        ((2, 2, 1), (None, 0.6, 0.35)),
        ((2, 2, 1), (None, 0.6, 0.35)),
    ]
    switched = drive.got[keys["switches-to-v2v"]]
    assert [ch.mode for ch in switched] == ["t2v", "t2v", "v2v", "v2v"]
    # the newer of two queued prompts replaced the older: applied once, with its re-cache, at chunk 3
    assert [(a.kind, a.chunk, a.recache, a.replaced) for a in switched[3].controls] == [
        ("prompt", 3, True, 1)
    ]
    assert switched[3].recache.frames > 0
    prefilled = drive.got[keys["prefilled"]]
    assert prefilled[0].start_frame == 1 + c and prefilled[2].recache.frames > 0


def test_suspend_and_resume_between_interactive_chunks_continue_exactly(wan, taew):
    """A prefilled session with a re-cache switch and a video-to-video one, suspended after chunk 1 (pending chunk,
    clean latents, queued input and controls at that moment) and resumed a tick later, each in another slot."""
    config = CONFIGS["bf16-sink1-cache"]
    c = config.chunk_frames
    plans = {
        "filler": _plan(2, 1, 5),
        "prefilled": _plan(
            6,
            4,
            4,
            prefill=_latents(300, 2 * c),
            steps={
                1: [("control", "prompt", 7, True)],
                2: [("prompt", 8, True)],
            },
        ),  # fmt: skip
        "v2v": _plan(4, 2, 4, steps=_v2v_steps(0.5, 4, c, 100)),
    }
    pool = SessionPool(wan, H, W, config, max_sessions=3, buckets=(1, 2, 4), tiny_vae=taew)
    drive = PlanDriver(pool)
    sessions = {label: drive.join(plan) for label, plan in plans.items()}
    drive.tick()
    drive.tick()
    for label in ("prefilled", "v2v"):
        session = sessions[label]
        drive._prepare(session)  # its next chunk's inputs and controls queued before the suspend
        pool.suspend(session)
    drive.tick()  # the filler alone; then the two resume into the slots in the other order
    assert drive.reports[-1].batches == (1,)
    pool.resume(sessions["v2v"])
    pool.resume(sessions["prefilled"])
    assert (sessions["v2v"].slot, sessions["prefilled"].slot) == (1, 2)
    for _ in range(2):
        drive.tick()
    for label in ("prefilled", "v2v"):
        reference, _ = _solo(wan, config, plans[label], taew)
        _assert_equal(drive.got[sessions[label].key], reference, label)


def test_a_video_to_video_session_without_input_is_skipped_and_reported(wan):
    config = CONFIGS["bf16-sink1-cache"]
    c = config.chunk_frames
    plan = _plan(4, 2, 3, steps=_v2v_steps(0.5, 3, c, 100))
    pool = SessionPool(wan, H, W, config, max_sessions=2)
    drive = PlanDriver(pool)
    other = drive.join(_plan(3, 1, 3))
    v2v = pool.join(_ctx(2), seed=4, chunks=3)
    drive.got[v2v.key] = []
    pool.set_strength(v2v, 0.5)
    pool.control(v2v, "seed", 4)  # applied at its chunk 0 boundary, while it starves: reported on chunk 0
    report = drive.tick()
    assert report.starved == (v2v.key,) and set(report.chunks) == {other.key} and report.failed == {}
    for i in range(3):
        pool.feed(v2v, plan["steps"][i][-1][1])
        report = drive.tick()
        assert v2v.key in report.chunks and report.starved == ()
    reference, _ = _solo(wan, config, _plan(4, 2, 3, steps={**plan["steps"], 0: [
        ("strength", 0.5), ("control", "seed", 4, False), *plan["steps"][0][1:]]}))  # fmt: skip
    _assert_equal(drive.got[v2v.key], reference, "starved v2v")
    assert [(a.kind, a.chunk) for a in drive.got[v2v.key][0].controls] == [("seed", 0)]


def test_a_pool_session_saved_after_a_prefill_and_a_switch_resumes_and_recaches_as_the_uninterrupted(
    wan, tmp_path
):
    """Snapshot format 2: a pool session saved after a prefill, a chunk and a prompt switch waiting as a control
    (its clean latents, queued controls and input in the file), resumed solo and in a new pool, then switched
    with a re-cache, equals the uninterrupted session."""
    from fewstep.engine.causal.snapshot import join_from_snapshot, resume_session, save_pool_session

    config = CONFIGS["int8-absolute"]
    c = config.chunk_frames
    steps = {
        1: [("control", "prompt", 7, False), ("feed", _latents(50, c)), ("control", "strength", 0.7, False)],
        2: [("prompt", 8, True), ("feed", _latents(51, c))],
        3: [
            ("control", "seed", 12, False),
            ("control", "strength", None, False),
            ("control", "prompt", 9, True),
        ],
    }
    plan = _plan(6, 4, 4, prefill=_latents(300, 1 + 2 * c), steps=steps)
    reference, _ = _solo(wan, config, plan)

    pool = SessionPool(wan, H, W, config, max_sessions=2)
    drive = PlanDriver(pool)
    session = drive.join(plan)
    drive.tick()
    drive._prepare(session)  # chunk 1's controls and input queued, then saved
    path = tmp_path / "s.safetensors"
    save_pool_session(pool, session, path)

    # solo
    solo, _ = resume_session(wan, path)
    got = [drive.got[session.key][0]]
    for i in (1, 2, 3):
        for action in steps[i] if i > 1 else ():  # chunk 1's are in the snapshot
            _act(solo, solo, action)
        got += solo.run(1)
    _assert_equal(got, reference, "resumed solo")

    # in another pool
    other = SessionPool(wan, H, W, config, max_sessions=2)
    other_drive = PlanDriver(other)
    joined = join_from_snapshot(other, path)
    other_drive.plans[joined.key], other_drive.got[joined.key] = plan, [drive.got[session.key][0]]
    other_drive.prepared[joined.key] = 1  # its chunk 1 actions are in the snapshot
    for _ in range(3):
        other_drive.tick()
    _assert_equal(other_drive.got[joined.key], reference, "resumed in a pool")


def test_bad_interactive_pool_input_is_refused_with_its_message(wan):
    config = CONFIGS["bf16-sink1-cache"]
    pool = SessionPool(wan, H, W, config, max_sessions=1, where="test pool")
    session = pool.join(_ctx(1), seed=3)
    waiting = pool.join(_ctx(2), seed=3, wait=True)
    with pytest.raises(InputError) as bad:
        pool.prefill(session, _latents(1, 4)[:, :8])
    assert str(bad.value) == (
        "test pool: input 'start_latent': 8 latent channels; this Wan model takes 16 (Wan 2.1 VAE latents)"
    )
    with pytest.raises(InputError) as bad:
        pool.prefill(waiting, _latents(1, 1))
    assert str(bad.value) == (
        f"test pool: input 'start_latent': {waiting.key} is waiting: a start latent is committed into a slot; "
        "prefill the session once it is active"
    )
    with pytest.raises(InputError) as bad:
        pool.prefill(session, _latents(1, 0))
    assert str(bad.value) == "test pool: input 'start_latent': the start latent holds no frames"
    with pytest.raises(InputError) as bad:
        pool.set_strength(session, 1.5)
    assert str(bad.value).startswith("test pool: input 'strength': 1.5 is not in (0, 1]")
    with pytest.raises(InputError) as bad:
        pool.control(session, "speed", 2)
    assert (
        str(bad.value)
        == "test pool: input 'control': unknown control 'speed'; expected prompt, strength or seed"
    )
    with pytest.raises(InputError) as bad:
        pool.feed(session, _latents(1, 2)[..., :3])
    assert str(bad.value).startswith("test pool: input 'input_video': input latents are [1, 16, 2, 4, 3]")
    drive = PlanDriver(pool)
    drive.got[session.key] = []
    drive.tick()
    with pytest.raises(InputError) as bad:
        pool.prefill(session, _latents(1, 2))
    assert str(bad.value) == (
        f"test pool: input 'start_latent': {session.key} has generated 2 frames already; a start latent is only "
        "taken before the first chunk (join a new session)"
    )


def test_prefill_and_recache_run_eagerly_beside_a_graphed_batched_step(monkeypatch):
    """CUDA graphs (emulated on the CPU, tests/compile_doubles.py) through open_session_pool: a session's prefill
    (a lone frame and a whole chunk) and its re-cache run on the plain model, so the captured steps see only
    chunk and commit forwards (no miss, no capture of another shape) and the video equals eager."""
    from compile_doubles import EMULATED

    from fewstep.engine import open_model
    from fewstep.engine.causal.kv_cache import BatchedKV
    from fewstep.engine.causal.recipe import open_session_pool
    from fewstep.engine.compile import attach_compile

    keys = []  # (bucket, masked, which rows' windows are full) of every batched forward: a graph's key
    prepare = BatchedKV.prepare

    def recording(self, slots, caches):
        prepare(self, slots, caches)
        keys.append((self.rows, self.key_mask() is not None, self._pattern))

    monkeypatch.setattr(BatchedKV, "prepare", recording)

    handle = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32, seed=2)
    config = CausalConfig(chunk_frames=2, window_frames=6, steps=2)
    plans = {
        "prefilled": _plan(6, 4, 3, prefill=_latents(300, 3), steps={2: [("prompt", 7, True)]}),
        "v2v": _plan(4, 2, 3, steps=_v2v_steps(0.5, 3, 2, 100)),
    }

    def scenario(model_handle):
        pool, compiled = open_session_pool(model_handle, H, W, config, max_sessions=2, buckets=(1, 2))
        drive = PlanDriver(pool)
        keys = {label: drive.join(plan).key for label, plan in plans.items()}
        for _ in range(3):
            drive.tick()
        return {label: drive.got[key] for label, key in keys.items()}, compiled

    eager, _ = scenario(handle)
    keys.clear()
    graphed, run = scenario(attach_compile(handle, "off", "whole", graph_segments=EMULATED))
    g = run.finish().graphs
    for label in plans:
        _assert_equal(graphed[label], eager[label], label)
    # every graph is a batched step's (the prefill's and the re-cache's forwards are not the compiled step's)
    assert (g.warmups, g.misses) == (len(set(keys)), 0) and g.hits > 0
