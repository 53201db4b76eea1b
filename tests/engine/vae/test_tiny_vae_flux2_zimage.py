"""Tiny VAE on the new image families (issue 16): taef2 on FLUX.2's 128-channel LATENT (an exact 2x2 patchify of
its 32-channel latent, as ComfyUI's taesd does), taef1 on Z-Image's 16-channel LATENT, and clear errors for a
tiny AE paired with the wrong latent."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from conftest import SHARED
from einops import rearrange

from fewstep.engine import TextCondition, load_tiny_vae, open_model
from fewstep.engine.latent_formats import FLUX1, FLUX2
from fewstep.engine.text_to_image import sample_latent
from fewstep.engine.vae.tiny import patchify_latent, unpatchify_latent, variants_for

WEIGHTS, DATA = SHARED / "weights", SHARED / "data"
HAVE_TAEF2 = (WEIGHTS / "taef2_encoder.pth").exists() and (WEIGHTS / "taef2_decoder.pth").exists()
needs_taef2 = pytest.mark.skipif(
    not HAVE_TAEF2, reason=f"real taef2 weights (taef2_encoder.pth, taef2_decoder.pth) not found in {WEIGHTS}"
)


def _photo(name: str) -> torch.Tensor:
    import numpy as np
    from PIL import Image

    img = np.asarray(Image.open(DATA / f"{name}.png").convert("RGB"))
    h, w = img.shape[0] // 16 * 16, img.shape[1] // 16 * 16
    return torch.from_numpy(img[:h, :w].copy()).permute(2, 0, 1)[None].float() / 255


def _psnr(a, b) -> float:
    return 10 * math.log10(1.0 / float(((a - b) ** 2).mean()))


def _pack_vae(pack, source):
    """A tiny VAE loaded by the pack as ComfyUI imports it (its errors are the nodes' InputError class)."""
    return importlib.import_module(f"{pack.__name__}.engine.vae.tiny").load_tiny_vae(
        source, device="cpu", dtype=torch.float32
    )


def _decode_node(pack):
    return pack.NODE_CLASS_MAPPINGS["FewStepTinyVAEDecode"]()


def _encode_node(pack):
    return pack.NODE_CLASS_MAPPINGS["FewStepTinyVAEEncode"]()


# -- the layout ---------------------------------------------------------------------------------------------------
def test_patchify_is_the_exact_inverse_and_matches_einops():
    z = torch.randn(2, 32, 6, 10, generator=torch.Generator().manual_seed(0))
    packed = patchify_latent(z, 2)
    assert packed.shape == (2, 128, 3, 5)
    # the FLUX.2 autoencoder's order: channel c * 4 + 2 * i + j holds pixel (2y + i, 2x + j) of channel c
    assert torch.equal(packed, rearrange(z, "b c (h i) (w j) -> b (c i j) h w", i=2, j=2))
    assert torch.equal(packed[:, 4 * 7 + 2 * 1 + 0, 2, 3], z[:, 7, 2 * 2 + 1, 2 * 3 + 0])
    assert torch.equal(unpatchify_latent(packed, 2), z)
    raw = torch.randn(1, 128, 4, 3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(
        unpatchify_latent(raw, 2), rearrange(raw, "b (c i j) h w -> b c (h i) (w j)", i=2, j=2)
    )
    assert torch.equal(patchify_latent(unpatchify_latent(raw, 2), 2), raw)
    assert patchify_latent(z, 1) is z and unpatchify_latent(z, 1) is z


def test_taef2_geometry_and_pairings():
    vae = load_tiny_vae("dummy:taef2", device="cpu", dtype=torch.float32)
    v = vae.variant
    assert (v.channels, v.raw_channels, v.spatial_factor, v.raw_downscale) == (32, 128, 8, 16)
    assert v.comfy_format == FLUX2
    assert [t.name for t in variants_for(FLUX2)] == ["taef2"]
    assert [t.name for t in variants_for(FLUX1)] == ["taef1"]  # FLUX.1 and Z-Image share the AE
    # the encoder's LATENT is FLUX.2's: [B, 128, H/16, W/16], exactly the patchified 32-channel latent
    x = torch.rand(2, 3, 48, 32, generator=torch.Generator().manual_seed(0))
    raw = vae.encode_raw(x)
    assert raw.shape == (2, 128, 3, 2)
    assert torch.equal(raw, rearrange(vae.encode(x), "b c (h i) (w j) -> b (c i j) h w", i=2, j=2))
    decoded = vae.decode_raw(raw)
    assert decoded.shape == (2, 3, 48, 32)
    assert torch.equal(decoded, vae.decode(vae.encode(x)))


# -- real pretrained taef2 -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def taef2_real():
    if not HAVE_TAEF2:
        pytest.skip(f"real taef2 weights (taef2_encoder.pth, taef2_decoder.pth) not found in {WEIGHTS}")
    return load_tiny_vae(WEIGHTS / "taef2_decoder.pth", device="cpu", dtype=torch.float32)


@needs_taef2
@pytest.mark.slow
def test_real_taef2_round_trip_through_the_128_channel_latent_is_the_32_channel_one(taef2_real):
    """The patching is a permutation, so the 128-channel path decodes to the very same pixels (same PSNR: measured
    31.19 dB on astronaut, 512x512, as the 32-channel path)."""
    x = _photo("astronaut")
    z = taef2_real.encode(x)
    raw = taef2_real.latent_to_raw(z)
    assert raw.shape == (1, 128, x.shape[-2] // 16, x.shape[-1] // 16)
    via_32 = taef2_real.decode(z)
    via_128 = taef2_real.decode_raw(raw)
    assert torch.equal(via_128, via_32)
    assert _psnr(via_128, x) == _psnr(via_32, x) >= 30.5
    # encode_raw is the same patchified latent (checked on a crop: one more encode of the whole photo is slow)
    crop = x[..., 128:256, 192:320]
    assert torch.equal(taef2_real.encode_raw(crop), patchify_latent(taef2_real.encode(crop), 2))


@needs_taef2
def test_real_taef2_nodes_round_trip_a_flux2_latent(pack, taef2_real):
    x = _photo("chelsea")[..., :128, :192]
    pixels = x.permute(0, 2, 3, 1)
    (latent,) = _encode_node(pack).encode(tiny_vae=taef2_real, pixels=pixels)
    assert latent["samples"].shape == (1, 128, 8, 12) and latent["samples"].dtype == torch.float32
    (image,) = _decode_node(pack).decode(tiny_vae=taef2_real, samples=latent)
    assert image.shape == (1, 128, 192, 3)
    expected = taef2_real.decode(taef2_real.encode(x)).permute(0, 2, 3, 1)
    assert torch.equal(image, expected)
    assert _psnr(image, pixels) > 27.0


# -- sampler output decodes -----------------------------------------------------------------------------------------
def test_a_zimage_sample_decodes_with_taef1(pack):
    handle = open_model("dummy:zimage-tiny", device="cpu", dtype=torch.float32)
    cond = TextCondition(
        torch.randn(1, 7, handle.params.cap_feat_dim, generator=torch.Generator().manual_seed(0))
    )
    raw, _ = sample_latent(
        handle, [cond], torch.zeros(1, 16, 4, 6), steps=2, schedule="flux.1-schnell", seed=3
    )
    assert raw.shape == (1, 16, 4, 6)
    taef1 = load_tiny_vae("dummy:taef1", device="cpu", dtype=torch.float32)
    (image,) = _decode_node(pack).decode(tiny_vae=taef1, samples={"samples": raw})
    assert image.shape == (1, 32, 48, 3)
    expected = taef1.decode((raw - 0.1159) * 0.3611)  # FLUX.1's scale and shift, Z-Image's too
    assert torch.allclose(image, expected.permute(0, 2, 3, 1), atol=1e-6)


def test_a_flux2_sample_decodes_with_taef2(pack):
    handle = open_model("dummy:flux2-tiny", device="cpu", dtype=torch.float32)
    cond = TextCondition(
        torch.randn(1, 5, handle.params.context_in_dim, generator=torch.Generator().manual_seed(0))
    )
    raw, _ = sample_latent(
        handle, [cond], torch.zeros(1, 128, 2, 3), steps=2, schedule="flux.1-schnell", seed=3
    )
    assert raw.shape == (1, 128, 2, 3)
    taef2 = load_tiny_vae("dummy:taef2", device="cpu", dtype=torch.float32)
    (image,) = _decode_node(pack).decode(tiny_vae=taef2, samples={"samples": raw})
    assert image.shape == (1, 32, 48, 3)
    expected = taef2.decode(rearrange(raw, "b (c i j) h w -> b c (h i) (w j)", i=2, j=2))
    assert torch.equal(image, expected.permute(0, 2, 3, 1))


# -- wrong pairings --------------------------------------------------------------------------------------------------
def test_wrong_tiny_ae_for_the_latent_is_an_error_naming_node_and_input(pack):
    taef1, taef2 = _pack_vae(pack, "dummy:taef1"), _pack_vae(pack, "dummy:taef2")
    with pytest.raises(
        ValueError,
        match=r"^FewStepTinyVAEDecode: input 'samples': taef1 \(FLUX.1, Z-Image, HiDream\) decodes 16-channel "
        r"latents \[batch, channels, height, width\]; got shape \[1, 128, 2, 2\]; a 128-channel image LATENT "
        r"decodes with taef2 \(FLUX.2\)$",
    ):
        _decode_node(pack).decode(tiny_vae=taef1, samples={"samples": torch.zeros(1, 128, 2, 2)})
    with pytest.raises(
        ValueError,
        match=r"^FewStepTinyVAEDecode: input 'samples': taef2 \(FLUX.2\) decodes flux2 LATENTs \[batch, 128, "
        r"height/16, width/16\] \(its 32-channel latent, 2x2-patchified\); got shape \[1, 16, 4, 4\]; a "
        r"16-channel image LATENT decodes with taesd3 \(SD3 / SD3.5\) or taef1 \(FLUX.1, Z-Image, HiDream\)$",
    ):
        _decode_node(pack).decode(tiny_vae=taef2, samples={"samples": torch.zeros(1, 16, 4, 4)})
    # taef2's own 32-channel latent is not a ComfyUI LATENT: the node wants FLUX.2's 128 channels
    with pytest.raises(
        ValueError, match=r"^FewStepTinyVAEDecode: input 'samples': taef2 .* got shape \[1, 32, 4, 4\]"
    ):
        _decode_node(pack).decode(tiny_vae=taef2, samples={"samples": torch.zeros(1, 32, 4, 4)})
    with pytest.raises(
        ValueError,
        match=r"^FewStepTinyVAEDecode: input 'samples': the latents: 512 of 512 values are NaN or infinite",
    ):
        _decode_node(pack).decode(
            tiny_vae=taef2, samples={"samples": torch.full((1, 128, 2, 2), float("nan"))}
        )
    with pytest.raises(
        ValueError,
        match=r"^FewStepTinyVAEEncode: input 'pixels': taef2 needs height and width divisible by 16; "
        r"got 24x32",
    ):
        _encode_node(pack).encode(tiny_vae=taef2, pixels=torch.rand(1, 24, 32, 3))
