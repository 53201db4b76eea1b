"""The speed features on FLUX.2 (klein / dev) and Z-Image: regional compile and CUDA graphs (engine.compile), the
step-cache gate (engine.step_cache). Sequence parallelism for them is tested with the worker pool in test_parallel.py.

Compiled models are module-scoped fixtures built after a ``torch._dynamo.reset()`` (counts do not depend on other
tests), with the ``aot_eager`` backend: dynamo's graphs, guards and recompiles are what these tests check, and it
compiles in seconds on two CPU cores (inductor's kernels for these blocks are the ones test_compile.py checks on
FLUX.1). Real CUDA-graph replay runs only on a GPU (skipped here, with the reason).
"""

from __future__ import annotations

import collections
import re

import pytest
import torch
from compile_doubles import EMULATED

from fewstep.engine import InputError, TextCondition, open_model, sample_latent
from fewstep.engine.compile import attach_compile, plan_breaks
from fewstep.engine.compile.feature import STEP_CACHE_NO_GRAPH
from fewstep.engine.compile.graphs import GraphedCallable
from fewstep.engine.compile.regional import BucketCheck
from fewstep.engine.models import flux2, flux2_layers, zimage, zimage_layers
from fewstep.engine.sampling import SCHEDULES
from fewstep.engine.step_cache import MIN_STEPS, STEP_CACHE_FEATURE, make_gate

TOL = 1e-4
NO_GPU = "CUDA-graph replay needs a CUDA GPU (torch.cuda.is_available() is False)"
# 64x64 px: FLUX.2 4 x 4 latent pixels = 16 tokens; Z-Image 8 x 8 latent, 4 x 4 patches = 16 tokens (padded to 32)
LATENTS = {
    "flux2-tiny": torch.zeros(1, 128, 4, 4),
    "flux2-tiny-dev": torch.zeros(1, 128, 4, 4),
    "zimage-tiny": torch.zeros(1, 16, 8, 8),
}
# The compiled runs: (latent, prompt tokens, another latent, other prompt tokens). dynamo's duck sizing gives a
# token count equal to a width of the model (zimage-tiny: head size 32, width 64; flux2-tiny: the RoPE half-head
# 16) that width's symbol, so it is specialised and the next size recompiles: these sizes avoid that (Z-Image pads
# the image and the caption to multiples of 32: 80 -> 96 and 120 -> 128 image tokens, 70 -> 96 and 100 -> 128
# caption tokens).
COMPILED_RUNS = {
    "flux2-tiny": (torch.zeros(1, 128, 4, 6), 8, torch.zeros(1, 128, 6, 6), 40),
    "flux2-tiny-dev": (torch.zeros(1, 128, 4, 6), 8, torch.zeros(1, 128, 6, 6), 40),
    "zimage-tiny": (torch.zeros(1, 16, 16, 20), 70, torch.zeros(1, 16, 20, 24), 100),
}
# 64x96 px: not a 64x64 bucket
OTHER_LATENTS = {
    "flux2-tiny": torch.zeros(1, 128, 4, 6),
    "flux2-tiny-dev": torch.zeros(1, 128, 4, 6),
    "zimage-tiny": torch.zeros(1, 16, 8, 12),
}
# Compiled functions per preset: one per block class (FLUX.2), one per stack of Z-Image's one block class (its
# noise refiner, context refiner and layers call it three ways; see engine.compile.regional.caller_names).
EXPECTED_CALLERS = {
    "flux2-tiny": {"compiled_DoubleStreamBlock": 1, "compiled_SingleStreamBlock": 1},
    "flux2-tiny-dev": {"compiled_DoubleStreamBlock": 1, "compiled_SingleStreamBlock": 1},
    "zimage-tiny": {
        "compiled_ZImageTransformerBlock_noise_refiner": 1,
        "compiled_ZImageTransformerBlock_context_refiner": 1,
        "compiled_ZImageTransformerBlock_layers": 1,
    },
}


