"""The ``compile`` handle feature: a model's compiled forward and its CUDA graphs, kept across sampling runs.

:func:`attach_compile` returns a new handle carrying a :class:`CompiledDiT` (the model object is shared, not
changed). The sampler asks it for a per-run :class:`CompileRun` (``start_run``): the run decides whether graphs
may be used (not while a step cache branches on data), gives the denoiser a callable that stands for the model,
and ``finish`` returns the run's :class:`~.telemetry.CompileTelemetry` for the report.

State that lives across runs (dynamo's compiled code, captured graphs) belongs to the ``CompiledDiT`` object;
``dispose`` drops the graphs. Composition: fp8 / patched weights are read by the compiled code and the graphs at
call time (the graphs drop themselves when weights move); a step-cache gate that refuses a run (4-step schedules)
leaves the run exactly uncached, so compile and graphs apply in full; a gate that is on keeps regional
compilation (its decisions run in Python between compiled blocks) and turns graphs off for that run.
"""

from __future__ import annotations

import logging

from torch import nn

from ..errors import InputError
from .graphs import GraphedCallable
from .options import DEFAULT_BREAKS, CompileConfig, graph_device_problem
from .regional import BucketCheck, CompiledModel
from .telemetry import CompileTelemetry, CompileWatch

log = logging.getLogger(__name__)

COMPILE_FEATURE = "compile"

STEP_CACHE_NO_GRAPH = (
    "CUDA graphs off for this run: the step cache is on, and it decides each step from tensor values whether to "
    "run the blocks (a Python branch on data), which a captured graph cannot follow"
)


class CompiledDiT:
    """What :func:`attach_compile` records on a handle (see the module docstring)."""

    def __init__(self, model: nn.Module, config: CompileConfig):
        self.model = model
        self.config = config
        self.compiled: CompiledModel | None = None
        if config.mode != "off":
            # the config was checked when it was built: compiled here without checking it again
            self.compiled = CompiledModel(model, config.mode, config.dynamic, config.buckets, config.backend)
        self.graph_problem: str | None = None
        self._graphs: GraphedCallable | None = None
        if config.graphs_requested:
            injected = config.graph_segments
            if (
                injected is not None
                and getattr(injected, "needs_tracer", False)
                and self.compiled is not None
            ):
                raise InputError(
                    "cuda_graph",
                    "injected graph segments that record eager torch calls cannot see inside a compiled "
                    "forward; use compile off with them (real CUDA graphs work with compile)",
                )
            problem = graph_device_problem() if injected is None else None
            device = next(model.parameters()).device
            if problem is None and injected is None and device.type != "cuda":
                problem = f"CUDA graphs replay GPU kernels; this model's weights are on {device}"
            if problem is not None and not config.allow_fallback:
                raise InputError(
                    "cuda_graph",
                    f"{problem}. Set cuda_graph off, or allow_fallback to run eagerly without graphs",
                )
            if problem is not None:
                log.warning("cuda_graph %s: %s; running eagerly (allow_fallback)", config.cuda_graph, problem)
            self.graph_problem = problem

    @property
    def forward(self):
        """The callable the graphs wrap: the compiled forward, or the model."""
        return self.compiled if self.compiled is not None else self.model

    @property
    def graphs(self) -> GraphedCallable | None:
        if not self.config.graphs_requested:
            return None
        if self._graphs is None:
            traced = self.compiled is None
            # the graph options were checked with the config, and the device when this feature was made
            # (graph_problem: why graphs cannot run here, None: they can), so nothing is checked again
            self._graphs = GraphedCallable(
                self.forward, self.config.cuda_graph, max_graphs=self.config.max_graphs,
                warmup=self.config.warmup, weights=self.model, segments=self.config.graph_segments,
                traced=traced, break_at=self.config.break_at,
                accept=BucketCheck(self.model, self.config.buckets) if self.config.buckets else None,
                disabled_reason=self.graph_problem,
            )  # fmt: skip
            if traced:
                self._graphs.names = {id(m): name for name, m in self.model.named_modules()}
        return self._graphs

    def start_run(self, model: nn.Module, step_cache_active: bool = False) -> CompileRun:
        if model is not self.model:
            raise InputError(
                "model",
                "the compile feature on this model handle was made for another model object; attach "
                "FewStepCompile (attach_compile) to the model it should run",
            )
        return CompileRun(self, step_cache_active)

    def dispose(self) -> None:
        """Drop the captured graphs (their buffers and memory pools); compiled code stays with dynamo."""
        if self._graphs is not None:
            self._graphs.clear()

    def describe(self) -> str:
        return self.config.describe()


