"""Building blocks of the FLUX.2 transformer (black-forest-labs/flux2, ``src/flux2/model.py``).

Differences from FLUX.1 (``flux_layers``): no bias anywhere, SiLU-gated MLPs (the first projection is twice
the hidden width, split into gate and value), and no per-block modulation: the model computes the (shift,
scale, gate) triples once per forward from the conditioning vector and every block of a kind shares them.

Attribute names are the official checkpoint's key names (``img_attn.qkv``, ``norm.query_norm.scale``,
``img_mlp.0``, ``linear1``...), so a BFL ``flux2-*.safetensors`` file loads with no renaming.
Tensors are ``[batch, tokens, heads, head_dim]`` around attention; attention, norms and RoPE run through the
forward's ``backends`` (``engine.backends``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..backends import Backends
from ..ops import Linear
from ..rope import RopeFreqs
from .flux_layers import LastLayer, MLPEmbedder, QKNorm, double_stream, single_stream, timestep_embedding

__all__ = [
    "DoubleStreamBlock",
    "LastLayer",
    "MLPEmbedder",
    "Modulation",
    "SelfAttention",
    "SingleStreamBlock",
    "timestep_embedding",
]

ModTriple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (shift, scale, gate), each [B, 1, C]


class SiLUGate(nn.Module):
    """``silu(a) * b`` for ``x = [a, b]`` split in halves along the last dimension (no parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b


class Modulation(nn.Module):
    """The shared adaLN parameters: one (shift, scale, gate) triple, or two for a double-stream block."""

    def __init__(self, dim: int, double: bool):
        super().__init__()
        self.double = double
        self.lin = Linear(dim, (6 if double else 3) * dim, bias=False)

    def forward(self, vec: torch.Tensor) -> tuple[ModTriple, ...]:
        out = self.lin(F.silu(vec))[:, None, :].chunk(6 if self.double else 3, dim=-1)
        return (out[:3], out[3:]) if self.double else (out,)


class SelfAttention(nn.Module):
    """Holds the projections of one stream; the joint attention itself runs in the block."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = Linear(dim, dim * 3, bias=False)
        self.norm = QKNorm(dim // num_heads)
        self.proj = Linear(dim, dim, bias=False)

    def project(self, x: torch.Tensor, backends: Backends) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(2)
        q, k = self.norm(q, k, backends)
        return q, k, v


def _mlp(hidden_size: int, mlp_hidden_dim: int) -> nn.Sequential:
    return nn.Sequential(
        Linear(hidden_size, 2 * mlp_hidden_dim, bias=False),
        SiLUGate(),
        Linear(mlp_hidden_dim, hidden_size, bias=False),
    )


class DoubleStreamBlock(nn.Module):
    """Separate weights for the image and text streams, one joint attention over ``[txt, img]``."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float):
        super().__init__()
        mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.img_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_attn = SelfAttention(hidden_size, num_heads)
        self.img_norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_mlp = _mlp(hidden_size, mlp_hidden_dim)

        self.txt_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.txt_attn = SelfAttention(hidden_size, num_heads)
        self.txt_norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.txt_mlp = _mlp(hidden_size, mlp_hidden_dim)

    def forward(self, img, txt, mod_img, mod_txt, freqs: RopeFreqs, *, backends: Backends):
        """``mod_img`` / ``mod_txt``: the two (shift, scale, gate) triples of each stream (shared)."""
        mods = (*mod_img[0], *mod_img[1]), (*mod_txt[0], *mod_txt[1])
        return double_stream(self, img, txt, *mods, freqs, backends)


class SingleStreamBlock(nn.Module):
    """One stream over ``[txt, img]``: fused qkv + gated-MLP-in projection, fused attention-out + MLP-out."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.mlp_in_dim = 2 * self.mlp_hidden_dim  # gate and value, which the SiLU gate multiplies
        self.linear1 = Linear(hidden_size, hidden_size * 3 + self.mlp_in_dim, bias=False)
        self.linear2 = Linear(hidden_size + self.mlp_hidden_dim, hidden_size, bias=False)
        self.norm = QKNorm(hidden_size // num_heads)
        self.pre_norm = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp_act = SiLUGate()

    def forward(self, x, mod: ModTriple, freqs: RopeFreqs, txt_tokens: int = 0, *, backends: Backends):
        """``x [B, txt_tokens + L_img, C]``: the text tokens first, then the image tokens."""
        return single_stream(self, x, mod, freqs, txt_tokens, backends)
