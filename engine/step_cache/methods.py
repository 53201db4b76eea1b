"""Step-cache methods as holders: each one turns a per-step measurement into "skip" or "compute".

A holder lives for one sampling run (created by :meth:`CacheGate.start_run`, emptied by ``reset``); it keeps
only the numbers and tensors of its rule, never anything on the model. ``decide`` is called once per step with
``cacheable`` telling whether the step is inside the gate's window (outside it the step is computed and the
holder only updates its reference). Every comparison is strict (``value < threshold``), so threshold 0 never
skips and the run equals the uncached one exactly.

* :class:`FirstBlockCache` (First-Block-Cache, chengzeyi/ParaAttention): the relative L1 change of block 0's
  residual against the last *computed* step's; below the threshold the remaining blocks are skipped and their
  last residual is added instead.
* :class:`TeaCache` (ali-vilab/TeaCache): the relative L1 change of a cheap probe (block 0's modulated input
  for FLUX, the time embedding for Wan) against the previous step's, mapped through the model's published
  polynomial and accumulated; while the sum stays below the threshold the whole block stack is skipped.
* :class:`MagCache` (Zehong-Ma/MagCache): no runtime probe; per step the calibrated ratio of residual
  magnitudes ``mean_tokens(|r_t| / |r_t-1|)`` is multiplied into a running ratio, ``|1 - ratio|`` is
  accumulated as the estimated error, and the step is skipped while that error stays below the threshold and at
  most ``max_consecutive`` steps in a row were skipped.
* :class:`InputChangeCache` (whole-model level, for ComfyUI's own models, after ComfyUI core's EasyCache):
  the output change since the last computed step predicted as ``k * mean|x - x_c| / mean|y_c|``, with ``k`` the
  output/input change ratio measured between the last two computed steps.
"""

from __future__ import annotations

import math

import torch

from .coefficients import TeaCacheCoefficients


def relative_l1(current: torch.Tensor, reference: torch.Tensor) -> float:
    """``mean|current - reference| / mean|reference|`` in float32, as a Python float (NaN when undefined)."""
    ref = reference.float()
    den = ref.abs().mean()
    num = (current.float() - ref).abs().mean()
    return float(num / den) if float(den) != 0.0 else (0.0 if float(num) == 0.0 else math.inf)


class _Holder:
    name = ""
    probe_blocks = 0  # blocks a skipped step still runs (First-Block-Cache: block 0)

    def __init__(self, threshold: float, max_consecutive: int | None = None):
        self.threshold = float(threshold)
        self.max_consecutive = max_consecutive
        self.reset()

    def reset(self) -> None:
        self.consecutive = 0

    def _allowed(self) -> bool:
        return self.max_consecutive is None or self.consecutive < self.max_consecutive


class FirstBlockCache(_Holder):
    name = "first_block"
    probe_blocks = 1

    def reset(self) -> None:
        super().reset()
        self.reference: torch.Tensor | None = None

    def decide(
        self, first_residual: torch.Tensor, cacheable: bool
    ) -> tuple[bool, float | None, float | None]:
        """``first_residual``: block 0's output minus its input (primary rows). Returns (skip, change, score)."""
        change = None if self.reference is None else relative_l1(first_residual, self.reference)
        skip = cacheable and change is not None and change < self.threshold and self._allowed()
        if skip:
            self.consecutive += (
                1  # the reference stays the last computed step's (drift is measured, not reset)
            )
        else:
            self.reference, self.consecutive = first_residual, 0
        return skip, change, change


class TeaCache(_Holder):
    name = "teacache"

    def __init__(
        self, threshold: float, coefficients: TeaCacheCoefficients, max_consecutive: int | None = None
    ):
        self.coefficients = coefficients
        super().__init__(threshold, max_consecutive)

    def reset(self) -> None:
        super().reset()
        self.previous: torch.Tensor | None = None
        self.accumulated = 0.0

    def decide(self, probe: torch.Tensor, cacheable: bool) -> tuple[bool, float | None, float | None]:
        change = None if self.previous is None else relative_l1(probe, self.previous)
        self.previous = probe
        if not cacheable or change is None:
            self.accumulated, self.consecutive = 0.0, 0
            return False, change, None
        self.accumulated += self.coefficients.rescale(change)
        score = self.accumulated
        skip = score < self.threshold and self._allowed()
        if skip:
            self.consecutive += 1
        else:
            self.accumulated, self.consecutive = 0.0, 0
        return skip, change, score


class MagCache(_Holder):
    name = "magcache"

    def __init__(self, threshold: float, ratios: tuple[float, ...], max_consecutive: int | None = 5):
        self.ratios = tuple(float(r) for r in ratios)
        super().__init__(threshold, max_consecutive)

    def reset(self) -> None:
        super().reset()
        self.ratio = 1.0
        self.error = 0.0

    def decide(self, step: int, cacheable: bool) -> tuple[bool, float | None, float | None]:
        """Returns (skip, the calibrated ratio of this step, the accumulated error estimate)."""
        ratio = self.ratios[step]
        if not cacheable:
            self.reset()
            return False, ratio, None
        self.ratio *= ratio
        self.error += abs(1.0 - self.ratio)
        score = self.error
        skip = score < self.threshold and self._allowed()
        if skip:
            self.consecutive += 1
        else:
            self.reset()
        return skip, ratio, score


class InputChangeCache(_Holder):
    name = "input_change"

    def reset(self) -> None:
        super().reset()
        self.x_last: torch.Tensor | None = None  # input and output of the last computed step
        self.y_last: torch.Tensor | None = None
        self.rate: float | None = None  # output change / input change between the last two computed steps

    def decide(self, x: torch.Tensor, cacheable: bool) -> tuple[bool, float | None, float | None]:
        """Returns (skip, the relative input change since the last computed step, the predicted relative
        output change that is compared with the threshold)."""
        if self.x_last is None or self.y_last is None:
            return False, None, None
        input_change = float((x.float() - self.x_last.float()).abs().mean())
        relative = relative_l1(x, self.x_last)
        if self.rate is None:
            return False, relative, None
        out_norm = float(self.y_last.float().abs().mean())
        score = self.rate * input_change / out_norm if out_norm else math.inf
        skip = cacheable and score < self.threshold and self._allowed()
        self.consecutive = self.consecutive + 1 if skip else 0
        return skip, relative, score

    def computed(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Record a computed step's input and output (primary rows)."""
        if self.x_last is not None and self.y_last is not None:
            dx = float((x.float() - self.x_last.float()).abs().mean())
            dy = float((y.float() - self.y_last.float()).abs().mean())
            self.rate = dy / dx if dx else None
        self.x_last, self.y_last = x, y


def residual_magnitude_ratio(current: torch.Tensor, previous: torch.Tensor, dim: int = -1) -> float:
    """MagCache's measurement: ``mean over tokens of |r_t| / |r_t-1|`` (norms over ``dim``, float32)."""
    return float((current.float().norm(dim=dim) / previous.float().norm(dim=dim)).mean())


__all__ = [
    "FirstBlockCache",
    "InputChangeCache",
    "MagCache",
    "TeaCache",
    "relative_l1",
    "residual_magnitude_ratio",
]
