"""Hostile prompts through a real ComfyUI server: file names posted to /prompt reach nothing outside the pack's
folders (MagCache calibrations in models/fewstep_magcache, weights in the model folders), with a clear error
naming the node and the input, the same one whether or not a named path exists.
"""

# ruff: noqa: F811 - the tests take the imported ``server`` fixture as an argument
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from comfy_server import PROBE, WORKFLOWS, queue, requires_comfyui, server  # noqa: F401

pytestmark = requires_comfyui

GATE_WORKFLOW = WORKFLOWS / "flux_dev_step_cache_dummy.api.json"


def _gate_workflow(**gate_inputs) -> tuple[dict, str]:
    workflow = json.loads(GATE_WORKFLOW.read_text())
    gate = next(k for k, v in workflow.items() if v["class_type"] == "FewStepCacheGate")
    workflow[gate]["inputs"].update(method="magcache", threshold=0.24, **gate_inputs)
    return workflow, gate


def _files_named(root: Path, name: str) -> list[Path]:
    return [p for p in root.rglob(name) if p.is_file()]


def _calibration(path: Path) -> Path:
    """A well-formed calibration file (for a model it does not fit; it must not even be read)."""
    path.write_text(json.dumps({"format": "fewstep-magcache", "version": 1, "steps": 28, "ratios": [1.0] * 28,
                                "model": {"family": "flux", "preset": "x", "config": "x"}}))  # fmt: skip
    return path


def _flux_tiny_file(path: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    from fewstep.engine import open_model

    model = open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32).model
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def test_magcache_file_outside_the_folder_is_rejected(server, tmp_path):
    outside = _calibration(tmp_path / "outside.json")
    for name in (str(outside), "../../../outside.json", str(tmp_path / "missing.json")):
        workflow, gate = _gate_workflow(magcache_file=name)
        code, out = queue(server, workflow, "--quiet")
        assert code == 2 and f"node {gate} (FewStepCacheGate) input 'magcache_file'" in out, out
        assert f"'{name}' not in ['none'" in out, out


@pytest.mark.parametrize("name", ["../../../../e2e-pwned.json", "ABSOLUTE", "sub/e2e-pwned.json", "..", ""])
def test_calibration_name_that_is_not_a_plain_name_writes_nothing(server, tmp_path, name):
    name = str(tmp_path / "e2e-pwned.json") if name == "ABSOLUTE" else name
    workflow, _ = _gate_workflow(calibrate=True, calibration_name=name)
    code, out = queue(server, workflow, "--quiet")
    expected = "is not a plain file name" if name else "calibrate is on: give the file name"
    assert code == 3 and "FewStepCacheGate: input 'calibration_name': " in out and expected in out, out
    base = server["base"]
    # where the name would land joined to the calibration folder of today or of the old output/ location
    landing = [(base / folder / "fewstep_magcache" / name).resolve() for folder in ("models", "output")]
    assert not [p for p in landing if p.is_file()] and not _files_named(base.parent, "e2e-pwned.json")


_GIVE_A_NAME = (
    ": give a name such as 'flux-dev-28.json'; calibrations are written to the pack's calibration folder"
)


@pytest.mark.parametrize(
    "name, shown",
    [
        ("\u202eevil", "'\\u202eevil' is not a plain file name (it contains U+202E RIGHT-TO-LEFT OVERRIDE, an "
                        "invisible format character such as a bidi override or a zero-width space)" + _GIVE_A_NAME),
        # not text at all: every STRING input of every node refuses it first (nodes/inputs.py)
        ("evil\ud800", "is not valid text: it holds the unpaired surrogate U+D800"),
    ],
)  # fmt: skip
def test_calibration_name_with_an_invisible_character_fails_at_once_and_writes_nothing(server, name, shown):
    """Posted to /prompt: the gate node's one-line error before the sampler runs (no progress line of it: before,
    all 28 steps ran and then the file was written, or failed with a bare encoding error), and no file."""
    workflow, gate = _gate_workflow(calibrate=True, calibration_name=name)
    sampler = next(k for k, v in workflow.items() if v["class_type"] == "FewStepSampler")
    code, out = queue(server, workflow)
    assert code == 3, out
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: node {gate} (FewStepCacheGate) failed: FewStepCacheGate: input 'calibration_name': "
                      f"{shown}"], out  # fmt: skip
    assert not [line for line in out.splitlines() if line.startswith(f"node {sampler} ")], out
    assert not [p for p in server["base"].rglob("*evil*")]


def test_calibration_is_written_in_models_fewstep_magcache_and_offered(server):
    folder = server["base"] / "models" / "fewstep_magcache"
    workflow, _ = _gate_workflow(calibrate=True, calibration_name="e2e-tiny")
    code, out = queue(server, workflow, "--quiet")
    assert code == 0, out
    assert sorted(p.name for p in folder.iterdir()) == ["e2e-tiny.json"]
    assert len(json.loads((folder / "e2e-tiny.json").read_text())["ratios"]) == 28
    with urllib.request.urlopen(server["url"] + "/object_info/FewStepCacheGate", timeout=30) as r:
        info = json.load(r)["FewStepCacheGate"]
    assert info["input"]["optional"]["magcache_file"][0] == ["none", "e2e-tiny.json"]
    workflow, _ = _gate_workflow(magcache_file="e2e-tiny.json")
    code, out = queue(server, workflow, "--quiet")
    assert code == 0 and "step cache magcache" in out, out


