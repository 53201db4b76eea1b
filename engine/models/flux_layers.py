"""Building blocks of the FLUX.1 transformer.

Attribute names are the official checkpoint's key names (``img_attn.qkv``, ``norm.query_norm.scale``,
``adaLN_modulation.1``...), so a BFL ``flux1-*.safetensors`` file loads with no renaming.
Tensors are ``[batch, tokens, heads, head_dim]`` around attention. Attention, the norms and RoPE run through the
``backends`` every forward is handed (``engine.backends``: the run's attention backend, kernel mode and
sequence-parallel plan).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import cat_tokens
from ..backends import Backends
from ..ops import Linear
from ..rope import RopeFreqs


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000, time_factor: float = 1000.0):
    """Sinusoidal embedding ``[N, dim]`` (cos half first) of ``time_factor * t``, computed in float32."""
    t = time_factor * t.float()
    half = dim // 2
    freqs = torch.exp(
        -math.log(max_period) * torch.arange(0, half, dtype=torch.float32, device=t.device) / half
    )
    args = t[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim: int, hidden_dim: int, bias: bool = True):  # FLUX.2: no bias
        super().__init__()
        self.in_layer = Linear(in_dim, hidden_dim, bias=bias)
        self.silu = nn.SiLU()
        self.out_layer = Linear(hidden_dim, hidden_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(self.silu(self.in_layer(x)))


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, backends: Backends) -> torch.Tensor:
        return backends.rms_norm(x, self.scale, 1e-6)


class QKNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.query_norm = RMSNorm(dim)
        self.key_norm = RMSNorm(dim)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, backends: Backends
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.query_norm(q, backends), self.key_norm(k, backends)


class SelfAttention(nn.Module):
    """Holds the projections of one stream; the joint attention itself runs in the block."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = Linear(dim, dim * 3, bias=qkv_bias)
        self.norm = QKNorm(dim // num_heads)
        self.proj = Linear(dim, dim)

    def project(self, x: torch.Tensor, backends: Backends) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(2)
        q, k = self.norm(q, k, backends)
        return q, k, v


class Modulation(nn.Module):
    """adaLN parameters (shift, scale, gate) x (1 or 2) from the conditioning vector."""

    def __init__(self, dim: int, double: bool):
        super().__init__()
        self.multiplier = 6 if double else 3
        self.lin = Linear(dim, self.multiplier * dim, bias=True)

    def forward(self, vec: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.lin(F.silu(vec))[:, None, :].chunk(self.multiplier, dim=-1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (1 + scale) * x + shift


def norm_modulate(
    norm: nn.LayerNorm, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, backends: Backends
) -> torch.Tensor:
    """``modulate(norm(x), shift, scale)`` for ``shift, scale [B, 1, C]``, one fused kernel (adaLN)."""
    return backends.adaln_modulate(x, shift, scale, norm.eps)


def _mlp(hidden_size: int, mlp_hidden_dim: int) -> nn.Sequential:
    return nn.Sequential(
        Linear(hidden_size, mlp_hidden_dim, bias=True),
        nn.GELU(approximate="tanh"),
        Linear(mlp_hidden_dim, hidden_size, bias=True),
    )


def rope_attention(q, k, v, freqs: RopeFreqs, txt_tokens: int, backends: Backends) -> torch.Tensor:
    """RoPE on q and k, attention, heads merged: ``[B, L, H, D]`` -> ``[B, L, H * D]``.

    ``txt_tokens``: the text tokens in front of the image tokens, whole on every rank under sequence
    parallelism (the image tokens may be a shard; see ``engine.backends``)."""
    q, k = backends.apply_rope(q, freqs), backends.apply_rope(k, freqs)
    return backends.attention(q, k, v, replicated_prefix=txt_tokens).flatten(2)


class DoubleStreamBlock(nn.Module):
    """Separate weights for the image and text streams, one joint attention over ``[txt, img]``."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, qkv_bias: bool = False):
        super().__init__()
        mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.img_mod = Modulation(hidden_size, double=True)
        self.img_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_attn = SelfAttention(hidden_size, num_heads, qkv_bias=qkv_bias)
        self.img_norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_mlp = _mlp(hidden_size, mlp_hidden_dim)

        self.txt_mod = Modulation(hidden_size, double=True)
        self.txt_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.txt_attn = SelfAttention(hidden_size, num_heads, qkv_bias=qkv_bias)
        self.txt_norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.txt_mlp = _mlp(hidden_size, mlp_hidden_dim)

    def forward(self, img, txt, vec, freqs: RopeFreqs, *, backends: Backends):
        return double_stream(self, img, txt, self.img_mod(vec), self.txt_mod(vec), freqs, backends)


def double_stream(block: nn.Module, img, txt, mod_img, mod_txt, freqs: RopeFreqs, backends: Backends):
    """The double-stream update of FLUX.1 and FLUX.2 (they differ in where the modulation comes from and in the
    MLP): ``mod_img`` / ``mod_txt`` are each stream's (shift, scale, gate) x 2 for attention and MLP; ``block``
    holds ``img_norm1/2``, ``img_attn``, ``img_mlp`` and the same for ``txt``."""
    i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = mod_img
    t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = mod_txt

    img_q, img_k, img_v = block.img_attn.project(
        norm_modulate(block.img_norm1, img, i_shift1, i_scale1, backends), backends
    )
    txt_q, txt_k, txt_v = block.txt_attn.project(
        norm_modulate(block.txt_norm1, txt, t_shift1, t_scale1, backends), backends
    )

    q = torch.cat((txt_q, img_q), dim=1)
    k = torch.cat((txt_k, img_k), dim=1)
    v = cat_tokens((txt_v, img_v), backends.reads_head_major(txt_v))  # q, k: RoPE writes them head-major
    attn = rope_attention(q, k, v, freqs, txt.shape[1], backends)
    txt_attn, img_attn = attn[:, : txt.shape[1]], attn[:, txt.shape[1] :]

    img = img + i_gate1 * block.img_attn.proj(img_attn)
    img = img + i_gate2 * block.img_mlp(norm_modulate(block.img_norm2, img, i_shift2, i_scale2, backends))
    txt = txt + t_gate1 * block.txt_attn.proj(txt_attn)
    txt = txt + t_gate2 * block.txt_mlp(norm_modulate(block.txt_norm2, txt, t_shift2, t_scale2, backends))
    return img, txt


class SingleStreamBlock(nn.Module):
    """One stream over ``[txt, img]``: fused qkv + MLP-in projection, fused attention-out + MLP-out."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.mlp_in_dim = self.mlp_hidden_dim  # the MLP's share of linear1's output
        self.linear1 = Linear(hidden_size, hidden_size * 3 + self.mlp_hidden_dim)
        self.linear2 = Linear(hidden_size + self.mlp_hidden_dim, hidden_size)
        self.norm = QKNorm(hidden_size // num_heads)
        self.pre_norm = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp_act = nn.GELU(approximate="tanh")
        self.modulation = Modulation(hidden_size, double=False)

    def forward(self, x, vec, freqs: RopeFreqs, txt_tokens: int = 0, *, backends: Backends):
        """``x [B, txt_tokens + L_img, C]``: the text tokens first, then the image tokens."""
        return single_stream(self, x, self.modulation(vec), freqs, txt_tokens, backends)


def single_stream(block: nn.Module, x, mod, freqs: RopeFreqs, txt_tokens: int, backends: Backends):
    """The single-stream update of FLUX.1 and FLUX.2 (they differ in where the modulation comes from and in the
    MLP): ``mod`` is the (shift, scale, gate) triple; ``block`` holds ``pre_norm``, ``linear1`` (qkv, then
    ``mlp_in_dim`` MLP inputs), ``norm``, ``mlp_act`` and ``linear2``."""
    shift, scale, gate = mod
    qkv, mlp = torch.split(
        block.linear1(norm_modulate(block.pre_norm, x, shift, scale, backends)),
        [3 * block.hidden_size, block.mlp_in_dim],
        -1,
    )
    q, k, v = qkv.unflatten(-1, (3, block.num_heads, -1)).unbind(2)
    q, k = block.norm(q, k, backends)
    attn = rope_attention(q, k, v, freqs, txt_tokens, backends)
    return x + gate * block.linear2(torch.cat((attn, block.mlp_act(mlp)), dim=2))


class LastLayer(nn.Module):
    """adaLN (shift and scale from the conditioning vector) then the projection to the output patches."""

    def __init__(
        self, hidden_size: int, patch_size: int, out_channels: int, bias: bool = True
    ):  # FLUX.2: no bias
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = Linear(hidden_size, patch_size * patch_size * out_channels, bias=bias)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), Linear(hidden_size, 2 * hidden_size, bias=bias))

    def forward(self, x: torch.Tensor, vec: torch.Tensor, backends: Backends) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(vec).chunk(2, dim=1)
        return self.linear(norm_modulate(self.norm_final, x, shift[:, None, :], scale[:, None, :], backends))
