"""The shipped workflows (workflows/*.json) against the pack's node definitions and ComfyUI's core nodes.

Set FEWSTEP_COMFY_URL (e.g. http://127.0.0.1:8231) to also check the workflows' nodes, inputs and values against a
running server's /object_info (tests/e2e/workflow_server_check.py; CI runs it in tests/e2e on every version).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import workflow_check as wc  # noqa: E402

from fewstep.cli.comfy_client import FRONTEND_ONLY_NODES, ui_to_api  # noqa: E402

WORKFLOWS = wc.ROOT / "workflows"
FILES = sorted(WORKFLOWS.glob("*.json"))
UI_FILES = [p for p in FILES if not p.name.endswith(".api.json")]
SHIPPED = {
    "flux2_klein_tiny_decode",
    "flux2_klein_tiny_decode_dummy",
    "zimage_turbo_t2i",
    "zimage_turbo_t2i_dummy",
    "zimage_turbo_stream_batch",
    "zimage_turbo_stream_batch_dummy",
    "flux_schnell_fewstep",
    "flux_schnell_fewstep_dummy",
    "native_fewstep_schedule",
    "fewstep_schedule_dummy",
}


@pytest.fixture(scope="module")
def specs():
    return wc.node_specs()


def load(name: str) -> dict:
    return json.loads((WORKFLOWS / name).read_text())


def node_id(api: dict, class_type: str) -> str:
    return next(i for i, n in api.items() if n["class_type"] == class_type)


def ui_node(ui: dict, class_type: str) -> dict:
    return next(n for n in ui["nodes"] if n["type"] == class_type)


def assert_error(errors: list[str], *parts: str) -> None:
    assert any(all(p in e for p in parts) for e in errors), f"no error naming {parts} in {errors}"


def test_pack_is_loaded_as_comfyui_loads_it():
    pack = wc.load_pack()
    assert sys.modules[wc.PACK_MODULE] is pack
    assert pack.__spec__.submodule_search_locations == [str(wc.ROOT)]
    assert {"FewStepDiTLoader", "FewStepSampler", "FewStepSchedule"} <= set(pack.NODE_CLASS_MAPPINGS)


def test_shipped_workflows_exist_in_both_formats():
    names = {p.name.removesuffix(".api.json").removesuffix(".json") for p in FILES}
    assert not SHIPPED - names
    for name in names:
        assert (WORKFLOWS / f"{name}.json").exists() and (WORKFLOWS / f"{name}.api.json").exists(), name


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_workflow_is_valid(path, specs):
    workflow = json.loads(path.read_text())
    assert wc.is_ui_format(workflow) == (not path.name.endswith(".api.json"))
    assert wc.validate(workflow, specs) == []


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.name)
def test_ui_workflow_matches_its_api_twin(path, specs):
    api = json.loads(path.with_name(path.name.replace(".json", ".api.json")).read_text())
    assert wc.compare_twins(json.loads(path.read_text()), api, specs) == []


def object_info_entry(spec) -> dict:
    """``spec`` as a server's /object_info lists it: each input as [type, options], a combo as [choices, options]."""
    inputs = {"required": {}, "optional": {}}
    for i in spec.inputs:
        inputs["required" if i.required else "optional"][i.name] = [
            list(i.options) if i.type == "COMBO" else i.type,
            i.opts,
        ]
    return {"input": inputs}


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.name)
def test_the_cli_converts_a_ui_workflow_to_its_api_twin(path, specs):
    """The two models of the formats agree: ``fewstep queue``'s conversion of a shipped UI file (ui_to_api) is the
    API file the builder wrote, with the frontend-only nodes (the Note) dropped and every other node kept."""
    ui = json.loads(path.read_text())
    api = json.loads(path.with_name(path.name.replace(".json", ".api.json")).read_text())
    converted = ui_to_api(ui, {name: object_info_entry(spec) for name, spec in specs.items()})
    assert converted == api
    dropped = {n["type"] for n in ui["nodes"]} - {n["class_type"] for n in converted.values()}
    assert dropped == {"Note"} and dropped <= FRONTEND_ONLY_NODES


