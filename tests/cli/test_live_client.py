"""``python -m fewstep live`` without a real ComfyUI: a fake live node (http.server plus a minimal WebSocket on
127.0.0.1) implementing the contract's routes and events. The client opens its event stream first, schedules the
script's controls with ``at_chunk``, sends its secret only in the header, downloads each chunk's latents and clip,
writes the whole latents and the video; hostile answers (files at other paths, oversized or malformed files,
events of another session) are refused with exit status 5, the rest still saved.

Every fake-server loop is bounded, so a test ends by itself even when the client misbehaves."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re
import struct
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save

from fewstep.cli import main

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
SESSION, SECRET, NODE, PROMPT_ID = "s1a2b3", "the-secret-value-123", "7", "live-prompt"
WIDTH, HEIGHT, CHUNK_FRAMES = 48, 32, 2
SHAPE = (1, 16, CHUNK_FRAMES, HEIGHT // 8, WIDTH // 8)


def _frame(payload: bytes, opcode: int = 0x1) -> bytes:
    n = len(payload)
    if n < 126:
        head = bytes([0x80 | opcode, n])
    elif n < 1 << 16:
        head = bytes([0x80 | opcode, 126]) + struct.pack(">H", n)
    else:
        head = bytes([0x80 | opcode, 127]) + struct.pack(">Q", n)
    return head + payload


def chunk_latents(n: int) -> torch.Tensor:
    return torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).reshape(SHAPE) + 1000 * n


def clip_bytes(n: int) -> bytes:
    from PIL import Image

    frames = [Image.new("RGB", (WIDTH, HEIGHT), (10 * n, 20 * i, 30)) for i in range(4 * CHUNK_FRAMES)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="WEBP", save_all=True, append_images=frames[1:], duration=62, lossless=True)
    return buffer.getvalue()


class FakeLiveNode:
    """A live node running one session: after the open (and the script's controls), it sends per chunk the
    controls scheduled at it and the chunk event, then the final metrics and the close. ``tamper(n, data)`` may
    change a chunk event; ``extra_events`` are sent before the first chunk; ``files`` overrides served files."""

    def __init__(self, chunks_made: int, expect_controls: int = 0):
        self.chunks_made, self.expect_controls = chunks_made, expect_controls
        self.opened = threading.Event()
        self.controls_in = threading.Event()
        self.open_bodies, self.control_bodies, self.deletes, self.frames_bodies = [], [], [], []
        self.secrets_seen, self.paths = [], []
        self.ws_client_ids = []
        self.tamper = lambda n, data: data
        self.extra_events: list = []
        self.dropped: set[int] = set()
        self.files: dict[str, bytes] = {}
        for n in range(chunks_made):
            self.files[f"/fewstep/live/sessions/{SESSION}/chunks/{n}.safetensors"] = save(
                {"latent": chunk_latents(n)}
            )
            self.files[f"/fewstep/live/sessions/{SESSION}/chunks/{n}.webp"] = clip_bytes(n)

    def tags(self, **data) -> dict:
        return {"session": SESSION, "node": NODE, "prompt_id": PROMPT_ID, **data}

    def events(self) -> list[dict]:
        out = [{"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 1}}}}]
        out.append({"type": "fewstep.session", "data": self.tags(state="opened", why="opened by its client")})
        out += self.extra_events
        for n in range(self.chunks_made):
            for seq, body in enumerate(self.control_bodies, 1):
                if body.get("at_chunk") == n:
                    kind = next(k for k in ("prompt", "strength", "seed", "stop") if k in body)
                    out.append({"type": "fewstep.control_applied", "data": self.tags(
                        control=seq, kind=kind, chunk=n, recache=bool(body.get("recache")),
                        recache_frames=None, recache_seconds=None)})  # fmt: skip
            base = f"/fewstep/live/sessions/{SESSION}/chunks/{n}"
            data = self.tags(
                chunk=n, chunks=None, frames=[max(0, 8 * n - 3), 8 * n + 4], seconds=0.05, latency=0.06,
                first_chunk_seconds=0.06, kv_bytes=1000, batch=1, bucket=1, deadline_met=True, mode="t2v",
                strength=None, clip=base + ".webp", latents=base + ".safetensors", files=[],
            )  # fmt: skip
            if n in self.dropped:  # a slow reader: the server drops the chunk's event and says so
                out.append({"type": "fewstep.stall", "data": self.tags(dropped=1, chunks=[n])})
            else:
                out.append({"type": "fewstep.chunk", "data": self.tamper(n, data)})
        metrics = {"time_to_first_chunk_s": 0.06, "inter_chunk_p50_s": 0.05, "inter_chunk_p99_s": 0.07,
                   "realtime_factor": 6.5, "deadline_attainment": 1.0, "viewer_stalls": 0,
                   "viewer_stall_seconds": 0.0, "batch_sizes": {"1": self.chunks_made}, "chunks": self.chunks_made,
                   "video_seconds": 1.5, "seconds": 0.3}  # fmt: skip
        out.append({"type": "fewstep.session", "data": self.tags(state="closed", why="its chunks are done")})
        out.append({"type": "fewstep.metrics", "data": self.tags(**metrics)})
        return out


def _handler(fake: FakeLiveNode):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, status: int, body) -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            fake.secrets_seen.append(self.headers.get("X-FewStep-Secret"))
            fake.paths.append(self.path)
            if self.headers.get("X-FewStep-Secret") != SECRET or f"/sessions/{SESSION}" not in self.path:
                self._answer(404, {"error": "no live session with this id and secret"})
                return False
            return True

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/fewstep/live/sessions":
                fake.paths.append(self.path)
                fake.open_bodies.append(body)
                # controls scheduled with the open are numbered first, as the live node numbers them
                fake.control_bodies.extend(body.get("controls", []))
                opened_controls = list(range(1, len(fake.control_bodies) + 1))
                fake.opened.set()
                if len(fake.control_bodies) >= fake.expect_controls:
                    fake.controls_in.set()
                return self._answer(201, {"session": SESSION, "secret": SECRET, "width": WIDTH, "height": HEIGHT,
                                          "chunk_frames": CHUNK_FRAMES, "frames_per_chunk": 4 * CHUNK_FRAMES,
                                          "fps": 16, "node": NODE, "prompt_id": PROMPT_ID,
                                          "controls": opened_controls})  # fmt: skip
            if not self._authorized():
                return None
            if self.path.endswith("/control"):
                fake.control_bodies.append(body)
                if len(fake.control_bodies) >= fake.expect_controls:
                    fake.controls_in.set()
                kind = next(k for k in ("prompt", "strength", "seed", "stop") if k in body)
                return self._answer(202, {"control": len(fake.control_bodies), "kind": kind})
            if self.path.endswith("/frames"):
                fake.frames_bodies.append(body)
                return self._answer(202, {"queued_frames": len(body["frames"])})
            return self._answer(404, {"error": "no route"})

        def do_DELETE(self):
            if self._authorized():
                fake.deletes.append(self.path)
                self._answer(409, {"error": "the session is closed"})

        def do_GET(self):
            if self.path.startswith("/ws?clientId="):
                return self._websocket()
            if not self._authorized():
                return None
            data = fake.files.get(self.path)
            if data is None:
                return self._answer(404, {"error": "no such chunk"})
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            return self.wfile.write(data)

        def _websocket(self):
            key = self.headers["Sec-WebSocket-Key"]
            accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
            self.send_response(101, "Switching Protocols")
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", accept)
            self.end_headers()
            self.wfile.flush()
            fake.ws_client_ids.append(self.path[len("/ws?clientId=") :])
            if not (fake.opened.wait(5) and fake.controls_in.wait(5)):
                return
            sock = self.connection
            for event in fake.events():
                sock.sendall(_frame(json.dumps(event).encode()))
            sock.settimeout(5)
            try:
                while data := sock.recv(4096):
                    if data[0] & 0x0F == 0x8:
                        sock.sendall(_frame(b"", 0x8))
                        break
            except OSError:
                pass

    return Handler


def _serve(fake: FakeLiveNode):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    fake.url = f"127.0.0.1:{httpd.server_address[1]}"
    return httpd


@pytest.fixture
def live_node():
    servers = []

    def start(chunks_made: int, expect_controls: int = 0) -> FakeLiveNode:
        fake = FakeLiveNode(chunks_made, expect_controls)
        servers.append(_serve(fake))
        return fake

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


SCRIPT = {
    "prompt": "a red fox running through snow",
    "seed": 3,
    "chunks": 5,
    "controls": [
        {"chunk": 2, "prompt": "a red fox running through a forest", "recache": True},
        {"chunk": 3, "seed": 11},
        {"chunk": 4, "strength": None},
    ],
}


def _live(tmp_path, fake, script=SCRIPT, *extra) -> int:
    path = tmp_path / "script.json"
    path.write_text(json.dumps(script))
    try:
        return main(["live", "--server", fake.url, "--script", str(path), "--timeout", "20", *extra])
    except SystemExit as exc:
        return exc.code


def test_a_session_follows_its_script_and_writes_every_chunk(live_node, tmp_path, capsys):
    fake = live_node(5, expect_controls=3)
    out = tmp_path / "out"
    assert _live(tmp_path, fake, SCRIPT, "--out", str(out), "--jpeg") == 0, capsys.readouterr().err
    stdout, stderr = capsys.readouterr()
    # the event stream first, under the client id the session was opened for
    [opened] = fake.open_bodies
    assert fake.ws_client_ids == [opened["client_id"]] and re.fullmatch(r"[0-9a-f]{32}", opened["client_id"])
    assert opened == {"client_id": opened["client_id"], "prompt": SCRIPT["prompt"], "seed": 3, "chunks": 5,
                      "start_image": None, "strength": None, "jpeg": True,
                      "controls": fake.control_bodies}  # fmt: skip  # the controls go with the open
    assert fake.control_bodies == [
        {"prompt": "a red fox running through a forest", "recache": True, "at_chunk": 2},
        {"seed": 11, "at_chunk": 3},
        {"strength": None, "at_chunk": 4},
    ]
    # the secret only in the header, never in a URL, never printed
    assert set(fake.secrets_seen) == {SECRET} and not any(SECRET in p for p in fake.paths)
    assert SECRET not in stdout + stderr
    whole = load_file(str(out / "latents.safetensors"))
    assert list(whole) == ["latent"]
    assert torch.equal(whole["latent"], torch.cat([chunk_latents(n) for n in range(5)], dim=2))
    for n in range(5):
        assert (out / "chunks" / f"chunk_{n:04d}.webp").read_bytes() == clip_bytes(n)
        assert torch.equal(
            load_file(str(out / "chunks" / f"chunk_{n:04d}.safetensors"))["latent"], chunk_latents(n)
        )
    video = [p for p in out.iterdir() if p.name.startswith("video.")]
    assert len(video) == 1 and video[0].stat().st_size > 0
    lines = stdout.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("chunk ")] == [
        f"chunk {n}" for n in range(5)
    ]
    assert "control 0 (prompt) applied at chunk 2" in lines and "control 1 (seed) applied at chunk 3" in lines
    assert lines[-1].startswith("metrics: time to first chunk 0.060 s, inter-chunk p50 0.050 s / p99 0.070 s, "
                                "real-time factor 6.50, deadlines met 100 %, viewer stalls 0")  # fmt: skip
    report = json.loads((out / "live.json").read_text())
    assert "secret" not in report["session"] and SECRET not in (out / "live.json").read_text()
    assert [c["applied"] for c in report["controls"]] == [2, 3, 4]
    assert fake.deletes == []  # the server closed the session itself: nothing to close


def test_a_stop_control_is_sent_and_ends_the_run(live_node, tmp_path, capsys):
    fake = live_node(3, expect_controls=1)
    script = {"prompt": "a fox", "controls": [{"chunk": 3, "stop": True}]}
    assert _live(tmp_path, fake, script, "--out", str(tmp_path / "out")) == 0, capsys.readouterr().err
    assert fake.open_bodies[0]["chunks"] is None
    assert fake.control_bodies == [{"stop": True, "at_chunk": 3}]
    assert load_file(str(tmp_path / "out" / "latents.safetensors"))["latent"].shape[2] == 3 * CHUNK_FRAMES


def test_a_script_without_chunks_or_stop_is_refused_before_connecting(tmp_path, capsys):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"prompt": "a fox"}))
    assert main(["live", "--server", "127.0.0.1:9", "--script", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: fewstep live: input '--script': {path}: 'chunks' is missing and no control stops the session: "
        "give 'chunks' (the session closes after them) or a stop control"
    )


def test_fewer_chunks_than_asked_is_exit_3(live_node, tmp_path, capsys):
    fake = live_node(2, expect_controls=3)
    assert _live(tmp_path, fake, SCRIPT, "--out", str(tmp_path / "out")) == 3
    err = capsys.readouterr().err
    assert "error: fewstep live: the session ended after 2 of its 5 chunks (its chunks are done)" in err
    assert load_file(str(tmp_path / "out" / "latents.safetensors"))["latent"].shape[2] == 2 * CHUNK_FRAMES


def _bad_path(n, data):
    if n == 1:
        data["latents"] = f"/fewstep/live/sessions/other/chunks/{n}.safetensors"
    if n == 2:
        data["clip"] = "/view?filename=../../etc/passwd"
    return data


@pytest.mark.parametrize(
    "tamper, files, message",
    [
        (_bad_path, {}, "refused a fewstep.chunk event: its 'latents' is "),
        (lambda n, d: d, {1: b"\x00" * (8 + (64 << 10) + 4 * 384 + 1)}, "chunk 1: refused a file: "),
        (lambda n, d: d, {1: save({"latent": torch.zeros(1, 16, 3, 4, 6)})}, "chunk 1: refused a file: the "
         "latents are not one float32 tensor 'latent' of shape [1, 16, 2, 4, 6]"),
        (lambda n, d: d, {1: b"not a safetensors file"}, "chunk 1: refused a file: the latents are not a "
         "safetensors file"),
    ],
    ids=["paths", "oversized", "wrong-shape", "garbage"],
)  # fmt: skip
def test_hostile_files_are_refused_and_the_rest_saved(live_node, tmp_path, capsys, tamper, files, message):
    fake = live_node(3)
    fake.tamper = tamper
    for n, data in files.items():
        fake.files[f"/fewstep/live/sessions/{SESSION}/chunks/{n}.safetensors"] = data
    script = {"prompt": "a fox", "chunks": 3}
    assert _live(tmp_path, fake, script, "--out", str(tmp_path / "out")) == 5
    err = capsys.readouterr().err
    assert message in err
    assert "error: fewstep live: refused " in err
    assert (tmp_path / "out" / "chunks" / "chunk_0000.safetensors").exists()
    assert not any(p.startswith("/view") or "/other/" in p for p in fake.paths)
    assert not (tmp_path / "out" / "chunks" / "chunk_0001.safetensors").exists() or tamper is not _bad_path


def test_events_of_another_session_are_refused(live_node, tmp_path, capsys):
    fake = live_node(2)
    other = {"session": "someone-else", "node": NODE, "prompt_id": PROMPT_ID}
    fake.extra_events = [
        {"type": "fewstep.chunk", "data": {**other, "chunk": 0, "frames": [0, 4], "seconds": 0.1, "latency": 0.1,
                                           "clip": None, "latents": "/fewstep/live/sessions/someone-else/chunks/"
                                           "0.safetensors"}},
        {"type": "fewstep.session", "data": {**other, "state": "closed", "why": "x"}},
    ]  # fmt: skip
    assert _live(tmp_path, fake, {"prompt": "a fox", "chunks": 2}, "--out", str(tmp_path / "out")) == 5
    err = capsys.readouterr().err
    assert err.count("error: refused a fewstep.") == 2 and "of another session" in err
    assert not any("someone-else" in p for p in fake.paths)
    assert load_file(str(tmp_path / "out" / "latents.safetensors"))["latent"].shape[2] == 2 * CHUNK_FRAMES


def test_a_refused_open_is_exit_2_with_the_servers_message(tmp_path, capsys):
    class Refusing(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):  # the websocket handshake
            key = self.headers["Sec-WebSocket-Key"]
            accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
            self.send_response(101, "Switching Protocols")
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", accept)
            self.end_headers()

        def do_POST(self):
            data = json.dumps(
                {"error": "no FewStep Live Video node is running: queue a workflow with one first"}
            )
            self.send_response(503)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data.encode())

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    try:
        path = tmp_path / "s.json"
        path.write_text(json.dumps({"prompt": "a fox", "chunks": 2}))
        url = f"127.0.0.1:{httpd.server_address[1]}"
        assert main(["live", "--server", url, "--script", str(path), "--timeout", "10"]) == 2
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert capsys.readouterr().err.strip() == (
        "error: fewstep live: POST /fewstep/live/sessions was refused (HTTP 503): no FewStep Live Video node is "
        "running: queue a workflow with one first"
    )


def test_an_unreachable_server_is_exit_5(tmp_path, capsys):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"prompt": "a fox", "chunks": 2}))
    assert main(["live", "--server", "127.0.0.1:9", "--script", str(path), "--timeout", "5"]) == 5
    assert "is ComfyUI running?" in capsys.readouterr().err


# -- the client example of docs/live-video.md ------------------------------------------------------------------------

LIVE_DOC = Path(__file__).resolve().parents[2] / "docs" / "live-video.md"
EXAMPLE_HEADING = "## A client in 50 lines"


def _doc_example(doc: Path) -> str | None:
    """The ```python block right under EXAMPLE_HEADING (no other heading between), or None."""
    text = doc.read_text() if doc.exists() else ""
    _, found, rest = ("\n" + text).partition(f"\n{EXAMPLE_HEADING}\n")
    start = rest.find("```python\n")
    if not found or start < 0 or re.search(r"^#{1,6} ", rest[:start], re.M):
        return None
    return rest[start + len("```python\n") :].split("\n```", 1)[0] + "\n"


def test_the_documented_live_client_example_follows_its_script(live_node, tmp_path):
    code = _doc_example(LIVE_DOC)
    # the page is shipped with the pack: a lost heading or code block is a documentation bug, not a skip
    assert code is not None, f"{LIVE_DOC} has no ```python block under {EXAMPLE_HEADING!r}"
    assert len(code.splitlines()) <= 50
    pytest.importorskip("websocket", reason="the docs/live-video.md example needs websocket-client")
    fake = live_node(5, expect_controls=3)
    (tmp_path / "live_client.py").write_text(code)
    (tmp_path / "script.json").write_text(json.dumps(SCRIPT))
    r = subprocess.run(
        [sys.executable, "live_client.py", fake.url, "script.json", "chunks"],
        capture_output=True, text=True, cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    [opened] = fake.open_bodies
    assert fake.ws_client_ids == [opened["client_id"]]
    assert fake.control_bodies == [
        {"prompt": "a red fox running through a forest", "recache": True, "at_chunk": 2},
        {"seed": 11, "at_chunk": 3},
        {"strength": None, "at_chunk": 4},
    ]
    assert set(fake.secrets_seen) == {SECRET} and not any(SECRET in p for p in fake.paths)
    for n in range(5):
        saved = load_file(str(tmp_path / "chunks" / f"chunk_{n:04d}.safetensors"))["latent"]
        assert torch.equal(saved, chunk_latents(n))
    assert [line for line in r.stdout.splitlines() if line.startswith("control ")] == [
        "control 1 (prompt) applied at chunk 2",
        "control 2 (seed) applied at chunk 3",
        "control 3 (strength) applied at chunk 4",
    ]


def test_a_timeout_is_exit_4_and_the_session_is_closed(live_node, tmp_path, capsys):
    fake = live_node(3, expect_controls=99)  # waits for controls that never come: no chunk is sent
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"prompt": "a fox", "chunks": 3}))
    assert main(["live", "--server", fake.url, "--script", str(path), "--timeout", "1.5"]) == 4
    assert capsys.readouterr().err.startswith("error: fewstep live: no end of the session within 1.5 s")
    assert fake.deletes == [f"/fewstep/live/sessions/{SESSION}"]  # its slot freed, with the secret
    assert set(fake.secrets_seen) == {SECRET}


