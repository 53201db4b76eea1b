"""Bytes in and out of a live session: client images -> frames, chunk frames -> JPEG / animated WebP, chunk
latents -> safetensors. Pillow is imported inside the functions (an optional dependency of the engine; ComfyUI
ships it)."""

from __future__ import annotations

import io
import math

import torch

from ..latent_formats import WAN21
from .protocol import LiveError

# a decoded client image is at most this many pixels (a PNG of a few KB can claim a huge canvas)
MAX_IMAGE_PIXELS = 8192 * 8192
LATENT_KEY = "latent"  # the key of a chunk's latents file, as stream --out writes it


def _pil():
    try:
        from PIL import Image
    except ImportError as exc:  # ComfyUI ships Pillow; a bare engine install may not
        raise LiveError(400, "image", "decoding images needs Pillow (pip install pillow)") from exc
    return Image


def decode_image(data: bytes, width: int, height: int, field: str = "image") -> torch.Tensor:
    """PNG / JPEG bytes -> ``[3, height, width]`` float32 RGB in [0, 1]: scaled to cover the size (aspect kept,
    bicubic) and center-cropped. A :class:`~.protocol.LiveError` 400 when the bytes are no such image or it is
    larger than :data:`MAX_IMAGE_PIXELS`."""
    Image = _pil()
    try:
        image = Image.open(io.BytesIO(data))
        if image.format not in ("PNG", "JPEG"):
            raise LiveError(400, field, f"expected a PNG or JPEG image, got {image.format}")
        w, h = image.size
        if w * h > MAX_IMAGE_PIXELS or w < 1 or h < 1:
            raise LiveError(400, field, f"a {w}x{h} image; at most {MAX_IMAGE_PIXELS} pixels")
        image = image.convert("RGB")
    except LiveError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise LiveError(400, field, f"not a readable PNG or JPEG image ({type(exc).__name__})") from None
    scale = max(width / w, height / h)
    covered = (max(width, math.ceil(w * scale - 1e-6)), max(height, math.ceil(h * scale - 1e-6)))
    if covered != (w, h):
        image = image.resize(covered, Image.Resampling.BICUBIC)
    left, top = (covered[0] - width) // 2, (covered[1] - height) // 2
    image = image.crop((left, top, left + width, top + height))
    array = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(height, width, 3)
    return array.permute(2, 0, 1).float().div_(255.0)


def _uint8_frames(frames: torch.Tensor):
    """``[k, 3, H, W]`` in [0, 1] -> Pillow images."""
    Image = _pil()
    array = (
        (frames.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    )
    return [Image.fromarray(a) for a in array]


def frames_to_jpeg(frames: torch.Tensor, quality: int = 80) -> list[bytes]:
    """``[k, 3, H, W]`` in [0, 1] -> one baseline JPEG per frame."""
    out = []
    for image in _uint8_frames(frames):
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=quality)
        out.append(buffer.getvalue())
    return out


def frames_to_webp(frames: torch.Tensor, fps: float = 16.0) -> bytes:
    """``[k, 3, H, W]`` in [0, 1] -> a looping animated WebP clip (quality 90, the fastest encoder method)."""
    images = _uint8_frames(frames)
    buffer = io.BytesIO()
    images[0].save(buffer, format="WEBP", save_all=True, append_images=images[1:], duration=round(1000 / fps),
                   loop=0, quality=90, method=0)  # fmt: skip
    return buffer.getvalue()


def latents_to_safetensors(latents: torch.Tensor) -> bytes:
    """A chunk's latents (model latent space ``[1, 16, F, h, w]``) -> safetensors bytes with key ``latent`` in the
    raw Wan 2.1 layout (``WAN21.process_out`` applied, float32), as ``stream --out`` writes them."""
    from safetensors.torch import save

    return save({LATENT_KEY: WAN21.process_out(latents.detach().float().cpu()).contiguous()})


def raw_latents_of(data: bytes) -> torch.Tensor:
    """The inverse of :func:`latents_to_safetensors` up to the layout: the raw Wan 2.1 latents it holds."""
    from safetensors.torch import load

    return load(data)[LATENT_KEY]
