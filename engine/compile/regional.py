"""``compile_model``: torch.compile applied to a model without changing it.

* **regional** (default): the repeated block is compiled, once per block class, and every block of the stack
  runs through that compiled code. torch.compile inlines module calls and lifts a module's parameters to graph
  inputs (torch >= 2.5), so the graph of ``DoubleStreamBlock.forward`` compiled for block 0 is the graph of
  every other double-stream block: compile time is that of one block per class (FLUX: two classes, Wan: one),
  not of the whole model, and it does not grow with depth. Embedding and head stay eager (they run once).
* **full**: the whole forward as one compiled callable (longer compile, no Python between blocks).

The model object is shared, never written to. Regional compilation works on a *view*: a shallow copy of the
model's top-level module whose block lists hold small wrappers around the same block objects, so it shares
every parameter, buffer and submodule with the model; only the block calls differ. A step cache's block runner
(``forward(..., block_runner=...)``) therefore gets a model whose ``run_blocks`` runs compiled blocks, and its
data-dependent decisions stay in Python between them.

Weights are graph *inputs*, never constants: in-place updates (LoRA merged into the weights, ``load_state_dict``)
are used by the next call without recompiling, and so are replaced parameter objects of the same dtype and
shape. A change of dtype or shape (fp8 storage applied after compiling) fails a guard and recompiles; the run's
telemetry shows that recompile and its reason.

Dynamic shapes (``dynamic=True``, ``torch.compile(dynamic=True)``): the first compilation is already generic in
the token dimensions and in the integers derived from them (FLUX passes the text-token count to its blocks), so
other prompt lengths and image sizes reuse it; dimensions tied to the weights (hidden sizes) are specialised by
their guards, and sizes 0 and 1 are always specialised (a batch of 1, then a CFG batch of 2, compiles once more).
Marking only the token dimensions (``torch._dynamo.maybe_mark_dynamic``) was measured and not kept: the
text-token count, a Python int, stays specialised and every new prompt length recompiled 3 frames of flux-tiny,
against none here. ``dynamic=False`` specialises every shape (one compilation per shape, the most specialised
kernels); with ``buckets`` only the bucket sizes are compiled and other sizes run uncompiled.
"""

from __future__ import annotations

import copy
import inspect
import logging
import threading

import torch
from torch import nn

from ..errors import InputError
from .capture import tree_leaves
from .options import COMPILE_BACKENDS, COMPILE_MODES, CompileConfig, run_outside_dynamo

log = logging.getLogger(__name__)

_compile_lock = threading.Lock()


def _block_caller(name: str):
    """A function calling a block, with a code object of its own (its own dynamo cache and telemetry name)."""

    def call(block, *args, **kwargs):
        return block(*args, **kwargs)

    call.__code__ = call.__code__.replace(co_name=name)
    call.__name__ = call.__qualname__ = name
    return call


# Object arguments of the engine's forwards whose calls must stay out of compiled graphs: a causal KV cache
# reads and writes through host-side cursors (tokens written, tokens read, ring positions) that change every
# chunk; traced, each new cursor value would fail a guard and recompile.
EAGER_ARGUMENTS = ("kv", "cross_kv")


class EagerCalls:
    """An object argument whose method calls a compiled forward runs eagerly (a graph break): its host state
    is never specialised into guards. Objects its methods return (a KV cache's per-layer view) are wrapped too."""

    def __init__(self, target):
        object.__setattr__(self, "_target", target)

    def __getattr__(self, name: str):
        value = getattr(object.__getattribute__(self, "_target"), name)
        return _EagerMethod(value) if callable(value) else value

    def __repr__(self) -> str:
        return f"EagerCalls({object.__getattribute__(self, '_target')!r})"


class _EagerMethod:
    def __init__(self, method):
        self.method = method

    def __call__(self, *args, **kwargs):
        out = self.method(*args, **kwargs)
        return EagerCalls(out) if _is_plain_object(out) else out


def _is_plain_object(value) -> bool:
    leaves = tree_leaves(value)
    return len(leaves) == 1 and leaves[0][0] == () and leaves[0][1] == "object"


class CompiledBlock(nn.Module):
    """A block of the view: the shared block object, called through its class's compiled function.

    Attributes the block has (``img_mod``, ``cross_attn``...) are read through, so code that inspects a block
    (a TeaCache probe) sees the block."""

    def __init__(self, block: nn.Module, call):
        super().__init__()
        self.block = block
        self._call = call

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["block"], name)

    def forward(self, *args, **kwargs):
        return self._call(self.block, *args, **kwargs)


def repeated_block_lists(model: nn.Module) -> list[str]:
    """Names of the model's block stacks: its ``nn.ModuleList`` children (FLUX: double_blocks, single_blocks;
    Wan: blocks)."""
    return [name for name, child in model.named_children() if isinstance(child, nn.ModuleList) and len(child)]


def model_view(model: nn.Module, wrap) -> nn.Module:
    """A shallow copy of ``model`` (same class, same parameters, buffers and submodules) whose block lists
    hold ``wrap(block)`` for each block. ``model`` is not changed."""
    view = copy.copy(
        model
    )  # the instance dict is copied; its values (parameter tables, submodules) are shared
    modules = dict(model._modules)
    for name in repeated_block_lists(model):
        modules[name] = nn.ModuleList(wrap(block) for block in model._modules[name])
    view.__dict__["_modules"] = modules
    return view


