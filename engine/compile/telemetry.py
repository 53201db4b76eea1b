"""What compilation and CUDA graphs did during one run: compile time, frames compiled, recompiles and their
reasons, graph breaks, graph hits / misses / captures.

Dynamo keeps process-wide records (``torch._dynamo.utils.get_compilation_metrics()``: one per compiled frame,
with its compile time and, for a recompile, the guard that failed; ``counters["graph_break"]``: break reasons).
:class:`CompileWatch` takes the records that appeared between its start and its end and keeps those of frames in
this package, so a run reports only its own compilations.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent.parent)


def _short(reason: str, limit: int = 240) -> str:
    """First line of a guard-failure reason, without dynamo's compile id prefix ("3/1: ")."""
    line = str(reason).strip().splitlines()[0] if str(reason).strip() else ""
    head, sep, rest = line.partition(": ")
    if sep and "/" in head and head.replace("/", "").isdigit():
        line = rest
    return line if len(line) <= limit else line[: limit - 3] + "..."


@dataclass
class CompiledFrame:
    """One dynamo compilation seen by a watch."""

    name: str  # code name (``forward``, ``torch_dynamo_resume_in_...``)
    file: str  # file name relative to the package
    line: int
    seconds: float
    recompile_reason: str | None = None
    failure: str | None = None


def _dynamo_records() -> list:
    from torch._dynamo.utils import get_compilation_metrics

    return list(get_compilation_metrics())


def _graph_break_counts() -> Counter:
    from torch._dynamo.utils import counters

    return Counter(dict(counters["graph_break"]))


def package_relative(filename: str, root: str) -> str | None:
    """``filename`` relative to the package ``root`` (resolved), or None outside it. Dynamo records the path a module
    was imported from, unresolved: with the pack installed as a symlink in custom_nodes (which docs/install.md allows) that
    path is the link's, so it is resolved before the comparison."""
    for candidate in (filename, os.path.realpath(filename)):
        try:
            return str(Path(candidate).relative_to(root))
        except ValueError:
            continue
    return None


class CompileWatch:
    """Collects dynamo's records of the compilations between ``start()`` and ``stop()`` (this package only)."""

    def __init__(self, root: str = PACKAGE_ROOT):
        self.root = root
        self._seen: list = []
        self._breaks: Counter = Counter()
        self._t0 = 0.0
        self.frames: list[CompiledFrame] = []
        self.graph_breaks: dict[str, int] = {}

    def start(self) -> CompileWatch:
        self._seen = _dynamo_records()  # kept referenced, so ids stay unique while we compare
        self._breaks = _graph_break_counts()
        self._t0 = time.time()
        return self

    def stop(self) -> CompileWatch:
        seen = {id(m) for m in self._seen}
        frames = []
        for m in _dynamo_records():
            if id(m) in seen:
                continue
            relative = package_relative(str(getattr(m, "co_filename", "") or ""), self.root)
            if relative is None:
                continue
            frames.append(
                CompiledFrame(
                    name=str(getattr(m, "co_name", "?")),
                    file=relative,
                    line=int(getattr(m, "co_firstlineno", 0) or 0),
                    seconds=float(getattr(m, "entire_frame_compile_time_s", 0.0) or 0.0),
                    recompile_reason=_short(m.recompile_reason)
                    if getattr(m, "recompile_reason", None)
                    else None,
                    failure=(
                        f"{m.fail_type}: {_short(m.fail_reason or '')}"
                        if getattr(m, "fail_type", None)
                        else None
                    ),
                )
            )
        self.frames = frames
        breaks = _graph_break_counts() - self._breaks
        self.graph_breaks = {_short(k, 160): v for k, v in breaks.items()}
        self._seen = []
        return self


