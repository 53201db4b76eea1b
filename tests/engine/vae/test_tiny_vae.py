"""Tiny autoencoders: the TAESD family with its original key layout, real pretrained weights, conventions.

Tiny VAE on the new image families (issue 16): taef2 on FLUX.2's 128-channel LATENT (an exact 2x2 patchify of
its 32-channel latent, as ComfyUI's taesd does), taef1 on Z-Image's 16-channel LATENT, and clear errors for a
tiny AE paired with the wrong latent."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import SHARED
from einops import rearrange

from fewstep.engine import CheckpointError, InputError, TextCondition, load_tiny_vae, open_model
from fewstep.engine.latent_formats import FLUX1, FLUX2
from fewstep.engine.text_to_image import sample_latent
from fewstep.engine.vae import TINY_VARIANTS
from fewstep.engine.vae.taesd import TAESD_VARIANTS, build_decoder, build_encoder, detect_taesd
from fewstep.engine.vae.tiny import patchify_latent, unpatchify_latent, variants_for
from fewstep.engine.weights import dummy_init_

WEIGHTS, DATA = SHARED / "weights", SHARED / "data"


def _save_pair(tmp_path: Path, variant: str, seed: int = 0) -> tuple[Path, Path]:
    enc, dec = build_encoder(variant), build_decoder(variant)
    dummy_init_(enc, seed)
    dummy_init_(dec, seed + 1)
    enc_path, dec_path = tmp_path / f"{variant}_encoder.pth", tmp_path / f"{variant}_decoder.pth"
    torch.save(enc.state_dict(), enc_path)
    torch.save(dec.state_dict(), dec_path)
    return enc_path, dec_path


def _load_photo(name: str) -> torch.Tensor:
    import numpy as np
    from PIL import Image

    img = np.asarray(Image.open(DATA / f"{name}.png").convert("RGB"))
    h, w = img.shape[0] // 16 * 16, img.shape[1] // 16 * 16
    return torch.from_numpy(img[:h, :w].copy()).permute(2, 0, 1)[None].float() / 255


def _psnr(a, b) -> float:
    return 10 * math.log10(1.0 / float(((a - b) ** 2).mean()))


@pytest.mark.skipif(
    not (WEIGHTS / "taef2_encoder.pth").exists(), reason=f"real taef2 weights not found in {WEIGHTS}"
)
@pytest.mark.parametrize("photo,floor", [("astronaut", 29.0), ("coffee", 29.0), ("chelsea", 29.0)])
@pytest.mark.slow
def test_real_taef2_round_trip_psnr(photo, floor):
    # measured: astronaut 31.19 dB, coffee 29.62 dB (400x592), chelsea 32.70 dB (288x448)
    vae = load_tiny_vae(WEIGHTS / "taef2_decoder.pth", device="cpu", dtype=torch.float32)
    assert vae.variant.name == "taef2" and vae.encoder is not None  # the encoder beside it came along
    x = _load_photo(photo)
    latent = vae.encode(x)
    assert latent.shape == (1, 32, x.shape[-2] // 8, x.shape[-1] // 8)
    assert _psnr(vae.decode(latent), x) >= floor


@pytest.mark.parametrize("variant", list(TAESD_VARIANTS))
def test_every_variant_loads_its_original_layout(tmp_path, variant):
    enc_path, dec_path = _save_pair(tmp_path, variant)
    vae = load_tiny_vae(dec_path, device="cpu")
    assert vae.variant.name == variant  # ties (taesd/taesdxl, taesd3/taef1) broken by the file name
    channels = TINY_VARIANTS[variant].channels
    factor = TINY_VARIANTS[variant].spatial_factor
    out = vae.decode(torch.randn(1, channels, 2, 3))
    assert out.shape == (1, 3, 2 * factor, 3 * factor) and out.min() >= 0 and out.max() <= 1
    assert vae.encode(torch.rand(1, 3, 64, 64)).shape == (1, channels, 64 // factor, 64 // factor)
    # decoding after loading from the file equals decoding with the saved modules
    dec = build_decoder(variant)
    dec.load_state_dict(torch.load(dec_path, weights_only=True))
    z = torch.randn(1, channels, 2, 2)
    with torch.no_grad():
        assert torch.allclose(vae.decode(z), dec(z).clamp(0, 1), atol=1e-5)  # channels_last kernels


def test_key_layout_matches_the_published_files():
    dec = build_decoder("taef2").state_dict()
    enc = build_encoder("taef2").state_dict()
    assert dec["1.weight"].shape == (64, 32, 3, 3)  # index 0 is the clamp
    assert dec["3.conv.0.weight"].shape == (64, 64, 3, 3) and dec["3.pool.0.weight"].shape == (256, 64, 1, 1)
    assert dec["3.pool.1.weight"].shape == (256,)  # GroupNorm(4, 256)
    assert enc["0.weight"].shape == (64, 3, 3, 3) and enc["11.pool.3.weight"].shape == (64, 256, 1, 1)
    assert "4.pool.0.weight" not in enc  # only the deepest blocks pool
    if (WEIGHTS / "taef2_decoder.pth").exists():
        real = torch.load(WEIGHTS / "taef2_decoder.pth", weights_only=True)
        assert {k: tuple(v.shape) for k, v in real.items()} == {k: tuple(v.shape) for k, v in dec.items()}
    sana = build_decoder("taesana").state_dict()
    assert sana["1.weight"].shape == (256, 32, 3, 3)


def _state(module) -> dict:
    return {k: v.detach().float() for k, v in module.state_dict().items()}


def test_diffusers_layout_of_the_hugging_face_taef1_loads_as_taef1(tmp_path):
    """madebyollin/taef1 on Hugging Face is diffusers' AutoencoderTiny (``encoder.layers.N`` /
    ``decoder.layers.N``, both parts in one file): written here by diffusers itself, it loads and decodes /
    encodes as diffusers' own modules do."""
    diffusers = pytest.importorskip("diffusers")
    from safetensors.torch import save_file

    reference = diffusers.AutoencoderTiny(latent_channels=16).eval()
    dummy_init_(reference, 3)
    save_file(
        {k: v.contiguous() for k, v in reference.state_dict().items()}, str(tmp_path / "taef1.safetensors")
    )
    vae = load_tiny_vae(tmp_path / "taef1.safetensors", device="cpu", dtype=torch.float32)
    assert vae.variant.name == "taef1" and vae.encoder is not None and vae.decoder is not None
    z = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    images = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # diffusers' tiny decoder gives [-1, 1] and its encoder takes [-1, 1]; the pack's work in [0, 1]
        expected_images = ((reference.decoder(z) + 1) / 2).clamp(0, 1)
        expected_latents = reference.encoder(images * 2 - 1)
        assert torch.allclose(vae.decode(z), expected_images, atol=1e-5)
        assert torch.allclose(vae.encode(images), expected_latents, atol=1e-4)


