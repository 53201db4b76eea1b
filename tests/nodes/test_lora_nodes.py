"""FewStepLoraLoader / FewStepLoraPreset, the dummy LoRA files, the presets and the CLI's --lora."""

from __future__ import annotations

import json
import os
import sys
import tempfile

import pytest
import torch
from fake_folder_paths import make_folder_paths
from safetensors.torch import load_file, save_file

from fewstep.engine import open_model
from fewstep.engine.errors import InputError
from fewstep.engine.lora.dummy import dummy_lora_tensors, linear_layers, write_dummy_lora
from fewstep.engine.lora.presets import LORA_PRESETS, lora_preset
from fewstep.engine.sampling import SCHEDULES
from fewstep.engine.sampling.schedules import schedule_sigmas
from fewstep.nodes.lora import DUMMY_LORAS, FewStepLoraLoader, FewStepLoraPreset, dummy_lora_folder
from fewstep.nodes.sampling import FewStepSampler, FewStepSyntheticConditioning

DUMMY = next(iter(DUMMY_LORAS))


@pytest.fixture
def handle():
    return open_model("dummy:flux-tiny-guidance", device="cpu", dtype=torch.float32)


@pytest.fixture
def no_comfy(monkeypatch, tmp_path):
    """Outside ComfyUI: lora names are paths, dummy files go to the system temp folder (here tmp_path)."""
    monkeypatch.delitem(sys.modules, "folder_paths", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "systemp"))
    return tmp_path


@pytest.fixture
def comfy(monkeypatch, tmp_path):
    """A ComfyUI base with a loras folder and a temp folder; returns (base, folder_paths)."""
    base = tmp_path / "comfy"
    fp = make_folder_paths(base)
    (base / "models" / "loras").mkdir(parents=True)
    fp.folder_names_and_paths["loras"] = ([str(base / "models" / "loras")], {".safetensors"})
    fp.get_temp_directory = lambda: str(base / "temp")
    monkeypatch.setitem(sys.modules, "folder_paths", fp)
    return base, fp


def load(model, name, strength=1.0):
    return FewStepLoraLoader().load(model, name, strength)[0]


def weights(handle):
    return {k: v.clone() for k, v in handle.model.state_dict().items()}


def sample(model, cond, steps=2):
    latent = {"samples": torch.zeros(1, 16, 8, 8)}
    return FewStepSampler().sample(model, cond, latent, 3, steps, "auto", "euler", 1.0, 1.0)


def test_output_carries_the_patch_and_the_input_is_unchanged(no_comfy, handle):
    before = weights(handle)
    out = load(handle, DUMMY, 0.5)
    assert handle.loras == () and out.loras[0].strength == 0.5 and out.loras[0].family == "flux"
    assert out.model is handle.model and out.host is handle.host  # shared model, same ComfyUI patcher
    assert all(torch.equal(v, before[k]) for k, v in handle.model.state_dict().items())  # nothing merged yet
    assert out.loras[0].keys == {f"{name}.weight" for name, _ in linear_layers(handle.model)}
    assert not hasattr(FewStepLoraLoader, "IS_CHANGED")  # a plain function of its inputs for ComfyUI's cache


def test_chained_loaders_accumulate_in_order(no_comfy, handle, tmp_path):
    other = tmp_path / "other.safetensors"
    write_dummy_lora(handle.model, other, rank=4, seed=5)
    first = load(handle, DUMMY, 0.25)
    second = load(first, str(other), -1.0)
    assert [(p.name, p.strength) for p in second.loras] == [
        (first.loras[0].name, 0.25),
        ("other.safetensors", -1.0),
    ]
    assert [p.strength for p in first.loras] == [0.25]


def test_strength_zero_samples_exactly_the_base_model(no_comfy, handle):
    (cond,) = FewStepSyntheticConditioning().make(8, 4096, 768, 3.5, 1, model=handle)
    base, _ = sample(handle, cond)
    zero, _ = sample(load(handle, DUMMY, 0.0), cond)
    half, _ = sample(load(handle, DUMMY, 0.5), cond)
    again, _ = sample(handle, cond)  # the base weights come back after a patched run
    assert torch.equal(zero["samples"], base["samples"])
    assert not torch.equal(half["samples"], base["samples"])
    assert torch.equal(again["samples"], base["samples"])


