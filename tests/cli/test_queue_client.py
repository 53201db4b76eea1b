"""``python -m fewstep queue`` without a real ComfyUI: the --server address, UI -> API conversion, node_errors
formatting, the exit status and --stream-dir (fewstep.chunk events) against a fake server (http.server plus a
minimal WebSocket on 127.0.0.1), and the stream client example of docs/streaming-api.md against the same server.

``python -m fewstep queue`` against hostile servers: paths in /history that point outside ``--out``, servers that
stall or flood so that ``--timeout`` must hold (also while a ``--stream-dir`` chunk clip downloads), answers that
are not what ComfyUI sends (HTML, a /prompt reply without prompt_id, garbage WebSocket frames, absurd sizes, deeply
nested JSON), and chunk clips that cannot be saved (reported, the run goes on).

The fake server is raw sockets on 127.0.0.1 so that each test can misbehave at the byte level. Every server loop
is bounded (SERVER_LIFETIME seconds at most), so a test ends by itself even when the client misbehaves; elapsed
time is only checked as "did not hang" (less than --timeout + 10 s)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fewstep.cli import main
from fewstep.cli.comfy_client import (
    FRONTEND_ONLY_NODES,
    NOTE_NODES,
    ComfyClient,
    server_address,
    ui_to_api,
)
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
        cwd=Path(__file__).resolve().parents[2],
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


def test_ui_to_api_drops_exactly_the_frontend_only_nodes():
    """The node types ComfyUI frontend 1.27.10 marks virtual (isVirtualNode: Note and MarkdownNote, Reroute,
    PrimitiveNode) never reach the API prompt: notes are dropped, the two that rewire links are refused; every
    other node is kept, a backend node named like one of them (PrimitiveInt) included."""
    assert {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"} == FRONTEND_ONLY_NODES
    assert {"Note", "MarkdownNote"} == NOTE_NODES
    kept = ui_to_api(_ui_workflow(), OBJECT_INFO)
    for kind in sorted(FRONTEND_ONLY_NODES):
        wf = _ui_workflow()
        wf["nodes"].append({"id": 8, "type": kind, "widgets_values": ["text"]})
        if kind in NOTE_NODES:
            assert ui_to_api(wf, OBJECT_INFO) == kept
        else:
            with pytest.raises(ValueError, match=f"node 8 is a frontend-only {kind}; export"):
                ui_to_api(wf, OBJECT_INFO)
    backend = {n["type"] for n in _ui_workflow()["nodes"]} - FRONTEND_ONLY_NODES
    assert {n["class_type"] for n in kept.values()} == backend


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
        self.files = {}  # _view_path(item) -> bytes
        self.posted = []
        self.viewed = []  # the /view queries asked, as {filename, subfolder, type}
        self.ws_client_ids = []
        self.submitted = threading.Event()


def _view_path(item: dict) -> str:
    """The /view path of a file ({filename, subfolder, type}), its query in one fixed order."""
    return "/view?" + urllib.parse.urlencode(
        {key: item.get(key, "") for key in ("filename", "subfolder", "type")}
    )


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
                query = dict(urllib.parse.parse_qsl(self.path[len("/view?") :], keep_blank_values=True))
                fake.viewed.append(query)
                data = fake.files.get(_view_path(query))
                if data is None:
                    return self._json(404, {})
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
            fake.ws_client_ids.append(self.path[len("/ws?clientId=") :])
            if not fake.submitted.wait(5):
                return
            for event in fake.events:
                is_text = isinstance(event, dict)
                sock.sendall(
                    _frame(json.dumps(event).encode() if is_text else event, 0x1 if is_text else 0x2)
                )
            sock.settimeout(5)
            try:  # hold the stream open until the client closes it (or times out)
                while data := sock.recv(4096):
                    if data[0] & 0x0F == 0x8:  # the client's close frame: answer it (websocket-client waits)
                        sock.sendall(_frame(b"", 0x8))
                        break
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


def test_a_repeated_progress_value_prints_one_line(fake_server, tmp_path, capsys):
    """The video sampler reports a chunk's end (with its preview) and the same count again before the next
    chunk's first step: one line per value and node."""

    def progress(node, value):
        return {"type": "progress", "data": {"node": node, "value": value, "max": 8, "prompt_id": PROMPT_ID}}

    fake_server.events = [
        progress("9", 3),
        progress("9", 4),
        b"\x00\x00\x00\x01preview",
        progress("9", 4),
        progress("4", 4),  # another node at the same count is its own line
        progress("9", 5),
        {"type": "executing", "data": {"node": None, "prompt_id": PROMPT_ID}},
    ]
    fake_server.history = {PROMPT_ID: {"outputs": {}}}
    assert _queue(fake_server, tmp_path) == 0
    assert capsys.readouterr().err.splitlines() == [
        "node 9 SaveLatent: 3/8",
        "node 9 SaveLatent: 4/8",
        "node 4 EmptyLatentImage: 4/8",
        "node 9 SaveLatent: 5/8",
    ]


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


# -- --stream-dir: the fewstep.chunk events ------------------------------------------------------------------------

KV_BYTES = 1258291  # 1.2 MiB


def _clip(index: int, subfolder: str = "fewstep") -> dict:
    return {"filename": f"fewstep_ab12_{index:05d}.webp", "subfolder": subfolder, "type": "temp"}


def _chunk_event(chunk: int, frames, files=(), node="12", chunks=3, prompt_id=PROMPT_ID, **fields) -> dict:
    """A fewstep.chunk event as the contract (docs/streaming-api.md) has it, plus a field this client does not know."""
    data = {
        "prompt_id": prompt_id,
        "node": node,
        "chunk": chunk,
        "chunks": chunks,
        "frames": list(frames),
        "files": list(files),
        "seconds": 0.84,
        "first_chunk_seconds": 1.9,
        "kv_bytes": KV_BYTES,
        "a_field_of_a_newer_node": {"ignored": True},
    }
    data.update(fields)
    return {"type": "fewstep.chunk", "data": data}


DONE = {"type": "executing", "data": {"node": None, "prompt_id": PROMPT_ID}}
FIRST_CHUNK_LINE = re.compile(
    r"first chunk: \d+\.\d\d s after submit \(client\), first_chunk_seconds 1\.90 s \(node\)"
)


