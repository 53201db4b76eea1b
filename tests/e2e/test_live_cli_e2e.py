"""``python -m fewstep live`` against a real ComfyUI server: the dummy live workflow queued once, two ``live``
clients run at the same time, each with its own control script; each one's latents (``--out
DIR/latents.safetensors``) equal what ``stream --sessions 2 --script a --script b`` writes for that session, and
each one's files and events are its own session's."""

# ruff: noqa: F811 - the tests take the imported ``server`` fixture as an argument
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from comfy_server import requires_comfyui, server  # noqa: F401

import fewstep

pytestmark = requires_comfyui
WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"
PACKAGE_PARENT = os.path.dirname(os.path.dirname(fewstep.__file__))
SHAPE = dict(width=48, height=32, chunk_frames=2, window_frames=6, sink_frames=1)
STREAM_SHAPE = ["--width", "48", "--height", "32", "--chunk-frames", "2", "--window-frames", "6", "--sink-frames", "1",
                "--schedule", "wan-dmd-4step", "--steps", "4"]  # fmt: skip
WAIT = 120  # seconds any one expected thing may take on a loaded CI machine (a bound, not an assertion)
TOLERANCE = 1e-5  # the live node batches the two sessions as it finds them due; the GEMMs round per batch
# controls from chunk 2 on: each client schedules them right after its open, long before chunk 2 starts
SCRIPTS = {
    "a": {"prompt": "a red fox running through snow", "seed": 3, "chunks": 6,
          "controls": [{"chunk": 2, "prompt": "a red fox running through a forest", "recache": True},
                       {"chunk": 4, "seed": 11}, {"chunk": 5, "prompt": "a red fox at night"}]},
    "b": {"prompt": "a corgi on a beach", "seed": 5, "chunks": 7,
          "controls": [{"chunk": 2, "prompt": "a corgi in the waves"}, {"chunk": 3, "seed": 2},
                       {"chunk": 5, "prompt": "a corgi at sunset", "recache": True}, {"chunk": 6, "stop": True}]},
}  # fmt: skip


