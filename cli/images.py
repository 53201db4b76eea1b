"""Writing decoded images from the CLI (Pillow, which ComfyUI ships; `pip install pillow`)."""

from __future__ import annotations

import os

import torch

from ..engine.errors import InputError
from ..engine.vae import load_tiny_vae


def save_png(images: torch.Tensor, out_dir: str, stem: str) -> list[str]:
    """``images [N, 3, H, W]`` in [0, 1] -> ``<stem>.png`` (``<stem>_<i>.png`` for a batch)."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise InputError("--decode", "writing PNG needs Pillow: pip install pillow") from exc
    paths = []
    for i, img in enumerate(images):
        array = (img.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
        path = os.path.join(out_dir, f"{stem}.png" if len(images) == 1 else f"{stem}_{i}.png")
        Image.fromarray(array).save(path)
        paths.append(path)
    return paths


def decode_raw(raw: torch.Tensor, how: str, tiny_vae: str, ae: str, device="cpu") -> torch.Tensor:
    """Decode a ComfyUI LATENT with a tiny AE of its space (taef1, taef2) or the full FLUX.1 autoencoder."""
    if how == "tiny":
        vae = load_tiny_vae(tiny_vae, device=device, input_name="--tiny-vae")
        return vae.decode_raw(raw, "--tiny-vae").float().cpu()
    from ..engine.vae.flux_ae import load_flux_ae

    with torch.inference_mode():
        return load_flux_ae(ae, device=device, input_name="--ae").decode(raw).float().cpu()
