"""The live routes' request handling without aiohttp (``nodes/live_routes.py``: ``LiveRequests``), the registry
the routes read (``LiveHosts``) and the websocket sender (``WebsocketTransport``) on a stand-in server: bodies
bounded and checked before the service sees them, the service's LiveError mapped to its status, the same 404 for an
unknown id and a wrong secret, events to one client only, and a slow or absent client holding up nobody else."""

from __future__ import annotations

import asyncio
import base64
import json
import threading

import pytest

from fewstep.engine.live import PROTOCOL, LiveError, SessionOutbox
from fewstep.engine.live.protocol import NO_NODE, NO_SESSION, check_control, check_open
from fewstep.nodes.live_routes import Answer, LiveHosts, LiveRequests, WebsocketTransport

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 16).decode()


class FakeService:
    """What the routes need of a LiveService: one session "s1" with secret "good"; bodies checked by the
    protocol's own checks, as the service does."""

    def __init__(self, node: str = "7"):
        self.node = node
        self.calls: list[tuple] = []
        self.stopped: list[str] = []

    def _session(self, session_id: str, secret: str) -> None:
        if (session_id, secret) != ("s1", "good"):
            raise LiveError(404, "", NO_SESSION)

    def status(self) -> dict:
        return {"node": self.node, "prompt_id": "p", "slots": 4, "sessions": 1, "free_slots": 3}

    def open(self, body: dict) -> dict:
        request = check_open(body)
        self.calls.append(("open", request))
        return {"session": "s1", "secret": "good", "node": self.node}

    def control(self, session_id: str, secret: str, body: dict) -> dict:
        self._session(session_id, secret)
        request = check_control(body)
        if request.kind == "strength":
            raise LiveError(409, "strength", "this session has no tiny VAE")
        self.calls.append(("control", request))
        return {"control": 1, "kind": request.kind}

    def feed_frames(self, session_id: str, secret: str, images: list[bytes]) -> dict:
        self._session(session_id, secret)
        self.calls.append(("frames", images))
        return {"queued_frames": len(images)}

    def payload(self, session_id: str, secret: str, chunk: int, kind: str) -> tuple[bytes, str]:
        self._session(session_id, secret)
        if chunk > 99:
            raise LiveError(
                404, "chunk", f"chunk {chunk} is not kept: a session keeps its newest 8 chunks (92..99)"
            )
        self.calls.append(("payload", chunk, kind))
        return b"bytes of " + kind.encode(), "image/webp" if kind == "webp" else "application/octet-stream"

    def close(self, session_id: str, secret: str) -> dict:
        self._session(session_id, secret)
        return {"closed": session_id}

    def stop(self, why: str = "stopped by a client") -> None:
        self.stopped.append(why)


@pytest.fixture
def hosted():
    hosts = LiveHosts()
    service = FakeService()
    with hosts.hosting(service):
        yield LiveRequests(hosts), service


def body(obj) -> bytes:
    return json.dumps(obj).encode()


def test_without_a_live_node_the_status_is_empty_and_every_other_route_answers_503():
    requests = LiveRequests(LiveHosts())
    assert requests.status() == Answer(200, [])
    no_node = Answer(503, {"error": NO_NODE})
    assert requests.open(body({"client_id": "a", "prompt": "x"})) == no_node
    assert requests.control("s1", "good", body({"seed": 1})) == no_node
    assert requests.frames("s1", "good", body({"frames": [PNG]})) == no_node
    assert requests.payload("s1", "good", "0", "webp") == no_node
    assert requests.close("s1", "good") == no_node
    assert requests.stop() == no_node
    assert NO_NODE == "no FewStep Live Video node is running: queue a workflow with one first"


def test_open_passes_the_checked_body_to_the_running_service(hosted):
    requests, service = hosted
    answer = requests.open(body({"client_id": "client-A", "prompt": "a fox", "seed": 3, "chunks": 6}))
    assert answer == Answer(201, {"session": "s1", "secret": "good", "node": "7"})
    ((kind, request),) = service.calls
    assert (kind, request.client_id, request.prompt, request.seed, request.chunks) == ("open", "client-A", "a fox",
                                                                                       3, 6)  # fmt: skip
    assert requests.status() == Answer(200, [service.status()])


@pytest.mark.parametrize(
    ("raw", "content_type", "expected"),
    [
        (b"{", "application/json", (400, "body: expected a JSON object")),
        (b"[1, 2]", "application/json", (400, "body: expected a JSON object, got a JSON list")),
        (body({"client_id": "a", "prompt": "x"}), "text/plain", (400, "Content-Type: expected application/json, "
                                                                  "got text/plain")),  # fmt: skip
        (body({"client_id": "a", "prompt": "x"}), None, (400, "Content-Type: expected application/json, got none")),
        (body({"client_id": "a", "prompt": ""}), "application/json",
         (400, "prompt: expected text of 1..2000 characters, got 0")),
        (body({"client_id": "a b", "prompt": "x"}), "application/json",
         (400, "client_id: expected the websocket clientId events go to")),
        (None, "application/json", (413, f"body: at most {PROTOCOL.max_open_body_bytes} bytes are accepted")),
    ],
    ids=["not-json", "not-an-object", "text-plain", "no-content-type", "empty-prompt", "bad-client-id", "too-big"],
)  # fmt: skip
def test_a_bad_open_body_is_refused_with_its_status_and_one_line(hosted, raw, content_type, expected):
    requests, service = hosted
    answer = requests.open(raw, content_type)
    status, start = expected
    assert answer.status == status and answer.body["error"].startswith(start), answer
    assert service.calls == []


