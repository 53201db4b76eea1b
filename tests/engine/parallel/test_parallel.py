"""Sequence and data parallelism on gloo worker pools (CPU; 2 ranks, 4 for USP) against single-process results;
failures (killed, stopped, unreachable workers) and shutdown leave no process behind."""

from __future__ import annotations

import functools
import importlib
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, fake_comfy_memory_manager, load_pack_as_comfyui, make_cond

from fewstep.engine import InputError, open_model, sample_latent
from fewstep.engine.backends import DEFAULT_BACKENDS, Backends
from fewstep.engine.causal import CausalConfig, VideoSession
from fewstep.engine.parallel import (
    ParallelConfig,
    ParallelError,
    RemoteVideoSession,
    WorkerPool,
    check_sequence_parallel,
    parallel_sample,
)
from fewstep.engine.parallel.client import check_local_workers_fit
from fewstep.engine.parallel.jobs import WorkerContext
from fewstep.engine.parallel.mesh import shard
from fewstep.engine.parallel.worker import connect
from fewstep.engine.preflight import budget
from fewstep.engine.preflight.ledger import LEDGER, Holding
from fewstep.engine.run import RunOptions

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is needed"
)

TOL = 1e-5


def _config(**changes) -> ParallelConfig:
    values = {"mode": "sp", "ulysses_degree": 2, "backend": "gloo", "timeout": 30.0, "threads_per_rank": 1}
    return ParallelConfig(**{**values, **changes})


def _gone(pid: int) -> bool:
    """No such process, not even a zombie (os.kill(pid, 0) succeeds on zombies; /proc shows them)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return not os.path.exists(f"/proc/{pid}")
    return False


def _wait_gone(pids, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return all(_gone(p) for p in pids)


@pytest.fixture(scope="module")
def pool():
    pool = WorkerPool(_config()).start()
    yield pool
    pids = pool.pids()
    pool.shutdown()
    assert _wait_gone(pids)


@pytest.fixture(scope="module")
def flux():
    return open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def wan():
    return open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32)


def _qkv(text: int, image: int, heads: int = 4, dim: int = 8, batch: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, text + image, heads, dim, generator=g) for _ in range(3)]


def _parallel_attention(pool, q, k, v, text, degrees):
    args = {"q": q, "k": k, "v": v, "replicated_prefix": text, "degrees": degrees}
    return pool.run({"kind": "task", "name": "sequence_attention", "args": args})


# -- the attention entry point ------------------------------------------------------------------------------------
def test_single_process_attention_ignores_the_parallel_arguments():
    q, k, v = _qkv(3, 6)
    attention = DEFAULT_BACKENDS.attention
    plain = attention(q, k, v)
    assert DEFAULT_BACKENDS.parallel is None
    assert torch.equal(attention(q, k, v, replicated_prefix=3), plain)
    assert torch.equal(attention(q, k, v, replicated_kv=True), plain)


def test_a_parallel_plan_receives_the_calls_except_replicated_kv():
    calls = []

    class Plan:
        def attention(self, q, k, v, *, mask, replicated_prefix, local):
            calls.append(replicated_prefix)
            return local(q, k, v, mask=mask)

    q, k, v = _qkv(3, 6)
    plain = DEFAULT_BACKENDS.attention(q, k, v)
    planned = Backends().with_parallel(Plan())
    assert torch.equal(planned.attention(q, k, v, replicated_prefix=3), plain)
    assert torch.equal(planned.attention(q, k, v, replicated_kv=True), plain)
    assert DEFAULT_BACKENDS.parallel is None  # the plan lives in the run's value, nowhere else
    assert calls == [3]  # the replicated-kv call ran locally, without the plan


@pytest.mark.parametrize("degrees", [(2, 1), (1, 2)], ids=["ulysses", "ring"])
@pytest.mark.parametrize("text", [0, 5], ids=["self", "joint-text"])
def test_sequence_parallel_attention_equals_single_process(pool, degrees, text):
    q, k, v = _qkv(text, 12)
    out = _parallel_attention(pool, q, k, v, text, degrees)
    assert out["out"].shape == q.shape
    assert (out["out"] - DEFAULT_BACKENDS.attention(q, k, v)).abs().max() <= TOL
    assert out["text_spread"] <= TOL  # every rank holds the same text rows
    # bytes this rank sent, against the formulas (fp32; shard S = 12 / 2 tokens, B 2, H 4, D 8)
    shard_bytes = 2 * 6 * 4 * 8 * 4
    u, r = degrees
    expected = {}
    if u > 1:
        expected["all_to_all"] = 4 * shard_bytes * (u - 1) // u
        if text:
            expected["gather_heads"] = (u - 1) * 2 * text * (4 // u) * 8 * 4
    if r > 1:
        expected["ring"] = (r - 1) * 2 * shard_bytes
    assert out["comm"]["bytes_sent"] == expected


@pytest.mark.slow
def test_usp_on_four_ranks_equals_single_process():
    """2 x 2 (Ulysses inside pairs, ring across them), and the pool's other splits, with joint text tokens."""
    pool4 = WorkerPool(_config(ulysses_degree=2, ring_degree=2)).start()
    try:
        q, k, v = _qkv(5, 16, heads=4)
        reference = DEFAULT_BACKENDS.attention(q, k, v)
        for degrees in ((2, 2), (4, 1), (1, 4)):
            out = _parallel_attention(pool4, q, k, v, 5, degrees)
            assert (out["out"] - reference).abs().max() <= TOL, degrees
            assert out["text_spread"] <= TOL
        assert out["comm"]["bytes_sent"] == {"ring": 3 * 2 * (2 * 4 * 4 * 8 * 4)}  # (1, 4): S = 4
    finally:
        pids = pool4.pids()
        pool4.shutdown()
    assert _wait_gone(pids)


