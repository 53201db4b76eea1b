"""The gate's policy: before a run, decide from the schedule and the sampler whether step caching can pay.

A step cache skips DiT work on a step whose model input is close to the previous computed step's, and reuses
what that step produced. That pays only when adjacent steps *are* close. The gate refuses (the run is exactly
the uncached one, and the report says why) when any of these holds:

* **The sampler re-noises** (``dmd``, ``lcm``, ``tcd``: :data:`~..sampling.RENOISING_SAMPLERS`; natively any
  ancestral / SDE / LCM sampler): every step draws fresh noise, so consecutive model inputs share no noise and
  a cached residual belongs to a different input.
* **Fewer than** :data:`MIN_STEPS` **steps.** The first and the last step are always computed and the schedule
  of a distilled 1-9 step model moves far on every step: there is nothing worth skipping.
* **The median sigma gap of the cache window exceeds** :data:`MAX_MEDIAN_SIGMA_GAP`. Sigma is the flow noise
  level (1 = noise, 0 = image); a gap of 0.06 means each step removes 6% of the noise. FLUX.1-dev's 28-step
  schedule has a median gap of 0.025-0.033 (0.056 at 12 steps); FLUX.1-schnell's 4 steps move 0.25 each.
  Schedules of eps / v models (k-diffusion sigmas above 1, ``x = x0 + sigma * noise``) are compared on the same
  scale through the equivalent flow noise level ``sigma / (1 + sigma)``.
* **The cache window is empty**: no step ``i`` with ``1 <= i < steps - 1`` and ``start <= i / steps < end``.

``force`` turns the gate on anyway, with a logged warning that names the rule it overrides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..sampling import RENOISING_SAMPLERS

MIN_STEPS = 10
MAX_MEDIAN_SIGMA_GAP = 0.06

# ComfyUI's own samplers (KSAMPLER function names) that draw fresh noise every step.
RENOISING_NAME_PARTS = ("ancestral", "sde", "lcm", "dmd", "tcd", "ddpm", "seeds")


@dataclass(frozen=True)
class GateDecision:
    enabled: bool
    reason: str
    forced: bool = False
    steps: int = 0
    cache_steps: tuple[int, ...] = ()  # steps a cache may skip
    cfg_skip_from: int | None = None  # first step whose unconditional pass may be skipped (None: never)

    def line(self) -> str:
        if self.forced:
            return f"forced on against the gate's policy ({self.reason})"
        return ("on: " if self.enabled else "off: ") + self.reason


def renoises(sampler: str) -> bool:
    """Whether a sampler (engine name, or a ComfyUI sampler function name) draws fresh noise each step."""
    name = sampler.lower().removeprefix("sample_").removeprefix("fewstep_")
    return name in RENOISING_SAMPLERS or any(part in name for part in RENOISING_NAME_PARTS)


def cache_window(steps: int, start: float, end: float) -> tuple[int, ...]:
    """Steps a cache may skip: never the first (nothing cached yet) nor the last (it makes the image)."""
    return tuple(i for i in range(1, steps - 1) if start <= i / steps < end)


def first_step_at(fraction: float, steps: int) -> int | None:
    """The first step index ``i`` with ``i / steps >= fraction`` (None for a fraction of 1: never)."""
    if fraction >= 1.0:
        return None
    return max(1, math.ceil(fraction * steps - 1e-9))


def _gaps(sigmas: Sequence[float], window: Sequence[int]) -> tuple[float, float]:
    s = torch.as_tensor(list(sigmas), dtype=torch.float64)
    gaps = (s[:-1] - s[1:]).abs()
    idx = list(window) or list(range(len(gaps)))
    picked = gaps[idx]
    return float(picked.median()), float(gaps.max())


def decide(
    sigmas: Sequence[float] | torch.Tensor,
    sampler: str,
    start: float = 0.0,
    end: float = 1.0,
    force: bool = False,
    cfg_cutoff: float = 1.0,
    context: str | None = None,
) -> GateDecision:
    """The gate's verdict for a schedule ``sigmas`` (decreasing, ending in 0) and a sampler."""
    sig = [float(v) for v in (sigmas.tolist() if isinstance(sigmas, torch.Tensor) else sigmas)]
    if max(sig, default=0.0) > 1.0 + 1e-6:  # variance-exploding sigmas: compare as flow noise levels
        sig = [v / (1.0 + v) for v in sig]
    steps = len(sig) - 1
    window = cache_window(steps, start, end)
    median_gap, max_gap = _gaps(sig, window) if steps > 0 else (math.inf, math.inf)
    problems = []
    if renoises(sampler):
        problems.append(
            f"sampler '{sampler}' re-noises every step (x0, then fresh noise to the next sigma): consecutive "
            "model inputs share no noise, so a cached result belongs to a different input"
        )
    kind = "distilled few-step schedule" if steps < MIN_STEPS else "schedule"
    if steps < MIN_STEPS or median_gap > MAX_MEDIAN_SIGMA_GAP:
        problems.append(
            f"{steps}-step {kind}: adjacent steps differ by {median_gap:.3f} in sigma (median; largest "
            f"{max_gap:.3f}); the gate needs at least {MIN_STEPS} steps and a median gap of at most "
            f"{MAX_MEDIAN_SIGMA_GAP}"
        )
    if not window:
        problems.append(f"no step falls in the cache window (start {start:g}, end {end:g} of {steps} steps)")
    prefix = f"{context}: " if context else ""
    cfg_from = first_step_at(cfg_cutoff, steps)
    if problems:
        reason = prefix + "; ".join(problems) + "; caching would skip nothing or corrupt the image"
        if not force:
            return GateDecision(False, reason + " (force overrides)", steps=steps)
        return GateDecision(
            True, reason, forced=True, steps=steps, cache_steps=window, cfg_skip_from=cfg_from
        )
    reason = (
        f"{prefix}{steps}-step schedule, median sigma gap {median_gap:.3f} <= {MAX_MEDIAN_SIGMA_GAP}, sampler "
        f"'{sampler}'; steps {window[0]}..{window[-1]} may be skipped"
    )
    return GateDecision(True, reason, steps=steps, cache_steps=window, cfg_skip_from=cfg_from)


__all__ = [
    "GateDecision",
    "MAX_MEDIAN_SIGMA_GAP",
    "MIN_STEPS",
    "cache_window",
    "decide",
    "first_step_at",
    "renoises",
]