def _stream_run(fake, tmp_path, capsys, *extra) -> tuple[int, list[str], list[str], Path]:
    """(exit status, stdout lines, stderr lines, the --stream-dir) of a --quiet run with --stream-dir."""
    stream = tmp_path / "stream"
    code = _queue(fake, tmp_path, API_WORKFLOW, "--stream-dir", str(stream), "--quiet", *extra)
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err.splitlines(), stream


def test_stream_dir_saves_each_chunk_as_it_arrives_with_one_line_per_chunk(fake_server, tmp_path, capsys):
    clips = {_view_path(_clip(i)): f"RIFF-webp-{i}".encode() * (i + 1) for i in (0, 2)}
    clips[_view_path(_clip(7))] = b"the other prompt's clip"
    fake_server.files = dict(clips)
    fake_server.events = [
        {"type": "execution_start", "data": {"prompt_id": PROMPT_ID}},
        {"type": "progress", "data": {"node": "12", "value": 4, "max": 12, "prompt_id": PROMPT_ID}},
        _chunk_event(0, [0, 8], [{**_clip(0), "format": "image/webp"}]),  # a field it does not know: ignored
        _chunk_event(0, [0, 8], [_clip(7)], prompt_id="someone-else"),  # not ours: not even looked at
        b"\x00\x00\x00\x01preview",
        _chunk_event(1, [9, 20], [], kv_bytes=512),  # a node that decodes no frames lists no file
        _chunk_event(2, [21, 32], [_clip(2)], seconds=1.5, kv_bytes=3 << 30),
        DONE,
    ]
    code, out, err, stream = _stream_run(fake_server, tmp_path, capsys)
    assert code == 0, err
    assert err == []
    saved = os.path.join(os.path.realpath(stream), "fewstep")
    assert FIRST_CHUNK_LINE.fullmatch(out[0]), out
    assert out[1:] == [
        f"chunk 1/3 (node 12): frames 0-8, 0.84 s, KV 1.2 MiB -> {saved}/fewstep_ab12_00000.webp",
        "chunk 2/3 (node 12): frames 9-20, 0.84 s, KV 512 B (no file: the node decodes no frames)",
        f"chunk 3/3 (node 12): frames 21-32, 1.50 s, KV 3.0 GiB -> {saved}/fewstep_ab12_00002.webp",
    ]
    assert sorted(p.name for p in (stream / "fewstep").iterdir()) == [
        "fewstep_ab12_00000.webp",
        "fewstep_ab12_00002.webp",
    ]
    for i in (0, 2):  # byte-identical to what the server holds
        assert (stream / "fewstep" / _clip(i)["filename"]).read_bytes() == clips[_view_path(_clip(i))]
    assert fake_server.viewed == [_clip(0), _clip(2)]  # the /view queries had exactly these parameters


def test_a_continue_counts_its_own_chunks_while_the_index_goes_on(fake_server, tmp_path, capsys):
    """The index keeps counting across FewStepCausalContinue; "k/N" is the chunk's place in this node run."""
    fake_server.files = {_view_path(_clip(i)): b"x" for i in (4, 5)}
    fake_server.events = [
        _chunk_event(4, [39, 50], [_clip(4)], node="15", chunks=2),
        _chunk_event(5, [51, 62], [_clip(5)], node="15", chunks=2),
        DONE,
    ]
    code, out, err, stream = _stream_run(fake_server, tmp_path, capsys)
    assert code == 0, err
    assert [line.split(":")[0] for line in out[1:]] == ["chunk 1/2 (node 15)", "chunk 2/2 (node 15)"]


@pytest.mark.parametrize(
    "filename, subfolder, reason",
    [
        ("../escaped.webp", "fewstep", "is not a plain file name"),
        ("/tmp/escaped.webp", "", "is not a plain file name"),
        ("escaped.webp", "ABSOLUTE", "is absolute"),
        ("escaped.webp", "fewstep/../../..", "contains '..'"),
        # names that would be saved reading as something else, or that no file system name can hold
        (
            "\u202egnp.exe.webp",
            "fewstep",
            r"'\u202egnp.exe.webp' is not a plain file name (it contains U+202E "
            "RIGHT-TO-LEFT OVERRIDE, an invisible format character such as a bidi override or a zero-width space)",
        ),
        ("clip\u200b.webp", "fewstep", "it contains U+200B ZERO WIDTH SPACE, an invisible format character"),
        ("clip\ufeff.webp", "fewstep", "it contains U+FEFF ZERO WIDTH NO-BREAK SPACE"),
        ("clip\ud800.webp", "fewstep", "it contains U+D800, a lone surrogate, which no file name can hold"),
        (
            "clip.webp",
            "few\u2067step",
            r"the subfolder 'few\u2067step' cannot name a folder (it contains U+2067 "
            "RIGHT-TO-LEFT ISOLATE",
        ),
        ("clip.webp", "few\u2028step", "it contains U+2028 LINE SEPARATOR, a line separator"),
    ],
)
def test_a_chunk_file_named_outside_stream_dir_is_refused(
    fake_server, tmp_path, capsys, filename, subfolder, reason
):
    outside = tmp_path / "outside"
    outside.mkdir()
    if subfolder == "ABSOLUTE":
        subfolder = str(outside)
    bad = {"filename": filename, "subfolder": subfolder, "type": "temp"}
    fake_server.files = {_view_path(_clip(1)): b"GOOD"}
    with contextlib.suppress(UnicodeEncodeError):  # a lone surrogate cannot even be put in a URL
        fake_server.files[_view_path(bad)] = b"EVIL"
    fake_server.events = [_chunk_event(0, [0, 8], [bad]), _chunk_event(1, [9, 20], [_clip(1)]), DONE]
    code, out, err, stream = _stream_run(fake_server, tmp_path, capsys)
    assert code == 5
    assert err[0].startswith("error: refused a file of chunk 1/3 (node 12): ") and reason in err[0], err
    assert err[0].endswith("; nothing was written")
    assert err[1:] == ["error: refused 1 fewstep.chunk events or files the server sent (see above)"]
    assert out[1] == "chunk 1/3 (node 12): frames 0-8, 0.84 s, KV 1.2 MiB (no file saved, see above)"
    assert out[2].startswith("chunk 2/3 (node 12): frames 9-20")  # the run went on
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["stream/fewstep/fewstep_ab12_00001.webp", "wf.json"]
    assert fake_server.viewed == [_clip(1)]  # the refused name was not even asked for


