"""Step caching that knows when caching is useless.

A step cache skips DiT work on steps that are close to the previous one (First-Block-Cache, TeaCache, MagCache;
CFG gating skips the unconditional pass late in the schedule). On a distilled 1-9 step schedule, or with a
sampler that re-noises every step, there is nothing to skip, so the gate reads the schedule first and says what
it does. Usage::

    from fewstep.engine.step_cache import STEP_CACHE_FEATURE, make_gate
    gate = make_gate("first_block", threshold=0.08)
    gate.check_model(handle.model)
    handle = handle.with_feature(STEP_CACHE_FEATURE, gate)  # the model object is shared, not changed
    latent, report = sample_latent(handle, [cond], latent, steps=28, schedule="flux.1-dev")
    print(report.summary())  # the decision, steps computed / skipped, the score compared per step

Modules: :mod:`.policy` (the gate's rules), :mod:`.methods` (the per-method holders), :mod:`.run` (per-run
state), :mod:`.gate` (the handle feature), :mod:`.coefficients` (TeaCache's published polynomials),
:mod:`.calibration` (MagCache files), :mod:`.native` (the gate on a ComfyUI ModelPatcher), :mod:`.telemetry` (what a run reports).
"""

from .calibration import MagCacheCalibration, load_calibration, model_identity
from .coefficients import TEACACHE_COEFFICIENTS, teacache_coefficients_for
from .gate import (
    DEFAULT_THRESHOLDS,
    MAX_THRESHOLDS,
    METHODS,
    NATIVE_METHODS,
    STEP_CACHE_FEATURE,
    CacheGate,
    causal_chunk_decision,
    make_gate,
)
from .methods import FirstBlockCache, InputChangeCache, MagCache, TeaCache, relative_l1
from .native import install_native_gate
from .policy import MAX_MEDIAN_SIGMA_GAP, MIN_STEPS, GateDecision, decide, renoises
from .run import PRIMARY, BlockCacheRun, WholeModelRun
from .telemetry import CacheTelemetry, StepRecord

__all__ = [
    "BlockCacheRun",
    "CacheGate",
    "CacheTelemetry",
    "DEFAULT_THRESHOLDS",
    "FirstBlockCache",
    "GateDecision",
    "InputChangeCache",
    "MAX_MEDIAN_SIGMA_GAP",
    "MAX_THRESHOLDS",
    "METHODS",
    "MIN_STEPS",
    "MagCache",
    "MagCacheCalibration",
    "NATIVE_METHODS",
    "PRIMARY",
    "STEP_CACHE_FEATURE",
    "StepRecord",
    "TEACACHE_COEFFICIENTS",
    "TeaCache",
    "WholeModelRun",
    "causal_chunk_decision",
    "decide",
    "load_calibration",
    "make_gate",
    "model_identity",
    "install_native_gate",
    "relative_l1",
    "renoises",
    "teacache_coefficients_for",
]
