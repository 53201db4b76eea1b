"""LiveService on wan-tiny (CPU fp32) with an in-process transport.

The key guarantee: two live sessions steered by control scripts (prompt switches with and without a re-cache, a
reseed, controls scheduled at chunks, a stop) make latents EQUAL (torch.equal) to a plain SessionPool run whose
driver calls pool.control before the same chunks, and to solo VideoSession runs. Then: secrets, isolation of the
events, event contents, limits, disconnects, Cancel, and flat bookkeeping over many sessions.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from fewstep.engine import InputError, load_dit, load_tiny_vae
from fewstep.engine.causal import CausalConfig, VideoSession
from fewstep.engine.causal.session_pool import SessionPool
from fewstep.engine.latent_formats import WAN21
from fewstep.engine.live import LiveError, LiveLimits, LiveService, SessionOutbox
from fewstep.engine.live.media import raw_latents_of
from fewstep.engine.prompt_embeddings import synthetic_text_embedding

H, W = 32, 48
CONFIG = CausalConfig(chunk_frames=2, window_frames=6, sink_frames=1)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """wan-tiny's GEMMs are tiny: a second intra-op thread only spins on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def wan():
    return load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=2)


@pytest.fixture(scope="module")
def taew():
    return load_tiny_vae("dummy:taew2_1", device="cpu", dtype=torch.float32)


class FakeTransport:
    """Clients in this process: connected unless the test says otherwise; the outboxes kept for the test."""

    def __init__(self):
        self.gone: set[str] = set()
        self.outboxes: dict[str, SessionOutbox] = {}
        self.attached: list[tuple[str, str]] = []
        self.detached: list[str] = []
        self.on_check = None  # called by connected(): lets a test act from inside the serve loop

    def connected(self, client_id: str) -> bool:
        if self.on_check is not None:
            self.on_check()
        return client_id not in self.gone

    def attach(self, session_id, client_id, outbox):
        self.attached.append((session_id, client_id))
        self.outboxes[session_id] = outbox

    def detach(self, session_id):
        self.detached.append(session_id)


def encoder_for(model):
    return lambda text: synthetic_text_embedding(text, text_tokens=model.params.text_len)


def make_service(wan, transport, tiny_vae=None, fps=16.0, slots=4, **limits):
    pool = SessionPool(wan, H, W, CONFIG, max_sessions=slots, buckets=(1, 2, 4), tiny_vae=tiny_vae, fps=fps)
    limits.setdefault("idle_seconds", 0.0)  # the run ends once its sessions are done
    limits.setdefault("max_events_queued", 64)
    return LiveService(pool, transport, encoder_for(wan), LiveLimits(**limits), tiny_vae=tiny_vae,
                       tags={"node": "7", "prompt_id": "p1"})  # fmt: skip


def drain(outbox: SessionOutbox) -> list[tuple[str, dict]]:
    out = []
    while (item := outbox.pop()) is not None:
        out.append(item)
    return out


# Two control scripts (the format `stream --script` and `live` read, as request bodies): controls by chunk.
SCRIPT_A = {
    "prompt": "a red fox running through snow", "seed": 3, "chunks": 5,
    "controls": [
        {"chunk": 1, "prompt": "a red fox running through a forest", "recache": True},
        {"chunk": 2, "prompt": "a red fox at night"},
        {"chunk": 3, "seed": 11},
    ],
}  # fmt: skip
SCRIPT_B = {
    "prompt": "a city street at dusk", "seed": 4, "chunks": 6,
    "controls": [
        {"chunk": 0, "prompt": "a city street in the rain"},
        {"chunk": 2, "seed": 9},
        {"chunk": 3, "prompt": "a city street at dawn", "recache": True},
        {"chunk": 4, "stop": True},
    ],
}  # fmt: skip


def open_script(service, script, client):
    answer = service.open({"client_id": client, "prompt": script["prompt"], "seed": script["seed"],
                           "chunks": script["chunks"]})  # fmt: skip
    sequences = []
    for control in script["controls"]:
        body = {k: v for k, v in control.items() if k != "chunk"}
        body["at_chunk"] = control["chunk"]
        sequences.append(service.control(answer["session"], answer["secret"], body)["control"])
    return answer, sequences


def reference_pool_run(wan, scripts, tiny_vae=None):
    """The same scripts on a plain SessionPool: the driver calls pool.control before each script's chunks."""
    pool = SessionPool(wan, H, W, CONFIG, max_sessions=4, buckets=(1, 2, 4), tiny_vae=tiny_vae)
    encode = encoder_for(wan)
    sessions = [pool.join(encode(s["prompt"]), seed=s["seed"], chunks=s["chunks"]) for s in scripts]
    got = [[] for _ in scripts]
    stopped = set()
    while True:
        for i, (script, session) in enumerate(zip(scripts, sessions)):
            if i in stopped or session.state != "active":
                continue
            n = session.stats.chunks_generated
            for control in script["controls"]:
                if control["chunk"] != n:
                    continue
                if control.get("stop"):
                    pool.leave(session, "stopped")
                    stopped.add(i)
                elif "prompt" in control:
                    pool.control(session, "prompt", encode(control["prompt"]), control.get("recache", False))
                else:
                    pool.control(session, "seed", control["seed"])
        if not pool.ready():
            break
        report = pool.tick()
        for i, session in enumerate(sessions):
            chunk = report.chunks.get(session.key)
            if chunk is not None:
                got[i].append(chunk)
                session.take()
    pool.close()
    return got


