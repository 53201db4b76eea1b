"""Compiled and CUDA-graph forwards (engine.compile): equal to eager, recompile counts, regional reuse, the
break-point planner, graph keys / LRU / fallbacks on the CPU (emulated graphs), bad input.

torch.compile is slow on two CPU cores: the compiled models are module-scoped fixtures, each built once after a
``torch._dynamo.reset()`` (so counts do not depend on other tests), and the tests of one fixture run together.
Real CUDA-graph replay is tested only on a GPU (skipped here, with the reason).
"""

from __future__ import annotations

import collections
import inspect

import pytest
import torch
from compile_doubles import EMULATED
from conftest import make_cond

from fewstep.engine import open_model, sample_latent
from fewstep.engine.backends import DEFAULT_BACKENDS
from fewstep.engine.causal.kv_cache import CrossAttentionCache, KVCache, KVStorage, WindowSpec
from fewstep.engine.compile import (
    COMPILE_FEATURE,
    CaptureError,
    CompileConfig,
    CompileWatch,
    attach_compile,
    call_key,
    check_torch,
    compile_model,
    cuda_graph,
    parse_buckets,
    plan_breaks,
)
from fewstep.engine.compile.capture import CaptureSession
from fewstep.engine.compile.feature import STEP_CACHE_NO_GRAPH
from fewstep.engine.compile.graphs import GraphedCallable
from fewstep.engine.errors import InputError
from fewstep.engine.models.flux_layers import DoubleStreamBlock, SingleStreamBlock
from fewstep.engine.models.wan_layers import WanAttentionBlock
from fewstep.engine.ops import store_linear_weights
from fewstep.engine.step_cache import STEP_CACHE_FEATURE, make_gate

TOL = 1e-4
LATENT = torch.zeros(1, 16, 8, 8)  # 64x64 px: 16 image tokens
NO_GPU = "CUDA-graph replay needs a CUDA GPU (torch.cuda.is_available() is False)"
ROLLING = WindowSpec(chunk_frames=2, window_frames=6, sink_frames=2)  # fills after 3 chunks, then rolls
PAST_WINDOW = WindowSpec(chunk_frames=2, window_frames=9, sink_frames=1)  # 12 chunks run far past 9 frames


def fresh(preset: str, **kwargs):
    return open_model(f"dummy:{preset}", device="cpu", dtype=torch.float32, **kwargs)


def run(handle, tokens: int = 8, seed: int = 0, latent=LATENT, **kwargs):
    return sample_latent(
        handle, [make_cond(handle.params, tokens=tokens, seed=seed)], latent, seed=seed, **kwargs
    )


def max_diff(a, b) -> float:
    return float((a - b).abs().max())


def compiled_frames(report, file: str, name: str = "forward") -> collections.Counter:
    """Compilations of ``name`` frames in ``file`` in a run, by first line."""
    return collections.Counter(
        f.line for f in report.compile.frames if f.file.endswith(file) and f.name == name
    )


def first_line(fn) -> int:
    return inspect.getsourcelines(fn)[1]


# -- FLUX, regional, inductor ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flux_regional():
    torch._dynamo.reset()
    handle = fresh("flux-tiny")
    compiled = attach_compile(handle, "regional", backend="inductor")
    from torch._dynamo.utils import get_compilation_metrics

    after_step = []  # dynamo's compilation records after each step of the first run
    out, report = run(compiled, callback=lambda info: after_step.append(len(get_compilation_metrics())))
    return {"handle": handle, "compiled": compiled, "out": out, "report": report, "after_step": after_step}


@pytest.mark.slow
def test_regional_flux_equals_eager(flux_regional):
    ref, _ = run(flux_regional["handle"])
    assert max_diff(flux_regional["out"], ref) <= TOL
    assert flux_regional["report"].compile.frames_compiled > 0  # it did compile (inductor)


@pytest.mark.slow
def test_compile_leaves_the_shared_model_alone(flux_regional):
    model = flux_regional["handle"].model
    assert flux_regional["compiled"].model is model
    assert type(model.double_blocks[0]) is DoubleStreamBlock
    assert "forward" not in vars(model) and "_compiled_call_impl" not in vars(model.double_blocks[0])
    assert flux_regional["handle"].feature(COMPILE_FEATURE) is None
    view = flux_regional["compiled"].feature(COMPILE_FEATURE).compiled.view
    assert type(view) is type(model) and view is not model
    assert view.double_blocks[0].block is model.double_blocks[0]  # same block object, same parameters
    assert view.double_blocks[0].img_mod is model.double_blocks[0].img_mod  # attributes read through


