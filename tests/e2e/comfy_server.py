"""The pieces the end-to-end modules share: a real ComfyUI server with this pack linked in, and the project's
queue client to drive it.

Needs a ComfyUI checkout: ``COMFYUI_DIR=/path/to/ComfyUI`` (and ``COMFYUI_PYTHON`` for its interpreter; default:
``$COMFYUI_DIR/../venv/bin/python`` when it exists, else this Python). The server runs on 127.0.0.1 on a free port
with a temporary base directory whose custom_nodes/ links this repository (and the probe pack from
``../shared/comfyui/probe`` when present, which provides a tiny SD1.5-layout native model, and the test-only
packs in packs/). A module that uses
the ``server`` fixture imports it from here (one server per module) and marks itself ``requires_comfyui``.
The fixture's dict names the ComfyUI it runs (``version`` such as ``"0.8.0"``, ``commit``, ``label`` such as
``"ComfyUI 0.8.0 (618b803d)"``; also the module-level ``COMFYUI_VERSION``), so a test can say which version it
checked or skip with a reason naming it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from comfy_version import comfyui_commit, comfyui_version, describe

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / "workflows"
PROBE = ROOT.parent / "shared" / "comfyui" / "probe" / "probe_pack_v3"
TEST_PACKS = Path(__file__).resolve().parent / "packs"  # test-only node packs (see each one's docstring)
COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
COMFYUI_VERSION = comfyui_version(COMFYUI_DIR) if COMFYUI_DIR else None

requires_comfyui = pytest.mark.skipif(
    not COMFYUI_DIR or not (Path(COMFYUI_DIR) / "main.py").exists(),
    reason="set COMFYUI_DIR to a ComfyUI checkout (see docs/testing.md: end-to-end tests) to run these",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _python() -> str:
    explicit = os.environ.get("COMFYUI_PYTHON")
    if explicit:
        return explicit
    sibling = Path(COMFYUI_DIR).parent / "venv" / "bin" / "python"
    return str(sibling) if sibling.exists() else sys.executable


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("comfy")
    for sub in ("custom_nodes", "output", "input", "temp", "user", "models"):
        (base / sub).mkdir()
    (base / "custom_nodes" / "ComfyUI-FewStep").symlink_to(ROOT)
    if PROBE.exists():
        (base / "custom_nodes" / "probe_pack_v3").symlink_to(PROBE)
    for test_pack in TEST_PACKS.iterdir():
        if (test_pack / "__init__.py").exists():
            (base / "custom_nodes" / test_pack.name).symlink_to(test_pack)
    port = free_port()
    with open(base / "server.log", "w") as log:
        proc = subprocess.Popen(
            [_python(), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), "--base-directory",
             str(base), "--database-url", f"sqlite:///{base}/user/comfyui.db", "--disable-auto-launch",
             "--preview-method", "none"],
            cwd=COMFYUI_DIR, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            yield {
                "url": url,
                "info": _wait_ready(url, proc, base),
                "base": base,
                "pid": proc.pid,
                "version": comfyui_version(COMFYUI_DIR),
                "commit": comfyui_commit(COMFYUI_DIR),
                "label": describe(COMFYUI_DIR),
            }
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def _wait_ready(url: str, proc, base: Path) -> dict:
    deadline = time.monotonic() + 240
    while True:
        try:
            with urllib.request.urlopen(url + "/object_info", timeout=5) as r:
                return json.load(r)
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    "ComfyUI did not start:\n" + (base / "server.log").read_text()[-3000:]
                ) from None
            time.sleep(0.5)


def queue(server, workflow, *extra, timeout=600):
    """Run ``python -m fewstep queue`` (the project's own client) and return (exit code, stdout + stderr)."""
    if isinstance(workflow, dict):
        path = server["base"] / f"wf_{time.monotonic_ns()}.json"
        path.write_text(json.dumps(workflow))
        workflow = path
    r = subprocess.run([sys.executable, "-m", "fewstep", "queue", str(workflow), "--server", server["url"], *extra],
                       capture_output=True, text=True, timeout=timeout)  # fmt: skip
    return r.returncode, r.stdout + r.stderr
