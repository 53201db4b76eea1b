"""FLUX.1 autoencoder: official key layout, loading, raw-latent decode mapping, deterministic encode."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import save_file

from fewstep.engine.errors import CheckpointError, InputError
from fewstep.engine.vae.flux_ae import AE_PRESETS, FluxAutoencoder, load_flux_ae

TINY = "dummy:flux1-ae-tiny"
RESNET = r"block\.{b}\.(norm1|conv1|norm2|conv2)\.(weight|bias)"
ATTN = r"mid\.attn_1\.(norm|q|k|v|proj_out)\.(weight|bias)"
MID = r"mid\.block_[12]\.(norm1|conv1|norm2|conv2)\.(weight|bias)"
# The key set of black-forest-labs/flux ae.safetensors, as patterns: 4 levels, 2 (encoder) or 3 (decoder)
# residual blocks per level, a shortcut conv only where the width changes, no attention outside the mid block.
OFFICIAL_PATTERNS = [
    r"encoder\.(conv_in|norm_out|conv_out)\.(weight|bias)",
    rf"encoder\.down\.[0-3]\.{RESNET.format(b='[01]')}",
    r"encoder\.down\.[12]\.block\.0\.nin_shortcut\.(weight|bias)",
    r"encoder\.down\.[0-2]\.downsample\.conv\.(weight|bias)",
    rf"encoder\.{MID}",
    rf"encoder\.{ATTN}",
    r"decoder\.(conv_in|norm_out|conv_out)\.(weight|bias)",
    rf"decoder\.up\.[0-3]\.{RESNET.format(b='[0-2]')}",
    r"decoder\.up\.[01]\.block\.0\.nin_shortcut\.(weight|bias)",
    r"decoder\.up\.[1-3]\.upsample\.conv\.(weight|bias)",
    rf"decoder\.{MID}",
    rf"decoder\.{ATTN}",
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These convolutions are tiny: one thread is fastest, and an OpenMP team stalls on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny() -> FluxAutoencoder:
    return load_flux_ae(TINY, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def tiny_sd(tiny) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in tiny.state_dict().items()}


def _latent(h: int = 4, w: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, 16, h, w, generator=torch.Generator().manual_seed(seed))


def test_decode_shape_and_range(tiny):
    img = tiny.decode(_latent(4, 6))
    assert img.shape == (1, 3, 32, 48)
    assert img.dtype == torch.float32
    assert img.min() >= 0.0 and img.max() <= 1.0


def test_official_key_names(tiny_sd):
    for key in (
        "encoder.conv_in.weight",
        "encoder.down.0.block.0.norm1.weight",
        "encoder.down.0.downsample.conv.weight",
        "encoder.mid.block_1.conv1.weight",
        "encoder.mid.attn_1.q.weight",
        "decoder.up.3.block.2.conv2.weight",
        "decoder.up.1.upsample.conv.weight",
        "decoder.norm_out.weight",
        "decoder.conv_out.weight",
    ):
        assert key in tiny_sd


def test_real_preset_key_set_is_official_and_tiny_shares_it(tiny_sd):
    with torch.device("meta"):
        real = FluxAutoencoder(AE_PRESETS["flux1-ae"]).state_dict()
    compiled = [re.compile(p) for p in OFFICIAL_PATTERNS]
    assert [k for k in real if not any(p.fullmatch(k) for p in compiled)] == []
    assert [p.pattern for p in compiled if not any(p.fullmatch(k) for k in real)] == []
    assert len(real) == 244
    assert sum(v.numel() for v in real.values()) == 83_819_683  # the official ae.safetensors
    assert tuple(real["decoder.conv_in.weight"].shape) == (512, 16, 3, 3)
    assert tuple(real["encoder.conv_out.weight"].shape) == (32, 512, 3, 3)
    assert set(tiny_sd) == set(real)


@pytest.mark.parametrize("prefix", ["", "first_stage_model.", "vae."])
def test_load_official_layout_file(tmp_path, tiny, tiny_sd, prefix):
    sd = {prefix + k: v for k, v in tiny_sd.items()}
    if prefix:  # a full checkpoint also holds other models
        sd["model.diffusion_model.img_in.weight"] = torch.zeros(2, 2)
    path = tmp_path / "ae.safetensors"
    save_file(sd, path)
    loaded = load_flux_ae(path, dtype=torch.float32, device="cpu")
    assert loaded.params == tiny.params
    z = _latent()
    torch.testing.assert_close(loaded.decode(z), tiny.decode(z), rtol=0, atol=0)


def test_decoder_only_file(tmp_path, tiny, tiny_sd):
    path = tmp_path / "decoder.safetensors"
    save_file({k: v for k, v in tiny_sd.items() if k.startswith("decoder.")}, path)
    loaded = load_flux_ae(path, dtype=torch.float32, device="cpu", input_name="vae_file")
    assert loaded.encoder is None
    z = _latent()
    torch.testing.assert_close(loaded.decode(z), tiny.decode(z), rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="decoder-only") as err:
        loaded.encode(torch.rand(1, 3, 16, 16))
    assert err.value.input_name == "vae_file"


def test_missing_and_unexpected_keys_are_listed(tmp_path, tiny_sd):
    sd = dict(tiny_sd)
    del sd["decoder.up.1.upsample.conv.weight"]
    sd["decoder.up.1.extra.weight"] = torch.zeros(1)
    path = tmp_path / "broken.safetensors"
    save_file(sd, path)
    with pytest.raises(CheckpointError) as err:
        load_flux_ae(path)
    text = str(err.value)
    assert "input 'vae'" in text and "broken.safetensors" in text
    assert "1 missing keys: decoder.up.1.upsample.conv.weight" in text
    assert "1 unexpected keys: decoder.up.1.extra.weight" in text


def test_unknown_layout_lists_top_level_keys(tmp_path):
    path = tmp_path / "other.safetensors"
    save_file({"blocks.0.weight": torch.zeros(2), "head.weight": torch.zeros(2)}, path)
    with pytest.raises(CheckpointError, match=r"not a FLUX.1 VAE(.|\n)*blocks \(1\), head \(1\)"):
        load_flux_ae(path)


def test_unknown_preset():
    with pytest.raises(InputError, match="flux1-ae-tiny"):
        load_flux_ae("dummy:nope")


def test_decode_takes_raw_latents(tiny):
    """No scale/shift inside decode: it is the official decoder on the raw latent, mapped [-1, 1] -> [0, 1]."""
    z = _latent(seed=1)
    expected = ((tiny.decoder(z) + 1) / 2).clamp(0, 1)
    torch.testing.assert_close(tiny.decode(z), expected, rtol=0, atol=0)


def test_encode_is_the_posterior_mean(tiny):
    img = torch.rand(1, 3, 32, 16, generator=torch.Generator().manual_seed(2))
    first, second = tiny.encode(img), tiny.encode(img)
    assert first.shape == (1, 16, 4, 2)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    torch.testing.assert_close(first, tiny.encoder(img * 2 - 1)[:, :16], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("call", "bad", "name"),
    [
        ("decode", torch.zeros(1, 4, 4, 4), "latent"),
        ("encode", torch.zeros(1, 32, 32, 3), "image"),
        ("encode", torch.zeros(1, 3, 20, 16), "image"),
    ],
)
def test_bad_inputs_name_the_input(tiny, call, bad, name):
    with pytest.raises(InputError, match=f"input '{name}': (expected|height)"):
        getattr(tiny, call)(bad)