def solo_run(wan, script, tiny_vae=None):
    encode = encoder_for(wan)
    session = VideoSession(wan, encode(script["prompt"]), H, W, CONFIG, script["seed"], tiny_vae)
    out = []
    for i in range(script["chunks"]):
        controls = [c for c in script["controls"] if c["chunk"] == i]
        if any(c.get("stop") for c in controls):
            break
        for c in controls:
            if "prompt" in c:
                session.control("prompt", encode(c["prompt"]), c.get("recache", False))
            else:
                session.control("seed", c["seed"])
        out += session.run(1)
    return out


def live_latents(service, answer, chunks):
    return [raw_latents_of(service.payload(answer["session"], answer["secret"], n, "safetensors")[0])
            for n in range(chunks)]  # fmt: skip


def test_two_live_sessions_equal_a_plain_pool_run_and_their_solo_runs(wan, taew):
    transport = FakeTransport()
    service = make_service(wan, transport, tiny_vae=taew)
    a, seq_a = open_script(service, SCRIPT_A, "client-a")
    b, seq_b = open_script(service, SCRIPT_B, "client-b")
    report = service.serve()
    assert report.chunks == 5 + 4
    assert report.why_stopped == "no session for 0 s (idle_seconds)"

    reference = reference_pool_run(wan, [SCRIPT_A, SCRIPT_B], taew)
    assert [len(r) for r in reference] == [5, 4]
    for answer, ref, script in ((a, reference[0], SCRIPT_A), (b, reference[1], SCRIPT_B)):
        got = live_latents(service, answer, len(ref))
        solo = solo_run(wan, script, taew)
        assert len(solo) == len(ref)
        for n, (latents, chunk, alone) in enumerate(zip(got, ref, solo)):
            assert torch.equal(latents, WAN21.process_out(chunk.latents)), (answer["session"], n)
            assert torch.equal(chunk.latents, alone.latents), (answer["session"], n)
        clip = service.payload(answer["session"], answer["secret"], 0, "webp")
        assert clip[1] == "image/webp" and clip[0][:4] == b"RIFF"

    events_a, events_b = drain(transport.outboxes[a["session"]]), drain(transport.outboxes[b["session"]])
    # events of a session only ever in its own outbox
    assert {d["session"] for _, d in events_a} == {a["session"]}
    assert {d["session"] for _, d in events_b} == {b["session"]}
    assert all(d["node"] == "7" and d["prompt_id"] == "p1" for _, d in events_a + events_b)

    kinds_a = [e for e, _ in events_a if e != "fewstep.metrics"]
    assert kinds_a[0] == "fewstep.session" and kinds_a[-1] == "fewstep.session"
    assert [d["chunk"] for e, d in events_a if e == "fewstep.chunk"] == [0, 1, 2, 3, 4]
    applied = [d for e, d in events_a if e == "fewstep.control_applied"]
    assert [(d["control"], d["kind"], d["chunk"], d["recache"]) for d in applied] == [
        (seq_a[0], "prompt", 1, True), (seq_a[1], "prompt", 2, False), (seq_a[2], "seed", 3, False),
    ]  # fmt: skip
    assert (
        applied[0]["recache_frames"] == 2 and applied[1]["recache_frames"] == 0
    )  # chunk 0's frames re-cached
    opened, closed = events_a[0][1], events_a[-1][1]
    assert (opened["state"], closed["state"], closed["why"]) == ("opened", "closed", "its 5 chunks are done")
    assert events_a[-2][0] == "fewstep.metrics" and events_a[-2][1]["chunks"] == 5

    chunk = next(d for e, d in events_a if e == "fewstep.chunk" and d["chunk"] == 1)
    sid = a["session"]
    assert chunk["clip"] == f"/fewstep/live/sessions/{sid}/chunks/1.webp"
    assert chunk["latents"] == f"/fewstep/live/sessions/{sid}/chunks/1.safetensors"
    assert chunk["frames"] == [5, 12] and chunk["chunks"] == 5 and chunk["files"] == []
    assert chunk["mode"] == "t2v" and chunk["strength"] is None and chunk["batch"] in (1, 2)
    assert "jpeg" not in chunk

    stop = [d for e, d in events_b if e == "fewstep.control_applied" and d["kind"] == "stop"]
    assert [(d["control"], d["chunk"]) for d in stop] == [(seq_b[3], 4)]
    assert events_b[-1][1]["why"] == "stopped by its client"
    assert [d["chunk"] for e, d in events_b if e == "fewstep.chunk"] == [0, 1, 2, 3]
    assert sorted(transport.detached) == sorted([a["session"], b["session"]])
    assert [s["index"] for s in report.sessions] == [2, 1]  # B stopped before A's last chunk
    text = report.text()
    assert "session 1 (seed 3): 5 chunks, closed: its 5 chunks are done" in text
    assert a["secret"] not in text and a["session"] not in text


