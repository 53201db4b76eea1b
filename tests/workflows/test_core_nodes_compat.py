"""The core nodes the shipped workflows use run on every ComfyUI the pack supports (0.3.64 and 0.8.0).

ComfyUI 0.8.0 deprecates ImageBatch (BatchImagesNode replaces it, absent from 0.3.64); the workflows keep it,
since deprecated nodes are hidden from node search but still execute. The offline tests pin that decision; the
server tests (``COMFYUI_DIR``, as in tests/e2e) check it against a real server of either version.
"""

# ruff: noqa: F811 - the server tests take the imported ``server`` fixture as an argument
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

import workflow_check as wc  # noqa: E402
from comfy_server import queue, requires_comfyui, server  # noqa: E402, F401 - ``server`` is a fixture
from fewstep_workflows.nodes import DEPRECATED_CORE_NODES, IMAGE_BATCH_NOTE  # noqa: E402

WORKFLOWS = wc.ROOT / "workflows"
API_FILES = sorted(WORKFLOWS.glob("*.api.json"))
DUMMY_API_FILES = [p for p in API_FILES if p.name.endswith("_dummy.api.json")]
PACK_NODES = set(wc.load_pack().NODE_CLASS_MAPPINGS)


def _core_nodes(paths) -> dict[str, set[str]]:
    """Core node class -> the workflow files that use it."""
    used: dict[str, set[str]] = {}
    for path in paths:
        for node in json.loads(path.read_text()).values():
            if node["class_type"] not in PACK_NODES:
                used.setdefault(node["class_type"], set()).add(path.name)
    return used


def _note(api_path: Path) -> str:
    ui = json.loads(api_path.with_name(api_path.name.replace(".api.json", ".json")).read_text())
    return next(n["widgets_values"][0] for n in ui["nodes"] if n["type"] == "Note")


def test_workflows_use_no_core_node_that_0_3_64_lacks_outside_the_real_newer_workflows():
    used = _core_nodes(API_FILES)
    assert set(used) <= set(wc.CORE_NODES) | set(wc.NEWER_CORE_NODES), sorted(set(used) - set(wc.CORE_NODES))
    # the replacements of deprecated nodes are newer than 0.3.64: a workflow using one would not load there
    assert not set(used) & set(DEPRECATED_CORE_NODES.values()), sorted(
        set(used) & set(DEPRECATED_CORE_NODES.values())
    )
    assert set(DEPRECATED_CORE_NODES) <= set(wc.CORE_NODES)  # kept because 0.3.64 has them


def test_each_workflow_with_a_deprecated_core_node_says_why_in_its_note():
    users = {name for node in DEPRECATED_CORE_NODES for name in _core_nodes(API_FILES).get(node, ())}
    assert users == {
        "flux_schnell_stream_batch_dummy.api.json",
        "wan_causal_continue.api.json",
        "wan_causal_continue_dummy.api.json",
        "zimage_turbo_stream_batch_dummy.api.json",
    }
    for name in users:
        assert IMAGE_BATCH_NOTE in _note(WORKFLOWS / name), name


@requires_comfyui
def test_every_core_node_of_the_dummy_workflows_is_on_the_server(server):
    info = server["info"]
    used = _core_nodes(DUMMY_API_FILES)
    assert set(used) <= set(info), sorted(set(used) - set(info))
    deprecated = {name for name in used if info[name].get("deprecated")}
    # a deprecation the table does not know about means a decision to take (keep, or switch and lose 0.3.64)
    assert deprecated <= set(DEPRECATED_CORE_NODES), sorted(deprecated - set(DEPRECATED_CORE_NODES))
    for name in deprecated:
        assert DEPRECATED_CORE_NODES[name] in info, name  # where it is deprecated, its replacement exists


@requires_comfyui
def test_image_batch_still_executes(server, tmp_path):
    # deprecated on 0.8.0: the server must still run it (2 blue + 1 orange frames -> one batch of 3)
    graph = {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": 8, "height": 8, "batch_size": 2, "color": 0x3366CC},
        },
        "2": {
            "class_type": "EmptyImage",
            "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": 0xEE8833},
        },
        "3": {"class_type": "ImageBatch", "inputs": {"image1": ["1", 0], "image2": ["2", 0]}},
        "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": "image_batch"}},
    }
    code, out = queue(server, graph, "--out", str(tmp_path))
    assert code == 0, out
    assert len([p for p in tmp_path.rglob("image_batch*.png")]) == 3, out
