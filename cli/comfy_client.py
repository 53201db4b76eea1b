"""A small ComfyUI API client (standard library only): HTTP for /prompt, /history, /view and /object_info, and a
minimal WebSocket (RFC 6455) reader for the progress events the server pushes on /ws.

The server is not trusted: every read and write of the client shares one deadline (the socket timeout of each
call is the time left), answers and messages have size and JSON-depth limits, anything that is not what ComfyUI
sends is a :class:`ProtocolError`, and downloads land only inside the chosen folder (:func:`local_output_path`).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import http.client
import json
import os
import re
import socket
import struct
import tempfile
import time
import urllib.parse

from ..engine.names import name_problem
from ..engine.settings import env_float
from .files import umask_mode

MAX_JSON_BYTES = 64 << 20  # an HTTP JSON answer (/object_info of a server with many packs is a few MB)
MAX_MESSAGE_BYTES = 64 << 20  # one event-stream message (binary previews are at most a few MB)
MAX_HEAD_BYTES = 64 << 10  # the WebSocket handshake answer
MAX_JSON_DEPTH = 128  # ComfyUI's answers nest about 10 levels; a deeper one is an attack on the parser
# one downloaded output file; a setting over 1 TiB (orders of magnitude above any output ComfyUI writes) is a typo
MAX_FILE_BYTES = int(env_float("FEWSTEP_QUEUE_MAX_FILE_GB", 16.0, minimum=0.0, maximum=1024.0) * (1 << 30))
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455's fixed key suffix


class ServerError(Exception):
    """The server answered ``what`` with an HTTP error; ``body`` is its JSON (or text) answer."""

    def __init__(self, status: int, body, what: str = "the request"):
        self.status, self.body, self.what = status, body, what
        super().__init__(f"{what} answered HTTP {status}: {snippet(body)}")


class UnreachableError(Exception):
    pass


class ProtocolError(Exception):
    """The server answered something ComfyUI does not send (HTML, garbage frames, absurd sizes...)."""


class DeadlineError(Exception):
    """The client's time ran out; the message says what it was doing."""


class LocalWriteError(Exception):
    """A downloaded file could not be written on this machine (disk full, a file where a folder should be...)."""


class WriteCapError(Exception):
    """A download would take this run past ``--max-files`` or ``--max-total-gb``; nothing of it was kept."""


@dataclasses.dataclass
class WriteBudget:
    """What one ``queue`` run may still write under ``--out`` and ``--stream-dir`` together: a flooding server
    (hundreds of files a second, each under the per-file limit) must not fill the disk before ``--timeout``."""

    max_files: int
    max_bytes: int
    files: int = 0  # files written so far (whole; a refused or failed one does not count)
    bytes: int = 0  # their bytes

    def written(self) -> str:
        return f"{self.files} files, {self.bytes} bytes"


class UnsafeOutputError(ValueError):
    """A server-listed output file would be written outside the download folder; the message says why."""


class MalformedEventError(ValueError):
    """An event's data is not in the layout its sender documents; the message says which field and why."""


