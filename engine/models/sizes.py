"""The sizes of a model: its parameters, its weight bytes by storage dtype, and the activations of one forward.

What the memory preflight (``engine.preflight``) and the cost planner (``engine.plan``) count a model by. Weights
are counted on the model built on the meta device (exact parameter counts, no memory). fp8 storage
follows the engine (``engine.ops.store_linear_weights``): the weight matrices of linear layers take 1 byte per
element, everything else (biases, norms, Wan's patch-embedding convolution and modulation tables) stays in the
16-bit compute dtype.

A causal KV cache's bytes are the KV cache module's own formula (``engine.causal.kv_cache.bytes``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from ..ops import Linear
from .zimage import padded_length
from .zimage_layers import ffn_hidden_dim

WEIGHT_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@dataclass(frozen=True)
class ParameterCount:
    total: int
    linear_weights: int  # elements of Linear weight matrices (what fp8 storage shrinks)

    def bytes(self, dtype: str) -> int:
        """Weight bytes when stored as ``dtype`` (fp8: linear weights in fp8, the rest in bf16)."""
        if dtype == "fp8":
            return self.linear_weights + 2 * (self.total - self.linear_weights)
        return WEIGHT_DTYPE_BYTES[dtype] * self.total

    def bytes_by_dtype(self) -> dict[str, int]:
        return {d: self.bytes(d) for d in WEIGHT_DTYPE_BYTES}


def count_parameters(model: nn.Module) -> ParameterCount:
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, Linear))
    return ParameterCount(total=sum(t.numel() for t in model.state_dict().values()), linear_weights=linear)


@functools.lru_cache(maxsize=32)
def preset_parameters(model_class: type, params) -> ParameterCount:
    """Parameter counts of ``model_class(params)``, built on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return count_parameters(model_class(params))


# Activation elements kept alive per token and row inside one FLUX block, in units of ``12 H + 3 M`` (H hidden,
# M MLP width: the residual stream, the qkv and MLP-in projections, q/k after norm and RoPE, the attention
# output, the MLP activation and the concatenated single-block input). Calibrated on the CPU in fp32: the peak
# RSS growth of a 1-step run (after a warm-up run) is 0.64x of the whole sampling estimate for flux-tiny at
# 2048 px and 0.60x for flux-mid at 1024 px, so the estimate errs on the safe side by about 1.6x.
FLUX_ACTIVATION_FACTOR = 2


def flux_activation_bytes(p, image_tokens: int, text_tokens: int, rows: int, dtype_bytes: int) -> int:
    """Estimated peak activation bytes of one FLUX forward over ``rows`` batch rows.

    An estimate, not an accounting: attention is assumed to run in a fused kernel (SDPA's flash / memory-
    efficient paths on CUDA and the CPU), which keeps no ``tokens x tokens`` score matrix, so it grows linearly
    in tokens. The RoPE rotation tables are float32, ``2 x head_dim`` per token.
    """
    tokens = image_tokens + text_tokens
    hidden = p.hidden_size
    mlp = int(hidden * p.mlp_ratio)
    per_token = FLUX_ACTIVATION_FACTOR * (12 * hidden + 3 * mlp) * dtype_bytes
    rope = 2 * (hidden // p.num_heads) * 4
    return rows * tokens * (per_token + rope)


def image_activation_bytes(p, image_tokens: int, text_tokens: int, rows: int, dtype_bytes: int) -> int:
    """:func:`flux_activation_bytes` for any image family's params: FLUX.1 and FLUX.2 (``hidden_size``,
    ``mlp_ratio``; FLUX.2's MLP is a SwiGLU whose input projection is twice the MLP width, counted as such) and
    Z-Image (``dim``, its SwiGLU width, caption and image tokens each padded to ``seq_multiple``)."""
    if hasattr(p, "hidden_size"):
        hidden, heads = p.hidden_size, p.num_heads
        mlp = int(hidden * p.mlp_ratio) * (2 if not hasattr(p, "vec_in_dim") else 1)
        tokens = image_tokens + text_tokens
    else:
        hidden, heads = p.dim, p.n_heads
        mlp = 2 * ffn_hidden_dim(hidden)
        tokens = padded_length(image_tokens, p.seq_multiple) + padded_length(text_tokens, p.seq_multiple)
    per_token = FLUX_ACTIVATION_FACTOR * (12 * hidden + 3 * mlp) * dtype_bytes
    rope = 2 * (hidden // heads) * 4
    return rows * tokens * (per_token + rope)


__all__ = [
    "FLUX_ACTIVATION_FACTOR",
    "WEIGHT_DTYPE_BYTES",
    "ParameterCount",
    "count_parameters",
    "flux_activation_bytes",
    "image_activation_bytes",
    "preset_parameters",
]
