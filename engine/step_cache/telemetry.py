"""What a gated run did: the decision, per step what was measured and whether it was computed, the counts.

The *estimated speedup* counts transformer-block evaluations (blocks x batch rows): what the uncached run would
have evaluated over what this run did. It leaves out the embedding, the head and the probe (a LayerNorm or a
subtraction per step), so on a real model it is an upper bound that the wall time approaches as the blocks
dominate. At the whole-model level (ComfyUI's own models) it counts model rows instead of block rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .policy import GateDecision


@dataclass
class StepRecord:
    index: int
    sigma: float
    computed: bool = True
    change: float | None = None  # the method's per-step measurement (relative change; MagCache: the ratio)
    score: float | None = None  # what was compared with the threshold (accumulated for TeaCache / MagCache)
    uncond_skipped: bool = False


@dataclass
class CacheTelemetry:
    method: str
    threshold: float
    decision: GateDecision
    records: list[StepRecord] = field(default_factory=list)
    full_forwards: int = 0  # forwards that ran every block
    probe_forwards: int = 0  # forwards that reused a residual (ran only the probe blocks, if any)
    work_done: int = 0  # block x rows evaluated (model rows at the whole-model level)
    work_uncached: int = 0  # what the same run without cache or CFG gating would have evaluated
    uncond_skipped: int = 0  # steps whose unconditional pass was replaced by the kept delta
    warnings: list[str] = field(default_factory=list)
    calibration_written: str | None = None
    calibration_ratios: list[float] | None = None
    unit: str = "block evaluations"  # what work_done counts ("model rows" at the whole-model level)

    @property
    def steps(self) -> int:
        return len(self.records)

    @property
    def computed_steps(self) -> int:
        return sum(r.computed for r in self.records)

    @property
    def skipped_steps(self) -> int:
        return sum(not r.computed for r in self.records)

    @property
    def estimated_speedup(self) -> float:
        return self.work_uncached / self.work_done if self.work_done else 1.0

    def check_measurements(self) -> None:
        """Warn about the silent always-miss / always-hit bugs: a change that is NaN or exactly 0."""
        nan = [r.index for r in self.records if r.change is not None and math.isnan(r.change)]
        zero = [r.index for r in self.records if r.change is not None and r.change == 0.0]
        if nan:
            self.warnings.append(
                f"the measured change was NaN at steps {nan} (non-finite activations?); those steps could never "
                "be skipped and were computed"
            )
        if zero and self.method != "magcache":
            self.warnings.append(
                f"the measured change was exactly 0 at steps {zero}: the probe did not change between steps "
                "(a stale or aliased tensor?); every such step would be skipped regardless of the image"
            )

    def summary_lines(self) -> list[str]:
        head = f"step cache {self.method} (threshold {self.threshold:g}): {self.decision.line()}"
        if not self.decision.enabled:
            return [head]
        lines = [
            head,
            f"  {self.computed_steps} steps computed, {self.skipped_steps} skipped of {self.steps}; "
            f"{self.full_forwards} full forwards, {self.probe_forwards} reused; estimated speedup "
            f"{self.estimated_speedup:.2f}x ({self.unit})",
        ]
        if self.uncond_skipped:
            lines.append(
                f"  CFG gating: unconditional pass skipped on {self.uncond_skipped} steps "
                f"(from step {self.decision.cfg_skip_from}; v_neg = v_pos + the last measured v_neg - v_pos)"
            )
        # The score, not the raw change: it is what was compared with the threshold (TeaCache and MagCache
        # accumulate it, input_change predicts it from the input change), so the line explains each skip.
        per_step = []
        for r in self.records:
            value = "-" if r.score is None else f"{r.score:.4g}"
            per_step.append(f"{r.index}:{value}{'' if r.computed else '*'}")
        lines.append(
            f"  score per step vs threshold {self.threshold:g} (* skipped, - not compared): "
            + " ".join(per_step)
        )
        if self.calibration_written:  # a calibration run compares nothing: its measurements are the ratios
            ratios = " ".join(f"{i}:{r:.4g}" for i, r in enumerate(self.calibration_ratios or ()))
            lines.append(
                f"  MagCache calibration written to {self.calibration_written}; ratios per step: {ratios}"
            )
        lines += [f"  warning: {w}" for w in self.warnings]
        return lines

    def summary(self) -> str:
        return "\n".join(self.summary_lines())

    def as_dict(self) -> dict:
        return {
            "method": self.method,
            "threshold": self.threshold,
            "enabled": self.decision.enabled,
            "forced": self.decision.forced,
            "reason": self.decision.reason,
            "steps": self.steps,
            "computed": self.computed_steps,
            "skipped": self.skipped_steps,
            "full_forwards": self.full_forwards,
            "probe_forwards": self.probe_forwards,
            "estimated_speedup": self.estimated_speedup,
            "uncond_skipped": self.uncond_skipped,
            "changes": [r.change for r in self.records],
            "scores": [r.score for r in self.records],
            "skipped_steps": [r.index for r in self.records if not r.computed],
            "warnings": list(self.warnings),
        }


__all__ = ["CacheTelemetry", "StepRecord"]
