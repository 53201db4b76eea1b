"""KV quantization: PyTorch references (the Triton versions are in ``triton_kernels``, same signatures).

Layout of a quantized K or V tensor ``x [..., D]`` (in the cache ``[batch, tokens, heads, head_dim]``): one
group per ``(token, head)`` row of ``D`` values, quantized asymmetrically between the row's min and max:

* ``data`` uint8 ``[..., D]`` for 8 bits (``q`` in ``0..255``), uint8 ``[..., D // 2]`` for 4 bits (``q`` in
  ``0..15``, two per byte: element ``2j`` in the low nibble, element ``2j + 1`` in the high nibble of byte ``j``;
  ``D`` must be even);
* ``scale`` float16 ``[...]`` = ``(max - zero) / (2**bits - 1)`` and ``zero`` float16 ``[...]`` = the row's
  min (both rounded to float16, and the codes computed against the rounded values);
* ``q = clamp(floor((x - zero) / scale + 0.5), 0, 2**bits - 1)`` (0 where ``scale`` is 0: a constant row);
  ``x_hat = q * scale + zero``, computed in float32 and cast to the requested dtype.

Bytes per group: ``D + 4`` (int8) and ``D / 2 + 4`` (int4), against ``2 D`` in bf16: with Wan's head_dim 128
that is 0.516x and 0.266x of bf16, the scales and zero points adding 3.1% and 6.25% to the codes.

Error per element: ``|x - x_hat| <= scale / 2`` plus float16 rounding of the parameters (``zero`` rounded to
nearest can sit up to half a float16 ulp above the min, and ``scale`` carries a relative 2**-11), i.e. at most
``0.5 * scale + 2**-11 * (|min| + range)`` (``range = max - min``). Rows whose range exceeds
``65504 * (2**bits - 1)`` overflow the float16 scale and are not representable (K/V rows are far below).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .rope import apply_rope

BITS = (8, 4)


def levels(bits: int) -> int:
    return (1 << bits) - 1


def packed_dim(head_dim: int, bits: int) -> int:
    """Bytes per group of ``head_dim`` values."""
    return head_dim if bits == 8 else head_dim // 2


def group_bytes(head_dim: int, bits: int) -> int:
    """Bytes per quantized group: the codes plus the float16 scale and zero point."""
    return packed_dim(head_dim, bits) + 4


def check_bits(bits: int, head_dim: int) -> None:
    if bits not in BITS:
        raise ValueError(f"KV quantization takes 8 or 4 bits, got {bits}")
    if bits == 4 and head_dim % 2:
        raise ValueError(f"int4 packs two values per byte; head_dim {head_dim} is odd")


def quantize_kv(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> ``(data, scale, zero)`` in the layout of the module docstring."""
    check_bits(bits, x.shape[-1])
    top = levels(bits)
    xf = x.float()
    zero = xf.amin(dim=-1).to(torch.float16)
    z = zero.float()
    scale = ((xf.amax(dim=-1) - z) / top).to(torch.float16)
    s = scale.float()
    positive = s > 0
    q = torch.floor((xf - z[..., None]) / torch.where(positive, s, 1.0)[..., None] + 0.5)
    q = torch.where(positive[..., None], q.clamp(0, top), 0.0).to(torch.uint8)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return q, scale, zero


def unpack(data: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes ``q [..., D]`` (uint8) of ``data``."""
    if bits == 8:
        return data
    return torch.stack((data & 15, data >> 4), dim=-1).flatten(-2)


def dequantize_kv(
    data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    """``x_hat [..., D]`` in ``dtype`` from the layout of the module docstring."""
    q = unpack(data, bits).float()
    return (q * scale.float()[..., None] + zero.float()[..., None]).to(dtype)


@dataclass(frozen=True)
class QuantizedAttentionInputs:
    """What attention over full-precision plus quantized keys and values reads (one layer of the KV cache):

    * ``q [B, Lq, H, D]``; the output has its shape and dtype;
    * ``k, v [B, Nf, H, D]``: full precision, used as they are (keys already rotated);
    * ``k_quant, v_quant``: ``(data, scale, zero)`` of ``[B, Nq, H, ...]`` (the layout of the module docstring),
      dequantized to ``q``'s dtype, the keys then rotated by ``cos, sin [Nq, D // 2]`` (RoPE of the cache
      positions; ``None``: stored rotated);
    * ``bits``: 8 or 4.

    The reference, the Triton kernel and the dispatcher take this one object; only the ``torch.library`` op
    (``ops``) spells it out flat (:meth:`flat` / :meth:`from_flat`), as an op schema must.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_quant: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    v_quant: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    bits: int

    def flat(self) -> tuple:
        return (self.q, self.k, self.v, *self.k_quant, *self.v_quant, self.cos, self.sin, self.bits)

    @classmethod
    def from_flat(cls, q, k, v, k_data, k_scale, k_zero, v_data, v_scale, v_zero, cos, sin, bits):
        return cls(q, k, v, (k_data, k_scale, k_zero), (v_data, v_scale, v_zero), cos, sin, bits)


def quantized_attention(inputs: QuantizedAttentionInputs) -> torch.Tensor:
    """Softmax attention of ``q [B, Lq, H, D]`` over two sets of keys and values, in ``q``'s dtype:

    ``inputs`` (see :class:`QuantizedAttentionInputs`). The reference dequantizes into transient tensors; the
    Triton kernel dequantizes tile by tile.
    """
    q, k, v, cos, sin, bits = inputs.q, inputs.k, inputs.v, inputs.cos, inputs.sin, inputs.bits
    (k_data, k_scale, k_zero), (v_data, v_scale, v_zero) = inputs.k_quant, inputs.v_quant
    kd = dequantize_kv(k_data, k_scale, k_zero, bits, q.dtype)
    if cos is not None:
        n, half = kd.shape[1], kd.shape[-1] // 2
        kd = apply_rope(kd, cos.reshape(1, n, 1, half), sin.reshape(1, n, 1, half))
    vd = dequantize_kv(v_data, v_scale, v_zero, bits, q.dtype)
    keys = torch.cat((k.to(q.dtype), kd), dim=1)
    values = torch.cat((v.to(q.dtype), vd), dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), scale=1 / math.sqrt(q.shape[-1])
    )
    return out.transpose(1, 2)
