"""The step-cache gate nodes, with the pack loaded as ComfyUI loads it and ComfyUI's sampling path faked.

FewStepCacheGateNative works through ModelPatcher wrappers only. The fakes below reproduce the parts of
ComfyUI it relies on (comfy/patcher_extension.py WrapperExecutor, comfy/samplers.py CFGGuider.sample ->
outer_sample -> inner_sample and calc_cond_batch, a DIFFUSION_MODEL-wrapped diffusion model); the run against a
real ComfyUI belongs to the end-to-end suite.
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
import sys
import types

import pytest
import torch
from conftest import make_cond
from fake_folder_paths import make_folder_paths

from fewstep.engine import open_model
from fewstep.engine.models.flux import flux_velocity
from fewstep.engine.sampling import schedule_sigmas

OUTER, CALC, DIFFUSION = "outer_sample", "calc_cond_batch", "diffusion_model"


class WrapperExecutor:
    """comfy.patcher_extension.WrapperExecutor: ``wrapper(executor, *args)``; ``executor(*args)`` runs the next."""

    def __init__(self, original, class_obj, wrappers, idx=0):
        self.original, self.class_obj, self.wrappers, self.idx = original, class_obj, list(wrappers), idx

    def __call__(self, *args, **kwargs):
        return WrapperExecutor(self.original, self.class_obj, self.wrappers, self.idx + 1).execute(
            *args, **kwargs
        )

    def execute(self, *args, **kwargs):
        if self.idx == len(self.wrappers):
            return self.original(*args, **kwargs)
        return self.wrappers[self.idx](self, *args, **kwargs)


class Patcher:
    """The parts of comfy.model_patcher.ModelPatcher the node uses."""

    def __init__(self, model):
        self.model = model
        self.model_options = {"transformer_options": {}}
        self.wrappers: dict = {}

    def clone(self):
        n = Patcher(self.model)
        n.model_options = copy.deepcopy(self.model_options)
        n.wrappers = {k: {kk: list(vv) for kk, vv in v.items()} for k, v in self.wrappers.items()}
        return n

    def add_wrapper_with_key(self, wrapper_type, key, wrapper):
        self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(wrapper)

    def all_wrappers(self, wrapper_type):
        return [w for ws in self.wrappers.get(wrapper_type, {}).values() for w in ws]


class DiffusionModel:
    """A ComfyUI-style diffusion model over the engine's FLUX: ``forward(x, timestep, context, y, guidance,
    transformer_options)`` goes through the DIFFUSION_MODEL wrappers; ``calls`` records the rows of each run."""

    def __init__(self, engine_model, patcher_ref):
        self.engine_model, self.patcher_ref, self.calls = engine_model, patcher_ref, []

    def forward(self, x, timestep, context, y, guidance, transformer_options):
        wrappers = transformer_options.get("wrappers", {}).get(DIFFUSION, [])
        return WrapperExecutor(self._forward, self, wrappers).execute(
            x, timestep, context, y, guidance, transformer_options
        )

    def _forward(self, x, timestep, context, y, guidance, transformer_options):
        self.calls.append(x.shape[0])
        cond = types.SimpleNamespace(context=context, pooled=y, guidance=None)
        return flux_velocity(self.engine_model, x, timestep, cond)


class BaseModel:
    def __init__(self, engine_model, unet_config):
        self.diffusion_model = DiffusionModel(engine_model, None)
        self.model_config = types.SimpleNamespace(unet_config=unet_config)


def calc_cond_batch(model, conds, x_in, timestep, model_options):
    """comfy.samplers._calc_cond_batch reduced: present conds batched into one diffusion-model call, x0 out.
    ComfyUI pops them from the end of its list, so the unconditional rows come first in the batch."""
    present = [(i, c) for i, c in enumerate(conds) if c is not None][::-1]
    options = {
        **model_options["transformer_options"],
        "uuids": [c["uuid"] for _, c in present],
        "cond_or_uncond": [i for i, _ in present],
        "sigmas": timestep,
    }
    n = len(present)
    v = model.diffusion_model.forward(
        x_in.repeat(n, 1, 1, 1),
        timestep.repeat(n),
        torch.cat([c["cond"].context for _, c in present]),
        torch.cat([c["cond"].pooled for _, c in present]),
        None,
        options,
    )
    out = [torch.zeros_like(x_in) for _ in conds]
    for j, (i, _) in enumerate(present):
        out[i] = x_in - timestep.view(-1, 1, 1, 1) * v[j * x_in.shape[0] : (j + 1) * x_in.shape[0]]
    return out


class Guider:
    """comfy.samplers.CFGGuider's sample -> outer_sample -> inner_sample, with an Euler sampler inside."""

    def __init__(self, patcher, positive, negative=None, cfg=1.0):
        self.model_patcher, self.cfg = patcher, cfg
        self.conds = [
            {"uuid": "u-pos", "cond": positive},
            {"uuid": "u-neg", "cond": negative} if negative else None,
        ]
        self.model_options = patcher.model_options

    def sample(self, noise, sampler, sigmas):
        original = self.model_options
        self.model_options = copy.copy(original)
        self.model_options["transformer_options"] = {
            **original.get("transformer_options", {}),
            "wrappers": {kind: self.model_patcher.all_wrappers(kind) for kind in (CALC, DIFFUSION)},
        }
        try:
            return WrapperExecutor(self.outer_sample, self, self.model_patcher.all_wrappers(OUTER)).execute(
                noise, None, sampler, sigmas, None, None, True, 0
            )
        finally:
            self.model_options = original

    def outer_sample(self, noise, latent_image, sampler, sigmas, denoise_mask, callback, disable_pbar, seed):
        options = {**self.model_options}
        options["transformer_options"] = {**options["transformer_options"], "sample_sigmas": sigmas}
        base = self.model_patcher.model
        x = sigmas[0] * noise
        for i in range(len(sigmas) - 1):
            conds = [self.conds[0], self.conds[1] if self.cfg != 1.0 else None]
            wrappers = options["transformer_options"]["wrappers"][CALC]
            out = WrapperExecutor(calc_cond_batch, None, wrappers).execute(
                base, conds, x, sigmas[i].reshape(1), options
            )
            denoised = out[0] if conds[1] is None else out[1] + self.cfg * (out[0] - out[1])
            x = x + (x - denoised) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
        return x


