"""Bytes in and out of a live session: client images -> frames, chunk frames -> JPEG / animated WebP, chunk
latents -> safetensors. Pillow is imported inside the functions (an optional dependency of the engine; ComfyUI
ships it)."""

from __future__ import annotations

import io
import math

import torch

from ..latent_formats import WAN21
from ..vae.taehv import TAEHVStreamEncoder
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


def start_latents(tiny_vae, image: torch.Tensor) -> torch.Tensor:
    """A start image ``[3, H, W]`` in [0, 1] (:func:`decode_image`'s) -> the model-space latents ``[1, 16, 1, h, w]``
    ``SessionPool.prefill`` takes for image to video: the tiny VAE's encoding of that one frame, as raw Wan 2.1
    latents, then ``WAN21.process_in``. The live service and ``stream --script`` both start an image this way."""
    with torch.inference_mode():
        raw = tiny_vae.encode_raw(image[None, None].clamp(0, 1))
    return WAN21.process_in(raw.float().cpu())


def input_latents(tiny_vae, encoder: TAEHVStreamEncoder, frames: torch.Tensor) -> torch.Tensor:
    """A chunk's input frames ``[4k, 3, H, W]`` in [0, 1] -> the model-space latents ``[1, 16, k, h, w]``
    ``SessionPool.feed`` takes for video to video: encoded by ``encoder`` (one
    :class:`~engine.vae.taehv.TAEHVStreamEncoder` per session, over ``tiny_vae.video``, so chunk after chunk equals
    the whole input video encoded at once), as raw Wan 2.1 latents, then ``WAN21.process_in``."""
    with torch.inference_mode():
        z = encoder.push(frames[None].to(tiny_vae.device, tiny_vae.dtype))  # [1, k, C, h, w]
        raw = tiny_vae.latent_to_raw(z.transpose(1, 2).float())
    return WAN21.process_in(raw.float().cpu())
