"""File names given to the pack's nodes stay inside the pack's folders.

Inside ComfyUI (a ``folder_paths`` module in sys.modules, faked here with ComfyUI's semantics) the loaders accept
only names from their model folders (and ``dummy:``), with one error whether or not a named path exists; MagCache
calibrations are read from and written to ``models/fewstep_magcache`` only, as plain file names. Outside ComfyUI
the loaders take paths and calibrations live in ``FEWSTEP_MAGCACHE_DIR``.
"""

from __future__ import annotations

import importlib
import json
import sys

import pytest
import torch
from fake_folder_paths import make_folder_paths
from safetensors.torch import save_file

from fewstep.engine import open_model
from fewstep.engine.vae.taesd import build_decoder
from fewstep.engine.weights import dummy_init_

HOSTILE_NAMES = ["/etc/passwd", "../../outside.json", "sub/dir.json", "sub\\dir.json", "x\0.json", "..", ".",
                 ".hidden.json", " padded.json", "new\nline.json", "x" * 300]  # fmt: skip


@pytest.fixture
def comfy(monkeypatch, tmp_path):
    """A ComfyUI base directory under tmp_path with folder_paths in sys.modules; returns (base, folder_paths)."""
    base = tmp_path / "comfy"
    fp = make_folder_paths(base)
    monkeypatch.setitem(sys.modules, "folder_paths", fp)
    return base, fp


@pytest.fixture
def no_comfy(monkeypatch, tmp_path):
    monkeypatch.delitem(sys.modules, "folder_paths", raising=False)
    folder = tmp_path / "magcache"
    monkeypatch.setenv("FEWSTEP_MAGCACHE_DIR", str(folder))
    return folder


@pytest.fixture
def flux_file(tmp_path):
    """A valid flux-tiny weights file outside every model folder."""
    outside = tmp_path / "outside"
    outside.mkdir()
    path = outside / "flux-tiny.safetensors"
    model = open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32).model
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


class _NativeModelStandIn:
    """Passes the MODEL type check (a clone() and the model it patches); the name checks refuse before it is used."""

    model = None

    def clone(self):
        raise AssertionError("the gate used the model before checking the file name")


def _nodes(pack):
    return pack.NODE_CLASS_MAPPINGS


# -- loaders ------------------------------------------------------------------------------------------------------
def _refusal(node: str, input_name: str, name: str, folder: str) -> str:
    return (
        f"{node}: input '{input_name}': {name!r} is not a file in ComfyUI's models/{folder} folder; inside "
        "ComfyUI only a name from its list (or a dummy: entry) is accepted, not a path"
    )


def test_loader_refuses_paths_outside_the_model_folder_with_one_error(pack, comfy, flux_file, monkeypatch):
    base, _ = comfy
    inside = base / "models" / "diffusion_models"
    inside.mkdir(parents=True)
    monkeypatch.chdir(inside)  # so that the relative names below would reach flux_file from here
    relative = "../../../outside/flux-tiny.safetensors"
    assert (inside / relative).resolve() == flux_file.resolve()
    names = [str(flux_file), str(flux_file.parent / "missing.safetensors"), relative,
             "../../../outside/missing.safetensors", "~/flux-tiny.safetensors"]  # fmt: skip
    for name in names:
        with pytest.raises(ValueError) as err:
            _nodes(pack)["FewStepDiTLoader"]().load(name)
        assert str(err.value) == _refusal("FewStepDiTLoader", "model_name", name, "diffusion_models"), name


def test_loader_takes_names_from_the_model_folder_inside_comfyui(pack, comfy, flux_file):
    base, fp = comfy
    inside = base / "models" / "diffusion_models" / "sub"
    inside.mkdir(parents=True)
    (inside / "tiny.safetensors").write_bytes(flux_file.read_bytes())
    assert "sub/tiny.safetensors" in fp.get_filename_list("diffusion_models")
    (handle,) = _nodes(pack)["FewStepDiTLoader"]().load("sub/tiny.safetensors")
    assert handle.params.hidden_size == open_model("dummy:flux-tiny", device="cpu").params.hidden_size
    (dummy,) = _nodes(pack)["FewStepDiTLoader"]().load("dummy:flux-tiny")
    assert type(dummy.model) is type(handle.model)


def test_loader_takes_paths_outside_comfyui(pack, no_comfy, flux_file):
    (handle,) = _nodes(pack)["FewStepDiTLoader"]().load(str(flux_file))
    assert handle.params.hidden_size == open_model("dummy:flux-tiny", device="cpu").params.hidden_size


