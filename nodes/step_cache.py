"""Step-cache gate nodes: FewStepCacheGate for the engine's FEWSTEP_MODEL, FewStepCacheGateNative for ComfyUI's
own MODEL.

Both attach a :class:`~..engine.step_cache.CacheGate` (an immutable description) and never change the model: the
FEWSTEP_MODEL handle gets it as its ``step_cache`` feature (a new handle; the model object is shared), the
native MODEL is cloned and gets three ModelPatcher wrappers, as ComfyUI core's EasyCache does:

* OUTER_SAMPLE: per sampling run, applies the gate's policy to the run's sigmas and sampler and puts a fresh
  per-run holder into the run's (cloned) model options; at the end it logs the telemetry once, shows it as text
  on the gate node (the node runs before the sampler, so the run's result can only reach the user this way, not
  as an output) and drops the holder.
* CALC_COND_BATCH: marks the step; with CFG gating, from the cut-off on runs only the conditional pass and
  gives the unconditional one as ``x0_cond + sigma * d`` with ``d = (x0_uncond - x0_cond) / sigma`` of the last
  step that ran it (per unit sigma this is the model-output difference: velocity for flow, eps for eps models).
* DIFFUSION_MODEL: decides per step and either calls the model or returns its last output.

No forward function is copied or replaced and nothing global is patched. The preconditions, the clone and the
wrappers are the engine's (:mod:`..engine.step_cache.native`); this module parses the inputs.
"""

from __future__ import annotations

from pathlib import Path

from ..engine.errors import InputError
from ..engine.names import check_name, name_problem
from ..engine.step_cache import METHODS, NATIVE_METHODS, STEP_CACHE_FEATURE, make_gate
from ..engine.step_cache.calibration import (
    SUFFIX,
    calibration_file_name,
    default_calibration_dir,
    list_calibration_files,
)
from ..engine.step_cache.native import (
    GATE_KEY,
    RUN_KEY,
    calc_cond_batch_wrapper,
    diffusion_model_wrapper,
    install_native_gate,
    native_identity,
    outer_sample_wrapper,
)
from .base import (
    ALL_FAMILIES,
    CATEGORY,
    ReturnsModel,
    model_input,
    reports_input_errors,
    schedule_fraction_input,
)
from .host import comfy_module, list_model_files, register_model_folder

MAGCACHE_FOLDER = "fewstep_magcache"  # ComfyUI's models/fewstep_magcache: the one folder calibrations live in
NO_CALIBRATION = "none"


# Tooltip text per method, so each node describes only the methods it offers.
METHOD_TOOLTIPS = {
    "first_block": "first_block: First-Block-Cache (no per-model fit).",
    "teacache": "teacache: TeaCache (published polynomials for FLUX.1 and Wan 2.1 1.3B/14B only; none for FLUX.2 "
    "or Z-Image).",
    "magcache": "magcache: MagCache (needs calibrated ratios: flux.1-dev at 28 steps ships them; else calibrate "
    "once, e.g. for FLUX.2 / Z-Image).",
    "input_change": "input_change: the whole model's predicted output change (ComfyUI models).",
}
THRESHOLD_HINTS = {
    "first_block": "first_block 0.08",
    "teacache": "teacache 0.4 (FLUX) / 0.05-0.08 (Wan 1.3B)",
    "magcache": "magcache 0.24",
    "input_change": "input_change 0.1",
}


