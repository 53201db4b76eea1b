"""The session pool (issue 31): many causal video streams of one model batched into one forward per denoising step.

Every pool session's latents equal its solo :class:`VideoSession` (same seed, prompt and config) whatever shares
its batch: joins at different ticks, leaves, prompt switches, suspends and resumes, more ready sessions than the
largest bucket, padded rows. A swap (suspend, resume into another slot) continues exactly. Admission is by bytes,
memory stays flat over a long run of joins and leaves, bad input is refused with its message, ticks are
round-robin fair, a cancelled tick leaves the sessions as they were."""

from __future__ import annotations

import collections
import gc
import threading
import time
import types

import pytest
import torch
from compile_doubles import EMULATED
from memory_probe import settled_rss_mib

from fewstep.engine import InputError, load_dit, load_tiny_vae, open_model
from fewstep.engine.backends import DEFAULT_BACKENDS
from fewstep.engine.causal import CausalConfig, VideoSession
from fewstep.engine.causal import session_pool as session_pool_module
from fewstep.engine.causal.kv_cache import BatchedKV, KVSlotPool, kv_cache_bytes
from fewstep.engine.causal.kv_cache.bytes import clean_frames_bytes, kv_pool_bytes
from fewstep.engine.causal.recipe import open_session_pool
from fewstep.engine.causal.session import RECENT_CHUNKS
from fewstep.engine.causal.session_pool import SessionPool
from fewstep.engine.compile import attach_compile
from fewstep.engine.run import RunBlocks, RunOptions
from fewstep.engine.units import format_bytes

H, W = 32, 48  # px: a 4x6 latent, 2x3 tokens per frame
TOL = 1e-5  # the bound for a pool row against its solo session (float32, CPU)
# The pool is built so that the bound is met with nothing to spare: a row's computation does not depend on what
# shares its batch (Wan embeds each row on its own; rows whose window is full attend unmasked even beside filling
# rows), so on one machine a pool session equals its solo run bit for bit, quantized tiers included.


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """wan-tiny's GEMMs are a few KiB: a second intra-op thread only spins, and on a loaded CI machine its spinning
    made this file ten times slower (measured: 342 s against 25 s with one thread on 2 shared cores)."""
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


def _solo_with_tiers(model, config, seed, chunks, prompts, tiny_vae=None):
    """The chunks of a solo session and, after each, how many frames its cache holds quantized; ``prompts``:
    {chunk index the prompt takes effect at: context seed}."""
    session = VideoSession(model, _ctx(prompts[0]), H, W, config, seed, tiny_vae)
    out, quantized = [], []
    for i in range(chunks):
        if i and i in prompts:
            session.set_prompt(_ctx(prompts[i]))
        out += session.run(1)
        quantized.append(session.cache.frames_quantized)
    return out, quantized


def _solo(model, config, seed, chunks, prompts, tiny_vae=None):
    return _solo_with_tiers(model, config, seed, chunks, prompts, tiny_vae)[0]


def _assert_follows(chunks, solo_with_tiers, label=""):
    """``chunks`` equal the solo run's bit for bit (before and after its frames are quantized); returns how many
    chunks came before any quantized frame."""
    reference, quantized = solo_with_tiers
    assert [c.index for c in chunks] == list(range(len(reference))), label
    assert [c.start_frame for c in chunks] == [c.start_frame for c in reference], label
    exact = 0
    for chunk, ref, frames_quantized in zip(chunks, reference, quantized):
        diff = (chunk.latents - ref.latents).abs().max().item()
        assert diff <= TOL and torch.equal(chunk.latents, ref.latents), (label, chunk.index, diff)
        exact += frames_quantized == 0
    return exact


def _max_diff(chunks, reference) -> float:
    assert len(chunks) == len(reference)
    return max((a.latents - b.latents).abs().max().item() for a, b in zip(chunks, reference))


class Driver:
    """Ticks a pool as a consumer that takes every chunk at once; keeps each session's chunks and the batches."""

    def __init__(self, pool: SessionPool):
        self.pool, self.got, self.reports = pool, {}, []

    def tick(self, **kwargs):
        report = self.pool.tick(**kwargs)
        self.reports.append(report)
        for key, chunk in report.chunks.items():
            self.got.setdefault(key, []).append(chunk)
        for session in list(self.pool.sessions.values()):
            session.take()
        return report

    def batches(self):
        return [(r.batches, r.buckets) for r in self.reports]


# -- exactness: every session equals its solo run -----------------------------------------------------------------
CONFIGS = {
    "bf16-evicting": CausalConfig(chunk_frames=2, window_frames=4, steps=2),
    "bf16-sink1-absolute": CausalConfig(
        chunk_frames=2, window_frames=5, sink_frames=1, rope="absolute", steps=2
    ),
    "int8-sink2-cache": CausalConfig(chunk_frames=2, window_frames=8, sink_frames=2, kv_dtype="int8"),
    "int8-absolute": CausalConfig(
        chunk_frames=2, window_frames=6, kv_dtype="int8", keep_recent_chunks=0, rope="absolute", steps=2
    ),
    "int4-sink1-absolute": CausalConfig(
        chunk_frames=2, window_frames=6, sink_frames=1, kv_dtype="int4", rope="absolute", steps=2
    ),
    "int4-sink1-cache": CausalConfig(
        chunk_frames=1, window_frames=4, sink_frames=1, kv_dtype="int4", keep_recent_chunks=1, steps=2
    ),
}
# the batches of the scenario below per tick: (sizes, bucketed sizes)
EXPECTED_BATCHES = {
    (1, 2, 4): [
        ((1,), (1,)),
        ((2,), (2,)),
        ((3,), (4,)),
        ((3,), (4,)),
        ((4,), (4,)),
        ((3,), (4,)),
        ((3,), (4,)),
    ],
    # more ready sessions than the largest bucket: two batches per tick
    (1, 2): [
        ((1,), (1,)),
        ((2,), (2,)),
        ((2, 1), (2, 1)),
        ((2, 1), (2, 1)),
        ((2, 2), (2, 2)),
        ((2, 1), (2, 1)),
        ((2, 1), (2, 1)),
    ],
    # padded rows: 2 or 3 sessions run in the bucket of 4
    (1, 4): [
        ((1,), (1,)),
        ((2,), (4,)),
        ((3,), (4,)),
        ((3,), (4,)),
        ((4,), (4,)),
        ((3,), (4,)),
        ((3,), (4,)),
    ],
}