def snippet(value, limit: int = 80) -> str:
    """A short one-line rendering of a server's answer, for error messages."""
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value[: limit * 4]).decode(errors="replace")
    elif not isinstance(value, str):
        try:
            value = json.dumps(value)[: limit * 4]
        except (TypeError, ValueError, RecursionError):
            value = type(value).__name__
    text = " ".join(value.split())
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _too_deep(value, limit: int) -> bool:
    """Whether ``value`` nests lists/objects deeper than ``limit`` (iterative: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def parse_json(data: bytes, source: str):
    """``data`` as JSON; ``source`` ("POST /prompt answered with") starts the ProtocolError when it is not."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise ProtocolError(f"{source} JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not text
        raise ProtocolError(f"{source} something that is not JSON: {snippet(data)}") from None
    if isinstance(value, (dict, list)) and _too_deep(value, MAX_JSON_DEPTH):
        raise ProtocolError(f"{source} JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


DEFAULT_PORTS = {"http": 80}


def server_address(server: str) -> tuple[str, str, int]:
    """(base URL, host, port) of a ``--server`` value; ``localhost:8188`` means ``http://localhost:8188``.

    Without the scheme check, urlparse reads "localhost" in ``localhost:8188`` as the scheme and the event stream
    would go to port 80. Raises ValueError for an address this client cannot use (https: no TLS here).
    """
    text = server.strip()
    if "://" not in text:
        text = "http://" + text
    url = urllib.parse.urlparse(text)
    scheme = url.scheme.lower()
    if scheme == "https":
        raise ValueError(
            f"--server {server}: https is not supported by this client; use the server's plain "
            "http://host:port address (ComfyUI listens on http, by default http://127.0.0.1:8188)"
        )
    if scheme not in DEFAULT_PORTS:
        raise ValueError(f"--server {server}: expected http://host:port (e.g. http://127.0.0.1:8188)")
    try:
        port = url.port or DEFAULT_PORTS[scheme]
    except ValueError:
        raise ValueError(f"--server {server}: the port is not a number from 0 to 65535") from None
    if not url.hostname:
        raise ValueError(f"--server {server}: no host name; expected http://host:port")
    return text.rstrip("/"), url.hostname, port


class Deadline:
    """One point in time that every socket operation of a client must finish by."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def remaining(self, doing: str) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise DeadlineError(f"while {doing}")
        return left


class _DeadlineSocket(socket.socket):
    """A socket whose every read and write may take only the time left until its deadline.

    A per-call timeout alone does not bound a server that sends a byte (or a ping) now and then; re-arming the
    timeout from the remaining time on each call does, for our own reads and for http.client's (its response
    file calls ``recv_into`` on this object).
    """

    deadline: Deadline
    doing: str

    def _arm(self) -> None:
        self.settimeout(self.deadline.remaining(self.doing))

    def recv(self, *args):
        self._arm()
        try:
            return super().recv(*args)
        except TimeoutError:
            raise DeadlineError(f"while {self.doing}") from None

    def recv_into(self, *args):
        self._arm()
        try:
            return super().recv_into(*args)
        except TimeoutError:
            raise DeadlineError(f"while {self.doing}") from None

    def sendall(self, *args):
        self._arm()
        try:
            return super().sendall(*args)
        except TimeoutError:
            raise DeadlineError(f"while {self.doing}") from None


def _connect(host: str, port: int, deadline: Deadline, doing: str, unreachable: str) -> _DeadlineSocket:
    try:
        raw = socket.create_connection((host, port), timeout=deadline.remaining(doing))
    except TimeoutError:
        raise DeadlineError(f"while {doing}") from None
    except OSError as exc:
        raise UnreachableError(f"{unreachable} ({exc})") from None
    sock = _DeadlineSocket(raw.family, raw.type, raw.proto, fileno=raw.detach())
    sock.deadline, sock.doing = deadline, doing
    return sock


class _Connection(http.client.HTTPConnection):
    def __init__(self, client: ComfyClient, doing: str):
        super().__init__(client.host, client.port)
        self.client, self.doing = client, doing

    def connect(self) -> None:
        self.sock = _connect(
            self.host,
            self.port,
            self.client.deadline,
            self.doing,
            f"cannot reach ComfyUI at {self.client.server}",
        )


def _read_body(resp, what: str, limit: int, sink=None, refuse=ProtocolError) -> bytes:
    """The answer's body (or passed to ``sink(chunk)``), refused (``refuse(message)`` raised) once it is larger
    than ``limit`` bytes."""
    if resp.length is not None and resp.length > limit:
        raise refuse(f"{what} answered with {resp.length} bytes, more than the {limit} this client accepts")
    parts, total = [], 0
    while chunk := resp.read(min(1 << 20, limit + 1 - total)):
        total += len(chunk)
        if total > limit:
            raise refuse(f"{what} answered with more than the {limit} bytes this client accepts")
        if sink is None:
            parts.append(chunk)
        else:
            sink(chunk)
    return b"".join(parts)


_SEPARATORS = re.compile(r"[\\/]")


def local_output_path(out_dir: str, subfolder, filename) -> str:
    """Where a server-listed output file (``subfolder``/``filename``) goes inside ``out_dir``.

    The names come from the server: the file name must be a plain name, the subfolder relative without ``..``
    (``/`` or ``\\`` separated), neither with a character the pack's name check refuses (control, bidi override,
    zero-width, surrogate...: :mod:`..engine.names`, so a saved name reads as what it is), and the resolved path
    (symlinks followed) must stay inside ``out_dir``. Raises UnsafeOutputError saying why otherwise; nothing is
    created here.
    """
    if (
        not isinstance(filename, str)
        or filename in ("", ".", "..")
        or _SEPARATORS.search(filename)
        or os.path.splitdrive(filename)[0]
    ):
        raise UnsafeOutputError(
            f"the file name {filename!r} is not a plain file name (no folders, '.', '..' or control characters)"
        )
    problem = name_problem(filename)
    if problem is not None:
        raise UnsafeOutputError(f"the file name {filename!r} is not a plain file name ({problem})")
    subfolder = "" if subfolder is None else subfolder
    if not isinstance(subfolder, str):
        raise UnsafeOutputError(f"the subfolder {subfolder!r} is not text")
    problem = name_problem(subfolder)
    if problem is not None:
        raise UnsafeOutputError(f"the subfolder {subfolder!r} cannot name a folder ({problem})")
    parts = [part for part in _SEPARATORS.split(subfolder) if part not in ("", ".")]
    if _SEPARATORS.match(subfolder) or re.match(r"[A-Za-z]:", subfolder) or os.path.isabs(subfolder):
        raise UnsafeOutputError(f"the subfolder {subfolder!r} is absolute")
    if ".." in parts:
        raise UnsafeOutputError(f"the subfolder {subfolder!r} contains '..'")
    root = os.path.realpath(out_dir)
    path = os.path.join(root, *parts, filename)
    resolved = os.path.realpath(path)  # follows symlinks already in out_dir, also in not-yet-created parents
    try:
        inside = os.path.commonpath([root, resolved]) == root
    except ValueError:  # another drive
        inside = False
    if not inside:
        raise UnsafeOutputError(f"{path} leads outside --out (through a symlink, to {resolved})")
    return path


class ComfyClient:
    def __init__(self, server: str, timeout: float = 30.0):
        """``server`` as the user gave it (see server_address); every request from now on shares one deadline,
        ``timeout`` seconds away. Raises ValueError for an unusable address."""
        self.server, self.host, self.port = server_address(server)
        self.base_path = urllib.parse.urlparse(self.server).path.rstrip("/")
        self.deadline = Deadline(timeout)

    def _request(
        self,
        path: str,
        data=None,
        sink=None,
        file_limit=MAX_FILE_BYTES,
        refuse=ProtocolError,
        method: str | None = None,
        headers: dict | None = None,
    ):
        """The JSON answer to GET (or POST ``data`` to) ``path``; with ``sink``, the body goes to ``sink(chunk)``,
        at most ``file_limit`` bytes (``refuse(message)`` is raised past it). ``method`` overrides GET / POST
        (DELETE); ``headers`` are sent besides the JSON content type (a secret: never part of a message)."""
        method = method or ("GET" if data is None else "POST")
        what = f"{method} {path}"
        conn = _Connection(self, f"reading {what}")
        body = None if data is None else json.dumps(data).encode()
        try:
            conn.request(
                method,
                self.base_path + path,
                body=body,
                headers={"Content-Type": "application/json", **(headers or {})},
            )
            resp = conn.getresponse()
            if resp.status >= 400:
                text = _read_body(resp, what, MAX_JSON_BYTES)
                with contextlib.suppress(ProtocolError):
                    text = parse_json(text, what)
                raise ServerError(
                    resp.status, text if not isinstance(text, bytes) else text.decode(errors="replace"), what
                )
            if sink is not None:
                return _read_body(resp, what, file_limit, sink, refuse)
            return parse_json(_read_body(resp, what, MAX_JSON_BYTES) or b"null", f"{what} answered with")
        except http.client.HTTPException as exc:  # not HTTP, a header line too long, a body cut short...
            raise ProtocolError(
                f"{what} answered with something that is not a complete HTTP answer ({exc!r})"
            ) from None
        except OSError as exc:
            raise UnreachableError(f"cannot reach ComfyUI at {self.server} ({exc})") from None
        finally:
            conn.close()

    def object_info(self) -> dict:
        info = self._request("/object_info")
        if not isinstance(info, dict):
            raise ProtocolError(f"GET /object_info answered with {snippet(info)}, not the node definitions")
        return info

    def submit(self, prompt: dict, client_id: str, extra_data: dict | None = None) -> dict:
        """The server's answer to POST /prompt; raises ProtocolError when it has no prompt_id."""
        payload = {"prompt": prompt, "client_id": client_id}
        if extra_data:
            payload["extra_data"] = extra_data
        answer = self._request("/prompt", payload)
        if (
            not isinstance(answer, dict)
            or not isinstance(answer.get("prompt_id"), str)
            or not answer["prompt_id"]
        ):
            raise ProtocolError(f"POST /prompt answered without a prompt_id: {snippet(answer)}")
        return answer

    def history(self, prompt_id: str) -> dict:
        """The prompt's history entry ({} while it is not written yet), checked to be in ComfyUI's layout."""
        path = f"/history/{urllib.parse.quote(prompt_id)}"
        history = self._request(path)
        entry = history.get(prompt_id, {}) if isinstance(history, dict) else None
        outputs = entry.get("outputs", {}) if isinstance(entry, dict) else None
        if not isinstance(outputs, dict) or not all(isinstance(o, dict) for o in outputs.values()):
            raise ProtocolError(
                f"GET {path} answered with a history entry ComfyUI does not write: {snippet(history)}"
            )
        return entry

    def download(self, item: dict, out_dir: str, budget: WriteBudget | None = None) -> str:
        """Save one output file the history lists into ``out_dir`` (see local_output_path); returns its path.

        Raises UnsafeOutputError (nothing written) for names that lead outside ``out_dir``, WriteCapError (nothing
        written) when the file would take ``budget`` past its files or bytes. The file appears whole or not at
        all: it is written next to its place and renamed, which also replaces rather than follows a symlink left
        there.
        """
        path = local_output_path(out_dir, item.get("subfolder"), item.get("filename"))
        kind = item.get("type", "output")
        if not isinstance(kind, str):
            raise UnsafeOutputError(f"the type {kind!r} is not text")
        limit, refuse = MAX_FILE_BYTES, ProtocolError
        if budget is not None:
            if budget.files >= budget.max_files:
                raise WriteCapError(
                    f"{path} would be file {budget.files + 1}, over --max-files {budget.max_files}"
                )
            left = budget.max_bytes - budget.bytes
            if left < limit:  # the run's total, not the file's own limit, is what bounds this one

                def refuse(message: str) -> WriteCapError:
                    return WriteCapError(
                        f"{message} ({left} bytes are left of --max-total-gb, {budget.max_bytes} bytes, after "
                        f"{budget.written()})"
                    )

                limit = left
        query = urllib.parse.urlencode(
            {"filename": item["filename"], "subfolder": item.get("subfolder") or "", "type": kind}
        )
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, partial = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".fewstep-download-")
        except OSError as exc:
            raise LocalWriteError(f"cannot write {path}: {exc}") from None

        def write(chunk: bytes) -> None:
            try:
                f.write(chunk)
            except OSError as exc:  # not the server's fault: keep it apart from UnreachableError
                raise LocalWriteError(f"cannot write {path}: {exc}") from None

        try:
            with os.fdopen(fd, "wb") as f:
                self._request(f"/view?{query}", sink=write, file_limit=limit, refuse=refuse)
                size = f.tell()
            try:
                os.chmod(partial, umask_mode())  # mkstemp makes it 0600; outputs get what open() would give
                os.replace(partial, path)
            except OSError as exc:  # a name too long for this file system, a folder where the file should go
                raise LocalWriteError(f"cannot write {path}: {exc}") from None
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
        if budget is not None:
            budget.files += 1
            budget.bytes += size
        return path

    def websocket(self, client_id: str) -> WebSocket:
        return WebSocket(self.host, self.port, f"/ws?clientId={client_id}", self.deadline)