def test_a_body_over_the_limit_is_refused_before_it_is_parsed(hosted):
    requests, service = hosted
    big = b" " * (PROTOCOL.max_body_bytes + 1)
    assert requests.control("s1", "good", big).status == 413
    assert requests.open(b" " * (PROTOCOL.max_open_body_bytes + 1)).status == 413
    assert requests.frames("s1", "good", b" " * (PROTOCOL.max_frames_body_bytes + 1)).status == 413
    assert service.calls == []


def test_content_type_parameters_are_accepted(hosted):
    requests, _ = hosted
    answer = requests.open(body({"client_id": "a", "prompt": "x"}), "application/json; charset=utf-8")
    assert answer.status == 201


@pytest.mark.parametrize("secret", [None, "", "wrong", "good "])
def test_no_or_a_wrong_secret_gets_the_same_answer_as_an_unknown_id(hosted, secret):
    requests, service = hosted
    refused = Answer(404, {"error": NO_SESSION})
    assert requests.control("s1", secret, body({"seed": 1})) == refused
    assert requests.control("s9", "good", body({"seed": 1})) == refused
    assert requests.frames("s1", secret, body({"frames": [PNG]})) == refused
    assert requests.payload("s1", secret, "0", "safetensors") == refused
    assert requests.close("s1", secret) == refused
    assert service.calls == []


def test_controls_frames_payloads_and_close_reach_the_session_with_its_secret(hosted):
    requests, service = hosted
    answer = requests.control(
        "s1", "good", body({"prompt": "a fox at night", "recache": True, "at_chunk": 3})
    )
    assert answer == Answer(202, {"control": 1, "kind": "prompt"})
    request = service.calls[-1][1]
    assert (request.kind, request.value, request.recache, request.at_chunk) == (
        "prompt",
        "a fox at night",
        True,
        3,
    )
    assert requests.frames("s1", "good", body({"frames": [PNG, PNG]})) == Answer(202, {"queued_frames": 2})
    assert service.calls[-1] == ("frames", [base64.b64decode(PNG)] * 2)
    assert requests.payload("s1", "good", "12", "webp") == Answer(200, b"bytes of webp", "image/webp")
    assert service.calls[-1] == ("payload", 12, "webp")
    assert requests.close("s1", "good") == Answer(200, {"closed": "s1"})


def test_the_services_refusal_keeps_its_status_and_names_the_field(hosted):
    requests, _ = hosted
    assert requests.control("s1", "good", body({"strength": 0.5})) == Answer(
        409, {"error": "strength: this session has no tiny VAE"}
    )
    answer = requests.control("s1", "good", body({"seed": 1, "stop": True}))
    assert answer == Answer(400, {"error": "control: expected exactly one of prompt, strength, seed, stop; got "
                                           "seed, stop"})  # fmt: skip
    answer = requests.frames("s1", "good", body({"frames": ["not base64!"]}))
    assert answer == Answer(400, {"error": "frames[0]: expected a base64 PNG or JPEG: not valid base64"})


@pytest.mark.parametrize("index", ["x", "-1", "1.5", "٣", "9" * 13, ""])
def test_a_chunk_name_that_is_no_index_is_answered_as_no_session(hosted, index):
    requests, service = hosted
    assert requests.payload("s1", "good", index, "webp") == Answer(404, {"error": NO_SESSION})
    assert service.calls == []


def test_stop_asks_the_running_node_to_stop(hosted):
    requests, service = hosted
    assert requests.stop() == Answer(200, {"stopping": ["7"]})
    assert service.stopped == ["stopped by POST /fewstep/live/stop"]


def test_a_session_is_looked_up_in_every_running_service():
    hosts, first, second = LiveHosts(), FakeService("1"), FakeService("2")

    def only_s2(session_id, secret):
        if (session_id, secret) != ("s2", "other"):
            raise LiveError(404, "", NO_SESSION)

    second._session = only_s2
    with hosts.hosting(first), hosts.hosting(second):
        requests = LiveRequests(hosts)
        assert requests.close("s2", "other") == Answer(200, {"closed": "s2"})
        assert requests.close("s1", "good") == Answer(200, {"closed": "s1"})
        assert requests.close("s2", "good").status == 404


def test_the_registry_is_empty_after_the_node_returns_or_raises():
    hosts = LiveHosts()
    with pytest.raises(KeyboardInterrupt), hosts.hosting(FakeService()):
        assert len(hosts) == 1
        raise KeyboardInterrupt
    assert len(hosts) == 0 and hosts.running() == []


# -- the websocket sender on a stand-in server ------------------------------------------------------------------


