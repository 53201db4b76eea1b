"""``python -m fewstep queue`` against hostile servers: paths in /history that point outside ``--out``, servers that
stall or flood so that ``--timeout`` must hold (also while a ``--stream-dir`` chunk clip downloads), answers that
are not what ComfyUI sends (HTML, a /prompt reply without prompt_id, garbage WebSocket frames, absurd sizes, deeply
nested JSON), and chunk clips that cannot be saved (reported, the run goes on).

The fake server is raw sockets on 127.0.0.1 so that each test can misbehave at the byte level. Every server loop
is bounded (SERVER_LIFETIME seconds at most), so a test ends by itself even when the client misbehaves; elapsed
time is only checked as "did not hang" (less than --timeout + 10 s).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import socket
import struct
import threading
import time

import pytest

from fewstep.cli import main

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
PROMPT_ID = "prompt-1"
SERVER_LIFETIME = 15.0  # no server loop runs longer than this
API_WORKFLOW = {
    "4": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}
}
DONE = {"type": "executing", "data": {"node": None, "prompt_id": PROMPT_ID}}


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
    wf.write_text(json.dumps(API_WORKFLOW))
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


def _view_path(item) -> str:
    from urllib.parse import urlencode

    return "/view?" + urlencode(
        {"filename": item["filename"], "subfolder": item["subfolder"], "type": item["type"]}
    )


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
    wf.write_text(json.dumps(API_WORKFLOW))
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
    wf.write_text(json.dumps(API_WORKFLOW))
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
    wf.write_text(json.dumps(API_WORKFLOW))
    with pytest.raises(SystemExit) as exc:
        main(["queue", str(wf), "--server", "127.0.0.1:9", f"{flag}={value}"])
    assert exc.value.code == 2
    assert f"argument {flag}: {expected}" in capsys.readouterr().err
