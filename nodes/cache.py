"""Step-cache gate nodes: FewStepCacheGate for the engine's FEWSTEP_MODEL, FewStepCacheGateNative for ComfyUI's
own MODEL.

Both attach a :class:`~..engine.cache.CacheGate` (an immutable description) and never change the model: the
FEWSTEP_MODEL handle gets it as its ``step_cache`` feature (a new handle; the model object is shared), the
native MODEL is cloned and gets three ModelPatcher wrappers, as ComfyUI core's EasyCache does:

* OUTER_SAMPLE: per sampling run, applies the gate's policy to the run's sigmas and sampler and puts a fresh
  per-run holder into the run's (cloned) model options; at the end it logs the telemetry and drops the holder.
* CALC_COND_BATCH: marks the step; with CFG gating, from the cut-off on runs only the conditional pass and
  gives the unconditional one as ``x0_cond + sigma * d`` with ``d = (x0_uncond - x0_cond) / sigma`` of the last
  step that ran it (per unit sigma this is the model-output difference: velocity for flow, eps for eps models).
* DIFFUSION_MODEL: decides per step and either calls the model or returns its last output.

No forward function is copied or replaced and nothing global is patched.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from ..engine.cache import METHODS, NATIVE_METHODS, STEP_CACHE_FEATURE, make_gate
from ..engine.cache.calibration import (
    SUFFIX,
    calibration_file_name,
    config_hash,
    default_calibration_dir,
    list_calibration_files,
)
from ..engine.errors import InputError
from .base import CATEGORY, FEWSTEP_MODEL, reports_input_errors
from .host import comfy_module, list_model_files, register_model_folder

log = logging.getLogger(__name__)

GATE_KEY = "fewstep_cache_gate"  # model_options["transformer_options"][GATE_KEY]: the CacheGate
RUN_KEY = "fewstep_cache_run"  # the per-run holder, only inside one sampling run's cloned options
MAGCACHE_FOLDER = "fewstep_magcache"  # ComfyUI's models/fewstep_magcache: the one folder calibrations live in
NO_CALIBRATION = "none"


def _common_inputs(methods: tuple[str, ...], default_method: str, default_threshold: float) -> dict:
    return {
        "method": (
            list(methods),
            {
                "default": default_method,
                "tooltip": "first_block: First-Block-Cache (no per-model fit). teacache: TeaCache (published "
                "polynomials for FLUX.1 and Wan 2.1 1.3B/14B only; none for FLUX.2 or Z-Image). magcache: MagCache "
                "(needs calibrated ratios: flux.1-dev at 28 steps ships them; else calibrate once, e.g. for "
                "FLUX.2 / Z-Image). input_change: the whole model's predicted output change (ComfyUI models). "
                "Few-step schedules (FLUX.2 klein 4, Z-Image-Turbo 8-9 steps) are refused with the reason.",
            },
        ),
        "threshold": (
            "FLOAT",
            {
                "default": default_threshold,
                "min": 0.0,
                "max": 2.0,
                "step": 0.01,
                "tooltip": "Skip while the measured change stays below this. 0 never skips (exactly the uncached "
                "run). Usual: first_block 0.08, teacache 0.4 (FLUX) / 0.05-0.08 (Wan 1.3B), magcache 0.24, "
                "input_change 0.1.",
            },
        ),
        "start": (
            "FLOAT",
            {
                "default": 0.1,
                "min": 0.0,
                "max": 1.0,
                "step": 0.01,
                "tooltip": "Steps before this fraction of the schedule are always computed.",
            },
        ),
        "end": (
            "FLOAT",
            {
                "default": 1.0,
                "min": 0.0,
                "max": 1.0,
                "step": 0.01,
                "tooltip": "Steps from this fraction on are always computed (the last step always is).",
            },
        ),
        "force": (
            "BOOLEAN",
            {
                "default": False,
                "tooltip": "Cache even where the gate refuses (few-step or re-noising schedules); logged "
                "as a warning. The result is usually worse.",
            },
        ),
        "cfg_cutoff": (
            "FLOAT",
            {
                "default": 1.0,
                "min": 0.0,
                "max": 1.0,
                "step": 0.01,
                "tooltip": "CFG gating: from this fraction of the steps on, skip the unconditional pass and "
                "reuse its last difference to the conditional one. 1 = off. Only with cfg != 1.",
            },
        ),
    }


def _optional_inputs() -> dict:
    return {
        "magcache_file": (
            [NO_CALIBRATION, *calibration_files()],
            {
                "default": NO_CALIBRATION,
                "tooltip": "MagCache calibration to use: the files in models/fewstep_magcache (written by a "
                "calibration run). none: the published ratios where there are some (FLUX.1-dev, 28 steps).",
            },
        ),
        "calibrate": (
            "BOOLEAN",
            {
                "default": False,
                "tooltip": "MagCache calibration run: compute every step and write the per-step ratios of this "
                "model and step count to calibration_name in models/fewstep_magcache.",
            },
        ),
        "calibration_name": (
            "STRING",
            {
                "default": "",
                "tooltip": "With calibrate on: the file name to write (e.g. flux-dev-28.json; a name, not a "
                "path), in models/fewstep_magcache. Afterwards choose it in magcache_file.",
            },
        ),
    }


def calibration_folder() -> tuple[Path, str]:
    """The folder calibrations are written to and how errors name it: ComfyUI's models/fewstep_magcache
    (registered with folder_paths) or, outside ComfyUI, the engine's default folder."""
    paths = register_model_folder(MAGCACHE_FOLDER, {SUFFIX})
    if paths:
        return Path(paths[0]), f"ComfyUI's models/{MAGCACHE_FOLDER} folder"
    folder = default_calibration_dir()
    return folder, str(folder)


