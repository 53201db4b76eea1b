"""FewStep Live Video through a real ComfyUI server: the dummy live workflow queued once, two websocket clients each
steering its own session with its own control script while the node runs.

* each client's chunk latents (GET .../chunks/<n>.safetensors) equal an in-process engine SessionPool run with the
  same seed, the synthetic embedding of the same prompt texts and the same controls applied at the chunks the
  ``fewstep.control_applied`` events name;
* isolation: client B never gets an event of A's session; A's session, payloads and controls without its secret,
  with a wrong one or with B's are answered 404, exactly like an unknown id;
* a client that disconnects has its session suspended, and resumed when it reconnects with the same clientId; the
  video goes on equal to the engine's;
* POST /fewstep/live/stop ends the node cleanly and its report (the history's output) has each session's metrics;
  POST /interrupt ends it within one forward: the prompt ends interrupted and GET /fewstep/live is [] again.
"""

# ruff: noqa: F811 - the tests take the imported ``server`` fixture as an argument
from __future__ import annotations

import base64
import io
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch
from comfy_server import requires_comfyui, server  # noqa: F401

pytestmark = requires_comfyui
WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"
SHAPE = dict(width=48, height=32, chunk_frames=2, window_frames=6, sink_frames=1)
WAIT = 120  # seconds any one expected thing may take on a loaded CI machine (a bound, not an assertion)
NO_SESSION = {"error": "no live session with this id and secret"}


# -- the HTTP and websocket clients ---------------------------------------------------------------------------------


def http(server, method: str, path: str, body=None, secret: str | None = None, raw: bytes | None = None,
         content_type: str = "application/json"):  # fmt: skip
    """(status, JSON answer or bytes) of one request."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": content_type} if data is not None else {}
    if secret is not None:
        headers["X-FewStep-Secret"] = secret
    request = urllib.request.Request(server["url"] + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            status, payload, kind = r.status, r.read(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        status, payload, kind = err.code, err.read(), err.headers.get("Content-Type", "")
    return status, json.loads(payload) if kind.startswith("application/json") else payload


class Client:
    """A websocket client (clientId ``client_id``) collecting the fewstep.* events it is sent."""

    def __init__(self, server, client_id: str):
        import websocket  # websocket-client, in the test extra

        self.server, self.client_id = server, client_id
        url = server["url"].replace("http://", "ws://") + f"/ws?clientId={client_id}"
        self.ws = websocket.create_connection(url, timeout=WAIT)
        self.events: list[tuple[str, dict]] = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                message = self.ws.recv()
            except Exception:  # noqa: BLE001 - closed by close() or by the server
                return
            if not message:  # the socket closed (websocket-client answers an empty message then)
                return
            if isinstance(message, str):
                event = json.loads(message)
                if event.get("type", "").startswith("fewstep."):
                    with self.changed:
                        self.events.append((event["type"], event["data"]))
                        self.changed.notify_all()

    def wait_for(self, predicate, what: str):
        """The first collected event ``(type, data)`` for which ``predicate`` holds, waiting for it."""
        deadline = time.monotonic() + WAIT
        with self.changed:
            while True:
                found = next((e for e in self.events if predicate(*e)), None)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"{self.client_id}: no {what} in {WAIT} s; events: {self.events[-20:]}"
                    )
                self.changed.wait(left)

    def of(self, session: str, kind: str) -> list[dict]:
        with self.changed:
            return [d for t, d in self.events if t == kind and d.get("session") == session]

    def close(self) -> None:
        self.ws.close()
        self.reader.join(10)

    def open(self, **body) -> dict:
        status, answer = http(
            self.server, "POST", "/fewstep/live/sessions", {"client_id": self.client_id, **body}
        )
        assert status == 201, answer
        return answer


def session_state(client: Client, session: str, state: str):
    return client.wait_for(
        lambda t, d: t == "fewstep.session" and d.get("session") == session and d.get("state") == state,
        f"'{state}' event of {session}",
    )


# -- the node -----------------------------------------------------------------------------------------------------


def live_graph(**widgets) -> dict:
    graph = json.loads((WORKFLOWS / "live_video_dummy.api.json").read_text())
    live = next(n for n in graph.values() if n["class_type"] == "FewStepLiveVideo")
    live["inputs"].update(SHAPE, max_seconds=300.0, idle_seconds=120.0, disconnect_seconds=60.0, **widgets)
    return graph


def queue_live(server, **widgets) -> str:
    status, answer = http(server, "POST", "/prompt", {"prompt": live_graph(**widgets), "client_id": "queuer"})
    assert status == 200 and not answer.get("node_errors"), answer
    deadline = time.monotonic() + WAIT
    while http(server, "GET", "/fewstep/live")[1] == []:
        assert time.monotonic() < deadline, "the live node did not start"
        time.sleep(0.1)
    return answer["prompt_id"]


def finished(server, prompt_id: str) -> dict:
    """The prompt's history entry once it is written."""
    deadline = time.monotonic() + WAIT
    while True:
        entry = http(server, "GET", f"/history/{prompt_id}")[1].get(prompt_id)
        if entry and entry.get("status", {}).get("completed") is not None:
            return entry
        assert time.monotonic() < deadline, f"prompt {prompt_id} did not finish"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def live(server):
    """The live node of the module's tests, running (stopped at the end if a test left it running)."""
    prompt_id = queue_live(server)
    yield prompt_id
    if http(server, "GET", "/fewstep/live")[1]:
        http(server, "POST", "/fewstep/live/stop", {})
        finished(server, prompt_id)