def test_the_open_answer_and_public_status(wan):
    service = make_service(wan, FakeTransport(), max_sessions_per_client=1)
    answer = service.open({"client_id": "c1", "prompt": "x"})
    assert set(answer) == {"session", "secret", "width", "height", "chunk_frames", "frames_per_chunk", "fps", "controls",
                           "node", "prompt_id"}  # fmt: skip
    assert (answer["width"], answer["height"], answer["chunk_frames"], answer["frames_per_chunk"]) == (
        48,
        32,
        2,
        8,
    )
    assert len(answer["secret"]) >= 43 and len(answer["session"]) == 16
    status = service.status()
    assert status == {"node": "7", "prompt_id": "p1", "width": 48, "height": 32, "chunk_frames": 2, "fps": 16.0,
                      "slots": 4, "sessions": 1, "free_slots": 3, "max_sessions_per_client": 1}  # fmt: skip
    assert answer["session"] not in str(status) and answer["secret"] not in str(status)
    with pytest.raises(LiveError) as err:
        service.open({"client_id": "c1", "prompt": "y"})
    assert err.value.status == 429
    assert (
        err.value.text == "client_id: this client has 1 open sessions; at most 1 per client: close one first"
    )
    service.close(answer["session"], answer["secret"])  # counts no more at once (closes apply before joins)
    service.open({"client_id": "c1", "prompt": "y"})
    assert service.status()["sessions"] == 2  # until the serve loop applies the close
    service.stop()
    report = service.serve()
    assert report.why_stopped == "stopped by a client" and service.status()["slots"] == 0


def test_the_pool_slots_bound_the_sessions(wan):
    service = make_service(wan, FakeTransport(), slots=2, max_sessions_per_client=4)
    service.open({"client_id": "c", "prompt": "x"})
    service.open({"client_id": "c", "prompt": "x"})
    with pytest.raises(LiveError) as err:
        service.open({"client_id": "d", "prompt": "x"})
    assert (err.value.status, err.value.text) == (
        429,
        "all 2 session slots of this live node are taken; try again later",
    )
    service.stop()
    service.serve()


def test_a_wrong_secret_and_an_unknown_id_get_one_identical_404(wan):
    service = make_service(wan, FakeTransport())
    answer = service.open({"client_id": "c", "prompt": "x"})
    sid, secret = answer["session"], answer["secret"]
    errors = []
    for call in (
        lambda: service.control(sid, secret[:-1] + ("A" if secret[-1] != "A" else "B"), {"seed": 1}),
        lambda: service.control("no-such-id", secret, {"seed": 1}),
        lambda: service.control(sid, None, {"seed": 1}),
        lambda: service.payload(sid, "", 0, "safetensors"),
        lambda: service.feed_frames(sid, "é", [b"x"]),
        lambda: service.close(sid, "wrong"),
    ):
        with pytest.raises(LiveError) as err:
            call()
        errors.append((err.value.status, err.value.answer()))
    assert errors == [(404, {"error": "no live session with this id and secret"})] * 6
    service.stop()
    service.serve()


def test_bad_bodies_are_refused_with_the_field_named(wan):
    service = make_service(wan, FakeTransport())
    cases = [
        ({"client_id": "c", "prompt": ""}, 400, "prompt: expected text of 1..2000 characters, got 0"),
        ({"client_id": "c d", "prompt": "x"}, 400, "client_id: expected the websocket clientId events go to: "
         "1..128 characters of A-Z a-z 0-9 _ -, got 'c d'"),
        ({"client_id": "c", "prompt": "x", "seed": -1}, 400, "seed: expected an integer 0..9223372036854775807, got -1"),
        ({"client_id": "c", "prompt": "x", "colour": 1}, 400, "colour: unknown field; expected client_id, prompt, "
         "seed, chunks, start_image, strength, jpeg, jpeg_quality, controls"),
        ({"client_id": "c", "prompt": "x", "start_image": "iVBORw0KGgo="}, 400,
         "start_image: image to video needs the live node's tiny VAE with its encoder (taew2_1); connect one"),
        ({"client_id": "c", "prompt": "x", "strength": 0.5}, 400,
         "strength: video to video needs the live node's tiny VAE with its encoder (taew2_1); connect one"),
    ]  # fmt: skip
    for body, status, text in cases:
        with pytest.raises(LiveError) as err:
            service.open(body)
        assert (err.value.status, err.value.text) == (status, text)
    answer = service.open({"client_id": "c", "prompt": "x"})
    for body, text in (
        (
            {"seed": 1, "stop": True},
            "control: expected exactly one of prompt, strength, seed, stop; got seed, stop",
        ),
        ({"seed": 1, "recache": True}, "recache: only goes with a prompt"),
        ({"stop": False}, "stop: expected true, got False"),
        ({"seed": 1, "at_chunk": -1}, "at_chunk: expected an integer >= 0, got -1"),
    ):
        with pytest.raises(LiveError) as err:
            service.control(answer["session"], answer["secret"], body)
        assert (err.value.status, err.value.text) == (400, text)
    service.stop()
    service.serve()


