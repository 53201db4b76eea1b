"""Layers whose stored weight dtype may differ from the compute dtype.

A checkpoint in fp8 stays fp8 in memory (half the bytes of bf16); each layer upcasts its own weight to the
activation dtype at the moment it runs, so at most one layer's weight exists in the compute dtype at a time.
When the stored and compute dtypes agree there is no cast at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))

WEIGHT_DTYPES = {
    "default": None,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3fn": getattr(torch, "float8_e4m3fn", None),
    "fp8_e5m2": getattr(torch, "float8_e5m2", None),
}
COMPUTE_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if t is None or t.dtype == dtype:
        return t
    return t.to(dtype)


class Linear(nn.Linear):
    """``nn.Linear`` that computes in the input's dtype whatever dtype its weight is stored in."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, _cast(self.weight, x.dtype), _cast(self.bias, x.dtype))


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def store_linear_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """Store the weight matrices of every :class:`Linear` in ``dtype`` (biases and norms keep theirs)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.weight.data = module.weight.data.to(dtype)


def weight_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())