class _GraphedRun:
    """Stands for the model in a run that replays CUDA graphs (the family adapters and the denoiser call it like
    the model): a call with a block runner (whose Python a graph cannot follow) runs the compiled forward or the
    model, every other call the graphs. A run without graphs needs no stand-in: its model is the compiled forward
    itself (or the model), so a forward is never wrapped more than once."""

    def __init__(self, feature: CompiledDiT):
        self._feature = feature

    def __call__(self, *args, block_runner=None, **kwargs):
        f = self._feature
        if block_runner is not None:  # the block stack runs from Python: no graph
            return f.forward(*args, block_runner=block_runner, **kwargs)
        return f.graphs(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._feature.model, name)


class CompileRun:
    """One sampling run's use of a :class:`CompiledDiT`; ``finish`` returns its telemetry."""

    def __init__(self, feature: CompiledDiT, step_cache_active: bool):
        self.feature = feature
        config = feature.config
        self.notes: list[str] = []
        use_graphs = config.graphs_requested
        if use_graphs and step_cache_active:
            use_graphs = False
            self.notes.append(STEP_CACHE_NO_GRAPH)
        if config.mode == "full" and step_cache_active:
            self.notes.append(
                "compile full: the step cache runs the block stack from Python in this run, so the blocks ran "
                "compiled one by one (regional)"
            )
        if feature.graph_problem is not None and use_graphs:
            self.notes.append(f"CUDA graphs off (allow_fallback): {feature.graph_problem}")
        # why no Python runs between the blocks of this run's forwards (None: the block loop is Python, eager or
        # with regionally compiled blocks), so a host's cancel check between blocks cannot run (engine.run)
        self.whole_forward: str | None = None
        if use_graphs:
            self.whole_forward = f"the forward is replayed from CUDA graphs (cuda_graph {config.cuda_graph})"
        elif feature.compiled is not None and config.mode == "full":
            self.whole_forward = "the forward is compiled whole (compile full)"
        # what the run calls: the graphs' stand-in, else the compiled forward (or the model: graphs refused)
        self.model = _GraphedRun(feature) if use_graphs else feature.forward
        self._graphs = feature.graphs if use_graphs else None
        self._before = self._graphs.stats.copy() if self._graphs is not None else None
        self._watch = CompileWatch().start() if feature.compiled is not None else None

    def finish(self) -> CompileTelemetry:
        config = self.feature.config
        telemetry = CompileTelemetry(config.describe(), graph_mode=config.cuda_graph, notes=self.notes)
        if self._watch is not None:
            self._watch.stop()
            telemetry.frames = self._watch.frames
            telemetry.graph_breaks = self._watch.graph_breaks
            self._watch = None
        if self._graphs is not None:
            telemetry.graphs = self._graphs.stats.since(self._before)
        log.info("%s", "; ".join(telemetry.summary_lines()))
        return telemetry


def attach_compile(
    handle,
    mode: str = "regional",
    cuda_graph: str = "off",
    *,
    dynamic: bool = True,
    buckets=None,
    backend: str = "inductor",
    allow_fallback: bool = False,
    max_graphs: int = 4,
    warmup: int = 1,
    break_at: tuple[str, ...] = DEFAULT_BREAKS,
    graph_segments=None,
):
    """A new handle whose runs use a compiled forward and/or CUDA graphs (both off: the feature removed).

    Apply it to the model as it will run: after fp8 storage and weight patches (later in-place patches are
    followed anyway; a dtype change recompiles, with the reason in the report). ``graph_segments``: a factory of
    segment backends used instead of CUDA graphs (the seam for tests/compile_doubles.py)."""
    config = CompileConfig(
        mode=mode, cuda_graph=cuda_graph, dynamic=dynamic, buckets=buckets, backend=backend,
        allow_fallback=allow_fallback, max_graphs=max_graphs, warmup=warmup, break_at=tuple(break_at),
        graph_segments=graph_segments,
    )  # fmt: skip
    return attach_compile_config(handle, config)


def attach_compile_config(handle, config: CompileConfig):
    """:func:`attach_compile` with a :class:`CompileConfig` already built (and so checked): nothing is checked
    again (a command that checked its flags before loading the model hands its config on)."""
    if config.mode == "off" and config.cuda_graph == "off":
        return handle.replace(features=tuple((k, v) for k, v in handle.features if k != COMPILE_FEATURE))
    return handle.with_feature(COMPILE_FEATURE, CompiledDiT(handle.model, config))


def start_compile_run(handle, step_cache_active: bool = False) -> CompileRun | None:
    """The run object for ``handle``'s compile feature, or None without one."""
    feature = handle.feature(COMPILE_FEATURE)
    return None if feature is None else feature.start_run(handle.model, step_cache_active)


__all__ = [
    "COMPILE_FEATURE",
    "CompileRun",
    "CompiledDiT",
    "STEP_CACHE_NO_GRAPH",
    "attach_compile",
    "attach_compile_config",
    "start_compile_run",
]
