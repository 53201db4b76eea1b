"""Building blocks of the Wan 2.1 video DiT. Attribute names are the official checkpoint keys
(``blocks.N.self_attn.q``, ``blocks.N.cross_attn.norm_k``, ``blocks.N.modulation``, ``head.head``...).

Attention, norms and RoPE run through the forward's ``backends`` (``engine.backends``: the run's attention backend,
kernel mode and sequence-parallel plan). Self-attention takes an optional ``kv`` view of a causal KV cache
(``engine.causal``): without one it is the bidirectional attention of the reference; with one,
``kv.attend(q, k, v, backends)`` writes the current chunk's keys and
values into the cache and attends to everything the cache makes visible. Cross-attention likewise takes an
optional per-prompt cache of the text keys and values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import as_head_major
from ..backends import Backends
from ..ops import Linear
from ..rope import RopeFreqs
from .norms import RMSNorm


class WanLayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32 (affine only where the checkpoint has weights: ``norm3``)."""

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = False):
        super().__init__(dim, eps=eps, elementwise_affine=elementwise_affine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).type_as(x)


class WanSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, eps: float = 1e-6):
        super().__init__()
        self.num_heads = num_heads
        self.q = Linear(dim, dim)
        self.k = Linear(dim, dim)
        self.v = Linear(dim, dim)
        self.o = Linear(dim, dim)
        self.norm_q = RMSNorm(dim, eps)  # over the whole width, before the heads are split
        self.norm_k = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, freqs: RopeFreqs, kv, backends: Backends) -> torch.Tensor:
        b, s = x.shape[:2]
        q = self.norm_q(self.q(x), backends).view(b, s, self.num_heads, -1)
        k = self.norm_k(self.k(x), backends).view(b, s, self.num_heads, -1)
        v = self.v(x).view(b, s, self.num_heads, -1)
        q = backends.apply_rope(q, freqs).type_as(x)
        if kv is None:
            out = backends.attention(q, backends.apply_rope(k, freqs).type_as(x), v)
        else:  # a KV cache (or a masked reference): it stores, rotates and attends to the keys it makes visible
            out = kv.attend(q, k, v, backends)
        return self.o(out.flatten(2))


class WanCrossAttention(WanSelfAttention):
    """Text cross-attention (the t2v variant): the same projections and q/k norms as self-attention, no RoPE.
    Keys/values depend only on the prompt, so a cache may hold them."""

    def context_kv(self, context: torch.Tensor, backends: Backends) -> tuple[torch.Tensor, torch.Tensor]:
        b = context.shape[0]
        k = self.norm_k(self.k(context), backends).view(
            b, -1, self.num_heads, context.shape[-1] // self.num_heads
        )
        v = self.v(context).view(b, -1, self.num_heads, context.shape[-1] // self.num_heads)
        if backends.reads_head_major(k):  # made once per prompt when cached: read head-major by every step
            k, v = as_head_major(k), as_head_major(v)
        return k, v

    def forward(
        self, x: torch.Tensor, context: torch.Tensor, kv: tuple | None, backends: Backends
    ) -> torch.Tensor:
        b = x.shape[0]
        q = self.norm_q(self.q(x), backends).view(b, -1, self.num_heads, x.shape[-1] // self.num_heads)
        k, v = self.context_kv(context, backends) if kv is None else kv
        # every rank holds the whole prompt: under sequence parallelism this needs no communication
        return self.o(backends.attention(q, k, v, replicated_kv=True).flatten(2))


def modulate_frames(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, frames: int) -> torch.Tensor:
    """``x [B, F*T, C]`` modulated per latent frame by ``shift, scale [B, F, 1, C]`` (float32)."""
    xf = x.float().unflatten(1, (frames, -1))
    return (xf * (1 + scale) + shift).flatten(1, 2)


def norm_modulate_frames(
    norm: WanLayerNorm, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, backends: Backends
) -> torch.Tensor:
    """``modulate_frames(norm(x), shift, scale, F)`` for ``shift, scale [B, F, 1, C]`` (``norm`` without affine
    weights, ``x`` float32), one fused kernel (adaLN)."""
    return backends.adaln_modulate(x, shift.squeeze(2), scale.squeeze(2), norm.eps)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, frames: int) -> torch.Tensor:
    """``x + y * gate`` per frame (``gate [B, F, 1, C]``) in float32, one pass (``addcmul``)."""
    per_frame = (frames, -1)
    return torch.addcmul(x.unflatten(1, per_frame), y.float().unflatten(1, per_frame), gate).flatten(1, 2)


def scaled_randn(*shape: int) -> torch.Tensor:
    """The official init of the modulation tables, ``randn(shape) / sqrt(shape[-1])``. Under ``torch.device("meta")``
    (how the loader builds a model before its weights arrive) only the shape: values would be discarded anyway, and
    ``randn`` and the division on the meta device import sympy and torch._dynamo (~1 s of a process's cold start)."""
    empty = torch.empty(shape)
    if empty.is_meta:
        return empty
    return torch.randn(shape) / shape[-1] ** 0.5


class WanAttentionBlock(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, num_heads: int, eps: float = 1e-6):
        super().__init__()
        self.norm1 = WanLayerNorm(dim, eps)
        self.self_attn = WanSelfAttention(dim, num_heads, eps)
        self.norm3 = WanLayerNorm(dim, eps, elementwise_affine=True)
        self.cross_attn = WanCrossAttention(dim, num_heads, eps)
        self.norm2 = WanLayerNorm(dim, eps)
        self.ffn = nn.Sequential(Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), Linear(ffn_dim, dim))
        self.modulation = nn.Parameter(scaled_randn(1, 6, dim))

    def forward(
        self, x, e, freqs: RopeFreqs, context, frames: int, kv=None, cross_kv=None, *, backends: Backends
    ):
        """``x [B, F*T, C]`` the float32 residual stream (as in the reference, where the first gated residual
        promotes it to float32); ``e [B, F, 6, C]`` per-frame modulation (float32); ``context`` in the compute
        dtype, which is the dtype every linear layer runs in."""
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation.float().unsqueeze(1) + e).chunk(
            6, dim=2
        )
        dtype = context.dtype
        y = self.self_attn(
            norm_modulate_frames(self.norm1, x, shift1, scale1, backends).to(dtype), freqs, kv, backends
        )
        x = gated_residual(x, y, gate1, frames)
        x = x + self.cross_attn(self.norm3(x).to(dtype), context, cross_kv, backends).float()
        y = self.ffn(norm_modulate_frames(self.norm2, x, shift2, scale2, backends).to(dtype))
        return gated_residual(x, y, gate2, frames)


class Head(nn.Module):
    def __init__(self, dim: int, out_dim: int, patch_size: tuple[int, int, int], eps: float = 1e-6):
        super().__init__()
        self.norm = WanLayerNorm(dim, eps)
        self.head = Linear(dim, out_dim * patch_size[0] * patch_size[1] * patch_size[2])
        self.modulation = nn.Parameter(scaled_randn(1, 2, dim))

    def forward(self, x: torch.Tensor, e: torch.Tensor, frames: int, backends: Backends) -> torch.Tensor:
        """``e [B, F, C]``: the per-frame time embedding (before the 6-way projection). Runs in float32, as the
        reference does (its head sits under a float32 autocast)."""
        shift, scale = (self.modulation.float().unsqueeze(1) + e.unsqueeze(2)).chunk(2, dim=2)
        return self.head(norm_modulate_frames(self.norm, x, shift, scale, backends))
