"""engine.run is the one composition point: local or pool is a run option, a video session is opened from a run,
and each config is checked once, when it is built."""

from __future__ import annotations

import collections
import dataclasses
import types

import pytest
import torch
from compile_doubles import EMULATED
from conftest import make_cond

from fewstep.engine import open_model
from fewstep.engine.causal import CausalConfig, VideoSession, kv_cache, open_session
from fewstep.engine.causal.kv_cache import quantized as kv_quantized
from fewstep.engine.causal.kv_cache import window as kv_window
from fewstep.engine.compile import attach_compile, attach_compile_config
from fewstep.engine.compile import graphs as compile_graphs
from fewstep.engine.compile import options as compile_options
from fewstep.engine.compile.feature import COMPILE_FEATURE
from fewstep.engine.compile.options import CompileConfig
from fewstep.engine.errors import InputError
from fewstep.engine.parallel import CausalSharding, ParallelConfig, jobs
from fewstep.engine.parallel.client import OnPool, RemoteVideoSession
from fewstep.engine.run import RunOptions, open_run, placement
from fewstep.engine.step_cache import STEP_CACHE_FEATURE, make_gate
from fewstep.engine.text_to_image import SampleRequest, sample

H, W = 32, 48


@pytest.fixture(scope="module")
def wan():
    return open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32)


def _context(seed: int = 1) -> torch.Tensor:
    return torch.randn(1, 6, 4096, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def window_checks(monkeypatch):
    """Counts every check of a causal window (WindowSpec checks itself with kv_cache.window.check_window)."""
    calls = []
    check = kv_window.check_window

    def counting(*args):
        calls.append(args)
        return check(*args)

    monkeypatch.setattr(kv_window, "check_window", counting)
    return calls


@pytest.fixture
def storage_checks(monkeypatch):
    """Counts every check of KV storage settings (KVStorage checks itself with kv_cache.quantized.check_kv_storage)."""
    calls = []
    check = kv_quantized.check_kv_storage

    def counting(*args, **kwargs):
        calls.append(args)
        return check(*args, **kwargs)

    monkeypatch.setattr(kv_quantized, "check_kv_storage", counting)
    return calls


def _stub_pool(degrees=(2, 1)):
    """What RemoteVideoSession reads of a pool before its first job (no worker is started)."""
    config = ParallelConfig(mode="sp", ulysses_degree=degrees[0], ring_degree=degrees[1], backend="gloo")
    return types.SimpleNamespace(config=config, world=degrees[0] * degrees[1], id="stub", closed=False)


# -- configs are checked once, when they are built -------------------------------------------------------------------
def test_the_window_is_checked_once_per_local_session_open(wan, window_checks):
    config = CausalConfig(chunk_frames=2, window_frames=6, sink_frames=1, kv_dtype="int8", steps=2)
    assert len(window_checks) == 1  # built: checked
    session, _ = open_session(wan, _context(), H, W, config, 3)
    session.run(1)
    assert len(window_checks) == 1  # the session, its KV cache and its run read it without checking it again
    assert dataclasses.replace(config, sink_frames=0).window.sink_frames == 0 and len(window_checks) == 2


def test_the_window_is_checked_once_per_pool_session_open(wan, window_checks, monkeypatch):
    config = CausalConfig(chunk_frames=2, window_frames=6, steps=2)
    monkeypatch.setattr(OnPool, "pool", lambda self, where=None: _stub_pool())
    session, compiled = open_session(
        wan, _context(), H, W, config, 3, options=RunOptions(pool=OnPool(_stub_pool().config))
    )
    assert isinstance(session, RemoteVideoSession) and compiled is None
    assert len(window_checks) == 1


def test_the_kv_storage_is_checked_once_per_session_open(wan, storage_checks):
    config = CausalConfig(chunk_frames=2, window_frames=6, sink_frames=1, kv_dtype="int8", steps=2)
    assert len(storage_checks) == 1  # built: checked
    session, _ = open_session(wan, _context(), H, W, config, 3)
    session.run(3)  # frames age out into the quantized ring
    assert session.cache.frames_quantized > 0
    assert session.cache.storage is config.storage  # the cache takes the config's storage as it is
    assert (
        len(storage_checks) == 1
    )  # the session's preflight, its KV cache and its chunks do not check it again


def test_the_kv_storage_is_checked_once_per_pool_session_open(wan, storage_checks, monkeypatch):
    config = CausalConfig(chunk_frames=2, window_frames=6, kv_dtype="int8", steps=2)
    monkeypatch.setattr(OnPool, "pool", lambda self, where=None: _stub_pool())
    session, _ = open_session(
        wan, _context(), H, W, config, 3, options=RunOptions(pool=OnPool(_stub_pool().config))
    )
    assert isinstance(session, RemoteVideoSession)
    assert len(storage_checks) == 1


def test_bad_settings_are_refused_when_the_config_is_built():
    with pytest.raises(
        InputError, match=r"^input 'window_frames': the window \(2 latent frames\) is smaller"
    ):
        CausalConfig(chunk_frames=3, window_frames=2)
    with pytest.raises(InputError, match=r"^input 'kv_dtype': unsupported KV storage 'fp8'"):
        CausalConfig(kv_dtype="fp8")
    with pytest.raises(InputError, match=r"^input 'context_noise': 5000.0 is not a timestep in \[0, 1000\]"):
        CausalConfig(context_noise=5000.0)
    with pytest.raises(InputError, match=r"^input 'sink_frames': 4 sink frames do not fit a window of 4"):
        kv_cache.WindowSpec(2, 4, 4)


def test_compile_options_are_checked_once(monkeypatch):
    handle = open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32)
    posts, torch_checks = [], []
    post_init, check_torch = CompileConfig.__post_init__, compile_options.check_torch

    def counting_post_init(self):
        posts.append(self)
        post_init(self)

    def counting_check_torch(*args, **kwargs):
        torch_checks.append(args)
        return check_torch(*args, **kwargs)

    monkeypatch.setattr(CompileConfig, "__post_init__", counting_post_init)
    monkeypatch.setattr(compile_options, "check_torch", counting_check_torch)
    monkeypatch.setattr(compile_graphs, "check_torch", counting_check_torch)
    compiled = attach_compile(handle, "regional", backend="eager")
    run = open_run(compiled)
    run.finish()
    assert len(posts) == 1 and torch_checks == [("compile", "compile")]

    posts.clear(), torch_checks.clear()
    config = CompileConfig(mode="regional", backend="eager")  # a command checks its flags before loading
    assert attach_compile_config(handle, config).feature(COMPILE_FEATURE).config is config
    assert len(posts) == 1 and torch_checks == [("compile", "compile")]

    posts.clear(), torch_checks.clear()
    graphed = attach_compile(handle, "off", "whole", graph_segments=EMULATED)
    assert graphed.feature(COMPILE_FEATURE).graphs is not None  # made from the checked config
    assert len(posts) == 1 and torch_checks == [("cuda_graph", "cuda_graph")]


