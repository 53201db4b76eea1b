"""Video tiny VAEs under the names ComfyUI's own VAELoader reads from models/vae_approx (0.8.0: ``lighttaew2_1``,
``taehv``) load in FewStepTinyVAELoader as those variants and decode a ComfyUI LATENT the way that ComfyUI does.

The files are written here with the published key names (``encoder.0.weight`` ... ``decoder.22.bias``) and seeded
random weights. The reference is our TAEHV module holding the same weights, fed the latent in each variant's own
space: lighttaew2_1 the LATENT as it is (LightX2V's LightTAE works on un-normalized Wan 2.1 latents, as
ComfyUI 0.8.0 decodes it), taehv the LATENT times HunyuanVideo's 0.476986, taew2_1 the normalized Wan latent.
With ``COMFYUI_DIR`` pointing at a ComfyUI that lists these names (0.8.0), its own VAE decodes the same files too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fewstep.engine.errors import InputError
from fewstep.engine.latent_formats import HUNYUAN_VIDEO, WAN21
from fewstep.engine.vae.taehv import TAEHV, TAEHV_CONFIGS
from fewstep.engine.weights import dummy_init_

# the LATENT -> the space each variant's decoder works in
OWN_SPACE = {
    "lighttaew2_1": lambda raw: raw,
    "taehv": HUNYUAN_VIDEO.process_in,
    "taew2_1": WAN21.process_in,
}
CORE_NAMES = [
    ("lighttaew2_1.pth", "lighttaew2_1"),
    ("lighttaew2_1.safetensors", "lighttaew2_1"),
    ("taehv.pth", "taehv"),
    ("taehv.safetensors", "taehv"),
    ("taew2_1.safetensors", "taew2_1"),
]


def _weights(seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """A 16-channel TAEHV state dict under the published key names (every 16-channel variant has this layout)."""
    module = TAEHV(TAEHV_CONFIGS["taew2_1"])
    dummy_init_(module, seed)
    return {k: v.detach().to(dtype).contiguous() for k, v in module.state_dict().items()}


def _write(path: Path, sd: dict) -> None:
    if path.suffix == ".safetensors":
        save_file(sd, str(path))
    else:
        torch.save(sd, path)


def _reference_decode(sd: dict, latents_in_own_space: torch.Tensor) -> torch.Tensor:
    module = TAEHV(TAEHV_CONFIGS["taew2_1"]).eval()
    module.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    with torch.no_grad():
        return module.decode_video(latents_in_own_space.transpose(1, 2))  # [B, T, 3, H, W]


@pytest.fixture
def vae_approx(tmp_path, monkeypatch):
    from fake_folder_paths import make_folder_paths

    monkeypatch.setitem(sys.modules, "folder_paths", make_folder_paths(tmp_path))
    folder = tmp_path / "models" / "vae_approx"
    folder.mkdir(parents=True)
    return folder


@pytest.mark.parametrize("file_name,variant", CORE_NAMES)
def test_the_loader_node_loads_a_core_video_tae_name_as_its_variant(pack, vae_approx, file_name, variant):
    sd = _weights(seed=5)
    _write(vae_approx / file_name, sd)
    loader = pack.NODE_CLASS_MAPPINGS["FewStepTinyVAELoader"]
    assert file_name in loader.INPUT_TYPES()["required"]["vae_name"][0]
    (vae,) = loader().load(file_name, "fp32")
    assert vae.variant.name == variant and vae.variant.kind == "video" and vae.encoder is not None
    raw = torch.randn(1, 16, 2, 4, 6, generator=torch.Generator().manual_seed(1))  # a ComfyUI Wan LATENT
    (image,) = pack.NODE_CLASS_MAPPINGS["FewStepTinyVAEDecode"]().decode(vae, {"samples": raw})
    expected = _reference_decode(sd, OWN_SPACE[variant](raw))  # [1, 5, 3, 32, 48]
    assert image.shape == (5, 32, 48, 3)
    torch.testing.assert_close(image, expected[0].permute(0, 2, 3, 1), atol=1e-5, rtol=0)


def test_lighttaew2_1_round_trips_a_latent_in_the_latents_own_space(vae_approx):
    """Encoding gives a ComfyUI LATENT with no normalization applied (latent_to_raw is the identity)."""
    from fewstep.engine.vae import load_tiny_vae

    _write(vae_approx / "lighttaew2_1.safetensors", _weights(seed=6))
    vae = load_tiny_vae(vae_approx / "lighttaew2_1.safetensors", device="cpu", dtype=torch.float32)
    frames = torch.rand(1, 5, 3, 32, 48, generator=torch.Generator().manual_seed(2))
    own = vae.encode(frames)
    assert torch.equal(vae.encode_raw(frames), own.float())
    assert vae.variant.comfy_format == WAN21  # it decodes what a Wan model's LATENT is


def test_a_16_channel_video_tae_with_no_variant_in_its_name_is_a_clear_error(pack, vae_approx):
    _write(vae_approx / "my_video_preview.pth", _weights(seed=7))
    with pytest.raises(ValueError) as caught:
        pack.NODE_CLASS_MAPPINGS["FewStepTinyVAELoader"]().load("my_video_preview.pth", "fp32")
    assert str(caught.value) == (
        "FewStepTinyVAELoader: input 'vae_name': my_video_preview.pth (a TAEHV video autoencoder) fits taew2_1 and "
        "lighttaew2_1 and taehv equally (same tensor shapes) and the file name does not say which; rename the file "
        "to contain the variant name or pass variant="
    )


def test_an_explicit_variant_overrides_the_name(vae_approx):
    from fewstep.engine.vae import load_tiny_vae

    _write(vae_approx / "taehv.pth", _weights(seed=8))
    vae = load_tiny_vae(vae_approx / "taehv.pth", variant="lighttaew2_1", device="cpu")
    assert vae.variant.name == "lighttaew2_1"
    with pytest.raises(InputError, match=r"holds a taew2_1/lighttaew2_1/taehv autoencoder, not taew2_2"):
        load_tiny_vae(vae_approx / "taehv.pth", variant="taew2_2")
