"""Building blocks of the Z-Image transformer (S3-DiT).

Attribute names are the official checkpoint's key names (``attention.to_q``, ``attention.norm_q.weight``,
``feed_forward.w1``, ``adaLN_modulation.0``, ``all_final_layer.2-1.adaLN_modulation.1``...), so a
Tongyi-MAI ``transformer/diffusion_pytorch_model*.safetensors`` file loads with no renaming.
Tensors are ``[batch, tokens, heads, head_dim]`` around attention; attention, norms and RoPE run through the
forward's ``backends`` (``engine.backends``).

Semantics (Tongyi-MAI/Z-Image ``src/zimage/transformer.py``): RMSNorm everywhere (eps 1e-5) except the final
layer's LayerNorm; a "sandwich" block, ``x + gate * norm2(attn(norm1(x) * (1 + scale)))`` and the same for the
SwiGLU feed-forward, with ``tanh`` gates and no shift; the modulation reads the timestep embedding (width
``min(dim, 256)``) directly, without an activation in front.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..backends import Backends
from ..ops import Linear
from ..rope import RopeFreqs
from .flux_layers import timestep_embedding
from .norms import RMSNorm

ADALN_EMBED_DIM = 256  # src/config/model.py ADALN_EMBED_DIM: the modulation input is min(dim, 256) wide
FREQUENCY_EMBEDDING_SIZE = 256
TIME_MID_SIZE = 1024  # TimestepEmbedder(mid_size=1024) in the reference


def adaln_dim(dim: int) -> int:
    return min(dim, ADALN_EMBED_DIM)


class TimestepEmbedder(nn.Module):
    """Sinusoidal embedding of ``t_scale * t`` (cos half first) through a 2-layer SiLU MLP: ``mlp.0``, ``mlp.2``."""

    def __init__(self, out_size: int, mid_size: int = TIME_MID_SIZE, t_scale: float = 1000.0):
        super().__init__()
        self.t_scale = t_scale
        self.mlp = nn.Sequential(
            Linear(FREQUENCY_EMBEDDING_SIZE, mid_size, bias=True),
            nn.SiLU(),
            Linear(mid_size, out_size, bias=True),
        )

    def forward(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        freq = timestep_embedding(t, FREQUENCY_EMBEDDING_SIZE, time_factor=self.t_scale)
        return self.mlp(freq.to(dtype))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``, no biases."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = Linear(dim, hidden_dim, bias=False)
        self.w2 = Linear(hidden_dim, dim, bias=False)
        self.w3 = Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def ffn_hidden_dim(dim: int) -> int:
    """The reference's ``int(dim / 3 * 8)``: 10240 for 3840."""
    return int(dim / 3 * 8)


class ZImageAttention(nn.Module):
    """Self-attention with per-head RMS q/k norms, RoPE after the norms.

    The reference has an ``n_kv_heads`` argument, but neither it nor diffusers runs with fewer key/value heads
    than query heads (diffusers ignores it, Tongyi's attention fails on the shapes) and every published model
    has as many, so only ``n_kv_heads == n_heads`` is accepted."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, qk_norm: bool = True, eps: float = 1e-5):
        super().__init__()
        if n_kv_heads != n_heads:
            raise ValueError(
                f"{n_kv_heads} key/value heads for {n_heads} heads: only equal counts are supported"
            )
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_heads
        self.to_q = Linear(dim, n_heads * self.head_dim, bias=False)
        self.to_k = Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.to_v = Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.to_out = nn.ModuleList([Linear(n_heads * self.head_dim, dim, bias=False)])
        self.norm_q = RMSNorm(self.head_dim, eps=eps) if qk_norm else None
        self.norm_k = RMSNorm(self.head_dim, eps=eps) if qk_norm else None

    def forward(
        self, x: torch.Tensor, freqs: RopeFreqs, replicated_prefix: int, replicated: bool, backends: Backends
    ) -> torch.Tensor:
        """``replicated_prefix``: leading tokens every rank holds whole under sequence parallelism (the
        caption in the single-stream layers); ``replicated``: all tokens are whole on every rank (the context
        refiner), so the attention stays local. Both are ignored outside a parallel plan."""
        q = self.to_q(x).unflatten(-1, (self.n_heads, -1))
        k = self.to_k(x).unflatten(-1, (self.n_kv_heads, -1))
        v = self.to_v(x).unflatten(-1, (self.n_kv_heads, -1))
        if self.norm_q is not None:
            q = self.norm_q(q, backends)
        if self.norm_k is not None:
            k = self.norm_k(k, backends)
        q, k = backends.apply_rope(q, freqs), backends.apply_rope(k, freqs)
        out = backends.attention(q, k, v, replicated_prefix=replicated_prefix, replicated_kv=replicated)
        return self.to_out[0](out.flatten(2))


class ZImageTransformerBlock(nn.Module):
    """One block of the noise refiner, the context refiner (``modulation=False``) or the single-stream stack."""

    def __init__(
        self, dim: int, n_heads: int, n_kv_heads: int, norm_eps: float, qk_norm: bool, modulation: bool = True
    ):
        super().__init__()
        self.dim = dim
        self.modulation = modulation
        self.attention = ZImageAttention(dim, n_heads, n_kv_heads, qk_norm, norm_eps)
        self.feed_forward = FeedForward(dim, ffn_hidden_dim(dim))
        self.attention_norm1 = RMSNorm(dim, eps=norm_eps)
        self.ffn_norm1 = RMSNorm(dim, eps=norm_eps)
        self.attention_norm2 = RMSNorm(dim, eps=norm_eps)
        self.ffn_norm2 = RMSNorm(dim, eps=norm_eps)
        if modulation:
            self.adaLN_modulation = nn.ModuleList([Linear(adaln_dim(dim), 4 * dim, bias=True)])

    def forward(
        self,
        x: torch.Tensor,
        freqs: RopeFreqs,
        adaln_input: torch.Tensor | None = None,
        replicated_prefix: int = 0,
        replicated: bool = False,
        *,
        backends: Backends,
    ) -> torch.Tensor:
        b = backends
        if self.modulation:
            if adaln_input is None:
                raise ValueError("a modulated Z-Image block needs the timestep embedding")
            scale_msa, gate_msa, scale_mlp, gate_mlp = (
                self.adaLN_modulation[0](adaln_input).unsqueeze(1).chunk(4, dim=2)
            )
            gate_msa, gate_mlp = gate_msa.tanh(), gate_mlp.tanh()
            attn = self.attention(
                self.attention_norm1(x, b) * (1.0 + scale_msa), freqs, replicated_prefix, replicated, b
            )
            x = x + gate_msa * self.attention_norm2(attn, b)
            ffn = self.feed_forward(self.ffn_norm1(x, b) * (1.0 + scale_mlp))
            return x + gate_mlp * self.ffn_norm2(ffn, b)
        attn = self.attention(self.attention_norm1(x, b), freqs, replicated_prefix, replicated, b)
        x = x + self.attention_norm2(attn, b)
        return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x, b)), b)


class FinalLayer(nn.Module):
    """LayerNorm (no affine) times ``1 + adaLN(c)`` (a scale only, no shift), then the patch projection."""

    def __init__(self, hidden_size: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = Linear(hidden_size, out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(
            nn.SiLU(), Linear(adaln_dim(hidden_size), hidden_size, bias=True)
        )

    def forward(self, x: torch.Tensor, c: torch.Tensor, backends: Backends) -> torch.Tensor:
        scale = self.adaLN_modulation(c)[:, None, :]
        return self.linear(backends.adaln_modulate(x, torch.zeros_like(scale), scale, self.norm_final.eps))
