"""The dispatcher: each kernel's Triton version on CUDA, its PyTorch reference elsewhere.

Every kernel function takes the mode as an argument (``mode=``): it is a per-run choice the engine's
``Backends`` object carries (``engine/backends.py``), never a process-wide switch. The modes:

* ``auto`` (default): Triton when the inputs are CUDA tensors, Triton is importable, the kernel handles the
  shapes and autograd is not recording; the reference otherwise. A kernel that raises (a Triton compile error on
  an untested GPU, say) is logged once and replaced by its reference for the rest of the process.
* ``reference``: always the PyTorch references.
* ``triton``: always the Triton kernels, on any device, errors raised. On the CPU this needs Triton's interpreter
  (:func:`enable_triton_interpreter`, or ``TRITON_INTERPRET=1`` before the kernels are first used); the tests
  run the engine this way.

``FEWSTEP_KERNELS`` (what a run uses when its options name no mode) is read by the engine's ``open_run``.

The Triton kernels are called through their ``torch.library`` custom ops (``ops``), so ``torch.compile`` keeps
each one as a single opaque node.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os

import torch

from . import kv_quant, norms, rope

log = logging.getLogger(__name__)

MODES = ("auto", "reference", "triton")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown kernel mode {mode!r}; expected one of {', '.join(MODES)}")
    return mode


# Kernels that raised in auto mode, for the rest of the process: a memo of what this GPU cannot run (the same
# for every run), not a setting.
_failed: set[str] = set()


@functools.cache
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def load_triton_kernels():
    """The ``triton_kernels`` module, (re)imported so that it matches the current ``TRITON_INTERPRET``."""
    from triton import knobs

    from . import triton_kernels

    interpreted = type(triton_kernels._rms_norm_kernel).__name__ == "InterpretedFunction"
    if interpreted != bool(knobs.runtime.interpret):
        triton_kernels = importlib.reload(triton_kernels)
    return triton_kernels


def enable_triton_interpreter() -> None:
    """Run the Triton kernels through Triton's interpreter from now on (any device: the tests use it on the CPU)."""
    os.environ["TRITON_INTERPRET"] = "1"
    load_triton_kernels()


def load_ops():
    from . import ops

    return ops


def uses_triton(kernel: str, mode: str, *tensors: torch.Tensor | None) -> bool:
    """Whether ``kernel`` runs as Triton in ``mode`` for these inputs (the first tensor decides the device)."""
    if mode == "reference":
        return False
    if mode == "triton":
        return True
    first = tensors[0]
    if not (first.is_cuda and triton_importable()) or kernel in _failed:
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def _run(kernel: str, mode: str, reference, *args):
    op = getattr(load_ops(), kernel)
    if mode == "triton":
        return op(*args)
    try:
        return op(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as err:  # noqa: BLE001  a kernel that cannot run here must not take the engine down
        log.warning(
            "Triton kernel %s failed (%s: %s); using its PyTorch reference", kernel, type(err).__name__, err
        )
        _failed.add(kernel)
        return reference(*args)


# -- the kernels: their references' signatures, plus the mode ------------------------------------------------------
def quantize_kv(
    x: torch.Tensor, bits: int, *, mode: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if uses_triton("quantize_kv", mode, x):
        kv_quant.check_bits(bits, x.shape[-1])
        return _run("quantize_kv", mode, kv_quant.quantize_kv, x, bits)
    return kv_quant.quantize_kv(x, bits)


def dequantize_kv(
    data: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    dtype: torch.dtype,
    *,
    mode: str = "auto",
) -> torch.Tensor:
    if uses_triton("dequantize_kv", mode, data):
        return _run("dequantize_kv", mode, kv_quant.dequantize_kv, data, scale, zero, bits, dtype)
    return kv_quant.dequantize_kv(data, scale, zero, bits, dtype)


def quantized_attention_supported(q: torch.Tensor) -> bool:
    """The fused kernel splits heads into even and odd halves and multiplies them with ``tl.dot`` (K >= 16)."""
    return q.shape[-1] % 2 == 0 and q.shape[-1] >= 32


def uses_fused_quantized_attention(q: torch.Tensor, mode: str = "auto") -> bool:
    return uses_triton("quantized_attention", mode, q) and (
        mode == "triton" or quantized_attention_supported(q)
    )


def quantized_attention(inputs: kv_quant.QuantizedAttentionInputs, *, mode: str = "auto") -> torch.Tensor:
    if uses_fused_quantized_attention(inputs.q, mode):
        return _run("quantized_attention", mode, _quantized_attention_reference, *inputs.flat())
    return kv_quant.quantized_attention(inputs)


def _quantized_attention_reference(*flat) -> torch.Tensor:
    """The reference with the op's flat arguments (what ``_run`` falls back to)."""
    return kv_quant.quantized_attention(kv_quant.QuantizedAttentionInputs.from_flat(*flat))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, mode: str = "auto") -> torch.Tensor:
    if uses_triton("rms_norm", mode, x, weight):
        return _run("rms_norm", mode, norms.rms_norm, x, weight, eps)
    return norms.rms_norm(x, weight, eps)


def adaln_modulate(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, *, mode: str = "auto"
) -> torch.Tensor:
    if uses_triton("adaln_modulate", mode, x, shift, scale):
        return _run("adaln_modulate", mode, norms.adaln_modulate, x, shift, scale, eps)
    return norms.adaln_modulate(x, shift, scale, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, mode: str = "auto") -> torch.Tensor:
    if uses_triton("apply_rope", mode, x) and x.shape[-1] % 2 == 0:
        return _run("apply_rope", mode, rope.apply_rope, x, cos, sin)
    return rope.apply_rope(x, cos, sin)