# -- whole runs ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("degrees", [(2, 1), (1, 2)], ids=["ulysses", "ring"])
def test_flux_sampling_on_two_ranks_equals_single_process(pool, flux, degrees):
    cond, neg = make_cond(flux.params, tokens=7, seed=1), make_cond(flux.params, tokens=7, seed=2)
    latent = torch.zeros(2, 16, 16, 12)  # 8 x 6 = 48 image tokens, 24 per rank
    kwargs = {"negative": [neg], "cfg": 2.5, "seed": 5, "steps": 4}
    reference, ref_report = sample_latent(flux, [cond], latent, **kwargs)
    steps = []
    out, report = parallel_sample(
        pool, flux, [cond], latent, degrees=degrees, callback=steps.append, **kwargs
    )
    assert out.shape == reference.shape
    assert (out - reference).abs().max() <= TOL
    assert [s["i"] for s in steps] == [0, 1, 2, 3]
    assert report.model_calls == ref_report.model_calls and report.cfg_used
    assert "sequence parallel" in report.notes[-1]


def test_data_parallel_splits_the_batch_and_equals_single_process(pool, flux):
    cond = make_cond(flux.params, tokens=6, seed=3, batch=3)
    latent = torch.zeros(3, 16, 8, 8)
    reference, _ = sample_latent(flux, [cond], latent, seed=9, steps=3, schedule="flux.1-dev")
    out, report = parallel_sample(
        pool, flux, [cond], latent, seed=9, steps=3, schedule="flux.1-dev", mode="dp"
    )
    assert (out - reference).abs().max() <= TOL
    assert report.rows_evaluated == 3 * 3 and "data parallel" in report.notes[-1]


@pytest.mark.parametrize("degrees", [(2, 1), (1, 2)], ids=["ulysses", "ring"])
def test_causal_video_chunks_on_two_ranks_equal_single_process(pool, wan, degrees):
    """Each rank caches its share (Ulysses: its heads; ring: its tokens); continuing and a prompt switch too."""
    ctx = torch.randn(1, 9, 4096, generator=torch.Generator().manual_seed(1))
    other = torch.randn(1, 5, 4096, generator=torch.Generator().manual_seed(2))
    config = CausalConfig(chunk_frames=2, window_frames=5, sink_frames=1)
    local = VideoSession(wan.model, ctx, 32, 48, config, seed=3)  # 2 x 3 tokens per frame
    expected = [c.latents for c in local.run(2)]
    local.set_prompt(other)
    expected += [c.latents for c in local.run(2)]
    remote = RemoteVideoSession(pool, wan, ctx, 32, 48, config, seed=3, degrees=degrees)
    got = [c.latents for c in remote.run(2)]
    remote.set_prompt(other)
    got += [c.latents for c in remote.run(2)]
    assert (torch.cat(got, 2) - torch.cat(expected, 2)).abs().max() <= TOL
    assert remote.frames_generated == local.frames_generated == 8
    u, r = degrees
    p = wan.params
    assert remote.cache.bytes_per_token() == 2 * (p.num_heads // u) * p.head_dim * p.num_layers * 4
    assert remote.stats.recent[-1].kv_bytes == local.cache.nbytes // (u * r)  # this rank's share
    # the session's size (the session store counts it) is what its ranks allocate, all together
    assert (
        remote.stats.recent[-1].kv_bytes == remote.kv_bytes_per_rank and remote.nbytes == local.cache.nbytes
    )


class _CancelledByHookError(Exception):
    pass


def test_a_pool_video_reports_every_forward_and_cancel_stops_within_one(pool, wan):
    """The host hears of each forward the ranks run (4 steps per chunk, then the commit of the previous chunk), so
    ComfyUI's Cancel, raised by the hook, stops the ranks before the chunk completes, not at the next chunk."""
    ctx = torch.randn(1, 9, 4096, generator=torch.Generator().manual_seed(1))
    config = CausalConfig(chunk_frames=2, window_frames=6, sink_frames=0, steps=4)
    calls = []
    remote = RemoteVideoSession(pool, wan, ctx, 32, 48, config, seed=3)
    chunks = list(remote.chunks(2, before_forward=lambda chunk, step: calls.append(chunk)))
    assert len(chunks) == 2
    assert len(calls) == 4 + 5  # chunk 1 commits chunk 0 first: one forward more

    def cancel_on_second(chunk, step, seen=[]):  # noqa: B006 - a counter local to this hook
        seen.append(chunk)
        if len(seen) == 2:
            raise _CancelledByHookError

    cancelled = RemoteVideoSession(pool, wan, ctx, 32, 48, config, seed=3)
    got = []
    with pytest.raises(_CancelledByHookError):
        for chunk in cancelled.chunks(3, before_forward=cancel_on_second):
            got.append(chunk)
    assert len(got) < 3  # stopped mid-run (the second forward's report may arrive with the first chunk)
    # the ranks stopped and the pool runs the next job
    again = RemoteVideoSession(pool, wan, ctx, 32, 48, config, seed=3)
    torch.testing.assert_close(next(iter(again.chunks(1))).latents, chunks[0].latents, rtol=0, atol=0)


def test_a_pool_video_session_has_one_caller_at_a_time(pool, wan):
    ctx = torch.randn(1, 9, 4096, generator=torch.Generator().manual_seed(1))
    remote = RemoteVideoSession(pool, wan, ctx, 32, 48, CausalConfig(chunk_frames=2, window_frames=6), seed=3)
    running = remote.chunks(2)
    next(running)  # a job is running on the pool for this session
    with pytest.raises(InputError, match="input 'session': .* used by one caller at a time"):
        list(remote.chunks(1))
    with pytest.raises(InputError, match="input 'session': .* used by one caller at a time"):
        remote.set_prompt(ctx)
    assert len(list(running)) == 1  # the first caller is unaffected
    assert len(list(remote.chunks(1))) == 1 and remote.frames_generated == 6


@pytest.mark.parametrize("degrees", [(2, 1), (1, 2)], ids=["ulysses", "ring"])
def test_wan_forward_on_two_ranks_equals_single_process(pool, wan, degrees):
    """Bidirectional Wan: self-attention over every frame's sharded tokens, cross-attention to the whole prompt."""
    from fewstep.engine.parallel import model_spec

    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 16, 3, 4, 6, generator=g)  # 3 frames x 2 x 3 tokens, 3 per rank per frame
    t = torch.tensor([900.0, 250.0])
    context = torch.randn(2, 7, 4096, generator=g)
    with torch.inference_mode():
        reference = wan.model(x, t, context)
    args = {"model": model_spec(wan), "x": x, "timestep": t, "context": context, "degrees": degrees}
    out = pool.run({"kind": "task", "name": "wan_forward", "args": args})
    assert out["out"].shape == reference.shape
    assert (out["out"] - reference).abs().max() <= TOL
    assert ("all_to_all" in out["comm"]["bytes_sent"]) == (degrees[0] > 1)
    assert ("ring" in out["comm"]["bytes_sent"]) == (degrees[1] > 1)


