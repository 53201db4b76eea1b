"""``CacheGate``: the user's step-cache choice, attached to a model handle as the ``step_cache`` feature.

The gate is an immutable description (method, threshold, window, force, CFG gating, MagCache calibration); it
holds no run state. Each sampling run asks it for a per-run holder (:meth:`CacheGate.start_run`), which first
applies the policy (:mod:`.policy`) to the run's schedule and sampler: a refused run is exactly the uncached run,
with the reason in its report.

Methods and their default thresholds (what the references ship for FLUX.1-dev at 28 steps):

==============  =========  =============================================================================
method          default    threshold on
==============  =========  =============================================================================
first_block     0.08       relative L1 change of block 0's residual (ParaAttention's FLUX default)
teacache        0.4        accumulated rescaled change of the probe (TeaCache4FLUX: 0.25 / 0.4 / 0.6 / 0.8
                           for 1.5x / 1.8x / 2.0x / 2.25x); Wan 1.3B uses 0.05-0.08
magcache        0.24       accumulated magnitude-ratio error, at most 5 skips in a row (MagCache4FLUX)
input_change    0.1        predicted relative output change, whole-model level (ComfyUI's own models)
==============  =========  =============================================================================
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import InputError
from ..names import check_name
from .calibration import (
    PUBLISHED_RATIOS,
    MagCacheCalibration,
    describe_identity,
    load_calibration,
    model_identity,
    published_calibration,
)
from .coefficients import teacache_coefficients_for
from .methods import FirstBlockCache, InputChangeCache, MagCache, TeaCache
from .policy import GateDecision, decide
from .run import BlockCacheRun, WholeModelRun
from .telemetry import CacheTelemetry

STEP_CACHE_FEATURE = "step_cache"

METHODS = ("first_block", "teacache", "magcache")  # over the engine models' block stack
NATIVE_METHODS = ("input_change", "magcache")  # over whole diffusion-model calls (ComfyUI's MODEL)
DEFAULT_THRESHOLDS = {"first_block": 0.08, "teacache": 0.4, "magcache": 0.24, "input_change": 0.1}
MAX_THRESHOLDS = {"first_block": 1.0, "teacache": 2.0, "magcache": 2.0, "input_change": 1.0}
DEFAULT_MAX_CONSECUTIVE = {"magcache": 5}
METHOD_NAMES = {
    "first_block": "First-Block-Cache",
    "teacache": "TeaCache",
    "magcache": "MagCache",
    "input_change": "input change (whole model)",
}


@dataclass(frozen=True)
class CacheGate:
    method: str = "first_block"
    threshold: float | None = None  # None: the method's default
    start: float = 0.1  # steps with i / steps < start are always computed
    end: float = 1.0  # steps with i / steps >= end are always computed (the last step always is)
    force: bool = False  # run the cache even where the policy refuses it (logged as a warning)
    cfg_cutoff: float = 1.0  # skip the unconditional pass from this fraction of the steps on (1: never)
    calibration: MagCacheCalibration | None = None  # MagCache ratios (None: the published ones, if any)
    calibrate_to: str | None = None  # MagCache calibration mode: compute every step, write the ratios here
    max_consecutive: int | None = (
        None  # at most this many skipped steps in a row (None: the method's default)
    )
    teacache_coefficients: str | tuple[float, ...] | None = None  # a published set by name, or a polynomial
    level: str = "blocks"  # "blocks": the engine's models; "model": whole-model calls (ComfyUI's own models)

    def __post_init__(self):
        known = METHODS if self.level == "blocks" else NATIVE_METHODS
        if self.method not in known:
            listed = ", ".join(f"{m} ({METHOD_NAMES[m]})" for m in known)
            hint = ""
            if self.level == "model" and self.method in METHODS:
                hint = (
                    f"; {self.method} needs the model split into stages, which ComfyUI's MODEL only allows by "
                    "replacing its forward: use it with FewStepCacheGate on a FEWSTEP_MODEL"
                )
            raise InputError("method", f"unknown step-cache method {self.method!r}; known: {listed}{hint}")
        if self.threshold is None:
            object.__setattr__(self, "threshold", DEFAULT_THRESHOLDS[self.method])
        t, top = self.threshold, MAX_THRESHOLDS[self.method]
        if not isinstance(t, (int, float)) or not math.isfinite(t) or not 0.0 <= t <= top:
            raise InputError(
                "threshold",
                f"{t} is out of range for {self.method}: expected 0 <= threshold <= {top} (0 never skips; "
                f"{DEFAULT_THRESHOLDS[self.method]} is the usual value)",
            )
        if not 0.0 <= self.start < 1.0:
            raise InputError("start", f"{self.start} is not a fraction of the steps in [0, 1)")
        if not self.start < self.end <= 1.0:
            raise InputError("end", f"{self.end}: expected start ({self.start}) < end <= 1")
        if not 0.0 <= self.cfg_cutoff <= 1.0:
            raise InputError("cfg_cutoff", f"{self.cfg_cutoff} is not a fraction of the steps in [0, 1]")
        if self.calibrate_to is not None and self.method != "magcache":
            raise InputError("calibrate", f"calibration records MagCache ratios; method is {self.method}")
        if self.calibrate_to is not None:  # written after the whole run: refuse a name that cannot be, now
            check_name(str(self.calibrate_to), "calibrate_to")
        if self.max_consecutive is not None and self.max_consecutive < 1:
            raise InputError("max_consecutive", f"{self.max_consecutive}: expected at least 1 (or None)")

    @property
    def consecutive_limit(self) -> int | None:
        if self.max_consecutive is not None:
            return self.max_consecutive
        return DEFAULT_MAX_CONSECUTIVE.get(self.method)

    def describe(self) -> str:
        cfg = "off" if self.cfg_cutoff >= 1.0 else f"from {self.cfg_cutoff:g} of the steps"
        mode = f", calibrating to {self.calibrate_to}" if self.calibrate_to else ""
        return (
            f"{METHOD_NAMES[self.method]} threshold {self.threshold:g}, window [{self.start:g}, {self.end:g}), "
            f"CFG gating {cfg}{', force' if self.force else ''}{mode}"
        )

    # -- model checks (at attach time: FewStepCacheGate knows the model, not the schedule) ----------------------
    def check_model(self, model) -> None:
        """Raise :class:`InputError` when this gate cannot run on ``model`` at all."""
        if self.method == "teacache":
            teacache_coefficients_for(model, self.teacache_coefficients, input_name="method")
        if self.method == "magcache" and self.calibrate_to is None:
            identity = model_identity(model)
            if self.calibration is not None:
                self.calibration.check(identity, model_input="magcache_file")
            elif not any(preset == identity["preset"] for preset, _ in PUBLISHED_RATIOS):
                raise InputError(
                    "magcache_file",
                    f"MagCache needs per-step ratios for this model ({describe_identity(identity)}) and none are "
                    "published for it: run a calibration once (calibrate on) and use the file it writes; or use "
                    "method 'first_block'",
                )

    # -- runs ------------------------------------------------------------------------------------------------------
    def decide(
        self, sigmas, sampler: str, uses_cfg: bool = False, context: str | None = None
    ) -> GateDecision:
        return decide(
            sigmas, sampler, self.start, self.end, self.force, self.cfg_cutoff if uses_cfg else 1.0, context
        )

    def _holder(self, steps: int, model=None, identity: dict | None = None):
        limit = self.consecutive_limit
        if self.method == "first_block":
            return FirstBlockCache(self.threshold, limit)
        if self.method == "input_change":
            return InputChangeCache(self.threshold, limit)
        if self.method == "teacache":
            coefficients = teacache_coefficients_for(model, self.teacache_coefficients, input_name="model")
            return TeaCache(self.threshold, coefficients, limit)
        if self.calibrate_to is not None:
            return MagCache(self.threshold, (1.0,) * steps, limit)
        calibration = self.calibration
        if calibration is None and model is not None:
            calibration = published_calibration(model, steps)
        if calibration is None:
            raise InputError(
                "steps",
                f"no MagCache ratios for this model at {steps} steps: calibrate for {steps} steps first "
                "(calibrate on), or use method 'first_block'",
            )
        calibration.check(identity, steps)
        return MagCache(self.threshold, calibration.ratios, limit)

    def start_run(
        self,
        model,
        sigmas: Sequence[float] | torch.Tensor,
        sampler: str,
        uses_cfg: bool = False,
        context: str | None = None,
    ) -> BlockCacheRun:
        """A fresh holder for one sampling run of an engine model (see :class:`BlockCacheRun`)."""
        decision = self.decide(sigmas, sampler, uses_cfg, context)
        return self._start(BlockCacheRun, decision, sigmas, sampler, model=model, identity=None)

    def start_native_run(
        self, sigmas, sampler: str, identity: dict, uses_cfg: bool = True, context: str | None = None
    ) -> WholeModelRun:
        """A fresh holder for one sampling run of a ComfyUI model (see :class:`WholeModelRun`)."""
        decision = self.decide(sigmas, sampler, uses_cfg, context)
        return self._start(WholeModelRun, decision, sigmas, sampler, model=None, identity=identity)

    def _start(self, run_class, decision: GateDecision, sigmas, sampler: str, model, identity):
        sig = sigmas.tolist() if isinstance(sigmas, torch.Tensor) else list(sigmas)
        steps = len(sig) - 1
        if identity is None and model is not None:
            identity = model_identity(model)
        # The decision is logged once, at the end of the run, as the head of the telemetry summary (WARNING when
        # forced); logging it here too printed the same line twice per run.
        telemetry = CacheTelemetry(self.method, self.threshold, decision)
        if run_class is WholeModelRun:
            telemetry.unit = "model rows"
        if not decision.enabled:
            return run_class(
                decision, FirstBlockCache(0.0), sig, telemetry, identity=identity, sampler=sampler
            )
        holder = self._holder(steps, model, identity)
        return run_class(decision, holder, sig, telemetry, self.calibrate_to, identity, sampler)

    def replace(self, **changes) -> CacheGate:
        return dataclasses.replace(self, **changes)


def make_gate(
    method: str = "first_block",
    threshold: float | None = None,
    start: float = 0.1,
    end: float = 1.0,
    force: bool = False,
    cfg_cutoff: float = 1.0,
    magcache_file: str = "",
    calibrate: bool = False,
    level: str = "blocks",
    **options,
) -> CacheGate:
    """A validated gate from node-style inputs: ``magcache_file`` is loaded (MagCache), or with ``calibrate``
    it is where the calibration run writes its ratios."""
    calibration, calibrate_to = None, None
    if calibrate:
        if method != "magcache":
            raise InputError("calibrate", f"calibration records MagCache ratios; method is {method}")
        if not magcache_file:
            raise InputError("magcache_file", "calibrate is on: give the file to write the ratios to")
        # checked here, before any step: a name that cannot be written would otherwise fail after the whole run
        calibrate_to = check_name(str(magcache_file), "magcache_file")
    elif method == "magcache" and magcache_file:
        calibration = load_calibration(magcache_file)
    return CacheGate(
        method=method, threshold=threshold, start=start, end=end, force=force, cfg_cutoff=cfg_cutoff,
        calibration=calibration, calibrate_to=calibrate_to, level=level, **options,
    )  # fmt: skip


def causal_chunk_decision(gate: CacheGate, sigmas, sampler: str = "dmd") -> GateDecision:
    """The gate's verdict for one chunk of causal generation (normally off: a few-step re-noising schedule)."""
    return gate.decide(sigmas, sampler, context="causal chunk")


__all__ = [
    "CacheGate",
    "DEFAULT_THRESHOLDS",
    "MAX_THRESHOLDS",
    "METHODS",
    "NATIVE_METHODS",
    "STEP_CACHE_FEATURE",
    "causal_chunk_decision",
    "make_gate",
]