def image_tokens(family: str, bound: inspect.BoundArguments) -> tuple | None:
    """The shape a bucket is compared with: FLUX image tokens; Wan latent (height, width)."""
    args = bound.arguments
    if family == "flux" and isinstance(args.get("img"), torch.Tensor):
        return (int(args["img"].shape[1]),)
    if family == "wan" and isinstance(args.get("x"), torch.Tensor):
        return tuple(int(s) for s in args["x"].shape[-2:])
    return None


def bucket_shapes(family: str, buckets, patch: int = 2) -> set[tuple]:
    """Bucket sizes (width, height px) as :func:`image_tokens` gives them."""
    out = set()
    for w, h in buckets or ():
        lh, lw = h // 8, w // 8
        out.add(((lh // patch) * (lw // patch),) if family == "flux" else (lh, lw))
    return out


class BucketCheck:
    """``check(*args, **kwargs)`` of a forward call: why its shape is outside the buckets (None: inside)."""

    def __init__(self, model: nn.Module, buckets):
        self.family = getattr(type(model), "family", None)
        self.shapes = bucket_shapes(self.family, buckets)
        self.signature = inspect.signature(model.forward)

    def __call__(self, *args, **kwargs) -> str | None:
        bound = self.signature.bind_partial(*args, **kwargs)
        shape = image_tokens(self.family, bound)
        if shape is None or shape in self.shapes:
            return None
        what = "image tokens" if self.family == "flux" else "latent height x width"
        return f"{what} {shape} is not one of the buckets {sorted(self.shapes)}"


class CompiledModel:
    """A model's forward compiled (``regional`` or ``full``), callable like the model.

    ``model(*args, **kwargs)`` semantics are unchanged; ``view`` is the model with compiled blocks (what a
    step cache's block runner is given). Nothing is compiled before the first call.
    """

    def __init__(
        self,
        model: nn.Module,
        mode: str = "regional",
        dynamic: bool = True,
        buckets=None,
        backend: str = "inductor",
    ):
        if mode not in COMPILE_MODES or mode == "off":
            raise ValueError(f"compile mode {mode!r}: expected regional or full")
        if backend not in COMPILE_BACKENDS:
            raise ValueError(f"compile backend {backend!r}: expected one of {', '.join(COMPILE_BACKENDS)}")
        self.model = model
        self.mode = mode
        self.dynamic = dynamic
        self.backend = backend
        self.family = getattr(type(model), "family", None)
        self.bucket_problem = BucketCheck(model, buckets) if buckets else None
        self._view: nn.Module | None = None
        self._full = None
        self._callers: dict[type, object] = {}
        self.notes: list[str] = []

    # -- the compiled pieces (built on first use) ------------------------------------------------------------------
    def _torch_compile(self, fn):
        run_outside_dynamo(EagerCalls, "__getattr__")
        run_outside_dynamo(_EagerMethod, "__call__")
        return torch.compile(fn, backend=self.backend, dynamic=self.dynamic)

    def _wrap_block(self, block: nn.Module) -> CompiledBlock:
        cls = type(block)
        if cls not in self._callers:
            self._callers[cls] = self._torch_compile(_block_caller(f"compiled_{cls.__name__}"))
        return CompiledBlock(block, self._callers[cls])

    @property
    def view(self) -> nn.Module:
        """The model with compiled blocks (shares everything else with the model)."""
        with _compile_lock:
            if self._view is None:
                self._view = model_view(self.model, self._wrap_block)
        return self._view

    @property
    def full(self):
        with _compile_lock:
            if self._full is None:
                self._full = self._torch_compile(self.model)
        return self._full

    # -- calls -----------------------------------------------------------------------------------------------------
    def __call__(self, *args, block_runner=None, **kwargs):
        for name in EAGER_ARGUMENTS:
            if kwargs.get(name) is not None and not isinstance(kwargs[name], EagerCalls):
                kwargs[name] = EagerCalls(kwargs[name])
        if not self.dynamic and self.bucket_problem is not None and self.bucket_problem(*args, **kwargs):
            # static shapes: a size outside the buckets would compile one more graph; run it uncompiled
            return self.model(*args, block_runner=block_runner, **kwargs)
        if self.mode == "regional" or block_runner is not None:
            # a block runner (a step cache) decides between blocks in Python: blocks compiled, the stack not
            return self.view(*args, block_runner=block_runner, **kwargs)
        return self.full(*args, **kwargs)

    def __getattr__(self, name: str):
        # params, num_blocks... read through to the model (family adapters and the denoiser use them)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.model, name)

    def describe(self) -> str:
        return f"{self.mode} ({self.backend}, {'dynamic' if self.dynamic else 'static'} shapes)"


def compile_model(
    model: nn.Module,
    mode: str = "regional",
    dynamic: bool = True,
    buckets=None,
    backend: str = "inductor",
) -> CompiledModel:
    """The model's forward compiled without changing the model (see the module docstring).

    ``buckets``: image sizes (width, height px) expected; see :class:`~.options.CompileConfig`. Raises
    :class:`~..errors.InputError` for an unknown mode or backend, or a torch too old for regional reuse."""
    CompileConfig(mode=mode, dynamic=dynamic, buckets=buckets, backend=backend)  # the input checks
    if mode == "off":
        raise InputError("compile", "mode 'off' compiles nothing: call the model itself")
    return CompiledModel(model, mode, dynamic, buckets, backend)


__all__ = [
    "BucketCheck",
    "CompiledBlock",
    "EAGER_ARGUMENTS",
    "EagerCalls",
    "CompiledModel",
    "compile_model",
    "model_view",
    "repeated_block_lists",
]