@dataclass
class GraphStats:
    """CUDA-graph counters (cumulative on the graphed callable; per run as a difference)."""

    hits: int = 0  # calls served by replaying a captured graph
    captures: int = 0  # capture passes (they also produce that call's output)
    warmups: int = 0  # eager calls on a shape's first sightings, before its capture
    misses: int = 0  # eager calls for another reason (see ``refused``)
    evictions: int = 0  # graphs dropped by the LRU bound
    invalidations: int = 0  # graphs dropped because the weights moved (offload / reload) or a break changed
    refused: dict[str, int] = field(default_factory=dict)  # reason -> eager calls
    held: int = 0  # graphs held after the run
    segments: int = 0  # graph segments of the last capture (breakable mode; 1 for a whole graph)
    breaks: dict[str, int] = field(default_factory=dict)  # break point -> count, in the last capture

    def copy(self) -> GraphStats:
        return GraphStats(
            self.hits, self.captures, self.warmups, self.misses, self.evictions, self.invalidations,
            dict(self.refused), self.held, self.segments, dict(self.breaks),
        )  # fmt: skip

    def since(self, before: GraphStats) -> GraphStats:
        refused = {k: v - before.refused.get(k, 0) for k, v in self.refused.items()}
        return GraphStats(
            self.hits - before.hits, self.captures - before.captures, self.warmups - before.warmups,
            self.misses - before.misses, self.evictions - before.evictions,
            self.invalidations - before.invalidations, {k: v for k, v in refused.items() if v},
            self.held, self.segments, dict(self.breaks),
        )  # fmt: skip

    def line(self, mode: str) -> str:
        text = (
            f"CUDA graph ({mode}): {self.hits} replays, {self.captures} captures, {self.warmups} warm-up and "
            f"{self.misses} other eager calls, {self.evictions} evicted, {self.invalidations} invalidated; "
            f"{self.held} held"
        )
        if mode == "breakable" and self.segments:
            breaks = ", ".join(f"{k} x{v}" for k, v in self.breaks.items()) or "none"
            text += f"; {self.segments} segments, breaks: {breaks}"
        return text


@dataclass
class CompileTelemetry:
    """One sampling run's view of compilation and CUDA graphs (``SampleReport.compile``)."""

    config: str
    frames: list[CompiledFrame] = field(default_factory=list)
    graph_breaks: dict[str, int] = field(default_factory=dict)
    graph_mode: str = "off"
    graphs: GraphStats | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def frames_compiled(self) -> int:
        return len(self.frames)

    @property
    def recompiles(self) -> int:
        return sum(f.recompile_reason is not None for f in self.frames)

    @property
    def compile_seconds(self) -> float:
        return sum(f.seconds for f in self.frames)

    @property
    def recompile_reasons(self) -> dict[str, int]:
        return dict(Counter(f.recompile_reason for f in self.frames if f.recompile_reason is not None))

    @property
    def failures(self) -> list[str]:
        return [f"{f.name} ({f.file}:{f.line}): {f.failure}" for f in self.frames if f.failure]

    def summary_lines(self) -> list[str]:
        lines = [
            f"compile: {self.config}; {self.frames_compiled} frames compiled in {self.compile_seconds:.2f} s, "
            f"{self.recompiles} recompiles, {sum(self.graph_breaks.values())} graph breaks"
        ]
        for reason, n in self.recompile_reasons.items():
            lines.append(f"  recompile x{n}: {reason}")
        for reason, n in self.graph_breaks.items():
            lines.append(f"  graph break x{n}: {reason}")
        lines += [f"  compile failed: {f}" for f in self.failures]
        if self.graphs is not None:
            lines.append(self.graphs.line(self.graph_mode))
            for reason, n in self.graphs.refused.items():
                lines.append(f"  no graph x{n}: {reason}")
        lines += self.notes
        return lines

    def as_dict(self) -> dict:
        return {
            "config": self.config,
            "frames_compiled": self.frames_compiled,
            "compile_seconds": self.compile_seconds,
            "recompiles": self.recompiles,
            "recompile_reasons": self.recompile_reasons,
            "graph_breaks": self.graph_breaks,
            "failures": self.failures,
            "graph_mode": self.graph_mode,
            "graphs": None if self.graphs is None else vars(self.graphs),
            "notes": list(self.notes),
        }


__all__ = ["CompileTelemetry", "CompileWatch", "CompiledFrame", "GraphStats"]
