"""The live-video protocol: route paths, event names, the secret's header, body bounds, and the validation of the
request bodies (open / control / frames). Routes on ComfyUI's server (``nodes/live_routes.py``) and clients
(``cli/live.py``) read these names from here; the service (``service.py``) validates every body with them.

Every failure is a :class:`LiveError`: an :class:`~engine.errors.InputError` carrying the HTTP status its route
answers with and a one-line message naming the field (``prompt: expected text of 1..2000 characters, got 0``).
"""

from __future__ import annotations

import base64
import binascii
import math
import numbers
import re
from dataclasses import dataclass

from ..errors import InputError
from ..units import format_bytes

BASE = "/fewstep/live"
STATUS_ROUTE = BASE  # GET: public status of the running live nodes
SESSIONS_ROUTE = f"{BASE}/sessions"  # POST: open
SESSION_ROUTE = f"{BASE}/sessions/{{id}}"  # DELETE: close
CONTROL_ROUTE = f"{BASE}/sessions/{{id}}/control"  # POST
FRAMES_ROUTE = f"{BASE}/sessions/{{id}}/frames"  # POST
CLIP_ROUTE = f"{BASE}/sessions/{{id}}/chunks/{{n}}.webp"  # GET
LATENTS_ROUTE = f"{BASE}/sessions/{{id}}/chunks/{{n}}.safetensors"  # GET
STOP_ROUTE = f"{BASE}/stop"  # POST
SECRET_HEADER = "X-FewStep-Secret"  # never in a URL: it would land in access logs

EVENT_SESSION = "fewstep.session"
EVENT_CHUNK = "fewstep.chunk"
EVENT_CONTROL_APPLIED = "fewstep.control_applied"
EVENT_DEADLINE_MISSED = "fewstep.deadline_missed"
EVENT_STALL = "fewstep.stall"
EVENT_METRICS = "fewstep.metrics"
EVENTS = (
    EVENT_SESSION,
    EVENT_CHUNK,
    EVENT_CONTROL_APPLIED,
    EVENT_DEADLINE_MISSED,
    EVENT_STALL,
    EVENT_METRICS,
)
SESSION_STATES = ("opened", "suspended", "resumed", "closed")

KIB, MIB = 1024, 1024 * 1024
MAX_START_IMAGE_BYTES = 8 * MIB  # a start image, decoded
MAX_BODY_BYTES = 64 * KIB  # open (without its start image) and control bodies
# open with a start image: the base64 text of 8 MiB is 4/3 of it
MAX_OPEN_BODY_BYTES = MAX_BODY_BYTES + 4 * math.ceil(MAX_START_IMAGE_BYTES / 3)
MAX_FRAMES_BODY_BYTES = 16 * MIB
MAX_PROMPT_CHARS = 2000
MAX_CLIENT_ID_CHARS = 128
MAX_SCHEDULED_CONTROLS = 64  # at_chunk controls waiting per session
QUEUED_INPUT_CHUNKS = 8  # video-to-video input frames queued per session, in chunks
SEED_MAX = 2**63 - 1
DEFAULT_JPEG_QUALITY = 80
CONTROL_KINDS = ("prompt", "strength", "seed", "stop")

NO_SESSION = "no live session with this id and secret"
NO_NODE = "no FewStep Live Video node is running: queue a workflow with one first"
_CLIENT_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


class LiveError(InputError):
    """A refused request: ``status`` (400, 404, 409, 413, 429, 503), the ``field`` it is about ("" when none) and
    the message. :meth:`answer` is the JSON body a route returns."""

    def __init__(self, status: int, field: str, message: str, where: str | None = None):
        self.status = status
        self.field = field
        self.message = message
        super().__init__(field or "request", message, where)

    @property
    def text(self) -> str:
        """The one line a client reads: ``field: message`` (just the message when it names no field)."""
        return f"{self.field}: {self.message}" if self.field else self.message

    def answer(self) -> dict:
        return {"error": self.text}


def no_session() -> LiveError:
    """Unknown id and wrong secret: one identical answer, so a guess learns nothing."""
    return LiveError(404, "", NO_SESSION)


def no_node() -> LiveError:
    return LiveError(503, "", NO_NODE)