def test_tiny_vae_loader_refuses_paths_outside_vae_approx(pack, comfy, tmp_path):
    decoder = build_decoder("taef1")
    dummy_init_(decoder, 0)
    outside = tmp_path / "taef1_decoder.pth"
    torch.save(decoder.state_dict(), outside)
    loader = _nodes(pack)["FewStepTinyVAELoader"]()
    for name in (str(outside), "../../../taef1_decoder.pth", str(tmp_path / "missing_decoder.pth")):
        with pytest.raises(ValueError) as err:
            loader.load(name)
        assert str(err.value) == _refusal("FewStepTinyVAELoader", "vae_name", name, "vae_approx"), name
    inside = comfy[0] / "models" / "vae_approx"
    inside.mkdir(parents=True)
    (inside / "taef1_decoder.pth").write_bytes(outside.read_bytes())
    (vae,) = loader.load("taef1_decoder.pth")
    assert vae.variant.name == "taef1"


# -- MagCache calibration files -------------------------------------------------------------------------------------
def _gate_args(**inputs):
    args = dict(method="magcache", threshold=0.24, start=0.1, end=1.0, force=False, cfg_cutoff=1.0)
    args.update(inputs)
    return args


def _calibration_json(model) -> dict:
    from fewstep.engine.step_cache.calibration import model_identity

    return {"format": "fewstep-magcache", "version": 1, "model": model_identity(model), "steps": 28,
            "sampler": "euler", "sigmas": [], "ratios": [1.0] * 28, "ratio_std": []}  # fmt: skip


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_calibration_name_must_be_a_plain_file_name(pack, comfy, name):
    (model,) = _nodes(pack)["FewStepDiTLoader"]().load("dummy:flux-tiny")
    for node, target in (("FewStepCacheGate", model), ("FewStepCacheGateNative", _NativeModelStandIn())):
        with pytest.raises(
            ValueError, match=rf"^{node}: input 'calibration_name': .* is not a plain file name"
        ):
            _nodes(pack)[node]().attach(target, **_gate_args(calibrate=True, calibration_name=name))
    assert not (comfy[0] / "models").exists() or not any((comfy[0] / "models").rglob("*.json"))


@pytest.mark.parametrize(
    "name,reason",
    [
        ("", "empty"),
        ("/etc/x.json", "'/'"),
        ("..", "'.'"),
        ("a\0b", "control character"),
        ("x" * 300, "long"),
    ],
)
def test_calibration_file_name_says_why(name, reason):
    from fewstep.engine.step_cache.calibration import calibration_file_name

    with pytest.raises(ValueError, match=rf"^input 'calibration_name': .*{reason}"):
        calibration_file_name(name)
    assert calibration_file_name("flux-dev-28") == "flux-dev-28.json"
    assert calibration_file_name("flux-dev-28.json") == "flux-dev-28.json"


def test_calibrate_needs_a_calibration_name(pack, comfy):
    (model,) = _nodes(pack)["FewStepDiTLoader"]().load("dummy:flux-tiny")
    with pytest.raises(
        ValueError, match=r"^FewStepCacheGate: input 'calibration_name': calibrate is on: give the file name"
    ):
        _nodes(pack)["FewStepCacheGate"]().attach(model, **_gate_args(calibrate=True))


def test_calibration_is_written_into_the_magcache_folder_and_offered_for_reading(pack, comfy):
    base, fp = comfy
    nodes = _nodes(pack)
    folder = base / "models" / "fewstep_magcache"
    (model,) = nodes["FewStepDiTLoader"]().load("dummy:flux-tiny")
    (cond,) = nodes["FewStepSyntheticConditioning"]().make(8, 4096, 768, 3.5, 0)
    (gated,) = nodes["FewStepCacheGate"]().attach(
        model, **_gate_args(calibrate=True, calibration_name="tiny-28")
    )
    latent = {"samples": torch.zeros(1, 16, 8, 8)}
    nodes["FewStepSampler"]().sample(gated, cond, latent, seed=0, steps=28, schedule="flux.1-dev", sampler="euler",
                                     cfg=1.0, denoise=1.0)  # fmt: skip
    written = sorted(p.relative_to(base) for p in base.rglob("*") if p.is_file())
    assert [str(p) for p in written] == ["models/fewstep_magcache/tiny-28.json"]
    assert len(json.loads((folder / "tiny-28.json").read_text())["ratios"]) == 28
    assert fp.folder_names_and_paths["fewstep_magcache"] == ([str(folder)], {".json"})
    (folder / "notes.txt").write_text("not a calibration")
    combo, opts = nodes["FewStepCacheGate"].INPUT_TYPES()["optional"]["magcache_file"]
    assert combo == ["none", "tiny-28.json"] and opts["default"] == "none"
    (reading,) = nodes["FewStepCacheGate"]().attach(model, **_gate_args(magcache_file="tiny-28.json"))
    calibration = reading.feature("step_cache").calibration
    assert calibration.source == str(folder / "tiny-28.json") and calibration.steps == 28