def test_scheduled_controls_are_bounded_per_session(wan):
    service = make_service(wan, FakeTransport())
    answer = service.open({"client_id": "c", "prompt": "x"})
    for i in range(64):
        service.control(answer["session"], answer["secret"], {"seed": i, "at_chunk": 100 + i})
    with pytest.raises(LiveError) as err:
        service.control(answer["session"], answer["secret"], {"seed": 1, "at_chunk": 500})
    assert err.value.status == 429 and err.value.text == (
        "control: 64 controls of this session wait for their chunk; at most 64"
    )
    service.stop()
    service.serve()


def test_a_newer_control_of_a_kind_replaces_an_older_one_due_at_the_same_boundary(wan):
    transport = FakeTransport()
    service = make_service(wan, transport)
    answer = service.open({"client_id": "c", "prompt": "x", "chunks": 2})
    sid, secret = answer["session"], answer["secret"]
    first = service.control(sid, secret, {"seed": 5, "at_chunk": 1})["control"]
    second = service.control(sid, secret, {"seed": 6})["control"]  # due at once: applied at chunk 0
    third = service.control(sid, secret, {"seed": 7, "at_chunk": 1})["control"]
    service.serve()
    applied = [d for e, d in drain(transport.outboxes[sid]) if e == "fewstep.control_applied"]
    assert [(d["control"], d["chunk"], d["replaced"]) for d in applied] == [(second, 0, 0), (third, 1, 1)]
    assert first < second < third
    # the same as a pool driven by hand
    reference = reference_pool_run(wan, [{"prompt": "x", "seed": 0, "chunks": 2,
                                          "controls": [{"chunk": 0, "seed": 6}, {"chunk": 1, "seed": 7}]}])  # fmt: skip
    for n, chunk in enumerate(reference[0]):
        assert torch.equal(live_latents(service, answer, 2)[n], WAN21.process_out(chunk.latents))


def test_deadline_missed_events_and_jpeg_frames(wan, taew):
    transport = FakeTransport()
    service = make_service(wan, transport, tiny_vae=taew, fps=1e9)  # every deadline is a nanosecond
    answer = service.open({"client_id": "c", "prompt": "x", "chunks": 2, "jpeg": True, "jpeg_quality": 50})
    service.serve()
    events = drain(transport.outboxes[answer["session"]])
    missed = [d for e, d in events if e == "fewstep.deadline_missed"]
    assert [d["chunk"] for d in missed] == [0, 1]
    assert missed[0]["deadline"] == round(5 / 1e9, 4) and missed[0]["latency"] >= 0
    chunks = [d for e, d in events if e == "fewstep.chunk"]
    assert [d["deadline_met"] for d in chunks] == [False, False]
    assert [len(d["jpeg"]) for d in chunks] == [5, 8]  # the first chunk of a video is 3 frames shorter
    import base64

    assert base64.b64decode(chunks[0]["jpeg"][0])[:2] == b"\xff\xd8"
    assert [d["frames"] for d in chunks] == [[0, 4], [5, 12]]


def test_a_gone_client_is_suspended_resumed_and_closed_after_disconnect_seconds(wan):
    transport = FakeTransport()
    service = make_service(wan, transport, disconnect_seconds=3600.0)
    answer = service.open({"client_id": "c", "prompt": "x", "chunks": 3})
    reference = reference_pool_run(wan, [{"prompt": "x", "seed": 0, "chunks": 3, "controls": []}])[0]
    sid = answer["session"]
    outbox = transport.outboxes[sid]
    seen: list[str] = []
    phase = {"n": 0}

    def on_check():  # inside the serve loop: a client that leaves once chunk 0 is made and comes back
        events = drain(outbox)
        seen.extend(f"{e}:{d.get('state', d.get('chunk', ''))}" for e, d in events if e != "fewstep.metrics")
        live = service._sessions[sid]  # what the serve thread knows (the events reach the outbox later)
        if phase["n"] == 0 and live.chunks == 1:
            transport.gone.add("c")
            phase["n"] = 1
        elif phase["n"] == 1 and live.suspended:
            phase["n"] = 2
        elif phase["n"] == 2:
            transport.gone.discard("c")
            phase["n"] = 3

    transport.on_check = on_check
    service.serve()
    seen.extend(
        f"{e}:{d.get('state', d.get('chunk', ''))}" for e, d in drain(outbox) if e != "fewstep.metrics"
    )
    assert seen == ["fewstep.session:opened", "fewstep.chunk:0", "fewstep.session:suspended",
                    "fewstep.session:resumed", "fewstep.chunk:1", "fewstep.chunk:2", "fewstep.session:closed"]  # fmt: skip
    for n, chunk in enumerate(reference):  # a suspend / resume continues the video exactly
        assert torch.equal(live_latents(service, answer, 3)[n], WAN21.process_out(chunk.latents))

    transport = FakeTransport()
    service = make_service(wan, transport, disconnect_seconds=0.0)
    answer = service.open({"client_id": "gone", "prompt": "x"})
    transport.gone.add("gone")
    report = service.serve()
    assert report.sessions[0]["why"] == "its client was gone for 0 s"