# -- local or pool is a run option -----------------------------------------------------------------------------------
def test_a_run_in_this_process_has_no_placement_and_open_run_refuses_a_pool_run(wan):
    on_pool = RunOptions(pool=OnPool(_stub_pool().config))
    assert placement(None) is None and placement(RunOptions()) is None and placement(on_pool) is on_pool.pool
    assert RunOptions().in_process and not on_pool.in_process
    with pytest.raises(ValueError, match="placement"):
        open_run(wan, on_pool)
    with pytest.raises(InputError, match=r"input 'parallel': expected a FEWSTEP_PARALLEL"):
        OnPool("not a pool config")


def test_sample_hands_a_pool_run_to_its_placement():
    handle = open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32)
    request = SampleRequest([make_cond(handle.params, tokens=5)], torch.zeros(1, 16, 8, 8), steps=2)
    handed = []

    class Placement:
        def sample(self, got_handle, got_request):
            handed.append((got_handle, got_request))
            return sample(got_handle, dataclasses.replace(got_request, options=None))

    expected, _ = sample(handle, request)
    got, _ = sample(handle, dataclasses.replace(request, options=RunOptions(pool=Placement())))
    assert len(handed) == 1 and handed[0][0] is handle and torch.equal(got, expected)


def test_a_session_runs_what_its_run_composed(wan):
    config = CausalConfig(chunk_frames=2, window_frames=6, steps=2)
    run = open_run(wan, RunOptions(kernel_mode="reference"))
    session = VideoSession(run.model, _context(), H, W, config, 3, run=run)
    assert session.backends is run.backends and session.blocks == run.blocks and session.chunk_cache is None
    plain = VideoSession(wan.model, _context(), H, W, config, 3)
    assert torch.equal(session.run(1)[0].latents, plain.run(1)[0].latents)


def test_a_run_wraps_the_model_once():
    handle = open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32)
    compiled = attach_compile(handle, "regional", backend="eager")
    run = open_run(compiled)
    assert run.model is compiled.feature(COMPILE_FEATURE).compiled and run.model.model is handle.model
    run.finish()
    graphed = attach_compile(handle, "off", "whole", graph_segments=EMULATED)
    run = open_run(graphed)
    feature = graphed.feature(COMPILE_FEATURE)
    assert run.model._feature is feature and feature.graphs.fn is handle.model  # the graphs wrap the model
    run.finish()
    # a step cache's block runner cannot be followed by a graph: the run calls the model itself
    gate = make_gate("first_block", threshold=0.5, force=True)
    run = open_run(
        graphed.with_feature(STEP_CACHE_FEATURE, gate), sigmas=torch.linspace(1, 0, 9), sampler="euler"
    )
    assert run.model is handle.model and run.compiled.notes
    run.abort()


def test_a_pool_rank_opens_its_session_with_the_local_opener(wan, window_checks, monkeypatch):
    """The worker's video job goes through causal.recipe.open_session with its rank's sharding in the options
    (here the opener records them and opens an unsharded session: no process group in this test)."""
    config = CausalConfig(chunk_frames=2, window_frames=6, steps=2)
    opened = []

    def opener(handle, context, height, width, causal_config, seed, tiny_vae=None, where=None, options=None):
        opened.append((handle, causal_config, options))
        return open_session(handle, context, height, width, causal_config, seed, tiny_vae, where)

    monkeypatch.setattr(jobs, "open_session", opener)
    mesh = types.SimpleNamespace(agree=lambda flag: flag, stats=types.SimpleNamespace(snapshot=dict))
    ctx = types.SimpleNamespace(
        model=lambda spec: wan, mesh=lambda degrees: mesh, sessions=collections.OrderedDict(), device="cpu",
        progress=lambda step=True: None, cancel_requested=lambda: False, rank=1,
    )  # fmt: skip
    job = {"model": {}, "key": "k", "start": True, "context": _context(), "height": H, "width": W, "seed": 3,
           "config": dataclasses.asdict(config), "chunks": 1}  # fmt: skip
    window_checks.clear()
    assert jobs.run_video(ctx, job) is None  # rank 1 reports nothing itself
    ((handle, rank_config, options),) = opened
    assert handle is wan and rank_config == config and len(window_checks) == 1  # rebuilt from the job: once
    assert isinstance(options.sharding, CausalSharding) and options.sharding.mesh is mesh
    assert not options.compile and not options.step_cache and options.in_process
    assert ctx.sessions["k"].frames_generated == 2