def fresh(preset: str, **kwargs):
    return open_model(f"dummy:{preset}", device="cpu", dtype=torch.float32, **kwargs)


def image_cond(handle, tokens: int = 8, seed: int = 0, batch: int = 1) -> TextCondition:
    """Seeded conditioning of the family's width (FLUX.2: stacked text-encoder states; Z-Image: Qwen3 features;
    neither has a pooled vector)."""
    g = torch.Generator().manual_seed(seed)
    width = handle.family.image.context_dim(handle.params)
    return TextCondition(torch.randn(batch, tokens, width, generator=g), None, 4.0)


def run(handle, preset: str, tokens: int = 8, seed: int = 0, latent=None, **kwargs):
    latent = LATENTS[preset] if latent is None else latent
    return sample_latent(handle, [image_cond(handle, tokens, seed)], latent, seed=seed, **kwargs)


def max_diff(a, b) -> float:
    return float((a - b).abs().max())


def smooth_time_embedding(model) -> None:
    """Dummy weights answer very differently at adjacent timesteps: the random time MLP weighs every frequency of
    the sinusoidal embedding of 1000 * sigma, and the fast ones flip between steps 0.05 apart; FLUX.2 and Z-Image
    have no pooled vector that would keep the modulation steady (FLUX.1's test damps the time MLP instead). Keeping
    only the 28 slowest of the 128 frequencies gives the tiny models a trained model's smoothness (block 0's
    residual changes by 3-9% per step of a 20-step schedule, measured) so caching has something to skip."""
    first = model.time_in.in_layer if hasattr(model, "time_in") else model.t_embedder.mlp[0]
    with torch.no_grad():
        first.weight[:, :100] = 0  # cos half, fast frequencies
        first.weight[:, 128:228] = 0  # sin half


def callers(report) -> collections.Counter:
    return collections.Counter(f.name for f in report.compile.frames if f.name.startswith("compiled_"))


# -- regional compile ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=list(LATENTS))
def regional(request):
    preset = request.param
    latent, tokens, _, _ = COMPILED_RUNS[preset]
    torch._dynamo.reset()
    handle = fresh(preset)
    smooth_time_embedding(handle.model)  # so that the step-cache test below has steps to skip
    compiled = attach_compile(handle, "regional", backend="aot_eager")
    out, report = run(compiled, preset, tokens=tokens, latent=latent)
    return {"preset": preset, "handle": handle, "compiled": compiled, "out": out, "report": report}


@pytest.mark.slow
def test_regional_compile_equals_eager(regional):
    latent, tokens, _, _ = COMPILED_RUNS[regional["preset"]]
    ref, _ = run(regional["handle"], regional["preset"], tokens=tokens, latent=latent)
    assert max_diff(regional["out"], ref) <= TOL
    assert regional["report"].compile.frames_compiled > 0  # it did compile


@pytest.mark.slow
def test_regional_compiles_one_graph_per_block_class_and_stack(regional):
    report, model = regional["report"].compile, regional["handle"].model
    expected = EXPECTED_CALLERS[regional["preset"]]
    assert callers(regional["report"]) == expected
    assert report.frames_compiled == len(expected), report.summary_lines()
    assert report.recompiles == 0 and report.graph_breaks == {}, report.summary_lines()
    stacks = ("double_blocks", "single_blocks", "noise_refiner", "context_refiner", "layers")
    blocks = sum(len(getattr(model, name, ())) for name in stacks)
    assert blocks > len(expected)  # a graph is reused by every block of its class / stack, not one per layer


