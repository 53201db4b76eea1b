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
    name: str
    channels: int
    scale: float | tuple[float, ...]
    shift: float | tuple[float, ...]
    spatial_factor: int = 8

    def _param(self, value, x: torch.Tensor) -> torch.Tensor | float:
        if isinstance(value, tuple):
            shape = [1, len(value)] + [1] * (x.ndim - 2)
            return torch.tensor(value, dtype=x.dtype, device=x.device).view(shape)
        return value

    def process_in(self, raw: torch.Tensor) -> torch.Tensor:
        return (raw - self._param(self.shift, raw)) * self._param(self.scale, raw)

    def process_out(self, latent: torch.Tensor) -> torch.Tensor:
        return latent / self._param(self.scale, latent) + self._param(self.shift, latent)


# FLUX.1 autoencoder: black-forest-labs/flux util.py (scale_factor 0.3611, shift_factor 0.1159), the same
# numbers as ComfyUI's comfy.latent_formats.Flux.
FLUX1 = LatentFormat("flux1", channels=16, scale=0.3611, shift=0.1159)
