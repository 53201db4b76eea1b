"""``python -m fewstep queue`` without a real ComfyUI: the --server address, UI -> API conversion, node_errors
formatting, and the exit status against a fake server (http.server plus a minimal WebSocket on 127.0.0.1)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fewstep.cli import main
from fewstep.cli.comfy_client import ComfyClient, server_address, ui_to_api
from fewstep.cli.queue import format_node_errors

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455's fixed key suffix
PROMPT_ID = "prompt-1"

API_WORKFLOW = {
    "4": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
    "9": {"class_type": "SaveLatent", "inputs": {"samples": ["4", 0], "filename_prefix": "out"}},
}

# A fragment of /object_info in the server's layout: [type or combo list, options].
OBJECT_INFO = {
    "CheckpointLoaderSimple": {
        "input": {"required": {"ckpt_name": [["tiny.safetensors", "other.safetensors"]]}}
    },
    "KSampler": {
        "input": {
            "required": {
                "model": ["MODEL"],
                "seed": ["INT", {"default": 0, "min": 0, "control_after_generate": True}],
                "steps": ["INT", {"default": 20, "min": 1}],
                "cfg": ["FLOAT", {"default": 8.0}],
                "sampler_name": [["euler", "dpmpp_2m"]],
                "positive": ["CONDITIONING"],
                "latent_image": ["LATENT"],
                "denoise": ["FLOAT", {"default": 1.0}],
            }
        }
    },
    "RandomNoise": {"input": {"required": {"noise_seed": ["INT", {"default": 0}]}}},  # companion by name
    "PrimitiveInt": {"input": {"required": {"value": ["INT", {"default": 0}]}}},
    "EmptyLatentImage": {
        "input": {"required": {"width": ["INT", {}], "height": ["INT", {}], "batch_size": ["INT", {}]}}
    },
}


def _ui_workflow(sampler_mode: int = 0) -> dict:
    """Checkpoint -> KSampler (steps driven by a link from PrimitiveInt) <- EmptyLatentImage, plus a Note."""
    return {
        "last_node_id": 7,
        "nodes": [
            {"id": 1, "type": "CheckpointLoaderSimple", "widgets_values": ["tiny.safetensors"]},
            {"id": 2, "type": "Note", "widgets_values": ["remember to pick a seed"]},
            {"id": 3, "type": "PrimitiveInt", "widgets_values": [6], "title": "Steps"},
            {"id": 4, "type": "EmptyLatentImage", "widgets_values": [64, 96, 1]},
            {
                "id": 5,
                "type": "KSampler",
                "mode": sampler_mode,
                "inputs": [
                    {"name": "model", "type": "MODEL", "link": 1},
                    {"name": "positive", "type": "CONDITIONING", "link": None},
                    {"name": "latent_image", "type": "LATENT", "link": 3},
                    {"name": "steps", "type": "INT", "widget": {"name": "steps"}, "link": 2},
                ],
                # seed, its control_after_generate value, steps (overridden by the link), cfg, sampler, denoise
                "widgets_values": [42, "randomize", 20, 1.5, "dpmpp_2m", 0.75],
            },
            {"id": 6, "type": "RandomNoise", "widgets_values": [7, "fixed"]},
        ],
        "links": [
            [1, 1, 0, 5, 0, "MODEL"],
            {"id": 2, "origin_id": 3, "origin_slot": 0, "target_id": 5, "target_slot": 3, "type": "INT"},
            [3, 4, 0, 5, 2, "LATENT"],
        ],
    }


# -- the --server address --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, expected",
    [
        ("localhost:8188", ("http://localhost:8188", "localhost", 8188)),
        ("127.0.0.1:8188/", ("http://127.0.0.1:8188", "127.0.0.1", 8188)),
        ("http://example.org", ("http://example.org", "example.org", 80)),
        ("HTTP://Example.org:9000", ("HTTP://Example.org:9000", "example.org", 9000)),
        ("[::1]:8188", ("http://[::1]:8188", "::1", 8188)),
    ],
)
def test_server_address_adds_the_scheme_and_takes_the_port_from_it(given, expected):
    assert server_address(given) == expected


@pytest.mark.parametrize(
    "given, message",
    [
        ("https://comfy.example.org", "https is not supported"),
        ("ws://127.0.0.1:8188", "expected http://host:port"),
        ("http://127.0.0.1:99999", "the port is not a number"),
        ("http://:8188", "no host name"),
    ],
)
def test_unusable_server_address_is_refused(given, message):
    with pytest.raises(ValueError, match=message):
        ComfyClient(given)


def test_https_server_is_exit_5_with_one_line(tmp_path, capsys):
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(API_WORKFLOW))
    assert _exit_status(["queue", str(wf), "--server", "https://127.0.0.1:8188"]) == 5
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "error: --server https://127.0.0.1:8188: https is not supported"
    )


def test_unreachable_server_is_a_clear_error(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(API_WORKFLOW))
    r = subprocess.run(
        [sys.executable, "-m", "fewstep", "queue", str(wf), "--server", f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert r.returncode == 5, r.stderr
    assert f"cannot open the event stream ws://127.0.0.1:{port}/ws" in r.stderr
    assert "is the server running?" in r.stderr


# -- UI -> API conversion ----------------------------------------------------------------------------------------


def test_ui_to_api_widgets_companions_links_and_notes():
    api = ui_to_api(_ui_workflow(), OBJECT_INFO)
    assert api == {
        "1": {
            "class_type": "CheckpointLoaderSimple",
            "inputs": {"ckpt_name": "tiny.safetensors"},
            "_meta": {"title": "CheckpointLoaderSimple"},
        },
        "3": {"class_type": "PrimitiveInt", "inputs": {"value": 6}, "_meta": {"title": "Steps"}},
        "4": {
            "class_type": "EmptyLatentImage",
            "inputs": {"width": 64, "height": 96, "batch_size": 1},
            "_meta": {"title": "EmptyLatentImage"},
        },
        "5": {
            "class_type": "KSampler",
            # "randomize" (the seed's control_after_generate value) is skipped, not taken as steps; the linked
            # steps widget takes the link, not its stale widget value; the unlinked positive is left out
            "inputs": {
                "seed": 42,
                "cfg": 1.5,
                "sampler_name": "dpmpp_2m",
                "denoise": 0.75,
                "model": ["1", 0],
                "latent_image": ["4", 0],
                "steps": ["3", 0],
            },
            "_meta": {"title": "KSampler"},
        },
        "6": {"class_type": "RandomNoise", "inputs": {"noise_seed": 7}, "_meta": {"title": "RandomNoise"}},
    }


@pytest.mark.parametrize("mode", [2, 4])  # 2: muted ("never"), 4: bypassed
def test_ui_to_api_refuses_muted_or_bypassed_nodes(mode):
    with pytest.raises(
        ValueError, match=r"node 5 \(KSampler\) is muted or bypassed; export with 'Save \(API\)'"
    ):
        ui_to_api(_ui_workflow(sampler_mode=mode), OBJECT_INFO)


def test_ui_to_api_refuses_frontend_only_and_unknown_nodes():
    wf = _ui_workflow()
    wf["nodes"].append({"id": 8, "type": "Reroute"})
    with pytest.raises(ValueError, match="node 8 is a frontend-only Reroute"):
        ui_to_api(wf, OBJECT_INFO)
    wf["nodes"][-1] = {"id": 8, "type": "FewStepMissing"}
    with pytest.raises(ValueError, match="node 8: the server has no node type 'FewStepMissing'"):
        ui_to_api(wf, OBJECT_INFO)


# -- node_errors -------------------------------------------------------------------------------------------------

NODE_ERRORS = {
    "5": {
        "errors": [
            {
                "type": "value_smaller_than_min",
                "message": "Value 0 smaller than min of 1",
                "details": "steps",
                "extra_info": {"input_name": "steps"},
            },
            {"type": "required_input_missing", "message": "Required input is missing", "details": ""},
        ],
        "dependent_outputs": ["9"],
        "class_type": "KSampler",
    },
    "4": {
        "errors": [{"message": "Exception when validating node", "details": "boom"}],
        "dependent_outputs": [],
    },
}


def test_format_node_errors_names_node_type_and_input():
    lines = format_node_errors(NODE_ERRORS, API_WORKFLOW)
    assert lines == [
        "node 5 (KSampler) input 'steps': Value 0 smaller than min of 1: steps",
        "node 5 (KSampler): Required input is missing",
        "node 4 (EmptyLatentImage): Exception when validating node: boom",  # class_type from the prompt
    ]
    assert format_node_errors(None, API_WORKFLOW) == []


# -- against a fake server ---------------------------------------------------------------------------------------


def _frame(payload: bytes, opcode: int) -> bytes:
    n = len(payload)
    head = bytes([0x80 | opcode]) + (bytes([n]) if n < 126 else bytes([126]) + struct.pack(">H", n))
    return head + payload  # server frames are not masked


class FakeComfy:
    """Scripted answers: ``prompt`` is (status, JSON body) for POST /prompt; ``events`` are the WebSocket
    messages sent once the prompt is posted (dicts as text, bytes as binary); records what the client sent."""

    def __init__(self):
        self.prompt = (200, {"prompt_id": PROMPT_ID, "number": 0, "node_errors": {}})
        self.events: list = [{"type": "executing", "data": {"node": None, "prompt_id": PROMPT_ID}}]
        self.history = {PROMPT_ID: {"outputs": {}}}
        self.files = {}
        self.posted = []
        self.submitted = threading.Event()


def _handler(fake: FakeComfy):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _json(self, status: int, body) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/prompt":
                return self._json(404, {})
            fake.posted.append(body)
            fake.submitted.set()
            self._json(*fake.prompt)

        def do_GET(self):
            if self.path.startswith("/ws?clientId="):
                return self._websocket()
            if self.path == "/object_info":
                return self._json(200, OBJECT_INFO)
            if self.path.startswith("/history/"):
                return self._json(200, fake.history)
            if self.path.startswith("/view?"):
                data = fake.files[self.path]
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                return self.wfile.write(data)
            self._json(404, {})

        def _websocket(self):
            key = self.headers["Sec-WebSocket-Key"]
            accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
            self.send_response(101, "Switching Protocols")
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", accept)
            self.end_headers()
            self.wfile.flush()
            sock = self.connection
            if not fake.submitted.wait(5):
                return
            for event in fake.events:
                is_text = isinstance(event, dict)
                sock.sendall(
                    _frame(json.dumps(event).encode() if is_text else event, 0x1 if is_text else 0x2)
                )
            sock.settimeout(5)
            try:  # hold the stream open until the client closes it (or times out)
                while sock.recv(4096):
                    pass
            except OSError:
                pass

    return Handler


@pytest.fixture
def fake_server():
    fake = FakeComfy()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    fake.url = f"127.0.0.1:{httpd.server_address[1]}"  # no scheme on purpose: the client adds http://
    try:
        yield fake
    finally:
        httpd.shutdown()
        httpd.server_close()


def _exit_status(argv: list[str]) -> int:
    """What ``python -m fewstep ARGV`` exits with (some checks end the command with SystemExit)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def _queue(fake, tmp_path, workflow=API_WORKFLOW, *extra):
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(workflow))
    return _exit_status(["queue", str(wf), "--server", fake.url, "--timeout", "5", *extra])