@pytest.mark.slow
def test_the_compiled_view_shares_the_model_blocks(regional):
    model = regional["handle"].model
    view = regional["compiled"].feature("compile").compiled.view
    stacks = ("double_blocks", "single_blocks") if regional["preset"].startswith("flux2") else (
        "noise_refiner", "context_refiner", "layers")  # fmt: skip
    for name in stacks:
        assert [b.block for b in getattr(view, name)] == list(getattr(model, name))
    if isinstance(model, flux2.Flux2):
        assert type(model.double_blocks[0]) is flux2_layers.DoubleStreamBlock
        # the shared modulation runs once per forward, eagerly, in the view as in the model
        assert view.double_stream_modulation_img is model.double_stream_modulation_img
    else:
        assert type(model.layers[0]) is zimage_layers.ZImageTransformerBlock
        assert view.layers[0].adaLN_modulation is model.layers[0].adaLN_modulation  # read through


@pytest.mark.slow
def test_other_prompt_lengths_and_sizes_reuse_the_compiled_blocks(regional):
    preset, compiled, handle = regional["preset"], regional["compiled"], regional["handle"]
    latent, tokens, other_latent, other_tokens = COMPILED_RUNS[preset]
    for t, x in ((other_tokens, latent), (tokens, other_latent), (other_tokens, other_latent)):
        out, report = run(compiled, preset, tokens=t, latent=x, seed=1)
        assert report.compile.frames_compiled == 0 and report.compile.recompiles == 0, report.summary()
        ref, _ = run(handle, preset, tokens=t, latent=x, seed=1)
        assert max_diff(out, ref) <= TOL


@pytest.mark.slow
def test_regional_compile_runs_under_a_step_cache(regional):
    preset, compiled, handle = regional["preset"], regional["compiled"], regional["handle"]
    latent, tokens, _, _ = COMPILED_RUNS[preset]
    gate = make_gate("first_block", 0.3, force=True)
    kwargs = {"tokens": tokens, "latent": latent, "steps": 12, "schedule": "flux.1-dev"}
    ref, ref_report = run(handle.with_feature(STEP_CACHE_FEATURE, gate), preset, **kwargs)
    out, report = run(compiled.with_feature(STEP_CACHE_FEATURE, gate), preset, **kwargs)
    assert ref_report.cache_probes > 0  # the cache did skip
    assert (report.model_calls, report.cache_probes) == (ref_report.model_calls, ref_report.cache_probes)
    assert max_diff(out, ref) <= TOL
    assert report.compile.frames_compiled == 0  # the step cache's block runner reuses the compiled blocks


# -- buckets, CUDA graphs ---------------------------------------------------------------------------------------------
def test_buckets_count_image_tokens_through_the_family_geometry():
    f2 = BucketCheck(fresh("flux2-tiny").model, ((64, 64), (64, 128)))
    assert f2.shapes == {(16,), (32,)}  # FLUX.2: 16 px a latent pixel, one token each
    assert f2(torch.zeros(1, 16, 128)) is None and f2(x=torch.zeros(1, 32, 128)) is None
    assert f2(torch.zeros(1, 64, 128)) == "image tokens (64,) is not one of the buckets [(16,), (32,)]"
    zi = BucketCheck(fresh("zimage-tiny").model, ((64, 64),))
    assert zi.shapes == {(16,)}  # Z-Image: 8 px a latent pixel, 2x2 patches (read from its latent input)
    assert zi(torch.zeros(1, 16, 8, 8), torch.zeros(1), torch.zeros(1, 8, 2560)) is None
    assert zi(torch.zeros(1, 16, 16, 8)) == "image tokens (32,) is not one of the buckets [(16,)]"


@pytest.mark.parametrize("preset", list(LATENTS))
@pytest.mark.slow
def test_emulated_whole_graph_replays_exactly(preset):
    handle = fresh(preset)
    graphed = attach_compile(handle, "off", "whole", graph_segments=EMULATED)
    ref, _ = run(handle, preset)
    out, report = run(graphed, preset)
    assert max_diff(out, ref) == 0.0
    g = report.compile.graphs
    assert (g.warmups, g.captures, g.hits, g.misses, g.held) == (1, 1, 2, 0, 1)
    out, report = run(graphed, preset)  # the next run replays every step
    assert max_diff(out, ref) == 0.0 and report.compile.graphs.hits == 4
    bucketed = attach_compile(handle, "off", "whole", graph_segments=EMULATED, buckets="64x64")
    _, report = run(bucketed, preset, latent=OTHER_LATENTS[preset])  # 64x96 px: not a bucket
    assert report.compile.graphs.captures == 0 and report.compile.graphs.misses == 4
    assert any("not one of the buckets" in r for r in report.compile.graphs.refused)