MISSING = object()  # a field left out of the event


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"frames": None}, "its 'frames' is 'null', expected [first, last] video frame numbers"),
        (
            {"frames": [8, 0]},
            "its 'frames' is '[8, 0]', expected [first, last] video frame numbers, first <= last",
        ),
        ({"frames": [0, 4, 8]}, "its 'frames' is '[0, 4, 8]'"),
        ({"chunk": "3"}, "its 'chunk' is '\"3\"', expected a chunk index (an integer >= 0)"),
        ({"chunk": True}, "its 'chunk' is 'true', expected a chunk index"),
        ({"chunks": 0}, "its 'chunks' is '0', expected a number of chunks (an integer >= 1)"),
        ({"node": 12}, "its 'node' is '12', expected a node id (text)"),
        ({"seconds": float("nan")}, "its 'seconds' is 'NaN', expected seconds (a number >= 0)"),
        ({"first_chunk_seconds": -1}, "its 'first_chunk_seconds' is '-1', expected seconds"),
        ({"kv_bytes": 10**400}, "its 'kv_bytes' is '1000000000"),
        (
            {"files": {"filename": "a.webp"}},
            "its 'files' is '{\"filename\": \"a.webp\"}', expected a list of at",
        ),
        (
            {"files": [_clip(0)] * 17},
            "expected a list of at most 16 {filename, subfolder, type} objects of text",
        ),
        ({"files": [{"filename": "a.webp", "subfolder": "fewstep"}]}, "its 'files' is"),
        ({"files": [{"filename": ["a"], "subfolder": "", "type": "temp"}]}, "its 'files' is"),
        ({"prompt_id": MISSING}, "it has no 'prompt_id'"),
        ({"kv_bytes": MISSING}, "it has no 'kv_bytes'"),
    ],
)
def test_a_malformed_chunk_event_is_refused_with_one_line(fake_server, tmp_path, capsys, fields, message):
    event = _chunk_event(0, [0, 8], [_clip(0)])
    event["data"].update(fields)
    for key in [key for key, value in fields.items() if value is MISSING]:
        del event["data"][key]
    fake_server.files = {_view_path(_clip(i)): b"x" for i in (0, 1)}
    fake_server.events = [event, _chunk_event(1, [9, 20], [_clip(1)]), DONE]
    code, out, err, stream = _stream_run(fake_server, tmp_path, capsys)
    assert code == 5
    assert len(err) == 2 and err[0].startswith("error: refused a fewstep.chunk event: "), err
    assert message in err[0] and err[0].endswith("; nothing was downloaded"), err
    assert err[1] == "error: refused 1 fewstep.chunk events or files the server sent (see above)"
    assert FIRST_CHUNK_LINE.fullmatch(out[0]) and out[1].startswith("chunk 1/3 (node 12): frames 9-20"), out
    assert fake_server.viewed == [_clip(1)]


def test_a_chunk_file_that_cannot_be_downloaded_is_reported_and_the_run_goes_on(
    fake_server, tmp_path, capsys
):
    fake_server.files = {
        _view_path(_clip(1)): b"GOOD"
    }  # clip 0 already deleted by the server (or never there)
    fake_server.events = [_chunk_event(0, [0, 8], [_clip(0)]), _chunk_event(1, [9, 20], [_clip(1)]), DONE]
    code, out, err, stream = _stream_run(fake_server, tmp_path, capsys)
    assert code == 0, err
    assert err == [
        "error: chunk 1/3 (node 12): could not save 'fewstep_ab12_00000.webp' (GET /view?filename=fewstep_ab12_"
        "00000.webp&subfolder=fewstep&type=temp answered HTTP 404: '{}'); the run goes on"
    ]
    assert out[1] == "chunk 1/3 (node 12): frames 0-8, 0.84 s, KV 1.2 MiB (no file saved, see above)"
    assert out[2].endswith("fewstep_ab12_00001.webp")
    assert (stream / "fewstep" / "fewstep_ab12_00001.webp").read_bytes() == b"GOOD"


def test_without_stream_dir_chunk_events_are_ignored(fake_server, tmp_path, capsys):
    fake_server.files = {_view_path(_clip(0)): b"x"}
    fake_server.events = [
        _chunk_event(0, [0, 8], [_clip(0)]),
        _chunk_event(1, [9, 20], kv_bytes=None),
        DONE,
    ]  # even a bad one
    assert _queue(fake_server, tmp_path, API_WORKFLOW, "--quiet") == 0
    assert capsys.readouterr() == ("", "")
    assert fake_server.viewed == []