@pytest.mark.skipif(not PROBE.exists(), reason=f"the probe pack with a tiny native model is not at {PROBE}")
def test_native_gate_calibration_name_is_refused(server, tmp_path):
    target = tmp_path / "native-pwned.json"
    graph = {
        "1": {"class_type": "ProbeTinySD15", "inputs": {"seed": 0}},
        "2": {"class_type": "FewStepCacheGateNative",
              "inputs": {"model": ["1", 0], "method": "magcache", "threshold": 0.24, "start": 0.1, "end": 1.0,
                         "force": False, "cfg_cutoff": 1.0, "calibrate": True, "calibration_name": str(target)}},
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}},
    }  # fmt: skip
    code, out = queue(server, graph, "--quiet")
    assert code == 3 and "FewStepCacheGateNative: input 'calibration_name': " in out, out
    assert not target.exists()
    graph["2"]["inputs"].update(calibrate=False, calibration_name="", magcache_file=str(target))
    code, out = queue(server, graph, "--quiet")
    assert code == 2 and "node 2 (FewStepCacheGateNative) input 'magcache_file'" in out, out


def _loader_error(server, node: str, input_name: str, name: str) -> str:
    workflow = json.loads((WORKFLOWS / "flux_schnell_tiny_decode_dummy.api.json").read_text())
    loader = next(k for k, v in workflow.items() if v["class_type"] == node)
    workflow[loader]["inputs"][input_name] = name
    code, out = queue(server, workflow, "--quiet")
    assert code == 2 and f"node {loader} ({node}) input '{input_name}'" in out, out
    return next(line for line in out.splitlines() if f"input '{input_name}'" in line).replace(name, "NAME")


def test_loader_paths_are_rejected_alike_whether_or_not_they_exist(server, tmp_path):
    present = _flux_tiny_file(tmp_path / "flux-tiny.safetensors")
    missing = tmp_path / "missing.safetensors"
    errors = {
        name: _loader_error(server, "FewStepDiTLoader", "model_name", name)
        for name in (
            str(present),
            str(missing),
            "../../../flux-tiny.safetensors",
            "../../../missing.safetensors",
        )
    }
    assert len(set(errors.values())) == 1, errors
    torch_file = tmp_path / "taef1_decoder.pth"
    torch_file.write_bytes(b"not read")
    for name in (str(torch_file), str(tmp_path / "taef1_encoder.pth")):
        _loader_error(server, "FewStepTinyVAELoader", "vae_name", name)


def _linked_name(workflow: dict, node_id: str, input_name: str, name: str) -> dict:
    """``node_id``'s ``input_name`` fed by a wildcard-typed link: ComfyUI's combo list check does not apply."""
    workflow["990"] = {"class_type": "FewStepE2EAnyString", "inputs": {"value": name}}
    workflow[node_id]["inputs"][input_name] = ["990", 0]
    return workflow


def test_loader_refuses_a_linked_path_with_one_error(server, tmp_path):
    present = _flux_tiny_file(tmp_path / "flux-tiny.safetensors")
    outputs = {}
    for name in (str(present), str(tmp_path / "missing.safetensors"), "../../../flux-tiny.safetensors"):
        workflow = json.loads((WORKFLOWS / "flux_schnell_fewstep_dummy.api.json").read_text())
        loader = next(k for k, v in workflow.items() if v["class_type"] == "FewStepDiTLoader")
        code, out = queue(server, _linked_name(workflow, loader, "model_name", name), "--quiet")
        assert code == 3 and "FewStepDiTLoader: input 'model_name': " in out, out
        outputs[name] = out.replace(repr(name), "NAME")
    assert len(set(outputs.values())) == 1, outputs


def test_magcache_file_linked_from_outside_is_refused(server, tmp_path):
    outside = _calibration(tmp_path / "linked.json")
    for name in (str(outside), "../../../linked.json"):
        workflow, gate = _gate_workflow()
        code, out = queue(server, _linked_name(workflow, gate, "magcache_file", name), "--quiet")
        assert (
            code == 3 and f"FewStepCacheGate: input 'magcache_file': {name!r} is not a calibration in" in out
        ), out
    workflow, gate = _gate_workflow(calibrate=True)
    code, out = queue(
        server, _linked_name(workflow, gate, "calibration_name", str(tmp_path / "w.json")), "--quiet"
    )
    assert code == 3 and "input 'calibration_name'" in out and not (tmp_path / "w.json").exists(), out


def test_loader_takes_a_file_from_the_model_folder(server, tmp_path):
    folder = server["base"] / "models" / "diffusion_models"
    folder.mkdir(parents=True, exist_ok=True)
    _flux_tiny_file(folder / "e2e-flux-tiny.safetensors")
    workflow = json.loads((WORKFLOWS / "flux_schnell_fewstep_dummy.api.json").read_text())
    loader = next(k for k, v in workflow.items() if v["class_type"] == "FewStepDiTLoader")
    workflow[loader]["inputs"]["model_name"] = "e2e-flux-tiny.safetensors"
    code, out = queue(server, workflow, "--out", str(tmp_path / "out"), "--quiet")
    assert code == 0, out
