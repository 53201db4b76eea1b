"""FewStepLiveVideo serving in this process (no ComfyUI server): sessions opened and steered through the routes'
request handling (``LiveRequests`` on the node's ``LIVE_HOSTS``) with a recording transport. A session's latents
equal an engine SessionPool run with the same seed, prompt texts (synthetic embeddings) and controls; stop, a
limit and Cancel each end the node, which unregisters and frees its pool."""

from __future__ import annotations

import json
import sys
import threading
from collections import defaultdict

import pytest
import torch
from test_live_node import TINY, serve
from test_nodes import _run

from fewstep.engine.causal import CausalConfig, open_session_pool
from fewstep.engine.prompt_embeddings import synthetic_text_embedding

WAIT = 120.0  # a bound on waiting for the generation thread, never an assertion on time


@pytest.fixture(scope="module")
def wan(pack):
    (model,) = _run(pack.NODE_CLASS_MAPPINGS["FewStepDiTLoader"], model_name="dummy:wan-tiny")
    return model


def live_module(pack):
    return sys.modules[f"{pack.__name__}.nodes.live"]


class RecordingTransport:
    """Events of each client in order, drained on the putting thread; ``clients``: who is connected."""

    def __init__(self, clients=()):
        self.clients = set(clients)
        self.events: dict[str, list[tuple[str, dict]]] = defaultdict(list)
        self.changed = threading.Condition()
        self._outboxes: dict[str, tuple[str, object]] = {}

    def connected(self, client_id: str) -> bool:
        return client_id in self.clients

    def attach(self, session_id, client_id, outbox) -> None:
        self._outboxes[session_id] = (client_id, outbox)
        outbox.set_listener(lambda: self._drain(session_id))
        self._drain(session_id)

    def detach(self, session_id) -> None:
        self._drain(session_id)

    def close(self) -> None:
        pass

    def _drain(self, session_id) -> None:
        client_id, outbox = self._outboxes[session_id]
        with self.changed:
            while (item := outbox.pop()) is not None:
                self.events[client_id].append(item)
            self.changed.notify_all()

    def wait_for(self, client_id: str, predicate, what: str) -> tuple[str, dict]:
        with self.changed:
            assert self.changed.wait_for(lambda: any(predicate(*e) for e in self.events[client_id]), WAIT), (
                f"no {what}: {self.events[client_id][-10:]}"
            )
            return next(e for e in self.events[client_id] if predicate(*e))


class Running:
    """The node serving on a thread; ``result`` / ``error`` once it returned."""

    def __init__(self, pack, monkeypatch, transport, **inputs):
        live = live_module(pack)
        self.pools = []
        opener = live.open_session_pool

        def recording_opener(*args, **kwargs):
            pool, compiled = opener(*args, **kwargs)
            self.pools.append(pool)
            return pool, compiled

        monkeypatch.setattr(live, "open_session_pool", recording_opener)
        monkeypatch.setattr(live, "make_transport", lambda: transport)
        # the pack's own import (ComfyUI's module name): its LiveError is the one the service raises
        self.requests = sys.modules[f"{pack.__name__}.nodes.live_routes"].LiveRequests(live.LIVE_HOSTS)
        self.hosts = live.LIVE_HOSTS
        self.result = self.error = None
        self.thread = threading.Thread(target=self._run, args=(pack, inputs), daemon=True)
        self.thread.start()
        started = threading.Event()
        while not len(self.hosts) and self.thread.is_alive():
            started.wait(0.01)

    def _run(self, pack, inputs) -> None:
        try:
            self.result = serve(pack, **inputs)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            self.error = err

    def join(self) -> None:
        self.thread.join(WAIT)
        assert not self.thread.is_alive(), "the node did not return"
        # nothing of the run is left running: the service's own threads ended with it
        assert [t.name for t in threading.enumerate() if t.name.startswith("fewstep-live")] == []

    def open(self, client_id: str, **body) -> dict:
        answer = self.requests.open(json.dumps({"client_id": client_id, **body}).encode())
        assert answer.status == 201, answer
        return answer.body

    def control(self, session: dict, **body) -> dict:
        answer = self.requests.control(session["session"], session["secret"], json.dumps(body).encode())
        assert answer.status == 202, answer
        return answer.body


def reference(wan, prompt: str, seed: int, chunks: int, controls_at: dict) -> list[torch.Tensor]:
    """The raw latents of an engine SessionPool session, ``controls_at`` (chunk -> [(kind, value, recache)])
    queued before that chunk."""
    config = CausalConfig(chunk_frames=TINY["chunk_frames"], window_frames=TINY["window_frames"],
                          sink_frames=TINY["sink_frames"], schedule="wan-dmd-4step", steps=4)  # fmt: skip

    def embed(text: str) -> torch.Tensor:
        return synthetic_text_embedding(text, text_tokens=wan.params.text_len)

    pool, _ = open_session_pool(wan, TINY["height"], TINY["width"], config, max_sessions=1)
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


def latents(running: Running, session: dict, index: int) -> torch.Tensor:
    from safetensors.torch import load

    answer = running.requests.payload(session["session"], session["secret"], str(index), "safetensors")
    assert answer.status == 200, answer
    return load(answer.body)["latent"]