def test_magcache_file_must_be_one_of_the_files_offered(pack, comfy, tmp_path):
    base, _ = comfy
    (model,) = _nodes(pack)["FewStepDiTLoader"]().load("dummy:flux-tiny")
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps(_calibration_json(model.model)))
    folder = base / "models" / "fewstep_magcache"
    folder.mkdir(parents=True)
    (folder / "present.json").write_text(json.dumps(_calibration_json(model.model)))
    names = [str(outside), "../../../outside.json", "../fewstep_magcache/present.json", str(tmp_path / "no.json"),
             "no.json", "notes.txt"]  # fmt: skip
    for node, target in (("FewStepCacheGate", model), ("FewStepCacheGateNative", _NativeModelStandIn())):
        for name in names:
            with pytest.raises(ValueError) as err:
                _nodes(pack)[node]().attach(target, **_gate_args(magcache_file=name))
            assert str(err.value) == (
                f"{node}: input 'magcache_file': {name!r} is not a calibration in ComfyUI's "
                "models/fewstep_magcache folder; choose one of ['none', 'present.json']"
            ), name


def test_old_empty_magcache_file_means_none(pack, comfy):
    (model,) = _nodes(pack)["FewStepDiTLoader"]().load("dummy:flux-tiny")
    (gated,) = _nodes(pack)["FewStepCacheGate"]().attach(model, **_gate_args(method="first_block",
                                                                             threshold=0.08, magcache_file=""))  # fmt: skip
    assert gated.feature("step_cache").calibration is None


def test_calibrations_outside_comfyui_live_in_fewstep_magcache_dir(pack, no_comfy):
    nodes = _nodes(pack)
    (model,) = nodes["FewStepDiTLoader"]().load("dummy:flux-tiny")
    (gated,) = nodes["FewStepCacheGate"]().attach(
        model, **_gate_args(calibrate=True, calibration_name="cli.json")
    )
    assert gated.feature("step_cache").calibrate_to == str(no_comfy / "cli.json")
    with pytest.raises(
        ValueError, match=r"^FewStepCacheGate: input 'calibration_name': '\.\./x' is not a plain"
    ):
        nodes["FewStepCacheGate"]().attach(model, **_gate_args(calibrate=True, calibration_name="../x"))
    no_comfy.mkdir()
    (no_comfy / "cli.json").write_text(json.dumps(_calibration_json(model.model)))
    combo, _ = nodes["FewStepCacheGate"].INPUT_TYPES()["optional"]["magcache_file"]
    assert combo == ["none", "cli.json"]
    (reading,) = nodes["FewStepCacheGate"]().attach(model, **_gate_args(magcache_file="cli.json"))
    assert reading.feature("step_cache").calibration.source == str(no_comfy / "cli.json")
    with pytest.raises(
        ValueError, match=r"^FewStepCacheGate: input 'magcache_file': '/etc/passwd' is not a calib"
    ):
        nodes["FewStepCacheGate"]().attach(model, **_gate_args(magcache_file="/etc/passwd"))