# -- the fewstep.chunk event -----------------------------------------------------------------------------------------

MAX_CHUNK_FILES = 16  # the sampler sends one clip per chunk; more is not a fewstep node talking
MAX_NODE_ID_CHARS = 256  # ComfyUI ids are short ("12", "5:3" inside a subgraph)
MAX_COUNT = 1 << 62  # chunk indices, frame numbers, byte counts: bounded so that a line stays a line


@dataclasses.dataclass(frozen=True)
class ChunkEvent:
    """The data of one ``fewstep.chunk`` event (the contract in docs/streaming-api.md): a chunk a fewstep sampler finished."""

    node: str
    chunk: int  # index in the session (keeps counting across FewStepCausalContinue)
    chunks: int  # chunks this node run produces in all
    frames: tuple[int, int]  # first and last video frame of the chunk in the session, inclusive
    files: tuple[dict, ...]  # /view query parameters (filename, subfolder, type); () when none is decoded
    seconds: float
    first_chunk_seconds: float
    kv_bytes: int


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_COUNT


def _is_seconds(value) -> bool:
    # compared, not math.isfinite(): NaN and infinity fail the comparison, and an int of 400 digits (JSON has
    # no limit) would overflow the conversion to float
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < MAX_COUNT


def _is_frames(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(map(_is_count, value)) and value[0] <= value[1]


def _is_file(value) -> bool:
    return isinstance(value, dict) and all(
        isinstance(value.get(key), str) for key in ("filename", "subfolder", "type")
    )


def _is_files(value) -> bool:
    return isinstance(value, list) and len(value) <= MAX_CHUNK_FILES and all(map(_is_file, value))


_CHUNK_FIELDS = {
    "node": (lambda v: isinstance(v, str) and 0 < len(v) <= MAX_NODE_ID_CHARS, "a node id (text)"),
    "chunk": (_is_count, "a chunk index (an integer >= 0)"),
    "chunks": (lambda v: _is_count(v) and v > 0, "a number of chunks (an integer >= 1)"),
    "frames": (_is_frames, "[first, last] video frame numbers, first <= last"),
    "files": (
        _is_files,
        f"a list of at most {MAX_CHUNK_FILES} {{filename, subfolder, type}} objects of text",
    ),
    "seconds": (_is_seconds, "seconds (a number >= 0)"),
    "first_chunk_seconds": (_is_seconds, "seconds (a number >= 0)"),
    "kv_bytes": (_is_count, "a number of bytes (an integer >= 0)"),
}


def parse_chunk_event(data: dict) -> ChunkEvent:
    """The fields of a ``fewstep.chunk`` event's ``data``; fields it does not know are ignored (the contract lets
    the node add some). Raises MalformedEventError naming the first field that is missing or not as documented."""
    for key, (valid, expected) in _CHUNK_FIELDS.items():
        if key not in data:
            raise MalformedEventError(f"it has no {key!r}")
        value = data[key]
        if not valid(value):
            as_json = json.dumps(value[:400]) if isinstance(value, str) else value  # "3" apart from 3
            raise MalformedEventError(f"its {key!r} is {snippet(as_json)}, expected {expected}")
    return ChunkEvent(
        node=data["node"],
        chunk=data["chunk"],
        chunks=data["chunks"],
        frames=tuple(data["frames"]),
        files=tuple({key: file[key] for key in ("filename", "subfolder", "type")} for file in data["files"]),
        seconds=float(data["seconds"]),
        first_chunk_seconds=float(data["first_chunk_seconds"]),
        kv_bytes=data["kv_bytes"],
    )


class WebSocket:
    """Just enough of RFC 6455 to read ComfyUI's event stream (text and binary messages, ping/pong, close).

    Frames that break the protocol (reserved bits, unknown opcodes, masked or oversized frames, a broken
    fragment sequence) raise ProtocolError; every read shares the client's deadline.
    """

    def __init__(self, host: str, port: int, path: str, deadline: Deadline):
        url = f"ws://{host}:{port}{path}"
        self.deadline = deadline
        self.sock = _connect(
            host, port, deadline, f"opening the event stream {url}", f"cannot open the event stream {url}"
        )
        try:
            self._handshake(host, port, path)
        except BaseException:
            self.sock.close()
            raise
        self.sock.doing = "waiting for the run's events"

    def _handshake(self, host: str, port: int, path: str) -> None:
        key = base64.b64encode(os.urandom(16)).decode()
        host_header = f"[{host}]" if ":" in host else host  # an IPv6 literal
        request = (
            f"GET {path} HTTP/1.1\r\nHost: {host_header}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        self.sock.sendall(request.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            if len(head) > MAX_HEAD_BYTES:
                raise ProtocolError(
                    f"the event stream's handshake answer is longer than {MAX_HEAD_BYTES} bytes"
                )
            chunk = self.sock.recv(4096)
            if not chunk:
                raise UnreachableError("the server closed the event stream during the handshake")
            head += chunk
        head, rest = head.split(b"\r\n\r\n", 1)
        status, *lines = head.decode("latin-1").split("\r\n")
        if " 101 " not in status + " ":
            raise UnreachableError(f"the server refused the event stream: {status}")
        headers = {
            name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)
        }
        expected = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        if headers.get("sec-websocket-accept") != expected:
            raise ProtocolError(
                "the event stream's handshake has a wrong Sec-WebSocket-Accept (not a WebSocket server)"
            )
        self._buffer = bytearray(rest)

    def _read(self, n: int) -> bytes:
        while len(self._buffer) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("event stream closed")
            self._buffer += chunk
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data

    def _send(self, opcode: int, payload: bytes = b"") -> None:
        mask = os.urandom(4)
        header = bytes([0x80 | opcode])
        n = len(payload)
        if n < 126:
            header += bytes([0x80 | n])
        elif n < 1 << 16:
            header += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            header += bytes([0x80 | 127]) + struct.pack(">Q", n)
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def receive(self) -> tuple[str, bytes]:
        """The next message: ("text" | "binary", payload). Raises ConnectionError when the stream closes,
        ProtocolError for a frame that breaks RFC 6455, DeadlineError when the time is up."""
        parts, kind, size = [], None, 0
        while True:
            self.deadline.remaining(self.sock.doing)  # also between frames already buffered (a ping flood)
            b0, b1 = self._read(2)
            opcode, n = b0 & 0x0F, b1 & 0x7F
            if b0 & 0x70:
                raise ProtocolError(
                    f"the event stream sent a frame with reserved bits set ({b0:#04x}), no extension was agreed"
                )
            if opcode not in (0x0, 0x1, 0x2, 0x8, 0x9, 0xA):
                raise ProtocolError(f"the event stream sent a frame with unknown opcode {opcode}")
            if b1 & 0x80:
                raise ProtocolError(
                    "the event stream sent a masked frame (a server must not mask its frames)"
                )
            if n == 126:
                n = struct.unpack(">H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read(8))[0]
            if opcode >= 0x8 and n > 125:
                raise ProtocolError(f"the event stream sent a control frame of {n} bytes (at most 125)")
            if opcode >= 0x8 and not b0 & 0x80:
                raise ProtocolError("the event stream sent a fragmented control frame")
            if size + n > MAX_MESSAGE_BYTES:
                raise ProtocolError(
                    f"the event stream sent a frame of {n} bytes; a message may be at most {MAX_MESSAGE_BYTES} bytes"
                )
            payload = self._read(n)
            if opcode == 0x9:
                self._send(0xA, payload)
                continue
            if opcode == 0xA:
                continue  # an unsolicited pong
            if opcode == 0x8:
                raise ConnectionError("event stream closed by the server")
            if opcode == 0x0 and kind is None:
                raise ProtocolError(
                    "the event stream sent a continuation frame without a message to continue"
                )
            if opcode != 0x0 and kind is not None:
                raise ProtocolError("the event stream started a new message inside a fragmented one")
            if opcode != 0x0:
                kind = "text" if opcode == 0x1 else "binary"
            parts.append(payload)
            size += n
            if b0 & 0x80:
                return kind, b"".join(parts)

    def close(self) -> None:
        with contextlib.suppress(OSError, DeadlineError):
            self._send(0x8)
        self.sock.close()


# -- UI-format workflows --------------------------------------------------------------------------------------------

# The frontend's rules this model of the UI format and the workflow builder's (workflows/fewstep_workflows/) both
# follow; the builder imports them from here. As ComfyUI frontend 1.27.10 (the one ComfyUI 0.3.64 pins) has them:
# the input types shown as widgets, and the INT inputs that get a "control after generate" widget by name alone.
WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})
SEED_INPUT_NAMES = frozenset({"seed", "noise_seed"})
# Node types that exist only in the frontend (the classes that set isVirtualNode: noteNode.ts, rerouteNode.ts,
# widgetInputs.ts), left out of the API prompt. A note holds only text, so dropping it is the whole conversion; a
# Reroute passes a link on and a PrimitiveNode writes its value into the widgets it is linked to, which the frontend
# resolves before it drops them.
NOTE_NODES = frozenset({"Note", "MarkdownNote"})
FRONTEND_ONLY_NODES = NOTE_NODES | {"Reroute", "PrimitiveNode"}


