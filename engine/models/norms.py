"""The RMS norm with a learnt ``weight`` that Wan (q/k norms over the whole width) and Z-Image (every norm but the
final layer's) share; FLUX's q/k norm names its weight ``scale`` (``flux_layers.RMSNorm``), a checkpoint key."""

from __future__ import annotations

import torch
from torch import nn

from ..backends import Backends


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension, computed by the run's backends (statistics in float32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, backends: Backends) -> torch.Tensor:
        return backends.rms_norm(x, self.weight, self.eps)