@pytest.mark.parametrize("preset", ["flux2-tiny", "zimage-tiny"])
def test_graphs_are_off_with_the_reason_under_an_active_step_cache(preset):
    handle = fresh(preset)
    graphed = attach_compile(handle, "off", "whole", graph_segments=EMULATED)
    gate = make_gate("first_block", 1.0, force=True)
    ref, _ = run(handle.with_feature(STEP_CACHE_FEATURE, gate), preset, steps=12, schedule="flux.1-dev")
    out, report = run(graphed.with_feature(STEP_CACHE_FEATURE, gate), preset, steps=12, schedule="flux.1-dev")
    assert max_diff(out, ref) == 0.0
    assert report.compile.graphs is None and STEP_CACHE_NO_GRAPH in report.compile.notes


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
@pytest.mark.parametrize("preset", ["flux2-tiny", "zimage-tiny"])
def test_cuda_graph_on_cpu_needs_allow_fallback(preset):
    handle = fresh(preset)
    with pytest.raises(InputError, match=r"input 'cuda_graph': CUDA graphs need a CUDA GPU.*allow_fallback"):
        attach_compile(handle, "off", "whole")
    fallback = attach_compile(handle, "off", "whole", allow_fallback=True)
    ref, _ = run(handle, preset)
    out, report = run(fallback, preset)
    assert torch.equal(out, ref)
    g = report.compile.graphs
    assert g.hits == 0 and g.misses == 4 and any("CUDA graphs need a CUDA GPU" in r for r in g.refused)
    assert any("allow_fallback" in n for n in report.compile.notes)
    real = GraphedCallable(handle.model, "whole", weights=handle.model)  # a real (not emulated) graph
    x = LATENTS[preset]
    inputs = (
        flux2.random_inputs(handle.params, 64, 64, 8)
        if preset.startswith("flux2")
        else {"x": torch.randn(x.shape), "t": torch.full((1,), 0.5), "cap_feats": torch.randn(1, 8, 2560)}
    )
    assert torch.equal(real(**inputs), handle.model(**inputs))
    (reason,) = real.stats.refused
    assert "weight tensors are on the CPU" in reason


def test_planner_cuts_flux2_and_zimage_at_their_attention_calls():
    f2 = fresh("flux2-tiny")
    plan = plan_breaks(f2.model, break_at=("attention",), **flux2.random_inputs(f2.params, 64, 64, 8))
    assert plan.break_modules == ["double_blocks.0", "double_blocks.1", "single_blocks.0", "single_blocks.1"]
    zi = fresh("zimage-tiny")
    inputs = zimage.random_inputs(zi.params, 64, 64, 8)
    plan = plan_breaks(zi.model, break_at=("attention",), **inputs)
    assert plan.break_modules == [
        "noise_refiner.0.attention", "context_refiner.0.attention", "layers.0.attention", "layers.1.attention"
    ]  # fmt: skip
    assert len(plan_breaks(zi.model, **inputs).segments) == 1  # no KV cache, no collective: one whole graph


@pytest.mark.parametrize("preset", ["flux2-tiny", "zimage-tiny"])
def test_cuda_graph_and_compile_equal_eager_on_gpu(preset):
    if not torch.cuda.is_available():
        pytest.skip(NO_GPU)
    torch._dynamo.reset()
    handle = open_model(f"dummy:{preset}", device="cuda", dtype=torch.float32)
    for mode, cuda_graph_mode in (("off", "whole"), ("regional", "whole")):
        graphed = attach_compile(handle, mode, cuda_graph_mode, backend="inductor")
        for seed in (0, 1):
            ref, _ = run(handle, preset, seed=seed)
            out, report = run(graphed, preset, seed=seed)
            assert max_diff(out, ref) <= TOL, report.summary()
        assert report.compile.graphs.hits == 4


