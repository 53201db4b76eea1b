"""The step-cache gate on a ComfyUI ModelPatcher: its preconditions, and the wrappers that run it.

ComfyUI-free: :func:`install_native_gate` takes the patcher and ComfyUI's wrapper types (``WrappersMP``, which
the node passes in) and uses only the patcher's generic wrapper API (``clone``, ``model_options``,
``add_wrapper_with_key``). The wrappers are called by ComfyUI as ``wrapper(executor, *args)``; ``executor(*args)``
runs the next one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from ..errors import InputError
from .calibration import config_hash
from .gate import CacheGate

GATE_KEY = "fewstep_cache_gate"  # model_options["transformer_options"][GATE_KEY]: the CacheGate
RUN_KEY = "fewstep_cache_run"  # the per-run holder, only inside one sampling run's cloned options
REPORT_KEY = (
    "fewstep_cache_report"  # model_options["transformer_options"][REPORT_KEY]: where a run's summary goes
)

log = logging.getLogger(__name__)


def check_native_gate(gate: CacheGate) -> None:
    """MagCache's precondition on a ComfyUI model: no ratios are published for one, so it needs its own."""
    if gate.method == "magcache" and gate.calibration is None and gate.calibrate_to is None:
        raise InputError(
            "magcache_file",
            "MagCache on a ComfyUI model needs ratios calibrated on it: run once with calibrate on "
            "(they are written to calibration_name), then choose that file here",
        )


def install_native_gate(patcher, gate: CacheGate, wrapper_types, report: Callable[[str], None] | None = None):
    """A clone of ``patcher`` that runs ``gate``; ``patcher`` itself is not changed. ``wrapper_types``: ComfyUI's
    ``comfy.patcher_extension.WrappersMP`` (None where that module is missing: refused). ``report``, if given, is
    called with each sampling run's summary (the decision, steps computed / skipped, the score per step) when the
    run ends: the node shows it to the user, the log has it already."""
    check_native_gate(gate)
    if wrapper_types is None or not hasattr(patcher, "add_wrapper_with_key"):
        raise InputError(
            "model", "needs a ComfyUI ModelPatcher with wrappers (comfy.patcher_extension; a recent ComfyUI)"
        )
    patched = patcher.clone()
    options = patched.model_options.setdefault("transformer_options", {})
    options[GATE_KEY] = gate
    if report is not None:
        options[REPORT_KEY] = report
    patched.add_wrapper_with_key(wrapper_types.OUTER_SAMPLE, GATE_KEY, outer_sample_wrapper)
    patched.add_wrapper_with_key(wrapper_types.CALC_COND_BATCH, GATE_KEY, calc_cond_batch_wrapper)
    patched.add_wrapper_with_key(wrapper_types.DIFFUSION_MODEL, GATE_KEY, diffusion_model_wrapper)
    return patched


def native_identity(model_patcher) -> dict:
    """What a native MagCache calibration is tied to: the diffusion model's class and its configuration."""
    base = getattr(model_patcher, "model", None)
    diffusion_model = getattr(base, "diffusion_model", base)
    model_config = getattr(base, "model_config", None)
    config = getattr(model_config, "unet_config", None)
    return {
        "family": f"comfy:{type(diffusion_model).__name__}",
        "preset": type(model_config).__name__ if model_config is not None else "custom",
        "config": config_hash(config if isinstance(config, dict) else repr(diffusion_model)),
    }


def _sampler_name(sampler) -> str:
    function = getattr(sampler, "sampler_function", None)
    return getattr(function, "__name__", None) or type(sampler).__name__


def outer_sample_wrapper(executor, *args, **kwargs):
    """``CFGGuider.outer_sample(noise, latent_image, sampler, sigmas, ...)``: one holder per sampling run."""
    guider = executor.class_obj
    original = guider.model_options
    transformer_options = dict(original.get("transformer_options", {}))
    gate = transformer_options.get(GATE_KEY)
    if gate is None:
        return executor(*args, **kwargs)
    # ComfyUI puts the schedule into transformer_options["sample_sigmas"] only inside inner_sample, after this
    # wrapper; here it is the call's own ``sigmas`` argument.
    sigmas = transformer_options.get("sample_sigmas")
    if sigmas is None:
        sigmas = args[3] if len(args) > 3 else kwargs["sigmas"]
    sampler = args[2] if len(args) > 2 else kwargs.get("sampler")
    uses_cfg = not math.isclose(float(getattr(guider, "cfg", 1.0)), 1.0)
    try:
        run = gate.start_native_run(
            sigmas, _sampler_name(sampler), native_identity(guider.model_patcher), uses_cfg
        )
    except InputError as err:
        raise err.located("FewStepCacheGateNative") from None
    transformer_options[RUN_KEY] = run
    guider.model_options = {**original, "transformer_options": transformer_options}
    try:
        return executor(*args, **kwargs)
    finally:
        guider.model_options = original
        telemetry = run.finish()
        _report(transformer_options.get(REPORT_KEY), telemetry.summary())


def _report(report: Callable[[str], None] | None, summary: str) -> None:
    if report is None:
        return
    try:
        report(summary)
    except Exception as exc:  # noqa: BLE001 - showing the summary on the node must never fail the finished run
        log.warning("FewStepCacheGateNative: could not show the step-cache report on the node (%s)", exc)


def calc_cond_batch_wrapper(executor, model, conds, x_in, timestep, model_options, **kwargs):
    run = model_options.get("transformer_options", {}).get(RUN_KEY)
    if run is None or not run.active:
        return executor(model, conds, x_in, timestep, model_options, **kwargs)
    run.begin_step(timestep)
    has_uncond = len(conds) > 1 and conds[1] is not None
    # ComfyUI returns x0 = x - sigma * output for flow (CONST) and eps models alike, so the x0 difference per
    # unit sigma is the model-output difference (velocity or eps), the quantity that stays put across steps.
    sigma = timestep.reshape(-1, *([1] * (x_in.ndim - 1)))
    if has_uncond and run.skip_uncond():
        out = executor(model, [conds[0], None, *conds[2:]], x_in, timestep, model_options, **kwargs)
        out[1] = out[0] + sigma * run.cfg_delta
        run.note_uncond_skipped(x_in.shape[0])
        return out
    out = executor(model, conds, x_in, timestep, model_options, **kwargs)
    if has_uncond:
        run.store_cfg_delta((out[1] - out[0]) / sigma)
    return out


def _transformer_options(args, kwargs) -> dict:
    options = kwargs.get("transformer_options")
    if isinstance(options, dict):
        return options
    return next((a for a in reversed(args) if isinstance(a, dict)), {})


def diffusion_model_wrapper(executor, *args, **kwargs):
    options = _transformer_options(args, kwargs)
    run = options.get(RUN_KEY)
    if run is None or not run.active:
        return executor(*args, **kwargs)
    x = args[0]
    cond_or_uncond = options.get("cond_or_uncond") or [0]
    keys = options.get("uuids") or cond_or_uncond
    positive = [c == 0 for c in cond_or_uncond] if len(cond_or_uncond) == len(keys) else None
    return run.model_call(x, keys, lambda: executor(*args, **kwargs), positive)
