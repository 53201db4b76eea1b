"""The live video routes on ComfyUI's server (``/fewstep/live/...``) and the websocket sender of their events.

Two layers, so that everything but the aiohttp glue is testable without aiohttp (the pack's test environment has
none; ComfyUI's has):

* :class:`LiveRequests` answers one request from plain values (path parts, the secret header, the body's bytes):
  body size and JSON checks, then one call of the running node's :class:`~..engine.live.LiveService` (which
  validates the body and never waits for the generation), its :class:`~..engine.live.LiveError` mapped to the
  HTTP status it carries, the JSON ``{"error": message}`` answer.
* :func:`register_routes` adds thin aiohttp handlers for it to ``PromptServer.instance.routes`` (custom nodes load
  before ComfyUI adds its route table to the app, so the routes are served under ``/`` and ``/api``). A handler
  reads at most the route's body limit and runs the service call on a worker thread: decoding a start image or
  input frames never holds up the event loop that serves every other client.

Events go to one client only: :class:`WebsocketTransport` is the service's ``LiveTransport``. Each attached
session gets a sender task on the server's event loop; the session's outbox wakes it (``loop.call_soon_threadsafe``)
after every event put, and it pops the events and awaits ``ws.send_json`` on the websocket of that session's
client id, looked up at each send (a reconnect with the same client id replaces the socket). Never ComfyUI's
``send_sync(..., sid=None)``, which broadcasts. A slow client holds up only its own sender, so only its own
bounded outbox fills (the engine then drops its chunk events and sends it a stall event); a client that is gone
leaves its events queued until it is back or its session is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from dataclasses import dataclass

from ..engine.live import PROTOCOL, LiveError
from ..engine.live.protocol import NO_NODE, NO_SESSION, check_frames

log = logging.getLogger(__name__)

PAYLOAD_KINDS = ("webp", "safetensors")  # a chunk's files: its clip, its latents


@dataclass(frozen=True)
class Answer:
    """One HTTP answer: a status and a JSON body (dict / list) or raw bytes with their content type."""

    status: int
    body: object
    content_type: str = "application/json"

    @property
    def json(self) -> bool:
        return not isinstance(self.body, bytes)


def _error(status: int, message: str) -> Answer:
    return Answer(status, {"error": message})


class LiveHosts:
    """The live services running now (the nodes' registry the routes read). ComfyUI runs one prompt at a time,
    so at most one FewStep Live Video node runs and this holds at most one service; a second would be served
    too (each route asks each service), which only tests do."""

    def __init__(self):
        self._services: list = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hosting(self, service):
        """``service`` is reachable through the routes while the block runs (the node's serve loop)."""
        with self._lock:
            self._services.append(service)
        try:
            yield service
        finally:
            with self._lock:
                self._services.remove(service)

    def running(self) -> list:
        with self._lock:
            return list(self._services)

    def __len__(self) -> int:
        with self._lock:
            return len(self._services)


class LiveRequests:
    """The routes' logic on plain values; every method returns an :class:`Answer` and never raises for a bad
    request (see the module docstring)."""

    def __init__(self, hosts: LiveHosts):
        self.hosts = hosts

    # -- routes without a session ------------------------------------------------------------------------------
    def status(self) -> Answer:
        """GET /fewstep/live: the running node's public status (no session ids or secrets), [] when none runs."""
        return Answer(200, [service.status() for service in self.hosts.running()])

    def open(self, body: bytes | None, content_type: str = "application/json") -> Answer:
        """POST /fewstep/live/sessions."""
        services = self.hosts.running()
        if not services:
            return _error(503, NO_NODE)
        parsed = _parse_body(body, content_type, PROTOCOL.max_open_body_bytes)
        if isinstance(parsed, Answer):
            return parsed
        try:
            return Answer(201, services[0].open(parsed))
        except LiveError as err:
            return Answer(err.status, err.answer())

    def stop(self) -> Answer:
        """POST /fewstep/live/stop: every running live node closes its sessions and returns its report."""
        services = self.hosts.running()
        if not services:
            return _error(503, NO_NODE)
        for service in services:
            service.stop("stopped by POST /fewstep/live/stop")
        return Answer(200, {"stopping": [service.status().get("node") for service in services]})

    # -- routes of one session (the secret in the header) ------------------------------------------------------
    def control(self, session_id: str, secret: str | None, body: bytes | None,
                content_type: str = "application/json") -> Answer:  # fmt: skip
        """POST /fewstep/live/sessions/{id}/control."""
        return self._session_call(
            session_id, body, content_type, PROTOCOL.max_body_bytes, 202,
            lambda service, parsed: service.control(session_id, secret or "", parsed),
        )  # fmt: skip

    def frames(self, session_id: str, secret: str | None, body: bytes | None,
               content_type: str = "application/json") -> Answer:  # fmt: skip
        """POST /fewstep/live/sessions/{id}/frames."""
        return self._session_call(
            session_id, body, content_type, PROTOCOL.max_frames_body_bytes, 202,
            lambda service, images: service.feed_frames(session_id, secret or "", images), check_frames,
        )  # fmt: skip

    def payload(self, session_id: str, secret: str | None, index: str, kind: str) -> Answer:
        """GET /fewstep/live/sessions/{id}/chunks/{n}.webp | .safetensors (``index``: the ``n`` of the path)."""
        if kind not in PAYLOAD_KINDS or not index.isascii() or not index.isdecimal() or len(index) > 12:
            # any other name is no chunk of any session: the same answer as a wrong id or secret
            return _error(404, NO_SESSION)

        def call(service):
            data, content_type = service.payload(session_id, secret or "", int(index), kind)
            return Answer(200, data, content_type)

        return self._on_session(call)

    def close(self, session_id: str, secret: str | None) -> Answer:
        """DELETE /fewstep/live/sessions/{id}."""
        return self._on_session(lambda service: Answer(200, service.close(session_id, secret or "")))

    # -- shared ------------------------------------------------------------------------------------------------
    def _session_call(self, session_id, body, content_type, limit, status, call, check=None) -> Answer:
        """``call(service, body)`` with the body parsed (and, with ``check``, turned into what the service
        takes: the frames' bytes)."""
        parsed = _parse_body(body, content_type, limit)
        if isinstance(parsed, Answer):
            return parsed
        if check is not None:
            try:
                parsed = check(parsed)
            except LiveError as err:
                return Answer(err.status, err.answer())
        return self._on_session(lambda service: Answer(status, call(service, parsed)))

    def _on_session(self, call) -> Answer:
        """``call(service)`` on the service that holds the session: a service that does not know the id (or
        the secret) answers the one 404 for both, and the next is asked. Any other refusal (a chunk no longer
        kept, to a caller that proved the secret) is answered as the service words it."""
        services = self.hosts.running()
        if not services:
            return _error(503, NO_NODE)
        for service in services:
            try:
                return call(service)
            except LiveError as err:
                if err.answer() != {"error": NO_SESSION}:
                    return Answer(err.status, err.answer())
        return _error(404, NO_SESSION)


def _parse_body(body: bytes | None, content_type: str | None, limit: int):
    """The body as a JSON object, or the :class:`Answer` refusing it (None: the body was over ``limit``)."""
    if body is None or len(body) > limit:
        return _error(413, f"body: at most {limit} bytes are accepted")
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        # a form or text/plain POST is what another web page can send without asking: refused
        return _error(400, f"Content-Type: expected application/json, got {media or 'none'}")
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return _error(400, "body: expected a JSON object")
    if not isinstance(parsed, dict):
        return _error(400, f"body: expected a JSON object, got a JSON {type(parsed).__name__}")
    return parsed


# -- the websocket sender ------------------------------------------------------------------------------------------


class _Sender:
    """One session's events to its client's websocket, on the server's event loop (see the module docstring)."""

    def __init__(self, server, client_id: str, outbox):
        self.server, self.client_id, self.outbox = server, client_id, outbox
        self.loop = server.loop
        self.closing = False
        self.task = None
        self._event: asyncio.Event | None = None

    def wake(self) -> None:
        """From any thread (the outbox's listener): there is something to send."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is shutting down
            self.loop.call_soon_threadsafe(self._set)

    def finish(self) -> None:
        """From any thread: send what is queued (to a connected client), then end."""
        self.closing = True
        self.wake()

    def _set(self) -> None:
        if self._event is not None:
            self._event.set()

    def start(self) -> None:
        """On the loop: the task that sends (what was queued before it started included)."""
        self._event = asyncio.Event()
        self._event.set()
        self.task = self.loop.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self._event.wait()
            self._event.clear()
            await self._send_queued()
            if self.closing:  # everything queued went out (or its client is gone: it never reads them)
                return

    async def _send_queued(self) -> bool:
        """Send the queued events while the client is connected; True when it is not (they wait for it)."""
        while True:
            ws = self.server.sockets.get(self.client_id)
            if ws is None or ws.closed:
                return True
            item = self.outbox.pop()
            if item is None:
                return False
            event, data = item
            try:
                await ws.send_json({"type": event, "data": data})
            except Exception as exc:  # noqa: BLE001 - a reset or closing socket: the client is gone for now
                log.debug("fewstep: live event %s to client %s not sent: %s", event, self.client_id, exc)
                return True


class WebsocketTransport:
    """The ``LiveTransport`` of a live node inside ComfyUI: sessions' events to their clients' websockets."""

    def __init__(self, server):
        self.server = server
        self._senders: dict[str, _Sender] = {}
        self._lock = threading.Lock()

    def connected(self, client_id: str) -> bool:
        return client_id in self.server.sockets

    def attach(self, session_id: str, client_id: str, outbox) -> None:
        sender = _Sender(self.server, client_id, outbox)
        with self._lock:
            self._senders[session_id] = sender
        # start first, then listen: call_soon_threadsafe keeps the order, so no wake can come before the task
        self.server.loop.call_soon_threadsafe(sender.start)
        outbox.set_listener(sender.wake)

    def detach(self, session_id: str) -> None:
        with self._lock:
            sender = self._senders.pop(session_id, None)
        if sender is not None:
            sender.finish()

    def close(self) -> None:
        """Finish every sender (the node returns)."""
        with self._lock:
            senders, self._senders = list(self._senders.values()), {}
        for sender in senders:
            sender.finish()


# -- the aiohttp glue ----------------------------------------------------------------------------------------------


def register_routes(server, hosts: LiveHosts) -> bool:
    """Add the live routes to ``server.routes`` (once per server); False when they were there already."""
    if getattr(server, "_fewstep_live_routes", None) is not None:
        return False
    from aiohttp import web  # ComfyUI's dependency: only imported inside a ComfyUI server

    requests = LiveRequests(hosts)
    routes = server.routes
    p = PROTOCOL

    def respond(answer: Answer):
        if answer.json:
            return web.json_response(answer.body, status=answer.status)
        return web.Response(body=answer.body, status=answer.status, content_type=answer.content_type)

    async def run(call, *args) -> Answer:
        return await asyncio.get_running_loop().run_in_executor(None, call, *args)

    async def read_body(request, limit: int) -> bytes | None:
        """At most ``limit`` bytes of the body, or None past it (nothing more is read)."""
        if request.content_length is not None and request.content_length > limit:
            return None
        data = bytearray()
        async for part in request.content.iter_any():
            data += part
            if len(data) > limit:
                return None
        return bytes(data)

    async def with_body(request, limit: int, call, *args):
        body = await read_body(request, limit)
        return respond(await run(call, *args, body, request.headers.get("Content-Type")))

    def session(request) -> tuple[str, str | None]:
        return request.match_info["id"], request.headers.get(p.secret_header)

    @routes.get(p.status_route)
    async def fewstep_live_status(request):
        return respond(requests.status())

    @routes.post(p.sessions_route)
    async def fewstep_live_open(request):
        return await with_body(request, p.max_open_body_bytes, requests.open)

    @routes.post(p.control_route)
    async def fewstep_live_control(request):
        return await with_body(request, p.max_body_bytes, requests.control, *session(request))

    @routes.post(p.frames_route)
    async def fewstep_live_frames(request):
        return await with_body(request, p.max_frames_body_bytes, requests.frames, *session(request))

    @routes.get(p.clip_route)
    async def fewstep_live_clip(request):
        return respond(await run(requests.payload, *session(request), request.match_info["n"], "webp"))

    @routes.get(p.latents_route)
    async def fewstep_live_latents(request):
        return respond(await run(requests.payload, *session(request), request.match_info["n"], "safetensors"))

    @routes.delete(p.session_route)
    async def fewstep_live_close(request):
        return respond(await run(requests.close, *session(request)))

    @routes.post(p.stop_route)
    async def fewstep_live_stop(request):
        return respond(await run(requests.stop))

    server._fewstep_live_routes = requests
    return True