@pytest.mark.slow
def test_regional_compiles_one_graph_per_block_class(flux_regional):
    report = flux_regional["report"]
    model = flux_regional["handle"].model
    assert len(model.double_blocks) == 2 and len(model.single_blocks) == 2
    callers = collections.Counter(f.name for f in report.compile.frames if f.name.startswith("compiled_"))
    assert callers == {"compiled_DoubleStreamBlock": 1, "compiled_SingleStreamBlock": 1}
    # each block class's forward is compiled at most once and reused by the second block of the class, not once
    # per layer (once while attention breaks the graph; 0 times when it is inlined into compiled_<Class>)
    frames = compiled_frames(report, "flux_layers.py")
    double, single = first_line(DoubleStreamBlock.forward), first_line(SingleStreamBlock.forward)
    assert frames[double] <= 1 and frames[single] <= 1, frames


@pytest.mark.slow
def test_regional_flux_block_is_one_graph_without_breaks(flux_regional):
    compile_report = flux_regional["report"].compile
    assert compile_report.graph_breaks == {} and compile_report.recompiles == 0, (
        compile_report.summary_lines()
    )
    assert (
        compile_report.frames_compiled == 2
    )  # one graph per block class: DoubleStreamBlock, SingleStreamBlock


@pytest.mark.slow
def test_no_recompilation_across_steps_and_seeds(flux_regional):
    after_step = flux_regional["after_step"]
    assert len(after_step) == 4 and after_step[0] > 0
    assert after_step[1:] == [after_step[0]] * 3  # the first run compiled in step 1 only, not in steps 2-4
    compiled, handle = flux_regional["compiled"], flux_regional["handle"]
    for seed in (1, 2):
        out, report = run(compiled, seed=seed)
        assert report.compile.frames_compiled == 0 and report.compile.recompiles == 0, report.summary()
        ref, _ = run(handle, seed=seed)
        assert max_diff(out, ref) <= TOL


@pytest.mark.slow
def test_three_prompt_lengths_recompile_at_most_once(flux_regional):
    compiled, handle = flux_regional["compiled"], flux_regional["handle"]
    recompiles = frames = 0
    for tokens in (8, 12, 16):  # 8 was compiled by the fixture
        out, report = run(compiled, tokens=tokens)
        recompiles += report.compile.recompiles
        frames += report.compile.frames_compiled
        ref, _ = run(handle, tokens=tokens)
        assert max_diff(out, ref) <= TOL
    print(f"3 prompt lengths: {recompiles} recompiles, {frames} frames compiled")
    assert recompiles <= 1
    assert frames <= 1


@pytest.mark.slow
def test_report_shows_compile_telemetry(flux_regional):
    report = flux_regional["report"]
    text = report.summary()
    assert "compile: compile regional; backend inductor, dynamic shapes" in text
    assert f"{report.compile.frames_compiled} frames compiled" in text and "recompiles" in text
    assert report.compile.compile_seconds > 0
    assert report.compile.as_dict()["frames_compiled"] == report.compile.frames_compiled


@pytest.mark.slow
def test_regional_compile_runs_under_a_step_cache(flux_regional):
    compiled, handle = flux_regional["compiled"], flux_regional["handle"]
    gate = make_gate("first_block", 1.0, force=True)  # skips whenever block 0 changed by < 100%
    ref, ref_report = run(handle.with_feature(STEP_CACHE_FEATURE, gate), steps=12, schedule="flux.1-dev")
    out, report = run(compiled.with_feature(STEP_CACHE_FEATURE, gate), steps=12, schedule="flux.1-dev")
    assert ref_report.cache_probes > 0  # the cache did skip
    assert (report.model_calls, report.cache_probes) == (ref_report.model_calls, ref_report.cache_probes)
    assert max_diff(out, ref) <= TOL
    assert report.compile.frames_compiled == 0  # the step cache's block runner reuses the compiled blocks


@pytest.mark.slow
def test_weights_changed_after_compile_are_used_without_recompiling(flux_regional):
    compiled, handle = flux_regional["compiled"], flux_regional["handle"]
    model = handle.model
    before, _ = run(handle)
    model.double_blocks[1].img_mlp[0].weight.mul_(1.5)  # in place (a LoRA merged into the weight)
    model.single_blocks[0].linear2.weight.data = (
        model.single_blocks[0].linear2.weight.data * 0.5
    )  # new storage
    ref, _ = run(handle)
    assert max_diff(ref, before) > 1e-3  # the change matters
    out, report = run(compiled)
    assert max_diff(out, ref) <= TOL
    assert report.compile.frames_compiled == 0, report.summary()


def test_static_shapes_recompile_per_prompt_length():
    """The counter sees recompiles: with dynamic=False a new prompt length compiles again."""
    torch._dynamo.reset()
    static = attach_compile(fresh("flux-tiny"), "regional", dynamic=False, backend="aot_eager")
    _, first = run(static, tokens=8)
    _, second = run(static, tokens=12)
    assert first.compile.frames_compiled > 0 and "static shapes" in first.compile.config
    assert second.compile.recompiles >= 1, second.summary()
    assert any("12" in r or "8" in r for r in second.compile.recompile_reasons), (
        second.compile.recompile_reasons
    )