def _diffusers_layout(encoder, decoder) -> dict:
    """The TAESD modules' tensors under diffusers' names (the taef2 model card's remap, run backwards)."""
    out = {f"encoder.layers.{k}": v for k, v in encoder.state_dict().items()}
    for key, value in decoder.state_dict().items():
        index, rest = key.split(".", 1)
        out[f"decoder.layers.{int(index) - 1}.{rest}"] = value
    return out


def test_diffusers_layout_of_the_hugging_face_taef2_equals_the_pth_pair(tmp_path):
    """madebyollin/taef2's taef2.safetensors: diffusers' names (the pooling branch included), both parts."""
    from safetensors.torch import save_file

    enc_path, dec_path = _save_pair(tmp_path, "taef2")
    enc, dec = build_encoder("taef2"), build_decoder("taef2")
    enc.load_state_dict(torch.load(enc_path, weights_only=True))
    dec.load_state_dict(torch.load(dec_path, weights_only=True))
    layout = _diffusers_layout(enc, dec)
    assert "decoder.layers.2.pool.0.weight" in layout and "encoder.layers.11.pool.3.weight" in layout
    save_file({k: v.contiguous() for k, v in layout.items()}, str(tmp_path / "taef2.safetensors"))
    combined = load_tiny_vae(tmp_path / "taef2.safetensors", device="cpu", dtype=torch.float32)
    pair = load_tiny_vae(dec_path, device="cpu", dtype=torch.float32)
    assert combined.variant.name == pair.variant.name == "taef2"
    for part in ("encoder", "decoder"):
        a, b = _state(getattr(combined, part)), _state(getattr(pair, part))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part


