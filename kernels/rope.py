"""RoPE application: the PyTorch reference (the Triton version is in ``triton_kernels``, same signature).

The engine's multi-axis RoPE (``engine/rope.py``) folds its axes (Wan: frame, row, column; FLUX: index, row,
column) into one table of angles per token, so applying it is the same for any number of axes: rotate the
adjacent pairs ``(x[2i], x[2i + 1])`` by ``cos[i], sin[i]``, in the tables' precision (float64 for Wan, float32
for FLUX), and cast back to ``x``'s dtype.
"""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, L, H, D]`` by ``cos, sin [B or 1, L, 1, D // 2]`` (broadcast over heads)."""
    xf = x.to(cos.dtype).unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out0 = cos * x0 - sin * x1
    out1 = sin * x0 + cos * x1
    return torch.stack((out0, out1), dim=-1).flatten(-2).to(x.dtype)
