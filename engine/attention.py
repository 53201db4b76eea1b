"""The one attention entry point every model calls.

Layout everywhere in the engine is ``[batch, tokens, heads, head_dim]`` (the flash-attn and KV-cache layout),
in and out. The backend is a *setting* (a context variable), never a monkeypatch: ``use_attention_backend``
scopes it to a block of code, so two models in one process can run different backends.

Backends:
  * ``sdpa``      torch.nn.functional.scaled_dot_product_attention (always available, always tested);
  * ``flash-attn`` flash_attn.flash_attn_func, used only on CUDA with fp16/bf16 inputs and no mask;
  * ``auto``       flash-attn when it is importable and the inputs qualify, else sdpa.
This module is also the place where the KV cache, sequence parallelism and Triton kernels hook in.

Sequence parallelism (``engine.parallel``) hooks in as a second scoped setting: inside
``use_parallel_attention(plan)`` every call runs ``plan.attention(...)``, which exchanges the sharded tokens with
the other ranks (Ulysses all-to-all, ring K/V passing) around the same local attention. Callers say which tokens
every rank holds whole: ``replicated_prefix`` leading tokens of q, k and v (FLUX's text tokens), or all of k and
v (``replicated_kv``: Wan's cross-attention to the prompt, which needs no communication). Outside such a scope
both are ignored and the call is the single-process attention, unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import threading

import torch
import torch.nn.functional as F

from .errors import InputError

BACKENDS = ("auto", "sdpa", "flash-attn")


class _ThreadSetting(threading.local):
    """A per-thread setting with ContextVar's ``get`` / ``set`` -> token / ``reset(token)``.

    Not a ContextVar: torch.compile cannot trace ``ContextVar.get`` and breaks the graph at every attention call
    (a compiled block then runs as 3 graphs, with extra recompiles on strides); a thread-local attribute is read
    during tracing and guarded, so a compiled block stays one graph and recompiles when the setting changes."""

    def __init__(self, default):
        self.value = default

    def get(self):
        return self.value

    def set(self, value):
        token, self.value = self.value, value
        return token

    def reset(self, token) -> None:
        self.value = token


_backend = _ThreadSetting("auto")
_parallel = _ThreadSetting(None)


@functools.cache
def flash_attn_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def check_backend(backend: str, input_name: str = "attention") -> str:
    if backend not in BACKENDS:
        raise InputError(
            input_name, f"unknown attention backend {backend!r}; expected one of {', '.join(BACKENDS)}"
        )
    if backend == "flash-attn" and not flash_attn_available():
        raise InputError(
            input_name,
            "flash-attn was requested but is not usable here (needs a CUDA GPU and the flash_attn package: "
            "pip install 'comfyui-fewstep[gpu]'); choose 'sdpa' or 'auto'",
        )
    return backend


@contextlib.contextmanager
def use_attention_backend(backend: str):
    """Run the enclosed code with ``backend`` as the attention backend."""
    token = _backend.set(check_backend(backend))
    try:
        yield
    finally:
        _backend.reset(token)


def current_backend() -> str:
    return _backend.get()


@contextlib.contextmanager
def use_parallel_attention(plan):
    """Run the enclosed attention calls through ``plan.attention`` (sequence parallelism; None: single process).

    ``plan.attention(q, k, v, mask=..., replicated_prefix=..., local=...)`` receives this rank's shard of the
    sequence and ``local``, the single-process attention, to run between its collectives.
    """
    token = _parallel.set(plan)
    try:
        yield
    finally:
        _parallel.reset(token)


def current_parallel_plan():
    return _parallel.get()


def _flash_qualifies(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    return (
        mask is None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and flash_attn_available()
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    replicated_prefix: int = 0,
    replicated_kv: bool = False,
) -> torch.Tensor:
    """Softmax attention. ``q [B, Lq, H, D]``, ``k, v [B, Lk, H, D]`` -> ``[B, Lq, H, D]``.

    ``mask`` is a boolean ``[Lq, Lk]`` (or broadcastable to ``[B, H, Lq, Lk]``) where True means *may attend*.
    Under sequence parallelism (see the module docstring) q, k and v are this rank's shard of the sequence,
    except the first ``replicated_prefix`` tokens, which every rank holds whole, or all of k and v when
    ``replicated_kv``; without a parallel plan both are ignored.
    """
    plan = _parallel.get()
    if plan is not None and not replicated_kv:
        return plan.attention(q, k, v, mask=mask, replicated_prefix=replicated_prefix, local=local_attention)
    return local_attention(q, k, v, mask=mask)


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The single-process attention of the current backend (what :func:`attention` runs without a plan)."""
    backend = _backend.get()
    if backend == "flash-attn" or (backend == "auto" and _flash_qualifies(q, mask)):
        if _flash_qualifies(q, mask):
            from flash_attn import flash_attn_func

            return flash_attn_func(q, k, v)
        if backend == "flash-attn":
            raise InputError(
                "attention",
                f"flash-attn needs CUDA fp16/bf16 inputs without a mask (got {q.dtype} on {q.device.type}"
                f"{', with a mask' if mask is not None else ''}); choose 'sdpa' or 'auto'",
            )
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
    )
    return out.transpose(1, 2)