def sample_euler():  # what a KSAMPLER's sampler_function is named after
    pass


def sample_euler_ancestral():
    pass


@pytest.fixture
def comfy(monkeypatch, tmp_path):
    ext = types.SimpleNamespace(WrappersMP=types.SimpleNamespace(OUTER_SAMPLE=OUTER, CALC_COND_BATCH=CALC,
                                                                DIFFUSION_MODEL=DIFFUSION))  # fmt: skip
    monkeypatch.setitem(sys.modules, "comfy.patcher_extension", ext)
    monkeypatch.setitem(sys.modules, "folder_paths", make_folder_paths(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def engine_model():
    handle = open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32)
    with (
        torch.no_grad()
    ):  # smooth across timesteps as a trained model is (see test_step_cache._damp_time_embedding)
        handle.model.time_in.out_layer.weight.mul_(0.1)
        handle.model.time_in.out_layer.bias.mul_(0.1)
    return handle.model


@pytest.fixture
def nodes(pack):
    return importlib.import_module(f"{pack.__name__}.nodes.step_cache")


def _patcher(engine_model, config=None):
    return Patcher(BaseModel(engine_model, config or {"image_model": "flux", "depth": 2}))


def _attach(nodes, patcher, **inputs):
    args = dict(method="input_change", threshold=0.1, start=0.1, end=1.0, force=False, cfg_cutoff=1.0)
    args.update(inputs)
    return nodes.FewStepCacheGateNative().attach(patcher, **args)[0]


def _sample(
    patcher, engine_model, steps=28, schedule="flux.1-dev", sampler=sample_euler, cfg=1.0, negative=False
):
    p = engine_model.params
    pos = make_cond(p)
    neg = make_cond(p, seed=9) if negative else None
    sigmas = schedule_sigmas(schedule, steps, image_seq_len=64)
    noise = torch.randn(1, 16, 16, 16, generator=torch.Generator().manual_seed(1))
    guider = Guider(patcher, pos, neg, cfg)
    calls = patcher.model.diffusion_model.calls
    calls.clear()
    with torch.no_grad():
        out = guider.sample(noise, types.SimpleNamespace(sampler_function=sampler), sigmas)
    return out, list(calls), guider


def test_native_node_contract(nodes):
    for cls in (nodes.FewStepCacheGateNative, nodes.FewStepCacheGate):
        assert cls.CATEGORY.startswith("FewStep/") and len(cls.RETURN_TYPES) == len(cls.RETURN_NAMES)
        spec = cls.INPUT_TYPES()
        for section in ("required", "optional"):
            for name, entry in spec[section].items():
                assert entry[1]["tooltip"], (cls.__name__, name)
    assert nodes.FewStepCacheGateNative.RETURN_TYPES == ("MODEL",)
    assert nodes.FewStepCacheGateNative.INPUT_TYPES()["required"]["method"][0] == ["input_change", "magcache"]


def test_native_node_clones_and_only_adds_wrappers(comfy, nodes, engine_model):
    patcher = _patcher(engine_model)
    original_options = copy.deepcopy(patcher.model_options)
    patched = _attach(nodes, patcher)
    assert patched is not patcher and patched.model is patcher.model
    assert patcher.wrappers == {} and patcher.model_options == original_options  # the input is untouched
    assert {k: list(v) for k, v in patched.wrappers.items()} == {
        OUTER: ["fewstep_cache_gate"], CALC: ["fewstep_cache_gate"], DIFFUSION: ["fewstep_cache_gate"]
    }  # fmt: skip
    gate = patched.model_options["transformer_options"]["fewstep_cache_gate"]
    assert gate.method == "input_change" and gate.level == "model"
    dm = patched.model.diffusion_model
    assert "forward" not in vars(dm) and "_forward" not in vars(dm)  # no forward was replaced
    _sample(patched, engine_model)
    assert (
        "fewstep_cache_run" not in patched.model_options["transformer_options"]
    )  # the holder left with the run


def test_native_threshold_zero_equals_the_plain_run_and_a_moderate_one_calls_less(comfy, nodes, engine_model):
    plain, plain_calls, _ = _sample(_patcher(engine_model), engine_model)
    exact, exact_calls, _ = _sample(_attach(nodes, _patcher(engine_model), threshold=0.0), engine_model)
    assert torch.equal(exact, plain) and len(exact_calls) == len(plain_calls) == 28
    # measured: 16 calls, 1.5% of the output's largest magnitude (threshold 0.1: 11 calls, 2.8%)
    cached, calls, _ = _sample(_attach(nodes, _patcher(engine_model), threshold=0.05), engine_model)
    assert len(calls) < 24
    assert float((cached - plain).abs().max() / plain.abs().max()) <= 0.03
    again, calls_again, _ = _sample(_attach(nodes, _patcher(engine_model), threshold=0.05), engine_model)
    assert torch.equal(again, cached) and calls_again == calls  # a fresh holder per run


def test_native_gate_refuses_few_step_and_ancestral_runs_with_a_logged_reason(
    comfy, nodes, engine_model, caplog
):
    patched = _attach(nodes, _patcher(engine_model), threshold=0.5)
    plain, _, _ = _sample(_patcher(engine_model), engine_model, steps=4, schedule="flux.1-schnell")
    with caplog.at_level(logging.INFO):
        out, calls, _ = _sample(patched, engine_model, steps=4, schedule="flux.1-schnell")
    assert torch.equal(out, plain) and calls == [1] * 4
    assert any("off: 4-step distilled few-step schedule" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _, calls, _ = _sample(patched, engine_model, sampler=sample_euler_ancestral)
    assert len(calls) == 28
    assert any(
        "sampler 'sample_euler_ancestral' re-noises every step" in r.getMessage() for r in caplog.records
    )


class FakePromptServer:
    """server.PromptServer.instance: what the node's report uses of it (ComfyUI 0.3.64 server.py)."""

    def __init__(self, fail=False):
        self.client_id, self.sent, self.fail = "client-1", [], fail

    def send_progress_text(self, text, node_id, sid=None):
        if self.fail:
            raise RuntimeError("socket closed")
        self.sent.append((text, node_id, sid))


@pytest.fixture
def server(monkeypatch):
    instance = FakePromptServer()
    monkeypatch.setitem(
        sys.modules, "server", types.SimpleNamespace(PromptServer=types.SimpleNamespace(instance=instance))
    )
    return instance


def _per_step(summary: str) -> list[str]:
    line = next(ln for ln in summary.splitlines() if "score per step" in ln)
    return line.split("): ", 1)[1].split()


def test_native_gate_shows_the_run_report_on_its_node_and_logs_the_decision_once(
    comfy, nodes, engine_model, server, caplog
):
    patched = _attach(nodes, _patcher(engine_model), threshold=0.05, unique_id="7")
    with caplog.at_level(logging.INFO):
        _, calls, _ = _sample(patched, engine_model)
    ((text, node_id, sid),) = server.sent
    assert (node_id, sid) == ("7", "client-1")
    messages = [r.getMessage() for r in caplog.records]
    assert text in messages  # the text on the node is the logged summary
    head = "step cache input_change (threshold 0.05): on: 28-step schedule"
    assert text.startswith(head) and sum(m.count(head) for m in messages) == 1
    computed = len(calls)
    assert f"  {computed} steps computed, {28 - computed} skipped of 28; " in text
    # a refused run reports its reason on the node too
    with caplog.at_level(logging.INFO):
        _sample(patched, engine_model, steps=4, schedule="flux.1-schnell")
    refused, node_id, _ = server.sent[1]
    assert node_id == "7" and "\n" not in refused  # the decision only: nothing ran through the cache
    assert refused.startswith(
        "step cache input_change (threshold 0.05): off: 4-step distilled few-step schedule"
    )


def test_native_report_prints_the_score_compared_with_the_threshold(
    comfy, nodes, engine_model, server, pack, monkeypatch
):
    methods = importlib.import_module(f"{pack.__name__}.engine.step_cache.methods")
    decided = []
    original = methods.InputChangeCache.decide

    def recording(self, x, cacheable):
        result = original(self, x, cacheable)
        decided.append(result)
        return result

    monkeypatch.setattr(methods.InputChangeCache, "decide", recording)
    threshold = 0.05
    _sample(_attach(nodes, _patcher(engine_model), threshold=threshold, unique_id="3"), engine_model)
    ((text, _, _),) = server.sent
    printed = _per_step(text)
    assert len(decided) == len(printed) == 28
    for i, (entry, (skip, _change, score)) in enumerate(zip(printed, decided)):
        assert entry == f"{i}:{'-' if score is None else f'{score:.4g}'}{'*' if skip else ''}"
        if skip:
            assert score < threshold
    # what the report printed before: the relative input change, a different number than the one compared
    assert any(s is not None and f"{c:.4g}" != f"{s:.4g}" for _, c, s in decided)
    assert sum(skip for skip, _, _ in decided) > 0


def test_native_report_failing_to_reach_the_node_does_not_fail_the_run(
    comfy, nodes, engine_model, monkeypatch, caplog
):
    broken = FakePromptServer(fail=True)
    monkeypatch.setitem(
        sys.modules, "server", types.SimpleNamespace(PromptServer=types.SimpleNamespace(instance=broken))
    )
    plain, _, _ = _sample(_attach(nodes, _patcher(engine_model), threshold=0.0), engine_model)
    with caplog.at_level(logging.WARNING):
        out, _, _ = _sample(
            _attach(nodes, _patcher(engine_model), threshold=0.0, unique_id="5"), engine_model
        )
    assert torch.equal(out, plain)
    assert [r.getMessage() for r in caplog.records if "could not show" in r.getMessage()] == [
        "FewStepCacheGateNative: could not show the step-cache report on the node (socket closed)"
    ]


def test_native_gate_without_a_node_id_or_server_sends_nothing(
    comfy, nodes, engine_model, server, monkeypatch
):
    _sample(_attach(nodes, _patcher(engine_model), threshold=0.05), engine_model)  # no unique_id: a script
    assert server.sent == []
    monkeypatch.delitem(sys.modules, "server")
    nodes.node_text_sender("4")("text")  # outside a ComfyUI server: nothing to send to, no error


def test_native_cfg_gating_drops_the_unconditional_rows(comfy, nodes, engine_model, caplog):
    with caplog.at_level(logging.INFO):  # with step caching too: the decisions go on after the cut-off
        _, calls, _ = _sample(_attach(nodes, _patcher(engine_model), threshold=0.05, cfg_cutoff=0.5), engine_model,
                              cfg=3.0, negative=True)  # fmt: skip
    (summary,) = [r.getMessage() for r in caplog.records if "score per step" in r.getMessage()]
    assert " 20:-" not in summary and "27:" in summary and sum(c == 1 for c in calls) < 14
    caplog.clear()
    patched = _attach(nodes, _patcher(engine_model), threshold=0.0, cfg_cutoff=0.5)
    with caplog.at_level(logging.INFO):
        out, calls, _ = _sample(patched, engine_model, cfg=3.0, negative=True)
    assert calls == [2] * 14 + [1] * 14
    assert any("unconditional pass skipped on 14 steps" in r.getMessage() for r in caplog.records)
    # written out: v_neg = v_pos + (v_neg - v_pos of step 13) from step 14 on, as in the engine
    p = engine_model.params
    pos, neg = make_cond(p), make_cond(p, seed=9)
    sigmas = schedule_sigmas("flux.1-dev", 28, image_seq_len=64)
    x = sigmas[0] * torch.randn(1, 16, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for i in range(28):
            s = sigmas[i].reshape(1)
            v_pos = flux_velocity(engine_model, x, s, pos)
            if i < 14:
                delta = flux_velocity(engine_model, x, s, neg) - v_pos
            x = x + (sigmas[i + 1] - sigmas[i]) * (v_pos + delta + 3.0 * (v_pos - (v_pos + delta)))
    assert torch.allclose(out, x, atol=1e-4, rtol=1e-4)


def test_native_magcache_calibration_and_identity(comfy, nodes, engine_model, server):
    patched = _attach(
        nodes, _patcher(engine_model), method="magcache", calibration_name="flux.json", calibrate=True,
        unique_id="2",
    )  # fmt: skip
    plain, _, _ = _sample(_patcher(engine_model), engine_model)
    out, calls, _ = _sample(patched, engine_model)
    assert torch.equal(out, plain) and len(calls) == 28
    path = comfy / "models" / "fewstep_magcache" / "flux.json"
    data = json.loads(path.read_text())
    ((report, _, _),) = server.sent  # nothing was compared: the report gives the ratios written
    assert _per_step(report) == [f"{i}:-" for i in range(28)]
    ratios = " ".join(f"{i}:{r:.4g}" for i, r in enumerate(data["ratios"]))
    assert report.endswith(f"  MagCache calibration written to {path}; ratios per step: {ratios}")
    assert (
        data["steps"] == 28
        and len(data["ratios"]) == 28
        and data["model"]["family"] == "comfy:DiffusionModel"
    )
    use = _attach(nodes, _patcher(engine_model), method="magcache", threshold=0.24, magcache_file="flux.json")
    _, calls, _ = _sample(use, engine_model)
    assert len(calls) < 28
    other = _attach(nodes, _patcher(engine_model, {"image_model": "flux", "depth": 19}), method="magcache",
                    magcache_file="flux.json")  # fmt: skip
    with pytest.raises(ValueError, match=r"^FewStepCacheGateNative: input 'model': the MagCache calibration .*"
                       r"was recorded on comfy:DiffusionModel"):  # fmt: skip
        _sample(other, engine_model)


def test_native_node_errors(comfy, nodes, engine_model, monkeypatch):
    patcher = _patcher(engine_model)
    with pytest.raises(
        ValueError,
        # the node's combo check (nodes/inputs.py) answers first; the engine's own message is in test_step_cache
        match=r"^FewStepCacheGateNative: input 'method': expected one of 'input_change', 'magcache'; "
        r"got the text 'first_block'$",
    ):
        _attach(nodes, patcher, method="first_block")
    with pytest.raises(
        ValueError, match=r"^FewStepCacheGateNative: input 'magcache_file': MagCache on a ComfyUI"
    ):
        _attach(nodes, patcher, method="magcache")
    with pytest.raises(ValueError, match=r"^FewStepCacheGateNative: input 'threshold': 1.5 is out of range"):
        _attach(nodes, patcher, threshold=1.5)
    monkeypatch.delitem(sys.modules, "comfy.patcher_extension")
    with pytest.raises(
        ValueError, match=r"^FewStepCacheGateNative: input 'model': needs a ComfyUI ModelPatcher"
    ):
        _attach(nodes, patcher)


# -- FewStepCacheGate on a FEWSTEP_MODEL, through FewStepSampler ---------------------------------------------------
def _gate_node(pack, model, **inputs):
    args = dict(method="first_block", threshold=0.08, start=0.1, end=1.0, force=False, cfg_cutoff=1.0)
    args.update(inputs)
    return (
        importlib.import_module(f"{pack.__name__}.nodes.step_cache")
        .FewStepCacheGate()
        .attach(model, **args)[0]
    )


def _sampler_run(pack, model, cond, **inputs):
    sampler = pack.NODE_CLASS_MAPPINGS["FewStepSampler"]()
    args = dict(seed=0, steps=4, schedule="flux.1-schnell", sampler="euler", cfg=1.0, denoise=1.0)
    args.update(inputs)
    return sampler.sample(model, cond, {"samples": torch.zeros(1, 16, 8, 8)}, **args)


def test_fewstep_gate_node_attaches_a_feature_and_the_sampler_reports(pack):
    m = pack.NODE_CLASS_MAPPINGS
    (model,) = m["FewStepDiTLoader"]().load("dummy:flux-tiny")
    (cond,) = m["FewStepSyntheticConditioning"]().make(16, 4096, 768, 3.5, 0)
    gated = _gate_node(pack, model)
    assert gated.model is model.model and model.feature("step_cache") is None
    assert gated.feature("step_cache").method == "first_block"
    plain, _ = _sampler_run(pack, model, cond)
    out, report = _sampler_run(pack, gated, cond)
    assert torch.equal(out["samples"], plain["samples"])
    assert "step cache first_block (threshold 0.08): off: 4-step distilled few-step schedule" in report
    _, report = _sampler_run(
        pack, _gate_node(pack, model, threshold=0.9), cond, steps=28, schedule="flux.1-dev"
    )
    assert "step cache first_block (threshold 0.9): on: 28-step schedule" in report
    assert (
        "steps computed" in report
        and "score per step vs threshold 0.9 (* skipped, - not compared): 0:- 1:" in report
    )


def test_fewstep_gate_node_errors(pack):
    (model,) = pack.NODE_CLASS_MAPPINGS["FewStepDiTLoader"]().load("dummy:flux-tiny")
    with pytest.raises(
        ValueError, match=r"^FewStepCacheGate: input 'method': TeaCache needs a rescaling polynomial"
    ):
        _gate_node(pack, model, method="teacache", threshold=0.4)
    with pytest.raises(
        ValueError, match=r"^FewStepCacheGate: input 'threshold': 1.2 is out of range for first_block"
    ):
        _gate_node(pack, model, threshold=1.2)
    with pytest.raises(
        ValueError, match=r"^FewStepCacheGate: input 'magcache_file': MagCache needs per-step ratios"
    ):
        _gate_node(pack, model, method="magcache", threshold=0.24)


def test_install_native_gate_is_the_engines_without_comfyui(engine_model):
    """The engine installs the gate from the patcher and the wrapper types alone (no comfy module imported)."""
    from fewstep.engine.errors import InputError
    from fewstep.engine.step_cache import install_native_gate, make_gate

    wrapper_types = types.SimpleNamespace(OUTER_SAMPLE=OUTER, CALC_COND_BATCH=CALC, DIFFUSION_MODEL=DIFFUSION)
    patcher = _patcher(engine_model)
    gate = make_gate("input_change", threshold=0.1, level="model")
    patched = install_native_gate(patcher, gate, wrapper_types)
    assert patcher.wrappers == {} and set(patched.wrappers) == {OUTER, CALC, DIFFUSION}
    assert patched.model_options["transformer_options"]["fewstep_cache_gate"] is gate
    with pytest.raises(InputError, match=r"^input 'model': needs a ComfyUI ModelPatcher with wrappers"):
        install_native_gate(patcher, gate, None)
    with pytest.raises(InputError, match=r"^input 'magcache_file': MagCache on a ComfyUI model needs ratios"):
        install_native_gate(patcher, make_gate("magcache", threshold=0.24, level="model"), wrapper_types)
