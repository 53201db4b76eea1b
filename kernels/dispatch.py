"""The dispatcher: each kernel's Triton version on CUDA, its PyTorch reference elsewhere.

Every kernel function takes the mode as an argument (``mode=``): it is a per-run choice the engine's
``Backends`` object carries (``engine/backends.py``), never a process-wide switch. The modes:

* ``auto`` (default): Triton when the inputs are CUDA tensors, Triton is importable, the kernel handles the
  shapes and autograd is not recording; the reference otherwise. A kernel that raises (a Triton compile error on
  an untested GPU, say) is replaced by its reference for the rest of the *run*: the run's :class:`KernelFallbacks`
  (``Backends.kernel_fallbacks``, made afresh by each ``open_run``) records it, so the next run tries the kernel
  again (a failure caused by one run's shapes does not switch it off for the process). The first failure of a
  kernel is logged as a warning once per process; later runs that fall back the same way log it at debug level.
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


class KernelFallbacks:
    """The kernels that raised in auto mode during one run, with why: that run uses their references from then on.

    One object per run (``engine.run.open_run`` builds the run's ``Backends`` with a new one), so the decision is
    the run's, never the process's. It is a record, not a setting: nothing but the dispatcher writes it."""

    def __init__(self):
        self.failed: dict[
            str, str
        ] = {}  # kernel name -> "ErrorType: message" of its first failure in the run

    def __contains__(self, kernel: str) -> bool:
        return kernel in self.failed

    def __repr__(self) -> str:
        return f"KernelFallbacks({sorted(self.failed)})"

    def capture_state(self) -> tuple:
        """What a captured forward (a CUDA graph) decided on: which kernels ran as their references."""
        return tuple(sorted(self.failed))

    def notes(self) -> list[str]:
        """One line per kernel that fell back in this run, for a run's report."""
        return [
            f"Triton kernel {k} failed ({why}); this run used its PyTorch reference"
            for k, why in self.failed.items()
        ]


# Kernels whose failure this process has already logged as a warning (a log memo: it decides nothing).
_warned: set[str] = set()


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


def triton_device(tensor: torch.Tensor) -> bool:
    """Whether auto mode would run Triton on ``tensor``'s device (CUDA, Triton importable)."""
    return tensor.is_cuda and triton_importable()


def uses_triton(
    kernel: str, mode: str, *tensors: torch.Tensor | None, fallbacks: KernelFallbacks | None = None
) -> bool:
    """Whether ``kernel`` runs as Triton in ``mode`` for these inputs (the first tensor decides the device);
    ``fallbacks``: the run's record (a kernel that failed in the run is not tried again in it)."""
    if mode == "reference":
        return False
    if mode == "triton":
        return True
    if not triton_device(tensors[0]) or (fallbacks is not None and kernel in fallbacks):
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def _run(kernel: str, mode: str, fallbacks: KernelFallbacks | None, reference, *args):
    op = getattr(load_ops(), kernel)
    if mode == "triton":
        return op(*args)
    try:
        return op(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as err:  # noqa: BLE001  a kernel that cannot run here must not take the engine down
        why = f"{type(err).__name__}: {err}"
        if fallbacks is not None:
            fallbacks.failed.setdefault(kernel, why)
        first = kernel not in _warned
        _warned.add(kernel)
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "Triton kernel %s failed (%s); this run uses its PyTorch reference%s",
            kernel, why, "" if first else " (logged as a warning at its first failure)",
        )  # fmt: skip
        return reference(*args)


# -- the kernels: their references' signatures, plus the mode ------------------------------------------------------
def quantize_kv(
    x: torch.Tensor, bits: int, *, mode: str = "auto", fallbacks: KernelFallbacks | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if uses_triton("quantize_kv", mode, x, fallbacks=fallbacks):
        kv_quant.check_bits(bits, x.shape[-1])
        return _run("quantize_kv", mode, fallbacks, kv_quant.quantize_kv, x, bits)
    return kv_quant.quantize_kv(x, bits)


def dequantize_kv(
    data: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    dtype: torch.dtype,
    *,
    mode: str = "auto",
    fallbacks: KernelFallbacks | None = None,
) -> torch.Tensor:
    if uses_triton("dequantize_kv", mode, data, fallbacks=fallbacks):
        return _run("dequantize_kv", mode, fallbacks, kv_quant.dequantize_kv, data, scale, zero, bits, dtype)
    return kv_quant.dequantize_kv(data, scale, zero, bits, dtype)


def quantized_attention_supported(q: torch.Tensor) -> bool:
    """The fused kernel splits heads into even and odd halves and multiplies them with ``tl.dot`` (K >= 16)."""
    return q.shape[-1] % 2 == 0 and q.shape[-1] >= 32


def uses_fused_quantized_attention(
    q: torch.Tensor, mode: str = "auto", fallbacks: KernelFallbacks | None = None
) -> bool:
    return uses_triton("quantized_attention", mode, q, fallbacks=fallbacks) and (
        mode == "triton" or quantized_attention_supported(q)
    )


def quantized_attention(
    inputs: kv_quant.QuantizedAttentionInputs, *, mode: str = "auto", fallbacks: KernelFallbacks | None = None
) -> torch.Tensor:
    if uses_fused_quantized_attention(inputs.q, mode, fallbacks):
        return _run("quantized_attention", mode, fallbacks, _quantized_attention_reference, *inputs.flat())
    return kv_quant.quantized_attention(inputs)


def _quantized_attention_reference(*flat) -> torch.Tensor:
    """The reference with the op's flat arguments (what ``_run`` falls back to)."""
    return kv_quant.quantized_attention(kv_quant.QuantizedAttentionInputs.from_flat(*flat))


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    mode: str = "auto",
    fallbacks: KernelFallbacks | None = None,
) -> torch.Tensor:
    if uses_triton("rms_norm", mode, x, weight, fallbacks=fallbacks):
        return _run("rms_norm", mode, fallbacks, norms.rms_norm, x, weight, eps)
    return norms.rms_norm(x, weight, eps)


def adaln_modulate(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    *,
    mode: str = "auto",
    fallbacks: KernelFallbacks | None = None,
) -> torch.Tensor:
    if uses_triton("adaln_modulate", mode, x, shift, scale, fallbacks=fallbacks):
        return _run("adaln_modulate", mode, fallbacks, norms.adaln_modulate, x, shift, scale, eps)
    return norms.adaln_modulate(x, shift, scale, eps)


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    mode: str = "auto",
    fallbacks: KernelFallbacks | None = None,
    head_major: bool = False,
) -> torch.Tensor:
    """``head_major``: the result laid out ``[B, H, L, D]`` in memory (``kernels.rope.apply_rope``)."""
    if uses_triton("apply_rope", mode, x, fallbacks=fallbacks) and x.shape[-1] % 2 == 0:
        return _run("apply_rope", mode, fallbacks, rope.apply_rope, x, cos, sin, head_major)
    return rope.apply_rope(x, cos, sin, head_major)
