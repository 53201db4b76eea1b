"""The break-point planner: where a breakable graph of a forward would be cut, without a GPU.

``plan_breaks`` runs the forward once, eagerly, under the same capture machinery a breakable CUDA graph uses,
with a backend that counts instead of capturing. The plan lists the segments (ops, and the modules they ran in)
and the break points between them (kind, name, and the module that made the call), in order. Run it on a tiny
preset of the model to see how a breakable graph of the real one is cut: the structure does not depend on width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from .capture import CaptureSession, DrySegments
from .options import BREAK_KINDS, DEFAULT_BREAKS


@dataclass(frozen=True)
class PlannedSegment:
    index: int
    ops: int  # torch calls in the segment
    modules: tuple[str, ...]  # modules the calls ran in, in order ("" is the model itself)

    def blocks(self, depth: int = 2) -> tuple[str, ...]:
        """``modules`` cut to ``depth`` name components, repeats merged (``double_blocks.0``, ``img_in``)."""
        out: list[str] = []
        for name in self.modules:
            short = ".".join(name.split(".")[:depth]) or "<model>"
            if not out or out[-1] != short:
                out.append(short)
        return tuple(out)


@dataclass(frozen=True)
class PlannedBreak:
    index: int  # order among the breaks
    kind: str  # attention / collective
    name: str  # scaled_dot_product_attention, all_to_all_single...
    module: str | None  # the module that made the call ("" the model itself)


@dataclass(frozen=True)
class BreakPlan:
    steps: tuple[PlannedSegment | PlannedBreak, ...]  # in execution order

    @property
    def segments(self) -> tuple[PlannedSegment, ...]:
        return tuple(s for s in self.steps if isinstance(s, PlannedSegment))

    @property
    def breaks(self) -> tuple[PlannedBreak, ...]:
        return tuple(s for s in self.steps if isinstance(s, PlannedBreak))

    @property
    def break_modules(self) -> list[str | None]:
        return [b.module for b in self.breaks]

    def summary(self) -> str:
        lines = [f"{len(self.segments)} graph segments, {len(self.breaks)} break points"]
        for step in self.steps:
            if isinstance(step, PlannedSegment):
                lines.append(f"  segment {step.index}: {step.ops} ops in {', '.join(step.blocks()) or '-'}")
            else:
                lines.append(f"  break {step.index}: {step.kind} {step.name} from {step.module or '<model>'}")
        return "\n".join(lines)


def plan_breaks(
    fn: Callable,
    *args,
    break_at: tuple[str, ...] = DEFAULT_BREAKS,
    modules: nn.Module | None = None,
    **kwargs,
) -> BreakPlan:
    """Run ``fn(*args, **kwargs)`` once and return where a breakable graph would cut it.

    ``modules``: the model (names the modules in the plan; default: ``fn`` itself when it is a module).
    ``break_at``: break kinds (``collective``, ``attention``)."""
    unknown = [k for k in break_at if k not in BREAK_KINDS]
    if unknown:
        raise ValueError(f"unknown break kinds {unknown}; expected some of {', '.join(BREAK_KINDS)}")
    root = modules if modules is not None else (fn if isinstance(fn, nn.Module) else None)
    names = {id(m): name for name, m in root.named_modules()} if root is not None else {}
    session = CaptureSession(DrySegments(names), break_at, traced=True, names=names)
    session.capture(fn, args, kwargs)
    steps: list[PlannedSegment | PlannedBreak] = []
    n_segments = n_breaks = 0
    for step in session.steps:
        if step[0] == "segment":
            steps.append(PlannedSegment(n_segments, step[1].ops, tuple(step[1].modules)))
            n_segments += 1
        else:
            brk = step[1]
            steps.append(PlannedBreak(n_breaks, brk.kind, brk.name, brk.where))
            n_breaks += 1
    return BreakPlan(tuple(steps))


__all__ = ["BreakPlan", "PlannedBreak", "PlannedSegment", "plan_breaks"]
