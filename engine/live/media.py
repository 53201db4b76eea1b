"""Bytes in and out of a live session: client images -> frames, chunk frames -> JPEG / animated WebP, chunk
latents -> safetensors. Pillow is imported inside the functions (an optional dependency of the engine)."""

from __future__ import annotations

import torch


def decode_image(data: bytes, width: int, height: int, field: str = "image") -> torch.Tensor:
    """PNG / JPEG bytes -> ``[3, height, width]`` float32 RGB in [0, 1]: scaled to cover the size (aspect kept)
    and center-cropped. A :class:`~.protocol.LiveError` 400 when the bytes are no image."""
    raise NotImplementedError


def frames_to_jpeg(frames: torch.Tensor, quality: int = 80) -> list[bytes]:
    """``[k, 3, H, W]`` in [0, 1] -> one JPEG per frame."""
    raise NotImplementedError


def frames_to_webp(frames: torch.Tensor, fps: float = 16.0) -> bytes:
    """``[k, 3, H, W]`` in [0, 1] -> an animated WebP clip (looping)."""
    raise NotImplementedError


def latents_to_safetensors(latents: torch.Tensor) -> bytes:
    """A chunk's latents (model latent space ``[1, 16, F, h, w]``) -> safetensors bytes with key ``latent`` in the
    raw Wan 2.1 layout (``WAN21.process_out`` applied, float32), as ``stream --out`` writes them."""
    raise NotImplementedError
