"""Live media: client images scaled to cover and center-cropped; chunk frames to JPEG / WebP; chunk latents to
safetensors bytes in the raw Wan 2.1 layout."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from fewstep.engine.latent_formats import WAN21
from fewstep.engine.live import LiveError
from fewstep.engine.live.media import (
    decode_image,
    frames_to_jpeg,
    frames_to_webp,
    latents_to_safetensors,
    raw_latents_of,
)


def png(array) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def striped(width: int, height: int):
    """Columns coloured by their x: 0..width-1 in the red channel, so a crop is readable."""
    import numpy as np

    a = np.zeros((height, width, 3), dtype=np.uint8)
    a[..., 0] = np.arange(width, dtype=np.uint8)[None, :]
    a[..., 1] = np.arange(height, dtype=np.uint8)[:, None]
    return a


def test_an_image_of_the_sessions_size_comes_back_unchanged():
    a = striped(48, 32)
    got = decode_image(png(a), 48, 32)
    assert got.shape == (3, 32, 48) and got.dtype == torch.float32
    assert torch.equal((got * 255).round().to(torch.uint8).permute(1, 2, 0), torch.from_numpy(a))


def test_a_wider_image_is_center_cropped_after_covering_the_height():
    a = striped(80, 32)  # same height: no scaling, 16 columns cut on each side
    got = decode_image(png(a), 48, 32)
    assert torch.equal((got[0, 0] * 255).round().to(torch.uint8), torch.arange(16, 64, dtype=torch.uint8))


def test_a_smaller_image_is_scaled_up_to_cover():
    got = decode_image(png(striped(24, 24)), 48, 32)  # scaled 2x to 48x48, then 8 rows cut top and bottom
    assert got.shape == (3, 32, 48)


@pytest.mark.parametrize("data", [b"not an image", b"\x89PNG\r\n\x1a\n" + b"\0" * 20])
def test_bytes_that_are_no_image_are_refused_naming_the_field(data):
    with pytest.raises(LiveError) as err:
        decode_image(data, 48, 32, "start_image")
    assert err.value.status == 400 and err.value.field == "start_image"
    assert err.value.text.startswith("start_image: not a readable PNG or JPEG image")


def test_other_formats_are_refused():
    buffer = io.BytesIO()
    Image.fromarray(striped(8, 8)).save(buffer, format="GIF")
    with pytest.raises(LiveError, match="expected a PNG or JPEG image, got GIF"):
        decode_image(buffer.getvalue(), 8, 8)


def test_frames_to_jpeg_and_webp():
    frames = torch.rand(5, 3, 32, 48, generator=torch.Generator().manual_seed(0))
    jpegs = frames_to_jpeg(frames, quality=70)
    assert len(jpegs) == 5 and all(j.startswith(b"\xff\xd8") for j in jpegs)
    assert Image.open(io.BytesIO(jpegs[0])).size == (48, 32)
    clip = Image.open(io.BytesIO(frames_to_webp(frames, fps=16)))
    assert clip.format == "WEBP" and clip.n_frames == 5 and clip.size == (48, 32)


def test_latents_are_written_raw_under_the_key_latent():
    latents = torch.randn(1, 16, 2, 4, 6, generator=torch.Generator().manual_seed(1))
    assert torch.equal(raw_latents_of(latents_to_safetensors(latents)), WAN21.process_out(latents))
