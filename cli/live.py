"""``python -m fewstep live --server URL --script FILE``: a client of a running FewStep Live Video node.

It connects its event stream first (its own random client id, so no event is missed), opens a session with the
script's prompt, seed, chunks, start image or video-to-video strength, schedules every control of the script at
its chunk (``at_chunk``), sends the input video's frames ahead of the chunks that restyle them, and receives the
session's events. With ``--out DIR`` each chunk's latents and clip are downloaded into ``DIR/chunks/`` as its event
arrives, and at the end ``DIR/latents.safetensors`` (the chunks concatenated: key ``latent``, ComfyUI's raw Wan 2.1
layout, what ``stream --out`` writes), the video (``video.mp4`` through PyAV, else ``video.webp``) and
``DIR/live.json`` (the session's chunks, applied controls and metrics) are written. One line per chunk; the
session's realtime metrics (its final ``fewstep.metrics`` event) at the end.

The server is not trusted, as in ``queue``: one deadline (``--timeout``) bounds the whole command, answers and
downloads have size limits, a chunk's files are fetched only from the paths the protocol fixes for this session
and land under names this client chooses, an event of another session is refused. The session's secret travels
only in the ``X-FewStep-Secret`` header and is never printed.

Exit status as ``queue``'s: 0 success; 2 the server refused the session or a control (bad input, limits, no live
node running); 3 the session ended before its chunks (the node stopped, the session was closed by the server);
4 timeout; 5 server unreachable, an answer or event that is not the protocol's (reported, the rest still saved),
or a file that cannot be written.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import re
import sys
import time
import uuid
from dataclasses import dataclass, field

from ..engine.errors import InputError
from ..engine.live.protocol import (
    CLIP_ROUTE,
    EVENT_CHUNK,
    EVENT_CONTROL_APPLIED,
    EVENT_DEADLINE_MISSED,
    EVENT_METRICS,
    EVENT_SESSION,
    EVENT_STALL,
    EVENTS,
    FRAMES_ROUTE,
    LATENTS_ROUTE,
    MAX_FRAMES_BODY_BYTES,
    MAX_START_IMAGE_BYTES,
    SECRET_HEADER,
    SESSION_ROUTE,
    SESSION_STATES,
    SESSIONS_ROUTE,
)
from .comfy_client import (
    ComfyClient,
    Deadline,
    DeadlineError,
    MalformedEventError,
    ProtocolError,
    ServerError,
    UnreachableError,
    parse_json,
    snippet,
)
from .control_script import ControlScript, read_script
from .queue import _PrintableOnly, _seconds

HELP = "drive a session of a running FewStep Live Video node with a control script; save its chunks and video"
DESCRIPTION = (
    "Open a session on a FewStep Live Video node running in ComfyUI, apply the control script's controls at their "
    "chunks, save each chunk as it lands (--out) and print the session's realtime metrics. Exit status: 0 "
    "success, 2 the server refused the session or a control, 3 the session ended before its chunks, 4 timeout, "
    "5 unreachable server or an answer that is not the live protocol's."
)

MAX_CLIP_BYTES = 64 << 20  # one chunk's animated WebP (a few hundred KB at 480p)
MAX_LATENT_HEADER_BYTES = 64 << 10  # a chunk's safetensors header (one tensor: about 100 bytes)
MAX_JPEG_BYTES = 8 << 20  # one inline JPEG frame
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
MAX_SECRET_CHARS = 512
CLOSE_WAIT_SECONDS = 3.0  # after the session closed: how long its final metrics event may take to arrive
CLOSE_TIMEOUT_SECONDS = 10.0  # closing the session at the end, whatever ended the run
FRAMES_AHEAD = 2  # input chunks of frames sent ahead of the chunk being made (the server queues at most 8)
FRAME_EXTENSIONS = (".png", ".jpg", ".jpeg")


def add_arguments(p) -> None:
    p.add_argument(
        "--server",
        default="http://127.0.0.1:8188",
        help="ComfyUI address, http://host:port (host:port means http://; https is not supported)",
    )
    p.add_argument(
        "--script",
        metavar="FILE",
        action="append",
        required=True,
        help="the control script (JSON, the format stream --script runs): prompt, seed, chunks, start_image, "
        "input_video + strength, controls sent at their chunks; it needs 'chunks' or a stop control "
        "(required)",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="write each chunk's latents and clip into DIR/chunks as it lands, then DIR/latents.safetensors (the "
        "chunks together, as stream --out writes it), the video and DIR/live.json (default: nothing written)",
    )
    p.add_argument(
        "--jpeg",
        action="store_true",
        help="ask for each chunk's frames inline as JPEG in its event (the lowest latency); with --out they are "
        "written as DIR/jpeg/chunk_NNNN_FF.jpg",
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=600.0,
        help="seconds the whole command may take: opening, the session's chunks and the downloads",
    )
    p.add_argument(
        "--quiet", action="store_true", help="no line per chunk or control, only the final metrics"
    )


class RefusedAnswerError(Exception):
    """The server sent something this client refuses (reported, counted; the run goes on)."""


@dataclass
class LiveRun:
    """One session as this client sees it."""

    client: ComfyClient
    script: ControlScript
    out: str | None
    quiet: bool
    session: str = ""
    secret: str = field(default="", repr=False)
    info: dict = field(default_factory=dict)  # the open answer, without the secret
    chunks: dict[int, dict] = field(default_factory=dict)  # chunk index -> its row
    controls: dict[int, dict] = field(
        default_factory=dict
    )  # sequence -> {script_index, kind, at_chunk, applied}
    metrics: dict | None = None
    metrics_final: bool = False  # a metrics event came after the session closed
    closed_why: str | None = None
    refused: int = 0
    missed_controls: int = 0
    video = None
    stalls: int = 0

    @property
    def headers(self) -> dict:
        return {SECRET_HEADER: self.secret}

    def route(self, template: str, n: int | None = None) -> str:
        return template.replace("{id}", self.session).replace("{n}", str(n))


def run(args) -> int:
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _PrintableOnly(stdout), _PrintableOnly(stderr)
    try:
        return _run_command(args)
    finally:
        sys.stdout, sys.stderr = stdout, stderr


def _fail(code: int, message: str) -> int:
    print(f"error: fewstep live: {message}", file=sys.stderr)
    return code


def read_live_script(path: str) -> ControlScript:
    script = read_script(path, "--script")
    if script.chunks_to_run is None:
        raise InputError(
            "--script",
            f"{path}: 'chunks' is missing and no control stops the session: give 'chunks' (the session closes "
            "after them) or a stop control",
        )
    return script


def _run_command(args) -> int:
    if len(args.script) != 1:
        raise InputError("--script", f"{len(args.script)} scripts; live runs one session: give one --script (one "
                         "live client per script, they may run at once)")  # fmt: skip
    script = read_live_script(args.script[0])  # bad input: one line, exit 2 (main)
    start_image = None
    if script.start_image is not None:
        with open(script.start_image, "rb") as f:
            start_image = f.read(MAX_START_IMAGE_BYTES + 1)
        if len(start_image) > MAX_START_IMAGE_BYTES:
            raise InputError("--script", f"{script.path}: 'start_image': larger than the "
                             f"{MAX_START_IMAGE_BYTES >> 20} MiB a live session takes")  # fmt: skip
    frames = input_frames(script.input_video, script.path) if script.input_video is not None else None
    if args.out:
        try:
            os.makedirs(os.path.join(args.out, "chunks"), exist_ok=True)
        except OSError as exc:
            return _fail(5, f"--out {args.out}: cannot create the folder ({exc.strerror or exc})")
    try:
        client = ComfyClient(args.server, timeout=args.timeout)
    except ValueError as exc:
        return _fail(5, str(exc))
    live = LiveRun(client, script, args.out, args.quiet)
    try:
        return _run(live, args, start_image, frames)
    except UnreachableError as exc:
        return _fail(5, f"{exc}; is ComfyUI running? (python main.py --listen 127.0.0.1 --port 8188)")
    except ProtocolError as exc:
        return _fail(5, f"{exc}; is --server a ComfyUI server with the fewstep pack?")
    except ServerError as exc:
        return _fail(5, _server_error(exc))
    except DeadlineError as exc:
        return _fail(4, f"no end of the session within {args.timeout:g} s ({exc})")
    except OSError as exc:
        return _fail(5, f"cannot write under --out: {exc}")
    finally:
        if live.video is not None:
            live.video.abandon()


def _server_error(exc: ServerError) -> str:
    body = exc.body
    message = body.get("error") if isinstance(body, dict) else None
    if isinstance(message, str):
        return f"{exc.what} was refused (HTTP {exc.status}): {message[:500]}"
    return str(exc)


def _run(live: LiveRun, args, start_image: bytes | None, frames) -> int:
    client, script = live.client, live.script
    client_id = uuid.uuid4().hex
    ws = client.websocket(client_id)  # first: the session's first events go to this client id
    interrupted = False
    try:
        body = {
            "client_id": client_id,
            "prompt": script.prompt,
            "seed": script.seed,
            "chunks": script.chunks,
            "start_image": None if start_image is None else base64.b64encode(start_image).decode(),
            "strength": script.strength,
            "jpeg": bool(args.jpeg),
            # scheduled with the open: each takes effect at its chunk however late the client gets to run
            "controls": [{**control.body(), "at_chunk": control.chunk} for control in script.controls],
        }
        try:
            answer = client._request(SESSIONS_ROUTE, body)
        except ServerError as exc:
            if 400 <= exc.status < 500 or exc.status == 503:
                return _fail(2, _server_error(exc))
            raise
        check_open_answer(answer, len(script.controls))
        live.session, live.secret = answer["session"], answer["secret"]
        for sequence, control in zip(answer["controls"], script.controls):  # ties each to its applied event
            live.controls[sequence] = {
                "script_index": control.index, "kind": control.kind, "at_chunk": control.chunk, "applied": None,
            }  # fmt: skip
        live.info = {k: v for k, v in answer.items() if k != "secret"}
        if not args.quiet:
            print(f"session opened on node {answer['node']} (prompt {answer['prompt_id']}): {answer['width']}x"
                  f"{answer['height']}, {answer['chunk_frames']} latent frames a chunk at {answer['fps']} fps",
                  flush=True)  # fmt: skip
        feeder = None if frames is None else FrameFeeder(live, frames, answer["frames_per_chunk"])
        if feeder is not None:
            feeder.send_until(FRAMES_AHEAD)
        follow(live, ws, feeder)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        ws.close()
        if live.session and live.closed_why is None:  # however the run ends: free the session's slot
            close_session(live)
    if interrupted:
        print("interrupted: the session was closed", file=sys.stderr)
        finish(live)
        return 130
    return finish(live)


def check_open_answer(answer, controls: int = 0) -> None:
    """The open's answer as the protocol has it (``controls``: the script controls sent with the open, one
    distinct sequence number each)."""
    expected = {
        "session": lambda v: isinstance(v, str) and SESSION_ID.fullmatch(v),
        "secret": lambda v: isinstance(v, str) and 0 < len(v) <= MAX_SECRET_CHARS and v.isprintable(),
        "width": _is_size,
        "height": _is_size,
        "chunk_frames": lambda v: _is_int(v) and 1 <= v <= 1024,
        "frames_per_chunk": lambda v: _is_int(v) and 1 <= v <= 4096,
        "fps": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1000,
        "node": lambda v: isinstance(v, str) and 0 < len(v) <= 256,
        "prompt_id": lambda v: isinstance(v, str) and 0 < len(v) <= 256,
        "controls": lambda v: (
            isinstance(v, list)
            and len(v) == controls
            and all(_is_int(x) for x in v)
            and len(set(v)) == controls
        ),
    }
    if not isinstance(answer, dict):
        raise ProtocolError(f"POST {SESSIONS_ROUTE} answered with {snippet(answer)}, not a session")
    for key, valid in expected.items():
        if not valid(answer.get(key)):
            shown = "<hidden>" if key == "secret" else snippet(json.dumps(answer.get(key)))
            raise ProtocolError(f"POST {SESSIONS_ROUTE} answered a session whose {key!r} is {shown}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_size(value) -> bool:
    return _is_int(value) and 8 <= value <= 8192 and value % 8 == 0


def close_session(live: LiveRun) -> None:
    """DELETE the session, under a deadline of its own (the command's may be spent: a timeout, a Ctrl-C). A
    session the server already closed answers 404 / 409: nothing left to do; a failure is one line."""
    closer = ComfyClient(live.client.server, timeout=CLOSE_TIMEOUT_SECONDS)
    try:
        closer._request(live.route(SESSION_ROUTE), method="DELETE", headers=live.headers)
        live.closed_why = "closed by this client"
    except ServerError as exc:
        if exc.status not in (404, 409):
            print(f"error: could not close the session: {_server_error(exc)}", file=sys.stderr)
    except (UnreachableError, ProtocolError, DeadlineError) as exc:
        print(f"error: could not close the session ({exc}); the server closes it once this client is gone for "
              "its disconnect time", file=sys.stderr)  # fmt: skip


# -- events ----------------------------------------------------------------------------------------------------------


def _count(value) -> bool:
    return _is_int(value) and 0 <= value < 1 << 62


def _seconds_value(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1 << 62


CHUNK_FIELDS = {
    "chunk": (_count, "a chunk index (an integer >= 0)"),
    "frames": (lambda v: isinstance(v, list) and len(v) == 2 and all(map(_count, v)) and v[0] <= v[1],
               "[first, last] video frame numbers, first <= last"),
    "seconds": (_seconds_value, "seconds (a number >= 0)"),
    "latency": (_seconds_value, "seconds (a number >= 0)"),
}  # fmt: skip


def parse_live_chunk(live: LiveRun, data: dict) -> dict:
    """A ``fewstep.chunk`` event of this session, checked; its files' paths must be the protocol's for it."""
    for key, (valid, expected) in CHUNK_FIELDS.items():
        if key not in data:
            raise MalformedEventError(f"it has no {key!r}")
        if not valid(data[key]):
            raise MalformedEventError(f"its {key!r} is {snippet(json.dumps(data[key]))}, expected {expected}")
    n, wanted = data["chunk"], live.script.chunks_to_run
    if n >= wanted:  # bounds what a flooding server can make this client write: the script's chunks
        raise MalformedEventError(f"its chunk {n} is past the session's {wanted} chunks (0 to {wanted - 1})")
    if n in live.chunks:
        raise MalformedEventError(f"chunk {n} came before")
    latents, clip = data.get("latents"), data.get("clip")
    if latents != live.route(LATENTS_ROUTE, n):
        raise MalformedEventError(
            f"its 'latents' is {snippet(json.dumps(latents))}, not this session's {live.route(LATENTS_ROUTE, n)}"
        )
    if clip is not None and clip != live.route(CLIP_ROUTE, n):
        raise MalformedEventError(
            f"its 'clip' is {snippet(json.dumps(clip))}, not this session's {live.route(CLIP_ROUTE, n)} or null"
        )
    jpeg = data.get("jpeg")
    if jpeg is not None and not (
        isinstance(jpeg, list) and len(jpeg) <= 4096 and all(isinstance(j, str) for j in jpeg)
    ):
        raise MalformedEventError("its 'jpeg' is not a list of base64 JPEG frames")
    return data


def follow(live: LiveRun, ws, feeder) -> None:
    """Read the event stream until the session is closed (and its final metrics came, or a short wait passed)."""
    closed_at, previous = None, None
    while True:
        if closed_at is not None and (
            live.metrics_final or time.monotonic() - closed_at > CLOSE_WAIT_SECONDS
        ):
            return
        try:
            if closed_at is not None:  # the final metrics may follow the close: wait for them, briefly
                kind, payload = _receive_within(ws, CLOSE_WAIT_SECONDS - (time.monotonic() - closed_at))
            else:
                kind, payload = ws.receive()
        except DeadlineError:
            if closed_at is not None:
                return
            raise
        except ConnectionError as exc:
            if closed_at is not None:
                return
            raise UnreachableError(f"lost the server's event stream: {exc}") from None
        if kind != "text":
            continue  # ComfyUI's binary previews
        msg = parse_json(payload, "the event stream sent")
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise ProtocolError(
                f"the event stream sent a message that is not a ComfyUI event: {snippet(msg)}"
            )
        event, data = msg["type"], msg.get("data")
        if event not in EVENTS:
            continue  # ComfyUI's own events (status, executing...)
        if not isinstance(data, dict):
            live.refused += 1
            print(f"error: refused a {event} event without an object as its data", file=sys.stderr)
            continue
        if data.get("session") != live.session or data.get("prompt_id") != live.info["prompt_id"]:
            live.refused += 1
            print(f"error: refused a {event} event of another session ({snippet(json.dumps(data.get('session')))}); "
                  "events of one session must reach only its client", file=sys.stderr)  # fmt: skip
            continue
        try:
            done = handle_event(live, event, data, feeder)
        except (MalformedEventError, RefusedAnswerError) as exc:
            live.refused += 1
            print(f"error: refused a {event} event: {exc}", file=sys.stderr)
            continue
        if done and closed_at is None:
            closed_at = time.monotonic()
            # the service sends its final metrics right before the close (after it: the wait above takes them)
            live.metrics_final = previous == EVENT_METRICS
        previous = event


def _receive_within(ws, seconds: float):
    """``ws.receive()`` with a deadline of ``seconds`` (never past the command's own)."""
    saved = ws.deadline
    short = Deadline(max(0.0, min(seconds, saved.end - time.monotonic())))
    ws.deadline = ws.sock.deadline = short
    try:
        return ws.receive()
    finally:
        ws.deadline = ws.sock.deadline = saved


def handle_event(live: LiveRun, event: str, data: dict, feeder) -> bool:
    """One event of this session; True when it closed the session."""
    if event == EVENT_CHUNK:
        receive_chunk(live, parse_live_chunk(live, data))
        if feeder is not None:
            feeder.send_until(data["chunk"] + 1 + FRAMES_AHEAD)
    elif event == EVENT_CONTROL_APPLIED:
        seq, chunk = data.get("control"), data.get("chunk")
        if not (_is_int(seq) and _count(chunk)) or seq not in live.controls:
            raise MalformedEventError(
                f"it names control {snippet(json.dumps(seq))}, not one this client sent"
            )
        row = live.controls[seq]
        row["applied"] = chunk
        row["recache_frames"], row["recache_seconds"] = (
            data.get("recache_frames"),
            data.get("recache_seconds"),
        )
        late = "" if chunk == row["at_chunk"] else f" (asked for chunk {row['at_chunk']}: it came too late)"
        if late:
            live.missed_controls += 1
        if not live.quiet or late:
            print(f"control {row['script_index']} ({row['kind']}) applied at chunk {chunk}{late}", flush=True)
    elif event == EVENT_DEADLINE_MISSED:
        if not live.quiet:
            print(f"chunk {data.get('chunk')}: deadline missed (latency {_num(data.get('latency'))} s, deadline "
                  f"{_num(data.get('deadline'))} s)", flush=True)  # fmt: skip
    elif event == EVENT_STALL:
        dropped = data.get("chunks")
        if not (isinstance(dropped, list) and len(dropped) <= 4096 and all(map(_count, dropped))):
            raise MalformedEventError("its 'chunks' is not a list of chunk indices")
        live.stalls += 1
        print(f"stall: this client read too slowly, the server dropped the events of chunks "
              f"{', '.join(map(str, dropped))}; fetching their files", file=sys.stderr, flush=True)  # fmt: skip
        for n in dropped:  # their files are kept (the newest ones): fetched from the paths the protocol fixes
            if n not in live.chunks and n < live.script.chunks_to_run:
                receive_chunk(live, {"chunk": n, "latents": live.route(LATENTS_ROUTE, n),
                                     "clip": live.route(CLIP_ROUTE, n), "dropped": True})  # fmt: skip
    elif event == EVENT_METRICS:
        live.metrics = data
        live.metrics_final = live.closed_why is not None
    elif event == EVENT_SESSION:
        state = data.get("state")
        if state not in SESSION_STATES:
            raise MalformedEventError(f"its 'state' is {snippet(json.dumps(state))}, expected one of "
                                      f"{', '.join(SESSION_STATES)}")  # fmt: skip
        why = data.get("why") if isinstance(data.get("why"), str) else ""
        if not live.quiet or state == "closed":
            print(f"session {state}" + (f": {why[:300]}" if why else ""), flush=True)
        if state == "closed":
            live.closed_why = why
            return True
    return False


def _num(value) -> str:
    return f"{value:.3f}" if _seconds_value(value) else "?"


def receive_chunk(live: LiveRun, data: dict) -> None:
    n = data["chunk"]
    row = {k: data.get(k) for k in ("chunk", "frames", "seconds", "latency", "batch", "deadline_met", "mode")}
    written = []
    if live.out is not None:
        try:
            written.append(download_latents(live, n))
            if data.get("clip") is not None:
                path, frames = download_clip(live, n)
                written.append(path)
                append_video(live, frames)
            for i, text in enumerate(data.get("jpeg") or []):
                written.append(write_jpeg(live, n, i, text))
        except RefusedAnswerError as exc:
            live.refused += 1
            print(f"error: chunk {n}: refused a file: {exc}; nothing was written for it", file=sys.stderr)
        except ServerError as exc:
            print(f"error: chunk {n}: could not download its files ({_server_error(exc)}); the session goes on",
                  file=sys.stderr)  # fmt: skip
    row["files"] = written
    live.chunks[n] = row
    if not live.quiet:
        if data.get("dropped"):
            line = f"chunk {n}: (its event was dropped)"
        else:
            met = "" if data.get("deadline_met") is None else (
                ", deadline met" if data.get("deadline_met") else ", deadline missed")  # fmt: skip
            batch = f", batch {data['batch']}" if _count(data.get("batch")) else ""
            line = (f"chunk {n}: frames {data['frames'][0]}-{data['frames'][1]}, {data['seconds']:.3f} s, latency "
                    f"{data['latency']:.3f} s{batch}{met}")  # fmt: skip
        print(line + ("" if not written else " -> " + ", ".join(written)), flush=True)


def _download(live: LiveRun, path: str, limit: int) -> bytes:
    parts = []
    live.client._request(
        path, sink=parts.append, file_limit=limit, refuse=RefusedAnswerError, headers=live.headers
    )
    return b"".join(parts)


def latent_shape(live: LiveRun) -> list[int]:
    info = live.info
    return [1, 16, info["chunk_frames"], info["height"] // 8, info["width"] // 8]


def download_latents(live: LiveRun, n: int) -> str:
    """The chunk's latents, checked to be one float32 tensor ``latent`` of the session's chunk shape."""
    shape = latent_shape(live)
    limit = 8 + MAX_LATENT_HEADER_BYTES + 4 * math.prod(shape)
    data = _download(live, live.route(LATENTS_ROUTE, n), limit)
    check_latent_file(data, shape)
    path = os.path.join(live.out, "chunks", f"chunk_{n:04d}.safetensors")
    _write(path, data)
    return path


def check_latent_file(data: bytes, shape: list[int]) -> None:
    if len(data) < 8:
        raise RefusedAnswerError("the latents are not a safetensors file (shorter than its header)")
    size = int.from_bytes(data[:8], "little")
    if size > MAX_LATENT_HEADER_BYTES or 8 + size > len(data):
        raise RefusedAnswerError("the latents are not a safetensors file (a header of an impossible size)")
    try:
        header = json.loads(data[8 : 8 + size])
    except ValueError:
        raise RefusedAnswerError("the latents are not a safetensors file (its header is not JSON)") from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"} if isinstance(header, dict) else None
    entry = tensors.get("latent") if tensors is not None and len(tensors) == 1 else None
    if (
        not isinstance(entry, dict)
        or entry.get("dtype") != "F32"
        or entry.get("shape") != shape
        or entry.get("data_offsets") != [0, 4 * math.prod(shape)]
        or len(data) != 8 + size + 4 * math.prod(shape)
    ):
        raise RefusedAnswerError(
            f"the latents are not one float32 tensor 'latent' of shape {shape} (the session's chunk): "
            f"{snippet(json.dumps(header) if isinstance(header, dict) else header)}"
        )


def download_clip(live: LiveRun, n: int):
    """The chunk's animated WebP; (its path, its frames [T, 3, H, W] for the whole video)."""
    data = _download(live, live.route(CLIP_ROUTE, n), MAX_CLIP_BYTES)
    frames = clip_frames(data, live.info["width"], live.info["height"], 4 * live.info["chunk_frames"])
    path = os.path.join(live.out, "chunks", f"chunk_{n:04d}.webp")
    _write(path, data)
    return path, frames


def clip_frames(data: bytes, width: int, height: int, max_frames: int):
    """A clip's frames, refused unless it is a WebP of the session's size with at most a chunk's frames (the
    size is checked before anything is decoded: no decompression bomb)."""
    import numpy as np
    import torch
    from PIL import Image

    if data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        raise RefusedAnswerError("the clip is not a WebP file")
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.size != (width, height):
                raise RefusedAnswerError(
                    f"the clip is {image.size[0]}x{image.size[1]}; the session is {width}x{height}"
                )
            count = getattr(image, "n_frames", 1)
            if count > max_frames:
                raise RefusedAnswerError(f"the clip has {count} frames; a chunk has at most {max_frames}")
            frames = []
            for i in range(count):
                image.seek(i)
                frames.append(torch.from_numpy(np.asarray(image.convert("RGB")).copy()))
    except (OSError, ValueError, EOFError) as exc:
        raise RefusedAnswerError(f"the clip cannot be read as a WebP ({exc})") from None
    return torch.stack(frames).permute(0, 3, 1, 2).float() / 255


def append_video(live: LiveRun, frames) -> None:
    from .video import open_video

    if live.video is None:
        live.video = open_video(os.path.join(live.out, "video"), live.info["width"], live.info["height"])
    live.video.append(frames)


def write_jpeg(live: LiveRun, n: int, i: int, text: str) -> str:
    try:
        data = base64.b64decode(text, validate=True)
    except ValueError:
        raise RefusedAnswerError(f"inline frame {i} is not base64") from None
    if not data.startswith(b"\xff\xd8") or len(data) > MAX_JPEG_BYTES:
        raise RefusedAnswerError(f"inline frame {i} is not a JPEG of at most {MAX_JPEG_BYTES >> 20} MiB")
    path = os.path.join(live.out, "jpeg", f"chunk_{n:04d}_{i:02d}.jpg")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _write(path, data)
    return path


def _write(path: str, data: bytes) -> None:
    partial = path + ".partial"
    with open(partial, "wb") as f:
        f.write(data)
    os.replace(partial, path)


# -- video to video input --------------------------------------------------------------------------------------------


def input_frames(path: str, script_path: str):
    """The input video's frames as PNG bytes, one at a time: a folder of PNG / JPEG files (sorted by name; a PNG
    is sent as it is) or a video file decoded with PyAV."""
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if os.path.splitext(n)[1].lower() in FRAME_EXTENSIONS)
        if not names:
            raise InputError(
                "--script", f"{script_path}: 'input_video': {path} holds no .png / .jpg / .jpeg frames"
            )
        return (_file_bytes(os.path.join(path, n)) for n in names)
    try:
        import av
    except ImportError:
        raise InputError("--script", f"{script_path}: 'input_video': reading {path} needs PyAV (pip install av); or give a "
                         "folder of PNG frames") from None  # fmt: skip
    return _video_frames(av, path)


def _file_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _video_frames(av, path: str):
    with av.open(path) as container:
        for frame in container.decode(video=0):
            buffer = io.BytesIO()
            frame.to_image().save(buffer, format="PNG")
            yield buffer.getvalue()


class FrameFeeder:
    """Sends the input video's frames a chunk at a time, at most ``FRAMES_AHEAD`` chunks ahead of the chunk being
    made (the server queues at most 8 chunks; a full queue, 429, is retried with the next chunk)."""

    def __init__(self, live: LiveRun, frames, per_chunk: int):
        self.live, self.frames, self.per_chunk = live, frames, per_chunk
        self.sent_chunks = 0
        self.pending: list[bytes] = []
        self.exhausted = False

    def send_until(self, chunks: int) -> None:
        while not self.exhausted and self.sent_chunks < chunks:
            if not self.pending:
                self.pending = [f for _, f in zip(range(self.per_chunk), self.frames)]
                if len(self.pending) < self.per_chunk:
                    self.exhausted = True  # a partial chunk is not sent: no chunk could restyle it
                    return
            encoded = [base64.b64encode(f).decode() for f in self.pending]
            if sum(len(e) for e in encoded) > MAX_FRAMES_BODY_BYTES - 4096:
                raise InputError("--script", f"{self.live.script.path}: 'input_video': one chunk of {self.per_chunk} frames is larger than "
                                 f"the {MAX_FRAMES_BODY_BYTES >> 20} MiB a frames body takes")  # fmt: skip
            try:
                self.live.client._request(self.live.route(FRAMES_ROUTE), {"frames": encoded},
                                          headers=self.live.headers)  # fmt: skip
            except ServerError as exc:
                if exc.status == 429:
                    return  # the queue is full: these frames go with the next chunk
                raise
            self.pending = []
            self.sent_chunks += 1


# -- the end ---------------------------------------------------------------------------------------------------------


def finish(live: LiveRun) -> int:
    wanted = live.script.chunks_to_run
    status = 0
    if live.out is not None:
        write_outputs(live)
    if live.metrics is not None:
        print(metrics_line(live.metrics), flush=True)
    else:
        print("metrics: none received (the server sent no fewstep.metrics event)", flush=True)
    if live.missed_controls:
        print(f"warning: {live.missed_controls} controls were applied later than their chunk (they reached the "
              "server after it had started): the latents differ from stream --script's", file=sys.stderr)  # fmt: skip
    if live.refused:
        status = _fail(5, f"refused {live.refused} events or files the server sent (see above)")
    elif len(live.chunks) < wanted:
        status = _fail(3, f"the session ended after {len(live.chunks)} of its {wanted} chunks"
                       + (f" ({live.closed_why[:300]})" if live.closed_why else ""))  # fmt: skip
    return status


def write_outputs(live: LiveRun) -> None:
    """DIR/latents.safetensors (the chunks received, in order, as one tensor), the video, DIR/live.json."""
    from safetensors.torch import load_file

    from .stream import ChunkedSafetensors

    saved = {n for n, row in live.chunks.items() if any(p.endswith(".safetensors") for p in row["files"])}
    done = list(range(next(n for n in range(len(saved) + 1) if n not in saved)))  # 0, 1, ... up to a gap
    if len(done) < len(saved):
        print(f"error: latents.safetensors holds chunks 0 to {len(done) - 1} only: chunk {len(done)} was not "
              f"saved; the later ones are in {os.path.join(live.out, 'chunks')}", file=sys.stderr)  # fmt: skip
    if done:
        shape = latent_shape(live)
        # the chunks in order, each read back and written at once: memory holds one chunk
        whole = (1, 16, shape[2] * len(done), shape[3], shape[4])
        latents = ChunkedSafetensors(os.path.join(live.out, "latents.safetensors"), {"latent": (whole, 2)})
        try:
            for n in done:
                latents.append(
                    "latent",
                    load_file(os.path.join(live.out, "chunks", f"chunk_{n:04d}.safetensors"))["latent"],
                )
            latents.finish()
        finally:
            latents.abandon()
        if not live.quiet:
            print(f"wrote {latents.path} ({len(done)} chunks)")
    if live.video is not None:
        live.video.close()
        if not live.quiet:
            print(f"wrote {live.video.path} ({live.video.frames} frames)")
        live.video = None
    report = {
        "session": live.info,
        "script": live.script.path,
        "chunks": [live.chunks[n] for n in sorted(live.chunks)],
        "controls": [{"control": seq, **row} for seq, row in sorted(live.controls.items())],
        "metrics": live.metrics,
        "closed": live.closed_why,
        "stalls": live.stalls,
    }
    path = os.path.join(live.out, "live.json")
    _write(path, json.dumps(report, indent=2).encode())
    if not live.quiet:
        print(f"wrote {path}")


def metrics_line(m: dict) -> str:
    def sec(key):
        v = m.get(key)
        return f"{v:.3f} s" if _seconds_value(v) else "-"

    rtf, attained = m.get("realtime_factor"), m.get("deadline_attainment")
    batches = m.get("batch_sizes") if isinstance(m.get("batch_sizes"), dict) else {}
    return (
        f"metrics: time to first chunk {sec('time_to_first_chunk_s')}, inter-chunk p50 {sec('inter_chunk_p50_s')} "
        f"/ p99 {sec('inter_chunk_p99_s')}, real-time factor {f'{rtf:.2f}' if _seconds_value(rtf) else '-'}, "
        f"deadlines met {f'{100 * attained:.0f} %' if _seconds_value(attained) else '-'}, viewer stalls "
        f"{m.get('viewer_stalls', '-')} ({sec('viewer_stall_seconds')}), batch sizes "
        f"{', '.join(f'{k}: {v}' for k, v in list(batches.items())[:16]) or '-'}; {m.get('chunks', '-')} chunks, "
        f"{sec('video_seconds')} of video in {sec('seconds')}"
    )
