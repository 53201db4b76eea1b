"""A small ComfyUI API client (standard library only): HTTP for /prompt, /history, /view and /object_info, and a
minimal WebSocket (RFC 6455) reader for the progress events the server pushes on /ws."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import struct
import urllib.error
import urllib.parse
import urllib.request


class ServerError(Exception):
    """The server answered with an HTTP error; ``body`` is its JSON (or text) answer."""

    def __init__(self, status: int, body):
        self.status, self.body = status, body
        super().__init__(f"HTTP {status}: {body}")


class UnreachableError(Exception):
    pass


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


class ComfyClient:
    def __init__(self, server: str, timeout: float = 30.0):
        """``server`` as the user gave it (see server_address); raises ValueError for an unusable address."""
        self.server, self.host, self.port = server_address(server)
        self.timeout = timeout

    def _request(self, path: str, data=None, raw: bool = False):
        body = None if data is None else json.dumps(data).encode()
        req = urllib.request.Request(
            self.server + path, data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                payload = resp.read()
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            with contextlib.suppress(ValueError):
                text = json.loads(text)
            raise ServerError(exc.code, text) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise UnreachableError(f"cannot reach ComfyUI at {self.server} ({reason})") from None
        return payload if raw else json.loads(payload or b"null")

    def object_info(self) -> dict:
        return self._request("/object_info")

    def submit(self, prompt: dict, client_id: str, extra_data: dict | None = None) -> dict:
        payload = {"prompt": prompt, "client_id": client_id}
        if extra_data:
            payload["extra_data"] = extra_data
        return self._request("/prompt", payload)

    def history(self, prompt_id: str) -> dict:
        return self._request(f"/history/{urllib.parse.quote(prompt_id)}").get(prompt_id, {})

    def download(self, item: dict, out_dir: str) -> str:
        query = urllib.parse.urlencode(
            {
                "filename": item["filename"],
                "subfolder": item.get("subfolder", ""),
                "type": item.get("type", "output"),
            }
        )
        data = self._request(f"/view?{query}", raw=True)
        path = os.path.join(out_dir, item.get("subfolder", ""), item["filename"])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def websocket(self, client_id: str, timeout: float) -> WebSocket:
        return WebSocket(self.host, self.port, f"/ws?clientId={client_id}", timeout)


class WebSocket:
    """Just enough of RFC 6455 to read ComfyUI's event stream (text and binary messages, ping/pong, close)."""

    def __init__(self, host: str, port: int, path: str, timeout: float):
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise UnreachableError(f"cannot open the event stream ws://{host}:{port}{path} ({exc})") from None
        key = base64.b64encode(os.urandom(16)).decode()
        host_header = f"[{host}]" if ":" in host else host  # an IPv6 literal
        request = (
            f"GET {path} HTTP/1.1\r\nHost: {host_header}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        self.sock.sendall(request.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise UnreachableError("the server closed the event stream during the handshake")
            head += chunk
        status = head.split(b"\r\n", 1)[0]
        if b" 101 " not in status:
            raise UnreachableError(f"the server refused the event stream: {status.decode(errors='replace')}")
        self._buffer = head.split(b"\r\n\r\n", 1)[1]

    def _read(self, n: int) -> bytes:
        while len(self._buffer) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("event stream closed")
            self._buffer += chunk
        data, self._buffer = self._buffer[:n], self._buffer[n:]
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
        """The next message: ("text" | "binary", payload). Raises ConnectionError when the stream closes."""
        parts, kind = [], None
        while True:
            b0, b1 = self._read(2)
            opcode, n = b0 & 0x0F, b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read(8))[0]
            mask = self._read(4) if b1 & 0x80 else None
            payload = self._read(n)
            if mask:
                payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
            if opcode == 0x9:
                self._send(0xA, payload)
                continue
            if opcode == 0x8:
                raise ConnectionError("event stream closed by the server")
            if opcode in (0x1, 0x2):
                kind = "text" if opcode == 0x1 else "binary"
            if opcode in (0x0, 0x1, 0x2):
                parts.append(payload)
                if b0 & 0x80:
                    return kind, b"".join(parts)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._send(0x8)
        self.sock.close()


# -- UI-format workflows --------------------------------------------------------------------------------------------

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
VIRTUAL_NODES = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}


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
                kind == "INT" and name in ("seed", "noise_seed")
            )
            companion = companion or bool(opts.get("image_upload"))
            out.append((name, opts, companion))
    return out


def ui_to_api(workflow: dict, object_info: dict) -> dict:
    """Convert a canvas (UI) workflow to the API format, using the server's node definitions for widget names.

    Muted or bypassed nodes, and frontend-only nodes (notes, reroutes, primitives), are not supported: their
    effect on links is the frontend's business, so such workflows are refused with a clear message.
    """
    links = {}
    for link in workflow.get("links", []):
        if isinstance(link, dict):  # the frontend's newer (version 1) schema writes links as objects
            link = [link[key] for key in ("id", "origin_id", "origin_slot", "target_id", "target_slot")]
        links[link[0]] = link
    api = {}
    for node in workflow["nodes"]:
        kind = node["type"]
        if kind in ("Note", "MarkdownNote"):
            continue
        if kind in VIRTUAL_NODES:
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