@dataclass(frozen=True)
class Protocol:
    """The protocol's names and bounds in one object (``engine.live.PROTOCOL``)."""

    base: str = BASE
    status_route: str = STATUS_ROUTE
    sessions_route: str = SESSIONS_ROUTE
    session_route: str = SESSION_ROUTE
    control_route: str = CONTROL_ROUTE
    frames_route: str = FRAMES_ROUTE
    clip_route: str = CLIP_ROUTE
    latents_route: str = LATENTS_ROUTE
    stop_route: str = STOP_ROUTE
    secret_header: str = SECRET_HEADER
    events: tuple[str, ...] = EVENTS
    max_body_bytes: int = MAX_BODY_BYTES
    max_open_body_bytes: int = MAX_OPEN_BODY_BYTES
    max_frames_body_bytes: int = MAX_FRAMES_BODY_BYTES
    max_start_image_bytes: int = MAX_START_IMAGE_BYTES
    max_prompt_chars: int = MAX_PROMPT_CHARS
    queued_input_chunks: int = QUEUED_INPUT_CHUNKS
    max_scheduled_controls: int = MAX_SCHEDULED_CONTROLS


PROTOCOL = Protocol()


@dataclass(frozen=True)
class OpenRequest:
    client_id: str
    prompt: str
    seed: int = 0
    chunks: int | None = None
    start_image: bytes | None = None  # decoded PNG / JPEG bytes
    strength: float | None = None
    jpeg: bool = False
    jpeg_quality: int = DEFAULT_JPEG_QUALITY
    # controls scheduled with the open itself (each with its at_chunk): no race with the session's first chunks
    controls: tuple[ControlRequest, ...] = ()


@dataclass(frozen=True)
class ControlRequest:
    kind: str  # prompt | strength | seed | stop
    value: object = None  # prompt: str; strength: float | None; seed: int; stop: True
    recache: bool = False
    at_chunk: int | None = None


def _body(body) -> dict:
    if not isinstance(body, dict):
        raise LiveError(400, "body", f"expected a JSON object, got {type(body).__name__}")
    return body


def _unknown(body: dict, allowed: tuple[str, ...]) -> None:
    extra = sorted(k for k in body if k not in allowed)
    if extra:
        raise LiveError(400, str(extra[0]), f"unknown field; expected {', '.join(allowed)}")


def check_prompt(value, field: str = "prompt") -> str:
    if not isinstance(value, str):
        raise LiveError(
            400, field, f"expected text of 1..{MAX_PROMPT_CHARS} characters, got {type(value).__name__}"
        )
    if not 1 <= len(value) <= MAX_PROMPT_CHARS:
        raise LiveError(400, field, f"expected text of 1..{MAX_PROMPT_CHARS} characters, got {len(value)}")
    return value


def check_int(value, field: str, low: int, high: int | None = None) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        span = f"{low}..{high}" if high is not None else f">= {low}"
        raise LiveError(400, field, f"expected an integer {span}, got {value!r}")
    return value


def check_strength(value, field: str = "strength") -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise LiveError(400, field, f"expected a number in (0, 1] or null, got {value!r}")
    if not 0.0 < float(value) <= 1.0:
        raise LiveError(400, field, f"expected a number in (0, 1] or null, got {value!r}")
    return float(value)


def check_bool(value, field: str) -> bool:
    if not isinstance(value, bool):
        raise LiveError(400, field, f"expected true or false, got {value!r}")
    return value


def check_client_id(value) -> str:
    if not isinstance(value, str) or not _CLIENT_ID.fullmatch(value):
        raise LiveError(400, "client_id", "expected the websocket clientId events go to: 1..128 characters of "
                        f"A-Z a-z 0-9 _ -, got {value!r}"[:300])  # fmt: skip
    return value


def decode_image_field(value, field: str, max_bytes: int = MAX_START_IMAGE_BYTES) -> bytes:
    """A base64 PNG / JPEG (a ``data:image/...;base64,`` prefix is accepted) -> its bytes, bounded."""
    if not isinstance(value, str) or not value:
        raise LiveError(400, field, f"expected a base64 PNG or JPEG, got {type(value).__name__}")
    if value.startswith("data:"):
        value = value.partition(",")[2]
    if len(value) > 4 * math.ceil(max_bytes / 3) + 4:
        raise LiveError(413, field, f"image larger than {format_bytes(max_bytes)}")
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise LiveError(400, field, "expected a base64 PNG or JPEG: not valid base64") from None
    if len(data) > max_bytes:
        raise LiveError(413, field, f"image larger than {format_bytes(max_bytes)}")
    if not (data.startswith(b"\x89PNG\r\n\x1a\n") or data.startswith(b"\xff\xd8")):
        raise LiveError(400, field, "expected a base64 PNG or JPEG: neither signature found")
    return data


