"""RoPE application: the PyTorch reference (the Triton version is in ``triton_kernels``, same signature).

The engine's multi-axis RoPE (``engine/rope.py``) folds its axes (Wan: frame, row, column; FLUX: index, row,
column) into one table of angles per token, so applying it is the same for any number of axes: rotate the
adjacent pairs ``(x[2i], x[2i + 1])`` by ``cos[i], sin[i]``, in the tables' precision (float32 for Wan and FLUX),
and cast back to ``x``'s dtype.

The pairs are rotated as one complex multiply, ``(x0 + i x1) * (cos + i sin)``, on a complex view of ``x``: a
single elementwise pass that writes the interleaved output directly (no per-half tensors stacked and flattened
afterwards; ~10x faster on the CPU for Wan's ``[1, 2304, 12, 128]`` float32 keys, ``bench/rope.py``). PyTorch's
CPU kernels compute the complex product as ``x0 cos - x1 sin, x0 sin + x1 cos`` without fused multiply-adds, so
it equals the two-real-halves formulation bit for bit (``tests/kernels/test_kernels.py`` asserts it). The real
formulation stays where that has not been verified or does not pay: on other devices (CUDA runs the Triton
kernel, which ``bench/device/checks.py`` compares to this reference exactly), under ``torch.compile`` (the
compiler fuses it into one kernel and has no complex code generation) and for 16-bit tables (no complex type).
"""

from __future__ import annotations

import torch


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_major: bool = False
) -> torch.Tensor:
    """Rotate ``x [B, L, H, D]`` by ``cos, sin [B or 1, L, 1, D // 2]`` (broadcast over heads).

    ``head_major``: lay the result out in memory as ``[B, H, L, D]`` (its shape stays ``[B, L, H, D]``; its
    ``transpose(1, 2)`` is contiguous), the layout PyTorch's SDPA kernels read fastest (``engine.attention``). The
    rotation writes it directly: the same single pass, the same values bit for bit."""
    xf = x.to(cos.dtype)
    if not _complex_path(xf, cos):
        pairs = xf.unflatten(-1, (-1, 2))
        x0, x1 = pairs[..., 0], pairs[..., 1]
        out = torch.stack((cos * x0 - sin * x1, sin * x0 + cos * x1), dim=-1).flatten(-2)
        return (head_major_empty(out).copy_(out) if head_major else out).to(x.dtype)
    pairs = torch.view_as_complex(xf.contiguous().unflatten(-1, (-1, 2)))
    table = torch.complex(cos, sin)  # the table is per token: L * D / 2 values, not per head
    if head_major:
        rotated = torch.mul(pairs, table, out=head_major_empty(pairs))
    else:
        rotated = pairs * table
    return torch.view_as_real(rotated).flatten(-2).to(x.dtype)


def head_major_empty(like: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """An uninitialised tensor of ``like``'s dtype and device and of its shape (or ``shape``) ``[B, L, H, ...]``,
    laid out head-major (``[B, H, L, ...]`` in memory)."""
    b, n, h, *rest = like.shape if shape is None else shape
    return torch.empty((b, h, n, *rest), dtype=like.dtype, device=like.device).transpose(1, 2)


def is_head_major(x: torch.Tensor) -> bool:
    """Whether ``x [B, L, H, D]`` is laid out head-major: ``x.transpose(1, 2)`` is contiguous."""
    return x.transpose(1, 2).is_contiguous()


def _complex_path(xf: torch.Tensor, cos: torch.Tensor) -> bool:
    return (
        xf.device.type == "cpu"
        and cos.dtype in (torch.float32, torch.float64)
        and not torch.compiler.is_compiling()
    )
