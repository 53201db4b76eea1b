"""Multi-axis rotary position embedding (RoPE).

Each token carries integer positions along several axes (FLUX: text-or-image index, row, column; Wan: frame,
row, column). The head dimension is split between the axes (``axes_dim``, each even); every axis rotates its
share of the head in adjacent pairs ``(x[2i], x[2i+1])`` by ``position * theta ** (-2i / axis_dim)``.

The rotation is applied in float32 (the tables' dtype) and cast back to the activation dtype. The angles are
computed in float32 for FLUX, as its reference does, and in float64 for Wan, whose absolute frame positions grow
without bound in a long stream: the float64 angles are reduced by ``cos`` / ``sin`` before the tables are
rounded to float32, so a table entry is within one float32 rounding of the official float64 rotation at any
position (``tests/engine/models/test_rope_precision.py`` states the measured bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels


@dataclass(frozen=True)
class RopeFreqs:
    """Rotation of every token: ``cos``/``sin`` of shape ``[B, L, 1, head_dim // 2]`` (float32)."""

    cos: torch.Tensor
    sin: torch.Tensor


def axis_angles(pos: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """Angles ``[..., dim // 2]`` for positions ``pos [...]`` along one axis."""
    if dim % 2:
        raise ValueError(f"RoPE axis dimension must be even, got {dim}")
    scale = torch.arange(0, dim, 2, dtype=pos.dtype, device=pos.device) / dim
    omega = 1.0 / (theta**scale)
    return pos[..., None] * omega


def rope_freqs(
    ids: torch.Tensor,
    axes_dim: tuple[int, ...],
    theta: float,
    dtype: torch.dtype = torch.float32,
    angle_dtype: torch.dtype | None = None,
) -> RopeFreqs:
    """``ids [B, L, n_axes]`` (positions) -> rotations for a ``sum(axes_dim)``-wide head.

    ``dtype`` is the precision of the tables and so of the rotation itself; ``angle_dtype`` (default ``dtype``)
    the precision of the angles and of their ``cos`` / ``sin``: float32 / float32 for FLUX, float32 / float64
    for Wan (its reference rotates in float64; float64 angles keep large frame positions exact).
    """
    if ids.shape[-1] != len(axes_dim):
        raise ValueError(f"position ids have {ids.shape[-1]} axes, RoPE is configured for {len(axes_dim)}")
    angle_dtype = angle_dtype or dtype
    ids = ids.to(angle_dtype)
    angles = torch.cat([axis_angles(ids[..., i], d, theta) for i, d in enumerate(axes_dim)], dim=-1)
    angles = angles.to(angle_dtype).unsqueeze(2)
    return RopeFreqs(torch.cos(angles).to(dtype), torch.sin(angles).to(dtype))


def apply_rope(
    x: torch.Tensor, freqs: RopeFreqs, mode: str = "auto", fallbacks=None, head_major: bool = False
) -> torch.Tensor:
    """Rotate ``x [B, L, H, D]`` by ``freqs`` (broadcast over heads), in the precision of ``freqs``.

    Through the kernel dispatcher in ``mode`` (a run's ``Backends.apply_rope`` passes its own): the Triton kernel
    on CUDA, ``kernels.rope.apply_rope`` elsewhere; ``fallbacks``: the run's ``kernels.KernelFallbacks``.
    ``head_major``: the result laid out ``[B, H, L, D]`` in memory, its shape unchanged (``engine.attention``)."""
    return kernels.apply_rope(x, freqs.cos, freqs.sin, mode=mode, fallbacks=fallbacks, head_major=head_major)