# -- the engine's reference -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    """``run(prompt, seed, chunks, controls_at)``: the chunks' raw latents of an in-process SessionPool session
    (``controls_at``: chunk -> [(kind, value, recache)], queued before that chunk is made)."""
    from fewstep.engine import open_model
    from fewstep.engine.causal import CausalConfig, open_session_pool
    from fewstep.engine.prompt_embeddings import synthetic_text_embedding

    handle = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32)
    config = CausalConfig(chunk_frames=SHAPE["chunk_frames"], window_frames=SHAPE["window_frames"],
                          sink_frames=SHAPE["sink_frames"], schedule="wan-dmd-4step", steps=4)  # fmt: skip

    def embed(text: str) -> torch.Tensor:
        return synthetic_text_embedding(text, text_tokens=handle.params.text_len)

    def run(prompt: str, seed: int, chunks: int, controls_at: dict) -> list[torch.Tensor]:
        pool, _ = open_session_pool(handle, SHAPE["height"], SHAPE["width"], config, max_sessions=1)
        try:
            session = pool.join(embed(prompt), seed=seed, chunks=chunks)
            out = []
            for index in range(chunks):
                for kind, value, recache in controls_at.get(index, []):
                    pool.control(session, kind, embed(value) if kind == "prompt" else value, recache=recache)
                pool.tick()
                out.append(session.take().raw.float())
            return out
        finally:
            pool.close()

    with torch.inference_mode():
        yield run


def latents(client: Client, session: dict, index: int) -> torch.Tensor:
    from safetensors.torch import load

    path = f"/fewstep/live/sessions/{session['session']}/chunks/{index}.safetensors"
    status, payload = http(client.server, "GET", path, secret=session["secret"])
    assert status == 200, payload
    return load(bytes(payload))["latent"]


def close(client: Client, session: dict) -> None:
    """Close the session (it runs until closed: the generation is not paced, so a session of a fixed length could
    end before its controls arrive)."""
    sid = session["session"]
    assert http(client.server, "DELETE", f"/fewstep/live/sessions/{sid}", secret=session["secret"]) == (
        200, {"closed": sid})  # fmt: skip


def kept_latents(client: Client, session: dict) -> dict[int, torch.Tensor]:
    """Once the session is closed: the latents of the chunks it keeps (its newest 8), by index."""
    sid = session["session"]
    session_state(client, sid, "closed")
    made = client.of(sid, "fewstep.metrics")[-1]["chunks"]  # the closing metrics event is never dropped
    return {index: latents(client, session, index) for index in range(max(0, made - 8), made)}


def control(client: Client, session: dict, **body) -> int:
    status, answer = http(client.server, "POST", f"/fewstep/live/sessions/{session['session']}/control", body,
                          secret=session["secret"])  # fmt: skip
    assert status == 202, answer
    kind = answer["kind"]
    session.setdefault("sent", {})[answer["control"]] = (kind, body[kind], bool(body.get("recache", False)))
    return answer["control"]


def applied_controls(client: Client, session: dict) -> dict:
    """Wait until every control sent to the session was applied; chunk -> [(kind, value, recache)] as the
    session's control_applied events say."""
    sid, sent = session["session"], session["sent"]
    for sequence in sent:
        client.wait_for(lambda t, d, q=sequence: t == "fewstep.control_applied" and d.get("session") == sid
                        and d["control"] == q, f"control {sequence} applied")  # fmt: skip
    out: dict[int, list] = {}
    for event in client.of(sid, "fewstep.control_applied"):
        out.setdefault(event["chunk"], []).append(sent[event["control"]])
    return out