# -- FLUX, full, aot_eager ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flux_full():
    torch._dynamo.reset()
    handle = fresh("flux-tiny")
    compiled = attach_compile(handle, "full", backend="aot_eager")
    out, report = run(compiled)
    return {"handle": handle, "compiled": compiled, "out": out, "report": report}


@pytest.mark.slow
def test_full_flux_equals_eager_and_compiles_the_forward(flux_full):
    ref, _ = run(flux_full["handle"])
    assert max_diff(flux_full["out"], ref) <= TOL
    top = [
        f for f in flux_full["report"].compile.frames if f.file.endswith("flux.py") and f.name == "forward"
    ]
    assert len(top) == 1  # Flux.forward itself, as one frame


@pytest.mark.slow
def test_fp8_storage_after_compile_recompiles_with_the_reason(flux_full):
    handle, compiled = flux_full["handle"], flux_full["compiled"]
    store_linear_weights(handle.model, torch.float8_e4m3fn)  # what weight_dtype=fp8 does at load time
    ref, _ = run(handle)
    out, report = run(compiled)
    assert max_diff(out, ref) <= TOL
    assert report.compile.recompiles >= 1
    reasons = " ".join(report.compile.recompile_reasons)
    assert "dtype mismatch" in reasons and "Float8_e4m3fn" in reasons, reasons
    _, again = run(compiled, seed=3)
    assert again.compile.frames_compiled == 0


# -- Wan, regional, inductor ----------------------------------------------------------------------------------------
def wan_inputs(model, tokens: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, 2, 8, 8, generator=g)
    return x, torch.full((1,), 700.0), torch.randn(1, tokens, model.params.text_dim, generator=g)


@pytest.fixture(scope="module")
def wan_regional():
    torch._dynamo.reset()
    model = fresh("wan-tiny").model
    compiled = compile_model(model, "regional", backend="inductor")
    watch = CompileWatch().start()
    with torch.inference_mode():
        out = compiled(*wan_inputs(model))
    watch.stop()
    return {"model": model, "compiled": compiled, "out": out, "frames": watch.frames}


@pytest.mark.slow
def test_regional_wan_equals_eager(wan_regional):
    model = wan_regional["model"]
    with torch.inference_mode():
        ref = model(*wan_inputs(model))
    assert max_diff(wan_regional["out"], ref) <= TOL


@pytest.mark.slow
def test_regional_wan_compiles_its_block_once(wan_regional):
    frames = [f for f in wan_regional["frames"] if f.file.endswith("wan_layers.py") and f.name == "forward"]
    block_line = first_line(WanAttentionBlock.forward)
    assert len(wan_regional["model"].blocks) == 2
    assert sum(f.line == block_line for f in frames) <= 1, frames  # 0 when inlined, never one per layer
    callers = [f.name for f in wan_regional["frames"] if f.name.startswith("compiled_")]
    assert callers == ["compiled_WanAttentionBlock"]


def causal_stream(model, forward, chunks: int = 5, window: WindowSpec = ROLLING, seed: int = 0, device="cpu"):
    """Chunk by chunk over a KV cache (as VideoSession does): 2 denoising forwards and a commit per chunk; the
    cache fills, then rolls (default: sinks 2, window 6)."""
    p = model.params
    cache = KVCache(p.num_layers, 1, 16, p.num_heads, p.head_dim, KVStorage(window), torch.float32, device)
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        ctx = model.embed_context(torch.randn(1, 8, p.text_dim, generator=g).to(device))
        cross = CrossAttentionCache().fill(
            model.blocks, ctx, DEFAULT_BACKENDS
        )  # filled with the prompt, outside the steps
        outs = []
        for _ in range(chunks):
            cache.begin(cache.frames_committed, window.chunk_frames, (4, 4), model.frame_rope)
            x = torch.randn(1, 16, window.chunk_frames, 8, 8, generator=g).to(device)
            for sigma in (0.9, 0.6):
                t = torch.full((1, window.chunk_frames), 1000 * sigma, device=device)
                v = forward(x, t, context_embedded=ctx, kv=cache, cross_kv=cross)
                outs.append(v.float().cpu())
                x = x - 0.3 * v
            t = torch.zeros(1, window.chunk_frames, device=device)
            forward(x, t, context_embedded=ctx, kv=cache, cross_kv=cross)
            cache.commit()
    return outs


@pytest.mark.slow
def test_regional_wan_follows_a_growing_kv_cache_without_recompiling(wan_regional):
    """The cache's per-chunk state is in device tensors and a layer's view holds that layer's tensors (no layer
    index), so the block graph traces attend and no chunk or layer is a new guard. The window filling (masked)
    and full (unmasked) are two entry points of the block, each compiled once: no recompile, ever."""
    model, compiled = wan_regional["model"], wan_regional["compiled"]
    ref = causal_stream(model, model)
    warm = CompileWatch().start()
    # compiles the causal path once per phase (the window fills with the third chunk)
    causal_stream(model, compiled, chunks=3)
    warm.stop()
    assert [(f.name, f.recompile_reason) for f in warm.frames] == [
        ("compiled_WanAttentionBlock_filling", None), ("compiled_WanAttentionBlock_full", None)
    ]  # fmt: skip
    assert warm.graph_breaks == {}
    watch = CompileWatch().start()
    out = causal_stream(model, compiled)
    watch.stop()
    assert max(max_diff(a, b) for a, b in zip(out, ref)) <= TOL
    assert watch.frames == [], [(f.name, f.recompile_reason) for f in watch.frames]


