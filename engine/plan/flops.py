"""FLOPs of one DiT forward, written out from the model configuration and the token counts.

Convention (the one ``bench/`` uses and ``torch.utils.flop_counter`` agrees with):

* a linear layer applied token by token costs ``2 x weights x tokens`` (a multiply and an add per weight per
  token; biases, norms, activations, RoPE and gating are elementwise and not counted). In FLUX's double blocks
  the image stream's weights see the image tokens and the text stream's weights the text tokens; single blocks
  see both. Wan's patch embedding is a strided convolution, which is the same product (``16 x 1 x 2 x 2``
  weights per output channel, once per token);
* attention costs ``4 x N_q x N_kv x d`` per layer (``Q K^T`` and ``P V``, 2 FLOPs per multiply-add each), with
  ``d = heads x head_dim`` the hidden size; softmax and scaling are not counted;
* the per-sample terms (FLUX's timestep / pooled-text / guidance embedders and every block's adaLN modulation;
  Wan's time embedding and projection, once per latent frame) are kept apart: they do not grow with the image;
* Wan's text embedding and cross-attention keys/values of the prompt (padded to 512 tokens) are *per prompt*: a
  causal session computes them once, a plain ``Wan.forward(x, t, context)`` once per call.

:func:`measure_flops` counts a real call with ``FlopCounterMode`` for the cross-checks; on the CPU it has no
formula for ``_scaled_dot_product_flash_attention_for_cpu`` (its attention op), so one is registered there:
torch's own SDPA formula, the same ``4 x N_q x N_kv x d`` as above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..models.flux import FluxParams
from ..models.wan import WanParams


@dataclass(frozen=True)
class ForwardFlops:
    linear: int = 0  # token-wise linear layers (and Wan's patch-embedding convolution)
    attention: int = 0  # QK^T and PV of every attention layer (self and cross)
    per_sample: int = 0  # embedders and modulation of the conditioning vector (FLUX), time embedding (Wan)
    per_prompt: int = 0  # Wan: text embedding + cross-attention K/V of the padded prompt

    @property
    def total(self) -> int:
        return self.linear + self.attention + self.per_sample + self.per_prompt

    def __add__(self, other: ForwardFlops) -> ForwardFlops:
        return ForwardFlops(
            self.linear + other.linear,
            self.attention + other.attention,
            self.per_sample + other.per_sample,
            self.per_prompt + other.per_prompt,
        )

    def times(self, k: int) -> ForwardFlops:
        return ForwardFlops(self.linear * k, self.attention * k, self.per_sample * k, self.per_prompt * k)

    def as_dict(self) -> dict[str, int]:
        return {
            "linear": self.linear,
            "attention": self.attention,
            "per_sample": self.per_sample,
            "per_prompt": self.per_prompt,
            "total": self.total,
        }


def flux_block_weights(p: FluxParams) -> int:
    """Token-wise weights of one stream of a double block, or of a single block (both are ``4H^2 + 2HM``):
    qkv ``3H^2`` + attention out ``H^2`` + MLP ``2HM``; a single block fuses them as ``H(3H + M)`` and
    ``(H + M)H``."""
    h, m = p.hidden_size, int(p.hidden_size * p.mlp_ratio)
    return 4 * h * h + 2 * h * m


def flux_forward_flops(p: FluxParams, image_tokens: int, text_tokens: int, batch: int = 1) -> ForwardFlops:
    """One ``Flux.forward`` over ``batch`` rows of ``image_tokens`` packed 2x2 patches and ``text_tokens``."""
    h, block = p.hidden_size, flux_block_weights(p)
    n = image_tokens + text_tokens
    image_weights = p.in_channels * h + p.depth * block + h * p.out_channels  # img_in, image streams, final
    text_weights = p.context_in_dim * h + p.depth * block  # txt_in, text streams
    linear = image_weights * image_tokens + text_weights * text_tokens + p.depth_single_blocks * block * n
    embedders = (256 * h + h * h) + (p.vec_in_dim * h + h * h) + (256 * h + h * h if p.guidance_embed else 0)
    modulation = p.depth * 2 * 6 * h * h + p.depth_single_blocks * 3 * h * h + 2 * h * h
    attention = (p.depth + p.depth_single_blocks) * 4 * n * n * h
    return ForwardFlops(
        linear=2 * batch * linear,
        attention=batch * attention,
        per_sample=2 * batch * (embedders + modulation),
    )


def wan_tokens_per_frame(p: WanParams, height: int, width: int) -> int:
    """Tokens of one latent frame of a ``height x width`` px video (8x VAE, then the patch)."""
    return (height // 8 // p.patch_size[1]) * (width // 8 // p.patch_size[2])


def wan_forward_flops(
    p: WanParams, frames: int, tokens_per_frame: int, key_tokens: int | None = None, batch: int = 1
) -> ForwardFlops:
    """One ``Wan.forward`` over ``frames`` latent frames whose self-attention reads ``key_tokens`` keys (default:
    its own tokens, the bidirectional model; a causal chunk reads the visible cache window). The per-prompt
    work (text embedding, cross K/V) is not included: see :func:`wan_prompt_flops`."""
    d, n = p.dim, frames * tokens_per_frame
    keys = n if key_tokens is None else key_tokens
    patch = math.prod(p.patch_size)
    # per layer: self q/k/v/o 4d^2, cross q/o 2d^2 (its k/v read the prompt), FFN 2dF
    per_token = p.in_dim * patch * d + p.num_layers * (6 * d * d + 2 * d * p.ffn_dim) + d * p.out_dim * patch
    per_frame = p.freq_dim * d + d * d + 6 * d * d  # time embedding (2 layers) and its 6-way projection
    attention = p.num_layers * 4 * n * (keys + p.text_len) * d  # self, then cross to the padded prompt
    return ForwardFlops(
        linear=2 * batch * n * per_token,
        attention=batch * attention,
        per_sample=2 * batch * frames * per_frame,
    )


def wan_prompt_flops(p: WanParams, batch: int = 1) -> ForwardFlops:
    """Text embedding of the prompt padded to ``text_len`` tokens, and every layer's cross-attention K/V."""
    d = p.dim
    embed = p.text_dim * d + d * d
    cross_kv = p.num_layers * 2 * d * d
    return ForwardFlops(per_prompt=2 * batch * p.text_len * (embed + cross_kv))


# -- measuring ---------------------------------------------------------------------------------------------------
def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


ATTENTION_OPS = ("_scaled_dot_product_flash_attention_for_cpu",)


@dataclass(frozen=True)
class MeasuredFlops:
    total: int
    attention: int  # the SDPA ops' share (counted with torch's SDPA formula)

    @property
    def rest(self) -> int:
        return self.total - self.attention


def measure_flops(fn) -> MeasuredFlops:
    """Run ``fn()`` under ``FlopCounterMode`` with the CPU attention op registered; no grad."""
    # imported here: flop_counter pulls in dynamo (and triton), too heavy for importing the engine
    from torch.utils.flop_counter import FlopCounterMode

    mapping = {getattr(torch.ops.aten, name): _cpu_sdpa_flops for name in ATTENTION_OPS}
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        fn()
    counts = counter.get_flop_counts()["Global"]
    attention = sum(v for k, v in counts.items() if "attention" in str(k))
    return MeasuredFlops(total=counter.get_total_flops(), attention=attention)


__all__ = [
    "ForwardFlops",
    "MeasuredFlops",
    "flux_block_weights",
    "flux_forward_flops",
    "measure_flops",
    "wan_forward_flops",
    "wan_prompt_flops",
    "wan_tokens_per_frame",
]
