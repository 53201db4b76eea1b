"""Step-cache gating (engine.step_cache): exactness at threshold 0, fewer forwards within a stated tolerance, the gate's
refusals, state reset, exact telemetry, CFG gating, MagCache calibration files, bad input, Wan and causal chunks."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from conftest import make_cond

from fewstep.engine import InputError, TextCondition, open_model, sample_latent
from fewstep.engine.denoiser import FlowDenoiser
from fewstep.engine.models.flux import flux_velocity, image_ids, pack_latent, text_ids, unpack_latent
from fewstep.engine.sampling import sample_dmd, sample_euler, schedule_sigmas
from fewstep.engine.step_cache import (
    MIN_STEPS,
    STEP_CACHE_FEATURE,
    CacheGate,
    causal_chunk_decision,
    load_calibration,
    make_gate,
    model_identity,
)

STEPS = 28
# A cached 28-step run may differ from the uncached one by at most this fraction of the uncached output's
# largest magnitude (measured on the smooth tiny model: 0.7% at first_block 0.1, 1.1% at teacache 0.4, 1.8% at
# magcache 0.05).
TOLERANCE = 0.03


def _damp_time_embedding(model, factor: float = 0.1) -> None:
    """Dummy weights answer very differently at adjacent timesteps (a random time MLP on a sinusoidal embedding of
    1000 * sigma): block 0's residual changes by ~60% between steps of a 28-step schedule, where a trained model
    changes by a few percent. Scaling the time MLP's output layer down gives the tiny model that smoothness
    (~8% per step measured), so caching has something to skip."""
    layer = model.time_in.out_layer if hasattr(model, "time_in") else model.time_embedding[2]
    with torch.no_grad():
        layer.weight.mul_(factor)
        layer.bias.mul_(factor)


@pytest.fixture(scope="module")
def smooth_handle():
    handle = open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32)
    _damp_time_embedding(handle.model)
    return handle


class BlockCounter:
    """Counts block 0 and last-block calls (with their batch rows): a full forward runs both, a First-Block-Cache
    hit only block 0, a TeaCache / MagCache hit neither."""

    def __init__(self, model):
        self.first, self.last = [], []
        blocks = (
            list(model.double_blocks) + list(model.single_blocks)
            if hasattr(model, "double_blocks")
            else list(model.blocks)
        )
        self.hooks = [
            blocks[0].register_forward_hook(lambda m, a, out: self.first.append(_rows(out))),
            blocks[-1].register_forward_hook(lambda m, a, out: self.last.append(_rows(out))),
        ]

    def close(self):
        for h in self.hooks:
            h.remove()


def _rows(out) -> int:
    return (out[0] if isinstance(out, tuple) else out).shape[0]


def _latent(b=1, h=16, w=16):
    return torch.zeros(b, 16, h, w)


def _run(handle, gate=None, steps=STEPS, schedule="flux.1-dev", **kw):
    h = handle if gate is None else handle.with_feature(STEP_CACHE_FEATURE, gate)
    kw.setdefault("positive", [make_cond(handle.params)])
    positive = kw.pop("positive")
    return sample_latent(
        h, positive, kw.pop("latent", _latent()), steps=steps, schedule=schedule, seed=1, **kw
    )


def _calibrate(handle, path, steps=STEPS, **kw):
    gate = make_gate("magcache", magcache_file=str(path), calibrate=True)
    return _run(handle, gate, steps=steps, **kw)


# -- the model stages -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["flux-tiny", "flux-tiny-guidance"])
def test_flux_forward_is_its_stages_bit_for_bit(preset):
    handle = open_model(f"dummy:{preset}", device="cpu", dtype=torch.float32)
    model, p = handle.model, handle.params
    x, sigma = torch.randn(2, 16, 8, 12), torch.tensor([0.8, 0.3])
    cond = make_cond(p, batch=2, guidance=4.0)
    reference = flux_velocity(model, x, sigma, cond)
    guidance = torch.full((2,), 4.0) if p.guidance_embed else None
    h = model.embed(
        pack_latent(x), image_ids(2, 8, 12), cond.context, text_ids(2, 8), sigma, cond.pooled, guidance
    )
    for i in range(model.num_blocks):  # one block at a time, across the double -> single transition
        h = model.run_blocks(h, i, i + 1)
    assert torch.equal(unpack_latent(model.finish(h), 8, 12), reference)
    hooked = flux_velocity(model, x, sigma, cond, block_runner=lambda m, hid: m.run_blocks(hid))
    assert torch.equal(hooked, reference)


def test_wan_forward_is_its_stages_bit_for_bit():
    model = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32).model
    x, t, ctx = torch.randn(2, 16, 3, 4, 6), torch.tensor([700.0, 200.0]), torch.randn(2, 9, 4096)
    reference = model(x, t, ctx)
    h = model.run_blocks(model.run_blocks(model.embed(x, t, ctx), 0, 1), 1)
    assert torch.equal(model.finish(h), reference)
    assert torch.equal(model(x, t, ctx, block_runner=lambda m, hid: m.run_blocks(hid)), reference)


# -- exactness and savings ----------------------------------------------------------------------------------------
def test_threshold_zero_equals_the_uncached_run_exactly(smooth_handle, tmp_path):
    base, base_report = _run(smooth_handle)
    _calibrate(smooth_handle, tmp_path / "cal.json")
    gates = {
        "first_block": make_gate("first_block", 0.0, start=0.0),
        "teacache": make_gate("teacache", 0.0, start=0.0, teacache_coefficients="flux.1"),
        "magcache": make_gate("magcache", 0.0, start=0.0, magcache_file=str(tmp_path / "cal.json")),
    }
    for method, gate in gates.items():
        out, report = _run(smooth_handle, gate)
        assert torch.equal(out, base), method
        assert report.model_calls == STEPS and report.cache_probes == 0, method
        assert report.cache.decision.enabled and report.cache.skipped_steps == 0, method
    assert base_report.cache is None


@pytest.mark.parametrize(
    "method,threshold,max_forwards",
    [("first_block", 0.1, 20), ("teacache", 0.4, 20), ("magcache", 0.05, 20)],
)
def test_moderate_threshold_makes_fewer_forwards_within_tolerance(
    smooth_handle, tmp_path, method, threshold, max_forwards
):
    base, _ = _run(smooth_handle)
    options = {"teacache_coefficients": "flux.1"} if method == "teacache" else {}
    if method == "magcache":
        _calibrate(smooth_handle, tmp_path / "cal.json")
        options = {"magcache_file": str(tmp_path / "cal.json")}
    gate = make_gate(method, threshold, **options)
    counter = BlockCounter(smooth_handle.model)
    try:
        out, report = _run(smooth_handle, gate)
    finally:
        counter.close()
    t = report.cache
    assert len(counter.last) == report.model_calls == t.full_forwards == t.computed_steps <= max_forwards
    assert t.skipped_steps == report.cache_probes == STEPS - t.computed_steps > 0
    # First-Block-Cache runs block 0 on every step; TeaCache and MagCache skip the whole stack
    assert len(counter.first) == (STEPS if method == "first_block" else t.computed_steps)
    deviation = float((out - base).abs().max() / base.abs().max())
    assert deviation <= TOLERANCE, f"{method}: {deviation:.4f}"


def test_gate_refuses_a_4_step_schnell_schedule_with_its_reason(tiny_handle):
    base, _ = _run(tiny_handle, steps=4, schedule="flux.1-schnell")
    out, report = _run(tiny_handle, make_gate("first_block", 0.5), steps=4, schedule="flux.1-schnell")
    decision = report.cache.decision
    assert not decision.enabled and not decision.forced
    assert decision.reason == (
        "4-step distilled few-step schedule: adjacent steps differ by 0.250 in sigma (median; largest 0.250); "
        f"the gate needs at least {MIN_STEPS} steps and a median gap of at most 0.06; caching would skip nothing "
        "or corrupt the image (force overrides)"
    )
    assert torch.equal(out, base) and report.model_calls == 4 and report.cache.records == []
    assert (
        "step cache first_block (threshold 0.5): off: 4-step distilled few-step schedule" in report.summary()
    )


def test_gate_refuses_re_noising_samplers_and_force_overrides_with_a_warning(smooth_handle, caplog):
    _, report = _run(smooth_handle, make_gate("first_block", 0.1), sampler="dmd")
    assert not report.cache.decision.enabled
    assert report.cache.decision.reason.startswith("sampler 'dmd' re-noises every step")
    with caplog.at_level(logging.WARNING, logger="fewstep.engine.step_cache"):
        _, forced = _run(
            smooth_handle, make_gate("first_block", 0.5, force=True), steps=4, schedule="flux.1-schnell"
        )
    assert forced.cache.decision.enabled and forced.cache.decision.forced
    assert any("forced on" in r.getMessage() and "4-step" in r.getMessage() for r in caplog.records)
    assert "forced on against the gate's policy (4-step" in forced.summary()


def test_two_consecutive_runs_give_identical_results(smooth_handle):
    gate = make_gate("first_block", 0.1)
    a, ra = _run(smooth_handle, gate)
    b, rb = _run(smooth_handle, gate)
    assert torch.equal(a, b)
    assert [r.change for r in ra.cache.records] == [r.change for r in rb.cache.records]
    assert ra.cache.computed_steps == rb.cache.computed_steps < STEPS


def test_telemetry_counts_are_exact(smooth_handle):
    threshold = 0.1
    counter = BlockCounter(smooth_handle.model)
    try:
        _, report = _run(smooth_handle, make_gate("first_block", threshold, start=0.1))
    finally:
        counter.close()
    t = report.cache
    window = set(t.decision.cache_steps)
    assert window == set(range(3, STEPS - 1))  # 3 / 28 >= 0.1; the last step is always computed
    assert [r.index for r in t.records] == list(range(STEPS))
    assert t.records[0].change is None
    for r in t.records:  # every decision follows from the recorded change
        assert r.computed == (r.index not in window or not r.change < threshold), r
    skipped = [r.index for r in t.records if not r.computed]
    assert t.skipped_steps == len(skipped) == report.cache_probes and t.computed_steps == STEPS - len(skipped)
    assert (len(counter.first), len(counter.last)) == (STEPS, t.computed_steps)
    blocks = smooth_handle.model.num_blocks  # 4: two double-stream + two single-stream blocks
    assert t.estimated_speedup == STEPS * blocks / (t.computed_steps * blocks + len(skipped) * 1)
    summary = report.summary()
    assert f"{t.computed_steps} steps computed, {len(skipped)} skipped of {STEPS}" in summary
    assert f"{skipped[0]}:{t.records[skipped[0]].change:.4g}*" in summary
    assert t.warnings == []


def _euler_cfg_reference(handle, pos, neg, cfg, sigmas, cutoff_step, seed=1):
    """The CFG-gated Euler run written out: v_neg = v_pos + (v_neg - v_pos of the last full step) from cutoff."""
    model, fmt = handle.model, handle.family.latent_format
    x = sigmas[0] * torch.randn(_latent().shape, generator=torch.Generator().manual_seed(seed))
    delta = None
    for i in range(len(sigmas) - 1):
        s = sigmas[i].reshape(1)
        v_pos = flux_velocity(model, x, s, pos)
        if i < cutoff_step:
            delta = flux_velocity(model, x, s, neg) - v_pos
        v = v_pos + delta + cfg * (v_pos - (v_pos + delta))
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return fmt.process_out(x)


@pytest.mark.slow
def test_cfg_gating_drops_the_unconditional_rows_after_the_cutoff(smooth_handle):
    p = smooth_handle.params
    pos, neg = make_cond(p), make_cond(p, seed=9)
    gate = make_gate("first_block", 0.0, cfg_cutoff=0.5)
    counter = BlockCounter(smooth_handle.model)
    try:
        out, report = _run(smooth_handle, gate, positive=[pos], negative=[neg], cfg=3.0)
    finally:
        counter.close()
    assert (
        counter.last == [2] * 14 + [1] * 14
    )  # batched [pos, neg] until step 14, then the positive rows only
    assert report.cache.uncond_skipped == 14 and report.cache.decision.cfg_skip_from == 14
    assert report.model_calls == STEPS and report.rows_evaluated == 42
    sigmas = torch.tensor(report.sigmas)
    expected = _euler_cfg_reference(smooth_handle, pos, neg, 3.0, sigmas, cutoff_step=14)
    assert torch.allclose(out, expected, atol=1e-5, rtol=1e-5)
    assert report.cache.estimated_speedup == pytest.approx(56 / 42)
    # a negative of another token count runs as its own forward: 2 forwards per step, then 1
    counter = BlockCounter(smooth_handle.model)
    try:
        _, report = _run(
            smooth_handle, gate, positive=[pos], negative=[make_cond(p, tokens=5, seed=9)], cfg=3.0
        )
    finally:
        counter.close()
    assert counter.last == [1] * (2 * 14 + 14) and report.model_calls == 42
    # cutoff 1 (the default) never skips: exactly the uncached CFG run
    base, _ = _run(smooth_handle, positive=[pos], negative=[neg], cfg=3.0)
    same, _ = _run(smooth_handle, make_gate("first_block", 0.0), positive=[pos], negative=[neg], cfg=3.0)
    assert torch.equal(same, base)


def test_magcache_calibration_file_round_trip(smooth_handle, tmp_path):
    path = tmp_path / "sub" / "flux-tiny-28.json"
    base, _ = _run(smooth_handle)
    out, report = _calibrate(smooth_handle, path)
    assert torch.equal(out, base)  # a calibration run computes every step
    assert report.cache.calibration_written == str(path) and report.cache.skipped_steps == 0
    data = json.loads(path.read_text())
    assert data["format"] == "fewstep-magcache" and data["version"] == 1 and data["steps"] == STEPS
    assert data["model"] == model_identity(smooth_handle.model)
    assert data["model"]["family"] == "flux" and data["model"]["preset"] == "flux-tiny"
    assert data["sampler"] == "euler" and data["sigmas"] == pytest.approx(report.sigmas)
    assert len(data["ratios"]) == STEPS and data["ratios"][0] == 1.0
    assert all(math.isfinite(r) and r > 0 for r in data["ratios"]) and len(set(data["ratios"])) > 1
    assert [r.change for r in report.cache.records] == data[
        "ratios"
    ]  # what the report showed is what was saved
    calibration = load_calibration(path)
    assert calibration.ratios == tuple(data["ratios"]) and calibration.steps == STEPS
    gate = make_gate("magcache", 0.24, magcache_file=str(path))
    assert gate.calibration == calibration
    gate.check_model(smooth_handle.model)
    _, used = _run(smooth_handle, gate)
    assert [r.change for r in used.cache.records] == data["ratios"] and used.cache.skipped_steps > 0


# -- bad input ----------------------------------------------------------------------------------------------------
def test_unknown_method():
    with pytest.raises(
        InputError,
        match=r"input 'method': unknown step-cache method 'fbcache'; known: first_block \(First-Block-Cache\), "
        r"teacache \(TeaCache\), magcache \(MagCache\)",
    ):
        make_gate("fbcache")
    with pytest.raises(InputError, match=r"input 'method': .*first_block needs the model split into stages"):
        make_gate("first_block", level="model")


def test_teacache_on_a_model_without_coefficients(tiny_handle):
    gate = make_gate("teacache", 0.4)
    with pytest.raises(
        InputError,
        match=r"input 'method': TeaCache needs a rescaling polynomial fitted on the model, and this flux model "
        r"\(flux-tiny\) has none; published polynomials exist for flux.1-dev \(flux.1\), flux.1-schnell "
        r"\(flux.1\), wan2.1-1.3b \(wan2.1-t2v-1.3b\), wan2.1-14b \(wan2.1-t2v-14b\). Use method 'first_block'",
    ):
        gate.check_model(tiny_handle.model)
    with pytest.raises(InputError, match=r"input 'model': TeaCache needs a rescaling polynomial"):
        _run(tiny_handle, gate)  # the sampler refuses it as well
    with pytest.raises(
        InputError, match=r"TeaCache coefficients 'wan2.1-t2v-1.3b' are for wan models, not flux"
    ):
        make_gate("teacache", teacache_coefficients="wan2.1-t2v-1.3b").check_model(tiny_handle.model)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (
            {"threshold": -0.1},
            r"input 'threshold': -0.1 is out of range for first_block: expected 0 <= threshold <= 1",
        ),
        ({"threshold": 1.5}, r"input 'threshold': 1.5 is out of range for first_block"),
        ({"threshold": float("nan")}, r"input 'threshold': nan is out of range"),
        (
            {"method": "teacache", "threshold": 2.5},
            r"input 'threshold': 2.5 is out of range for teacache: .* <= 2",
        ),
        ({"start": 1.0}, r"input 'start': 1.0 is not a fraction of the steps in \[0, 1\)"),
        ({"start": 0.5, "end": 0.5}, r"input 'end': 0.5: expected start \(0.5\) < end <= 1"),
        ({"cfg_cutoff": 1.5}, r"input 'cfg_cutoff': 1.5 is not a fraction"),
        (
            {"calibrate": True},
            r"input 'calibrate': calibration records MagCache ratios; method is first_block",
        ),
        ({"method": "magcache", "calibrate": True}, r"input 'magcache_file': calibrate is on: give the file"),
    ],
)
def test_out_of_range_inputs(kwargs, pattern):
    with pytest.raises(InputError, match=pattern):
        make_gate(**kwargs)


def test_magcache_file_for_another_model_or_step_count(smooth_handle, tiny_guidance_handle, tmp_path):
    path = tmp_path / "cal.json"
    _calibrate(smooth_handle, path)
    gate = make_gate("magcache", 0.24, magcache_file=str(path))
    with pytest.raises(
        InputError,
        match=r"input 'magcache_file': the MagCache calibration .*cal.json was recorded on flux \[flux-tiny, config "
        r"\w+\]; this model is flux \[flux-tiny-guidance, config \w+\]",
    ):
        gate.check_model(tiny_guidance_handle.model)
    with pytest.raises(
        InputError,
        match=r"input 'steps': the MagCache calibration .* was recorded for 28 steps; this run has 20",
    ):
        _run(smooth_handle, gate, steps=20)
    with pytest.raises(
        InputError, match=r"input 'magcache_file': MagCache needs per-step ratios for this model"
    ):
        make_gate("magcache").check_model(smooth_handle.model)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InputError, match=r"input 'magcache_file': .*bad.json is not a readable JSON file"):
        make_gate("magcache", magcache_file=str(tmp_path / "bad.json"))
    (tmp_path / "other.json").write_text(json.dumps({"ratios": [1.0]}))
    with pytest.raises(InputError, match=r"other.json is not a MagCache calibration"):
        make_gate("magcache", magcache_file=str(tmp_path / "other.json"))
    with pytest.raises(InputError, match=r"MagCache calibration file not found: .*missing.json"):
        make_gate("magcache", magcache_file=str(tmp_path / "missing.json"))


# -- measurement warnings -------------------------------------------------------------------------------------------
def test_nan_and_exactly_zero_changes_are_reported():
    nan_handle = open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32)
    with torch.no_grad():
        nan_handle.model.double_blocks[0].img_mlp[0].bias[0] = float("nan")
    with pytest.raises(
        InputError, match="the sampled latent is not finite"
    ):  # sample_latent refuses the result
        _run(nan_handle, make_gate("first_block", 0.5))
    # the gate's own telemetry, from the sampler loop itself
    sigmas = schedule_sigmas("flux.1-dev", STEPS, image_seq_len=64)
    run = make_gate("first_block", 0.5).start_run(nan_handle.model, sigmas, "euler")
    denoiser = FlowDenoiser(
        nan_handle.model, nan_handle.family, [make_cond(nan_handle.params)], step_cache=run
    )
    with torch.inference_mode():
        sample_euler(denoiser, torch.randn(_latent().shape), sigmas, disable=True)
    cache = run.finish()
    assert cache.skipped_steps == 0  # NaN is never below a threshold: the always-miss bug
    assert any("NaN at steps [1, 2" in w for w in cache.warnings)
    assert "warning: the measured change was NaN" in "\n".join(cache.summary_lines())
    frozen = open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32)
    with torch.no_grad():  # block 0 leaves the image tokens unchanged: its residual is exactly 0 every step
        frozen.model.double_blocks[0].img_mod.lin.weight.zero_()
        frozen.model.double_blocks[0].img_mod.lin.bias.zero_()
    _, report = _run(frozen, make_gate("first_block", 0.5))
    assert any("exactly 0 at steps [1, 2" in w for w in report.cache.warnings)


# -- the handle feature, Wan, causal chunks ---------------------------------------------------------------------------
def test_the_gate_is_a_handle_feature_and_the_model_is_not_touched(tiny_handle):
    before = {k: v.clone() for k, v in tiny_handle.model.state_dict().items()}
    attrs = set(vars(tiny_handle.model))
    gated = tiny_handle.with_feature(STEP_CACHE_FEATURE, make_gate("first_block", 0.1))
    assert gated.model is tiny_handle.model and tiny_handle.feature(STEP_CACHE_FEATURE) is None
    assert isinstance(gated.feature(STEP_CACHE_FEATURE), CacheGate)
    _run(tiny_handle.with_feature(STEP_CACHE_FEATURE, make_gate("first_block", 0.9)))
    assert set(vars(tiny_handle.model)) == attrs
    assert all(torch.equal(v, before[k]) for k, v in tiny_handle.model.state_dict().items())


def _wan_run(handle, gate=None, steps=20):
    p = handle.params
    cond = TextCondition(torch.randn(1, 6, p.text_dim, generator=torch.Generator().manual_seed(3)))
    sigmas = schedule_sigmas("flux.1-schnell", steps)  # plain linear flow schedule
    run = gate.start_run(handle.model, sigmas, "euler") if gate is not None else None
    denoiser = FlowDenoiser(handle.model, handle.family, [cond], step_cache=run)
    x = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        out = sample_euler(denoiser, x, sigmas, disable=True)
    return out, denoiser, run.finish() if run is not None else None


def test_bidirectional_wan_through_the_velocity_adapter():
    handle = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32)
    _damp_time_embedding(handle.model)
    base, plain, _ = _wan_run(handle)
    exact, den, telemetry = _wan_run(handle, make_gate("first_block", 0.0))
    assert torch.equal(exact, base) and den.model_calls == 20 and telemetry.decision.enabled
    tea, den, telemetry = _wan_run(
        handle, make_gate("teacache", 0.0, teacache_coefficients="wan2.1-t2v-1.3b")
    )
    assert torch.equal(tea, base) and telemetry.records[1].change is not None
    cached, den, telemetry = _wan_run(handle, make_gate("first_block", 0.2))
    assert den.model_calls == telemetry.computed_steps < 20 and den.cache_probes == telemetry.skipped_steps
    assert float((cached - base).abs().max() / base.abs().max()) <= TOLERANCE


def test_causal_chunks_normally_disable_the_gate():
    sigmas = schedule_sigmas("wan-dmd-4step", None)
    decision = causal_chunk_decision(make_gate("first_block", 0.08), sigmas)
    assert not decision.enabled
    assert decision.reason.startswith("causal chunk: sampler 'dmd' re-noises every step")
    assert "4-step distilled few-step schedule: adjacent steps differ by 0.104 in sigma" in decision.reason
    forced = causal_chunk_decision(make_gate("first_block", 0.08, force=True), sigmas)
    assert forced.enabled and forced.forced and forced.cache_steps == (1, 2)


def test_the_causal_chunk_recipe_runs_a_forced_gate_exactly_at_threshold_zero():
    """What engine/causal/session.py calls per chunk: start_run(..., "dmd", context="causal chunk"), then per step
    begin_step(sigma) and model(..., block_runner=run.block_runner()), then finish()."""
    model = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32).model
    ctx = torch.randn(1, 6, 4096, generator=torch.Generator().manual_seed(3))
    sigmas = schedule_sigmas("wan-dmd-4step", None)

    def chunk(gate):
        run = gate.start_run(model, sigmas, "dmd", context="causal chunk") if gate is not None else None
        active = run is not None and run.active
        calls = []

        def denoised(x, sigma, **_):
            if active:
                run.begin_step(sigma)
            runner = run.block_runner() if active else None
            calls.append(runner is not None)
            return x - sigma.view(-1, 1, 1, 1, 1) * model(x, sigma * 1000.0, ctx, block_runner=runner)

        gen = torch.Generator().manual_seed(5)
        x = torch.randn(1, 16, 2, 4, 4, generator=gen)
        with torch.inference_mode():
            out = sample_dmd(
                denoised, x, sigmas, noise_sampler=lambda *_: torch.randn(x.shape, generator=gen)
            )
        return out, calls, run.finish() if run is not None else None

    base, _, _ = chunk(None)
    refused, calls, telemetry = chunk(make_gate("first_block", 0.08))
    assert torch.equal(refused, base) and calls == [False] * 4 and not telemetry.decision.enabled
    forced, calls, telemetry = chunk(make_gate("first_block", 0.0, force=True))
    assert torch.equal(forced, base) and calls == [True] * 4 and telemetry.decision.forced
    assert [r.index for r in telemetry.records] == [0, 1, 2, 3] and telemetry.full_forwards == 4


def test_eps_model_sigmas_are_judged_as_flow_noise_levels():
    """k-diffusion sigmas of eps/v models (14.6 -> 0.03) are compared as sigma / (1 + sigma)."""
    from fewstep.engine.step_cache.policy import decide

    def ve_sigmas(steps):  # a log-linear VE schedule like ComfyUI's 'simple' for SD1.5, ending in 0
        return torch.cat([torch.logspace(math.log10(14.6), math.log10(0.03), steps), torch.zeros(1)])

    assert decide(ve_sigmas(28), "euler").enabled
    off = decide(ve_sigmas(4), "euler")
    assert not off.enabled and "4-step" in off.reason