def test_frontend_only_nodes_other_than_notes_are_refused(specs):
    ui = load("flux_schnell_fewstep_dummy.json")
    ui["nodes"].append({"id": 99, "type": "Reroute", "inputs": [], "outputs": [], "widgets_values": []})
    ui["last_node_id"] = 99
    assert_error(wc.validate(ui, specs), "node 99 (Reroute)", "a frontend-only node")


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.name)
def test_ui_workflow_explains_itself_in_a_note(path):
    notes = [n for n in json.loads(path.read_text())["nodes"] if n["type"] == "Note"]
    assert len(notes) == 1 and len(notes[0]["widgets_values"][0]) > 100
    # no hard line break inside a sentence (the Note wraps to its width; a source break renders ragged): a single
    # break only starts a list item or follows a line ending in ":"
    text = notes[0]["widgets_values"][0]
    for paragraph in text.split("\n\n"):
        lines = paragraph.split("\n")
        for before, after in zip(lines, lines[1:]):
            assert after.startswith("- ") or before.endswith(":"), (path.name, before, after)
    assert notes[0]["size"][1] >= 20 * len(text) // 52


def test_files_match_their_definitions():
    run = subprocess.run(
        [sys.executable, "workflows/build_workflows.py", "--check"],
        cwd=wc.ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_builder_depends_on_nothing_in_tests():
    """Shipped code: building every workflow loads no module from tests/ (workflow_check re-exports the builder's)."""
    probe = (
        "import runpy, sys\n"
        "sys.argv[1:] = ['--check']\n"
        "try:\n"
        "    runpy.run_path('workflows/build_workflows.py', run_name='__main__')\n"
        "except SystemExit as done:\n"
        "    assert done.code == 0, done.code\n"
        "tests = [n for n, m in sys.modules.items() if 'tests' in str(getattr(m, '__file__', '') or '').split('/')]\n"
        "print(sorted(tests))\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], cwd=wc.ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[-1] == "[]"


# ---- the validator must catch broken workflows ----


def test_missing_required_value(specs):
    api = load("flux_schnell_fewstep_dummy.api.json")
    sampler = node_id(api, "FewStepSampler")
    del api[sampler]["inputs"]["steps"]
    assert_error(
        wc.validate(api, specs), f"node {sampler} ", "FewStepSampler", "'steps'", "required input missing"
    )


def test_missing_required_link(specs):
    api = load("flux_schnell_fewstep_dummy.api.json")
    sampler = node_id(api, "FewStepSampler")
    del api[sampler]["inputs"]["model"]
    assert_error(
        wc.validate(api, specs), f"node {sampler} ", "FewStepSampler", "'model'", "FEWSTEP_MODEL link"
    )


def test_wrong_link_type(specs):
    api = load("flux_schnell_fewstep_dummy.api.json")
    sampler, latent = node_id(api, "FewStepSampler"), node_id(api, "EmptySD3LatentImage")
    api[sampler]["inputs"]["model"] = [latent, 0]
    assert_error(
        wc.validate(api, specs), f"node {sampler} ", "FewStepSampler", "'model'", "FEWSTEP_MODEL", "LATENT"
    )


def test_link_to_missing_node_or_slot(specs):
    api = load("flux_schnell_fewstep_dummy.api.json")
    sampler, loader = node_id(api, "FewStepSampler"), node_id(api, "FewStepDiTLoader")
    api[sampler]["inputs"]["model"] = ["99", 0]
    api[sampler]["inputs"]["positive"] = [loader, 3]
    errors = wc.validate(api, specs)
    assert_error(errors, f"node {sampler} ", "'model'", "node 99")
    assert_error(errors, f"node {sampler} ", "'positive'", "no output slot 3")


@pytest.mark.parametrize(
    ("class_type", "input_name", "value", "why"),
    [
        ("FewStepSampler", "steps", 0, "below the minimum 1"),
        ("FewStepSampler", "cfg", 31.0, "above the maximum 30.0"),
        ("FewStepSampler", "steps", 4.5, "not an INT"),
        ("EmptySD3LatentImage", "width", 8, "below the minimum 16"),
        ("FewStepSampler", "schedule", "flux.2", "not one of"),
        ("SaveLatent", "filename_prefix", 3, "not a STRING"),
    ],
)
def test_bad_widget_value(specs, class_type, input_name, value, why):
    api = load("flux_schnell_fewstep_dummy.api.json")
    nid = node_id(api, class_type)
    api[nid]["inputs"][input_name] = value
    assert_error(wc.validate(api, specs), f"node {nid} ", class_type, f"'{input_name}'", why)


def test_unknown_class(specs):
    api = load("flux_schnell_fewstep_dummy.api.json")
    nid = node_id(api, "FewStepSampler")
    api[nid]["class_type"] = "FewStepSamplerXL"
    assert_error(wc.validate(api, specs), f"node {nid} ", "FewStepSamplerXL", "unknown node class")


def test_unknown_input_name(specs):
    api = load("flux_schnell_fewstep_dummy.api.json")
    nid = node_id(api, "FewStepSampler")
    api[nid]["inputs"]["sampler_name"] = "euler"
    assert_error(wc.validate(api, specs), f"node {nid} ", "FewStepSampler", "'sampler_name'", "no such input")


def test_model_file_combos(specs):
    """Model files need not exist on this machine; dummy presets and other values must be real."""
    api = load("flux_schnell_fewstep_dummy.api.json")
    loader = node_id(api, "FewStepDiTLoader")
    for ok in ("flux1-dev-fp8.safetensors", "sub/dir/model.pt", "dummy:flux-mid"):
        api[loader]["inputs"]["model_name"] = ok
        assert wc.validate(api, specs) == [], ok
    api[loader]["inputs"]["model_name"] = "dummy:flux-huge"
    assert_error(
        wc.validate(api, specs), f"node {loader} ", "FewStepDiTLoader", "'model_name'", "unknown dummy preset"
    )
    api[loader]["inputs"]["model_name"] = "readme.txt"
    assert_error(wc.validate(api, specs), f"node {loader} ", "'model_name'", "a model file name or one of")
    api[loader]["inputs"]["model_name"] = "dummy:flux-tiny"
    api[loader]["inputs"]["weight_dtype"] = "int4.safetensors"  # not a file combo: files are not accepted
    assert_error(wc.validate(api, specs), f"node {loader} ", "'weight_dtype'", "not one of")


def test_ui_widgets_values_count(specs):
    ui = load("flux_schnell_fewstep_dummy.json")
    sampler = ui_node(ui, "FewStepSampler")
    sampler["widgets_values"].remove("fixed")  # the seed's control_after_generate value
    expected = specs["FewStepSampler"].widget_value_count
    assert_error(
        wc.validate(ui, specs),
        f"node {sampler['id']} ",
        "FewStepSampler",
        f"widgets_values has {expected - 1} values, expected {expected}",
    )


def test_ui_bad_value_and_control(specs):
    ui = load("flux_schnell_fewstep_dummy.json")
    sampler = ui_node(ui, "FewStepSampler")
    sampler["widgets_values"][1] = "sometimes"
    sampler["widgets_values"][2] = 500  # steps
    errors = wc.validate(ui, specs)
    assert_error(errors, f"node {sampler['id']} ", "'seed'", "control_after_generate 'sometimes'")
    assert_error(errors, f"node {sampler['id']} ", "'steps'", "above the maximum 200")


def test_ui_link_table_must_agree(specs):
    ui = load("flux_schnell_fewstep_dummy.json")
    sampler = ui_node(ui, "FewStepSampler")
    link = next(lk for lk in ui["links"] if lk[3] == sampler["id"] and lk[4] == 0)
    link[5] = "MODEL"
    assert_error(wc.validate(ui, specs), f"node {sampler['id']} ", "'model'", "type 'MODEL'", "FEWSTEP_MODEL")
    ui = load("flux_schnell_fewstep_dummy.json")
    ui["links"].append([99, 1, 0, ui_node(ui, "SaveLatent")["id"], 0, "LATENT"])
    assert_error(wc.validate(ui, specs), "link 99", "does not list it")


def test_ui_wrong_link_type_across_nodes(specs):
    ui = load("flux_schnell_fewstep_dummy.json")
    save = ui_node(ui, "SaveLatent")
    link = next(lk for lk in ui["links"] if lk[3] == save["id"])
    link[2] = 1  # from the sampler's STRING report instead of its LATENT
    link[5] = "LATENT"
    assert_error(wc.validate(ui, specs), f"node {save['id']} ", "SaveLatent", "'samples'", "expects LATENT")


def test_twins_must_agree(specs):
    ui, api = load("native_fewstep_schedule.json"), load("native_fewstep_schedule.api.json")
    changed = copy.deepcopy(api)
    nid = node_id(changed, "FewStepSchedule")
    changed[nid]["inputs"]["steps"] = 8
    assert_error(wc.compare_twins(ui, changed, specs), f"node {nid} ", "FewStepSchedule", "widgets")
    changed = copy.deepcopy(api)
    del changed[node_id(changed, "RandomNoise")]
    assert_error(wc.compare_twins(ui, changed, specs), "node ids differ")


def test_object_info_comparison_finds_differences(specs):
    """compare_object_info against an /object_info entry built the way ComfyUI builds it."""
    cls = wc.load_pack().NODE_CLASS_MAPPINGS["FewStepSampler"]
    info = {
        "input": cls.INPUT_TYPES(),
        "output": list(cls.RETURN_TYPES),
        "output_name": list(cls.RETURN_NAMES),
    }
    assert wc.compare_object_info(specs["FewStepSampler"], info) == []
    info["input"]["required"]["steps"][1]["max"] = 100
    info["output"][1] = "TEXT"
    errors = wc.compare_object_info(specs["FewStepSampler"], info)
    assert_error(errors, "FewStepSampler.steps", "max 200, server 100")
    assert_error(errors, "FewStepSampler: outputs")


@pytest.mark.skipif(
    not os.environ.get("FEWSTEP_COMFY_URL"), reason="set FEWSTEP_COMFY_URL to a running ComfyUI"
)
def test_node_table_matches_server(specs):
    url = os.environ["FEWSTEP_COMFY_URL"].rstrip("/")
    with urllib.request.urlopen(f"{url}/object_info", timeout=60) as r:
        object_info = json.load(r)
    # what the workflows use, not one version's lists (tests/e2e runs the same check on every CI ComfyUI version)
    sys.path.insert(0, str(wc.ROOT / "tests" / "e2e"))
    from workflow_server_check import mismatches

    assert mismatches(object_info, specs, FILES)["errors"] == []


def test_builder_writes_a_linked_widget_consistently(specs):
    """A widget fed by a link gets a widget socket in the UI file and a link in the API file."""
    spec = importlib.util.spec_from_file_location("build_workflows", WORKFLOWS / "build_workflows.py")
    build = sys.modules["build_workflows"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(build)
    g = build.Graph("linked", specs)
    model = g.add("FewStepDiTLoader", "model", 1, model_name="dummy:flux-tiny")
    cond = g.add("FewStepSyntheticConditioning", "cond", 1)
    latent = g.add("EmptySD3LatentImage", "latent", 1)
    first = g.add("FewStepSampler", "first", 2, model=model[0], positive=cond[0], latent_image=latent[0])
    # custom_sigmas (a STRING widget) driven by the first sampler's report: type-valid, if not useful
    second = g.add(
        "FewStepSampler",
        "second",
        3,
        model=model[0],
        positive=cond[0],
        latent_image=latent[0],
        custom_sigmas=first[1],
    )
    ui, api = build.to_ui(g), build.to_api(g)
    assert wc.validate(ui, specs) == wc.validate(api, specs) == wc.compare_twins(ui, api, specs) == []
    ui_second = next(n for n in ui["nodes"] if n["id"] == second.id)
    socket = ui_second["inputs"][-1]  # after the link inputs (model, positive, latent_image, negative, ...)
    slot = len(ui_second["inputs"]) - 1
    assert socket["name"] == "custom_sigmas" and socket["widget"] == {"name": "custom_sigmas"}
    assert [first.id, 1, second.id, slot, "STRING"] in [
        link[1:] for link in ui["links"] if link[0] == socket["link"]
    ]
    assert len(ui_second["widgets_values"]) == specs["FewStepSampler"].widget_value_count
    assert api[str(second.id)]["inputs"]["custom_sigmas"] == [str(first.id), 1]


# ---- the new families' dummy workflows, run through the pack's nodes in this process ----


# What the core nodes these workflows use do, as ComfyUI computes it (nodes.py / comfy_extras): enough to run a
# dummy graph without a server. tests/e2e runs the same files on a real ComfyUI.
def _empty_sd3_latent(width, height, batch_size):
    return ({"samples": torch.zeros(batch_size, 16, height // 8, width // 8)},)


def _empty_image(width, height, batch_size, color):
    import torch

    rgb = torch.tensor([(color >> 16) & 0xFF, (color >> 8) & 0xFF, color & 0xFF]) / 255.0
    return (rgb.expand(batch_size, height, width, 3).clone(),)


def _image_batch(image1, image2):
    return (torch.cat([image1, image2]),)


CORE_STAND_INS = {
    "EmptySD3LatentImage": _empty_sd3_latent,
    "EmptyImage": _empty_image,
    "ImageBatch": _image_batch,
    "SaveImage": lambda images, filename_prefix: (images,),
    "SaveLatent": lambda samples, filename_prefix: (samples,),
    "SaveAnimatedWEBP": lambda images, **_: (images,),
    "PreviewAny": lambda source: (source,),
}


def run_in_process(api: dict) -> dict:
    """Execute an API-format workflow node by node: pack nodes for real, core nodes by CORE_STAND_INS."""
    nodes = wc.load_pack().NODE_CLASS_MAPPINGS
    results: dict[str, tuple] = {}

    def value(v):
        is_link = isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and type(v[1]) is int
        return evaluate(v[0])[v[1]] if is_link else v

    def evaluate(node_id: str) -> tuple:
        if node_id not in results:
            entry = api[node_id]
            kwargs = {k: value(v) for k, v in entry["inputs"].items()}
            if entry["class_type"] in CORE_STAND_INS:
                results[node_id] = CORE_STAND_INS[entry["class_type"]](**kwargs)
            else:
                cls = nodes[entry["class_type"]]
                results[node_id] = getattr(cls(), cls.FUNCTION)(**kwargs)
        return results[node_id]

    for node_id in api:
        evaluate(node_id)
    return {api[i]["_meta"]["title"]: out for i, out in results.items()}


@pytest.mark.parametrize(
    ("name", "image_shape", "latent_shape", "report"),
    [
        ("flux2_klein_tiny_decode_dummy", (1, 128, 128, 3), (1, 128, 8, 8), "4 steps"),
        ("zimage_turbo_t2i_dummy", (1, 128, 128, 3), (1, 16, 16, 16), "8 steps"),
    ],
)
@pytest.mark.slow
def test_new_family_dummy_workflows_run_through_the_nodes(name, image_shape, latent_shape, report):
    outputs = run_in_process(load(f"{name}.api.json"))
    sampled = next(out for title, out in outputs.items() if title.startswith("FewStep Sampler"))
    assert tuple(sampled[0]["samples"].shape) == latent_shape
    assert report in sampled[1]
    (image,) = outputs["Save image"]
    assert tuple(image.shape) == image_shape
    assert torch.isfinite(image).all() and float(image.min()) >= 0 and float(image.max()) <= 1


def test_lora_dummy_workflows_run_through_the_nodes(monkeypatch, tmp_path):
    """The LoRA twins: the loader writes its random LoRA (here in a temp dir) and the samplers run the patched
    model with the preset's steps (Hyper-FLUX 8 on the dev schedule, CausVid 4 per chunk)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    image = run_in_process(load("flux_dev_hyper_lora_dummy.api.json"))
    (model,) = image["FewStep LoRA Loader (random LoRA)"]
    assert [p.strength for p in model.loras] == [0.125]
    latent, report = image["FewStep Sampler (8 steps)"]
    assert tuple(latent["samples"].shape) == (1, 16, 16, 16) and "8 steps" in report
    video = run_in_process(load("wan_causal_lora_dummy.api.json"))
    (model,) = video["FewStep LoRA Loader (random LoRA)"]
    assert [p.strength for p in model.loras] == [1.0]
    assert "4 steps" in video["FewStep Causal Video Sampler (LoRA)"][3]
    assert sorted(os.listdir(tmp_path / "fewstep" / "loras")) == sorted(
        {p.name for p in image["FewStep LoRA Loader (random LoRA)"][0].loras} | {p.name for p in model.loras}
    )


def test_zimage_stream_batch_dummy_runs_through_the_nodes():
    """Needs the stream batch for Z-Image (engine/stream_batch): six 64x64 frames in, six out, repeats skipped."""
    outputs = run_in_process(load("zimage_turbo_stream_batch_dummy.api.json"))
    frames, report = next(out for title, out in outputs.items() if title.startswith("FewStep Stream Batch"))
    assert tuple(frames.shape) == (6, 64, 64, 3)
    assert "frames skipped" in report


NOT_OFFERED_SELF_FORCING = (
    "https://huggingface.co/gdhe17/Self-Forcing/resolve/main/checkpoints/self_forcing_dmd.pt"
)
# The files each real workflow's Missing Models list must offer (ComfyUI's frontend downloads them from there).
EXPECTED_MODELS = {
    "flux2_klein_tiny_decode.json": {
        ("flux-2-klein-4b.safetensors", "diffusion_models",
         "https://huggingface.co/black-forest-labs/FLUX.2-klein-4B/resolve/main/flux-2-klein-4b.safetensors"),
        ("qwen_3_4b.safetensors", "text_encoders",
         "https://huggingface.co/Comfy-Org/z_image_turbo/resolve/main/split_files/text_encoders/qwen_3_4b.safetensors"),
        ("taef2.safetensors", "vae_approx", "https://huggingface.co/madebyollin/taef2/resolve/main/taef2.safetensors"),
    },
    "zimage_turbo_t2i.json": {
        ("z_image_turbo_bf16.safetensors", "diffusion_models",
         "https://huggingface.co/Comfy-Org/z_image_turbo/resolve/main/split_files/diffusion_models/"
         "z_image_turbo_bf16.safetensors"),
        ("qwen_3_4b.safetensors", "text_encoders",
         "https://huggingface.co/Comfy-Org/z_image_turbo/resolve/main/split_files/text_encoders/qwen_3_4b.safetensors"),
        ("ae.safetensors", "vae",
         "https://huggingface.co/Comfy-Org/Lumina_Image_2.0_Repackaged/resolve/main/split_files/vae/ae.safetensors"),
    },
    "zimage_turbo_stream_batch.json": {
        ("z_image_turbo_bf16.safetensors", "diffusion_models",
         "https://huggingface.co/Comfy-Org/z_image_turbo/resolve/main/split_files/diffusion_models/"
         "z_image_turbo_bf16.safetensors"),
        ("qwen_3_4b.safetensors", "text_encoders",
         "https://huggingface.co/Comfy-Org/z_image_turbo/resolve/main/split_files/text_encoders/qwen_3_4b.safetensors"),
        ("taef1.safetensors", "vae_approx",
         "https://huggingface.co/madebyollin/taef1/resolve/main/diffusion_pytorch_model.safetensors"),
    },
    "flux_dev_hyper_lora.json": {
        ("flux1-dev.safetensors", "diffusion_models",
         "https://huggingface.co/black-forest-labs/FLUX.1-dev/resolve/main/flux1-dev.safetensors"),
        ("Hyper-FLUX.1-dev-8steps-lora.safetensors", "loras",
         "https://huggingface.co/ByteDance/Hyper-SD/resolve/main/Hyper-FLUX.1-dev-8steps-lora.safetensors"),
        ("t5xxl_fp16.safetensors", "text_encoders",
         "https://huggingface.co/comfyanonymous/flux_text_encoders/resolve/main/t5xxl_fp16.safetensors"),
        ("clip_l.safetensors", "text_encoders",
         "https://huggingface.co/comfyanonymous/flux_text_encoders/resolve/main/clip_l.safetensors"),
        ("ae.safetensors", "vae",
         "https://huggingface.co/Comfy-Org/Lumina_Image_2.0_Repackaged/resolve/main/split_files/vae/ae.safetensors"),
    },
    "wan_causal_lora.json": {
        ("wan2.1_t2v_1.3B_bf16.safetensors", "diffusion_models",
         "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/diffusion_models/"
         "wan2.1_t2v_1.3B_bf16.safetensors"),
        ("Wan21_CausVid_bidirect2_T2V_1_3B_lora_rank32.safetensors", "loras",
         "https://huggingface.co/Kijai/WanVideo_comfy/resolve/main/Wan21_CausVid_bidirect2_T2V_1_3B_lora_rank32.safetensors"),
        ("umt5_xxl_fp8_e4m3fn_scaled.safetensors", "text_encoders",
         "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/text_encoders/"
         "umt5_xxl_fp8_e4m3fn_scaled.safetensors"),
        ("taew2_1.safetensors", "vae_approx",
         "https://huggingface.co/Kijai/WanVideo_comfy/resolve/main/taew2_1.safetensors"),
    },
}  # fmt: skip
# The interactive causal video workflows: the Self-Forcing student's files, and the Wan 2.1 VAE that encodes the input
_SELF_FORCING_FILES = {
    ("self_forcing_dmd.pt", "diffusion_models",
     "https://huggingface.co/gdhe17/Self-Forcing/resolve/main/checkpoints/self_forcing_dmd.pt"),
    ("umt5_xxl_fp8_e4m3fn_scaled.safetensors", "text_encoders",
     "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/text_encoders/"
     "umt5_xxl_fp8_e4m3fn_scaled.safetensors"),
    ("taew2_1.safetensors", "vae_approx", "https://huggingface.co/Kijai/WanVideo_comfy/resolve/main/taew2_1.safetensors"),
}  # fmt: skip
_WAN_VAE = ("wan_2.1_vae.safetensors", "vae",
            "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/vae/wan_2.1_vae.safetensors")  # fmt: skip
for _name in ("wan_causal_image_to_video", "wan_causal_extend_video", "wan_causal_video_to_video"):
    EXPECTED_MODELS[f"{_name}.json"] = _SELF_FORCING_FILES | {_WAN_VAE}
EXPECTED_MODELS["wan_causal_prompt_recache.json"] = _SELF_FORCING_FILES


@pytest.mark.parametrize("name", sorted(EXPECTED_MODELS))
def test_real_workflows_offer_their_model_downloads(name):
    found = {
        (m["name"], m["directory"], m["url"])
        for n in load(name)["nodes"]
        for m in n.get("properties", {}).get("models", [])
    }
    assert found == EXPECTED_MODELS[name]


# The folder each loader input reads its files from (ComfyUI's folder names: the dialog's "directory").
LOADER_FOLDERS = {
    ("FewStepDiTLoader", "model_name"): "diffusion_models",
    ("FewStepTinyVAELoader", "vae_name"): "vae_approx",
    ("FewStepLoraLoader", "lora_name"): "loras",
    ("UNETLoader", "unet_name"): "diffusion_models",
    ("VAELoader", "vae_name"): "vae",
    ("CLIPLoader", "clip_name"): "text_encoders",
    ("DualCLIPLoader", "clip_name1"): "text_encoders",
    ("DualCLIPLoader", "clip_name2"): "text_encoders",
}
# Files with no copy the dialog downloads (no safetensors of the official tensors on huggingface.co): listed all
# the same, so the dialog names them as missing (with "Copy URL" beside its suffix refusal), and the workflow's
# Note says where to get them.
NOT_OFFERED = {
    "self_forcing_dmd.pt": "https://huggingface.co/gdhe17/Self-Forcing/resolve/main/checkpoints/self_forcing_dmd.pt"
}


def test_frontend_download_rule():
    assert (
        wc.frontend_download_refusal("a.safetensors", "https://huggingface.co/o/r/resolve/main/b.safetensors")
        is None
    )
    assert wc.frontend_download_refusal(
        "taew2_1.pth", "https://github.com/madebyollin/taehv/raw/main/taew2_1.pth"
    ) == (
        "Download not allowed from source 'https://github.com/madebyollin/taehv/raw/main/taew2_1.pth', only allowed "
        "from 'https://civitai.com/', 'https://huggingface.co/', 'http://localhost:'"
    )
    assert wc.frontend_download_refusal(
        "m.pt", "https://huggingface.co/gdhe17/Self-Forcing/resolve/main/m.pt"
    ) == ("Only allowed suffixes are: '.safetensors', '.sft'")
    whitelisted = "https://huggingface.co/stabilityai/stable-zero123/resolve/main/stable_zero123.ckpt"
    assert wc.frontend_download_refusal("stable_zero123.ckpt", whitelisted) is None


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.name)
def test_every_model_file_is_offered_by_the_missing_models_dialog(path, specs):
    """Each model file a loader node names is in that node's properties.models, with a URL the frontend offers
    and the folder the loader reads; a file without such a copy is named, with its URL, in the Note."""
    ui = json.loads(path.read_text())
    api = json.loads(path.with_name(path.name.replace(".json", ".api.json")).read_text())
    (note,) = [n["widgets_values"][0] for n in ui["nodes"] if n["type"] == "Note"]
    for node in ui["nodes"]:
        if node["type"] == "Note":
            continue
        offered = {m["name"]: m for m in node["properties"].get("models", [])}
        named = set()
        for widget in specs[node["type"]].widgets:
            value = api[str(node["id"])]["inputs"][widget.name]
            if (
                not widget.is_file_combo
                or value.startswith("dummy:")
                or widget.opts.get("model_files") == "input"
            ):
                continue  # not a model file (ComfyUI/input holds the user's images and videos)
            where = (path.name, node["title"], widget.name, value)
            folder = LOADER_FOLDERS.get((node["type"], widget.name))
            assert folder is not None, f"{where}: a model-file input this test does not know the folder of"
            assert widget.opts.get("model_files", folder) == folder, where
            named.add(value)
            assert value in offered, f"{where}: not in the node's properties.models"
            assert offered[value]["directory"] == folder, where
            refusal = wc.frontend_download_refusal(value, offered[value]["url"])
            if value in NOT_OFFERED:
                assert offered[value]["url"] == NOT_OFFERED[value] and NOT_OFFERED[value] in note, where
                assert refusal == "Only allowed suffixes are: '.safetensors', '.sft'", where
                continue
            assert refusal is None, where
        assert set(offered) == named, (path.name, node["title"])  # nothing listed that the node does not load


def test_newer_comfyui_nodes_are_only_in_real_workflows():
    """EmptyFlux2LatentImage and CLIPLoader type flux2 are not in 0.3.64 (CI's server): dummy twins avoid them."""
    for path in WORKFLOWS.glob("*_dummy.api.json"):
        for node in json.loads(path.read_text()).values():
            assert node["class_type"] not in wc.NEWER_CORE_NODES, path.name
            assert node["inputs"].get("type") not in wc.NEWER_COMBO_OPTIONS[("CLIPLoader", "type")], path.name
    klein = load("flux2_klein_tiny_decode.api.json")
    assert {"EmptyFlux2LatentImage", "CLIPLoader"} <= {n["class_type"] for n in klein.values()}
    assert klein[node_id(klein, "CLIPLoader")]["inputs"]["type"] == "flux2"