def _common_inputs(methods: tuple[str, ...], default_method: str, default_threshold: float) -> dict:
    return {
        "method": (
            list(methods),
            {
                "default": default_method,
                "tooltip": " ".join(METHOD_TOOLTIPS[m] for m in methods)
                + " Few-step schedules (FLUX.2 klein 4, Z-Image-Turbo 8-9 steps) are refused with the reason.",
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
                "run). Usual: " + ", ".join(THRESHOLD_HINTS[m] for m in methods) + ".",
            },
        ),
        "start": schedule_fraction_input(
            0.1, "Steps before this fraction of the schedule are always computed."
        ),
        "end": schedule_fraction_input(
            1.0, "Steps from this fraction on are always computed (the last step always is)."
        ),
        "force": (
            "BOOLEAN",
            {
                "default": False,
                "tooltip": "Cache even where the gate refuses (few-step or re-noising schedules); logged "
                "as a warning. The result is usually worse.",
            },
        ),
        "cfg_cutoff": schedule_fraction_input(
            1.0,
            "CFG gating: from this fraction of the steps on, skip the unconditional pass and reuse its last "
            "difference to the conditional one. 1 = off. Only with cfg != 1.",
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
        # a file someone put there under a bidi or zero-width name is not offered to everyone who opens the node
        return [name for name in list_model_files(MAGCACHE_FOLDER) if name_problem(name) is None]
    return list_calibration_files(folder)


def calibration_to_read(choice: str) -> str:
    """The full path of the calibration chosen in ``magcache_file`` ("" for none); only files offered are read."""
    if choice in ("", NO_CALIBRATION):  # "" is what magcache_file held before it became a list
        return ""
    check_name(choice, "magcache_file")  # before the list, so the refusal names the character
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


class FewStepCacheGate(ReturnsModel):
    DESCRIPTION = (
        "Attaches a step cache (First-Block-Cache, TeaCache or MagCache, plus CFG gating) to a FEWSTEP_MODEL. Before "
        "each run it reads the schedule and the sampler and refuses, saying why, where caching cannot pay "
        "(distilled 1-9 step schedules, re-noising samplers). FewStepSampler's report lists what it did."
    )
    CATEGORY = f"{CATEGORY}/speed"
    FUNCTION = "attach"

    @classmethod
    def INPUT_TYPES(cls):
        required = {"model": model_input(ALL_FAMILIES)}
        required.update(_common_inputs(METHODS, "first_block", 0.08))
        return {"required": required, "optional": _optional_inputs()}

    @reports_input_errors("FewStepCacheGate", file_lists=("magcache_file",))
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
        "refused with the reason on few-step or re-noising schedules. After each sampling run the node shows "
        "the decision, the steps computed / skipped and the score per step that was compared with the "
        "threshold (also in the log)."
    )
    CATEGORY = f"{CATEGORY}/speed"
    RETURN_TYPES = ("MODEL",)
    RETURN_NAMES = ("model",)
    FUNCTION = "attach"

    @classmethod
    def INPUT_TYPES(cls):
        required = {"model": ("MODEL", {"tooltip": "A ComfyUI model (e.g. from Load Diffusion Model)."})}
        required.update(_common_inputs(NATIVE_METHODS, "input_change", 0.1))
        return {"required": required, "optional": _optional_inputs(), "hidden": {"unique_id": "UNIQUE_ID"}}

    @reports_input_errors("FewStepCacheGateNative", file_lists=("magcache_file",))
    def attach(
        self, model, method, threshold, start, end, force, cfg_cutoff, magcache_file=NO_CALIBRATION,
        calibrate=False, calibration_name="", unique_id=None,
    ):  # fmt: skip
        gate = _gate_from_inputs(
            method, threshold, start, end, force, cfg_cutoff, magcache_file, calibrate, calibration_name, "model"
        )  # fmt: skip
        ext = comfy_module("comfy.patcher_extension")
        report = None if unique_id is None else node_text_sender(str(unique_id))
        return (install_native_gate(model, gate, None if ext is None else ext.WrappersMP, report),)


def node_text_sender(node_id: str):
    """A function that shows a text on node ``node_id`` in the ComfyUI frontend (the server's progress text, the
    text core nodes show under themselves), sent to the client that queued the prompt; outside a ComfyUI server
    (no ``server`` module) it does nothing."""

    def send(text: str) -> None:
        server_module = comfy_module("server")
        server = getattr(getattr(server_module, "PromptServer", None), "instance", None)
        if server is None:
            return
        server.send_progress_text(text, node_id, getattr(server, "client_id", None))

    return send


__all__ = [
    "GATE_KEY",
    "RUN_KEY",
    "FewStepCacheGate",
    "FewStepCacheGateNative",
    "calc_cond_batch_wrapper",
    "node_text_sender",
    "diffusion_model_wrapper",
    "native_identity",
    "outer_sample_wrapper",
]