def chunk_after(client: Client, session: dict, index: int) -> int:
    """Wait for a chunk event of the session later than chunk ``index``; its index."""
    sid = session["session"]
    return client.wait_for(lambda t, d: t == "fewstep.chunk" and d.get("session") == sid and d["chunk"] > index,
                           f"a chunk after {index}")[1]["chunk"]  # fmt: skip


# -- the tests --------------------------------------------------------------------------------------------------------


def test_before_a_live_node_runs_the_status_is_empty_and_opening_is_refused(server):
    assert http(server, "GET", "/fewstep/live") == (200, [])
    assert http(server, "GET", "/api/fewstep/live") == (200, [])  # ComfyUI serves every route under /api too
    status, answer = http(server, "POST", "/fewstep/live/sessions", {"client_id": "x", "prompt": "a fox"})
    assert (status, answer) == (503, {"error": "no FewStep Live Video node is running: queue a workflow with one "
                                                "first"})  # fmt: skip


SCRIPTS = {
    "A": dict(prompt="a red fox running through snow", seed=3,
              controls=[dict(at_chunk=3, prompt="a red fox running through a forest", recache=True),
                        dict(at_chunk=6, seed=11)]),
    "B": dict(prompt="a corgi on a beach", seed=5,
              controls=[dict(at_chunk=2, prompt="a corgi in the waves"), dict(at_chunk=5, seed=2),
                        dict(at_chunk=9, prompt="a corgi at sunset", recache=True)]),
}  # fmt: skip


def test_two_clients_steer_their_own_sessions_and_get_the_engines_video(server, live, reference):
    status = http(server, "GET", "/fewstep/live")[1]
    assert len(status) == 1 and status[0]["prompt_id"] == live and "secret" not in json.dumps(status)
    clients = {name: Client(server, f"client-{name}-{uuid.uuid4().hex[:6]}") for name in SCRIPTS}
    try:
        sessions = {}
        for name, script in SCRIPTS.items():
            opened = clients[name].open(prompt=script["prompt"], seed=script["seed"], chunks=None)
            assert {"session", "secret", "width", "height", "chunk_frames", "node", "prompt_id"} <= set(
                opened
            )
            assert (opened["width"], opened["height"], opened["prompt_id"]) == (48, 32, live)
            sessions[name] = opened
            for c in script["controls"]:
                control(clients[name], opened, **c)
        applied = {}
        for name, client in clients.items():
            script, session = SCRIPTS[name], sessions[name]
            applied[name] = applied_controls(client, session)
            # every control took effect at its chunk or, sent after that chunk had started, at the next one
            kinds = sorted(kind for at in applied[name].values() for kind, _, _ in at)
            assert kinds == sorted(next(k for k in ("prompt", "seed") if k in c) for c in script["controls"])
        for name, client in clients.items():  # both closed soon after their controls: short references
            chunk_after(client, sessions[name], max(applied[name]))
            close(client, sessions[name])
        for name, client in clients.items():
            script, session = SCRIPTS[name], sessions[name]
            kept = kept_latents(client, session)
            assert max(kept) > max(applied[name])
            expected = reference(script["prompt"], script["seed"], max(kept) + 1, applied[name])
            for index, got in kept.items():
                assert got.shape == expected[index].shape and torch.equal(got, expected[index]), (name, index)
            chunks = client.of(session["session"], "fewstep.chunk")
            assert all(c["latents"].endswith(f"/chunks/{c['chunk']}.safetensors") for c in chunks)
        # isolation: no event of one client's session reached the other
        a, b = sessions["A"]["session"], sessions["B"]["session"]
        assert all(d.get("session") != a for _, d in clients["B"].events)
        assert all(d.get("session") != b for _, d in clients["A"].events)
    finally:
        for client in clients.values():
            client.close()


