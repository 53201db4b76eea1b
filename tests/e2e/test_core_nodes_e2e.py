"""The core nodes of the shipped dummy workflows exist and run on the ComfyUI under test (0.3.64 and 0.8.0).

ComfyUI 0.8.0 deprecates ImageBatch (BatchImagesNode replaces it, absent from 0.3.64); the workflows keep it, since
deprecated nodes are hidden from node search but still execute (tests/workflows/test_core_nodes_compat.py pins the
decision offline). Runs once per ComfyUI version with tests/e2e.
"""

# ruff: noqa: F811 - the tests take the imported ``server`` fixture as an argument
from __future__ import annotations

from comfy_server import queue, requires_comfyui, server  # noqa: F401 - ``server`` is a fixture
from test_core_nodes_compat import DUMMY_API_FILES, _core_nodes  # puts workflows/ on the path first

from fewstep_workflows.nodes import DEPRECATED_CORE_NODES  # noqa: E402  isort: skip


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