def http(server, method: str, path: str, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server["url"] + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _cli(*args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([PACKAGE_PARENT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "fewstep", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip


@pytest.fixture(scope="module")
def live(server):
    """The dummy live workflow at the test's size, running; stopped at the end."""
    graph = json.loads((WORKFLOWS / "live_video_dummy.api.json").read_text())
    node = next(n for n in graph.values() if n["class_type"] == "FewStepLiveVideo")
    node["inputs"].update(SHAPE, max_seconds=300.0, idle_seconds=120.0)
    status, answer = http(server, "POST", "/prompt", {"prompt": graph, "client_id": "queuer"})
    assert status == 200 and not answer.get("node_errors"), answer
    deadline = time.monotonic() + WAIT
    while http(server, "GET", "/fewstep/live")[1] == []:
        assert time.monotonic() < deadline, "the live node did not start"
        time.sleep(0.1)
    yield answer["prompt_id"]
    http(server, "POST", "/fewstep/live/stop", {})
    deadline = time.monotonic() + WAIT
    while http(server, "GET", "/fewstep/live")[1] != [] and time.monotonic() < deadline:
        time.sleep(0.1)


def _run_and_compare(server, tmp_path, scripts: dict, *stream_flags) -> None:
    """Run one ``live`` client per script at once, then ``stream --sessions N --script ...``; each client's latents
    equal its session's."""
    from safetensors.torch import load_file

    paths = {}
    for name, script in scripts.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(script))
    first = next(iter(scripts))  # the first client also asks for the frames inline as JPEG
    clients = {
        name: _cli(
            "live",
            "--server",
            server["url"],
            "--script",
            str(path),
            "--out",
            str(tmp_path / name),
            "--timeout",
            str(3 * WAIT),
            *(["--jpeg"] if name == first else []),
        )  # fmt: skip
        for name, path in paths.items()
    }
    results = {name: proc.communicate(timeout=4 * WAIT) for name, proc in clients.items()}
    as_run = {}
    for name, proc in clients.items():
        out, err = results[name]
        assert proc.returncode == 0, (name, out, err)
        assert out.splitlines()[-1].startswith("metrics: time to first chunk ")
        # A control is sent once its client has opened the session: on a loaded machine a chunk may have started
        # by then, and the node applies it at the next boundary (the client says "came too late"). The engine
        # runs the script as the node applied it: the script itself whenever every control came in time.
        report = json.loads((tmp_path / name / "live.json").read_text())
        applied = {c["script_index"]: c["applied"] for c in report["controls"]}
        controls = [{**c, "chunk": applied[i]} for i, c in enumerate(scripts[name].get("controls", []))
                    if "stop" not in c]  # fmt: skip
        if "came too late" not in out + err:
            assert controls == [c for c in scripts[name].get("controls", []) if "stop" not in c]
        as_run[name] = tmp_path / f"{name}_as_run.json"
        as_run[name].write_text(
            json.dumps({**scripts[name], "chunks": len(report["chunks"]), "controls": controls})
        )
    engine = subprocess.run(
        [sys.executable, "-m", "fewstep", "stream", "--model", "wan-tiny", *STREAM_SHAPE, "--sessions",
         str(len(paths)), *(a for p in as_run.values() for a in ("--script", str(p))), *stream_flags,
         "--out", str(tmp_path / "engine")],
        capture_output=True, text=True, timeout=4 * WAIT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([PACKAGE_PARENT, os.environ.get("PYTHONPATH", "")])},
    )  # fmt: skip
    assert engine.returncode == 0, engine.stderr
    for i, name in enumerate(scripts):
        got = load_file(str(tmp_path / name / "latents.safetensors"))["latent"]
        want = load_file(str(tmp_path / "engine" / f"session_{i}" / "latents.safetensors"))["latent"]
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE)
        report = json.loads((tmp_path / name / "live.json").read_text())
        script = scripts[name]
        stop = next((c["chunk"] for c in script.get("controls", []) if "stop" in c), None)
        assert len(report["chunks"]) == min(n for n in (script.get("chunks"), stop) if n is not None)
        assert report["metrics"]["chunks"] == len(report["chunks"])
        # each client's files are of its own session
        assert {c["chunk"] for c in report["chunks"]} == set(range(got.shape[2] // SHAPE["chunk_frames"]))
    jpegs = sorted((tmp_path / first / "jpeg").iterdir())
    rows = json.loads((tmp_path / first / "live.json").read_text())["chunks"]
    assert len(jpegs) == sum(r["frames"][1] - r["frames"][0] + 1 for r in rows)  # every frame of every chunk
    assert all(p.read_bytes()[:2] == b"\xff\xd8" for p in jpegs)
    sessions = {json.loads((tmp_path / n / "live.json").read_text())["session"]["session"] for n in scripts}
    assert len(sessions) == len(scripts)


def test_two_live_clients_at_once_write_what_stream_sessions_writes(server, live, tmp_path):
    _run_and_compare(server, tmp_path, SCRIPTS)


def _png(path: Path, seed: int, size=(60, 40)) -> None:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def test_a_start_image_and_video_to_video_through_the_node_equal_the_engine(server, live, tmp_path):
    """The start image (base64 in the open body) and the input frames (POST .../frames, PNG) are decoded and
    encoded by the node's tiny VAE as ``stream --script --tiny-vae`` encodes them."""
    _png(tmp_path / "start.png", 1)
    (tmp_path / "frames").mkdir()
    for i in range(8 * 5):
        _png(tmp_path / "frames" / f"{i:03d}.png", 10 + i)
    scripts = {
        "i2v": {"prompt": "a fox", "seed": 2, "chunks": 4, "start_image": "start.png",
                "controls": [{"chunk": 2, "prompt": "a fox at night", "recache": True}]},
        "v2v": {"prompt": "a cat", "seed": 6, "chunks": 5, "input_video": "frames", "strength": 0.6,
                "controls": [{"chunk": 2, "strength": 1.0}, {"chunk": 3, "prompt": "a cat in rain"}]},
    }  # fmt: skip
    _run_and_compare(server, tmp_path, scripts, "--tiny-vae", "dummy:taew2_1")


def test_the_documented_client_example_gets_the_engines_latents(server, live, tmp_path):
    """docs/live-video.md's "A client in 50 lines" against the real node: its chunk files, concatenated, equal a
    single ``stream --script`` run of the same script."""
    from safetensors.torch import load_file

    pytest.importorskip("websocket", reason="the docs/live-video.md example needs websocket-client")
    text = (Path(__file__).resolve().parents[2] / "docs" / "live-video.md").read_text()
    code = text.split("## A client in 50 lines\n", 1)[1].split("```python\n", 1)[1].split("\n```", 1)[0]
    (tmp_path / "live_client.py").write_text(code + "\n")
    (tmp_path / "a.json").write_text(json.dumps(SCRIPTS["a"]))
    r = subprocess.run([sys.executable, "live_client.py", server["url"].removeprefix("http://"), "a.json", "chunks"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=4 * WAIT)  # fmt: skip
    assert r.returncode == 0, r.stderr
    # the script as the node applied it (see _run_and_compare): "control <seq> (<kind>) applied at chunk <n>"
    lines = [line.split() for line in r.stdout.splitlines() if line.startswith("control ")]
    applied = {
        int(words[1]): int(words[-1]) for words in lines
    }  # the sequence numbers count the sends: 1, 2...
    controls = SCRIPTS["a"]["controls"]
    assert sorted(applied) == list(range(1, len(controls) + 1))
    script = {**SCRIPTS["a"], "controls": [{**c, "chunk": applied[i + 1]} for i, c in enumerate(controls)]}
    (tmp_path / "a.json").write_text(json.dumps(script))
    files = sorted((tmp_path / "chunks").iterdir())
    assert [f.name for f in files] == [f"chunk_{n:04d}.safetensors" for n in range(SCRIPTS["a"]["chunks"])]
    got = torch.cat([load_file(str(f))["latent"] for f in files], dim=2)
    engine = subprocess.run(
        [sys.executable, "-m", "fewstep", "stream", "--model", "wan-tiny", *STREAM_SHAPE, "--script",
         str(tmp_path / "a.json"), "--out", str(tmp_path / "engine")],
        capture_output=True, text=True, timeout=4 * WAIT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([PACKAGE_PARENT, os.environ.get("PYTHONPATH", "")])},
    )  # fmt: skip
    assert engine.returncode == 0, engine.stderr
    want = load_file(str(tmp_path / "engine" / "latents.safetensors"))["latent"]
    torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE)