@pytest.mark.parametrize("flag", ["--stream-dir", "--out"])
def test_a_folder_that_cannot_be_made_is_exit_5_before_queueing(fake_server, tmp_path, capsys, flag):
    (tmp_path / "taken").write_text("a file")
    assert _queue(fake_server, tmp_path, API_WORKFLOW, flag, str(tmp_path / "taken" / "clips")) == 5
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag} {tmp_path / 'taken' / 'clips'}: cannot create the folder ("), err
    assert fake_server.posted == []


def test_stream_dir_help_is_one_sentence_with_the_default(capsys):
    with pytest.raises(SystemExit):
        main(["queue", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "--stream-dir DIR save each chunk clip a fewstep sampler streams while the prompt runs into DIR"
        in text
    )
    assert "(default: none, chunk events are ignored)" in text


# -- the stream client example of docs/streaming-api.md -------------------------------------------------------------

STREAMING_DOC = Path(__file__).resolve().parents[2] / "docs" / "streaming-api.md"
EXAMPLE_HEADING = "## Consuming the stream from your own client"


def _doc_stream_example(doc: Path) -> str | None:
    """The ```python block right under EXAMPLE_HEADING (no other heading between), or None."""
    text = doc.read_text() if doc.exists() else ""
    _, found, rest = text.partition(f"\n{EXAMPLE_HEADING}\n")
    start = rest.find("```python\n")
    if not found or start < 0 or re.search(r"^#{1,6} ", rest[:start], re.M):
        return None
    return rest[start + len("```python\n") :].split("\n```", 1)[0] + "\n"


def test_the_documented_stream_client_example_saves_every_chunk(fake_server, tmp_path):
    code = _doc_stream_example(STREAMING_DOC)
    # The page is shipped with the pack: a lost heading or code block is a documentation bug, not a skip.
    assert code is not None, f"{STREAMING_DOC} has no ```python block under {EXAMPLE_HEADING!r}"
    pytest.importorskip(
        "websocket",
        reason="the docs/streaming-api.md example needs websocket-client (pip install websocket-client)",
    )
    script = tmp_path / "stream_client.py"
    script.write_text(code)
    wf = tmp_path / "workflow_api.json"
    wf.write_text(json.dumps(API_WORKFLOW))
    clips = {_view_path(_clip(i)): f"clip {i}".encode() * 1000 for i in range(3)}
    fake_server.files = dict(clips)
    fake_server.events = [
        {"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 1}}}},
        _chunk_event(0, [0, 8], [_clip(0)]),
        b"\x00\x00\x00\x01preview",
        _chunk_event(7, [0, 8], [_clip(9)], prompt_id="someone-else"),
        _chunk_event(1, [9, 20], []),
        _chunk_event(2, [21, 32], [_clip(1)]),
        _chunk_event(3, [33, 44], [_clip(2)]),
        DONE,
    ]
    out = tmp_path / "clips"
    r = subprocess.run(
        [sys.executable, str(script), fake_server.url, str(wf), str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == [_clip(i)["filename"] for i in range(3)]
    for i in range(3):
        assert (out / _clip(i)["filename"]).read_bytes() == clips[_view_path(_clip(i))]
    [posted] = fake_server.posted
    assert posted["prompt"] == API_WORKFLOW and fake_server.ws_client_ids == [posted["client_id"]]


SERVER_LIFETIME = 15.0  # no server loop runs longer than this
ONE_NODE_WORKFLOW = {
    "4": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}
}


def ws_frame(payload: bytes, opcode: int = 0x1, first_byte: int | None = None) -> bytes:
    """An unmasked server frame; ``first_byte`` overrides FIN/RSV/opcode for malformed frames."""
    n = len(payload)
    if n < 126:
        length = bytes([n])
    elif n < 1 << 16:
        length = bytes([126]) + struct.pack(">H", n)
    else:
        length = bytes([127]) + struct.pack(">Q", n)
    return bytes([0x80 | opcode if first_byte is None else first_byte]) + length + payload


def http_answer(status: int, body: bytes, content_type: str = "application/json", length: int | None = None):
    head = (
        f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body) if length is None else length}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def json_answer(body, status: int = 200) -> bytes:
    return http_answer(status, json.dumps(body).encode())


class HostileServer:
    """One listening socket; each connection's request goes to ``routes[(method, path prefix)]``, a function
    ``(conn, path) -> None`` that writes whatever it likes. Defaults answer like a well-behaved ComfyUI."""

    def __init__(self):
        self.posted = threading.Event()
        self.ws_events: list[bytes] = [ws_frame(json.dumps(DONE).encode())]
        self.history = {PROMPT_ID: {"outputs": {}}}
        self.files: dict[str, bytes] = {}
        self.routes = {
            ("POST", "/prompt"): self.send(
                json_answer({"prompt_id": PROMPT_ID, "number": 0, "node_errors": {}})
            ),
            ("GET", "/ws"): self.websocket(self.send_events),
            ("GET", "/history/"): lambda conn, path: conn.sendall(json_answer(self.history)),
            ("GET", "/view"): self.view,
        }
        self.stopped = threading.Event()
        self.local = threading.local()  # the request headers of the connection this thread serves
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.url = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @staticmethod
    def send(data: bytes):
        return lambda conn, path: conn.sendall(data)

    def _accept(self):
        end = time.monotonic() + SERVER_LIFETIME
        while not self.stopped.is_set() and time.monotonic() < end:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket):
        with conn:
            conn.settimeout(SERVER_LIFETIME)
            try:
                head = b""
                while b"\r\n\r\n" not in head and len(head) < 1 << 16:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    head += chunk
                head, body = head.split(b"\r\n\r\n", 1)
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = dict(line.split(": ", 1) for line in lines[1:])
                self.local.ws_key = headers.get("Sec-WebSocket-Key", "")
                length = int(headers.get("Content-Length", 0))
                while len(body) < length:
                    body += conn.recv(65536)
                if method == "POST" and path == "/prompt":
                    self.posted.set()
                for (want_method, prefix), route in self.routes.items():
                    if method == want_method and path.startswith(prefix):
                        return route(conn, path)
                conn.sendall(json_answer({}, status=404))
            except OSError:
                pass

    def websocket(self, behaviour, accept: str | None = None):
        """A route that completes the handshake, waits for the prompt to be posted, then runs ``behaviour``."""

        def route(conn, path):
            key = (
                accept
                or base64.b64encode(hashlib.sha1((self.local.ws_key + WS_GUID).encode()).digest()).decode()
            )
            conn.sendall(
                "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Accept: {key}\r\n\r\n".encode()
            )
            if self.posted.wait(SERVER_LIFETIME):
                behaviour(conn)

        return route

    def send_events(self, conn):
        for frame in self.ws_events:
            conn.sendall(frame)
        self.linger(conn)

    def linger(self, conn):
        """Hold the connection open until the client closes it (bounded)."""
        conn.settimeout(1.0)
        end = time.monotonic() + SERVER_LIFETIME
        while time.monotonic() < end:
            try:
                if not conn.recv(4096):
                    return
            except TimeoutError:
                continue
            except OSError:
                return

    def view(self, conn, path):
        data = self.files.get(path)
        conn.sendall(http_answer(200, data, "image/png") if data is not None else json_answer({}, status=404))

    def close(self):
        self.stopped.set()
        self.thread.join(2)
        self.listener.close()


@pytest.fixture
def hostile():
    server = HostileServer()
    try:
        yield server
    finally:
        server.close()


def run_queue(server, tmp_path, *extra, timeout: float = 2.0):
    """(exit status, seconds) of ``queue`` against ``server``; an escaping exception fails the test as it is."""
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(ONE_NODE_WORKFLOW))
    start = time.monotonic()
    try:
        code = main(["queue", str(wf), "--server", server.url, "--timeout", str(timeout), "--quiet", *extra])
    except SystemExit as exc:
        code = exc.code
    return code, time.monotonic() - start


def one_error_line(err: str) -> str:
    """The single line the client printed to stderr; fails when there are several or it is not an error."""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# -- 1. the client writes only inside --out ------------------------------------------------------------------------


def _history_item(filename, subfolder="", kind="output"):
    return {"filename": filename, "subfolder": subfolder, "type": kind}


@pytest.mark.parametrize(
    "filename, subfolder, reason",
    [
        ("../escaped.png", "", "not a plain file name"),
        ("x/../../escaped.png", "", "not a plain file name"),
        ("..", "", "not a plain file name"),
        ("escaped.png", "ABSOLUTE", "absolute"),
        ("escaped.png", "a/../../..", "'..'"),
        ("escaped.png", "..\\..", "'..'"),
        ("esc\x00aped.png", "", "not a plain file name"),
        ("escaped.png", "sub\x00dir", "control character"),
        ("\u202egnp.exe.png", "", "it contains U+202E RIGHT-TO-LEFT OVERRIDE, an invisible format character"),
        ("a\u200db.png", "", "it contains U+200D ZERO WIDTH JOINER"),
        ("a\udc80b.png", "", "it contains U+DC80, a lone surrogate"),
        (
            "escaped.png",
            "sub\u202adir",
            "the subfolder 'sub\\u202adir' cannot name a folder (it contains U+202A",
        ),
        ("escaped.png", "sub\x85dir", "it contains U+0085, a control character"),
    ],
)
def test_outputs_outside_out_are_refused_and_reported(hostile, tmp_path, capsys, filename, subfolder, reason):
    outside = tmp_path / "outside"
    outside.mkdir()
    out = outside / "a" / "b" / "out"  # ../.. from out is still inside tmp_path: nothing can land elsewhere
    if subfolder == "ABSOLUTE":
        subfolder = str(outside)
    bad = _history_item(filename, subfolder)
    good = _history_item("fine_00001_.png", "videos/day1")
    hostile.history = {PROMPT_ID: {"outputs": {"9": {"images": [bad, good]}}}}
    hostile.files = {_view_path(good): b"GOOD"}
    with contextlib.suppress(UnicodeEncodeError):  # a lone surrogate cannot even be put in a URL
        hostile.files[_view_path(bad)] = b"EVIL"
    code, _ = run_queue(hostile, tmp_path, "--out", str(out))
    captured = capsys.readouterr()
    assert code == 5, captured.err
    # the well-formed item is still downloaded, into its relative subfolder
    assert (out / "videos" / "day1" / "fine_00001_.png").read_bytes() == b"GOOD"
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["outside/a/b/out/videos/day1/fine_00001_.png", "wf.json"]
    err = captured.err.splitlines()
    assert err[0].startswith("error: refused output of node 9 (images): ") and reason in err[0], err
    assert "nothing was written" in err[0]
    assert (
        err[-1] == "error: refused 1 of 2 output files the server listed (see above); the others were saved"
    )


def test_symlink_inside_out_does_not_lead_outside(hostile, tmp_path, capsys):
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "link").symlink_to(outside, target_is_directory=True)
    (out / "trap.png").symlink_to(outside / "trap.png")  # an existing file symlink is not followed either
    items = [_history_item("escaped.png", "link/new"), _history_item("trap.png")]
    hostile.history = {PROMPT_ID: {"outputs": {"9": {"images": items}}}}
    hostile.files = {_view_path(item): b"EVIL" for item in items}
    code, _ = run_queue(hostile, tmp_path, "--out", str(out))
    err = capsys.readouterr().err
    assert code == 5, err
    assert list(outside.iterdir()) == []  # not even the directory "new" was created
    assert err.count("leads outside --out") == 2, err