def test_dummy_choice_writes_into_the_pack_temp_folder(comfy, handle):
    base, _ = comfy
    out = load(handle, DUMMY)
    folder = base / "temp" / "fewstep" / "loras"
    assert dummy_lora_folder() == str(folder)
    (name,) = os.listdir(folder)
    assert out.loras[0].path == str(folder / name) and name.endswith("_rank8_seed0.safetensors")


def test_dummy_lora_is_deterministic_by_seed(handle, tmp_path):
    a = dummy_lora_tensors(handle.model, rank=8, seed=3)
    b = load_file(write_dummy_lora(handle.model, tmp_path / "b.safetensors", rank=8, seed=3))
    c = dummy_lora_tensors(handle.model, rank=8, seed=4)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["diffusion_model.img_in.lora_up.weight"], c["diffusion_model.img_in.lora_up.weight"]
    )
    layer = dict(linear_layers(handle.model))["img_in"]
    assert a["diffusion_model.img_in.lora_down.weight"].shape == (8, layer.in_features)
    assert a["diffusion_model.img_in.lora_up.weight"].shape == (layer.out_features, 8)
    assert float(a["diffusion_model.img_in.alpha"]) == 8.0


@pytest.mark.parametrize("name", ["../secret.safetensors", "/etc/passwd", "sub/../../secret.safetensors"])
def test_hostile_lora_name_is_refused_inside_comfyui(comfy, handle, name):
    base, _ = comfy
    save_file({"x": torch.zeros(1)}, str(base / "secret.safetensors"))  # exists, outside the loras folder
    with pytest.raises(InputError) as err:
        load(handle, name)
    assert str(err.value) == (
        f"FewStepLoraLoader: input 'lora_name': {name!r} is not a file in ComfyUI's models/loras folder; inside "
        "ComfyUI only a name from its list (or a dummy: entry) is accepted, not a path"
    )


def test_listed_file_is_read_inside_comfyui(comfy, handle):
    base, _ = comfy
    write_dummy_lora(handle.model, base / "models" / "loras" / "mine.safetensors", rank=2, seed=1)
    assert "mine.safetensors" in FewStepLoraLoader.INPUT_TYPES()["required"]["lora_name"][0]
    out = load(handle, "mine.safetensors", 0.75)
    assert out.loras[0].path == str(base / "models" / "loras" / "mine.safetensors")


def test_missing_file_names_the_node_and_the_input(no_comfy, handle, tmp_path):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(InputError) as err:
        load(handle, str(missing))
    assert str(err.value) == f"FewStepLoraLoader: input 'lora_name': weights file not found: {missing}"


def test_lora_for_another_model_names_the_input(no_comfy, handle, tmp_path):
    wan = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32)
    path = write_dummy_lora(wan.model, tmp_path / "wan.safetensors", rank=2)
    with pytest.raises(InputError, match=r"^FewStepLoraLoader: input 'lora_name': ") as err:
        load(handle, path)
    assert "wan.safetensors" in str(err.value)


def test_presets_name_known_schedules_and_published_numbers():
    assert {p.schedule for p in LORA_PRESETS.values()} <= set(SCHEDULES)
    hyper = lora_preset("hyper-flux.1-dev-8step")
    assert (hyper.steps, hyper.guidance, hyper.strength, hyper.cfg) == (8, 3.5, 0.125, 1.0)
    assert (
        lora_preset("flux.1-turbo-alpha-8step").steps,
        lora_preset("flux.1-turbo-alpha-8step").strength,
    ) == (8, 1.0)
    light = lora_preset("lightx2v-wan2.1-4step")
    assert (light.steps, light.schedule, light.cfg) == (4, "wan-dmd-4step", 1.0)
    # the lightx2v denoising list 1000, 750, 500, 250 through shift 5
    assert schedule_sigmas(light.schedule, light.steps).tolist() == pytest.approx(
        [1.0, 0.9375, 0.8333333, 0.625, 0.0]
    )
    with pytest.raises(InputError, match=r"^input 'preset': unknown LoRA preset 'nope'; known: hyper-flux"):
        lora_preset("nope")


