"""Latent conventions: ComfyUI's raw VAE latent space <-> the space a diffusion model works in.

A ComfyUI ``LATENT`` holds the VAE encoder's raw output. Each model family trains on a normalised version;
``process_in`` maps raw -> model space before sampling and ``process_out`` maps back afterwards, so the
sampler's output decodes with ComfyUI's own ``VAEDecode``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LatentFormat:
    """``model = (raw - shift) * scale / std``; ``shift`` and ``std`` may be per channel (dim 1).

    ``downscale``: image pixels per latent pixel along each side (8 for most VAEs; 16 for FLUX.2, whose VAE
    patchifies its 32-channel latent 2x2 into 128 channels)."""

    name: str
    channels: int
    scale: float = 1.0
    shift: float | tuple[float, ...] = 0.0
    std: tuple[float, ...] | None = None
    downscale: int = 8

    def _param(self, value, x: torch.Tensor) -> torch.Tensor | float:
        if isinstance(value, tuple):
            shape = [1, len(value)] + [1] * (x.ndim - 2)
            return torch.tensor(value, dtype=x.dtype, device=x.device).view(shape)
        return value

    def process_in(self, raw: torch.Tensor) -> torch.Tensor:
        out = (raw - self._param(self.shift, raw)) * self.scale
        return out if self.std is None else out / self._param(self.std, raw)

    def process_out(self, latent: torch.Tensor) -> torch.Tensor:
        out = latent if self.std is None else latent * self._param(self.std, latent)
        return out / self.scale + self._param(self.shift, latent)


# FLUX.1 autoencoder: black-forest-labs/flux util.py (scale_factor 0.3611, shift_factor 0.1159), the same
# numbers as ComfyUI's comfy.latent_formats.Flux.
FLUX1 = LatentFormat("flux1", channels=16, scale=0.3611, shift=0.1159)

# Image autoencoders, as ComfyUI's comfy.latent_formats and the models' own configs give them.
SD15 = LatentFormat("sd15", channels=4, scale=0.18215)
SDXL = LatentFormat("sdxl", channels=4, scale=0.13025)
SD3 = LatentFormat("sd3", channels=16, scale=1.5305, shift=0.0609)
# FLUX.2: ComfyUI's LATENT (comfy.latent_formats.Flux2: 128 channels, spacial_downscale_ratio 16, process_in and
# process_out the identity). ComfyUI's FLUX.2 VAE (comfy/sd.py: a VAE file with ``bn.running_mean`` gets
# ``batch_norm_latent``) already applies the official autoencoder's latent normalization: encode = the
# 32-channel latent, 2x2-patchified to 128 channels, then the batch-norm with the AE's running statistics;
# decode undoes both. So the LATENT *is* the transformer's input space, as in black-forest-labs/flux2.
FLUX2 = LatentFormat("flux2", channels=128, downscale=16)
# The 32-channel FLUX.2 VAE latent before that patching, the space TAEF2 works in (ComfyUI's taesd decodes a
# 128-channel FLUX.2 LATENT by un-patchifying it to these 32 channels and encodes by patchifying back).
FLUX2_RAW = LatentFormat("flux2-raw", channels=32)
# Sana's DC-AE f32c32 (mit-han-lab dc-ae-f32c32-sana-1.0: scaling_factor 0.41407).
SANA_DCAE = LatentFormat("sana-dcae", channels=32, scale=0.41407)

# Video autoencoders (ComfyUI comfy.latent_formats.Wan21 / Wan22 / HunyuanVideo).
WAN21 = LatentFormat(
    "wan2.1",
    channels=16,
    shift=(-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
           0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921),
    std=(2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
         3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160),
)  # fmt: skip
WAN22 = LatentFormat(
    "wan2.2",
    channels=48,
    shift=(-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
           -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
           -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
           -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
           -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
           0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667),
    std=(0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
         0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
         0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
         0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
         0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
         0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744),
)  # fmt: skip
HUNYUAN_VIDEO = LatentFormat("hunyuan-video", channels=16, scale=0.476986)
# The Wan 2.1 VAE latent as the VAE gives it (ComfyUI's Wan LATENT), before WAN21's per-channel normalization:
# the space LightX2V's lighttaew2_1 works in (LightX2V WanVAE_tiny need_scaled=True un-normalizes before its
# decoder; ComfyUI 0.8.0's VAELoader decodes a LATENT with it unscaled), unlike madebyollin's taew2_1.
WAN21_RAW = LatentFormat("wan2.1-raw", channels=16)