# -- whole steps under torch.compile(fullgraph=True) -----------------------------------------------------------------
def test_one_flux_step_compiles_as_one_graph(tiny):
    torch._dynamo.reset()
    step = torch.compile(tiny.model, backend="eager", fullgraph=True)  # a graph break would raise
    inputs = flux_forward_inputs(tiny.params)
    watch = CompileWatch().start()
    with torch.inference_mode():
        outs = [step(**{**inputs, "timesteps": torch.full((1,), t)}) for t in (0.9, 0.5, 0.1)]
        refs = [tiny.model(**{**inputs, "timesteps": torch.full((1,), t)}) for t in (0.9, 0.5, 0.1)]
    watch.stop()
    assert all(max_diff(a, b) <= TOL for a, b in zip(outs, refs))
    assert [f.recompile_reason for f in watch.frames] == [None] and watch.graph_breaks == {}


@pytest.mark.slow
def test_one_causal_wan_step_compiles_as_one_graph_over_a_stream_past_the_window():
    """12 chunks through a 9-frame window (full from chunk 4 on), the whole step compiled with fullgraph=True (a
    graph break raises): two frames, the masked step (causal_step_filling) and the unmasked one
    (causal_step_full), each compiled once; no recompile, and once the window is full nothing compiles."""
    torch._dynamo.reset()
    model = fresh("wan-tiny").model
    step = compile_model(model, "full", backend="eager", fullgraph=True)
    ref = causal_stream(model, model, chunks=12, window=PAST_WINDOW)
    watch = CompileWatch().start()
    out = causal_stream(model, step, chunks=12, window=PAST_WINDOW)
    watch.stop()
    assert max(max_diff(a, b) for a, b in zip(out, ref)) <= TOL
    assert watch.graph_breaks == {}
    assert [(f.name, f.recompile_reason) for f in watch.frames] == [
        ("causal_step_filling", None), ("causal_step_full", None)
    ]  # fmt: skip
    again = CompileWatch().start()  # a second stream: both phases compiled, nothing compiles
    out = causal_stream(model, step, chunks=12, window=PAST_WINDOW)
    again.stop()
    assert max(max_diff(a, b) for a, b in zip(out, ref)) <= TOL
    assert again.frames == [] and again.graph_breaks == {}


# -- CUDA graphs, emulated on the CPU --------------------------------------------------------------------------------
@pytest.fixture
def tiny():
    return fresh("flux-tiny")


def test_whole_graph_replay_equals_eager_and_counts(tiny):
    graphed = attach_compile(tiny, "off", "whole", graph_segments=EMULATED)
    ref, _ = run(tiny)
    out, report = run(graphed)
    assert max_diff(out, ref) == 0.0
    g = report.compile.graphs
    assert (g.warmups, g.captures, g.hits, g.misses, g.held) == (1, 1, 2, 0, 1)
    out, report = run(graphed)  # the next run replays every step
    assert max_diff(out, ref) == 0.0 and report.compile.graphs.hits == 4
    assert "CUDA graph (whole): 4 replays, 0 captures" in report.summary()


def test_graph_keys_lru_and_bucket_fallback(tiny):
    a, b = torch.zeros(1, 4), torch.zeros(1, 5)
    assert call_key((a,), {}) == call_key((torch.ones(1, 4),), {})  # values do not matter
    assert call_key((a,), {}) != call_key((b,), {})  # shapes do
    assert call_key((a,), {}) != call_key((a.double(),), {})  # dtypes do
    assert call_key((a,), {"n": 1}) != call_key((a,), {"n": 2})  # constants do
    graphed = attach_compile(tiny, "off", "whole", graph_segments=EMULATED, max_graphs=2)
    graphs = graphed.feature(COMPILE_FEATURE).graphs
    for tokens in (8, 9, 10):  # three text lengths: three keys, LRU of 2
        out, _ = run(graphed, tokens=tokens)
        ref, _ = run(tiny, tokens=tokens)
        assert max_diff(out, ref) == 0.0
    assert graphs.stats.captures == 3 and graphs.stats.evictions == 1 and graphs.graphs_held == 2
    bucketed = attach_compile(tiny, "off", "whole", graph_segments=EMULATED, buckets=parse_buckets("64x64"))
    _, report = run(bucketed, latent=torch.zeros(1, 16, 16, 16))  # 128x128 px: not a bucket
    g = report.compile.graphs
    assert g.captures == 0 and g.misses == 4
    assert any("not one of the buckets" in r for r in g.refused), g.refused