def test_preset_settings_reach_the_sampler(no_comfy, handle):
    steps, cfg, guidance, strength, settings = FewStepLoraPreset().preset("hyper-flux.1-dev-8step")
    assert "Hyper-FLUX.1-dev-8steps-lora.safetensors" in settings and "ByteDance/Hyper-SD" in settings
    model = load(handle, DUMMY, strength)
    (cond,) = FewStepSyntheticConditioning().make(8, 4096, 768, guidance, 1, model=handle)
    assert cond[0][1]["guidance"] == 3.5
    latent = {"samples": torch.zeros(1, 16, 8, 8)}
    _, report = FewStepSampler().sample(model, cond, latent, 3, steps, "flux.1-dev", "euler", cfg, 1.0)
    sigmas = schedule_sigmas("flux.1-dev", 8, image_seq_len=16)  # an 8x8 latent: 4x4 = 16 image tokens
    assert report.splitlines()[0] == f"euler, 8 steps, sigmas {[round(s, 4) for s in sigmas.tolist()]}"
    assert model.loras[0].strength == 0.125


# -- the CLI's --lora ----------------------------------------------------------------------------------------------


def test_lora_option_parses_file_and_strength():
    from fewstep.cli.common import lora_option

    assert lora_option("a/b.safetensors:0.5") == ("a/b.safetensors", 0.5)
    assert lora_option("a/b.safetensors:-2") == ("a/b.safetensors", -2.0)
    assert lora_option("a/b.safetensors") == ("a/b.safetensors", 1.0)
    assert lora_option(r"C:\loras\b.safetensors") == (
        r"C:\loras\b.safetensors",
        1.0,
    )  # a drive, not a strength


def _generate(out, *extra):
    from fewstep.cli import main

    argv = ["generate", "--model", "flux-tiny", "--height", "32", "--width", "32", "--steps", "2"]
    return main([*argv, "--device", "cpu", "--dtype", "fp32", "--out", str(out), *extra, "--json"])


def test_generate_applies_each_lora_in_order(tmp_path, capsys):
    model = open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32).model
    lora = write_dummy_lora(model, tmp_path / "l.safetensors", rank=4, seed=1, scale=0.05)
    assert _generate(tmp_path / "base") == 0
    assert _generate(tmp_path / "zero", "--lora", f"{lora}:0") == 0
    assert _generate(tmp_path / "two", "--lora", f"{lora}:0.5", "--lora", lora) == 0
    capsys.readouterr()
    base, zero, two = (
        load_file(tmp_path / d / "latent.safetensors")["latent"] for d in ("base", "zero", "two")
    )
    assert torch.equal(zero, base) and not torch.equal(two, base)
    described = json.loads((tmp_path / "two" / "timings.json").read_text())["model"]
    assert described.count("; LoRA l.safetensors") == 2 and "at strength 0.5; LoRA" in described


def test_missing_or_bad_lora_is_refused_before_loading(tmp_path, capsys):
    from fewstep.cli import main

    assert _generate(tmp_path / "o", "--lora", str(tmp_path / "none.safetensors:0.5")) == 2
    assert (
        f"error: fewstep generate: input '--lora': weights file not found: {tmp_path / 'none.safetensors'}"
        in (capsys.readouterr().err)
    )
    assert _generate(tmp_path / "o", "--lora", f"{tmp_path}/x.safetensors:nan") == 2
    assert "input '--lora': expected a finite number, got nan" in capsys.readouterr().err
    wan = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32).model
    lora = write_dummy_lora(wan, tmp_path / "wan.safetensors", rank=2)
    args = [
        "stream",
        "--chunks",
        "1",
        "--chunk-frames",
        "1",
        "--window-frames",
        "2",
        "--height",
        "32",
        "--json",
    ]
    out = ["--out", str(tmp_path / "s"), "--lora", f"{lora}:0.5"]
    assert main([*args, "--width", "32", "--device", "cpu", "--dtype", "fp32", *out]) == 0
    capsys.readouterr()
    described = json.loads((tmp_path / "s" / "stream.json").read_text())["model"]
    n = len(linear_layers(wan))  # a pair on every linear layer
    assert described.endswith(
        f"; LoRA wan.safetensors (ComfyUI / BFL format, {n} low-rank and 0 full deltas on {n} weights, rank 2) "
        "at strength 0.5"
    )
    assert _generate(tmp_path / "o", "--lora", lora) == 2  # a Wan LoRA on the FLUX model
    assert "input '--lora': wan.safetensors" in capsys.readouterr().err