def calibration_files() -> list[str]:
    """The calibrations a gate can read: what the combo offers."""
    folder, _ = calibration_folder()  # registers the folder inside ComfyUI before it is listed
    if comfy_module("folder_paths") is not None:
        return list_model_files(MAGCACHE_FOLDER)
    return list_calibration_files(folder)


def calibration_to_read(choice: str) -> str:
    """The full path of the calibration chosen in ``magcache_file`` ("" for none); only files offered are read."""
    if choice in ("", NO_CALIBRATION):  # "" is what magcache_file held before it became a list
        return ""
    folder, described = calibration_folder()
    files = calibration_files()
    if choice in files:
        fp = comfy_module("folder_paths")
        path = fp.get_full_path(MAGCACHE_FOLDER, choice) if fp is not None else str(folder / choice)
        if path is not None:
            return path
    raise InputError(
        "magcache_file",
        f"{choice!r} is not a calibration in {described}; choose one of {[NO_CALIBRATION, *files]}",
    )


def calibration_to_write(name: str) -> str:
    """The full path a calibration run writes to: ``name`` (a plain file name) in the calibration folder."""
    folder, described = calibration_folder()
    if not name:
        raise InputError(
            "calibration_name",
            f"calibrate is on: give the file name to write the ratios to (e.g. flux-dev-28.json, in {described})",
        )
    return str(folder / calibration_file_name(name, "calibration_name"))


def _gate_from_inputs(
    method, threshold, start, end, force, cfg_cutoff, magcache_file, calibrate, calibration_name, level
):
    path = calibration_to_write(calibration_name) if calibrate else calibration_to_read(magcache_file)
    return make_gate(
        method=method, threshold=threshold, start=start, end=end, force=force, cfg_cutoff=cfg_cutoff,
        magcache_file=path, calibrate=calibrate, level=level,
    )  # fmt: skip