def _busy_pool_scenario(model, config, buckets):
    """Joins at ticks 0 / 1 / 2 / 3, A and B switch prompts at their chunk 2, C is suspended for a tick (and
    resumed into another slot: D took its slot), B leaves after 4 chunks. Returns (driver, sessions)."""
    pool = SessionPool(model, H, W, config, max_sessions=4, buckets=buckets)
    drive = Driver(pool)
    a = pool.join(_ctx(1), seed=3)
    drive.tick()
    b = pool.join(_ctx(2), seed=4)
    drive.tick()
    c = pool.join(_ctx(3), seed=5)
    pool.set_prompt(a, _ctx(7))  # A's chunk 2 on
    drive.tick()
    c_slot = c.slot
    pool.suspend(c)
    pool.set_prompt(b, _ctx(8))  # B's chunk 2 on
    d = pool.join(_ctx(4), seed=6)
    assert d.slot == c_slot  # the suspended session's slot was freed
    drive.tick()
    pool.resume(c)
    assert c.slot not in (None, c_slot)
    drive.tick()
    pool.leave(b)
    for _ in range(2):
        drive.tick()
    return drive, (a, b, c, d)


@pytest.mark.parametrize("buckets", list(EXPECTED_BATCHES), ids=lambda b: "buckets" + "-".join(map(str, b)))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_pool_session_equals_its_solo_session(wan, name, buckets):
    config = CONFIGS[name]
    drive, (a, b, c, d) = _busy_pool_scenario(wan, config, buckets)
    assert drive.batches() == EXPECTED_BATCHES[buckets]
    solos = {
        a.key: _solo_with_tiers(wan, config, 3, 7, {0: 1, 2: 7}),
        b.key: _solo_with_tiers(wan, config, 4, 4, {0: 2, 2: 8}),
        c.key: _solo_with_tiers(wan, config, 5, 4, {0: 3}),
        d.key: _solo_with_tiers(wan, config, 6, 4, {0: 4}),
    }
    exact = sum(_assert_follows(drive.got[key], solo, key) for key, solo in solos.items())
    assert exact == 19 if config.kv_dtype == "bf16" else exact >= 4  # every chunk / those before quantizing
    if config.window_frames < 14:  # the scenario runs A past its window: frames were evicted / quantized
        assert a.cache.frames_committed > config.window_frames
    if config.kv_dtype != "bf16":
        assert a.cache.frames_quantized > 0


def test_a_pool_sessions_quantized_ring_equals_its_solo_sessions(wan):
    """The int8 codes, scales and zero points a busy pool session stores are the solo session's, bit for bit: a value
    on a quantization step's edge rounds the same way whatever shares the batch."""
    config = CONFIGS["int8-absolute"]
    drive, (a, *_) = _busy_pool_scenario(wan, config, (1, 2, 4))
    solo = VideoSession(wan, _ctx(1), H, W, config, 3)
    solo.run(2)
    solo.set_prompt(_ctx(7))
    solo.run(5)
    pooled, alone = a.cache.named_storage(), solo.cache.named_storage()
    codes = [name for name in pooled if pooled[name].dtype == torch.uint8]
    assert codes == ["kq0", "vq0", "kq1", "vq1"]
    assert a.cache.frames_quantized == solo.cache.frames_quantized > 0
    for name in pooled:
        assert torch.equal(pooled[name], alone[name]), name


def test_a_lone_session_in_a_pool_is_bit_exact(wan):
    config = CONFIGS["int8-sink2-cache"]
    pool = SessionPool(wan, H, W, config, max_sessions=3)
    drive = Driver(pool)
    s = pool.join(_ctx(1), seed=3)
    for _ in range(6):
        drive.tick()
    reference = _solo(wan, config, 3, 6, {0: 1})
    assert all(torch.equal(x.latents, y.latents) for x, y in zip(drive.got[s.key], reference))


def test_a_prompt_switch_takes_effect_at_the_next_chunk_only(wan):
    """The switched session follows the solo session that switched at the same chunk, not the unswitched one."""
    config = CONFIGS["bf16-evicting"]
    pool = SessionPool(wan, H, W, config, max_sessions=2)
    drive = Driver(pool)
    s = pool.join(_ctx(1), seed=3)
    other = pool.join(_ctx(2), seed=4)
    drive.tick()
    pool.set_prompt(s, _ctx(5))
    for _ in range(2):
        drive.tick()
    switched, unswitched = _solo(wan, config, 3, 3, {0: 1, 1: 5}), _solo(wan, config, 3, 3, {0: 1})
    assert _max_diff(drive.got[s.key], switched) <= TOL
    assert _max_diff(drive.got[s.key][1:], unswitched[1:]) > 1e-3
    assert _max_diff(drive.got[other.key], _solo(wan, config, 4, 3, {0: 2})) <= TOL


# -- swap -----------------------------------------------------------------------------------------------------------
SWAP_AFTER = (
    4  # ticks before the swap: the windows below have evicted, quantized and copied their sinks by then
)


def _swap_scenario(model, config, vae, swap: bool):
    """A, B, C join; after SWAP_AFTER ticks A is suspended, D joins (into A's slot) and A is resumed (into another
    slot); without ``swap`` D joins the same way and A stays. Every tick is one batch of 4 rows in the same
    order."""
    pool = SessionPool(model, H, W, config, max_sessions=4, buckets=(4,), tiny_vae=vae)
    drive = Driver(pool)
    a, b, c = (pool.join(_ctx(i), seed=i + 2) for i in (1, 2, 3))
    for _ in range(SWAP_AFTER):
        drive.tick()
    saved, old_slot = None, a.slot
    if swap:
        saved = pool.suspend(a)
        assert a.state == "suspended" and a.slot is None and a.cache is None
        assert a.frames_generated == SWAP_AFTER * config.chunk_frames  # the host copy holds its position
    d = pool.join(_ctx(4), seed=6)
    if swap:
        assert d.slot == old_slot  # the freed slot is taken while A is suspended
        assert pool.resume(a) and a.state == "active" and a.slot not in (None, old_slot)
    for _ in range(3):
        drive.tick()
    assert drive.batches() == [((3,), (4,))] * SWAP_AFTER + [((4,), (4,))] * 3
    return drive, (a, b, c, d), saved