def test_the_model_is_loaded_once_and_kept(pool, flux):
    cond = make_cond(flux.params, tokens=4)
    parallel_sample(pool, flux, [cond], torch.zeros(1, 16, 8, 8), steps=1)
    before = pool.run({"kind": "task", "name": "ping"})
    parallel_sample(pool, flux, [cond], torch.zeros(2, 16, 8, 8), steps=2, seed=4)
    after = pool.run({"kind": "task", "name": "ping"})
    assert after["models_loaded"] == before["models_loaded"] and after["pid"] == before["pid"]
    other = open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32, seed=7)
    with pytest.raises(InputError, match="weights differ from the model on the host"):
        parallel_sample(
            pool, other.replace(source="dummy:flux-tiny"), [cond], torch.zeros(1, 16, 8, 8), steps=1
        )
    assert pool.alive  # every rank refused before any collective: the pool stays
    patched = open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32)
    parallel_sample(
        pool, patched, [cond], torch.zeros(1, 16, 8, 8), steps=1
    )  # the workers' weights: accepted
    with torch.no_grad():
        patched.model.img_in.weight.mul_(
            1.5
        )  # patched in place after a job (a merged LoRA): refused, not ignored
    with pytest.raises(InputError, match="weights patched in place on the host"):
        parallel_sample(pool, patched, [cond], torch.zeros(1, 16, 8, 8), steps=1)


def test_a_compiled_model_on_the_pool_runs_eagerly_and_says_so(pool, flux):
    from fewstep.engine.compile import attach_compile

    cond = make_cond(flux.params, tokens=4)
    compiled = attach_compile(flux, "regional", backend="eager")
    out, report = parallel_sample(pool, compiled, [cond], torch.zeros(1, 16, 8, 8), steps=1)
    plain, _ = parallel_sample(pool, flux, [cond], torch.zeros(1, 16, 8, 8), steps=1)
    assert torch.equal(out, plain)
    assert "compile: not applied on the pool's workers" in report.summary()


# -- bad input ----------------------------------------------------------------------------------------------------
def test_bad_degrees_heads_and_sequence_are_input_errors(pool, flux, wan):
    with pytest.raises(
        InputError, match=r"ulysses_degree 2 x ring_degree 2 = 4 ranks, but the world size is 3"
    ):
        _config(ring_degree=2, world_size=3).check()
    with pytest.raises(InputError, match="ulysses 2 x ring 2 = 4 ranks, but the pool has 2"):
        parallel_sample(pool, flux, [make_cond(flux.params)], torch.zeros(1, 16, 8, 8), degrees=(2, 2))
    with pytest.raises(InputError, match="12 attention heads, which do not split over ulysses degree 5"):
        check_sequence_parallel((5, 1), 12, 100, "tokens", "latent")
    with pytest.raises(
        InputError, match="input 'latent': 35 image tokens .* do not split over ulysses 2 x ring 1"
    ):
        parallel_sample(pool, flux, [make_cond(flux.params)], torch.zeros(1, 16, 14, 10))
    with pytest.raises(InputError, match="input 'width': 9 tokens per latent frame"):
        RemoteVideoSession(pool, wan, torch.zeros(1, 4, 4096), 48, 48)
    with pytest.raises(InputError, match="input 'kv_dtype': int8 KV storage with ring degree 2"):
        RemoteVideoSession(pool, wan, torch.zeros(1, 4, 4096), 32, 48, CausalConfig(2, 8, kv_dtype="int8"),
                           degrees=(1, 2))  # fmt: skip
    assert pool.alive  # none of these reached the workers


def test_local_workers_that_would_not_fit_in_memory_are_refused_before_loading(pool, flux, monkeypatch):
    monkeypatch.delenv("FEWSTEP_MEMORY_LIMIT_GB", raising=False)
    # the host's figure (the ranks, other processes, keep theirs)
    monkeypatch.setattr(budget, "device_free_bytes", lambda device=None: 1000)
    monkeypatch.setattr(pool, "model_key", None)  # as if the workers held no model yet
    with pytest.raises(
        InputError,
        match=r"input 'parallel': this needs about .* \(2 local workers x .* model weights .*\) but only 900 B of "
        r"available host memory can be used on cpu; refused before allocating. Each local worker loads the whole "
        r"model",
    ):
        parallel_sample(pool, flux, [make_cond(flux.params)], torch.zeros(1, 16, 8, 8), steps=1)
    assert pool.alive


# -- the pool's memory checks are the memory preflight's (no worker process: the checks are called directly) ------
_MIB = 2**20