# -- the step-cache gate ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["flux2-tiny", "zimage-tiny"])
def smooth(request):
    handle = fresh(request.param)
    smooth_time_embedding(handle.model)
    return request.param, handle


def _cached(handle, preset, gate=None, steps=20, schedule="flux.1-dev", **kwargs):
    h = handle if gate is None else handle.with_feature(STEP_CACHE_FEATURE, gate)
    return run(h, preset, steps=steps, schedule=schedule, seed=1, **kwargs)


class LastBlockCalls:
    """Counts calls of the last block of the stack a step cache skips (FLUX.2 single_blocks, Z-Image layers)."""

    def __init__(self, model):
        last = model.single_blocks[-1] if hasattr(model, "single_blocks") else model.layers[-1]
        self.calls = 0
        self.hook = last.register_forward_hook(self._count)

    def _count(self, module, args, out):
        self.calls += 1

    def close(self):
        self.hook.remove()


def test_first_block_cache_skips_blocks_and_threshold_zero_is_exact(smooth):
    preset, handle = smooth
    base, base_report = _cached(handle, preset)
    exact, report = _cached(handle, preset, make_gate("first_block", 0.0, start=0.0))
    assert torch.equal(exact, base)
    assert report.cache.decision.enabled and report.cache.skipped_steps == 0 and report.model_calls == 20
    counter = LastBlockCalls(handle.model)
    try:
        out, report = _cached(handle, preset, make_gate("first_block", 0.1))
    finally:
        counter.close()
    t = report.cache
    assert t.decision.enabled and not t.decision.forced
    assert t.skipped_steps == report.cache_probes == 20 - report.model_calls > 0
    assert counter.calls == report.model_calls == t.computed_steps < 20  # skipped steps ran block 0 only
    deviation = float((out - base).abs().max() / base.abs().max())
    assert deviation <= 0.03, f"{preset}: {deviation:.4f}"  # measured: 0.1% (FLUX.2), 1.0% (Z-Image)
    assert base_report.cache is None


def test_magcache_needs_a_calibration_and_then_skips(smooth, tmp_path):
    preset, handle = smooth
    with pytest.raises(InputError, match=r"input 'magcache_file': MagCache needs per-step ratios for this model "
                       rf"\({handle.family.name} \[{preset}, .*none are published for it: run a calibration"):  # fmt: skip
        make_gate("magcache").check_model(handle.model)
    path = tmp_path / f"{preset}-20.json"
    base, _ = _cached(handle, preset)
    _, calibration = _cached(handle, preset, make_gate("magcache", magcache_file=str(path), calibrate=True))
    assert calibration.cache.calibration_written == str(path)
    exact, _ = _cached(handle, preset, make_gate("magcache", 0.0, magcache_file=str(path)))
    assert torch.equal(exact, base)
    _, report = _cached(handle, preset, make_gate("magcache", 0.1, magcache_file=str(path)))
    assert report.cache.skipped_steps > 0


