"""The core nodes the shipped workflows use run on every ComfyUI the pack supports (0.3.64 and 0.8.0).

ComfyUI 0.8.0 deprecates ImageBatch (BatchImagesNode replaces it, absent from 0.3.64); the workflows keep it,
since deprecated nodes are hidden from node search but still execute. These offline tests pin that decision;
tests/e2e/test_core_nodes_e2e.py checks it against a real server of each version.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import workflow_check as wc  # noqa: E402
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
        "wan_causal_prompt_recache.api.json",
        "wan_causal_prompt_recache_dummy.api.json",
        "zimage_turbo_stream_batch_dummy.api.json",
    }
    for name in users:
        assert IMAGE_BATCH_NOTE in _note(WORKFLOWS / name), name