@pytest.mark.parametrize("name", ["bf16-sink1-absolute", "int8-sink2-cache", "int4-sink1-cache"])
def test_a_suspended_and_resumed_session_continues_exactly(wan, taew, name):
    config = CONFIGS[name]
    swapped, (a, *_), saved = _swap_scenario(wan, config, taew, swap=True)
    plain, _, _ = _swap_scenario(wan, config, taew, swap=False)
    for key in swapped.got:
        assert len(swapped.got[key]) == len(plain.got[key])
        for x, y in zip(swapped.got[key], plain.got[key]):
            assert torch.equal(x.latents, y.latents) and torch.equal(x.frames, y.frames), key
    _assert_follows(swapped.got[a.key], _solo_with_tiers(wan, config, 3, SWAP_AFTER + 3, {0: 1}, taew))
    # the whole state went to the host: every K/V buffer (the quantized ring with its scales and zero points, the
    # sinks' copies), the prompt rows, the clean latents awaiting commit, the generator and the stream decoder
    assert all(t.device.type == "cpu" for t in saved.tensors.values())
    names = set(saved.tensors)
    assert {"pending", "generator", "cross.k0", "cross.v1", "kv.k0", "kv.v1"} <= names
    assert any(n.startswith("decoder.") for n in names)
    kv = saved.meta["kv"]
    assert kv["frames_committed"] == (SWAP_AFTER - 1) * config.chunk_frames
    if config.kv_dtype != "bf16":
        assert kv["frames_quantized"] > 0 and {"kv.kq0", "kv.kq0_scale", "kv.vq1_zero"} <= names
    if config.rope == "cache" and config.sink_frames:
        assert kv["sinks_copied"] > 0 and "kv.sink_k0" in names
    assert saved.frames_generated == SWAP_AFTER * config.chunk_frames
    assert saved.meta["chunks_generated"] == SWAP_AFTER


def test_a_full_pool_gives_a_suspended_sessions_slot_and_a_queued_resume_the_next_free_one(wan):
    config = CONFIGS["bf16-sink1-absolute"]
    pool = SessionPool(wan, H, W, config, max_sessions=2)
    drive = Driver(pool)
    a, b = pool.join(_ctx(1), seed=3), pool.join(_ctx(2), seed=4)
    drive.tick()
    pool.suspend(a)
    c = pool.join(_ctx(3), seed=5)  # the pool is full of active sessions again
    with pytest.raises(InputError, match=r"^input 'pool': all 2 slots hold active sessions"):
        pool.resume(a)
    assert a.state == "suspended"
    assert pool.resume(a, wait=True) is False and a.state == "waiting"
    drive.tick()
    assert a.key not in drive.reports[-1].chunks
    pool.leave(b)
    assert a.state == "active"  # the queued resume took the freed slot
    for _ in range(2):
        drive.tick()
    assert _max_diff(drive.got[a.key], _solo(wan, config, 3, 3, {0: 1})) <= TOL
    assert _max_diff(drive.got[c.key], _solo(wan, config, 5, 3, {0: 3})) <= TOL


def test_suspend_idle_suspends_only_sessions_whose_chunk_was_not_taken(wan):
    pool = SessionPool(wan, H, W, CONFIGS["bf16-evicting"], max_sessions=3)
    taker, idler, fresh = pool.join(_ctx(1)), pool.join(_ctx(2)), None
    pool.tick()
    taker.take()
    fresh = pool.join(_ctx(3))  # nothing generated yet: nothing to take
    now = time.perf_counter()
    assert pool.suspend_idle(timeout=60.0, now=now) == []  # not idle for the timeout yet
    assert pool.suspend_idle(timeout=60.0, now=now + 61.0) == [idler]
    assert idler.state == "suspended" and idler.why == "its consumer took no chunk for 60 s"
    assert taker.state == fresh.state == "active"


