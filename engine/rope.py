"""Multi-axis rotary position embedding (RoPE).

Each token carries integer positions along several axes (FLUX: text-or-image index, row, column; Wan: frame,
row, column). The head dimension is split between the axes (``axes_dim``, each even); every axis rotates its
share of the head in adjacent pairs ``(x[2i], x[2i+1])`` by ``position * theta ** (-2i / axis_dim)``.

Frequencies are computed in float32 and the rotation is applied in float32, as the reference implementations
do, then cast back to the activation dtype.
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
    ids: torch.Tensor, axes_dim: tuple[int, ...], theta: float, dtype: torch.dtype = torch.float32
) -> RopeFreqs:
    """``ids [B, L, n_axes]`` (positions) -> rotations for a ``sum(axes_dim)``-wide head.

    ``dtype`` is the precision of the angles and of the rotation itself: float32 for FLUX, float64 for Wan
    (as each reference computes it).
    """
    if ids.shape[-1] != len(axes_dim):
        raise ValueError(f"position ids have {ids.shape[-1]} axes, RoPE is configured for {len(axes_dim)}")
    ids = ids.to(dtype)
    angles = torch.cat([axis_angles(ids[..., i], d, theta) for i, d in enumerate(axes_dim)], dim=-1)
    angles = angles.to(dtype).unsqueeze(2)
    return RopeFreqs(torch.cos(angles), torch.sin(angles))


def apply_rope(x: torch.Tensor, freqs: RopeFreqs, mode: str = "auto") -> torch.Tensor:
    """Rotate ``x [B, L, H, D]`` by ``freqs`` (broadcast over heads), in the precision of ``freqs``.

    Through the kernel dispatcher in ``mode`` (a run's ``Backends.apply_rope`` passes its own): the Triton kernel
    on CUDA, ``kernels.rope.apply_rope`` elsewhere."""
    return kernels.apply_rope(x, freqs.cos, freqs.sin, mode=mode)
