"""Every numeric input of every node, fed out-of-range values by a link through a real ComfyUI server.

ComfyUI checks a widget's min / max only for values typed into the widget; a core ``PrimitiveInt`` /
``PrimitiveFloat`` linked to the input skips that check (``steps`` = 2^31 once allocated 21.5 GB and got the server
killed). The test walks the server's own ``/object_info`` for the pack's nodes, links a primitive holding max + 1
and min - 1 to each INT / FLOAT input in turn (NaN and -9.2e18 for a FLOAT, the string "false" for a BOOLEAN through
a wildcard link), and expects the node's one-line error naming the input, with the server still answering.
"""

# ruff: noqa: F811 - the tests take the imported ``server`` fixture as an argument
from __future__ import annotations

import json
import math
import sys
import time
import urllib.error
import urllib.request

import pytest
from comfy_server import PROBE, requires_comfyui, server  # noqa: F401

pytestmark = requires_comfyui

# one provider node per object type; their outputs are cached by ComfyUI across the prompts of the walk
PROVIDERS = {
    "FEWSTEP_MODEL": ("FewStepDiTLoader", {"model_name": "dummy:flux-tiny", "weight_dtype": "default",
                                           "compute_dtype": "auto", "attention": "auto"}),
    "CONDITIONING": ("FewStepSyntheticConditioning", {"tokens": 4, "width": 64, "pooled_width": 0,
                                                      "guidance": 0.0, "seed": 0}),
    "LATENT": ("EmptyLatentImage", {"width": 64, "height": 64, "batch_size": 1}),
    "IMAGE": ("EmptyImage", {"width": 64, "height": 64, "batch_size": 1, "color": 0}),
    "FEWSTEP_TINY_VAE": ("FewStepTinyVAELoader", {"vae_name": "dummy:taef1", "dtype": "auto"}),
    "MODEL": ("ProbeTinySD15", {"seed": 0}),
}  # fmt: skip
# a session to continue: a real one-chunk wan-tiny stream (FEWSTEP_SESSION has no cheaper source)
SESSION_GRAPH = {
    "s1": {"class_type": "FewStepDiTLoader", "inputs": {"model_name": "dummy:wan-tiny", "weight_dtype": "default",
                                                         "compute_dtype": "auto", "attention": "auto"}},
    "s2": {"class_type": "FewStepSyntheticConditioning",
           "inputs": {"tokens": 4, "width": 4096, "pooled_width": 0, "guidance": 0.0, "seed": 1}},
    "s3": {"class_type": "FewStepCausalVideoSampler",
           "inputs": {"model": ["s1", 0], "positive": ["s2", 0], "width": 32, "height": 32, "num_chunks": 1,
                      "chunk_frames": 1, "window_frames": 2, "sink_frames": 0, "schedule": "wan-dmd-4step",
                      "steps": 1, "seed": 0}},
}  # fmt: skip