def test_local_output_path_accepts_relative_names_and_refuses_escapes(tmp_path):
    from fewstep.cli.comfy_client import UnsafeOutputError, local_output_path

    out = str(tmp_path)
    assert local_output_path(out, "", "a.png") == os.path.join(os.path.realpath(out), "a.png")
    assert local_output_path(out, "x/./y/", "a.png") == os.path.join(os.path.realpath(out), "x", "y", "a.png")
    assert local_output_path(out, None, "a.png") == os.path.join(os.path.realpath(out), "a.png")
    for subfolder, filename in [("", "a/b.png"), ("", ""), ("", "."), ("/etc", "a"), ("C:\\x", "a"), ("", 7)]:
        with pytest.raises(UnsafeOutputError):
            local_output_path(out, subfolder, filename)


# -- 2. --timeout holds whatever the server does ------------------------------------------------------------------


def _ping_forever(conn):
    end = time.monotonic() + SERVER_LIFETIME
    with contextlib.suppress(OSError):
        while time.monotonic() < end:
            conn.sendall(ws_frame(b"", opcode=0x9))
            time.sleep(0.02)


def test_a_server_that_only_pings_hits_the_timeout(hostile, tmp_path, capsys):
    hostile.routes[("GET", "/ws")] = hostile.websocket(_ping_forever)
    code, elapsed = run_queue(hostile, tmp_path, timeout=1.0)
    assert code == 4
    assert one_error_line(capsys.readouterr().err) == "error: no result within 1 s"
    assert elapsed < 1.0 + 10


def _huge_frame_then_trickle(conn):
    conn.sendall(bytes([0x82, 127]) + struct.pack(">Q", 1 << 62))
    end = time.monotonic() + SERVER_LIFETIME
    with contextlib.suppress(OSError):
        while time.monotonic() < end:
            conn.sendall(b"x" * 1024)
            time.sleep(0.01)