def test_a_session_without_its_secret_is_answered_as_an_unknown_one(server, live):
    owner, other = (
        Client(server, "owner-" + uuid.uuid4().hex[:6]),
        Client(server, "other-" + uuid.uuid4().hex[:6]),
    )
    try:
        mine = owner.open(prompt="a fox", seed=1, chunks=None)
        theirs = other.open(prompt="a corgi", seed=2, chunks=None)
        owner.wait_for(lambda t, d: t == "fewstep.chunk" and d.get("session") == mine["session"], "a chunk")
        sid = mine["session"]
        for secret in (None, "", "wrong", theirs["secret"]):
            assert http(server, "POST", f"/fewstep/live/sessions/{sid}/control", {"seed": 9}, secret=secret) == (
                404, NO_SESSION)  # fmt: skip
            assert http(server, "GET", f"/fewstep/live/sessions/{sid}/chunks/0.safetensors", secret=secret) == (
                404, NO_SESSION)  # fmt: skip
            assert http(server, "DELETE", f"/fewstep/live/sessions/{sid}", secret=secret) == (404, NO_SESSION)
        assert http(server, "POST", "/fewstep/live/sessions/s999/control", {"seed": 9}, secret=mine["secret"]) == (
            404, NO_SESSION)  # fmt: skip
        # bad bodies: the field named, the right status
        status, answer = http(server, "POST", f"/fewstep/live/sessions/{sid}/control", {"seed": -1},
                              secret=mine["secret"])  # fmt: skip
        assert (status, answer["error"]) == (400, "seed: expected an integer 0..9223372036854775807, got -1")
        status, answer = http(server, "POST", "/fewstep/live/sessions", raw=b"{}", content_type="text/plain")
        assert (status, answer) == (400, {"error": "Content-Type: expected application/json, got text/plain"})
        status, _ = http(server, "POST", "/fewstep/live/sessions", raw=b" " * (12 * 2**20))
        assert status == 413
        assert all(d.get("session") != sid for _, d in other.events)
        assert http(server, "DELETE", f"/fewstep/live/sessions/{sid}", secret=mine["secret"]) == (
            200,
            {"closed": sid},
        )
        assert (
            http(server, "DELETE", f"/fewstep/live/sessions/{theirs['session']}", secret=theirs["secret"])[0]
            == 200
        )
    finally:
        owner.close()
        other.close()