def _weights_spec(nbytes: int) -> dict:
    return {"source": "dummy:flux-tiny", "dtype": "float32", "weight_dtype": "float32", "attention": "sdpa",
            "weight_bytes": nbytes}  # fmt: skip


def _budget_figures(monkeypatch, free: int, limit_gb: str | None, holdings=()) -> list:
    """The memory preflight's figures, set: the device's free bytes, the pack's limit and holdings. Returns the
    devices the budget was asked about."""
    asked = []
    monkeypatch.setattr(budget, "device_free_bytes", lambda device=None: asked.append(device) or free)
    monkeypatch.setattr(LEDGER, "holdings", lambda *args, **kwargs: list(holdings))
    if limit_gb is None:
        monkeypatch.delenv("FEWSTEP_MEMORY_LIMIT_GB", raising=False)
    else:
        monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", limit_gb)
    return asked


def test_the_hosts_check_of_local_workers_honours_the_memory_limit_and_lists_what_is_held(monkeypatch):
    held = [Holding("worker pool", 1, 100 * _MIB)]
    # the limit decides: 512 MiB less the 100 held leaves 412 MiB, 370.8 MiB of it usable
    asked = _budget_figures(monkeypatch, free=1 << 40, limit_gb="0.5", holdings=held)
    cpu_pool = SimpleNamespace(model_key=None, backend="gloo", procs={0: None, 1: None})
    with pytest.raises(InputError) as refused:
        check_local_workers_fit(cpu_pool, _weights_spec(200 * _MIB))
    assert str(refused.value) == (
        "input 'parallel': this needs about 400.00 MiB (2 local workers x 200.00 MiB model weights 400.00 MiB) but "
        "only 370.80 MiB of available host memory can be used on cpu; refused before allocating. Each local worker "
        "loads the whole model: start fewer local ranks (local_ranks, the degrees) and join the others from other "
        "machines, or use a smaller dtype. FEWSTEP_MEMORY_LIMIT_GB allows the pack 512.00 MiB in all and it already "
        "holds 100.00 MiB on cpu (1 worker pool 100.00 MiB): free some of it (unload models, end video sessions) or "
        "raise the limit"
    )
    assert asked == [torch.device("cpu")]  # the host's memory, through the preflight's budget
    assert cpu_pool.model_key is None  # refused: the model is not marked as loaded
    check_local_workers_fit(cpu_pool, _weights_spec(180 * _MIB))  # 360 MiB fit
    assert cpu_pool.model_key == ("dummy:flux-tiny", "float32", "float32", "sdpa")
    check_local_workers_fit(cpu_pool, _weights_spec(1 << 40))  # the workers hold this model already: no check
    gpu_pool = SimpleNamespace(model_key=None, backend="nccl", procs={0: None, 1: None})
    check_local_workers_fit(gpu_pool, _weights_spec(1 << 40))  # each GPU rank checks its own device
    assert len(asked) == 2


def test_a_ranks_check_before_loading_is_the_memory_preflight_on_its_own_device(monkeypatch):
    rank = WorkerContext(None, _config(), 1, 2, torch.device("cuda", 1), "nccl")  # no store: no job is served
    asked = _budget_figures(monkeypatch, free=1000 * _MIB, limit_gb=None)  # 900 MiB usable
    rank.check_model_fits(_weights_spec(900 * _MIB))
    with pytest.raises(InputError) as refused:
        rank.check_model_fits(_weights_spec(901 * _MIB))
    assert str(refused.value) == (
        "input 'model': this needs about 901.00 MiB (model weights 901.00 MiB) but only 900.00 MiB of free GPU "
        "memory can be used on cuda:1; refused before allocating. Rank 1 holds a whole copy of the model: use fewer "
        "ranks per machine or a smaller dtype"
    )
    assert asked == [torch.device("cuda", 1)] * 2  # the rank's device, read through the preflight's budget
    # the limit caps a rank as it caps the host: 512 MiB, 460.8 MiB of it usable
    _budget_figures(monkeypatch, free=1000 * _MIB, limit_gb="0.5")
    with pytest.raises(
        InputError, match=r"input 'model': .* but only 460.80 MiB of free GPU memory can be used"
    ):
        rank.check_model_fits(_weights_spec(500 * _MIB))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without GPUs")
def test_nccl_without_gpus_is_an_input_error_before_anything_starts():
    with pytest.raises(InputError, match="input 'backend': nccl needs CUDA GPUs and this machine has none"):
        WorkerPool(_config(backend="nccl"))
    assert _config(backend="auto").resolved_backend() == "gloo"


def test_unreachable_master_addr_is_an_error_within_the_timeout():
    closed = _free_port()
    t0 = time.monotonic()
    with pytest.raises(InputError, match=rf"input 'MASTER_ADDR': could not reach the pool's store at 127.0.0.1:{closed} "
                       r"within 1.5 s"):  # fmt: skip
        connect("127.0.0.1", closed, 1.5)
    assert time.monotonic() - t0 < 1.5 + 0.5


def test_a_launcher_address_this_machine_cannot_listen_on_is_refused_at_once(monkeypatch):
    monkeypatch.setenv("FEWSTEP_POOL_ALLOWED_ADDRS", "no.such.host.invalid, 192.0.2.1")  # the administrator's
    t0 = time.monotonic()
    with pytest.raises(InputError, match=r"input 'master_addr': 'no.such.host.invalid' does not resolve"):
        WorkerPool(_config(master_addr="no.such.host.invalid", timeout=30.0)).start()
    with pytest.raises(
        InputError, match=r"input 'master_addr': '192.0.2.1' is not an address of this machine"
    ):
        WorkerPool(_config(master_addr="192.0.2.1", timeout=30.0)).start()  # TEST-NET-1: never local
    assert time.monotonic() - t0 < 10  # not the 30 s store timeout