def test_check_cancel_closes_every_session_frees_the_pool_and_re_raises(wan):
    transport = FakeTransport()
    service = make_service(wan, transport)
    answers = [service.open({"client_id": f"c{i}", "prompt": "x"}) for i in range(2)]
    forwards = {"n": 0}

    class CancelledByTestError(Exception):
        pass

    def check_cancel():
        forwards["n"] += 1
        if forwards["n"] > 6:
            raise CancelledByTestError

    pool = service.pool
    with pytest.raises(CancelledByTestError):
        service.serve(check_cancel)
    assert pool.closed and pool.sessions == {}
    for answer in answers:
        events = drain(transport.outboxes[answer["session"]])
        assert events[-1] == ("fewstep.session", {"session": answer["session"], "node": "7", "prompt_id": "p1",
                                                  "state": "closed", "why": "the live node was cancelled"})  # fmt: skip
    assert service.status()["sessions"] == 0
    with pytest.raises(LiveError) as err:
        service.open({"client_id": "c", "prompt": "x"})
    assert err.value.status == 503


def test_limits_stop_the_run(wan):
    service = make_service(wan, FakeTransport(), max_chunks=3)
    service.open({"client_id": "c", "prompt": "x"})
    report = service.serve()
    assert report.why_stopped == "max_chunks reached (3 chunks)" and report.chunks == 3
    assert report.sessions[0]["why"] == "max_chunks reached (3 chunks)"

    service = make_service(wan, FakeTransport(), max_seconds=0.0)
    assert service.serve().why_stopped == "max_seconds reached (0 s)"


def test_a_stop_from_another_thread_ends_a_serving_run(wan):
    service = make_service(wan, FakeTransport(), idle_seconds=None)
    service.open({"client_id": "c", "prompt": "x"})
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("report", service.serve()))
    thread.start()
    deadline = time.monotonic() + 30
    while not service.serving and time.monotonic() < deadline:
        time.sleep(0.01)
    service.stop("stopped by the test")
    thread.join(30)
    assert not thread.is_alive() and result["report"].why_stopped == "stopped by the test"


def test_closed_sessions_answer_409_to_controls_keep_their_payloads_and_close_again_quietly(wan):
    service = make_service(wan, FakeTransport())
    answer = service.open({"client_id": "c", "prompt": "x", "chunks": 1})
    sid, secret = answer["session"], answer["secret"]
    service.serve()
    with pytest.raises(LiveError) as err:
        service.control(sid, secret, {"seed": 1})
    assert (err.value.status, err.value.text) == (409, "this session is closed (its 1 chunks are done)")
    assert service.payload(sid, secret, 0, "safetensors")[1] == "application/octet-stream"
    with pytest.raises(LiveError) as err:
        service.payload(sid, secret, 0, "webp")
    assert (err.value.status, err.value.text) == (
        404,
        "chunk: no clip: the live node has no tiny VAE to decode frames",
    )
    with pytest.raises(LiveError) as err:
        service.payload(sid, secret, 5, "safetensors")
    assert err.value.text == "chunk: chunk 5 is not kept: a session keeps its newest 8 chunks (0..0)"
    assert service.close(sid, secret) == {"closed": sid}


def test_bookkeeping_stays_flat_over_many_sessions(wan):
    transport = FakeTransport()
    service = make_service(wan, transport, idle_seconds=None, chunks_kept=2, closed_sessions_kept=4)
    failures = []

    def clients():  # 100 sessions opened and closed while the service runs: half joined first, half not
        try:
            for n in range(100):
                while True:
                    try:
                        answer = service.open({"client_id": f"c{n % 3}", "prompt": f"p{n % 5}"})
                        break
                    except LiveError as err:  # the previous closes are not applied yet
                        assert err.status == 429, err.text
                        time.sleep(0.002)
                if n % 2:
                    deadline = time.monotonic() + 30
                    while not len(transport.outboxes[answer["session"]]) and time.monotonic() < deadline:
                        time.sleep(0.002)
                service.close(answer["session"], answer["secret"])
        except BaseException as exc:
            failures.append(exc)
        finally:
            service.stop("done")

    worker = threading.Thread(target=clients)
    worker.start()
    report = service.serve()
    worker.join(60)
    assert failures == [] and report.why_stopped == "done"
    assert service._sessions == {} and service._by_key == {} and len(service._opening) == 0
    assert len(service._closed) == 4 and len(service._summaries) == 64
    assert (
        len(service.prompts) == 5 and service.prompts.misses == 5
    )  # the sessions that joined encoded them once
    assert report.prompt_cache["misses"] == 5 and report.prompt_cache["hits"] == service.prompts.hits > 0
    assert f"prompts: 5 encoded, {service.prompts.hits} from the cache" in report.text().splitlines()[1]
    assert service.pool.closed and service.pool.sessions == {}