def test_teacache_is_refused_for_lack_of_published_coefficients(smooth):
    preset, handle = smooth
    title = {"flux2-tiny": "FLUX.2", "zimage-tiny": "Z-Image"}[preset]
    message = (
        f"input 'method': TeaCache needs a rescaling polynomial fitted on the model, and none is published for any "
        f"{title} model (this one: {preset}); TeaCache's polynomials exist only for flux.1-dev (flux.1), "
        "flux.1-schnell (flux.1), wan2.1-1.3b (wan2.1-t2v-1.3b), wan2.1-14b (wan2.1-t2v-14b). Use method "
        "'first_block' (First-Block-Cache needs no per-model fit), or 'magcache' with a calibration file "
        "(calibrate on, once per step count)"
    )
    with pytest.raises(InputError) as err:
        make_gate("teacache").check_model(handle.model)
    assert str(err.value) == message
    with pytest.raises(InputError, match=r"input 'model': TeaCache needs a rescaling polynomial"):
        _cached(handle, preset, make_gate("teacache"))  # the sampler refuses it as well
    with pytest.raises(
        InputError, match=rf"TeaCache coefficients 'flux.1' are for flux models, not {handle.family.name}"
    ):
        make_gate("teacache", teacache_coefficients="flux.1").check_model(handle.model)


def test_teacache_with_explicit_coefficients_probes_the_first_modulated_input(smooth):
    """For experiments: an explicit polynomial (here the identity) runs TeaCache on the family's probe (FLUX.2: block
    0's modulated image input from the shared modulation; Z-Image: layer 0's modulated image tokens)."""
    preset, handle = smooth
    base, _ = _cached(handle, preset)
    exact, _ = _cached(handle, preset, make_gate("teacache", 0.0, teacache_coefficients=(1.0, 0.0)))
    assert torch.equal(exact, base)
    out, report = _cached(handle, preset, make_gate("teacache", 0.3, teacache_coefficients=(1.0, 0.0)))
    changes = [r.change for r in report.cache.records[1:]]
    assert report.cache.skipped_steps > 0 and all(0.0 < c < 0.2 for c in changes), changes
    assert float((out - base).abs().max() / base.abs().max()) <= 0.06


@pytest.mark.parametrize("steps", [8, 9])
def test_the_gate_refuses_z_image_turbo_schedules_with_its_reason(steps):
    handle = fresh("zimage-tiny")
    base, _ = run(handle, "zimage-tiny", steps=steps, schedule="z-image-turbo")
    gated = handle.with_feature(STEP_CACHE_FEATURE, make_gate("first_block", 0.5))
    out, report = run(gated, "zimage-tiny", steps=steps, schedule="z-image-turbo")
    gaps = {8: "0.083 in sigma (median; largest 0.300)", 9: "0.084 in sigma (median; largest 0.273)"}[steps]
    assert report.cache.decision.reason == (
        f"{steps}-step distilled few-step schedule: adjacent steps differ by {gaps}; the gate needs at least "
        f"{MIN_STEPS} steps and a median gap of at most 0.06; caching would skip nothing or corrupt the image "
        "(force overrides)"
    )
    assert not report.cache.decision.enabled and report.cache.records == []
    assert torch.equal(out, base) and report.model_calls == steps


@pytest.mark.parametrize("preset", ["flux2-tiny", "flux2-tiny-dev"])
def test_the_gate_refuses_a_4_step_klein_schedule_with_its_reason(preset):
    handle = fresh(preset)
    # FLUX.2's own schedule when it is registered (its gaps depend on the resolution), else FLUX.1-schnell's
    schedule = handle.family.image.schedule if handle.family.image.schedule in SCHEDULES else "flux.1-schnell"
    base, _ = run(handle, preset, steps=4, schedule=schedule)
    gated = handle.with_feature(STEP_CACHE_FEATURE, make_gate("first_block", 0.5))
    out, report = run(gated, preset, steps=4, schedule=schedule)
    reason = report.cache.decision.reason
    assert re.fullmatch(
        r"4-step distilled few-step schedule: adjacent steps differ by 0\.\d{3} in sigma \(median; largest "
        rf"0\.\d{{3}}\); the gate needs at least {MIN_STEPS} steps and a median gap of at most 0\.06; caching "
        r"would skip nothing or corrupt the image \(force overrides\)",
        reason,
    ), reason
    assert not report.cache.decision.enabled and torch.equal(out, base) and report.model_calls == 4
    assert (
        "step cache first_block (threshold 0.5): off: 4-step distilled few-step schedule" in report.summary()
    )
