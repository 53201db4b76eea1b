"""FLOPs of one DiT forward, written out from the model configuration and the token counts.

Convention (the one ``bench/`` uses and ``torch.utils.flop_counter`` agrees with):

* a linear layer applied token by token costs ``2 x weights x tokens`` (a multiply and an add per weight per
  token; biases, norms, activations, RoPE and gating are elementwise and not counted). In FLUX's (FLUX.1 and
  FLUX.2) double blocks the image stream's weights see the image tokens and the text stream's weights the text
  tokens; single blocks see both. Z-Image pads the caption and the image tokens each to a multiple of 32 with
  learnt pad tokens after embedding them: the embedders and the final layer see the real tokens, the refiners
  and the single-stream layers the padded ones (pad tokens are computed like any other). Wan's patch embedding is a strided convolution, which is the same product (``16 x 1 x 2 x 2``
  weights per output channel, once per token);
* attention costs ``4 x N_q x N_kv x d`` per layer (``Q K^T`` and ``P V``, 2 FLOPs per multiply-add each), with
  ``d = heads x head_dim`` the hidden size; softmax and scaling are not counted;
* the per-sample terms (FLUX's timestep / pooled-text / guidance embedders and every block's adaLN modulation,
  FLUX.2's three shared modulations; Z-Image's timestep MLP and every modulated block's adaLN; Wan's time embedding and projection, once per latent frame) are kept apart: they do not grow with the image;
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
from ..models.flux2 import Flux2Params
from ..models.wan import WanParams
from ..models.zimage import ZImageParams, padded_length
from ..models.zimage_layers import FREQUENCY_EMBEDDING_SIZE, TIME_MID_SIZE, adaln_dim, ffn_hidden_dim


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


def flux2_block_weights(p: Flux2Params) -> int:
    """Token-wise weights of one stream of a FLUX.2 double block, or of a single block (both ``4H^2 + 3HM``):
    qkv ``3H^2`` + attention out ``H^2`` + the SiLU-gated MLP ``H x 2M`` in, ``M x H`` out; a single block fuses
    them as ``H(3H + 2M)`` and ``(H + M)H``. No biases anywhere."""
    h, m = p.hidden_size, int(p.hidden_size * p.mlp_ratio)
    return 4 * h * h + 3 * h * m


def flux2_forward_flops(p: Flux2Params, image_tokens: int, text_tokens: int, batch: int = 1) -> ForwardFlops:
    """One ``Flux2.forward`` over ``batch`` rows of ``image_tokens`` latent pixels (FLUX.2's LATENT is already
    patchified: one token each) and ``text_tokens`` stacked text-encoder states."""
    h, block = p.hidden_size, flux2_block_weights(p)
    n = image_tokens + text_tokens
    image_weights = p.in_channels * h + p.depth * block + h * p.out_channels  # img_in, image streams, final
    text_weights = p.context_in_dim * h + p.depth * block  # txt_in, text streams
    linear = image_weights * image_tokens + text_weights * text_tokens + p.depth_single_blocks * block * n
    embedders = (256 * h + h * h) * (2 if p.guidance_embed else 1)  # time (and guidance) MLPs
    # shared modulation, once per forward: double img 6H^2, double txt 6H^2, single 3H^2; final adaLN 2H^2
    modulation = 2 * 6 * h * h + 3 * h * h + 2 * h * h
    attention = (p.depth + p.depth_single_blocks) * 4 * n * n * h
    return ForwardFlops(
        linear=2 * batch * linear,
        attention=batch * attention,
        per_sample=2 * batch * (embedders + modulation),
    )


def zimage_block_weights(p: ZImageParams) -> int:
    """Token-wise weights of one Z-Image block (refiner or single-stream): q, k, v, out ``4D^2`` and the SwiGLU
    ``w1``, ``w3`` (``D x F``) and ``w2`` (``F x D``), ``F = int(8D / 3)``."""
    d = p.dim
    return 4 * d * d + 3 * d * ffn_hidden_dim(d)


def zimage_forward_flops(
    p: ZImageParams, image_tokens: int, text_tokens: int, batch: int = 1
) -> ForwardFlops:
    """One ``ZImage.forward`` over ``batch`` rows of ``image_tokens`` 2x2 patches and ``text_tokens`` caption
    features; both counts are padded to ``seq_multiple`` here, as the model pads them."""
    d, block = p.dim, zimage_block_weights(p)
    img = padded_length(image_tokens, p.seq_multiple)
    txt = padded_length(text_tokens, p.seq_multiple)
    n = img + txt
    embed = p.patch_channels * d * image_tokens + p.cap_feat_dim * d * text_tokens  # before the padding
    final = d * p.patch_channels * image_tokens  # on the real image tokens only
    refiners = (
        p.n_refiner_layers * block * (img + txt)
    )  # noise refiner on the image, context refiner on the caption
    linear = embed + refiners + p.n_layers * block * n + final
    attention = 4 * d * (p.n_refiner_layers * (img * img + txt * txt) + p.n_layers * n * n)
    a = adaln_dim(d)
    time_mlp = FREQUENCY_EMBEDDING_SIZE * TIME_MID_SIZE + TIME_MID_SIZE * a
    modulation = (p.n_refiner_layers + p.n_layers) * a * 4 * d + a * d  # modulated blocks + the final scale
    return ForwardFlops(
        linear=2 * batch * linear,
        attention=batch * attention,
        per_sample=2 * batch * (time_mlp + modulation),
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
    "flux2_block_weights",
    "flux2_forward_flops",
    "flux_block_weights",
    "flux_forward_flops",
    "measure_flops",
    "wan_forward_flops",
    "wan_prompt_flops",
    "wan_tokens_per_frame",
    "zimage_block_weights",
    "zimage_forward_flops",
]