def test_the_loader_node_lists_and_loads_the_safetensors_file_as_the_pth_pair(tmp_path, monkeypatch, pack):
    from fake_folder_paths import make_folder_paths
    from safetensors.torch import save_file

    monkeypatch.setitem(sys.modules, "folder_paths", make_folder_paths(tmp_path))
    folder = tmp_path / "models" / "vae_approx"
    folder.mkdir(parents=True)
    enc_path, dec_path = _save_pair(folder, "taef1")
    enc, dec = build_encoder("taef1"), build_decoder("taef1")
    enc.load_state_dict(torch.load(enc_path, weights_only=True))
    dec.load_state_dict(torch.load(dec_path, weights_only=True))
    save_file(
        {k: v.contiguous() for k, v in _diffusers_layout(enc, dec).items()}, str(folder / "taef1.safetensors")
    )
    loader = pack.NODE_CLASS_MAPPINGS["FewStepTinyVAELoader"]
    listed = loader.INPUT_TYPES()["required"]["vae_name"][0]
    assert {"taef1.safetensors", "taef1_encoder.pth", "taef1_decoder.pth"} <= set(listed)
    (combined,) = loader().load("taef1.safetensors", "fp32")
    (pair,) = loader().load("taef1_decoder.pth", "fp32")
    assert combined.variant.name == pair.variant.name == "taef1"
    for part in ("encoder", "decoder"):
        a, b = _state(getattr(combined, part)), _state(getattr(pair, part))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part


def test_detection_from_tensors():
    for variant in TAESD_VARIANTS:
        part, found = detect_taesd(build_decoder(variant).state_dict())
        assert part == "decoder" and variant in found
        part, found = detect_taesd(build_encoder(variant).state_dict())
        assert part == "encoder" and variant in found
    assert detect_taesd({"img_in.weight": torch.zeros(2, 2)}) is None


def test_ambiguous_files_need_a_name_or_variant(tmp_path):
    dec = build_decoder("taef1")
    torch.save(dec.state_dict(), tmp_path / "my_preview_decoder.pth")
    with pytest.raises(InputError, match="fits taef1 and taesd3 equally"):
        load_tiny_vae(tmp_path / "my_preview_decoder.pth")
    assert load_tiny_vae(tmp_path / "my_preview_decoder.pth", variant="taesd3").variant.name == "taesd3"
    with pytest.raises(InputError, match="holds a taef1/taesd3 autoencoder, not taef2"):
        load_tiny_vae(tmp_path / "my_preview_decoder.pth", variant="taef2")


def test_mismatched_and_bad_files(tmp_path):
    from safetensors.torch import save_file

    save_file(
        {"img_in.weight": torch.zeros(4, 4), "double_blocks.0.x": torch.zeros(1)},
        str(tmp_path / "dit.safetensors"),
    )
    with pytest.raises(CheckpointError, match=r"(?s)not a tiny autoencoder this pack knows.*img_in \(1\)"):
        load_tiny_vae(tmp_path / "dit.safetensors")
    torch.save({"epoch": 3, "note": "hi"}, tmp_path / "notes.pth")
    with pytest.raises(CheckpointError, match="does not hold a state dict of tensors"):
        load_tiny_vae(tmp_path / "notes.pth")
    sd = build_decoder("taesd").state_dict()
    del sd["3.conv.2.bias"]
    torch.save(sd, tmp_path / "taesd_decoder.pth")
    with pytest.raises(CheckpointError, match=r"missing keys: 3\.conv\.2\.bias"):
        load_tiny_vae(tmp_path / "taesd_decoder.pth")
    with pytest.raises(InputError, match="unknown tiny VAE 'dummy:taesd9'"):
        load_tiny_vae("dummy:taesd9")


def test_decoder_only_file_cannot_encode(tmp_path):
    torch.save(build_decoder("taef1").state_dict(), tmp_path / "taef1_decoder.pth")
    vae = load_tiny_vae(tmp_path / "taef1_decoder.pth")
    assert vae.encoder is None
    with pytest.raises(InputError, match="loaded without its encoder"):
        vae.encode(torch.rand(1, 3, 16, 16))


@pytest.mark.parametrize(
    "variant,scale,shift",
    [
        ("taesd", 0.18215, 0.0),
        ("taesdxl", 0.13025, 0.0),
        ("taesd3", 1.5305, 0.0609),
        ("taef1", 0.3611, 0.1159),
        ("taesana", 0.41407, 0.0),
    ],
)
def test_raw_latent_conversion_per_family(variant, scale, shift):
    vae = load_tiny_vae(f"dummy:{variant}")
    c = vae.variant.channels
    raw = torch.randn(2, c, 3, 4)
    assert torch.allclose(vae.raw_to_latent(raw), (raw - shift) * scale)
    assert torch.allclose(vae.latent_to_raw(vae.raw_to_latent(raw)), raw, atol=1e-6)