def test_a_steered_session_gets_the_engines_video_and_stop_returns_the_report(pack, monkeypatch, wan):
    transport = RecordingTransport({"A", "B"})
    running = Running(pack, monkeypatch, transport, model=wan, **TINY, idle_seconds=0.0, max_seconds=600.0)
    script = dict(prompt="a red fox running through snow", seed=3, chunks=5)
    session = running.open("A", **script)
    other = running.open("B", prompt="a corgi", seed=1, chunks=3)
    sent = {}
    for body in (dict(at_chunk=2, prompt="a red fox in a forest", recache=True), dict(at_chunk=3, seed=11)):
        answer = running.control(session, **body)
        kind = answer["kind"]
        sent[answer["control"]] = (kind, body[kind], body.get("recache", False))
    for client, s in (("A", session), ("B", other)):
        transport.wait_for(client, lambda t, d, s=s: t == "fewstep.session" and d["session"] == s["session"]
                           and d["state"] == "closed", "closed event")  # fmt: skip
    applied: dict[int, list] = {}
    for event, data in transport.events["A"]:
        if event == "fewstep.control_applied":
            applied.setdefault(data["chunk"], []).append(sent[data["control"]])
    assert sorted(k for at in applied.values() for k, _, _ in at) == ["prompt", "seed"]
    chunks = [d["chunk"] for e, d in transport.events["A"] if e == "fewstep.chunk"]
    assert chunks == list(range(5))
    with torch.inference_mode():
        expected = reference(wan, script["prompt"], script["seed"], script["chunks"], applied)
    for index, want in enumerate(expected):
        assert torch.equal(latents(running, session, index), want), index
    assert all(d["session"] != session["session"] for _, d in transport.events["B"])  # B saw only its own
    assert running.requests.stop().status == 200
    running.join()
    assert running.error is None, running.error
    report = running.result["result"][0]
    assert running.result["ui"]["text"] == [report]
    assert report.startswith("live run stopped: stopped by POST /fewstep/live/stop;"), report
    line = next(x for x in report.splitlines() if x.startswith("session 1 (seed 3): 5 chunks"))
    for metric in ("first chunk", "inter-chunk p50", "p99", "realtime factor", "deadlines met", "viewer stalls",
                   "batch sizes"):  # fmt: skip
        assert metric in line, line
    assert len(running.hosts) == 0 and running.pools[0].closed and running.pools[0].nbytes == 0


def test_a_limit_ends_the_node_by_itself(pack, monkeypatch, wan):
    transport = RecordingTransport({"A"})
    running = Running(pack, monkeypatch, transport, model=wan, **TINY, max_chunks=2, idle_seconds=0.0)
    running.open("A", prompt="a fox", seed=0, chunks=None)
    running.join()
    assert running.error is None, running.error
    assert len(running.hosts) == 0 and running.pools[0].closed


class CancelledError(Exception):
    """Stands for ComfyUI's InterruptProcessingException."""


def test_cancel_stops_the_node_and_frees_its_pool(pack, monkeypatch, wan):
    live = live_module(pack)
    cancel = threading.Event()

    def check_interrupt():
        if cancel.is_set():
            raise CancelledError

    monkeypatch.setattr(live, "check_interrupt", check_interrupt)
    transport = RecordingTransport({"A"})
    running = Running(pack, monkeypatch, transport, model=wan, **TINY, idle_seconds=0.0, max_seconds=600.0)
    session = running.open("A", prompt="a fox", seed=0, chunks=None)
    transport.wait_for("A", lambda t, d: t == "fewstep.chunk", "a chunk")
    cancel.set()
    running.join()
    assert isinstance(running.error, CancelledError), running.error
    assert len(running.hosts) == 0 and running.pools[0].closed and running.pools[0].nbytes == 0
    assert running.requests.control(session["session"], session["secret"], b'{"seed": 1}').status == 503


def test_sessions_are_bounded_per_client_and_per_node(pack, monkeypatch, wan):
    transport = RecordingTransport({"A", "B", "C"})
    running = Running(pack, monkeypatch, transport, model=wan, **TINY, max_sessions=2, max_sessions_per_client=1,
                      idle_seconds=0.0, max_seconds=600.0)  # fmt: skip
    try:
        running.open("A", prompt="a fox", seed=0, chunks=None)
        refused = running.requests.open(json.dumps({"client_id": "A", "prompt": "a fox"}).encode())
        assert refused.status == 429 and refused.body["error"].startswith(
            "client_id: this client has 1 open sessions; at most 1 per client"
        ), refused
        running.open("B", prompt="a corgi", seed=0, chunks=None)
        refused = running.requests.open(json.dumps({"client_id": "C", "prompt": "a cat"}).encode())
        assert (
            refused.status == 429
            and "all 2 session slots of this live node are taken" in refused.body["error"]
        )
        assert running.requests.status().body[0]["free_slots"] == 0
    finally:
        running.requests.stop()
        running.join()
    assert running.error is None, running.error
