"""The interactive inputs of the causal video sampler through a real ComfyUI server: core nodes' outputs of the
wrong kind (an image LATENT from EmptyLatentImage, frames of another size from EmptyImage) are refused with the
node's one-line error naming the input. The dummy workflows that run them correctly are in
test_comfyui_server.py (test_dummy_workflow_runs)."""

# ruff: noqa: F811 - the tests take the imported ``server`` fixture as an argument
from __future__ import annotations

import json
from pathlib import Path

import pytest
from comfy_server import requires_comfyui, server  # noqa: F401
from test_input_checks_e2e import _post

pytestmark = requires_comfyui
WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"


def _sampler(graph: dict) -> dict:
    return next(n for n in graph.values() if n["class_type"] == "FewStepCausalVideoSampler")


@pytest.mark.parametrize(
    ("source", "input_name", "expected"),
    [
        (
            {"class_type": "EmptyLatentImage", "inputs": {"width": 96, "height": 64, "batch_size": 1}},
            "start_latent",
            "FewStepCausalVideoSampler: input 'start_latent': a LATENT of shape [1, 4, 8, 12]; expected a Wan 2.1 "
            "video LATENT",
        ),
        (
            {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 8, "color": 0}},
            "input_images",
            "FewStepCausalVideoSampler: input 'input_images': frames of 64x64 px; this video is 96x64 px",
        ),
    ],
    ids=["image-latent", "image-size"],
)
def test_wrong_inputs_are_refused_naming_the_node_and_input(server, source, input_name, expected):
    graph = json.loads((WORKFLOWS / "wan_causal_image_to_video_dummy.api.json").read_text())
    sampler = _sampler(graph)
    sampler["inputs"].pop("start_latent")
    graph["wrong"] = source
    sampler["inputs"][input_name] = ["wrong", 0]
    status, message = _post(server, graph)
    assert status == "error" and expected in message, (status, message)
