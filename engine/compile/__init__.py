"""Compiled and CUDA-graph DiT forwards, applied to a model without changing it.

At 4 steps each forward is short, and kernel launches and Python become a visible share of it. This package
offers two independent speed features for the engine's models (FLUX.1, FLUX.2, Z-Image, Wan); each can be
switched off alone:

* :func:`compile_model` (:mod:`.regional`): ``torch.compile`` of the repeated block, compiled once per block
  class and reused by every block (``regional``), or of the whole forward (``full``); token dimensions marked
  dynamic so other prompt lengths and image sizes reuse the compiled code; optional size buckets.
* :func:`cuda_graph` (:mod:`.graphs`): the forward replayed from CUDA graphs, one per input signature, in a
  bounded LRU, captured after a warm-up call, eager on anything a graph cannot follow. ``whole`` captures a
  FLUX.1 step or a causal Wan step (its static-shape KV cache included) as one graph; ``breakable`` captures
  the forward as segments with collectives run eagerly between them (:mod:`.capture`), and
  :func:`plan_breaks` (:mod:`.planner`) shows where a forward would be cut.

Telemetry (:mod:`.telemetry`): frames compiled, compile time, recompiles with the guard that failed, graph
breaks, graph replays / captures / eager calls with reasons; the sampler's report shows it.

Usage::

    from fewstep.engine.compile import attach_compile
    handle = attach_compile(handle, "regional", cuda_graph="whole")  # the model object is shared, not changed
    latent, report = sample_latent(handle, [cond], latent, steps=4)
    print(report.summary())  # compile time, recompiles and their reasons, graph hits / misses

The models never import this package; it reaches them through their public stages and their block lists.
"""

from .capture import CaptureError, StaleGraphError, function_break_kind
from .feature import (
    COMPILE_FEATURE,
    CompiledDiT,
    CompileRun,
    attach_compile,
    attach_compile_config,
    start_compile_run,
)
from .graphs import GraphedCallable, call_key, cuda_graph, object_state
from .options import (
    BREAK_KINDS,
    COMPILE_BACKENDS,
    COMPILE_MODES,
    DEFAULT_BREAKS,
    GRAPH_MODES,
    MIN_TORCH,
    CompileConfig,
    check_torch,
    parse_buckets,
)
from .planner import BreakPlan, PlannedBreak, PlannedSegment, plan_breaks
from .regional import CompiledModel, compile_model, model_view, repeated_block_lists
from .telemetry import CompileTelemetry, CompileWatch, GraphStats

__all__ = [
    "BREAK_KINDS",
    "BreakPlan",
    "COMPILE_BACKENDS",
    "COMPILE_FEATURE",
    "COMPILE_MODES",
    "CaptureError",
    "CompileConfig",
    "CompileRun",
    "CompileTelemetry",
    "CompileWatch",
    "CompiledDiT",
    "CompiledModel",
    "DEFAULT_BREAKS",
    "GRAPH_MODES",
    "StaleGraphError",
    "GraphStats",
    "GraphedCallable",
    "MIN_TORCH",
    "PlannedBreak",
    "PlannedSegment",
    "attach_compile",
    "attach_compile_config",
    "call_key",
    "check_torch",
    "compile_model",
    "cuda_graph",
    "function_break_kind",
    "model_view",
    "object_state",
    "parse_buckets",
    "plan_breaks",
    "repeated_block_lists",
    "start_compile_run",
]