def test_a_worker_with_the_wrong_world_size_or_rank_is_refused(pool):
    from fewstep.engine.parallel.worker import Rendezvous, serve

    def join(world, rank):
        serve(Rendezvous("127.0.0.1", pool.port, world, rank, 0, timeout=5, token=pool.token))

    with pytest.raises(InputError, match="input 'WORLD_SIZE': 3, but the pool at .* has 2 ranks"):
        join(3, 1)
    with pytest.raises(InputError, match="input 'RANK': 5 is outside the pool's ranks 0..1"):
        join(2, 5)
    with pytest.raises(InputError, match="input 'RANK': rank 1 has already joined this pool"):
        join(2, 1)
    assert pool.run({"kind": "task", "name": "ping"})["world"] == 2


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- failures and shutdown ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("sig", "message"),
    [
        (signal.SIGKILL, r"rank 1 \(pid \d+\) was killed by SIGKILL during the job"),
        (signal.SIGSTOP, r"rank 1 \(pid \d+\) stopped responding"),
    ],
    ids=["killed", "hung"],
)
@pytest.mark.parametrize("job", ["sleep", "sampling"])
@pytest.mark.slow
def test_a_lost_worker_is_an_error_naming_it_and_leaves_no_process(flux, sig, message, job):
    """``sampling``: rank 0 is inside the all-to-alls when rank 1 goes, so it fails too (peer lost, or the
    collective's timeout); the error still names rank 1, the cause."""
    lost = WorkerPool(_config(timeout=2.0)).start()
    pids = lost.pids()
    cond, latent = make_cond(flux.params, tokens=4), torch.zeros(1, 16, 32, 32)
    if job == "sleep":
        run = functools.partial(lost.run, {"kind": "task", "name": "sleep", "args": {"seconds": 60}})
    else:
        parallel_sample(lost, flux, [cond], latent, steps=1)  # the model is loaded: the next job is all steps
        run = functools.partial(parallel_sample, lost, flux, [cond], latent, steps=10_000)
    timer = threading.Timer(0.5, os.kill, (pids[1], sig))
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(ParallelError, match=message):
        run()
    timer.join()
    # the timeout, the heartbeat check period, and (sampling) waiting one timeout for the other rank's report
    assert time.monotonic() - t0 < 0.5 + 2.0 + 2.0 + (2.0 if job == "sampling" else 0.0)
    assert lost.closed and _wait_gone(pids, 5)
    with pytest.raises(ParallelError, match="was shut down"):
        lost.run({"kind": "task", "name": "ping"})


def test_shutdown_leaves_no_process_and_joined_workers_leave_too(monkeypatch):
    """One rank local, one joined as from another machine (``python -m fewstep worker``'s code path)."""
    monkeypatch.setenv("FEWSTEP_POOL_TOKEN", secrets.token_hex(32))  # the joining worker inherits it
    host = WorkerPool(_config(local_ranks=1))
    starter = threading.Thread(target=host.start)
    starter.start()
    while host.port is None:
        time.sleep(0.01)
    code = "import sys, argparse; from fewstep.cli import worker; p = argparse.ArgumentParser(); " \
           "worker.add_arguments(p); sys.exit(worker.run(p.parse_args(sys.argv[1:])))"  # fmt: skip
    joined = subprocess.Popen(
        [sys.executable, "-c", code, "--master-addr", "127.0.0.1", "--master-port", str(host.port),
         "--world-size", "2", "--rank", "1", "--threads", "1"], cwd=ROOT.parent,
    )  # fmt: skip
    starter.join(60)
    assert host.ranks[1]["pid"] == joined.pid
    assert host.run({"kind": "task", "name": "ping"})["world"] == 2
    local = host.pids()
    host.shutdown()
    assert [host.procs[0].returncode, joined.wait(10)] == [0, 0]  # both left on their own
    assert _wait_gone([*local, joined.pid], 5)


def test_a_cancelled_start_stops_the_ranks_it_started(monkeypatch):
    """A rank that never joins (local_ranks 1 of 2) and the user presses Cancel: the wait ends at once."""
    monkeypatch.setenv("FEWSTEP_POOL_TOKEN", secrets.token_hex(32))
    pool = WorkerPool(_config(local_ranks=1))

    class CancelledError(Exception):
        pass

    def interrupt():
        if pool.procs:  # the local rank was started
            raise CancelledError

    t0 = time.monotonic()
    with pytest.raises(CancelledError):
        pool.start(interrupt)
    assert time.monotonic() - t0 < 20  # not the 300 s start-up timeout
    assert _wait_gone([proc.pid for proc in pool.procs.values()], 10)


@pytest.mark.parametrize("ending", ["exit", "killed"])
@pytest.mark.slow
def test_no_worker_outlives_its_host(tmp_path, ending):
    """Interpreter exit runs the atexit shutdown; a host killed outright is noticed by its workers."""
    script = tmp_path / "host.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, signal, sys
        from fewstep.engine.parallel import ParallelConfig, get_pool
        pool = get_pool(ParallelConfig(mode="dp", dp_degree=1, backend="gloo", threads_per_rank=1, timeout=5))
        print(" ".join(map(str, pool.pids())), flush=True)
        if {ending!r} == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 1, out.stderr[-2000:]
    assert _wait_gone(pids, 10)