class FewStepCacheGate:
    DESCRIPTION = (
        "Attaches a step cache (First-Block-Cache, TeaCache or MagCache, plus CFG gating) to a FEWSTEP_MODEL. Before "
        "each run it reads the schedule and the sampler and refuses, saying why, where caching cannot pay "
        "(distilled 1-9 step schedules, re-noising samplers). FewStepSampler's report lists what it did."
    )
    CATEGORY = f"{CATEGORY}/speed"
    RETURN_TYPES = (FEWSTEP_MODEL,)
    RETURN_NAMES = ("model",)
    FUNCTION = "attach"

    @classmethod
    def INPUT_TYPES(cls):
        required = {"model": (FEWSTEP_MODEL, {"tooltip": "A model from FewStepDiTLoader (FLUX or Wan)."})}
        required.update(_common_inputs(METHODS, "first_block", 0.08))
        return {"required": required, "optional": _optional_inputs()}

    @reports_input_errors("FewStepCacheGate")
    def attach(
        self, model, method, threshold, start, end, force, cfg_cutoff, magcache_file=NO_CALIBRATION,
        calibrate=False, calibration_name="",
    ):  # fmt: skip
        gate = _gate_from_inputs(
            method, threshold, start, end, force, cfg_cutoff, magcache_file, calibrate, calibration_name, "blocks"
        )  # fmt: skip
        gate.check_model(model.model)
        return (model.with_feature(STEP_CACHE_FEATURE, gate),)


class FewStepCacheGateNative:
    DESCRIPTION = (
        "The FewStep step-cache gate for ComfyUI's own MODEL (KSampler, SamplerCustomAdvanced), through "
        "ModelPatcher wrappers on a clone: whole-model step caching (input_change, magcache) and CFG gating, "
        "refused with a logged reason on few-step or re-noising schedules. Telemetry goes to the log."
    )
    CATEGORY = f"{CATEGORY}/speed"
    RETURN_TYPES = ("MODEL",)
    RETURN_NAMES = ("model",)
    FUNCTION = "attach"

    @classmethod
    def INPUT_TYPES(cls):
        required = {"model": ("MODEL", {"tooltip": "A ComfyUI model (e.g. from Load Diffusion Model)."})}
        required.update(_common_inputs(NATIVE_METHODS, "input_change", 0.1))
        return {"required": required, "optional": _optional_inputs()}

    @reports_input_errors("FewStepCacheGateNative")
    def attach(
        self, model, method, threshold, start, end, force, cfg_cutoff, magcache_file=NO_CALIBRATION,
        calibrate=False, calibration_name="",
    ):  # fmt: skip
        gate = _gate_from_inputs(
            method, threshold, start, end, force, cfg_cutoff, magcache_file, calibrate, calibration_name, "model"
        )  # fmt: skip
        if method == "magcache" and gate.calibration is None and gate.calibrate_to is None:
            raise InputError(
                "magcache_file",
                "MagCache on a ComfyUI model needs ratios calibrated on it: run once with calibrate on "
                "(they are written to calibration_name), then choose that file here",
            )
        ext = comfy_module("comfy.patcher_extension")
        if ext is None or not hasattr(model, "add_wrapper_with_key"):
            raise InputError(
                "model",
                "needs a ComfyUI ModelPatcher with wrappers (comfy.patcher_extension; a recent ComfyUI)",
            )
        patched = model.clone()
        patched.model_options.setdefault("transformer_options", {})[GATE_KEY] = gate
        patched.add_wrapper_with_key(ext.WrappersMP.OUTER_SAMPLE, GATE_KEY, outer_sample_wrapper)
        patched.add_wrapper_with_key(ext.WrappersMP.CALC_COND_BATCH, GATE_KEY, calc_cond_batch_wrapper)
        patched.add_wrapper_with_key(ext.WrappersMP.DIFFUSION_MODEL, GATE_KEY, diffusion_model_wrapper)
        return (patched,)


# -- the wrappers (ComfyUI calls them as wrapper(executor, *args); executor(*args) runs the next one) -----------
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
        run.finish()


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


__all__ = [
    "FewStepCacheGate",
    "FewStepCacheGateNative",
    "calc_cond_batch_wrapper",
    "diffusion_model_wrapper",
    "native_identity",
    "outer_sample_wrapper",
]