def test_graphs_are_dropped_when_the_weights_move(tiny):
    graphed = attach_compile(tiny, "off", "whole", graph_segments=EMULATED)
    run(graphed)
    layer = tiny.model.double_blocks[0].img_attn.qkv
    layer.weight.data = layer.weight.data * 0.9  # new storage, as an offload and reload gives
    ref, _ = run(tiny)
    out, report = run(graphed)
    assert max_diff(out, ref) == 0.0
    assert report.compile.graphs.invalidations == 1 and report.compile.graphs.captures == 1


def test_graph_off_with_reason_when_a_step_cache_is_on(tiny):
    graphed = attach_compile(tiny, "off", "whole", graph_segments=EMULATED)
    gate = make_gate("first_block", 1.0, force=True)
    ref, _ = run(tiny.with_feature(STEP_CACHE_FEATURE, gate), steps=12, schedule="flux.1-dev")
    out, report = run(graphed.with_feature(STEP_CACHE_FEATURE, gate), steps=12, schedule="flux.1-dev")
    assert max_diff(out, ref) == 0.0
    assert report.compile.graphs is None and STEP_CACHE_NO_GRAPH in report.compile.notes
    refused_gate = make_gate("first_block")  # 4 steps: the gate refuses, so the run is uncached and graphed
    _, report = run(graphed.with_feature(STEP_CACHE_FEATURE, refused_gate))
    assert (
        report.compile.graphs is not None and report.compile.graphs.hits + report.compile.graphs.captures > 0
    )


@pytest.mark.slow
def test_whole_graph_replays_every_chunk_of_a_causal_stream_past_the_window():
    """A causal step is one graph: replay equals eager for every chunk of 12 (a 9-frame window filled at chunk 4,
    then rolling). Keys (the caches' capture_state()): the masked step while the window fills and the unmasked
    one after it (one warm-up and one capture each; the cross-attention cache is filled before the steps)."""
    model = fresh("wan-tiny").model
    graphed = cuda_graph(model, "whole", segments=EMULATED, weights=model)
    ref = causal_stream(model, model, chunks=12, window=PAST_WINDOW)
    out = causal_stream(model, graphed, chunks=12, window=PAST_WINDOW)
    assert len(out) == 24 and all(torch.equal(a, b) for a, b in zip(out, ref))
    s = graphed.stats
    assert (s.warmups, s.captures, s.hits, s.misses, s.held) == (2, 2, 32, 0, 2), s
    assert graphed.sessions()[0].breaks == [] and len(graphed.sessions()[0].segments) == 1


def test_a_new_cache_is_a_new_graph_key():
    """A graph reads the addresses of the cache it was captured with: a cache with other buffers is another key."""
    model = fresh("wan-tiny").model
    graphed = cuda_graph(model, "whole", segments=EMULATED, weights=model)
    ref = [causal_stream(model, model, chunks=2, seed=seed) for seed in (0, 1)]
    out = [causal_stream(model, graphed, chunks=2, seed=seed) for seed in (0, 1)]
    assert all(torch.equal(a, b) for o, r in zip(out, ref) for a, b in zip(o, r))
    assert graphed.stats.captures == 2 and graphed.stats.misses == 0


def test_an_object_argument_without_declared_state_is_refused():
    class Opaque:
        scale = 2.0

    def forward(x, obj):
        return x * obj.scale

    graphed = cuda_graph(forward, "whole", segments=EMULATED)
    assert torch.equal(graphed(torch.ones(2), Opaque()), torch.full((2,), 2.0))
    (reason,) = graphed.stats.refused
    assert reason == (
        "positional argument 1 is a Opaque, host-side state a graph would bake in without knowing when it "
        "changes (it declares no capture_state())"
    )


def test_breakable_graph_of_a_causal_step_has_no_kv_breaks():
    model = fresh("wan-tiny").model
    graphed = cuda_graph(model, "breakable", segments=EMULATED, weights=model)
    ref = causal_stream(model, model)
    out = causal_stream(model, graphed)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    s = graphed.stats
    assert s.breaks == {} and s.segments == 1 and s.misses == 0  # no collective in a single-process step


def test_a_graph_captured_with_the_kv_cache_calls_inside_replays_every_chunk_exactly():
    """The static-shape KV cache keeps its cursors, slot positions and visibility in device tensors updated in
    place, so a graph captured on chunk 0 with the cache calls inside replays the later chunks exactly (with the
    old host-side cursors the replay re-read the slots of the chunk it was captured on). Bare session: no key,
    so the window stays masked for these 3 chunks of a 6-frame window."""
    model = fresh("wan-tiny").model
    session = CaptureSession(EMULATED(), (), traced=True)
    captured = []

    def forward(x, t, **kw):
        if not captured:
            captured.append(True)
            return session.capture(model, (x, t), kw)
        return session.replay((x, t), kw)

    ref = causal_stream(model, model, chunks=3)
    out = causal_stream(model, forward, chunks=3)
    assert max(max_diff(a, b) for a, b in zip(out, ref)) == 0.0