def png_bytes(seed: int, width: int = W, height: int = H) -> bytes:
    import io

    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    array = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_start_image_starts_the_session_as_a_pool_prefilled_with_its_tiny_vae_latents(wan, taew):
    import base64

    from fewstep.engine.live.media import decode_image

    image = png_bytes(1, 64, 32)  # wider than the session: scaled to cover, center-cropped
    transport = FakeTransport()
    service = make_service(wan, transport, tiny_vae=taew)
    answer = service.open({"client_id": "c", "prompt": "a lighthouse", "seed": 2, "chunks": 2,
                           "start_image": base64.b64encode(image).decode()})  # fmt: skip
    service.serve()

    pool = SessionPool(wan, H, W, CONFIG, max_sessions=4, buckets=(1, 2, 4), tiny_vae=taew)
    session = pool.join(encoder_for(wan)("a lighthouse"), seed=2, chunks=2)
    start = decode_image(image, W, H)[None, None]
    pool.prefill(session, WAN21.process_in(taew.encode_raw(start).float().cpu()))
    reference = []
    while pool.ready():
        reference.append(pool.tick().chunks[session.key])
        session.take()
    pool.close()
    got = live_latents(service, answer, 2)
    assert len(reference) == 2
    for latents, chunk in zip(got, reference):
        assert torch.equal(latents, WAN21.process_out(chunk.latents))
    chunks = [d for e, d in drain(transport.outboxes[answer["session"]]) if e == "fewstep.chunk"]
    # the start image's frame is video frame 0: the first chunk's frames follow it
    assert [d["frames"] for d in chunks] == [[1, 8], [9, 16]]


def test_video_to_video_input_frames_equal_a_pool_fed_by_the_stream_encoder(wan, taew):
    from fewstep.engine.live.media import decode_image
    from fewstep.engine.vae.taehv import TAEHVStreamEncoder

    images = [png_bytes(10 + i) for i in range(16)]  # two chunks of 4 x 2 frames
    transport = FakeTransport()
    service = make_service(wan, transport, tiny_vae=taew)
    answer = service.open(
        {"client_id": "c", "prompt": "oil painting", "seed": 5, "chunks": 2, "strength": 0.6}
    )
    assert service.feed_frames(answer["session"], answer["secret"], images[:5]) == {"queued_frames": 5}
    assert service.feed_frames(answer["session"], answer["secret"], images[5:]) == {"queued_frames": 16}
    service.serve()

    pool = SessionPool(wan, H, W, CONFIG, max_sessions=4, buckets=(1, 2, 4), tiny_vae=taew)
    session = pool.join(encoder_for(wan)("oil painting"), seed=5, chunks=2)
    pool.set_strength(session, 0.6)
    encoder = TAEHVStreamEncoder(taew.video)
    frames = torch.stack([decode_image(b, W, H) for b in images])
    for i in range(2):
        z = encoder.push(frames[None, 8 * i : 8 * (i + 1)])
        pool.feed(session, WAN21.process_in(taew.latent_to_raw(z.transpose(1, 2).float()).float()))
    reference = []
    while pool.ready():
        reference.append(pool.tick().chunks[session.key])
        session.take()
    pool.close()
    assert [c.mode for c in reference] == ["v2v", "v2v"]
    for latents, chunk in zip(live_latents(service, answer, 2), reference):
        assert torch.equal(latents, WAN21.process_out(chunk.latents))
    chunks = [d for e, d in drain(transport.outboxes[answer["session"]]) if e == "fewstep.chunk"]
    assert [(d["mode"], d["strength"]) for d in chunks] == [("v2v", 0.6), ("v2v", 0.6)]


def test_input_frames_are_bounded_to_8_chunks(wan, taew):
    service = make_service(wan, FakeTransport(), tiny_vae=taew)
    answer = service.open({"client_id": "c", "prompt": "x", "strength": 0.5})
    frame = png_bytes(0)
    assert service.feed_frames(answer["session"], answer["secret"], [frame] * 64) == {"queued_frames": 64}
    with pytest.raises(LiveError) as err:
        service.feed_frames(answer["session"], answer["secret"], [frame])
    assert (err.value.status, err.value.text) == (429, "frames: 1 more frames do not fit: 64 of 64 are queued (8 "
                                                  "chunks ahead of the generation); send them after the next chunks")  # fmt: skip
    with pytest.raises(LiveError) as err:
        service.feed_frames(answer["session"], answer["secret"], [b"GIF89a"])
    assert (err.value.status, err.value.field) == (400, "frames[0]")
    service.stop()
    service.serve()


def test_without_a_tiny_vae_frames_are_refused(wan):
    service = make_service(wan, FakeTransport())
    answer = service.open({"client_id": "c", "prompt": "x"})
    with pytest.raises(LiveError) as err:
        service.feed_frames(answer["session"], answer["secret"], [png_bytes(0)])
    assert (
        err.value.text
        == "frames: video to video needs the live node's tiny VAE with its encoder (taew2_1); connect one"
    )
    with pytest.raises(LiveError) as err:
        service.control(answer["session"], answer["secret"], {"strength": 0.4})
    assert err.value.status == 400 and err.value.field == "strength"
    service.stop()
    service.serve()


def test_a_slow_reader_loses_chunks_with_a_stall_event_while_the_generation_goes_on(wan):
    transport = FakeTransport()
    service = make_service(wan, transport, max_events_queued=2, metrics_seconds=1e9)
    answer = service.open({"client_id": "c", "prompt": "x", "chunks": 6})
    report = service.serve()  # nobody reads during the run
    assert report.chunks == 6
    events = drain(transport.outboxes[answer["session"]])
    assert [(e, d.get("state"), d.get("chunk"), d.get("chunks")) for e, d in events] == [
        ("fewstep.session", "opened", None, None),
        ("fewstep.stall", None, None, [0, 1, 2, 3, 4]),
        ("fewstep.chunk", None, 5, 6),
        ("fewstep.metrics", None, None, 6),
        ("fewstep.session", "closed", None, None),
    ]
    assert events[1][1] == {"session": answer["session"], "node": "7", "prompt_id": "p1", "dropped": 5,
                            "chunks": [0, 1, 2, 3, 4]}  # fmt: skip


