"""``compile_model``: torch.compile applied to a model without changing it.

* **regional** (default): the repeated block is compiled, once per block class, and every block of the stack
  runs through that compiled code. torch.compile inlines module calls and lifts a module's parameters to graph
  inputs (torch >= 2.5), so the graph of ``DoubleStreamBlock.forward`` compiled for block 0 is the graph of
  every other double-stream block: compile time is that of one block per class (FLUX.1 and FLUX.2: two
  classes, Wan: one), not of the whole model, and it does not grow with depth. Z-Image has one block class
  in three stacks that call it three ways (noise refiner, context refiner, layers): one compiled function per
  stack (:func:`caller_names`), so three block graphs and no recompiles. Embedding, the FLUX.2 shared
  modulation and the head stay eager (they run once per forward).
* **full**: the whole forward as one compiled callable (longer compile, no Python between blocks).

A causal Wan step (a forward given a KV cache) is traced whole, attend included, in both modes: the cache's
per-chunk state is device tensors of fixed shapes, and a layer's view holds that layer's tensors (no index, no
guard per layer). The one host flag a step branches on, the window filling (masked) or full (unmasked), picks
the entry point (:func:`step_phase`): ``causal_step_filling`` / ``causal_step_full`` in full mode,
``compiled_<Class>_filling`` / ``_full`` in regional mode, each a code object of its own that compiles once, so
a stream past its window compiles two frames and recompiles none.

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
from ..models.registry import FAMILIES, Family
from .options import CompileConfig

log = logging.getLogger(__name__)

_compile_lock = threading.Lock()


def _block_caller(name: str):
    """A function calling a block, with a code object of its own (its own dynamo cache and telemetry name)."""

    def call(block, *args, **kwargs):
        return block(*args, **kwargs)

    call.__code__ = call.__code__.replace(co_name=name)
    call.__name__ = call.__qualname__ = name
    return call


def step_phase(kv) -> str | None:
    """The compiled entry point a forward takes, from its causal KV cache (``kv``: the cache, or one layer's view
    of it): None without one, ``"filling"`` while the window fills (masked attention), ``"full"`` once every slot
    is visible (unmasked: the path flash-attn and the fused int8 kernel take). Each phase is a code object of its
    own (:func:`_block_caller`), so each compiles once and the masked-to-unmasked transition of a stream is a
    second compiled frame, never a recompile (the host flag the step branches on is a guard of one code object
    only). The one place the choice is made, for ``full`` and ``regional`` mode alike. A ``kv`` without
    ``key_mask()`` (a reference's masked prefix) takes the masked entry."""
    if kv is None:
        return None
    key_mask = getattr(kv, "key_mask", None)
    return "full" if callable(key_mask) and key_mask() is None else "filling"


class CompiledBlock(nn.Module):
    """A block of the view: the shared block object, called through its class's compiled function.

    Attributes the block has (``img_mod``, ``cross_attn``...) are read through, so code that inspects a block
    (a TeaCache probe) sees the block."""

    def __init__(self, block: nn.Module, call):
        super().__init__()
        self.block = block
        self._call = call  # call(phase) -> the compiled function for that phase (see step_phase)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["block"], name)

    def forward(self, *args, **kwargs):
        return self._call(step_phase(kwargs.get("kv")))(self.block, *args, **kwargs)


def repeated_block_lists(model: nn.Module) -> list[str]:
    """Names of the model's block stacks: its ``nn.ModuleList`` children (FLUX.1 / FLUX.2: double_blocks,
    single_blocks; Z-Image: noise_refiner, context_refiner, layers; Wan: blocks)."""
    return [name for name, child in model.named_children() if isinstance(child, nn.ModuleList) and len(child)]


def model_view(model: nn.Module, wrap) -> nn.Module:
    """A shallow copy of ``model`` (same class, same parameters, buffers and submodules) whose block lists
    hold ``wrap(block, stack)`` for each block (``stack``: the list's name). ``model`` is not changed."""
    view = copy.copy(
        model
    )  # the instance dict is copied; its values (parameter tables, submodules) are shared
    modules = dict(model._modules)
    for name in repeated_block_lists(model):
        modules[name] = nn.ModuleList(wrap(block, name) for block in model._modules[name])
    view.__dict__["_modules"] = modules
    return view


def caller_names(model: nn.Module) -> dict[tuple[type, str], str]:
    """The compiled function of each (block class, stack): ``compiled_<Class>``, one per class, which every block
    of the class reuses. A class that several stacks call differently gets one function per stack,
    ``compiled_<Class>_<stack>``: Z-Image's refiners are its layer class called three ways (modulated on the
    image tokens, unmodulated on the caption, modulated on both with a replicated caption prefix). Through one
    function each call form would fail the previous one's guards and recompile it (three graphs, two reported
    recompiles, and a shared recompile limit); through one function per stack each is compiled once, with no
    recompile, and the compile time is the same three block graphs."""
    stacks: dict[type, list[str]] = {}
    for name in repeated_block_lists(model):
        for block in model._modules[name]:
            names = stacks.setdefault(type(block), [])
            if name not in names:
                names.append(name)
    return {
        (cls, stack): f"compiled_{cls.__name__}" if len(names) == 1 else f"compiled_{cls.__name__}_{stack}"
        for cls, names in stacks.items()
        for stack in names
    }


def family_spec(model: nn.Module) -> Family | None:
    """The registry family of ``model`` (None for a model outside the registry: a test double, a callable)."""
    return FAMILIES.get(getattr(type(model), "family", None))


def image_tokens(family: Family | None, first_input) -> tuple | None:
    """The shape a bucket is compared with, from the forward's first input (FLUX.1 ``img``, FLUX.2 / Z-Image /
    Wan ``x``): an image family's image tokens (sizes with as many tokens share compiled code and graphs),
    read from packed tokens ``[B, L, C]`` (FLUX.1, FLUX.2) or from a latent ``[B, C, H, W]`` (Z-Image, which
    packs its patches inside the forward); a video family's latent (height, width)."""
    if family is None or not isinstance(first_input, torch.Tensor):
        return None
    if family.is_image:
        if first_input.ndim == 3:
            return (int(first_input.shape[1]),)
        if first_input.ndim == 4:
            return (family.image.image_tokens(int(first_input.shape[-2]), int(first_input.shape[-1])),)
        return None
    return tuple(int(s) for s in first_input.shape[-2:])


def bucket_shapes(family: Family, buckets) -> set[tuple]:
    """Bucket sizes (width, height px) as :func:`image_tokens` gives them, through the family's latent
    downscale (FLUX.1, Z-Image, Wan: 8; FLUX.2: 16) and its token patch (ImageSpec.token_patch)."""
    out = set()
    down = family.latent_format.downscale
    for w, h in buckets or ():
        lh, lw = h // down, w // down
        out.add((family.image.image_tokens(lh, lw),) if family.is_image else (lh, lw))
    return out


class BucketCheck:
    """``check(*args, **kwargs)`` of a forward call: why its shape is outside the buckets (None: inside)."""

    def __init__(self, model: nn.Module, buckets):
        self.family = family_spec(model)
        self.shapes = bucket_shapes(self.family, buckets) if self.family is not None else set()
        self.signature = inspect.signature(model.forward)
        self.first_input = next(iter(self.signature.parameters))

    def __call__(self, *args, **kwargs) -> str | None:
        bound = self.signature.bind_partial(*args, **kwargs)
        shape = image_tokens(self.family, bound.arguments.get(self.first_input))
        if shape is None or shape in self.shapes:
            return None
        what = "image tokens" if self.family.is_image else "latent height x width"
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
        fullgraph: bool = False,
    ):
        # mode, backend and buckets come checked: from the CompileConfig its maker built (compile_model, or
        # the compile feature), which checks them once, when it is built
        self.model = model
        self.mode = mode
        self.dynamic = dynamic
        self.backend = backend
        self.fullgraph = fullgraph  # a graph break raises (the tests' check that a step is one graph)
        self.family = getattr(type(model), "family", None)
        self.bucket_problem = BucketCheck(model, buckets) if buckets else None
        self._view: nn.Module | None = None
        self._full = None
        self._callers: dict[str, object] = {}  # compiled functions by code name
        self.notes: list[str] = []

    # -- the compiled pieces (built on first use) ------------------------------------------------------------------
    def _torch_compile(self, fn):
        return torch.compile(fn, backend=self.backend, dynamic=self.dynamic, fullgraph=self.fullgraph)

    def _caller(self, name: str):
        """The compiled function named ``name`` (a code object of its own), made once. Called for every block of
        every forward: the lock is taken only to make a missing one."""
        fn = self._callers.get(name)
        if fn is None:
            with _compile_lock:
                fn = self._callers.get(name)
                if fn is None:
                    fn = self._callers[name] = self._torch_compile(_block_caller(name))
        return fn

    def _wrap_block(self, block: nn.Module, stack: str, names: dict) -> CompiledBlock:
        base = names[(type(block), stack)]

        def call(phase: str | None):
            return self._caller(base if phase is None else f"{base}_{phase}")

        return CompiledBlock(block, call)

    @property
    def view(self) -> nn.Module:
        """The model with compiled blocks (shares everything else with the model)."""
        with _compile_lock:
            if self._view is None:
                names = caller_names(self.model)
                self._view = model_view(
                    self.model, lambda block, stack: self._wrap_block(block, stack, names)
                )
        return self._view

    @property
    def full(self):
        """The whole forward compiled (a forward without a causal KV cache)."""
        with _compile_lock:
            if self._full is None:
                self._full = self._torch_compile(self.model)
        return self._full

    def step(self, phase: str):
        """The whole forward of a causal step in ``phase`` (:func:`step_phase`), compiled as
        ``causal_step_<phase>``: called as ``step(phase)(model, *args, **kwargs)``."""
        return self._caller(f"causal_step_{phase}")

    # -- calls -----------------------------------------------------------------------------------------------------
    def __call__(self, *args, block_runner=None, **kwargs):
        if not self.dynamic and self.bucket_problem is not None and self.bucket_problem(*args, **kwargs):
            # static shapes: a size outside the buckets would compile one more graph; run it uncompiled
            return self.model(*args, block_runner=block_runner, **kwargs)
        if self.mode == "regional" or block_runner is not None:
            # a block runner (a step cache) decides between blocks in Python: blocks compiled, the stack not
            return self.view(*args, block_runner=block_runner, **kwargs)
        phase = step_phase(kwargs.get("kv"))
        if phase is None:
            return self.full(*args, **kwargs)
        return self.step(phase)(self.model, *args, **kwargs)

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
    fullgraph: bool = False,
) -> CompiledModel:
    """The model's forward compiled without changing the model (see the module docstring).

    ``buckets``: image sizes (width, height px) expected; see :class:`~.options.CompileConfig`. Raises
    :class:`~..errors.InputError` for an unknown mode or backend, or a torch too old for regional reuse.
    ``fullgraph``: a graph break raises instead of splitting the graph."""
    config = CompileConfig(mode=mode, dynamic=dynamic, buckets=buckets, backend=backend)  # the input checks
    if config.mode == "off":
        raise InputError("compile", "mode 'off' compiles nothing: call the model itself")
    return CompiledModel(model, config.mode, config.dynamic, config.buckets, config.backend, fullgraph)


__all__ = [
    "BucketCheck",
    "CompiledBlock",
    "caller_names",
    "CompiledModel",
    "compile_model",
    "model_view",
    "repeated_block_lists",
    "step_phase",
]