class FakeSocket:
    def __init__(self, loop):
        self.sent: list[dict] = []
        self.closed = False
        self.blocked = asyncio.Event()
        self.blocked.set()  # cleared: send_json waits, as aiohttp's does for a reader that does not read
        self.loop = loop

    async def send_json(self, message: dict) -> None:
        await self.blocked.wait()
        self.sent.append(message)


class FakeServer:
    """ComfyUI's PromptServer as the sender sees it: an event loop (in its own thread) and sockets by client id."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.sockets: dict[str, FakeSocket] = {}
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def on_loop(self, fn):
        done = threading.Event()
        out = []

        def call():
            out.append(fn())
            done.set()

        self.loop.call_soon_threadsafe(call)
        assert done.wait(10)
        return out[0]

    def connect(self, client_id: str) -> FakeSocket:
        ws = self.on_loop(lambda: FakeSocket(self.loop))
        self.sockets[client_id] = ws
        return ws

    def stop(self):
        async def cancel_the_senders():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_the_senders(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.stop()


def wait_for(condition, what: str) -> None:
    """Wait until ``condition()`` holds (the sender runs on another thread); a bound so a bug fails, not hangs."""
    done = threading.Event()
    for _ in range(1000):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_events_go_to_their_sessions_client_only(server):
    a, b = server.connect("A"), server.connect("B")
    transport = WebsocketTransport(server)
    assert transport.connected("A") and not transport.connected("C")
    box_a, box_b = SessionOutbox(8), SessionOutbox(8)
    transport.attach("s1", "A", box_a)
    transport.attach("s2", "B", box_b)
    box_a.put("fewstep.chunk", {"session": "s1", "chunk": 0}, droppable=True)
    box_b.put("fewstep.chunk", {"session": "s2", "chunk": 0}, droppable=True)
    box_a.put("fewstep.chunk", {"session": "s1", "chunk": 1}, droppable=True)
    wait_for(lambda: len(a.sent) == 2 and len(b.sent) == 1, "the events")
    assert a.sent == [{"type": "fewstep.chunk", "data": {"session": "s1", "chunk": i}} for i in (0, 1)]
    assert b.sent == [{"type": "fewstep.chunk", "data": {"session": "s2", "chunk": 0}}]
    transport.close()


def test_events_put_before_attach_are_sent_and_a_detached_session_sends_what_was_queued(server):
    a = server.connect("A")
    transport = WebsocketTransport(server)
    box = SessionOutbox(8)
    box.put("fewstep.session", {"state": "opened"})
    transport.attach("s1", "A", box)
    box.put("fewstep.session", {"state": "closed"})
    transport.detach("s1")
    wait_for(lambda: len(a.sent) == 2, "both events")
    assert [m["data"]["state"] for m in a.sent] == ["opened", "closed"]


def test_a_gone_clients_events_wait_for_its_reconnect_on_a_new_socket(server):
    transport = WebsocketTransport(server)
    box = SessionOutbox(8)
    transport.attach("s1", "A", box)  # A is not connected
    box.put("fewstep.chunk", {"chunk": 0}, droppable=True)
    assert not transport.connected("A")
    a = server.connect("A")  # reconnects: the next put wakes the sender
    box.put("fewstep.session", {"state": "resumed"})
    wait_for(lambda: len(a.sent) == 2, "the queued events")
    assert [m["type"] for m in a.sent] == ["fewstep.chunk", "fewstep.session"]
    transport.close()


def test_a_client_that_does_not_read_holds_up_only_its_own_events(server):
    slow, fast = server.connect("slow"), server.connect("fast")
    server.on_loop(slow.blocked.clear)
    transport = WebsocketTransport(server)
    slow_box, fast_box = SessionOutbox(3), SessionOutbox(3)
    transport.attach("s1", "slow", slow_box)
    transport.attach("s2", "fast", fast_box)
    for i in range(10):  # the putting thread never waits: the slow client's outbox drops its oldest chunks
        slow_box.put("fewstep.chunk", {"chunk": i}, droppable=True)
        fast_box.put("fewstep.chunk", {"chunk": i}, droppable=True)
        wait_for(lambda i=i: len(fast.sent) == i + 1, "the fast client's chunk")
    assert [m["data"]["chunk"] for m in fast.sent] == list(range(10))
    assert slow.sent == [] and slow_box.dropped > 0
    server.on_loop(slow.blocked.set)
    wait_for(lambda: len(slow_box) == 0, "the slow client to read")
    kinds = [m["type"] for m in slow.sent]
    assert "fewstep.stall" in kinds and slow.sent[-1]["data"] == {"chunk": 9}
    transport.close()


def test_a_chunk_no_longer_kept_is_said_so_to_the_sessions_owner_only(hosted):
    requests, _ = hosted
    assert requests.payload("s1", "good", "120", "webp") == Answer(
        404, {"error": "chunk: chunk 120 is not kept: a session keeps its newest 8 chunks (92..99)"}
    )
    assert requests.payload("s1", "wrong", "120", "webp") == Answer(404, {"error": NO_SESSION})