# -- admission by bytes ---------------------------------------------------------------------------------------------
def _expected_pool_bytes(model, config, slots):
    p = model.params
    kv = kv_pool_bytes(p.num_layers, slots, 6, p.num_heads, p.head_dim, config.window, torch.float32,
                       config.kv_dtype, config.keep_recent_chunks, config.rope)  # fmt: skip
    clean = clean_frames_bytes(config.window, 1, p.in_dim, (H // 8, W // 8))  # a re-cache's clean latents
    return kv + slots * (2 * p.num_layers * p.text_len * p.dim * 4 + clean)


def test_a_budget_for_two_of_three_slots_gives_two_and_refuses_or_queues_the_third(wan):
    config = CONFIGS["int8-sink2-cache"]
    p = wan.params
    probe = SessionPool(wan, H, W, config, max_sessions=1)
    budget = sum(probe.bytes_needed(2, 2).values())
    assert sum(probe.bytes_needed(3, 3).values()) > budget
    pool = SessionPool(wan, H, W, config, max_sessions=3, max_bytes=budget, where="test pool")
    assert pool.slots == 2 and pool.buckets == (1, 2)
    assert pool.nbytes == _expected_pool_bytes(wan, config, 2) <= budget
    drive = Driver(pool)
    a, b = pool.join(_ctx(1), seed=3), pool.join(_ctx(2), seed=4)
    kv_window = kv_cache_bytes(p.num_layers, 1, 6, p.num_heads, p.head_dim, config.window, torch.float32,
                               config.kv_dtype, config.keep_recent_chunks, config.rope).window  # fmt: skip
    prompt_rows = 2 * p.num_layers * p.text_len * p.dim * 4
    clean = clean_frames_bytes(config.window, 1, p.in_dim, (H // 8, W // 8))
    with pytest.raises(InputError) as refused:
        pool.join(_ctx(3), seed=5)
    assert str(refused.value) == (
        f"test pool: input 'pool': all 2 slots hold active sessions; a session needs about "
        f"{format_bytes(kv_window + prompt_rows + clean)} (KV window {format_bytes(kv_window)}, prompt rows "
        f"{format_bytes(prompt_rows)}, clean latents {format_bytes(clean)}) and the pool holds {format_bytes(pool.nbytes)} for 2: join with wait=True "
        "to be admitted when a slot frees, or suspend or close a session"
    )
    c = pool.join(_ctx(3), seed=5, wait=True)
    assert c.state == "waiting" and c.slot is None
    drive.tick()
    assert set(drive.reports[-1].chunks) == {a.key, b.key}
    pool.leave(a)
    assert c.state == "active"
    for _ in range(2):
        report = drive.tick()
        assert c.key in report.chunks
    assert _max_diff(drive.got[c.key], _solo(wan, config, 5, 2, {0: 3})) <= TOL
    assert pool.nbytes == _expected_pool_bytes(wan, config, 2)


def test_a_budget_that_holds_no_session_is_refused_before_allocating(wan, monkeypatch):
    config = CONFIGS["bf16-evicting"]
    probe = SessionPool(wan, H, W, config, max_sessions=1)
    need = probe.bytes_needed(1, 1)

    def no_allocation(*args, **kwargs):
        raise AssertionError("the KV slots were allocated")

    monkeypatch.setattr(KVSlotPool, "__init__", no_allocation)
    with pytest.raises(InputError) as refused:
        SessionPool(wan, H, W, config, max_sessions=4, max_bytes=sum(need.values()) - 1, where="test pool")
    parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in need.items() if v)
    assert str(refused.value) == (
        f"test pool: input 'max_sessions': not one session fits: a session needs about "
        f"{format_bytes(sum(need.values()))} ({parts}) and the budget is {format_bytes(sum(need.values()) - 1)}; "
        "refused before allocating. Use a smaller window_frames, kv_dtype int8 / int4, or a smaller width / height"
    )
    assert list(need) == ["KV slots", "prompt rows", "clean latents", "batch activations", "stream decoders"]


def _live_tensor_bytes() -> int:
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if type(obj) in (torch.Tensor, torch.nn.Parameter):
                storage = obj.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        except (RuntimeError, ReferenceError):
            continue
    return total


def test_memory_stays_flat_over_a_long_run_of_joins_and_leaves(wan):
    """150 ticks; a session joins every 3 ticks and leaves after 7 chunks, one is suspended and resumed every 5
    ticks: the storage is the same tensors throughout, the live tensors and the resident memory do not grow, the
    logs stay bounded and closed sessions are dropped."""
    config = CausalConfig(chunk_frames=1, window_frames=3, sink_frames=1, kv_dtype="int8", keep_recent_chunks=0,
                          steps=1)  # fmt: skip
    pool = SessionPool(wan, H, W, config, max_sessions=4)
    storage = {name: t.data_ptr() for name, t in pool.kv.tensors.items()}
    nbytes = pool.nbytes
    live: list = []
    seed = 0
    chunks = 0
    settled_rss = settled_tensors = None
    for tick in range(150):
        if tick % 3 == 0:
            seed += 1
            live.append(pool.join(_ctx(seed % 5), seed=seed, chunks=7, wait=True))
        if tick % 5 == 4 and live and live[0].state == "active":
            pool.suspend(live[0])
            pool.resume(live[0], wait=True)
        report = pool.tick()
        chunks += len(report.chunks)
        for s in list(live):
            s.take()
            if s.chunks_left == 0:
                pool.leave(s)
                live.remove(s)
        if tick == 40:
            settled_rss, settled_tensors = settled_rss_mib(), _live_tensor_bytes()
    assert chunks > 140 and pool.ticks == 150
    assert {name: t.data_ptr() for name, t in pool.kv.tensors.items()} == storage
    assert pool.nbytes == nbytes
    assert len(pool.tick_log) == RECENT_CHUNKS and len(pool.report()["ticks"]) == RECENT_CHUNKS
    assert len(pool.sessions) <= 4 + 1 and len(pool._waiting) <= 1
    assert all(len(s.stats.pool_recent) <= RECENT_CHUNKS for s in pool.sessions.values())
    assert _live_tensor_bytes() <= settled_tensors
    grown = settled_rss_mib() - settled_rss
    assert grown < 8, f"resident memory grew {grown:.1f} MiB"


def test_session_statistics_stay_bounded(wan):
    config = CausalConfig(chunk_frames=1, window_frames=2, steps=1)
    pool = SessionPool(wan, H, W, config, max_sessions=1)
    s = pool.join(_ctx())
    for _ in range(RECENT_CHUNKS + 6):
        pool.tick()
        s.take()
    assert s.stats.chunks_generated == RECENT_CHUNKS + 6
    assert len(s.stats.pool_recent) == len(s.stats.recent) == RECENT_CHUNKS
    assert s.stats.pool_recent[-1].index == RECENT_CHUNKS + 5


# -- refusals -------------------------------------------------------------------------------------------------------
def test_bad_pool_settings_are_refused_with_their_message(wan):
    config = CONFIGS["bf16-evicting"]
    for bad, message in [
        ({"max_sessions": 0}, "input 'max_sessions': expected at least 1 session, got 0"),
        ({"max_sessions": 2.0}, "input 'max_sessions': expected at least 1 session, got 2.0"),
        ({"buckets": ()}, "input 'buckets': batch sizes must be positive integers, got ()"),
        ({"buckets": (0, 2)}, "input 'buckets': batch sizes must be positive integers, got (0, 2)"),
        ({"buckets": (1.5,)}, "input 'buckets': batch sizes must be positive integers, got (1.5,)"),
    ]:
        with pytest.raises(InputError) as refused:
            SessionPool(wan, H, W, config, where="test pool", **bad)
        assert str(refused.value) == f"test pool: {message}"
    with pytest.raises(InputError, match=r"^input 'width': 44 px is not a positive multiple of 16"):
        SessionPool(wan, H, 44, config)


def test_a_sharded_run_is_refused(wan):
    sharded = types.SimpleNamespace(weights_keeper=lambda: None, blocks=RunBlocks(sharding=object()),
                                    backends=DEFAULT_BACKENDS, base_model=wan)  # fmt: skip
    with pytest.raises(InputError) as refused:
        SessionPool(wan, H, W, CONFIGS["bf16-evicting"], run=sharded, where="test pool")
    assert str(refused.value) == (
        "test pool: input 'pool': a session pool runs on one device; this run is sharded over a worker pool (run "
        "it without sequence parallelism)"
    )


def test_a_pool_placed_on_a_worker_pool_is_refused():
    handle = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32, seed=2)
    with pytest.raises(InputError) as refused:
        open_session_pool(handle, H, W, CONFIGS["bf16-evicting"], where="test pool",
                          options=RunOptions(pool=object()))  # fmt: skip
    assert str(refused.value) == (
        "test pool: input 'pool': a session pool runs in this process on one device; it cannot be placed on a "
        "worker pool"
    )


def test_bad_joins_and_session_operations_are_refused_with_their_message(wan):
    pool = SessionPool(wan, H, W, CONFIGS["bf16-evicting"], max_sessions=2, where="test pool")
    nan = _ctx()
    nan[0, 3, 5] = float("nan")
    for kwargs, message in [
        ({"context": torch.randn(1, 9, 100)}, "input 'context': conditioning is [1, 9, 100]; Wan expects umT5 "
         "tokens [batch, tokens, 4096] (e.g. CLIPTextEncode with the umt5_xxl text encoder)"),
        ({"context": _ctx().expand(2, -1, -1)}, "input 'context': conditioning batch 2 differs from the session's 1"),
        ({"context": nan}, "input 'context': conditioning: 1 of 36864 values are NaN or infinite (the first at "
         "index [0, 3, 5])"),
        ({"context": _ctx(), "seed": -1}, "input 'seed': expected an integer in [0, 2^64 - 1], got -1"),
        ({"context": _ctx(), "chunks": 0}, "input 'chunks': expected at least 1 chunk (or None: until it leaves), "
         "got 0"),
    ]:  # fmt: skip
        with pytest.raises(InputError) as refused:
            pool.join(**kwargs)
        assert str(refused.value) == f"test pool: {message}"
    assert pool.sessions == {}  # nothing was admitted
    a, b = pool.join(_ctx(1)), pool.join(_ctx(2))
    with pytest.raises(
        InputError, match=r"^test pool: input 'context': conditioning: 1 of 36864 values are NaN"
    ):
        pool.set_prompt(a, nan)
    waiting = pool.join(_ctx(3), wait=True)
    for call, message in [
        (
            lambda: pool.suspend(waiting),
            f"input 'session': {waiting.key} is waiting, not active: it holds no slot",
        ),
        (lambda: pool.resume(a), f"input 'session': {a.key} is active, not suspended"),
        (lambda: pool.resume(waiting), f"input 'session': {waiting.key} is waiting, not suspended"),
    ]:
        with pytest.raises(InputError) as refused:
            call()
        assert str(refused.value) == f"test pool: {message}"
    pool.suspend(a)  # frees a slot: the queued join takes it
    assert waiting.state == "active"
    with pytest.raises(InputError) as refused:
        pool.suspend(a)
    assert (
        str(refused.value)
        == f"test pool: input 'session': {a.key} is suspended, not active: it holds no slot"
    )
    pool.leave(b)
    pool.leave(b)  # a second leave is no error
    assert b.state == "closed" and pool.resume(a) and a.state == "active"
    with pytest.raises(InputError) as refused:
        pool.suspend(b)
    assert str(refused.value) == f"test pool: input 'session': {b.key} is not a live session of this pool"
    pool.close()
    assert pool.nbytes == 0 and a.state == waiting.state == "closed"
    closed = "test pool: input 'pool': this session pool was closed; open a new one"
    for call in (lambda: pool.join(_ctx()), pool.tick, lambda: pool.suspend(a)):
        with pytest.raises(InputError) as refused:
            call()
        assert str(refused.value) == closed


def test_a_row_with_non_finite_output_stops_only_its_session(wan):
    """A finite prompt that overflows float32 in the model (1e30 everywhere) makes that row Inf / NaN: its session
    is stopped with the reason and its slot freed; the others go on as their solo sessions, and a session that
    joins into the freed slot too."""
    config = CONFIGS["bf16-evicting"]
    pool = SessionPool(wan, H, W, config, max_sessions=3, where="test pool")
    drive = Driver(pool)
    a = pool.join(_ctx(1), seed=3)
    drive.tick()
    bad = pool.join(torch.full((1, 9, 4096), 1e30), seed=4)
    bad_slot = bad.slot
    c = pool.join(_ctx(3), seed=5)
    report = drive.tick()
    assert report.batches == (3,)
    message = (
        f"test pool: input 'model': {bad.key}: chunk 0 (latent frames 0-1): the denoised latents hold NaN or "
        "infinite values; the session was stopped"
    )
    assert report.failed == {bad.key: message} and str(bad.error) == message
    assert bad.state == "closed" and bad.why == "non-finite output" and bad.key not in report.chunks
    d = pool.join(_ctx(4), seed=6)
    assert d.slot == bad_slot
    for _ in range(2):
        drive.tick()
    assert _max_diff(drive.got[a.key], _solo(wan, config, 3, 4, {0: 1})) <= TOL
    assert _max_diff(drive.got[c.key], _solo(wan, config, 5, 3, {0: 3})) <= TOL
    assert _max_diff(drive.got[d.key], _solo(wan, config, 6, 2, {0: 4})) <= TOL


# -- scheduling and metrics -----------------------------------------------------------------------------------------
def test_ticks_are_round_robin_served_longest_ago_first(wan):
    pool = SessionPool(wan, H, W, CONFIGS["bf16-evicting"], max_sessions=3, buckets=(1,))
    a, b, c = (pool.join(_ctx(i)) for i in (1, 2, 3))
    report = pool.tick()
    assert list(report.chunks) == [a.key, b.key, c.key] and report.batches == report.buckets == (1, 1, 1)
    a.take(), b.take()  # C's consumer has not taken its chunk: C is not served
    report = pool.tick()
    assert list(report.chunks) == [a.key, b.key] and report.batches == (1, 1)
    for s in (a, b, c):
        s.take()
    report = pool.tick()  # C was served longest ago: first
    assert list(report.chunks) == [c.key, a.key, b.key]
    assert [s.stats.chunks_generated for s in (a, b, c)] == [3, 3, 2]
    assert [t["batches"] for t in pool.report()["ticks"]] == [[1, 1, 1], [1, 1], [1, 1, 1]]
    assert pool.report()["sessions"][c.key]["chunks"] == 2


def test_a_session_with_chunks_wanted_stops_when_they_are_done(wan):
    pool = SessionPool(wan, H, W, CONFIGS["bf16-evicting"], max_sessions=2)
    drive = Driver(pool)
    short, long = pool.join(_ctx(1), chunks=2), pool.join(_ctx(2))
    for _ in range(4):
        drive.tick()
    assert len(drive.got[short.key]) == 2 and len(drive.got[long.key]) == 4
    assert short.state == "active" and short.chunks_left == 0 and not short.ready


class FakeClock:
    """perf_counter for the pool module: set by the test, advanced 0.01 s by every forward."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_pool_timing_waited_latency_and_deadlines(wan, monkeypatch):
    """chunk_frames 2 at 16 fps: the first chunk is due within (4*2 - 3) / 16 = 0.3125 s, the next ones within
    8 / 16 = 0.5 s of their due time. With buckets (1,) the second batch of a tick waits for the first."""
    clock = FakeClock()
    monkeypatch.setattr(session_pool_module, "time", clock)
    config = CausalConfig(chunk_frames=2, window_frames=4, steps=2)
    pool = SessionPool(wan, H, W, config, max_sessions=2, buckets=(1,))
    forward = pool._forward

    def timed_forward(*args, **kwargs):
        clock.now += 0.01
        return forward(*args, **kwargs)

    monkeypatch.setattr(pool, "_forward", timed_forward)
    a, b = pool.join(_ctx(1)), pool.join(_ctx(2))  # due at 0
    clock.now = 0.28
    pool.tick()  # A: 2 steps (0.30); B starts at 0.30, done at 0.32: late for a first chunk, not for a later one
    ta, tb = a.stats.pool_recent[-1], b.stats.pool_recent[-1]
    assert (ta.waited, ta.latency, ta.deadline_met) == (pytest.approx(0.28), pytest.approx(0.30), True)
    assert (tb.waited, tb.latency, tb.deadline_met) == (pytest.approx(0.30), pytest.approx(0.32), False)
    assert (ta.batch, ta.bucket, ta.tick, ta.index, ta.start_frame) == (1, 1, 0, 0, 0)
    clock.now = 1.0
    a.take(), b.take()  # due at 1.0
    clock.now = 1.45
    pool.tick()  # each: a commit and 2 steps; A done at 1.48, B starts at 1.48 and is done at 1.51
    ta, tb = a.stats.pool_recent[-1], b.stats.pool_recent[-1]
    assert (ta.waited, ta.latency, ta.deadline_met) == (pytest.approx(0.45), pytest.approx(0.48), True)
    assert (tb.waited, tb.latency, tb.deadline_met) == (pytest.approx(0.48), pytest.approx(0.51), False)
    assert (ta.index, ta.start_frame, ta.tick) == (1, 2, 1)
    assert a.stats.deadlines_met == 2 and b.stats.deadlines_met == 0
    assert pool.report()["sessions"][a.key]["deadlines_met"] == 2
    assert all(t.waited <= t.latency for s in (a, b) for t in s.stats.pool_recent)


# -- compile ----------------------------------------------------------------------------------------------------------
def _compile_scenario(handle, config, record_keys=None):
    """Joins at ticks 0 / 1 / 2 (batches of 1, 2, 3 rows), 5 ticks: the windows fill, then the steps unmask."""
    pool, compiled = open_session_pool(handle, H, W, config, max_sessions=3, buckets=(1, 2, 4))
    drive = Driver(pool)
    for i in range(3):
        pool.join(_ctx(i + 1), seed=i + 3)
        drive.tick()
    for _ in range(2):
        drive.tick()
    return drive, compiled


@pytest.fixture
def forward_keys(monkeypatch):
    """(bucket, masked, which rows' windows are full) of every batched forward: what a captured step is keyed by
    besides the addresses (a mixed batch attends in two calls: another graph)."""
    keys = []
    prepare = BatchedKV.prepare

    def recording(self, slots, caches):
        prepare(self, slots, caches)
        keys.append((self.rows, self.key_mask() is not None, self._pattern))

    monkeypatch.setattr(BatchedKV, "prepare", recording)
    return keys


def test_the_batched_step_replays_one_graph_per_bucket_and_phase(forward_keys):
    """CUDA graphs (emulated on the CPU, tests/compile_doubles.py) through open_session_pool: one capture per
    bucket size and phase (the masked step while a window fills, the unmasked one after, and a batch mixing both),
    replayed for every other forward, bit-exact with eager."""
    handle = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32, seed=2)
    config = CausalConfig(chunk_frames=2, window_frames=4, steps=2)
    eager, _ = _compile_scenario(handle, config)
    forward_keys.clear()
    graphed, run = _compile_scenario(attach_compile(handle, "off", "whole", graph_segments=EMULATED), config)
    telemetry = run.finish()
    assert graphed.batches() == eager.batches() == [((1,), (1,)), ((2,), (2,)), ((3,), (3,)), ((3,), (3,)),
                                                    ((3,), (3,))]  # fmt: skip
    for key, chunks in eager.got.items():
        assert all(torch.equal(a.latents, b.latents) for a, b in zip(graphed.got[key], chunks)), key
    keys = collections.Counter(forward_keys)
    assert {(rows, masked) for rows, masked, _ in keys} == {(1, True), (2, True), (3, True), (3, False)}
    assert (3, True, (True, True, False)) in keys  # a mixed batch: two full windows beside a filling one
    g = telemetry.graphs
    # a warm-up per key, a capture at its second forward, every later forward of it a replay
    assert (g.captures, g.warmups, g.misses, g.hits) == (
        sum(n >= 2 for n in keys.values()),
        len(keys),
        0,
        sum(max(0, n - 2) for n in keys.values()),
    )


@pytest.mark.slow
def test_the_batched_step_compiles_once_per_bucket_and_phase():
    """compile full with static shapes through open_session_pool: one entry per bucket and phase, recompiled only
    for a new bucket size (never between the commit pass and the steps), equal to eager."""
    torch._dynamo.reset()
    handle = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32, seed=2)
    config = CausalConfig(chunk_frames=2, window_frames=4, steps=2)
    eager, _ = _compile_scenario(handle, config)
    compiled, run = _compile_scenario(attach_compile(handle, "full", backend="eager", dynamic=False), config)
    telemetry = run.finish()
    for key, chunks in eager.got.items():
        assert (
            max((a.latents - b.latents).abs().max().item() for a, b in zip(compiled.got[key], chunks)) <= TOL
        )
    assert [(f.name, f.recompile_reason) for f in telemetry.frames] == [
        ("causal_step_filling", None),
        ("causal_step_filling", "tensor 'args[0]' size mismatch at index 0. expected 1, actual 2"),
        ("causal_step_filling", "tensor 'args[0]' size mismatch at index 0. expected 2, actual 3"),
        ("causal_step_full", None),
    ]
    assert telemetry.graph_breaks == {}


# -- cancel -----------------------------------------------------------------------------------------------------------
class TickCancelledError(Exception):
    pass


def _cancel_at(tick_calls: list, when):
    """A before_forward hook that raises at its call whose step is ``when`` (None: the commit pass), once."""

    def hook(step):
        tick_calls.append(step)
        if step == when and tick_calls.count(when) == 1:
            raise TickCancelledError

    return hook


@pytest.mark.parametrize("when", [None, 0, 1], ids=["commit", "step0", "step1"])
def test_a_cancelled_tick_leaves_every_session_as_before_and_the_video_goes_on(wan, when):
    config = CONFIGS["int8-sink2-cache"]

    def scenario(cancel: bool):
        pool = SessionPool(wan, H, W, config, max_sessions=3)
        drive = Driver(pool)
        sessions = [pool.join(_ctx(i + 1), seed=i + 3) for i in range(3)]
        for _ in range(2):
            drive.tick()
        if cancel:
            before = [
                (s.generator.get_state(), s.frames_generated, s.stats.chunks_generated) for s in sessions
            ]
            calls = []
            with pytest.raises(TickCancelledError):
                pool.tick(before_forward=_cancel_at(calls, when))
            assert calls[-1] == when and pool.ticks == 2
            after = [
                (s.generator.get_state(), s.frames_generated, s.stats.chunks_generated) for s in sessions
            ]
            assert all(torch.equal(a[0], b[0]) and a[1:] == b[1:] for a, b in zip(before, after))
            assert all(s.outbox is None and s.ready for s in sessions)
        for _ in range(3):
            drive.tick()
        return drive

    cancelled, whole = scenario(True), scenario(False)
    assert cancelled.batches() == whole.batches()
    for key, chunks in whole.got.items():
        assert all(torch.equal(a.latents, b.latents) for a, b in zip(cancelled.got[key], chunks)), key


def test_a_tick_cancelled_in_its_second_batch_keeps_the_first_batchs_chunks(wan):
    """buckets (1,): each session is its own batch; a cancel in the second batch leaves the first session's chunk
    in its outbox (its consumer takes it), the others as before the tick; every video goes on unchanged."""
    config = CONFIGS["bf16-sink1-absolute"]
    pool = SessionPool(wan, H, W, config, max_sessions=3, buckets=(1,))
    drive = Driver(pool)
    sessions = [pool.join(_ctx(i + 1), seed=i + 3) for i in range(3)]
    drive.tick()
    states = [s.generator.get_state() for s in sessions]
    calls = []

    def hook(step):
        calls.append(step)
        if len(calls) == 5:  # the first batch ran its commit and 2 steps; the second its commit and 1 step
            raise TickCancelledError

    with pytest.raises(TickCancelledError):
        pool.tick(before_forward=hook)
    first, *rest = sessions
    assert first.outbox is not None and first.outbox.index == 1
    assert all(s.outbox is None and torch.equal(s.generator.get_state(), g) for s, g in zip(rest, states[1:]))
    drive.got[first.key].append(first.take())
    for _ in range(2):
        drive.tick()
    for i, s in enumerate(sessions):
        got = drive.got[s.key]
        reference = _solo(wan, config, i + 3, len(got), {0: i + 1})
        assert all(torch.equal(a.latents, b.latents) for a, b in zip(got, reference)), s.key
    assert [len(drive.got[s.key]) for s in sessions] == [4, 3, 3]


def test_a_resume_that_fails_to_restore_leaves_the_session_suspended_and_the_slot_free(wan, monkeypatch):
    config = CONFIGS["bf16-sink1-absolute"]
    pool = SessionPool(wan, H, W, config, max_sessions=2, where="test pool")
    drive = Driver(pool)
    a = pool.join(_ctx(1), seed=3)
    drive.tick()
    pool.suspend(a)

    def failing(state, session, pool=None):
        raise InputError("session", "the saved state does not fit")

    with monkeypatch.context() as patch:
        patch.setattr(session_pool_module, "restore_state", failing)
        with pytest.raises(InputError, match="the saved state does not fit"):
            pool.resume(a)
    assert a.state == "suspended" and a.slot is None and a.saved is not None
    assert pool._free_slots == [0, 1] and pool.ready() == []  # no half-restored session runs
    assert pool.resume(a) and a.state == "active"
    for _ in range(2):
        drive.tick()
    assert _max_diff(drive.got[a.key], _solo(wan, config, 3, 3, {0: 1})) <= TOL


def test_suspend_idle_waits_for_a_running_tick(wan):
    """The idle policy run by another thread during a tick suspends nothing mid-tick: it runs once the tick is
    done (the pool's lock), and then suspends the session whose chunk is left untaken."""
    pool = SessionPool(wan, H, W, CONFIGS["bf16-evicting"], max_sessions=2)
    s = pool.join(_ctx(1))
    pool.tick()  # its chunk is left untaken; the next tick serves nobody but still runs
    other = pool.join(_ctx(2))
    suspended, watcher = [], []

    def hook(step):
        if not watcher:
            watcher.append(
                threading.Thread(target=lambda: suspended.extend(pool.suspend_idle(0.0, now=1e12)))
            )
            watcher[0].start()
            watcher[0].join(0.2)
            assert watcher[0].is_alive() and s.state == "active"  # held back by the running tick

    pool.tick(before_forward=hook)
    watcher[0].join()
    assert suspended == [s, other] and s.state == other.state == "suspended"


def test_a_prompt_switch_asked_before_a_suspend_takes_effect_after_the_resume(wan):
    config = CONFIGS["int4-sink1-cache"]
    pool = SessionPool(wan, H, W, config, max_sessions=2)
    drive = Driver(pool)
    s = pool.join(_ctx(1), seed=3)
    for _ in range(2):
        drive.tick()
    pool.set_prompt(s, _ctx(5))
    pool.join(_ctx(2), seed=4)
    waiting = pool.join(_ctx(3), seed=6, wait=True)
    pool.suspend(s)  # the queued join takes its slot
    assert waiting.state == "active" and s.slot is None
    drive.tick()
    pool.leave(waiting)
    assert pool.resume(s)
    for _ in range(2):
        drive.tick()
    _assert_follows(drive.got[s.key], _solo_with_tiers(wan, config, 3, 4, {0: 1, 2: 5}))


def test_padded_rows_and_other_sessions_write_nothing_into_an_idle_sessions_slot(wan):
    """A tick of two sessions in the bucket of 4 (two padded rows reading the first row's slot) leaves every
    buffer of a third session's slot, and its prompt rows, bit for bit as they were."""
    config = CONFIGS["int8-sink2-cache"]
    pool = SessionPool(wan, H, W, config, max_sessions=4, buckets=(4,))
    idle, b, c = (pool.join(_ctx(i), seed=i) for i in (1, 2, 3))
    for _ in range(4):
        pool.tick()
        b.take(), c.take(), idle.take()
    pool.tick()  # idle's consumer does not take this one: idle is not served by the next ticks

    def idle_rows():
        rows = {name: pool.kv.slot_rows(name, idle.slot).clone() for name in pool.kv.tensors}
        rows.update(
            {f"cross{i}": torch.stack([k[idle.slot], v[idle.slot]]) for i, (k, v) in enumerate(pool.cross)}
        )
        return rows

    before = idle_rows()
    for _ in range(3):
        b.take(), c.take()
        report = pool.tick()
        assert report.batches == (2,) and report.buckets == (4,)
    after = idle_rows()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_host_copies_and_queued_joins_are_bounded(wan):
    """Suspended sessions hold host memory and queued joins hold their prompts: both are bounded (max_suspended,
    max_waiting), so a pool's host memory stays bounded however clients behave; the idle policy stops at the bound."""
    config = CausalConfig(chunk_frames=2, window_frames=4, steps=2)
    pool = SessionPool(wan, H, W, config, max_sessions=2, max_suspended=1, max_waiting=1)
    a, b = pool.join(_ctx(1), seed=1), pool.join(_ctx(2), seed=2)
    pool.tick()
    state = pool.suspend(a)
    assert pool.host_bytes == state.nbytes > 0
    with pytest.raises(InputError) as err:
        pool.suspend(b)
    assert str(err.value) == (
        f"input 'session': 1 sessions already wait in host memory ({format_bytes(state.nbytes)}); the pool keeps at most 1 "
        "(max_suspended): resume or close one first"
    )
    c = pool.join(_ctx(3), seed=3)  # a's freed slot
    assert c.state == "active"
    waiting = pool.join(_ctx(4), seed=4, wait=True)
    assert waiting.state == "waiting"
    with pytest.raises(InputError) as err:
        pool.join(_ctx(5), seed=5, wait=True)
    assert str(err.value) == (
        "input 'pool': all 2 slots hold active sessions and 1 joins already wait for one (max_waiting); try again later"
    )
    pool.tick()  # nobody takes: b and c are idle; one host copy is held already, so the policy suspends none
    assert pool.suspend_idle(0.0) == [] and b.state == c.state == "active"
    for name, value in (("max_suspended", -1), ("max_waiting", 1.5)):
        with pytest.raises(InputError, match=f"input '{name}': expected a count >= 0, got {value}"):
            SessionPool(wan, H, W, config, max_sessions=1, **{name: value})


def test_a_refused_join_takes_no_key_and_pool_options_pass_through_open_session_pool():
    handle = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32, seed=2)
    config = CausalConfig(chunk_frames=2, window_frames=4, steps=2)
    pool, _ = open_session_pool(handle, H, W, config, max_sessions=1, max_waiting=0, max_suspended=0)
    assert (pool.max_waiting, pool.max_suspended) == (0, 0)
    first = pool.join(_ctx(1), seed=1)
    with pytest.raises(InputError, match="all 1 slots hold active sessions"):
        pool.join(_ctx(2), seed=2)
    with pytest.raises(InputError, match="0 joins already wait for one"):
        pool.join(_ctx(2), seed=2, wait=True)
    pool.leave(first)
    assert pool.join(_ctx(3), seed=3).key == "s2"  # the refused joins used no key