# -- nodes --------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_parallel_nodes_match_the_single_process_nodes_and_comfyui_free_stops_the_pool(monkeypatch):
    pack = load_pack_as_comfyui()
    nodes = importlib.import_module(f"{pack.__name__}.nodes.parallel")
    pools = importlib.import_module(f"{pack.__name__}.engine.parallel")
    pack_input_error = importlib.import_module(f"{pack.__name__}.engine.errors").InputError
    m = {**pack.NODE_CLASS_MAPPINGS, "FewStepParallelLauncher": nodes.FewStepParallelLauncher}
    loaded = []
    callbacks = fake_comfy_memory_manager(monkeypatch, loaded)
    launcher = m["FewStepParallelLauncher"]()
    config, report = launcher.launch("sp", 2, 1, 1, "gloo", 30.0, threads_per_rank=1)
    assert "ulysses 2 x ring 1" in report and "backend gloo" in report
    pool = pools.get_pool(config)
    pids = pool.pids()

    (model,) = m["FewStepDiTLoader"]().load("dummy:flux-tiny", compute_dtype="fp32")
    (cond,) = m["FewStepSyntheticConditioning"]().make(8, 4096, 768, 3.5, 0)
    sampler = m["FewStepSampler"]()
    args = dict(model=model, positive=cond, latent_image={"samples": torch.zeros(1, 16, 16, 16)}, seed=1, steps=4,
                schedule="flux.1-schnell", sampler="euler", cfg=1.0, denoise=1.0)  # fmt: skip
    (plain, _), (par, text) = sampler.sample(**args), sampler.sample(**args, parallel=config)
    assert (par["samples"] - plain["samples"]).abs().max() <= TOL and "sequence parallel" in text

    (wan,) = m["FewStepDiTLoader"]().load("dummy:wan-tiny", compute_dtype="fp32")
    (wcond,) = m["FewStepSyntheticConditioning"]().make(6, 4096, 0, 3.5, 0)
    video = m["FewStepCausalVideoSampler"]()
    vargs = dict(model=wan, positive=wcond, width=48, height=32, num_chunks=2, chunk_frames=2, window_frames=4,
                 sink_frames=0, schedule="wan-dmd-4step", steps=4, seed=0)  # fmt: skip
    local, remote = (
        video.generate(**vargs),
        video.generate(**vargs, parallel=config),
    )
    assert (remote[0]["samples"] - local[0]["samples"]).abs().max() <= TOL
    more = m["FewStepCausalContinue"]().extend(remote[2], 1)
    assert more[0]["samples"].shape[2] == 2
    # interactive inputs on the pool: a whole-chunk start and an input video, on the sampler and on Continue
    cont = m["FewStepCausalContinue"]()
    iargs = dict(vargs, start_latent={"samples": _latents(2, 7)}, input_latent={"samples": _latents(4, 8)},
                 strength=0.6)  # fmt: skip
    restyle = dict(input_latent={"samples": _latents(2, 9)}, strength=0.5)
    local_i = video.generate(**iargs)
    local_c = cont.extend(local_i[2], 1, **restyle)  # in this process first: the pool's model is loaded last
    remote_i = video.generate(**iargs, parallel=config)
    assert remote_i[0]["samples"].shape[2] == 2 + 4 and remote_i[2].position == 6
    assert (remote_i[0]["samples"] - local_i[0]["samples"]).abs().max() <= TOL
    remote_c = cont.extend(remote_i[2], 1, **restyle)
    assert (remote_c[0]["samples"] - local_c[0]["samples"]).abs().max() <= TOL
    with pytest.raises(pack_input_error, match=r"^FewStepCausalContinue: input 'parallel': recache runs in this "
                       "process only"):  # fmt: skip
        cont.extend(remote_c[2], 1, positive=wcond, recache=True)
    with pytest.raises(pack_input_error, match=r"^FewStepCausalVideoSampler: input 'start_latent': 3 latent "
                       "frames: on a worker pool a start takes whole chunks of 2"):  # fmt: skip
        video.generate(**vargs, parallel=config, start_latent={"samples": _latents(3, 7)})

    (on_detach,) = callbacks[("on_detach_after", "fewstep-parallel")]
    assert (
        loaded and type(loaded[-1].model.diffusion_model).__name__ == "Module"
    )  # no weights in this process
    on_detach(loaded[-1], False)  # ComfyUI re-loading a loaded model: keep the pool
    assert pool.alive
    on_detach(loaded[-1], True)  # free memory
    assert pool.closed and _wait_gone(pids, 5)
    # its pool is gone: the Continue rebuilds the session on a new pool (as the sampler would, run again)
    again = m["FewStepCausalContinue"]().extend(remote[2], 1)
    assert (again[0]["samples"] - more[0]["samples"]).abs().max() <= TOL
    # an interactive reference is rebuilt on the new pool by replaying its start and input video
    again_i = cont.extend(remote_c[2], 1)
    assert (again_i[0]["samples"] - cont.extend(local_c[2], 1)[0]["samples"]).abs().max() <= TOL
    restarted = pools.get_pool(config)
    assert restarted is not pool and restarted.alive
    restarted_pids = restarted.pids()
    assert nodes.shutdown_pool(config) and _wait_gone(restarted_pids, 5)

    assert launcher.launch("sp", 2, 1, 1, "gloo", 30.0, enabled=False, threads_per_rank=1)[0] is None
    with pytest.raises(pack_input_error, match="FewStepParallelLauncher: input 'ulysses_degree'"):
        launcher.launch("sp", 0, 1, 1, "gloo", 30.0)


def test_shard_helpers_keep_frames_whole():
    x = torch.arange(2 * 12).reshape(1, 24, 1)  # 2 frames x 12 tokens
    parts = [shard(x, i, 3, dim=1, frames=2) for i in range(3)]
    assert parts[1].flatten().tolist() == [4, 5, 6, 7, 16, 17, 18, 19]
    assert shard(torch.arange(6).view(1, 6), 1, 2).tolist() == [[3, 4, 5]]


def test_plain_single_process_flux_is_bit_identical_under_an_inactive_plan(flux):
    cond = make_cond(flux.params, tokens=5)
    a, _ = sample_latent(flux, [cond], torch.zeros(1, 16, 8, 8), steps=2)
    b, _ = sample_latent(
        flux,
        [cond],
        torch.zeros(1, 16, 8, 8),
        steps=2,
        options=RunOptions(sharding=None, attention_backend="sdpa"),
    )
    assert torch.equal(a, b)