def is_ui_format(workflow) -> bool:
    return isinstance(workflow, dict) and "nodes" in workflow and "links" in workflow


def _widget_inputs(info: dict) -> list[tuple[str, dict, bool]]:
    """(name, options, has a companion value) for each widget input, in the order the frontend lays them out."""
    out = []
    for section in ("required", "optional"):
        for name, spec in info.get("input", {}).get(section, {}).items():
            kind = spec[0]
            opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            is_widget = isinstance(kind, list) or kind in WIDGET_TYPES
            if not is_widget or opts.get("forceInput"):
                continue
            companion = bool(opts.get("control_after_generate")) or (
                kind == "INT" and name in SEED_INPUT_NAMES
            )
            companion = companion or bool(opts.get("image_upload"))
            out.append((name, opts, companion))
    return out


def ui_to_api(workflow: dict, object_info: dict) -> dict:
    """Convert a canvas (UI) workflow to the API format, using the server's node definitions for widget names.

    Notes are dropped. Muted or bypassed nodes, and the other frontend-only nodes (reroutes, primitives), are not
    supported: their effect on links is the frontend's business, so such workflows are refused with a clear
    message.
    """
    links = {}
    for link in workflow.get("links", []):
        if isinstance(link, dict):  # the frontend's newer (version 1) schema writes links as objects
            link = [link[key] for key in ("id", "origin_id", "origin_slot", "target_id", "target_slot")]
        links[link[0]] = link
    api = {}
    for node in workflow["nodes"]:
        kind = node["type"]
        if kind in NOTE_NODES:
            continue
        if kind in FRONTEND_ONLY_NODES:
            raise ValueError(
                f"node {node['id']} is a frontend-only {kind}; export the workflow with "
                "'Save (API)' in ComfyUI instead"
            )
        if node.get("mode", 0) in (2, 4):
            raise ValueError(
                f"node {node['id']} ({kind}) is muted or bypassed; export with 'Save (API)' instead"
            )
        if kind not in object_info:
            raise ValueError(
                f"node {node['id']}: the server has no node type {kind!r} (is the pack installed?)"
            )
        inputs = {}
        values = list(node.get("widgets_values") or [])
        linked = {i["name"]: i.get("link") for i in node.get("inputs", []) if i.get("link") is not None}
        for name, _, companion in _widget_inputs(object_info[kind]):
            value = values.pop(0) if values else None
            if companion and values:
                values.pop(0)
            if name not in linked and value is not None:
                inputs[name] = value
        for name, link_id in linked.items():
            link = links[link_id]
            inputs[name] = [str(link[1]), link[2]]
        api[str(node["id"])] = {
            "class_type": kind,
            "inputs": inputs,
            "_meta": {"title": node.get("title", kind)},
        }
    return api
