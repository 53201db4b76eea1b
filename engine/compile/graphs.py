"""``cuda_graph``: a forward replayed from CUDA graphs, one per input signature, with an eager fallback.

* **whole**: the forward captured as one graph per key (shapes, dtypes and devices of the tensor arguments,
  values of the constant ones). Inputs are copied into static buffers the graph reads; outputs are copied out
  (a replay overwrites its buffers).
  A causal Wan step is captured whole like a FLUX.1 step: its KV cache keeps every per-chunk value in device
  tensors of fixed shapes rewritten in place, so one graph replays every chunk. The key names each object
  argument by the host state its forward branches on and the addresses the graph reads (its ``capture_state()``:
  a KV cache's "window full, no mask" flag and its buffers), so a graph never holds a cache alive: another
  cache is another key, unless it lies at the same addresses, where the graph reads it correctly.
* **breakable**: the forward captured as segments between break points (:mod:`.capture`): collectives (a gloo
  all-to-all cannot be captured) and, on request, attention calls run eagerly between the segments.

Lifecycle of a key: its first ``warmup`` sightings run eagerly (on the capture stream: lazy initialisation,
cuBLAS workspaces and compilation happen there, never inside a capture); the next one captures (and returns that
call's output); later ones replay. At most ``max_graphs`` captured keys are kept (least recently used evicted,
with their memory pools). A key whose capture fails (a branch on tensor data, a host sync) is remembered with the
reason and runs eagerly from then on.

Eager fallbacks, each counted with its reason in :class:`~.telemetry.GraphStats`: the weights are not on the
GPU (offloaded), the weights moved since the capture (offload and reload: every graph is dropped, since a graph
holds their addresses), an object argument declares no host state a key could name, the call is outside the
buckets, autograd is recording.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from itertools import chain

import torch

from ..errors import InputError
from .capture import (
    CaptureError,
    CaptureSession,
    CudaSegments,
    StaleGraphError,
    tree_leaves,
)
from .options import BREAK_KINDS, DEFAULT_BREAKS, GRAPH_MODES, check_torch, graph_device_problem
from .telemetry import GraphStats

log = logging.getLogger(__name__)

MAX_REMEMBERED = 256  # keys whose sightings or refusals are remembered


def object_state(value) -> tuple | None:
    """What a captured forward decided on from an object argument: its ``capture_state()`` (the engine's caches
    declare theirs: :meth:`KVCache.capture_state`, :meth:`CrossAttentionCache.capture_state`), or None when it
    declares nothing, so a graph cannot know when it changes."""
    declared = getattr(value, "capture_state", None)
    return tuple(declared()) if callable(declared) else None


def call_key(args: tuple, kwargs: dict) -> tuple:
    """What a graph is specialised on: the argument tree with each tensor's shape, dtype and device, each
    constant's value and each object's host state (:func:`object_state`)."""
    key = []
    for path, kind, value in tree_leaves((args, kwargs)):
        if kind == "tensor":
            key.append((path, tuple(value.shape), value.dtype, value.device))
        elif kind == "const":
            key.append((path, type(value).__name__, value))
        else:
            key.append((path, type(value).__qualname__, object_state(value)))
    return (torch.is_grad_enabled(), tuple(key))


def _path_name(path: tuple) -> str:
    """``(1, "kv")`` -> ``argument 'kv'``; ``(0, 2)`` -> ``positional argument 2``."""
    where, *rest = path
    if not rest:
        return "an argument"
    head = f"argument {rest[0]!r}" if where == 1 else f"positional argument {rest[0]}"
    return head + "".join(f"[{p!r}]" for p in rest[1:])


class GraphedCallable:
    """``fn`` behind CUDA graphs (see the module docstring); call it like ``fn``."""

    def __init__(
        self,
        fn: Callable,
        mode: str = "whole",
        *,
        max_graphs: int = 4,
        warmup: int = 1,
        weights: torch.nn.Module | None = None,
        segments: Callable[[], object] | None = None,
        traced: bool = True,
        break_at: tuple[str, ...] = DEFAULT_BREAKS,
        accept: Callable[..., str | None] | None = None,
        disabled_reason: str | None = None,
        names: dict[int, str] | None = None,
    ):
        self.fn = fn
        self.mode = mode
        self.max_graphs = max_graphs
        self.warmup = warmup
        self.weights = weights
        self.segments = segments  # None: CUDA graphs; else a factory of segment backends (a test double)
        self.traced = traced
        self.break_at = tuple(break_at) if mode == "breakable" else ()
        self.accept = accept
        self.disabled_reason = disabled_reason
        self.names = names
        self.stats = GraphStats()
        self._captured: OrderedDict[tuple, CaptureSession] = OrderedDict()
        self._sightings: dict[tuple, int] = {}
        self._refused: dict[tuple, str] = {}
        self._fingerprint: tuple | None = None
        self._stream = None

    # -- bookkeeping -------------------------------------------------------------------------------------------------
    def _miss(self, reason: str) -> None:
        self.stats.misses += 1
        self.stats.refused[reason] = self.stats.refused.get(reason, 0) + 1

    def clear(self, reason: str | None = None) -> None:
        """Drop every graph (their static buffers and memory pools) and what was learned about keys."""
        if reason and self._captured:
            log.info("dropping %d CUDA graphs: %s", len(self._captured), reason)
            self.stats.invalidations += len(self._captured)
        self._captured.clear()
        self._sightings.clear()
        self._refused.clear()
        self.stats.held = 0

    def _weights_problem(self) -> str | None:
        """Check the weights are where the graphs expect them; drop every graph when they moved."""
        if self.weights is None:
            return None
        tensors = list(chain(self.weights.parameters(), self.weights.buffers()))
        if self.segments is None:
            off = sum(1 for t in tensors if not t.is_cuda)
            if off:
                return (
                    f"{off} of {len(tensors)} weight tensors are on the CPU (offloaded, or a CPU model); a graph "
                    "needs every weight on the GPU"
                )
        fingerprint = tuple(t.data_ptr() for t in tensors)
        if self._fingerprint is not None and fingerprint != self._fingerprint:
            self.clear("the weights moved since the capture (offload and reload, or replaced tensors)")
        self._fingerprint = fingerprint
        return None

    def _call_problem(self, args: tuple, kwargs: dict) -> str | None:
        if self.disabled_reason is not None:
            return self.disabled_reason
        weights = self._weights_problem()
        if weights is not None:
            return weights
        for path, kind, value in tree_leaves((args, kwargs)):
            if kind == "object" and object_state(value) is None:
                return (
                    f"{_path_name(path)} is a {type(value).__name__}, host-side state a graph would bake in "
                    "without knowing when it changes (it declares no capture_state())"
                )
            if kind == "tensor":
                if value.requires_grad and torch.is_grad_enabled():
                    return "autograd is recording (graphs here are for inference)"
                if self.segments is None and not value.is_cuda:
                    return f"{_path_name(path)} is on {value.device}, not on the GPU"
        if self.accept is not None:
            return self.accept(*args, **kwargs)
        return None

    def _backend(self):
        if self.segments is not None:
            return self.segments()
        device = torch.device("cuda", torch.cuda.current_device())
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return CudaSegments(device, self._stream)

    # -- calls -------------------------------------------------------------------------------------------------------
    def _eager_warmup(self, args: tuple, kwargs: dict):
        backend = self._backend()
        with backend.side_stream():
            out = self.fn(*args, **kwargs)
        return out

    def __call__(self, *args, **kwargs):
        problem = self._call_problem(args, kwargs)
        if problem is not None:
            self._miss(problem)
            return self.fn(*args, **kwargs)
        key = call_key(args, kwargs)
        if key in self._refused:
            self._miss(self._refused[key])
            return self.fn(*args, **kwargs)
        session = self._captured.get(key)
        if session is not None:
            self._captured.move_to_end(key)
            try:
                out = session.replay(args, kwargs)
            except StaleGraphError as err:
                del self._captured[key]
                self.stats.invalidations += 1
                self.stats.held = len(self._captured)
                self._miss(f"graph dropped: {err}")
                return self.fn(*args, **kwargs)
            self.stats.hits += 1
            return out
        seen = self._sightings.get(key, 0)
        if seen < self.warmup:
            if len(self._sightings) >= MAX_REMEMBERED:
                self._sightings.clear()
            self._sightings[key] = seen + 1
            self.stats.warmups += 1
            return self._eager_warmup(args, kwargs)
        return self._capture(key, args, kwargs)

    def _capture(self, key: tuple, args: tuple, kwargs: dict):
        session = CaptureSession(self._backend(), self.break_at, self.traced, self.names)
        try:
            out = session.capture(self.fn, args, kwargs)
        except (CaptureError, RuntimeError) as err:
            reason = f"capture failed: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
            log.warning("CUDA graph %s; running eagerly for this input signature", reason)
            if len(self._refused) >= MAX_REMEMBERED:
                self._refused.clear()
            self._refused[key] = reason
            self._miss(reason)
            return self.fn(*args, **kwargs)
        while len(self._captured) >= self.max_graphs:
            self._captured.popitem(last=False)
            self.stats.evictions += 1
        self._captured[key] = session
        self._sightings.pop(key, None)
        self.stats.captures += 1
        self.stats.held = len(self._captured)
        self.stats.segments = len(session.segments)
        breaks: dict[str, int] = {}
        for brk in session.breaks:
            breaks[brk.name] = breaks.get(brk.name, 0) + 1
        self.stats.breaks = breaks
        return out

    @property
    def graphs_held(self) -> int:
        return len(self._captured)

    def sessions(self) -> list[CaptureSession]:
        return list(self._captured.values())


def cuda_graph(
    model_callable: Callable,
    mode: str = "whole",
    *,
    max_graphs: int = 4,
    warmup: int = 1,
    allow_fallback: bool = False,
    weights: torch.nn.Module | None = None,
    segments: Callable[[], object] | None = None,
    traced: bool = True,
    break_at: tuple[str, ...] = DEFAULT_BREAKS,
    accept: Callable[..., str | None] | None = None,
    input_name: str = "cuda_graph",
) -> GraphedCallable:
    """``model_callable`` replayed from CUDA graphs (see the module docstring).

    ``weights``: the module whose parameters the forward reads (checked on the GPU and unmoved before each
    replay). ``traced``: the callable is eager Python (not compiled), so attention / collective break points and
    data-dependent reads can be seen during capture. ``segments``: a factory of segment backends used instead of
    CUDA graphs (the seam for the tests' CPU emulation, tests/compile_doubles.py; no device checks then). ``accept(*args, **kwargs)`` returns why a call must run eagerly, or None.

    Without a CUDA device this raises :class:`~..errors.InputError`, unless ``allow_fallback``: then the
    callable runs eagerly and each call is counted with the reason."""
    if mode not in GRAPH_MODES or mode == "off":
        raise InputError(
            input_name,
            f"unknown CUDA-graph mode {mode!r}; expected whole or breakable (or leave the forward as it is: off)",
        )
    unknown = [k for k in break_at if k not in BREAK_KINDS]
    if unknown:
        raise InputError(
            "break_at", f"unknown break points {unknown}; expected some of {', '.join(BREAK_KINDS)}"
        )
    check_torch("cuda_graph", input_name)
    if mode == "breakable":
        check_torch("breakable", input_name)
    disabled = graph_device_problem() if segments is None else None
    if disabled is not None and not allow_fallback:
        raise InputError(
            input_name,
            f"{disabled}. Set cuda_graph off, or allow_fallback to run eagerly without graphs",
        )
    if max_graphs < 1:
        raise InputError("max_graphs", f"{max_graphs}: expected at least 1")
    if warmup < 1:
        raise InputError("warmup", f"{warmup}: expected at least 1 eager call before a capture")
    return GraphedCallable(
        model_callable, mode, max_graphs=max_graphs, warmup=warmup, weights=weights, segments=segments,
        traced=traced, break_at=break_at, accept=accept, disabled_reason=disabled,
    )  # fmt: skip


__all__ = ["GraphedCallable", "call_key", "cuda_graph", "object_state"]