def test_default_calibration_folder_without_the_variable(monkeypatch, tmp_path):
    calibration = importlib.import_module("fewstep.engine.step_cache.calibration")
    monkeypatch.delenv("FEWSTEP_MAGCACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert calibration.default_calibration_dir() == tmp_path / "data" / "fewstep" / "magcache"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert calibration.default_calibration_dir() == tmp_path / ".local" / "share" / "fewstep" / "magcache"


# -- names that read as something else, or that no file system name can hold ---------------------------------------
INVISIBLE_NAMES = [
    ("\u202eevil", "U+202E RIGHT-TO-LEFT OVERRIDE, an invisible format character such as a bidi override or a "
                   "zero-width space)"),
    ("evil\ud800", "U+D800, a lone surrogate, which no file name can hold"),
    ("tiny\u200b-28.json", "U+200B ZERO WIDTH SPACE, an invisible format character"),
    ("tiny\u2066-28", "U+2066 LEFT-TO-RIGHT ISOLATE, an invisible format character"),
    ("\ufefftiny.json", "U+FEFF ZERO WIDTH NO-BREAK SPACE, an invisible format character"),
    ("tiny\u2029.json", "U+2029 PARAGRAPH SEPARATOR, a paragraph separator"),
]  # fmt: skip


def _count_forwards(module: torch.nn.Module) -> list:
    calls = []
    for sub in module.modules():
        sub.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("name, problem", INVISIBLE_NAMES)
def test_an_invisible_or_unwritable_calibration_name_is_refused_before_any_step(pack, comfy, name, problem):
    """The gate node refuses at once; before, the whole sampling run went first and then the file was written under
    a name that reads differently (bidi, zero width) or failed with a bare encoding error (a lone surrogate)."""
    nodes = _nodes(pack)
    (model,) = nodes["FewStepDiTLoader"]().load("dummy:flux-tiny")
    (cond,) = nodes["FewStepSyntheticConditioning"]().make(8, 4096, 768, 3.5, 0)
    forwards = _count_forwards(model.model)
    with pytest.raises(ValueError) as err:  # the gate, then what ComfyUI runs next
        (gated,) = nodes["FewStepCacheGate"]().attach(
            model, **_gate_args(calibrate=True, calibration_name=name)
        )
        nodes["FewStepSampler"]().sample(gated, cond, {"samples": torch.zeros(1, 16, 8, 8)}, seed=0, steps=28,
                                         schedule="flux.1-dev", sampler="euler", cfg=1.0, denoise=1.0)  # fmt: skip
    if "\ud800" in name:  # not text at all: every STRING input refuses it first (nodes/inputs.py)
        assert str(err.value) == (
            "FewStepCacheGate: input 'calibration_name': is not valid text: it holds the unpaired surrogate U+D800"
        )
    else:
        assert str(err.value).startswith(
            f"FewStepCacheGate: input 'calibration_name': {name!r} is not a plain file name (it contains {problem}"
        )
        assert str(err.value).endswith(
            "): give a name such as 'flux-dev-28.json'; calibrations are written to the pack's calibration folder"
        )
    assert "\n" not in str(err.value) and name not in str(err.value)  # one line, the name printed escaped
    assert forwards == []
    with pytest.raises(
        ValueError, match=r"^FewStepCacheGateNative: input 'calibration_name': .*(it contains|surrogate) U\+"
    ):
        nodes["FewStepCacheGateNative"]().attach(
            _NativeModelStandIn(), **_gate_args(calibrate=True, calibration_name=name)
        )
    assert not any(p.is_file() for p in comfy[0].rglob("*"))


def test_a_calibration_under_an_invisible_name_is_not_offered_nor_read(pack, comfy):
    nodes = _nodes(pack)
    (model,) = nodes["FewStepDiTLoader"]().load("dummy:flux-tiny")
    folder = comfy[0] / "models" / "fewstep_magcache"
    folder.mkdir(parents=True)
    for name in ("\u202eevil.json", "plain.json", "zero\u200bwidth.json"):
        (folder / name).write_text(json.dumps(_calibration_json(model.model)))
    combo, _ = nodes["FewStepCacheGate"].INPUT_TYPES()["optional"]["magcache_file"]
    assert combo == ["none", "plain.json"]
    with pytest.raises(ValueError) as err:
        nodes["FewStepCacheGate"]().attach(model, **_gate_args(magcache_file="\u202eevil.json"))
    assert str(err.value) == (
        "FewStepCacheGate: input 'magcache_file': '\\u202eevil.json' cannot name a file: it contains U+202E "
        "RIGHT-TO-LEFT OVERRIDE, an invisible format character such as a bidi override or a zero-width space"
    )
    from fewstep.engine.step_cache.calibration import list_calibration_files

    assert list_calibration_files(folder) == ["plain.json"]  # the listing outside ComfyUI skips it too


def test_the_engine_refuses_a_calibration_path_it_could_not_write_before_any_step(tmp_path):
    from fewstep.engine import sample_latent
    from fewstep.engine.step_cache import STEP_CACHE_FEATURE, CacheGate, make_gate

    handle = open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32)
    forwards = _count_forwards(handle.model)
    bidi, lone = str(tmp_path / "\u202eevil.json"), str(tmp_path / "evil\udc00.json")
    with pytest.raises(
        ValueError, match=r"^input 'magcache_file': .*cannot name a file: it contains U\+202E RIGHT"
    ):
        gate = make_gate("magcache", calibrate=True, magcache_file=bidi)
        sample_latent(handle.with_feature(STEP_CACHE_FEATURE, gate), [], torch.zeros(1, 16, 8, 8), steps=28)
    with pytest.raises(ValueError, match=r"^input 'calibrate_to': .*it contains U\+DC00, a lone surrogate"):
        CacheGate(method="magcache", calibrate_to=lone)
    assert forwards == [] and list(tmp_path.iterdir()) == []