def png(width: int, height: int, color: tuple[int, int, int]) -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def test_jpeg_frames_clips_image_and_video_to_video_through_the_tiny_vae(server, live):
    client = Client(server, "viewer-" + uuid.uuid4().hex[:6])
    try:
        t2v = client.open(prompt="a fox", seed=1, chunks=2, jpeg=True, jpeg_quality=60)
        _, chunk = client.wait_for(lambda t, d: t == "fewstep.chunk" and d.get("session") == t2v["session"],
                                   "a chunk with JPEG frames")  # fmt: skip
        first, last = chunk["frames"]
        assert len(chunk["jpeg"]) == last - first + 1 and chunk["mode"] == "t2v"
        assert all(base64.b64decode(j).startswith(b"\xff\xd8") for j in chunk["jpeg"])
        status, clip = http(server, "GET", chunk["clip"], secret=t2v["secret"])
        assert status == 200 and clip[:4] == b"RIFF" and clip[8:12] == b"WEBP"
        # video to video: input frames (any size: scaled to cover 48x32 and center-cropped), a chunk's worth
        v2v = client.open(prompt="a watercolor fox", seed=2, chunks=1, strength=0.7)
        frames = [png(64, 64, (30 * i, 90, 200)) for i in range(v2v["frames_per_chunk"])]
        status, answer = http(server, "POST", f"/fewstep/live/sessions/{v2v['session']}/frames", {"frames": frames},
                              secret=v2v["secret"])  # fmt: skip
        assert (status, answer) == (202, {"queued_frames": len(frames)})
        _, chunk = client.wait_for(lambda t, d: t == "fewstep.chunk" and d.get("session") == v2v["session"],
                                   "a restyled chunk")  # fmt: skip
        assert chunk["mode"] == "v2v" and 0 < chunk["strength"] <= 0.7 and "jpeg" not in chunk, chunk
        session_state(client, v2v["session"], "closed")
        # image to video: the start image is the video's first frame, the first chunk's frames come after it
        i2v = client.open(prompt="a fox waking up", seed=3, chunks=1, start_image=png(96, 64, (200, 120, 40)))
        _, chunk = client.wait_for(lambda t, d: t == "fewstep.chunk" and d.get("session") == i2v["session"],
                                   "the chunk after the start image")  # fmt: skip
        assert chunk["chunk"] == 0 and chunk["frames"][0] == 1, chunk
    finally:
        client.close()


def test_a_client_that_disconnects_is_suspended_and_resumed_and_its_video_goes_on(server, live, reference):
    client_id = "wanderer-" + uuid.uuid4().hex[:6]
    client = Client(server, client_id)
    session = client.open(prompt="a fox in the rain", seed=21, chunks=None)
    sid = session["session"]
    client.wait_for(lambda t, d: t == "fewstep.chunk" and d.get("session") == sid, "a first chunk")
    client.close()  # gone: the service sees it at its next loop (one tick: milliseconds here) and suspends it
    time.sleep(
        2.0
    )  # long enough for that, and far from disconnect_seconds (60), which would close the session
    client = Client(server, client_id)  # back, with the same clientId
    try:
        session_state(client, sid, "resumed")
        states = [d["state"] for d in client.of(sid, "fewstep.session")]
        assert states.index("suspended") < states.index("resumed"), states
        before = max([c["chunk"] for c in client.of(sid, "fewstep.chunk")], default=0)
        chunk_after(client, session, before)  # the video goes on after the resume
        close(client, session)
        kept = kept_latents(client, session)
        expected = reference("a fox in the rain", 21, max(kept) + 1, {})
        for index, got in kept.items():
            assert torch.equal(got, expected[index]), index
    finally:
        client.close()


def test_stop_ends_the_node_and_its_report_has_each_sessions_metrics(server, live):
    status, answer = http(server, "POST", "/fewstep/live/stop", {})
    assert status == 200, answer
    entry = finished(server, live)
    assert entry["status"]["status_str"] == "success", entry["status"]
    (report,) = [o["text"][0] for o in entry["outputs"].values() if "text" in o][:1]
    for expected in ("first chunk", "inter-chunk p50", "p99", "realtime factor", "deadlines met", "viewer stalls",
                     "batch sizes"):  # fmt: skip
        assert expected in report, report
    assert http(server, "GET", "/fewstep/live") == (200, [])


def test_interrupt_ends_the_node_within_a_forward_and_frees_it(server):
    prompt_id = queue_live(server)
    client = Client(server, "interrupted-" + uuid.uuid4().hex[:6])
    try:
        session = client.open(prompt="a fox", seed=4, chunks=None)
        client.wait_for(
            lambda t, d: t == "fewstep.chunk" and d.get("session") == session["session"], "a chunk"
        )
        assert http(server, "POST", "/interrupt", {})[0] == 200
        entry = finished(server, prompt_id)
        messages = [m[0] for m in entry["status"].get("messages", [])]
        assert "execution_interrupted" in messages, entry["status"]
        assert http(server, "GET", "/fewstep/live") == (200, [])
        status, answer = http(server, "POST", "/fewstep/live/sessions", {"client_id": "x", "prompt": "a fox"})
        assert status == 503, answer
    finally:
        client.close()