def test_capture_refuses_a_branch_on_tensor_data():
    def forward(x):
        return x * 2 if bool(x.sum() > 0) else x - 1

    graphed = cuda_graph(forward, "whole", segments=EMULATED)
    x = torch.ones(3)
    outs = [graphed(x) for _ in range(3)]
    assert all(torch.equal(o, x * 2) for o in outs)
    assert graphed.stats.captures == 0 and graphed.stats.misses == 2  # 1 warm-up, 1 failed capture, 1 refused
    (reason,) = graphed.stats.refused
    assert "capture failed" in reason and "reads a tensor value into Python" in reason
    with pytest.raises(CaptureError):
        CaptureSession(EMULATED(), (), traced=True).capture(forward, (x,), {})


def test_weights_on_the_cpu_refuse_a_real_graph(tiny):
    graphed = GraphedCallable(tiny.model, "whole", weights=tiny.model)  # a real (not emulated) graph
    inputs = flux_forward_inputs(tiny.params)
    with torch.inference_mode():
        assert torch.equal(graphed(**inputs), tiny.model(**inputs))
    (reason,) = graphed.stats.refused
    assert "weight tensors are on the CPU" in reason and "needs every weight on the GPU" in reason


# -- the break-point planner -----------------------------------------------------------------------------------------
def flux_forward_inputs(params, tokens: int = 8):
    from fewstep.engine.models.flux import image_ids, pack_latent, text_ids

    g = torch.Generator().manual_seed(0)
    return {
        "img": pack_latent(torch.randn(1, 16, 8, 8, generator=g)), "img_ids": image_ids(1, 8, 8),
        "txt": torch.randn(1, tokens, params.context_in_dim, generator=g), "txt_ids": text_ids(1, tokens),
        "timesteps": torch.full((1,), 0.5), "y": torch.randn(1, params.vec_in_dim, generator=g),
    }  # fmt: skip


def test_planner_splits_flux_at_its_attention_calls(tiny):
    inputs = flux_forward_inputs(tiny.params)
    plan = plan_breaks(tiny.model, break_at=("attention",), **inputs)
    assert [b.module for b in plan.breaks] == ["double_blocks.0", "double_blocks.1", "single_blocks.0",
                                               "single_blocks.1"]  # fmt: skip
    assert {b.name for b in plan.breaks} == {"scaled_dot_product_attention"}
    segs = plan.segments
    assert len(segs) == 5 and all(s.ops > 0 for s in segs)
    assert segs[0].blocks()[:2] == ("<model>", "img_in") and segs[0].blocks()[-1] == "double_blocks.0"
    assert segs[1].blocks() == (
        "double_blocks.0",
        "double_blocks.1",
    )  # after block 0's attention, into block 1's
    assert segs[-1].blocks(depth=1)[-1] == "final_layer"
    whole = plan_breaks(tiny.model, **inputs)  # default breaks: KV calls and collectives; FLUX has neither
    assert len(whole.segments) == 1 and not whole.breaks
    assert (
        sum(s.ops for s in segs) == whole.segments[0].ops - 4
    )  # the same calls, the attention ones now breaks
    assert "5 graph segments, 4 break points" in plan.summary()


def test_planner_keeps_a_causal_wan_forward_whole():
    """The KV-cache calls are no break points (static shapes): one segment; asked to, it cuts at attention."""
    model = fresh("wan-tiny").model
    p = model.params
    storage = KVStorage(WindowSpec(2, 4, 0))
    cache = KVCache(p.num_layers, 1, 16, p.num_heads, p.head_dim, storage, torch.float32, "cpu")
    cache.begin(0, 2, (4, 4), model.frame_rope)
    with torch.inference_mode():
        ctx = model.embed_context(torch.randn(1, 8, p.text_dim))
        cross = CrossAttentionCache().fill(model.blocks, ctx, DEFAULT_BACKENDS)
        inputs = (torch.randn(1, 16, 2, 8, 8), torch.full((1, 2), 500.0))
        plan = plan_breaks(model, *inputs, context_embedded=ctx, kv=cache, cross_kv=cross)
        assert len(plan.segments) == 1 and plan.breaks == ()
        plan = plan_breaks(model, *inputs, break_at=("attention",), context_embedded=ctx, kv=cache,
                           cross_kv=cross)  # fmt: skip
    assert plan.break_modules == ["blocks.0.self_attn", "blocks.0.cross_attn", "blocks.1.self_attn",
                                  "blocks.1.cross_attn"]  # fmt: skip
    assert len(plan.segments) == 5


