"""The single-process softmax attention and its backends (a run picks one: ``engine.backends.Backends``).

Shapes everywhere in the engine are ``[batch, tokens, heads, head_dim]`` (the flash-attn layout), in and out.
Layers never call this module directly: they call ``backends.attention(...)``, which adds the run's
sequence-parallel exchange around :func:`local_attention` with the run's backend.

Memory layout is a separate choice, per backend and device (:func:`reads_head_major`): PyTorch's SDPA kernels take
``[B, H, L, D]`` and the CPU one runs 1.04-1.08x faster when those are contiguous (``bench/attention_layout.py``)
than on transposed views of ``[B, L, H, D]`` tensors; flash-attn takes ``[B, L, H, D]`` itself. So where q, k and
v are made (RoPE, the text/image concatenation, the causal KV cache's buffers and the session pool's gather of
them, the cross-attention cache) they are written head-major in memory, their shape unchanged, and
:func:`local_attention` copies only what still arrives otherwise (a value projection's view: O(L) against the
kernel's O(L^2)). On CUDA, SDPA gains nothing from it (an H200: 0.93-0.98x at FLUX.1 1024 px, 1.00-1.01x for a
Wan causal chunk), so there the tensors keep the layout they are made in. See docs/attention.md.

Backends:
  * ``sdpa``      torch.nn.functional.scaled_dot_product_attention (always available, always tested);
  * ``flash-attn`` flash_attn.flash_attn_func, used only on CUDA with fp16/bf16 inputs and no mask;
  * ``auto``       flash-attn when it is importable and the inputs qualify, else sdpa.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from ..kernels.rope import head_major_empty
from .errors import InputError

BACKENDS = ("auto", "sdpa", "flash-attn")


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
            "pip install flash-attn); choose 'sdpa' or 'auto'",
        )
    return backend


# Devices whose SDPA reads head-major ``[B, H, L, D]`` inputs faster than transposed views (bench/attention_layout.py;
# CUDA: bench/device/checks.py). Elsewhere the inputs are passed as they come.
SDPA_HEAD_MAJOR_DEVICES = frozenset({"cpu"})


def reads_head_major(backend: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> bool:
    """Whether attention with ``backend`` over tensors like ``x`` (on its device, in its dtype) reads its q, k and v
    fastest laid out head-major: SDPA on :data:`SDPA_HEAD_MAJOR_DEVICES`, never flash-attn."""
    # the device first: a plain attribute test that torch.compile traces without a break (the flash-attn probe
    # behind _flash_qualifies is not, and on the CPU flash-attn never qualifies anyway)
    if backend == "flash-attn" or x.device.type not in SDPA_HEAD_MAJOR_DEVICES:
        return False
    return not (backend == "auto" and _flash_qualifies(x, mask))


def as_head_major(x: torch.Tensor) -> torch.Tensor:
    """``x [B, L, H, D]`` laid out head-major (a copy unless it already is; same shape and values)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def cat_tokens(parts: tuple[torch.Tensor, ...], head_major: bool) -> torch.Tensor:
    """``torch.cat(parts, dim=1)`` of ``[B, L_i, H, D]`` tensors, written head-major when ``head_major`` (the same
    single copy: FLUX's joint attention concatenates its text and image values anyway)."""
    if (
        not head_major or torch.compiler.is_compiling()
    ):  # compiled: out= breaks the graph, the copy fuses anyway
        return torch.cat(parts, dim=1)
    first = parts[0]
    shape = (first.shape[0], sum(p.shape[1] for p in parts), *first.shape[2:])
    return torch.cat(parts, dim=1, out=head_major_empty(first, shape))


def gather_rows(x: torch.Tensor, index: torch.Tensor, head_major: bool) -> torch.Tensor:
    """``x.index_select(0, index)`` of ``x [N, L, H, D]``, written head-major when ``head_major`` (the same single
    copy: a session pool gathers its batch rows' KV windows anyway)."""
    if not head_major or torch.compiler.is_compiling():
        return x.index_select(0, index)
    shape = (index.numel(), *x.shape[1:])
    return torch.index_select(x, 0, index, out=head_major_empty(x, shape))


def _flash_qualifies(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    return (
        mask is None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and flash_attn_available()
    )


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Softmax attention, ``q [B, Lq, H, D]``, ``k, v [B, Lk, H, D]`` -> ``[B, Lq, H, D]``, with ``backend``.
    ``mask``: boolean, True = may attend."""
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
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    # no-ops for the inputs made head-major (the module docstring); one pass over the others
    if q.device.type in SDPA_HEAD_MAJOR_DEVICES:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
