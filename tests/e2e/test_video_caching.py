"""The causal video nodes under ComfyUI's own caching, and their streamed chunks, through a real server.

The sampler is cached like any node (same inputs: not run again, however its session was used since); a
Continue that runs again on a cached sampler output, or on one whose session was freed, gives exactly what a
fresh run of the same graph gives; each chunk reaches the client as a ``fewstep.chunk`` event with its clip.
"""

# ruff: noqa: F811 - the tests take the imported ``server`` fixture as an argument
from __future__ import annotations

import io
import json
import time
import urllib.parse
import urllib.request
import uuid

import pytest
from comfy_server import ROOT, WORKFLOWS, requires_comfyui, server  # noqa: F401

pytestmark = requires_comfyui


def _client(server):
    import sys

    sys.path.insert(0, str(ROOT.parent))  # the repository root is the package `fewstep`
    from fewstep.cli.comfy_client import ComfyClient

    return ComfyClient(server["url"], timeout=600)


def _stream_graph(num_chunks: int = 2, fps: float = 16.0, continue_chunks: int | None = None) -> dict:
    graph = json.loads((WORKFLOWS / "wan_causal_stream_dummy.api.json").read_text())
    sampler = next(k for k, v in graph.items() if v["class_type"] == "FewStepCausalVideoSampler")
    graph[sampler]["inputs"]["num_chunks"] = num_chunks
    for node in graph.values():
        if node["class_type"] == "SaveAnimatedWEBP":
            node["inputs"]["fps"] = fps
    graph["90"] = {
        "class_type": "SaveLatent",
        "inputs": {"samples": [sampler, 0], "filename_prefix": "cache/s"},
    }
    if continue_chunks is not None:
        graph["91"] = {"class_type": "FewStepCausalContinue",
                       "inputs": {"session": [sampler, 2], "num_chunks": continue_chunks}}  # fmt: skip
        graph["92"] = {
            "class_type": "SaveLatent",
            "inputs": {"samples": ["91", 0], "filename_prefix": "cache/c"},
        }
    return graph


def _run(server, graph: dict, events: list | None = None) -> dict:
    """Queue ``graph``, wait for it; its history entry plus the nodes it ran and the ones it took from cache."""
    client, client_id = _client(server), uuid.uuid4().hex
    ws = client.websocket(client_id)
    try:
        prompt_id = client.submit(graph, client_id)["prompt_id"]
        while True:
            kind, payload = ws.receive()
            if kind != "text":
                continue
            msg = json.loads(payload)
            data = msg.get("data") or {}
            if events is not None and msg["type"] == "fewstep.chunk":
                events.append((time.monotonic(), data))
            if msg["type"] == "execution_error":
                pytest.fail(f"the run failed: {data}")
            if msg["type"] == "executing" and data.get("node") is None and data.get("prompt_id") == prompt_id:
                break
    finally:
        ws.close()
    for _ in range(40):
        entry = client.history(prompt_id)
        if entry:
            break
        time.sleep(0.25)
    messages = dict((kind, data) for kind, data in entry["status"]["messages"])
    cached = set(messages.get("execution_cached", {}).get("nodes", []))
    ran = set(entry["outputs"]) | (set(graph) - cached)
    return {"entry": entry, "cached": cached, "ran": ran, "prompt_id": prompt_id}


def _latent(server, run: dict, node: str):
    import safetensors.torch

    (item,) = run["entry"]["outputs"][node]["latents"]
    path = server["base"] / "output" / item["subfolder"] / item["filename"]
    return safetensors.torch.load_file(str(path))["latent_tensor"]