def _post(server, graph: dict) -> tuple[str, str]:
    """Queue ``graph``; ("invalid", why) when /prompt refuses it, else (status, the execution error or "")."""
    body = json.dumps({"prompt": graph, "client_id": "fewstep-e2e-inputs"}).encode()
    request = urllib.request.Request(
        server["url"] + "/prompt", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            prompt_id = json.load(r)["prompt_id"]
    except urllib.error.HTTPError as err:
        return "invalid", err.read().decode(errors="replace")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{server['url']}/history/{prompt_id}", timeout=60) as r:
            history = json.load(r)
        if prompt_id in history and history[prompt_id]["status"].get("completed") is not None:
            status = history[prompt_id]["status"]
            errors = [
                m[1]["exception_message"].strip() for m in status["messages"] if m[0] == "execution_error"
            ]
            if status["status_str"] != "success" or errors:
                return "error", "\n".join(errors)
            return "success", ""
        time.sleep(0.05)
    raise AssertionError(f"prompt {prompt_id} did not finish")


def _graph(node: str, info: dict, input_name: str, source: list) -> dict:
    """``node`` with ``input_name`` fed by ``source`` and every other required input valid."""
    graph = {}
    inputs = {}
    for name, declaration in info["input"]["required"].items():
        kind, options = declaration[0], (declaration[1] if len(declaration) > 1 else {})
        if name == input_name:
            inputs[name] = source
        elif isinstance(kind, list):
            inputs[name] = options.get("default", kind[0])
        elif kind in ("INT", "FLOAT", "BOOLEAN", "STRING"):
            inputs[name] = options["default"]
        elif kind == "FEWSTEP_SESSION":
            graph.update(SESSION_GRAPH)
            inputs[name] = ["s3", 2]
        else:
            provider, provider_inputs = PROVIDERS[kind]
            graph[f"p_{kind}"] = {"class_type": provider, "inputs": provider_inputs}
            inputs[name] = [f"p_{kind}", 0]
    if input_name not in inputs:
        inputs[input_name] = source
    graph["target"] = {"class_type": node, "inputs": inputs}
    graph["out"] = {"class_type": "PreviewAny", "inputs": {"source": ["target", 0]}}
    return graph


def _our_nodes(server) -> dict:
    return {name: info for name, info in server["info"].items() if name.startswith("FewStep")
            and not name.startswith("FewStepE2E")}  # fmt: skip


def _numeric_inputs(info: dict):
    for section in ("required", "optional"):
        for name, declaration in info["input"].get(section, {}).items():
            if declaration[0] in ("INT", "FLOAT"):
                yield name, declaration[0], declaration[1]


def test_every_numeric_input_is_bounded_through_a_linked_primitive(server):
    nodes = _our_nodes(server)
    if not PROBE.exists():
        nodes.pop("FewStepCacheGateNative")  # its MODEL comes from the probe pack's tiny native model
    checked = []
    for node, info in sorted(nodes.items()):
        for name, kind, options in _numeric_inputs(info):
            primitive = "PrimitiveInt" if kind == "INT" else "PrimitiveFloat"
            low, high = options["min"], options["max"]
            values = [high + 1, low - 1] if kind == "INT" else [high + 1.0, low - 1.0, math.nan, -9.2e18]
            for value in values:
                if kind == "INT" and not -sys.maxsize <= value <= sys.maxsize:
                    continue  # beyond PrimitiveInt's own range (a seed's 2^64): ComfyUI refuses it there
                graph = _graph(node, info, name, ["prim", 0])
                graph["prim"] = {"class_type": primitive, "inputs": {"value": value}}
                status, message = _post(server, graph)
                expected = f"{node}: input '{name}': expected "
                assert status == "error" and message.startswith(expected), (
                    node,
                    name,
                    value,
                    status,
                    message,
                )
                assert "\n" not in message and "Traceback" not in message, message
                checked.append((node, name))
    assert len(set(checked)) >= 50, sorted(set(checked))  # the walk reached the pack's numeric inputs


@pytest.mark.parametrize(
    ("node", "input_name", "value", "expected"),
    [
        ("FewStepSampler", "steps", 2**31, "expected an integer in [1, 200], got 2147483648"),
        ("FewStepSampler", "preview", "false", "expected a boolean (true or false), got the text 'false'"),
        ("FewStepSampler", "cfg", "NaN", "expected a finite number in [0.0, 30.0], got nan"),
        ("FewStepSampler", "latent_image", 5, "expected a LATENT (a dict with a 'samples' tensor), got 5"),
        ("FewStepSampler", "sampler", ["euler"], "expected one of 'euler', 'dmd', 'lcm', 'tcd'; got a list"),
        ("FewStepDiTLoader", "model_name", 7, "expected text, got 7"),
        ("FewStepDiTLoader", "weight_dtype", "fp64", "expected one of 'default', 'fp32'"),
        ("FewStepSyntheticConditioning", "pooled_width", 2**63, "expected an integer in [0, 8192], got 9223372036854775808"),
        ("FewStepParallelLauncher", "threads_per_rank", 2**40, "expected an integer in [0, 1024], got 1099511627776"),
    ],
)  # fmt: skip
def test_a_wildcard_link_delivers_any_value_and_gets_one_line(server, node, input_name, value, expected):
    info = server["info"][node]
    graph = _graph(node, info, input_name, ["any", 0])
    literal = "NaN" if value == "NaN" else json.dumps(value)
    graph["any"] = {"class_type": "FewStepE2EAnyJSON", "inputs": {"json": literal}}
    status, message = _post(server, graph)
    assert status == "error", (status, message)
    assert message.startswith(f"{node}: input '{input_name}': {expected}"), message
    # the server is still up and answers the next prompt
    with urllib.request.urlopen(server["url"] + "/queue", timeout=30) as r:
        assert json.load(r)["queue_running"] == []