def test_a_frame_declaring_2_to_the_62_bytes_is_refused_at_once(hostile, tmp_path, capsys):
    hostile.routes[("GET", "/ws")] = hostile.websocket(_huge_frame_then_trickle)
    code, elapsed = run_queue(hostile, tmp_path, timeout=3.0)
    assert code == 5
    line = one_error_line(capsys.readouterr().err)
    assert "the event stream sent a frame of 4611686018427387904 bytes" in line and "at most" in line, line
    assert elapsed < 3.0 + 10


def _trickle(prefix: bytes):
    def route(conn, path):
        conn.sendall(prefix)
        end = time.monotonic() + SERVER_LIFETIME
        with contextlib.suppress(OSError):
            while time.monotonic() < end:
                conn.sendall(b"X")
                time.sleep(0.05)

    return route


@pytest.mark.parametrize(
    "route",
    [
        ("POST", "/prompt"),  # the answer's head never ends
        ("GET", "/history/"),  # the body trickles in, one byte at a time
    ],
)
def test_a_trickling_http_answer_hits_the_timeout(hostile, tmp_path, capsys, route):
    if route[0] == "POST":
        hostile.routes[route] = _trickle(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    else:
        hostile.routes[route] = _trickle(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n{")
    code, elapsed = run_queue(hostile, tmp_path, timeout=1.5)
    assert code == 4
    assert one_error_line(capsys.readouterr().err).startswith("error: no result within 1.5 s")
    assert elapsed < 1.5 + 10


def test_a_websocket_handshake_that_never_ends_hits_the_timeout(hostile, tmp_path, capsys):
    hostile.routes[("GET", "/ws")] = _trickle(b"HTTP/1.1 101 Switching Protocols\r\nX-Slow: ")
    code, elapsed = run_queue(hostile, tmp_path, timeout=1.0)
    assert code in (4, 5)  # the deadline or the handshake size limit, whichever comes first
    line = one_error_line(capsys.readouterr().err)
    assert "no result within 1 s" in line or "handshake" in line, line
    assert elapsed < 1.0 + 10


# -- 3. answers that are not ComfyUI's: one line, exit status 5 -----------------------------------------------------

HTML = b"<!DOCTYPE html><html><body>It works!</body></html>"
NESTED = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(
    "answer, expected",
    [
        (http_answer(200, HTML, "text/html"), "POST /prompt answered with something that is not JSON"),
        (http_answer(404, HTML, "text/html"), "POST /prompt answered HTTP 404"),
        (json_answer({"number": 0, "node_errors": {}}), "POST /prompt answered without a prompt_id"),
        (json_answer(["not", "an", "object"]), "POST /prompt answered without a prompt_id"),
        (http_answer(200, NESTED), "POST /prompt answered with JSON nested deeper than"),
        (http_answer(200, b"{}", length=1 << 40), "POST /prompt answered with 1099511627776 bytes"),
        (http_answer(200, b"\xff\xfe{"), "POST /prompt answered with something that is not JSON"),
    ],
)
def test_a_prompt_answer_that_is_not_comfyuis_is_exit_5(hostile, tmp_path, capsys, answer, expected):
    hostile.routes[("POST", "/prompt")] = hostile.send(answer)
    code, _ = run_queue(hostile, tmp_path)
    line = one_error_line(capsys.readouterr().err)
    assert code == 5
    assert expected in line, line
    assert "is --server a ComfyUI server?" in line


@pytest.mark.parametrize(
    "frame, expected",
    [
        (ws_frame(b"<html>not json</html>"), "the event stream sent something that is not JSON"),
        (ws_frame(b"\xff\xfe\xfd"), "the event stream sent something that is not JSON"),
        (ws_frame(b"[1, 2, 3]"), "the event stream sent a message that is not a ComfyUI event"),
        (ws_frame(NESTED), "the event stream sent JSON nested deeper than"),
        (ws_frame(b"{}", first_byte=0x80 | 0x40 | 0x1), "reserved bits"),  # RSV1 without an extension
        (ws_frame(b"x", first_byte=0x83), "unknown opcode 3"),
        (ws_frame(b"x" * 200, opcode=0x9), "a control frame of 200 bytes"),
        (ws_frame(b"x", opcode=0x0), "a continuation frame without a message to continue"),
        (bytes([0x81, 0x81]) + b"mask" + b"x", "a masked frame"),
    ],
)
def test_garbage_websocket_frames_are_exit_5(hostile, tmp_path, capsys, frame, expected):
    hostile.ws_events = [frame, ws_frame(json.dumps(DONE).encode())]
    code, _ = run_queue(hostile, tmp_path)
    line = one_error_line(capsys.readouterr().err)
    assert code == 5
    assert expected in line, line


def test_a_handshake_with_a_wrong_accept_key_is_exit_5(hostile, tmp_path, capsys):
    hostile.routes[("GET", "/ws")] = hostile.websocket(hostile.send_events, accept="d3Jvbmc=")
    code, _ = run_queue(hostile, tmp_path)
    line = one_error_line(capsys.readouterr().err)
    assert code == 5
    assert "Sec-WebSocket-Accept" in line, line


@pytest.mark.parametrize(
    "history, expected",
    [
        (NESTED, "GET /history/prompt-1 answered with JSON nested deeper than"),
        (HTML, "GET /history/prompt-1 answered with something that is not JSON"),
        (
            b'{"prompt-1": {"outputs": []}}',
            "GET /history/prompt-1 answered with a history entry ComfyUI does not",
        ),
        (b'["prompt-1"]', "GET /history/prompt-1 answered with a history entry ComfyUI does not"),
    ],
)
def test_a_bad_history_answer_is_exit_5(hostile, tmp_path, capsys, history, expected):
    hostile.routes[("GET", "/history/")] = hostile.send(http_answer(200, history))
    code, _ = run_queue(hostile, tmp_path)
    line = one_error_line(capsys.readouterr().err)
    assert code == 5
    assert expected in line, line


def test_a_missing_output_file_is_exit_5_with_one_line(hostile, tmp_path, capsys):
    hostile.history = {PROMPT_ID: {"outputs": {"9": {"images": [_history_item("gone.png")]}}}}
    code, _ = run_queue(hostile, tmp_path, "--out", str(tmp_path / "out"))
    line = one_error_line(capsys.readouterr().err)
    assert code == 5
    assert line.startswith("error: GET /view?filename=gone.png&subfolder=&type=output answered HTTP 404"), (
        line
    )
    assert not (tmp_path / "out" / "gone.png").exists()


def test_an_output_file_larger_than_declared_limits_is_refused(hostile, tmp_path, capsys, monkeypatch):
    from fewstep.cli import comfy_client

    monkeypatch.setattr(comfy_client, "MAX_FILE_BYTES", 1000)
    item = _history_item("big.png")
    hostile.history = {PROMPT_ID: {"outputs": {"9": {"images": [item]}}}}
    hostile.files = {_view_path(item): b"x" * 5000}
    code, _ = run_queue(hostile, tmp_path, "--out", str(tmp_path / "out"))
    line = one_error_line(capsys.readouterr().err)
    assert code == 5
    assert "answered with 5000 bytes, more than the 1000 this client accepts" in line, line
    assert list((tmp_path / "out").iterdir()) == []  # no partial file left behind


def test_an_output_that_cannot_be_saved_is_one_line_exit_5(hostile, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "videos").write_text("a file where the subfolder should be")
    item = _history_item("clip.png", "videos")
    hostile.history = {PROMPT_ID: {"outputs": {"9": {"images": [item]}}}}
    hostile.files = {_view_path(item): b"PNG"}
    code, _ = run_queue(hostile, tmp_path, "--out", str(out))
    line = one_error_line(capsys.readouterr().err)
    assert code == 5
    assert line.startswith(f"error: cannot write {os.path.realpath(out / 'videos' / 'clip.png')}: "), line


# -- answers that are odd but harmless are not errors ----------------------------------------------------------------


def test_an_event_whose_data_is_not_an_object_is_skipped(hostile, tmp_path, capsys):
    custom = {"type": "some.pack.event", "data": [1, 2, 3]}
    hostile.ws_events = [ws_frame(json.dumps(custom).encode()), ws_frame(json.dumps(DONE).encode())]
    code, _ = run_queue(hostile, tmp_path)
    assert code == 0, capsys.readouterr().err


def test_a_rejection_whose_error_is_a_string_is_exit_2(hostile, tmp_path, capsys):
    hostile.routes[("POST", "/prompt")] = hostile.send(
        json_answer({"error": "no outputs", "node_errors": []}, status=400)
    )
    code, _ = run_queue(hostile, tmp_path)
    assert code == 2
    assert capsys.readouterr().err == "error: the server rejected the workflow: no outputs\n"


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_timeout_must_be_a_positive_number_of_seconds(tmp_path, capsys, value):
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(ONE_NODE_WORKFLOW))
    with pytest.raises(SystemExit) as exc:
        main(["queue", str(wf), "--server", "127.0.0.1:9", "--timeout", value])
    assert exc.value.code == 2
    assert f"argument --timeout: expected a number of seconds > 0, got '{value}'" in capsys.readouterr().err


# -- 4. --stream-dir: the chunk clips a fewstep.chunk event names ----------------------------------------------------


def _chunk_frame(chunk: int, files: list[dict]) -> bytes:
    data = {"prompt_id": PROMPT_ID, "node": "12", "chunk": chunk, "chunks": 2, "frames": [12 * chunk, 12 * chunk + 8],
            "files": files, "seconds": 0.5, "first_chunk_seconds": 0.5, "kv_bytes": 1024}  # fmt: skip
    return ws_frame(json.dumps({"type": "fewstep.chunk", "data": data}).encode())


def test_a_stalled_chunk_download_cannot_outlive_the_timeout(hostile, tmp_path, capsys):
    clip = _history_item("fewstep_00000.webp", "fewstep", "temp")
    hostile.ws_events = [_chunk_frame(0, [clip]), ws_frame(json.dumps(DONE).encode())]
    hostile.routes[("GET", "/view")] = _trickle(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
    code, elapsed = run_queue(hostile, tmp_path, "--stream-dir", str(tmp_path / "clips"), timeout=1.5)
    assert code == 4
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: no result within 1.5 s (while reading GET {_view_path(clip)})"), line
    assert elapsed < 1.5 + 10
    assert list((tmp_path / "clips" / "fewstep").iterdir()) == []  # no partial file left behind


@pytest.mark.parametrize(
    "filename, answer, expected",
    [
        ("big.webp", http_answer(200, b"x" * 5000), "answered with 5000 bytes, more than the 1000"),
        ("x" * 300 + ".webp", http_answer(200, b"WEBP"), "cannot write "),  # a name too long for this disk
        ("junk.webp", b"not http at all\r\n\r\n", "not a complete HTTP answer"),
    ],
)
def test_a_chunk_clip_that_cannot_be_saved_is_one_line_and_the_run_goes_on(
    hostile, tmp_path, capsys, monkeypatch, filename, answer, expected
):
    from fewstep.cli import comfy_client

    monkeypatch.setattr(comfy_client, "MAX_FILE_BYTES", 1000)
    clip = _history_item(filename, "fewstep", "temp")
    good = _history_item("fewstep_00001.webp", "fewstep", "temp")
    hostile.files = {_view_path(good): b"GOOD"}

    def view(conn, path):
        if path == _view_path(clip):
            return conn.sendall(answer)
        hostile.view(conn, path)

    hostile.routes[("GET", "/view")] = view
    hostile.ws_events = [
        _chunk_frame(0, [clip]),
        _chunk_frame(1, [good]),
        ws_frame(json.dumps(DONE).encode()),
    ]
    code, _ = run_queue(hostile, tmp_path, "--stream-dir", str(tmp_path / "clips"))
    line = one_error_line(capsys.readouterr().err)
    assert code == 0
    assert line.startswith("error: chunk 1/2 (node 12): could not save ") and expected in line, line
    assert line.endswith("; the run goes on")
    assert os.listdir(tmp_path / "clips" / "fewstep") == [
        "fewstep_00001.webp"
    ]  # no partial file, the next saved


def test_an_output_name_too_long_for_the_file_system_is_one_line_exit_5(hostile, tmp_path, capsys):
    item = _history_item("x" * 300 + ".png")
    hostile.history = {PROMPT_ID: {"outputs": {"9": {"images": [item]}}}}
    hostile.files = {_view_path(item): b"PNG"}
    code, _ = run_queue(hostile, tmp_path, "--out", str(tmp_path / "out"))
    line = one_error_line(capsys.readouterr().err)
    assert code == 5
    assert (
        line.startswith(f"error: cannot write {os.path.realpath(tmp_path / 'out')}/xxx")
        and "too long" in line
    )
    assert list((tmp_path / "out").iterdir()) == []


# -- 5. what one run writes in all: --max-files and --max-total-gb ---------------------------------------------------


def _flood(hostile, events: int, files_per_event: int, size: int, declared: bool = True) -> list[dict]:
    """A server that announces ``events`` chunks of ``files_per_event`` distinct clips of ``size`` bytes each (and
    lists them all again in /history); ``declared``: each /view answer has a Content-Length, else it just ends."""
    clips = [_history_item(f"flood_{i:05d}.webp", "fewstep", "temp") for i in range(events * files_per_event)]
    hostile.ws_events = [
        _chunk_frame(e, clips[e * files_per_event : (e + 1) * files_per_event]) for e in range(events)
    ] + [ws_frame(json.dumps(DONE).encode())]
    hostile.history = {PROMPT_ID: {"outputs": {"9": {"images": clips}}}}
    served = {_view_path(clip) for clip in clips}

    def view(conn, path):
        if path not in served:
            return conn.sendall(json_answer({}, status=404))
        if declared:
            return conn.sendall(http_answer(200, b"x" * size, "image/webp"))
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: image/webp\r\nConnection: close\r\n\r\n" + b"x" * size
        )

    hostile.routes[("GET", "/view")] = view
    return clips


def _files_under(*folders) -> list[str]:
    return sorted(str(p) for folder in folders for p in folder.rglob("*") if p.is_file())


def test_max_files_counts_stream_dir_and_out_together(hostile, tmp_path, capsys):
    clips = _flood(hostile, events=3, files_per_event=1, size=100)
    stream, out = tmp_path / "clips", tmp_path / "out"
    code, _ = run_queue(hostile, tmp_path, "--stream-dir", str(stream), "--out", str(out), "--max-files", "5")
    captured = capsys.readouterr()
    assert code == 5, captured.err
    sixth = os.path.realpath(out / "fewstep" / clips[2]["filename"])
    assert one_error_line(captured.err) == (
        f"error: stopped writing: {sixth} would be file 6, over --max-files 5; that file was not kept, the 5 "
        "files (500 B) written before it are whole (--max-files / --max-total-gb set the caps)"
    )
    # three clips while the prompt ran, then the first two outputs; no temporary file left
    assert _files_under(stream, out) == [
        *(str(stream / "fewstep" / c["filename"]) for c in clips),
        *(str(out / "fewstep" / c["filename"]) for c in clips[:2]),
    ]


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "no-content-length"])
def test_a_flooding_server_is_stopped_at_max_total_gb_with_nothing_partial(
    hostile, tmp_path, capsys, declared
):
    """A server that announces 200 chunks of 16 clips each: the client stops at the byte cap, at once, and keeps
    only whole files (the one that crossed the cap is removed, whether its size was declared or not)."""
    _flood(hostile, events=200, files_per_event=16, size=1000, declared=declared)
    stream = tmp_path / "clips"
    cap_gb = 10_500 / (1 << 30)  # 10 whole files fit; the 11th would cross the cap
    code, _ = run_queue(hostile, tmp_path, "--stream-dir", str(stream), "--max-total-gb", repr(cap_gb))
    captured = capsys.readouterr()
    assert code == 5, captured.err
    line = one_error_line(captured.err)
    view = _view_path(_history_item("flood_00010.webp", "fewstep", "temp"))
    size = "with 1000 bytes, more" if declared else "with more than the 500 bytes"
    assert line.startswith(f"error: stopped writing: GET {view} answered {size}"), line
    assert "(500 bytes are left of --max-total-gb, 10500 bytes, after 10 files, 10000 bytes)" in line, line
    assert line.endswith(
        "the 10 files (9.77 KiB) written before it are whole (--max-files / --max-total-gb set the caps)"
    )
    written = _files_under(stream)
    assert [os.path.basename(p) for p in written] == [f"flood_{i:05d}.webp" for i in range(10)]
    assert all(os.path.getsize(p) == 1000 for p in written)