# -- FLUX.2 and Z-Image ------------------------------------------------------------------------------------------------
def _image_cond(handle, tokens: int, seed: int, batch: int = 1):
    """Seeded conditioning of the family's width; FLUX.2 and Z-Image take no pooled vector."""
    from fewstep.engine import TextCondition

    g = torch.Generator().manual_seed(seed)
    width = handle.family.image.context_dim(handle.params)
    return TextCondition(torch.randn(batch, tokens, width, generator=g), None, 4.0)


# FLUX.2: 4 x 6 latent pixels = 24 image tokens, 12 per rank. Z-Image: 4 x 6 patches = 24 image tokens, padded to
# 32 (16 per rank: rank 0 holds 16 real tokens, rank 1 the other 8 and the 8 padding tokens).
IMAGE_LATENTS = {
    "flux2-tiny": torch.zeros(2, 128, 4, 6),
    "flux2-tiny-dev": torch.zeros(1, 128, 4, 6),
    "zimage-tiny": torch.zeros(2, 16, 8, 12),
}


@pytest.mark.parametrize("degrees", [(2, 1), (1, 2)], ids=["ulysses", "ring"])
@pytest.mark.parametrize("preset", list(IMAGE_LATENTS))
@pytest.mark.slow
def test_flux2_and_zimage_sampling_on_two_ranks_equals_single_process(pool, preset, degrees):
    handle = open_model(f"dummy:{preset}", device="cpu", dtype=torch.float32)
    cond, neg = _image_cond(handle, 7, seed=1), _image_cond(handle, 7, seed=2)
    latent = IMAGE_LATENTS[preset]
    kwargs = {"negative": [neg], "cfg": 2.5, "seed": 5, "steps": 3}
    reference, ref_report = sample_latent(handle, [cond], latent, **kwargs)
    comm = {}
    out, report = parallel_sample(pool, handle, [cond], latent, degrees=degrees, comm=comm, **kwargs)
    assert out.shape == reference.shape
    assert (out - reference).abs().max() <= TOL
    assert report.model_calls == ref_report.model_calls and report.cfg_used
    assert ("all_to_all" in comm["bytes_sent"]) == (degrees[0] > 1)  # it did run sharded
    assert ("ring" in comm["bytes_sent"]) == (degrees[1] > 1)


def test_image_sharding_refuses_degrees_that_split_neither_heads_nor_padded_tokens():
    from fewstep.engine.models import flux2, zimage
    from fewstep.engine.parallel import check_image_sequence_parallel

    turbo = zimage.PRESETS["z-image-turbo"]  # 30 heads
    for degrees in ((2, 1), (3, 1), (5, 1), (6, 1), (1, 4), (2, 2)):  # 1280x768: 3840 image tokens
        check_image_sequence_parallel("zimage", turbo, 96, 160, degrees)
    with pytest.raises(InputError) as err:
        check_image_sequence_parallel("zimage", turbo, 96, 160, (4, 1))
    assert str(err.value) == (
        "input 'ulysses_degree': the model has 30 attention heads, which do not split over ulysses degree 4; "
        "choose a divisor of 30 (1, 2, 3, 5, 6, 10, 15 or 30; the ring degree has no such limit)"
    )
    # 1008x1008 px: 63 x 63 = 3969 image tokens, padded to 4000: the padded tokens are what is split
    check_image_sequence_parallel("zimage", turbo, 126, 126, (2, 1))
    check_image_sequence_parallel("zimage", turbo, 126, 126, (5, 1))
    with pytest.raises(InputError) as err:
        check_image_sequence_parallel("zimage", turbo, 128, 128, (3, 1))  # 1024x1024: 4096 tokens
    assert str(err.value) == (
        "input 'latent': 4096 image tokens (16x16 px each, padded by Z-Image to a multiple of 32) do not split "
        "over ulysses 3 x ring 1 = 3 ranks; choose a size whose image tokens (16x16 px each, padded by Z-Image to "
        "a multiple of 32) are a multiple of 3"
    )
    for preset, heads, bad in (("flux.2-klein-4b", 24, 5), ("flux.2-klein-9b", 32, 3), ("flux.2-dev", 48, 5)):
        params = flux2.PRESETS[preset]
        check_image_sequence_parallel("flux2", params, 64, 64, (2, 1))  # 1024x1024: 4096 tokens
        with pytest.raises(InputError, match=rf"^input 'ulysses_degree': the model has {heads} attention heads, "
                           rf"which do not split over ulysses degree {bad}; choose a divisor of {heads} \("):  # fmt: skip
            check_image_sequence_parallel("flux2", params, 64, 64, (bad, 1))


def test_a_flux2_size_whose_tokens_do_not_split_is_refused_before_the_workers(pool):
    handle = open_model("dummy:flux2-tiny", device="cpu", dtype=torch.float32)
    with pytest.raises(
        InputError,
        match=r"^input 'latent': 9 image tokens \(16x16 px each\) do not split over ulysses 2 x ring 1 = 2 ranks",
    ):
        parallel_sample(pool, handle, [_image_cond(handle, 4, seed=0)], torch.zeros(1, 128, 3, 3), steps=1)
    assert pool.alive


