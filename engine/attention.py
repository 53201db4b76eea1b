"""The single-process softmax attention and its backends (a run picks one: ``engine.backends.Backends``).

Layout everywhere in the engine is ``[batch, tokens, heads, head_dim]`` (the flash-attn and KV-cache layout),
in and out. Layers never call this module directly: they call ``backends.attention(...)``, which adds the
run's sequence-parallel exchange around :func:`local_attention` with the run's backend.

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
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
    )
    return out.transpose(1, 2)