# -- bad input ---------------------------------------------------------------------------------------------------------
def test_unknown_modes_and_backends_name_the_input(tiny):
    with pytest.raises(
        InputError, match=r"input 'compile': unknown compile mode 'fast'; expected one of off"
    ):
        attach_compile(tiny, "fast")
    with pytest.raises(InputError, match=r"input 'cuda_graph': unknown CUDA-graph mode 'partial'"):
        attach_compile(tiny, "off", "partial")
    with pytest.raises(InputError, match=r"input 'backend': unknown compile backend 'tvm'"):
        CompileConfig(backend="tvm")
    with pytest.raises(InputError, match=r"input 'buckets': 1000x1024 px: .* multiples of 16"):
        parse_buckets("1000x1024")
    with pytest.raises(InputError, match=r"input 'buckets': 'big' is not a size"):
        parse_buckets("big")
    assert parse_buckets(" 1024x1024, 768x1344 ") == ((1024, 1024), (768, 1344)) and parse_buckets("") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_graph_on_cpu_needs_allow_fallback(tiny):
    with pytest.raises(InputError, match=r"input 'cuda_graph': CUDA graphs need a CUDA GPU.*allow_fallback"):
        attach_compile(tiny, "off", "whole")
    with pytest.raises(InputError, match=r"CUDA graphs need a CUDA GPU"):
        cuda_graph(tiny.model, "whole")
    fallback = attach_compile(tiny, "off", "whole", allow_fallback=True)
    ref, _ = run(tiny)
    out, report = run(fallback)
    assert torch.equal(out, ref)
    g = report.compile.graphs
    assert g.hits == 0 and g.misses == 4 and any("CUDA graphs need a CUDA GPU" in r for r in g.refused)
    assert any("allow_fallback" in n for n in report.compile.notes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback of the shipped settings")
@pytest.mark.slow
def test_shipped_dummy_workflow_settings_fall_back_on_the_cpu_with_the_reason(tiny):
    """workflows/flux_schnell_compiled_dummy: regional compile + whole CUDA graph with allow_fallback, on a CPU."""
    import json
    from pathlib import Path

    from fewstep.nodes.compile import FewStepCompile

    api = json.loads((Path(__file__).resolve().parents[3] / "workflows" /
                      "flux_schnell_compiled_dummy.api.json").read_text())  # fmt: skip
    (node,) = [n for n in api.values() if n["class_type"] == "FewStepCompile"]
    widgets = {k: v for k, v in node["inputs"].items() if not isinstance(v, list)}
    assert (widgets["compile"], widgets["cuda_graph"], widgets["allow_fallback"]) == (
        "regional",
        "whole",
        True,
    )
    torch._dynamo.reset()
    (handle,) = FewStepCompile().attach(tiny, **widgets)
    ref, _ = run(tiny)
    out, report = run(handle)
    assert max_diff(out, ref) <= TOL
    text = report.summary()
    assert f"compile: compile regional; backend {widgets['backend']}" in text
    assert "no graph x4: CUDA graphs need a CUDA GPU" in text
    assert "CUDA graphs off (allow_fallback): CUDA graphs need a CUDA GPU" in text
    assert report.compile.graphs.hits == 0 and report.compile.frames_compiled > 0


def test_torch_too_old_names_the_version_needed():
    with pytest.raises(
        InputError, match=r"input 'compile': compile needs torch >= 2\.5 .*this is torch 2\.2\.0"
    ):
        check_torch("compile", "compile", version="2.2.0")
    with pytest.raises(InputError, match=r"cuda_graph needs torch >= 2\.1"):
        check_torch("cuda_graph", "cuda_graph", version="2.0.1+cu118")
    check_torch("compile", "compile", version="2.5.0")  # new enough: no error


def test_emulated_graphs_cannot_wrap_a_compiled_forward(tiny):
    with pytest.raises(InputError, match=r"input 'cuda_graph': injected graph segments .* compiled forward"):
        attach_compile(tiny, "regional", "whole", graph_segments=EMULATED)


def test_compile_feature_for_another_model_is_refused(tiny):
    compiled = attach_compile(tiny, "regional", backend="eager")
    other = compiled.replace(model=fresh("flux-tiny").model)
    with pytest.raises(InputError, match=r"input 'model': the compile feature .* another model object"):
        run(other)


def test_both_off_removes_the_feature(tiny):
    compiled = attach_compile(tiny, "regional", backend="eager")
    assert compiled.feature(COMPILE_FEATURE) is not None
    assert attach_compile(compiled, "off", "off").feature(COMPILE_FEATURE) is None


# -- the node ----------------------------------------------------------------------------------------------------------
def test_node_contract_and_errors(tiny):
    from fewstep.nodes.compile import FewStepCompile

    spec = FewStepCompile.INPUT_TYPES()
    inputs = {**spec["required"], **spec["optional"]}
    assert all("tooltip" in opts for _, opts in inputs.values())
    assert inputs["compile"][0] == ["off", "regional", "full"]
    assert inputs["cuda_graph"][0] == ["off", "whole", "breakable"]
    assert FewStepCompile.CATEGORY.startswith("FewStep/") and FewStepCompile.RETURN_TYPES == (
        "FEWSTEP_MODEL",
    )
    (handle,) = FewStepCompile().attach(tiny, "regional", "off", True, "eager", False)
    assert handle.feature(COMPILE_FEATURE).config.mode == "regional" and handle.model is tiny.model
    if not torch.cuda.is_available():
        with pytest.raises(
            InputError, match=r"^FewStepCompile: input 'cuda_graph': CUDA graphs need a CUDA GPU"
        ):
            FewStepCompile().attach(tiny, "regional", "whole", True, "inductor", False)
    with pytest.raises(InputError, match=r"^FewStepCompile: input 'buckets': "):
        FewStepCompile().attach(tiny, "regional", "off", True, "inductor", False, buckets="1024")


# -- GPU ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_flux():
    if not torch.cuda.is_available():
        pytest.skip(NO_GPU)
    return open_model("dummy:flux-tiny", device="cuda", dtype=torch.float32)


def gpu_run(handle, seed=0, tokens=8):
    cond = make_cond(handle.params, tokens=tokens, seed=seed)
    return sample_latent(handle, [cond], LATENT, seed=seed)


@pytest.mark.parametrize("mode", ["whole", "breakable"])
def test_cuda_graph_replay_equals_eager_on_gpu(gpu_flux, mode):
    graphed = attach_compile(gpu_flux, "off", mode, break_at=("attention",) if mode == "breakable" else ())
    for seed in (0, 1):
        ref, _ = gpu_run(gpu_flux, seed=seed)
        out, report = gpu_run(graphed, seed=seed)
        assert max_diff(out, ref) <= 1e-5, report.summary()
    assert report.compile.graphs.hits == 4


def test_compile_and_cuda_graph_equal_eager_on_gpu(gpu_flux):
    torch._dynamo.reset()
    graphed = attach_compile(gpu_flux, "regional", "whole", backend="inductor")
    for seed in (0, 1):
        ref, _ = gpu_run(gpu_flux, seed=seed)
        out, report = gpu_run(graphed, seed=seed)
        assert max_diff(out, ref) <= TOL, report.summary()
    assert report.compile.graphs.hits == 4 and report.compile.frames_compiled == 0


def test_whole_graph_of_a_causal_stream_equals_eager_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip(NO_GPU)
    model = open_model("dummy:wan-tiny", device="cuda", dtype=torch.float32).model
    graphed = cuda_graph(model, "whole", weights=model)
    ref = causal_stream(model, model, chunks=12, window=PAST_WINDOW, device="cuda")
    out = causal_stream(model, graphed, chunks=12, window=PAST_WINDOW, device="cuda")
    assert max(max_diff(a, b) for a, b in zip(out, ref)) <= 1e-5
    assert graphed.stats.captures == 2 and graphed.stats.hits == 32, graphed.stats


def test_engine_api_takes_the_node_text_forms():
    from fewstep.engine.compile.options import CompileConfig

    assert CompileConfig(buckets="1024x1024, 768x1344").buckets == ((1024, 1024), (768, 1344))
    assert CompileConfig(break_at="collective, attention").break_at == ("collective", "attention")
    with pytest.raises(InputError, match=r"input 'break_at': unknown break points \['kv'\]"):
        CompileConfig(break_at="kv")  # the KV cache is captured with the step
    with pytest.raises(
        InputError, match=r"input 'buckets': 10x10 px: width and height must be positive multiples"
    ):
        CompileConfig(buckets="10x10")


@pytest.mark.slow
def test_telemetry_counts_frames_when_the_pack_is_a_symlink(tmp_path):
    """docs/install.md allows installing the pack as a symlink in custom_nodes; dynamo then records the link's paths,
    which the frame filter resolves before comparing them with the package root (it read 0 frames before)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from fewstep.engine.compile.telemetry import package_relative

    root = Path(__file__).resolve().parents[3]
    (tmp_path / "custom_nodes").mkdir()
    os.symlink(root, tmp_path / "custom_nodes" / "fewstep")
    code = (
        "import torch, fewstep; from fewstep.engine import open_model; "
        "from fewstep.engine.compile import CompileWatch; "
        "from fewstep.engine.models.flux import random_inputs; "
        "h = open_model('dummy:flux-tiny'); step = torch.compile(h.model, backend='eager'); "
        "w = CompileWatch().start(); step(**random_inputs(h.params, 64, 64, 8)); w.stop(); "
        "print(fewstep.__file__, len(w.frames), w.frames[0].file if w.frames else '-')"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "custom_nodes")}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    where, frames, first = out.stdout.split()
    assert where.startswith(str(tmp_path)), where  # imported through the link
    assert int(frames) >= 1 and first == "engine/models/flux.py"
    linked = str(tmp_path / "custom_nodes" / "fewstep" / "engine" / "models" / "flux.py")
    assert package_relative(linked, str(root)) == "engine/models/flux.py"
    assert package_relative("/usr/lib/python3/os.py", str(root)) is None