def test_a_padding_mask_reaches_the_workers(pool):
    """Z-Image drops masked caption tokens (engine.conditioning.for_family); the workers must see the mask too."""
    from dataclasses import replace

    handle = open_model("dummy:zimage-tiny", device="cpu", dtype=torch.float32)
    cond = _image_cond(handle, 9, seed=3)
    masked = replace(cond, mask=torch.tensor([[True] * 6 + [False] * 3]))
    latent = torch.zeros(1, 16, 8, 12)
    reference, _ = sample_latent(handle, [masked], latent, seed=2, steps=2)
    unmasked, _ = sample_latent(handle, [cond], latent, seed=2, steps=2)
    assert (reference - unmasked).abs().max() > 1e-3  # the mask matters
    out, _ = parallel_sample(pool, handle, [masked], latent, seed=2, steps=2)
    assert (out - reference).abs().max() <= TOL
    dp, _ = parallel_sample(pool, handle, [masked], latent, seed=2, steps=2, mode="dp")
    assert (dp - reference).abs().max() <= TOL


def _latents(frames: int, seed: int) -> torch.Tensor:
    return torch.randn(1, 16, frames, 4, 6, generator=torch.Generator().manual_seed(seed))


def test_a_pool_session_takes_a_whole_chunk_prefill_video_to_video_and_controls_as_one_process(pool, wan):
    """Prefill (the start job), V2V chunks whose input is fed one chunk ahead (a job per run of queued input, as
    the nodes feed it), then controls (strength off, a seed, a prompt without re-cache) sent with the next job:
    the chunks, their mode / strength / applied controls and the positions equal the in-process session's."""
    ctx = torch.randn(1, 9, 4096, generator=torch.Generator().manual_seed(1))
    other = torch.randn(1, 5, 4096, generator=torch.Generator().manual_seed(2))
    config = CausalConfig(chunk_frames=2, window_frames=6, sink_frames=1, steps=2)
    start, inputs = _latents(4, 7), _latents(6, 8)

    def drive(session):
        prefill = session.prefill(start)
        session.set_strength(0.6)
        session.feed(inputs[:, :, :2])
        chunks = []
        for i, chunk in enumerate(session.chunks(3)):
            if i < 2:
                session.feed(inputs[:, :, 2 * (i + 1) : 2 * (i + 2)])
            chunks.append(chunk)
        session.control("strength", None)
        session.control("seed", 11)
        session.control("prompt", other)
        chunks += session.run(2)
        return prefill, chunks

    local_prefill, local = drive(VideoSession(wan.model, ctx, 32, 48, config, seed=3))
    remote = RemoteVideoSession(pool, wan, ctx, 32, 48, config, seed=3)
    prefill, got = drive(remote)
    assert (prefill.frames, prefill.blocks) == (local_prefill.frames, local_prefill.blocks) == (4, (2, 2))
    torch.testing.assert_close(prefill.latents, start, rtol=0, atol=0)
    assert (
        torch.cat([c.latents for c in got], 2) - torch.cat([c.latents for c in local], 2)
    ).abs().max() <= TOL
    assert [(c.index, c.start_frame, c.mode, c.strength) for c in got] == [
        (c.index, c.start_frame, c.mode, c.strength) for c in local
    ]
    assert [c.mode for c in got] == ["v2v"] * 3 + ["t2v"] * 2
    assert [[(a.kind, a.chunk, a.detail) for a in c.controls] for c in got] == [
        [(a.kind, a.chunk, a.detail) for a in c.controls] for c in local
    ]
    assert [a.kind for a in got[3].controls] == ["prompt", "strength", "seed"]
    assert remote.frames_generated == local[-1].start_frame + 2 == 14
    assert len(remote.inputs) == 0 and remote.strength is None and remote.seed == 11


def test_a_pool_session_restyles_every_queued_input_chunk_in_one_job_and_starts_with_a_prompt_set_first(
    pool, wan
):
    ctx = torch.randn(1, 9, 4096, generator=torch.Generator().manual_seed(1))
    other = torch.randn(1, 5, 4096, generator=torch.Generator().manual_seed(2))
    config = CausalConfig(chunk_frames=2, window_frames=6, sink_frames=1, steps=2)

    def drive(session):
        session.set_prompt(other)  # before the first chunk: the session starts with it
        session.feed(_latents(4, 8))
        session.set_strength(0.6)
        return torch.cat([c.latents for c in session.run(2)], 2)

    want = drive(VideoSession(wan.model, ctx, 32, 48, config, seed=3))
    jobs = pool._jobs
    got = drive(RemoteVideoSession(pool, wan, ctx, 32, 48, config, seed=3))
    assert pool._jobs == jobs + 1  # both queued input chunks went with the one job
    assert (got - want).abs().max() <= TOL


def test_a_pool_session_refuses_what_a_sharded_session_cannot_run_before_any_job(pool, wan):
    ctx = torch.randn(1, 9, 4096, generator=torch.Generator().manual_seed(1))
    config = CausalConfig(chunk_frames=2, window_frames=6, sink_frames=1, steps=2)
    remote = RemoteVideoSession(pool, wan, ctx, 32, 48, config, seed=3, where="Node")
    refusal = (
        r"^Node: input 'session': {} runs a forward that is not a chunk's shape, which a sharded worker pool does "
        r"not run; use one worker$"
    )
    jobs = pool._jobs
    with pytest.raises(
        InputError, match=refusal.format("a start latent of one frame more than whole chunks")
    ):
        remote.prefill(_latents(3, 7))
    with pytest.raises(InputError, match=refusal.format("a prompt switch with recache")):
        remote.set_prompt(ctx, recache=True)
    with pytest.raises(InputError, match=refusal.format("a prompt switch with recache")):
        remote.control("prompt", ctx, recache=True)
    with pytest.raises(InputError, match=r"^Node: input 'start_latent': latents of batch 1 and 4x4 latent"):
        remote.prefill(torch.zeros(1, 16, 2, 4, 4))
    remote.set_strength(0.5)
    with pytest.raises(
        InputError, match=r"^Node: input 'input_video': chunk 0 restyles an input chunk .* 0 of"
    ):
        next(iter(remote.chunks(1)))
    assert pool._jobs == jobs and not remote.started and remote.controls.pending() == []
