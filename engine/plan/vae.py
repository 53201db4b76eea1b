"""Decode FLOPs of the autoencoders, counted by ``FlopCounterMode`` on a meta-device copy (shapes only, no compute).

Convolutions count ``2 x output elements x (input channels x kernel size)``, the full FLUX.1 AE's mid-block
attention ``4 x pixels^2 x channels``; upsampling, norms and activations are not counted. Counts are cached per
latent shape.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..vae import taesd
from ..vae.flux_ae import AE_PRESETS, Decoder
from ..vae.taehv import TAEHV, TAEHV_CONFIGS
from ..vae.tiny import TINY_VARIANTS
from .flops import measure_flops


@functools.lru_cache(maxsize=64)
def flux_ae_decode_flops(latent_h: int, latent_w: int, batch: int = 1, preset: str = "flux1-ae") -> int:
    """The full FLUX.1 autoencoder (``ae.safetensors`` architecture) decoding ``[batch, 16, h, w]``."""

    with torch.device("meta"):
        decoder = Decoder(AE_PRESETS[preset])
        z = torch.empty(batch, 16, latent_h, latent_w)
    return measure_flops(lambda: decoder(z)).total


@functools.lru_cache(maxsize=64)
def flux2_ae_decode_flops(latent_h: int, latent_w: int, batch: int = 1) -> int:
    """The full FLUX.2 autoencoder decoding its raw ``[batch, 32, h, w]`` latent (after ComfyUI's LATENT is
    un-patchified to 32 channels at 1/8): the FLUX.1 AE's decoder with 32 latent channels (black-forest-labs/flux2
    ``AutoEncoderParams``: ch 128, ch_mult 1-2-4-4, 2 res blocks, z_channels 32; the same as diffusers'
    ``AutoencoderKLFlux2``), behind a 1x1 ``post_quant_conv`` 32 -> 32. Counted on the meta device."""

    params = dataclasses.replace(AE_PRESETS["flux1-ae"], z_channels=32)
    with torch.device("meta"):
        decoder = Decoder(params)
        post_quant_conv = torch.nn.Conv2d(32, 32, 1)
        z = torch.empty(batch, 32, latent_h, latent_w)
    return measure_flops(lambda: decoder(post_quant_conv(z))).total


@functools.lru_cache(maxsize=64)
def taesd_decode_flops(variant: str, latent_h: int, latent_w: int, batch: int = 1) -> int:
    """A TAESD-family tiny decoder decoding ``[batch, C, h, w]`` in its own latent (``taef1`` for FLUX.1 and
    Z-Image: the 16-channel LATENT at 1/8; ``taef2`` for FLUX.2: the 32-channel latent at 1/8, so a FLUX.2 LATENT
    ``[B, 128, H/16, W/16]`` is ``h, w = H/8, W/8`` here; its un-patchify is a permutation, no FLOPs)."""

    with torch.device("meta"):
        decoder = taesd.build_decoder(variant)
        z = torch.empty(batch, TINY_VARIANTS[variant].channels, latent_h, latent_w)
    return measure_flops(lambda: decoder(z)).total


@functools.lru_cache(maxsize=64)
def taehv_decode_flops(variant: str, latent_frames: int, latent_h: int, latent_w: int, batch: int = 1) -> int:
    """A TAEHV tiny video decoder (``taew2_1`` for Wan 2.1) decoding a whole ``latent_frames`` video (streaming
    it chunk by chunk costs the same: each latent frame runs through the stack once)."""

    config = TAEHV_CONFIGS[variant]
    with torch.device("meta"):
        model = TAEHV(config)
        z = torch.empty(batch, latent_frames, config.latent_channels, latent_h, latent_w)
    return measure_flops(lambda: model.decode_frames(z, None)).total


__all__ = ["flux_ae_decode_flops", "taehv_decode_flops", "taesd_decode_flops"]