def _free(server, everything: bool) -> None:
    body = {"unload_models": True, "free_memory": everything}  # free_memory: ComfyUI also drops its caches
    req = urllib.request.Request(server["url"] + "/free", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    urllib.request.urlopen(req, timeout=10).read()
    # The prompt worker handles these flags when it wakes, or after the prompt it picks first: a cheap prompt
    # run to its end makes sure they are handled before the next one starts.
    _run(server, {"1": {"class_type": "FewStepSyntheticConditioning", "inputs": {"tokens": 16, "width": 4096,
                  "pooled_width": 0, "guidance": 0.0, "seed": 0}},
                  "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}})  # fmt: skip


def test_the_sampler_is_cached_and_a_session_continues_across_prompts(server):
    _free(server, everything=True)
    sampler = next(k for k, v in _stream_graph().items() if v["class_type"] == "FewStepCausalVideoSampler")
    first = _run(server, _stream_graph())
    assert sampler in first["ran"]
    again = _run(server, _stream_graph())  # the same prompt: nothing runs again
    assert sampler in again["cached"]
    fps = _run(server, _stream_graph(fps=8.0))  # only the saver's input changed
    assert sampler in fps["cached"] and "6" not in fps["cached"]
    cont = _run(server, _stream_graph(continue_chunks=1))  # later, the same graph plus a Continue
    assert sampler in cont["cached"] and "91" not in cont["cached"]
    assert _latent(server, cont, "92").shape[2] == 2  # one chunk of 2 latent frames


@pytest.mark.parametrize("freed", [False, True], ids=["moved-on", "freed"])
def test_a_continue_run_again_gives_what_a_fresh_run_gives(server, freed):
    _free(server, everything=True)
    _run(server, _stream_graph())
    one = _run(server, _stream_graph(continue_chunks=1))  # moves the cached sampler's session on
    if freed:  # the sessions go with the models; the loaders see it and run again, and so the sampler
        _free(server, everything=False)
    two = _run(server, _stream_graph(continue_chunks=2))  # the Continue again, with another num_chunks
    assert "91" in two["ran"] and ("4" in two["ran"]) == freed
    _free(server, everything=True)
    fresh_one = _run(server, _stream_graph(continue_chunks=1))
    _free(server, everything=True)
    fresh_two = _run(server, _stream_graph(continue_chunks=2))
    assert "91" in fresh_two["ran"] and not fresh_two["cached"] & {"4", "91"}
    assert _latent(server, two, "92").equal(_latent(server, fresh_two, "92"))
    assert _latent(server, one, "92").equal(_latent(server, fresh_one, "92"))
    assert _latent(server, two, "92")[:, :, :2].equal(_latent(server, one, "92"))


def test_each_chunk_reaches_the_client_while_the_node_runs(server):
    from PIL import Image

    _free(server, everything=True)
    events: list = []
    run = _run(server, _stream_graph(num_chunks=3), events)
    assert [e["chunk"] for _, e in events] == [0, 1, 2]
    assert all(
        e["prompt_id"] == run["prompt_id"] and e["node"] == "4" and e["chunks"] == 3 for _, e in events
    )
    assert [e["frames"] for _, e in events] == [[0, 4], [5, 12], [13, 20]]
    for _, e in events:
        (file,) = e["files"]
        with urllib.request.urlopen(server["url"] + "/view?" + urllib.parse.urlencode(file), timeout=10) as r:
            clip = Image.open(io.BytesIO(r.read()))
            assert (clip.n_frames, clip.size) == (e["frames"][1] - e["frames"][0] + 1, (96, 64))


def test_queue_stream_dir_saves_every_chunk_as_it_comes(server, tmp_path):
    from comfy_server import queue
    from PIL import Image

    graph = _stream_graph(num_chunks=3)
    graph["4"]["inputs"]["seed"] = 1234  # not a cached run
    code, out = queue(server, graph, "--stream-dir", str(tmp_path / "clips"), "--quiet")
    assert code == 0, out
    lines = [line for line in out.splitlines() if line.startswith(("chunk ", "first chunk: "))]
    assert lines[0].startswith("first chunk: ") and len(lines) == 4, out
    spans = [line.split("frames ")[1].split(",")[0] for line in lines[1:]]
    assert [line.split(" (node")[0] for line in lines[1:]] == ["chunk 1/3", "chunk 2/3", "chunk 3/3"]
    assert spans == ["0-4", "5-12", "13-20"]
    clips = sorted((tmp_path / "clips" / "fewstep").iterdir())
    assert [Image.open(c).n_frames for c in clips] == [5, 8, 8]
