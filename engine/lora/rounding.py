"""Casting a merged float32 weight back to its storage dtype.

16/32-bit storage rounds to nearest (``Tensor.to``). fp8 storage rounds *stochastically*: a LoRA delta is often
far below one fp8 step of the weight it changes (e4m3 keeps 3 mantissa bits, a step of 6-12% of the value), so
rounding to nearest would drop most of it; rounding up with probability equal to the distance from the lower
neighbour keeps the delta in expectation. The generator is seeded from the parameter name, so a merge is
reproducible. ComfyUI rounds fp8 LoRA merges stochastically too.
"""

from __future__ import annotations

import zlib

import torch

from ..ops import is_fp8


def key_seed(key: str) -> int:
    # salted: the dummy presets draw each weight from crc32(name) (engine.weights), and a rounding stream equal to
    # the one that made the weight is correlated with its values (a constant delta came out 36% low)
    return zlib.crc32(f"fewstep.lora.rounding:{key}".encode())


def stochastic_round_fp8(x: torch.Tensor, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``x`` (float32) to fp8 ``dtype``, unbiased: each value goes to one of its two fp8 neighbours."""
    info = torch.finfo(dtype)
    x = x.clamp(info.min, info.max)
    nearest = x.to(dtype)
    near32 = nearest.to(torch.float32)
    # the neighbour on x's other side: one step away in the bit pattern (magnitude up when |x| > |nearest|)
    bits = nearest.view(torch.uint8).to(torch.int16)
    magnitude_up = x.abs() > near32.abs()
    step = torch.where(magnitude_up, 1, -1).to(torch.int16)
    # zero has no smaller magnitude: its other neighbour is the smallest subnormal of x's sign
    zero = (bits & 0x7F) == 0
    sign_bit = torch.where(x < 0, 0x80, 0).to(torch.int16)
    other_bits = torch.where(zero, sign_bit | 1, bits + step)
    other = other_bits.to(torch.uint8).view(dtype).to(torch.float32)
    other = torch.where(torch.isfinite(other) & (other.abs() <= info.max), other, near32)
    gap = (other - near32).abs()
    distance = (x - near32).abs()
    p = torch.where(gap > 0, distance / gap.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    gen = torch.Generator(device=x.device).manual_seed(seed)
    u = torch.rand(x.shape, generator=gen, device=x.device, dtype=torch.float32)
    return torch.where(u < p, other, near32).to(dtype)


def to_storage(merged: torch.Tensor, dtype: torch.dtype, key: str) -> torch.Tensor:
    if is_fp8(dtype):
        return stochastic_round_fp8(merged, dtype, key_seed(key))
    return merged.to(dtype)
