"""Capturing a forward as graph segments separated by eagerly run break points.

One capture pass runs the forward once on static input buffers. Graph capture is open while it runs; at a break
point the open segment is closed (and, on a GPU, replayed, so the pass computes real values), the break runs
eagerly, its outputs are copied into buffers the graph owns, and the next segment opens. A replay copies the new
inputs into the static buffers and walks the same steps: segments are replayed, breaks are called again and their
outputs copied into the same buffers. Python in the segments does not run on replay, so everything it decided at
capture (shapes, host-side integers and flags) is baked in: the graph's key (:func:`.graphs.call_key`) names
what it decided on, the object arguments (a KV cache) by their host state and the addresses they hold.

A causal KV cache needs no break: its cursors, visibility and RoPE positions are device tensors rewritten in
place before each chunk (engine/causal/kv_cache.py), so its calls are captured like any other op and a whole
causal step is one graph. Break points remain for torch-level calls seen by a ``TorchFunctionMode``
(:class:`SegmentTracer`), which only sees eager code (inside a compiled forward they are part of its graph):

* ``collective``: the functional collectives (``torch.ops._c10d_functional.*``). What truly cannot be captured
  is a collective over gloo (sequence parallelism's Ulysses all-to-all on CPU tensors: host-side transport, no
  kernel a CUDA graph could record); NCCL collectives can be captured but are cut too by default. The tracer
  sees torch ops only: ``dist.all_to_all_single`` (engine/parallel/mesh.py) is a process-group call it does
  not see, so a graphed sequence-parallel step needs the functional all-to-all.
* ``attention``: ``scaled_dot_product_attention``, the pack's quantized attention, flash-attn ops (for a kernel
  that refuses capture, and for the planner's view of a forward).

The tracer also refuses reads of tensor values into Python (``item``, ``bool(t)``...): a branch on data cannot
be captured.

Backends: :class:`CudaSegments` (``torch.cuda.CUDAGraph`` in a private memory pool per captured key) and
:class:`DrySegments` (counts the ops of each segment: the planner). Another backend can be injected
(``cuda_graph(..., segments=factory)``); the tests inject a CPU emulation (tests/compile_doubles.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# Calls that read a tensor's value into Python: a graph cannot follow what Python then decides.
DATA_DEPENDENT = frozenset(
    getattr(torch.Tensor, name)
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__complex__", "numpy")
    if hasattr(torch.Tensor, name)
) | frozenset((torch.nonzero, torch.Tensor.nonzero))

ATTENTION_OPS = {("fewstep", "quantized_attention")}
ATTENTION_NAMESPACES = {"flash_attn"}
COLLECTIVE_NAMESPACES = {"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d"}


class CaptureError(Exception):
    """The forward did something a graph cannot capture (the message says what and where)."""


class StaleGraphError(Exception):
    """A captured graph no longer matches the call (a break returned other shapes or values)."""


def op_name(func) -> str:
    return getattr(func, "__name__", None) or str(func)


def function_break_kind(func) -> str | None:
    """``attention`` / ``collective`` for torch-level calls that are break points, else None."""
    if func is F.scaled_dot_product_attention:
        return "attention"
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        namespace, _, rest = str(func).partition(".")
        name = rest.split(".")[0]
        if namespace in COLLECTIVE_NAMESPACES:
            return "collective"
        if (namespace, name) in ATTENTION_OPS or namespace in ATTENTION_NAMESPACES:
            return "attention"
        if namespace == "aten" and name.startswith("_scaled_dot_product"):
            return "attention"
    return None


# -- trees of arguments / results ----------------------------------------------------------------------------------
CONSTANT_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device)


def tree_map(value, on_tensor: Callable, on_object: Callable | None = None, on_const: Callable | None = None,
             path: tuple = ()):  # fmt: skip
    """Rebuild ``value`` (tensors, constants, tuples, lists, dicts, dataclasses) with ``on_tensor(path, t)`` in
    place of each tensor, ``on_object(path, obj)`` in place of any other object (kept when None) and
    ``on_const(path, c)`` called on constants (kept)."""
    if isinstance(value, torch.Tensor):
        return on_tensor(path, value)
    if isinstance(value, CONSTANT_TYPES):
        if on_const is not None:
            on_const(path, value)
        return value
    if isinstance(value, (tuple, list)):
        items = [tree_map(v, on_tensor, on_object, on_const, path + (i,)) for i, v in enumerate(value)]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: tree_map(v, on_tensor, on_object, on_const, path + (k,)) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: tree_map(getattr(value, f.name), on_tensor, on_object, on_const, path + (f.name,))
            for f in dataclasses.fields(value)
            if f.init
        }
        return dataclasses.replace(value, **changes)
    return value if on_object is None else on_object(path, value)


def tree_leaves(value) -> list[tuple[tuple, str, object]]:
    """``(path, kind, value)`` for every leaf, in :func:`tree_map` order; kind is tensor, const or object."""
    out: list[tuple[tuple, str, object]] = []

    def keep(kind):
        def add(path, leaf):
            out.append((path, kind, leaf))
            return leaf

        return add

    tree_map(value, keep("tensor"), keep("object"), keep("const"))
    return out


def clone_tensors(value):
    return tree_map(value, lambda _, t: t.clone())


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a usable equality are compared by identity
        return a is b


def copy_into(static, new, what: str) -> None:
    """Copy a break's new result into the buffers the graph reads (same structure, shapes and dtypes)."""
    static_leaves, new_leaves = tree_leaves(static), tree_leaves(new)
    if [(p, k) for p, k, _ in static_leaves] != [(p, k) for p, k, _ in new_leaves]:
        raise StaleGraphError(f"{what} returned another structure than at capture")
    for (path, kind, s), (_, _, n) in zip(static_leaves, new_leaves):
        if kind == "tensor":
            if s.shape != n.shape or s.dtype != n.dtype or s.device != n.device:
                raise StaleGraphError(
                    f"{what} returned {list(n.shape)} {n.dtype} at {path}, captured {list(s.shape)} {s.dtype}"
                )
            s.copy_(n)
        elif not _same(s, n):
            raise StaleGraphError(
                f"{what} returned {n!r} at {path}, captured {s!r} (a host value baked into the graph)"
            )