def test_a_reader_too_slow_for_events_that_may_not_be_dropped_has_its_session_closed(wan):
    transport = FakeTransport()
    service = make_service(wan, transport, max_events_queued=2, metrics_seconds=1e9)
    answer = service.open({"client_id": "c", "prompt": "x", "chunks": 6})
    for n in range(3):
        service.control(answer["session"], answer["secret"], {"seed": n, "at_chunk": n})
    report = service.serve()
    assert report.sessions[0]["why"] == "its client reads too slowly"
    # closed by the serve loop once the publisher found the outbox full: before its 6 chunks
    assert report.sessions[0]["chunks"] < 6


def test_a_control_sent_while_running_applies_at_the_next_boundary_and_a_late_at_chunk_says_its_real_chunk(
    wan,
):
    transport = FakeTransport()
    service = make_service(wan, transport)
    answer = service.open({"client_id": "c", "prompt": "x", "seed": 1, "chunks": 4})
    sid, secret = answer["session"], answer["secret"]
    outbox = transport.outboxes[sid]
    events: list = []
    sent = {}

    def on_check():  # once chunk 1 is made: a prompt now, and a seed "at chunk 0" (already past)
        events.extend(drain(outbox))
        if "prompt" not in sent and service._sessions[sid].chunks == 2:
            sent["prompt"] = service.control(sid, secret, {"prompt": "y", "recache": True})["control"]
            sent["seed"] = service.control(sid, secret, {"seed": 8, "at_chunk": 0})["control"]

    transport.on_check = on_check
    service.serve()
    events.extend(drain(outbox))
    applied = [
        (d["control"], d["kind"], d["chunk"], d["recache"])
        for e, d in events
        if e == "fewstep.control_applied"
    ]
    assert applied == [(sent["prompt"], "prompt", 2, True), (sent["seed"], "seed", 2, False)]
    script = {"prompt": "x", "seed": 1, "chunks": 4,
              "controls": [{"chunk": 2, "prompt": "y", "recache": True}, {"chunk": 2, "seed": 8}]}  # fmt: skip
    reference = reference_pool_run(wan, [script])[0]
    for latents, chunk in zip(live_latents(service, answer, 4), reference):
        assert torch.equal(latents, WAN21.process_out(chunk.latents))


def test_metrics_events_come_every_metrics_seconds_and_once_at_close(wan):
    transport = FakeTransport()
    service = make_service(wan, transport, metrics_seconds=0.0)
    answer = service.open({"client_id": "c", "prompt": "x", "chunks": 2})
    service.serve()
    metrics = [d for e, d in drain(transport.outboxes[answer["session"]]) if e == "fewstep.metrics"]
    assert len(metrics) >= 2 and metrics[-1]["chunks"] == 2
    assert set(metrics[-1]) == {"session", "node", "prompt_id", "time_to_first_chunk_s", "inter_chunk_p50_s",
                                "inter_chunk_p99_s", "realtime_factor", "deadline_attainment", "viewer_stalls",
                                "viewer_stall_seconds", "batch_sizes", "chunks", "video_seconds", "seconds"}  # fmt: skip
    assert metrics[-1]["batch_sizes"] == {"1": 2} and metrics[-1]["video_seconds"] == round(13 / 16, 6)


def test_limits_are_checked(wan):
    pool = SessionPool(wan, H, W, CONFIG, max_sessions=1)
    with pytest.raises(InputError) as err:
        LiveService(pool, FakeTransport(), encoder_for(wan), LiveLimits(max_sessions_per_client=0))
    assert (
        str(err.value)
        == "FewStep Live Video: input 'max_sessions_per_client': expected an integer >= 1, got 0"
    )
    with pytest.raises(InputError, match="input 'idle_seconds': expected seconds >= 0 or None, got -1"):
        LiveService(pool, FakeTransport(), encoder_for(wan), LiveLimits(idle_seconds=-1))
    pool.close()


def test_the_generation_runs_ahead_of_a_slow_publisher_by_a_bounded_number_of_chunks(wan, monkeypatch):
    from fewstep.engine.live import media

    release = threading.Event()
    encode = media.latents_to_safetensors

    def slow_encode(latents):
        release.wait(60)
        return encode(latents)

    monkeypatch.setattr(media, "latents_to_safetensors", slow_encode)
    transport = FakeTransport()
    service = make_service(wan, transport, slots=2, metrics_seconds=1e9)  # at most 2 chunks being published
    answer = service.open({"client_id": "c", "prompt": "x", "chunks": 6})
    sid = answer["session"]
    thread = threading.Thread(target=service.serve)
    thread.start()
    deadline = time.monotonic() + 60
    while (sid not in service._sessions or service._sessions[sid].chunks < 2) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # room to run ahead, if it could
    made = service._sessions[sid].chunks
    release.set()
    thread.join(60)
    assert made == 2
    chunks = [d["chunk"] for e, d in drain(transport.outboxes[sid]) if e == "fewstep.chunk"]
    assert chunks == [0, 1, 2, 3, 4, 5]