def test_taef2_raw_latent_is_flux2s_128_channel_latent():
    """No scale or shift; ComfyUI's FLUX.2 LATENT [B, 128, h, w] is taef2's [B, 32, 2h, 2w] 2x2-patchified
    (the FLUX.2 tests below check the layout against einops and the real weights)."""
    vae = load_tiny_vae("dummy:taef2")
    raw = torch.randn(2, 128, 3, 4)
    latent = vae.raw_to_latent(raw)
    assert latent.shape == (2, 32, 6, 8)
    assert torch.equal(vae.latent_to_raw(latent), raw)


def test_wan_conversion_is_per_channel():
    from fewstep.engine.latent_formats import WAN21

    raw = torch.randn(1, 16, 2, 3, 4)
    mean = torch.tensor(WAN21.shift).view(1, 16, 1, 1, 1)
    std = torch.tensor(WAN21.std).view(1, 16, 1, 1, 1)
    assert torch.allclose(WAN21.process_in(raw), (raw - mean) / std)
    assert torch.allclose(WAN21.process_out(WAN21.process_in(raw)), raw, atol=1e-6)


def test_bad_inputs_name_what_was_expected():
    vae = load_tiny_vae("dummy:taef1")
    with pytest.raises(
        InputError,
        match=r"taef1 \(FLUX.1, Z-Image, HiDream\) decodes 16-channel latents .* got shape \[1, 4, 8, 8\]",
    ):
        vae.decode(torch.randn(1, 4, 8, 8))
    with pytest.raises(
        InputError, match="video latent .* image-only tiny AE taef1; decode video with a TAEHV variant"
    ):
        vae.decode(torch.randn(1, 16, 3, 8, 8))
    bad = torch.rand(1, 3, 16, 16)
    bad[0, 0, 0, 0] = -1.0
    with pytest.raises(InputError, match=r"image values must be in \[0, 1\]; got \[-1.000"):
        vae.encode(bad)
    with pytest.raises(
        InputError, match=r"encodes RGB images \[N, 3, H, W\]; got shape \[1, 16, 16, 3\] \(channels last"
    ):
        vae.encode(torch.rand(1, 16, 16, 3))
    with pytest.raises(InputError, match="needs height and width divisible by 8; got 12x16"):
        vae.encode(torch.rand(1, 3, 12, 16))


@pytest.mark.parametrize("variant", ["taew2_1", "taew2_2"])
@pytest.mark.slow
def test_stream_decoder_equals_whole_video_decode(variant):
    vae = load_tiny_vae(f"dummy:{variant}", device="cpu", dtype=torch.float32)
    c = vae.variant.channels
    latents = torch.randn(1, c, 6, 4, 6, generator=torch.Generator().manual_seed(0))
    whole = vae.decode(latents)
    assert whole.shape == (1, 21, 3, 4 * vae.variant.spatial_factor, 6 * vae.variant.spatial_factor)
    for chunks in ([1] * 6, [2, 2, 2], [3, 3], [3, 1, 2]):
        stream = vae.stream_decoder()
        parts, start = [], 0
        for n in chunks:
            parts.append(stream.push(latents[:, :, start : start + n]))
            start += n
        streamed = torch.cat(parts, dim=1)
        assert streamed.shape == whole.shape and stream.frames_decoded == 21
        assert (streamed - whole).abs().max() <= 1e-5, chunks
    with pytest.raises(InputError, match="is an image autoencoder; streaming decode is for video"):
        load_tiny_vae("dummy:taef1").stream_decoder()


def test_a_file_with_malformed_diffusers_names_is_a_clear_error(tmp_path):
    """``encoder.layers.x.weight`` (no index) is not diffusers' layout: refused by the strict loader, naming the
    file, not a bare ValueError from the renumbering."""
    from safetensors.torch import save_file

    save_file({"encoder.layers.x.weight": torch.zeros(1), "decoder.layers.1": torch.zeros(1)},
              str(tmp_path / "bad.safetensors"))  # fmt: skip
    with pytest.raises(InputError, match="bad.safetensors"):
        load_tiny_vae(tmp_path / "bad.safetensors", device="cpu")


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