# -- where an op runs (planner) --------------------------------------------------------------------------------------
def calling_module(names: dict[int, str], depth: int = 2, limit: int = 40) -> str | None:
    """The name of the innermost module whose method is on the Python stack (``names``: id -> module name)."""
    frame = sys._getframe(depth)
    for _ in range(limit):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            return names[id(owner)]
        frame = frame.f_back
    return None


# -- breaks ------------------------------------------------------------------------------------------------------------
@dataclass
class BreakCall:
    """A break point met during capture: ``invoke()`` runs it again on replay (on the captured static inputs)."""

    kind: str
    name: str
    invoke: Callable[[], object]
    where: str | None = None


# -- the tracer ------------------------------------------------------------------------------------------------------
class SegmentTracer(TorchFunctionMode):
    """Sees every torch call of an eager forward: breaks at attention / collectives, refuses data-dependent
    reads, and hands each other call to the backend's recorder (the emulator's tape, the planner's counts)."""

    def __init__(self, session: CaptureSession, break_kinds):
        super().__init__()
        self.session = session
        self.break_kinds = frozenset(break_kinds)
        self.record: Callable | None = None
        self.paused = False
        self.ops = 0  # torch calls captured so far (an empty segment between two breaks is dropped)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if func in DATA_DEPENDENT:
            where = self.session.where()
            raise CaptureError(
                f"Tensor.{op_name(func)} reads a tensor value into Python{f' in {where}' if where else ''}: a "
                "branch on data cannot be captured in a graph"
            )
        kind = function_break_kind(func)
        if kind is not None and kind in self.break_kinds:
            captured = (args, kwargs)

            def invoke():
                return func(*captured[0], **captured[1])

            return self.session.on_break(BreakCall(kind, op_name(func), invoke))
        out = func(*args, **kwargs)
        self.ops += 1
        if self.record is not None:
            self.record(func, args, kwargs, out)
        return out


# -- segment backends ----------------------------------------------------------------------------------------------
class CudaSegments:
    """CUDA graphs: each segment a ``torch.cuda.CUDAGraph`` captured into this key's private memory pool on a
    side stream (capture does not execute: the pass replays each segment right after capturing it)."""

    capture_executes = False
    needs_tracer = False

    def __init__(self, device: torch.device, stream=None):
        self.device = device
        self.stream = stream if stream is not None else torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()  # one pool per captured key: its segments share it

    @contextlib.contextmanager
    def side_stream(self):
        """Warm-up and capture run on the side stream; the caller's stream waits for them."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)

    def prepare(self) -> None:
        torch.cuda.synchronize(self.device)
        gc.collect()

    def begin(self, tracer: SegmentTracer | None):
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        return graph

    def end(self, graph, tracer: SegmentTracer | None):
        with warnings.catch_warnings():  # a segment between two breaks may hold no kernel at all
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            graph.capture_end()
        return graph

    def abort(self, graph) -> None:
        with contextlib.suppress(Exception):
            graph.capture_end()

    def replay(self, graph) -> None:
        graph.replay()


class _TracedSegments:
    """A backend whose segments are what the tracer records (no device graph): nothing to prepare or abort."""

    capture_executes = True
    needs_tracer = True

    @contextlib.contextmanager
    def side_stream(self):
        yield

    def prepare(self) -> None:
        pass

    def end(self, segment, tracer: SegmentTracer | None):
        tracer.record = None
        return segment

    def abort(self, segment) -> None:
        pass


@dataclass
class SegmentRecord:
    ops: int = 0
    modules: list[str] = field(default_factory=list)


class DrySegments(_TracedSegments):
    """The planner's backend: counts the ops of each segment and the modules they run in."""

    def __init__(self, names: dict[int, str] | None):
        self.names = names or {}

    def begin(self, tracer: SegmentTracer | None):
        seg = SegmentRecord()

        def record(func, args, kwargs, out):
            seg.ops += 1
            where = calling_module(self.names, depth=3)
            if where is not None and (not seg.modules or seg.modules[-1] != where):
                seg.modules.append(where)

        tracer.record = record
        return seg

    def replay(self, seg) -> None:
        pass