def test_the_caps_default_to_10000_files_and_64_gib(tmp_path, monkeypatch):
    from fewstep.cli import queue as queue_cli

    seen = {}
    monkeypatch.setattr(
        queue_cli, "_run", lambda client, prompt, extra, args, budget: seen.setdefault("b", budget)
    )
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(ONE_NODE_WORKFLOW))
    main(["queue", str(wf), "--server", "127.0.0.1:9"])
    assert (seen["b"].max_files, seen["b"].max_bytes) == (10_000, 64 << 30)


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--max-files", "0", "expected a number of files from 1 to 1000000000, got '0'"),
        ("--max-files", "1e3", "expected a number of files from 1 to 1000000000, got '1e3'"),
        ("--max-files", str(2**80), "expected a number of files from 1 to 1000000000"),
        ("--max-total-gb", "0", "expected GiB > 0 and <= 1048576, got '0'"),
        ("--max-total-gb", "1e300", "expected GiB > 0 and <= 1048576, got '1e300'"),
        ("--max-total-gb", "nan", "expected GiB > 0 and <= 1048576, got 'nan'"),
        ("--max-total-gb", "-1", "expected GiB > 0 and <= 1048576, got '-1'"),
    ],
)
def test_the_caps_must_be_in_range(tmp_path, capsys, flag, value, expected):
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(ONE_NODE_WORKFLOW))
    with pytest.raises(SystemExit) as exc:
        main(["queue", str(wf), "--server", "127.0.0.1:9", f"{flag}={value}"])
    assert exc.value.code == 2
    assert f"argument {flag}: {expected}" in capsys.readouterr().err