OPEN_FIELDS = (
    "client_id",
    "prompt",
    "seed",
    "chunks",
    "start_image",
    "strength",
    "jpeg",
    "jpeg_quality",
    "controls",
)


def check_open(body) -> OpenRequest:
    """An open body -> :class:`OpenRequest` (the first problem -> :class:`LiveError` 400 / 413)."""
    body = _body(body)
    _unknown(body, OPEN_FIELDS)
    client_id = check_client_id(body.get("client_id"))
    prompt = check_prompt(body.get("prompt"))
    seed = check_int(body.get("seed", 0), "seed", 0, SEED_MAX)
    chunks = body.get("chunks")
    chunks = None if chunks is None else check_int(chunks, "chunks", 1)
    start = body.get("start_image")
    start = None if start is None else decode_image_field(start, "start_image")
    strength = check_strength(body.get("strength"))
    jpeg = check_bool(body.get("jpeg", False), "jpeg")
    quality = check_int(body.get("jpeg_quality", DEFAULT_JPEG_QUALITY), "jpeg_quality", 1, 95)
    if start is not None and strength is not None:
        raise LiveError(400, "strength", "video to video restyles input frames; a start image is for image to "
                        "video: give one or the other")  # fmt: skip
    controls = check_open_controls(body.get("controls", []))
    return OpenRequest(client_id, prompt, seed, chunks, start, strength, jpeg, quality, controls)


def check_open_controls(value) -> tuple[ControlRequest, ...]:
    """The open body's ``controls``: control bodies, each with its ``at_chunk`` (scheduled with the open, so a
    script's controls never race the session's first chunks), at most ``MAX_SCHEDULED_CONTROLS``."""
    if not isinstance(value, list):
        raise LiveError(400, "controls", f"expected a list of control objects, got {type(value).__name__}")
    if len(value) > MAX_SCHEDULED_CONTROLS:
        raise LiveError(400, "controls", f"{len(value)} controls; at most {MAX_SCHEDULED_CONTROLS}")
    controls = []
    for i, body in enumerate(value):
        try:
            control = check_control(body)
        except LiveError as err:
            field = f"controls[{i}].{err.field}" if err.field else f"controls[{i}]"
            raise LiveError(err.status, field, err.message) from None
        if control.at_chunk is None:
            raise LiveError(400, f"controls[{i}].at_chunk", "a control sent with the open needs its chunk")
        controls.append(control)
    return tuple(controls)


def check_control(body) -> ControlRequest:
    """A control body: exactly one of prompt (+ recache) / strength / seed / stop, optional at_chunk."""
    body = _body(body)
    _unknown(body, ("prompt", "recache", "strength", "seed", "stop", "at_chunk"))
    kinds = [k for k in CONTROL_KINDS if k in body]
    if len(kinds) != 1:
        got = ", ".join(kinds) if kinds else "none"
        raise LiveError(400, "control", f"expected exactly one of prompt, strength, seed, stop; got {got}")
    kind = kinds[0]
    if "recache" in body and kind != "prompt":
        raise LiveError(400, "recache", "only goes with a prompt")
    at = body.get("at_chunk")
    at = None if at is None else check_int(at, "at_chunk", 0)
    recache = False
    if kind == "prompt":
        value = check_prompt(body["prompt"])
        recache = check_bool(body.get("recache", False), "recache")
    elif kind == "strength":
        value = check_strength(body["strength"])
    elif kind == "seed":
        value = check_int(body["seed"], "seed", 0, SEED_MAX)
    else:
        if body["stop"] is not True:
            raise LiveError(400, "stop", f"expected true, got {body['stop']!r}")
        value = True
    return ControlRequest(kind, value, recache, at)


def check_frames(body, max_frames: int | None = None) -> list[bytes]:
    """A frames body ``{"frames": [base64 PNG/JPEG, ...]}`` -> the images' bytes."""
    body = _body(body)
    _unknown(body, ("frames",))
    frames = body.get("frames")
    if not isinstance(frames, list) or not frames:
        raise LiveError(400, "frames", "expected a non-empty list of base64 PNG or JPEG images")
    if max_frames is not None and len(frames) > max_frames:
        raise LiveError(413, "frames", f"{len(frames)} frames in one body; at most {max_frames}")
    return [decode_image_field(f, f"frames[{i}]", MAX_FRAMES_BODY_BYTES) for i, f in enumerate(frames)]