# -- one capture -------------------------------------------------------------------------------------------------------
class CaptureSession:
    """The capture of one forward for one key, then its replays (see the module docstring)."""

    def __init__(self, backend, break_kinds, traced: bool, names: dict[int, str] | None = None):
        self.backend = backend
        self.break_kinds = tuple(break_kinds)
        self.traced = traced or backend.needs_tracer
        self.names = names or {}
        self.steps: list[tuple] = []  # ("segment", handle) or ("break", BreakCall, static result)
        self.static_inputs: list[torch.Tensor] = []
        self.output = None
        self.tracer: SegmentTracer | None = None
        self._open = None
        self._ops_at_open = 0

    # -- helpers used by proxies and the tracer --------------------------------------------------------------------
    @contextlib.contextmanager
    def paused(self):
        if self.tracer is None:
            yield
            return
        before = self.tracer.paused
        self.tracer.paused = True
        try:
            yield
        finally:
            self.tracer.paused = before

    def where(self) -> str | None:
        return calling_module(self.names, depth=3) if self.names else None

    def _close_segment(self) -> None:
        handle = self.backend.end(self._open, self.tracer)
        self._open = None
        if self.tracer is not None and self.tracer.ops == self._ops_at_open:
            return  # nothing ran since the last break: no segment
        self.steps.append(("segment", handle))
        if not self.backend.capture_executes:
            self.backend.replay(handle)

    def _open_segment(self) -> None:
        self._open = self.backend.begin(self.tracer)
        self._ops_at_open = self.tracer.ops if self.tracer is not None else 0

    def on_break(self, brk: BreakCall):
        brk.where = self.where()
        self._close_segment()
        with self.paused():
            result = brk.invoke()
            if any(kind == "object" for _, kind, _ in tree_leaves(result)):
                raise CaptureError(f"{brk.name} returned a Python object; a break must return tensors")
            static = clone_tensors(result)  # the graph reads its own copy, refreshed on every replay
        self.steps.append(("break", brk, static))
        self._open_segment()
        return static

    # -- capture and replay -------------------------------------------------------------------------------------------
    def _static_arguments(self, args: tuple, kwargs: dict):
        def tensor(path, t):
            with torch.inference_mode(False), torch.no_grad():
                static = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            static.copy_(t)
            self.static_inputs.append(static)
            return static

        return tree_map((args, kwargs), tensor)

    def capture(self, fn: Callable, args: tuple, kwargs: dict):
        """The capture pass: returns the forward's output (private copies)."""
        self.backend.prepare()
        static_args, static_kwargs = self._static_arguments(args, kwargs)
        self.tracer = SegmentTracer(self, self.break_kinds) if self.traced else None
        with self.backend.side_stream():
            self._open_segment()
            try:
                if self.tracer is not None:
                    with self.tracer:
                        out = fn(*static_args, **static_kwargs)
                else:
                    out = fn(*static_args, **static_kwargs)
                self._close_segment()
            except BaseException:
                if self._open is not None:
                    self.backend.abort(self._open)
                raise
        self.tracer = None
        self.output = out
        if any(kind == "object" for _, kind, _ in tree_leaves(out)):
            raise CaptureError("the forward returned a Python object; a graph returns tensors")
        return clone_tensors(out)

    def replay(self, args: tuple, kwargs: dict):
        """Copy the call's tensors into the static inputs and replay (its objects match the captured ones: the
        graph's key names their host state and addresses)."""
        new = [t for _, kind, t in tree_leaves((args, kwargs)) if kind == "tensor"]
        for static, t in zip(self.static_inputs, new):
            static.copy_(t)
        for step in self.steps:
            if step[0] == "segment":
                self.backend.replay(step[1])
            else:
                _, brk, static = step
                copy_into(static, brk.invoke(), brk.name)
        return clone_tensors(self.output)

    # -- what the capture did ---------------------------------------------------------------------------------------
    @property
    def segments(self) -> list:
        return [s[1] for s in self.steps if s[0] == "segment"]

    @property
    def breaks(self) -> list[BreakCall]:
        return [s[1] for s in self.steps if s[0] == "break"]


__all__ = [
    "BreakCall",
    "CaptureSession",
    "CaptureError",
    "CudaSegments",
    "DATA_DEPENDENT",
    "DrySegments",
    "StaleGraphError",
    "SegmentTracer",
    "function_break_kind",
    "tree_leaves",
    "tree_map",
]