def _png_bytes(seed: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (WIDTH, HEIGHT), (seed, 2 * seed, 3 * seed)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_an_input_video_is_sent_a_chunk_of_frames_at_a_time_with_the_start_and_strength(
    live_node, tmp_path, capsys
):
    fake = live_node(3)
    (tmp_path / "frames").mkdir()
    frames = [_png_bytes(i) for i in range(4 * CHUNK_FRAMES * 3 + 5)]  # 3 chunks and a rest, never sent
    for i, data in enumerate(frames):
        (tmp_path / "frames" / f"{i:03d}.png").write_bytes(data)
    script = {"prompt": "a fox", "chunks": 3, "input_video": "frames", "strength": 0.4}
    assert _live(tmp_path, fake, script) == 0, capsys.readouterr().err
    assert fake.open_bodies[0]["strength"] == 0.4 and fake.open_bodies[0]["start_image"] is None
    per_chunk = 4 * CHUNK_FRAMES
    assert [len(b["frames"]) for b in fake.frames_bodies] == [per_chunk] * 3
    sent = [base64.b64decode(f) for b in fake.frames_bodies for f in b["frames"]]
    assert sent == frames[: 3 * per_chunk]  # the files' own bytes, in name order


def test_a_start_image_goes_in_the_open_body(live_node, tmp_path, capsys):
    fake = live_node(2)
    (tmp_path / "start.png").write_bytes(_png_bytes(7))
    assert _live(tmp_path, fake, {"prompt": "a fox", "chunks": 2, "start_image": "start.png"}) == 0
    assert base64.b64decode(fake.open_bodies[0]["start_image"]) == _png_bytes(7)


def test_a_video_file_is_read_with_pyav_as_png_frames(tmp_path):
    pytest.importorskip("av")
    from PIL import Image

    from fewstep.cli.live import input_frames
    from fewstep.cli.video import open_video

    video = open_video(str(tmp_path / "in"), WIDTH, HEIGHT, backend="mp4")
    video.append(torch.rand(9, 3, HEIGHT, WIDTH))
    video.close()
    frames = list(input_frames(video.path, "s.json"))
    assert len(frames) == 9
    assert all(Image.open(io.BytesIO(f)).format == "PNG" for f in frames)


def test_chunks_past_the_script_or_repeated_are_refused_and_server_text_is_escaped(
    live_node, tmp_path, capsys
):
    fake = live_node(3)
    base = f"/fewstep/live/sessions/{SESSION}/chunks"
    flood = {"chunk": 1000, "frames": [0, 4], "seconds": 0.1, "latency": 0.1, "clip": None,
             "latents": f"{base}/1000.safetensors"}  # fmt: skip
    again = {**flood, "chunk": 0, "latents": f"{base}/0.safetensors"}
    fake.tamper = lambda n, data: data if n < 2 else {**data, **again}  # chunk 2's event repeats chunk 0
    fake.extra_events = [
        {"type": "fewstep.chunk", "data": fake.tags(**flood)},
        {"type": "fewstep.session", "data": fake.tags(state="suspended", why="\x1b[2Jcleared")},
    ]
    assert _live(tmp_path, fake, {"prompt": "a fox", "chunks": 3}, "--out", str(tmp_path / "out")) == 5
    out, err = capsys.readouterr()
    assert "its chunk 1000 is past the session's 3 chunks (0 to 2)" in err
    assert "refused a fewstep.chunk event: chunk 0 came before" in err
    assert "\x1b" not in out + err and "session suspended: \\x1b[2Jcleared" in out
    assert sorted(p.name for p in (tmp_path / "out" / "chunks").iterdir()) == [
        "chunk_0000.safetensors", "chunk_0000.webp", "chunk_0001.safetensors", "chunk_0001.webp",
    ]  # fmt: skip
    assert not any("1000" in p for p in fake.paths)


def test_the_files_of_chunks_whose_events_were_dropped_are_fetched(live_node, tmp_path, capsys):
    fake = live_node(4)
    fake.dropped = {1, 2}
    assert _live(tmp_path, fake, {"prompt": "a fox", "chunks": 4}, "--out", str(tmp_path / "out")) == 0
    out, err = capsys.readouterr()
    assert (
        "stall: this client read too slowly, the server dropped the events of chunks 1; fetching their files"
        in err
    )
    assert "chunk 2: (its event was dropped) -> " in out
    whole = load_file(str(tmp_path / "out" / "latents.safetensors"))["latent"]
    assert torch.equal(whole, torch.cat([chunk_latents(n) for n in range(4)], dim=2))