def test_success_prints_progress_and_downloads_outputs(fake_server, tmp_path, capsys):
    fake_server.events = [
        {"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 1}}}},
        {"type": "progress", "data": {"node": "9", "value": 1, "max": 2, "prompt_id": "someone-else"}},
        b"\x00\x00\x00\x01preview",
        {"type": "progress", "data": {"node": "9", "value": 2, "max": 2, "prompt_id": PROMPT_ID}},
        {"type": "executing", "data": {"node": None, "prompt_id": PROMPT_ID}},
    ]
    item = {"filename": "out_00001_.latent", "subfolder": "", "type": "output"}
    fake_server.history = {PROMPT_ID: {"outputs": {"9": {"latents": [item]}, "10": {"text": ["hello"]}}}}
    fake_server.files = {"/view?filename=out_00001_.latent&subfolder=&type=output": b"LATENT"}
    out = tmp_path / "out"
    assert _queue(fake_server, tmp_path, API_WORKFLOW, "--out", str(out), "--set", "4.width=128") == 0
    captured = capsys.readouterr()
    assert captured.err == "node 9 SaveLatent: 2/2\n"  # the other prompt's progress is not shown
    assert captured.out == f"node 9 latents: {out / 'out_00001_.latent'}\nnode 10 text:\nhello\n"
    assert (out / "out_00001_.latent").read_bytes() == b"LATENT"
    mask = os.umask(0)
    os.umask(mask)
    assert (out / "out_00001_.latent").stat().st_mode & 0o777 == 0o666 & ~mask  # not mkstemp's 0600
    [posted] = fake_server.posted
    assert posted["prompt"]["4"]["inputs"]["width"] == 128 and posted["client_id"]


def test_ui_format_file_is_converted_with_the_servers_object_info(fake_server, tmp_path, capsys):
    assert _queue(fake_server, tmp_path, _ui_workflow(), "--quiet") == 0
    assert "UI-format (canvas) workflow; converting it" in capsys.readouterr().err
    assert fake_server.posted[0]["prompt"] == ui_to_api(_ui_workflow(), OBJECT_INFO)


def test_ui_format_with_bypassed_node_is_exit_5(fake_server, tmp_path, capsys):
    assert _queue(fake_server, tmp_path, _ui_workflow(sampler_mode=4)) == 5
    err = capsys.readouterr().err
    assert "error: cannot convert" in err and "node 5 (KSampler) is muted or bypassed" in err
    assert fake_server.posted == []  # nothing was queued


def test_partial_validation_is_exit_2_with_the_servers_message(fake_server, tmp_path, capsys):
    fake_server.prompt = (200, {"prompt_id": PROMPT_ID, "number": 0, "node_errors": NODE_ERRORS})
    assert _queue(fake_server, tmp_path) == 2
    err = capsys.readouterr().err
    assert (
        "error: node 5 (KSampler) input 'steps': Value 0 smaller than min of 1: steps (the valid outputs still run)"
        in err
    )
    assert "error: node 4 (EmptyLatentImage): Exception when validating node: boom" in err


def test_rejected_workflow_is_exit_2_with_the_servers_message(fake_server, tmp_path, capsys):
    fake_server.prompt = (
        400,
        {
            "error": {
                "type": "prompt_outputs_failed_validation",
                "message": "Prompt outputs failed validation",
            },
            "node_errors": NODE_ERRORS,
        },
    )
    assert _queue(fake_server, tmp_path) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "error: the server rejected the workflow: Prompt outputs failed validation"
    assert err[1] == "  node 5 (KSampler) input 'steps': Value 0 smaller than min of 1: steps"


def test_execution_error_is_exit_3(fake_server, tmp_path, capsys):
    fake_server.events = [
        {"type": "execution_start", "data": {"prompt_id": PROMPT_ID}},
        {
            "type": "execution_error",
            "data": {
                "prompt_id": PROMPT_ID,
                "node_id": "9",
                "node_type": "SaveLatent",
                "exception_message": "disk full\n",
            },
        },
    ]
    assert _queue(fake_server, tmp_path) == 3
    assert capsys.readouterr().err == "error: node 9 (SaveLatent) failed: disk full\n"


def test_server_text_cannot_drive_the_terminal(fake_server, tmp_path, capsys):
    """Names and messages from the server are printed with control characters escaped (no terminal escapes)."""
    fake_server.events = [
        {
            "type": "execution_error",
            "data": {
                "prompt_id": PROMPT_ID,
                "node_id": "9\x1b]0;owned\x07",
                "node_type": "Save\x1b[2J",
                "exception_message": "bad\x1b[31m red",
            },
        },
    ]
    assert _queue(fake_server, tmp_path) == 3
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err
    assert err == "error: node 9\\x1b]0;owned\\x07 (Save\\x1b[2J) failed: bad\\x1b[31m red\n"


def test_no_result_in_time_is_exit_4(fake_server, tmp_path, capsys):
    fake_server.events = []
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(API_WORKFLOW))
    assert _exit_status(["queue", str(wf), "--server", fake_server.url, "--timeout", "0.5"]) == 4
    assert capsys.readouterr().err == "error: no result within 0.5 s\n"