def test_a_failing_text_encoder_refuses_that_prompt_only(wan):
    encode = encoder_for(wan)

    def picky(text):
        if "bad" in text:
            raise RuntimeError("tokenizer exploded")
        return encode(text)

    transport = FakeTransport()
    pool = SessionPool(wan, H, W, CONFIG, max_sessions=2, buckets=(1, 2))
    service = LiveService(pool, transport, picky, LiveLimits(idle_seconds=0.0))
    good = service.open({"client_id": "c", "prompt": "good", "chunks": 2})
    bad = service.open({"client_id": "c", "prompt": "bad"})
    sequence = service.control(good["session"], good["secret"], {"prompt": "bad too", "at_chunk": 1})[
        "control"
    ]
    report = service.serve()
    why = {s["index"]: s["why"] for s in report.sessions}
    assert why == {1: "its 2 chunks are done",
                   2: "could not join: the text encoder failed on it: RuntimeError: tokenizer exploded"}  # fmt: skip
    applied = [d for e, d in drain(transport.outboxes[good["session"]]) if e == "fewstep.control_applied"]
    assert [(d["control"], d["chunk"], d["error"]) for d in applied] == [
        (sequence, None, "the text encoder failed on it: RuntimeError: tokenizer exploded")
    ]
    assert drain(transport.outboxes[bad["session"]])[-1][1]["state"] == "closed"


def test_a_session_keeps_the_payloads_of_its_newest_chunks_kept_chunks(wan):
    service = make_service(wan, FakeTransport(), chunks_kept=2)
    answer = service.open({"client_id": "c", "prompt": "x", "chunks": 4})
    service.serve()
    sid, secret = answer["session"], answer["secret"]
    for n in (0, 1):
        with pytest.raises(LiveError) as err:
            service.payload(sid, secret, n, "safetensors")
        assert err.value.text == f"chunk: chunk {n} is not kept: a session keeps its newest 2 chunks (2..3)"
    assert [raw_latents_of(service.payload(sid, secret, n, "safetensors")[0]).shape for n in (2, 3)] == [
        (1, 16, 2, H // 8, W // 8)
    ] * 2
    with pytest.raises(LiveError) as err:
        service.payload(sid, secret, 3, "mp4")
    assert err.value.text == "kind: expected one of webp, safetensors, got 'mp4'"


def test_controls_sent_with_the_open_take_effect_at_their_chunks(wan):
    """A script's controls in the open body are in place before the session's first chunk: the same video as the
    plain pool run, and the answer numbers them in the order given."""
    transport = FakeTransport()
    service = make_service(wan, transport)
    answers = []
    for script, client in ((SCRIPT_A, "client-a"), (SCRIPT_B, "client-b")):
        controls = [{**{k: v for k, v in c.items() if k != "chunk"}, "at_chunk": c["chunk"]}
                    for c in script["controls"]]  # fmt: skip
        answer = service.open({"client_id": client, "prompt": script["prompt"], "seed": script["seed"],
                               "chunks": script["chunks"], "controls": controls})  # fmt: skip
        assert answer["controls"] == list(range(1, len(controls) + 1))
        answers.append(answer)
    service.serve()
    reference = reference_pool_run(wan, [SCRIPT_A, SCRIPT_B])
    for answer, ref in zip(answers, reference):
        got = live_latents(service, answer, len(ref))
        assert all(torch.equal(g, WAN21.process_out(r.latents)) for g, r in zip(got, ref))
    applied = [
        d for e, d in drain(transport.outboxes[answers[0]["session"]]) if e == "fewstep.control_applied"
    ]
    assert [(d["control"], d["chunk"]) for d in applied] == [(1, 1), (2, 2), (3, 3)]


def test_controls_of_the_open_body_are_checked_with_their_index(wan):
    service = make_service(wan, FakeTransport())
    cases = [
        ({"controls": {"seed": 1}}, "controls: expected a list of control objects, got dict"),
        ({"controls": [{"seed": 1}]}, "controls[0].at_chunk: a control sent with the open needs its chunk"),
        ({"controls": [{"seed": 1, "at_chunk": 0}, {"seed": -1, "at_chunk": 1}]},
         "controls[1].seed: expected an integer 0..9223372036854775807, got -1"),
        ({"controls": [{"seed": 1, "stop": True, "at_chunk": 0}]},
         "controls[0].control: expected exactly one of prompt, strength, seed, stop; got seed, stop"),
        ({"controls": [{"seed": 1, "at_chunk": i} for i in range(65)]}, "controls: 65 controls; at most 64"),
        ({"controls": [{"strength": 0.5, "at_chunk": 1}]},
         "strength: video to video needs the live node's tiny VAE with its encoder (taew2_1); connect one"),
    ]  # fmt: skip
    for extra, text in cases:
        with pytest.raises(LiveError) as err:
            service.open({"client_id": "c", "prompt": "x", **extra})
        assert (err.value.status, err.value.text) == (400, text)
    service.stop()
    service.serve()
