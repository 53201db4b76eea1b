"""Bytes: weights by storage dtype, and the causal KV cache by element type.

Weights are counted on the model built on the meta device (exact parameter counts, no memory). fp8 storage
follows the engine (``engine.ops.store_linear_weights``): the weight matrices of linear layers take 1 byte per
element, everything else (biases, norms, Wan's patch-embedding convolution and modulation tables) stays in the
16-bit compute dtype.

The KV cache (``engine.causal.KVCache``) holds K and V of every layer, ``2 x layers x heads x head_dim``
elements per token, for ``window_frames x tokens_per_frame`` tokens (with sinks under the default cache-relative
RoPE, plus an unrotated copy of the sinks' keys). ``bf16`` keeps them all in the compute
dtype. ``int8`` / ``int4`` (``kernels.kv_quant``) keep the sinks, the current chunk and the newest
``keep_recent_chunks`` completed chunks in the compute dtype and quantize the rest of the window per (token,
head) row: the codes (``head_dim`` bytes for int8, ``head_dim / 2`` for int4) plus a float16 scale and a float16
zero point, so ``head_dim + 4`` and ``head_dim / 2 + 4`` bytes per row against ``2 x head_dim`` in bf16.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from ..causal.kv_cache import WindowSpec
from ..errors import InputError
from ..ops import Linear

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
        from ..models.zimage import padded_length
        from ..models.zimage_layers import ffn_hidden_dim

        hidden, heads = p.dim, p.n_heads
        mlp = 2 * ffn_hidden_dim(hidden)
        tokens = padded_length(image_tokens, p.seq_multiple) + padded_length(text_tokens, p.seq_multiple)
    per_token = FLUX_ACTIVATION_FACTOR * (12 * hidden + 3 * mlp) * dtype_bytes
    rope = 2 * (hidden // heads) * 4
    return rows * tokens * (per_token + rope)


@dataclass(frozen=True)
class KVLayout:
    name: str
    bits: int | None  # None: unquantized, in the compute dtype (bf16 on a GPU)
    note: str

    def group_bytes(self, head_dim: int) -> int:
        """Bytes of one (token, head) row of K or of V."""
        if self.bits is None:
            return 2 * head_dim
        return head_dim * self.bits // 8 + 4  # codes + float16 scale + float16 zero point


KV_LAYOUTS: dict[str, KVLayout] = {
    k.name: k
    for k in (
        KVLayout("bf16", None, "the compute dtype, unquantized"),
        KVLayout("int8", 8, "uint8 codes + fp16 scale and zero point per (token, head)"),
        KVLayout("int4", 4, "two 4-bit codes per byte + fp16 scale and zero point per (token, head)"),
    )
}


def kv_layout(name: str, input_name: str = "kv_dtype") -> KVLayout:
    if name not in KV_LAYOUTS:
        raise InputError(input_name, f"unknown KV cache dtype {name!r}; known: {', '.join(KV_LAYOUTS)}")
    return KV_LAYOUTS[name]


def kv_bytes_per_token(layers: int, heads: int, head_dim: int, layout: KVLayout) -> int:
    """K and V of one token over every layer (batch 1), as the layout stores it."""
    return 2 * layers * heads * layout.group_bytes(head_dim)


@dataclass(frozen=True)
class KVBytes:
    per_token: int  # as stored for good (quantized for int8 / int4)
    per_chunk: int  # one chunk's tokens at per_token
    window: int  # the cache's allocation: full-precision slots + quantized slots
    full_frames: int  # frame slots kept in the compute dtype (all of them unquantized)
    quantized_frames: int

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def kv_cache_bytes(
    layers: int,
    heads: int,
    head_dim: int,
    tokens_per_frame: int,
    window: WindowSpec,
    layout: KVLayout,
    keep_recent_chunks: int = 1,
    batch: int = 1,
    rope: str = "cache",
) -> KVBytes:
    """Bytes of ``engine.causal.KVCache`` (the layout of ``kernels.kv_quant`` for int8 / int4): unquantized, all
    ``window_frames`` slots in the compute dtype; quantized, the sinks, the current chunk and the newest
    ``keep_recent_chunks`` completed chunks stay in the compute dtype and the rest of the window is quantized.
    ``rope="cache"`` with sinks adds an unrotated copy of the sinks' keys (compute dtype), from which every
    chunk re-positions them."""
    full_token = batch * kv_bytes_per_token(layers, heads, head_dim, KV_LAYOUTS["bf16"])
    token = batch * kv_bytes_per_token(layers, heads, head_dim, layout)
    if layout.bits is None:
        full = window.window_frames
    else:
        full = window.sink_frames + (keep_recent_chunks + 1) * window.chunk_frames
    quantized = window.window_frames - full
    sink_copies = window.sink_frames if rope == "cache" else 0  # keys only: half a K/V row
    return KVBytes(
        per_token=token,
        per_chunk=token * tokens_per_frame * window.chunk_frames,
        window=(full * full_token + quantized * token + sink_copies * full_token // 2) * tokens_per_frame,
        full_frames=full,
        quantized_frames=quantized,
    )


__all__ = [
    "KV_LAYOUTS",
    "KVBytes",
    "KVLayout",
    "ParameterCount",
    "WEIGHT_DTYPE_BYTES",
    "count_parameters",
    "flux_activation_bytes",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "kv_layout",
    "preset_parameters",
]
