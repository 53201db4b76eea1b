"""LiveService: a session pool served to live clients (issue 33).

The host (ComfyUI's live node, a test, the bench) builds a :class:`~engine.causal.session_pool.SessionPool` and a
:class:`LiveTransport`, then runs :meth:`LiveService.serve` on its generation thread until it is stopped or a
limit is reached. Request threads (routes) call :meth:`LiveService.open`, :meth:`~LiveService.control`,
:meth:`~LiveService.feed_frames`, :meth:`~LiveService.payload`, :meth:`~LiveService.close`,
:meth:`~LiveService.status` and :meth:`~LiveService.stop`: thread-safe and non-blocking. They validate the request,
record it on the session (controls keep the order they were sent in) and wake the serve loop; only the serve thread
touches the pool, between ticks:

1. opens (each prompt encoded through the :class:`~engine.prompt_embeddings.PromptEmbeddingCache`, a start image
   encoded by the tiny VAE and prefilled, the strength set), closes;
2. the clients' presence (``transport.connected``): a gone client's session is suspended to host memory, resumed
   when it is back, closed after ``disconnect_seconds``;
3. the limits (``stop()``, ``max_seconds``, ``max_chunks``, ``idle_seconds``);
4. video-to-video input: each session's queued frames encoded 4 x chunk_frames at a time
   (:class:`~engine.vae.taehv.TAEHVStreamEncoder`, one per session) and fed to the pool;
5. controls due at each session's next chunk boundary, put on the pool's control queue in the order they were sent
   (an ``at_chunk`` control waits for its chunk; ``stop`` closes the session there);
6. one :meth:`~engine.causal.session_pool.SessionPool.tick`, then every chunk it made taken and handed to the
   publisher;
7. periodic ``fewstep.metrics``; when nothing was made, a wait of at most 50 ms for the next request.

The publisher, one thread, turns each chunk into its payloads (the newest ``chunks_kept`` kept: the latents as
safetensors bytes, an animated WebP clip and JPEG frames with a tiny VAE), records its metrics and puts its events
(``fewstep.control_applied``, ``fewstep.chunk``, ``fewstep.deadline_missed``) in the session's
:class:`~.outbox.SessionOutbox`; every other event goes through it too, so a session's events keep their order.
Encoding a chunk thus overlaps generating the next (measured here: a 480x832 chunk of 12 frames took 0.66 s to
WebP and 0.23 s to JPEG on one thread of a shared 2-core CPU); the generation waits only while a whole tick's worth
of chunks (``max(2, slots)``) is still being encoded. A session's realtime metrics count a chunk when its event is
ready (its encoding included: what its viewer sees); its summary in the report carries its ``media_seconds``.
"""

from __future__ import annotations

import base64
import hmac
import logging
import queue
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from ..causal.session_pool import PoolSession, SessionPool, TickReport
from ..errors import InputError
from ..prompt_embeddings import PromptEmbeddingCache
from ..vae.taehv import TAEHVStreamEncoder
from . import media
from .metrics import RealtimeMetrics
from .outbox import OutboxFullError, SessionOutbox
from .protocol import (
    CLIP_ROUTE,
    EVENT_CHUNK,
    EVENT_CONTROL_APPLIED,
    EVENT_DEADLINE_MISSED,
    EVENT_METRICS,
    EVENT_SESSION,
    LATENTS_ROUTE,
    MAX_SCHEDULED_CONTROLS,
    QUEUED_INPUT_CHUNKS,
    ControlRequest,
    LiveError,
    OpenRequest,
    check_control,
    check_open,
    no_node,
    no_session,
)

log = logging.getLogger(__name__)

IDLE_WAIT_SECONDS = (
    0.05  # the serve loop's longest wait with nothing to make (Cancel is checked at least this often)
)
REPORTED_SESSIONS = 64  # sessions a LiveReport summarizes (the newest)
PAYLOAD_KINDS = {"webp": "image/webp", "safetensors": "application/octet-stream"}


@dataclass(frozen=True)
class LiveLimits:
    max_sessions_per_client: int = 2
    max_seconds: float | None = None  # the whole live run
    max_chunks: int | None = None  # chunks of all sessions together; the run stops when reached
    idle_seconds: float | None = 300.0  # no open session for this long -> stop
    disconnect_seconds: float = 30.0  # a suspended session of a gone client is closed after this
    max_events_queued: int = 16  # per session outbox
    chunks_kept: int = 8  # per session payloads kept for GET (clip / latents)
    metrics_seconds: float = 2.0
    # closed sessions whose payloads stay readable (a client fetches its last chunk after the close)
    closed_sessions_kept: int = 16

    def check(self, where: str | None = None) -> None:
        counts = ("max_sessions_per_client", "max_events_queued", "chunks_kept")
        for name in counts:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(name, f"expected an integer >= 1, got {value!r}", where)
        value = self.closed_sessions_kept
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InputError("closed_sessions_kept", f"expected an integer >= 0, got {value!r}", where)
        if self.max_chunks is not None and (
            isinstance(self.max_chunks, bool) or not isinstance(self.max_chunks, int) or self.max_chunks < 1
        ):
            raise InputError(
                "max_chunks", f"expected an integer >= 1 or None, got {self.max_chunks!r}", where
            )
        for name in ("max_seconds", "idle_seconds", "disconnect_seconds", "metrics_seconds"):
            value = getattr(self, name)
            optional = name in ("max_seconds", "idle_seconds")
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                expected = "seconds >= 0" + (" or None" if optional else "")
                raise InputError(name, f"expected {expected}, got {value!r}", where)


class LiveTransport(Protocol):
    """What the host provides. ``connected`` is asked every loop iteration for every active session (keep it
    cheap; thread-safe); ``attach`` is called on the request thread that opens a session, before its first event;
    ``detach`` on the service's publisher thread once the session is closed and its outbox closed (its last
    events, ``fewstep.metrics`` and ``fewstep.session`` closed, are still queued: deliver them, then forget the
    outbox). ``detach`` may come twice for an id (a run ending while the session opens): ignore an unknown one."""

    def connected(self, client_id: str) -> bool: ...

    def attach(self, session_id: str, client_id: str, outbox: SessionOutbox) -> None: ...

    def detach(self, session_id: str) -> None: ...


@dataclass
class LiveReport:
    why_stopped: str
    seconds: float
    chunks: int
    sessions: list[dict] = field(default_factory=list)  # newest 64: index, seed, chunks, metrics, why closed
    prompt_cache: dict = field(default_factory=dict)  # PromptEmbeddingCache.stats(): prompts encoded, hits

    def text(self) -> str:
        """The node's report: why the run stopped, its totals, one line per session (no ids or secrets)."""
        lines = [
            f"live run stopped: {self.why_stopped}; {self.seconds:.1f} s, {self.chunks} chunks, "
            f"{len(self.sessions)} sessions"
        ]
        if self.prompt_cache:
            c = self.prompt_cache
            lines.append(f"prompts: {c['misses']} encoded, {c['hits']} from the cache")
        for s in self.sessions:
            m = s["metrics"]

            def sec(key, m=m):
                return "-" if m[key] is None else f"{m[key]:.3f} s"

            attained = "-" if m["deadline_attainment"] is None else f"{100 * m['deadline_attainment']:.0f}%"
            rtf = "-" if m["realtime_factor"] is None else f"{m['realtime_factor']:.2f}x"
            batches = ", ".join(f"{n}: {c}" for n, c in m["batch_sizes"].items()) or "-"
            lines.append(
                f"session {s['index']} (seed {s['seed']}): {s['chunks']} chunks, closed: {s['why']}; first chunk "
                f"{sec('time_to_first_chunk_s')}, inter-chunk p50 {sec('inter_chunk_p50_s')} / p99 "
                f"{sec('inter_chunk_p99_s')}, realtime factor {rtf}, deadlines met {attained}, viewer stalls "
                f"{m['viewer_stalls']} ({m['viewer_stall_seconds']:.3f} s), batch sizes {{{batches}}}"
            )
        return "\n".join(lines)


def video_frame_span(first_latent: int, latent_frames: int) -> tuple[int, int]:
    """First and last video frame (inclusive) of ``latent_frames`` latent frames from ``first_latent``: Wan's VAE
    makes one frame of the first latent frame and four of every later one."""

    def start(latent: int) -> int:
        return 0 if latent == 0 else 4 * latent - 3

    return start(first_latent), start(first_latent + latent_frames) - 1


class _Publisher:
    """One thread that publishes every event of the service, in the order the serve thread hands them over, and
    turns each chunk into its payloads (the animated WebP clip, the JPEG frames, the latents file) on the way: the
    encoding of a chunk overlaps the generation of the next instead of delaying it. The serve thread waits only
    when ``max_pending_chunks`` chunks are still being encoded (the frames they hold stay bounded)."""

    def __init__(self, max_pending_chunks: int):
        self.max_pending_chunks = max_pending_chunks
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._room = threading.Condition()
        self._pending_chunks = 0
        self._thread = threading.Thread(target=self._run, name="fewstep-live-publisher", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], chunk: bool = False) -> None:
        if chunk:
            with self._room:
                self._pending_chunks += 1
        self._jobs.put((job, chunk))

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, chunk = item
            try:
                job()
            except Exception:  # one chunk's failure must not silence every other session
                log.exception("fewstep live: publishing an event failed")
            finally:
                if chunk:
                    with self._room:
                        self._pending_chunks -= 1
                        self._room.notify_all()

    def wait_for_room(self, check: Callable[[], None]) -> None:
        """Wait while too many chunks are being encoded; ``check()`` (Cancel) at least every 50 ms."""
        while True:
            with self._room:
                if self._pending_chunks < self.max_pending_chunks:
                    return
                self._room.wait(IDLE_WAIT_SECONDS)
            check()

    def finish(self) -> None:
        """Publish everything handed over, then end the thread."""
        self._jobs.put(None)
        self._thread.join()


@dataclass(frozen=True)
class _Control:
    sequence: int  # the session's own numbering, answered to the client
    request: ControlRequest


class _Session:
    """A live client's session (service side; ``pool_session`` is the pool's stream once joined)."""

    def __init__(self, index: int, sid: str, secret: str, request: OpenRequest, outbox: SessionOutbox,
                 tags: dict, start: Tensor | None, fps: float):  # fmt: skip
        self.index, self.id, self.secret = index, sid, secret
        self.client_id = request.client_id
        self.request = request
        self.outbox = outbox
        self.tags = tags  # session, node, prompt_id: in every event's data
        self.start = start  # the decoded start image [3, H, W], until it is prefilled
        self.metrics = RealtimeMetrics(fps)
        self.state = "opening"  # opening | active | closed (suspension is the pool session's state)
        self.why = ""
        self.closing: str | None = None  # a close asked for by its client, applied by the serve loop
        self.pool_session: PoolSession | None = None
        self.controls: list[_Control] = []  # sent, not yet on the pool's queue, in the order sent
        self.sequence = 0
        self.pool_sequences: dict[int, int] = {}  # the pool queue's sequence -> ours
        # chunk -> (clip, latents), the newest chunks_kept
        self.payloads: OrderedDict[int, tuple[bytes | None, bytes]] = OrderedDict()
        self.frames: deque[Tensor] = deque()  # input frames [3, H, W] not yet encoded
        self.frames_in_pool = 0  # video frames whose latents wait in the pool's input queue
        self.encoder: TAEHVStreamEncoder | None = None
        self.gone_since: float | None = None
        self.suspended = False  # suspended by the service because its client is gone
        self.video_frames = 0  # video frames made so far (a start image's included)
        self.last_metrics = time.perf_counter()
        self.media_seconds = 0.0
        self.chunks = 0

    def event(self, name: str, data: dict, droppable: bool = False, force: bool = False) -> None:
        self.outbox.put(name, {**self.tags, **data}, droppable=droppable, force=force)

    def summary(self) -> dict:
        return {"index": self.index, "seed": self.request.seed, "chunks": self.chunks,
                "metrics": self.metrics.as_dict(), "why": self.why,
                "media_seconds": round(self.media_seconds, 4)}  # fmt: skip


class LiveService:
    """Live sessions on ``pool`` for clients reached through ``transport`` (see the module docstring).

    ``encode_prompt(text) -> [1, L, 4096]``: the text encoder (ComfyUI's CLIP) or
    ``engine.prompt_embeddings.synthetic_text_embedding`` with dummy weights; called on the serve thread through a
    cache of ``prompt_cache_entries`` prompts. ``tiny_vae``: the pool's tiny VAE (clips, image to video and video
    to video need it; the latter two its encoder). ``tags``: ``{"node", "prompt_id"}`` put in every event."""

    def __init__(
        self,
        pool: SessionPool,
        transport: LiveTransport,
        encode_prompt: Callable[[str], Tensor],
        limits: LiveLimits = LiveLimits(),
        tiny_vae=None,
        tags: dict | None = None,
        where: str = "FewStep Live Video",
        prompt_cache_entries: int = 32,
    ):
        limits.check(where)
        self.pool, self.transport, self.limits, self.where = pool, transport, limits, where
        self.tiny_vae = tiny_vae if tiny_vae is not None else pool.tiny_vae
        tags = tags or {}
        self.tags = {"node": tags.get("node", ""), "prompt_id": tags.get("prompt_id", "")}
        # one encoder for the whole run: the text alone is the key
        self._encode_prompt = encode_prompt
        self.prompts = PromptEmbeddingCache(max_entries=prompt_cache_entries)
        self.chunk_frames = pool.config.chunk_frames
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._sessions: dict[str, _Session] = {}  # open (not closed) sessions by id
        self._closed: OrderedDict[str, _Session] = OrderedDict()  # the newest closed ones (payloads readable)
        self._by_key: dict[str, _Session] = {}  # pool session key -> session
        self._opening: deque[str] = deque()  # ids to join, in the order opened
        self._summaries: deque[dict] = deque(maxlen=REPORTED_SESSIONS)
        self._opened = 0
        self._chunks = 0
        self._stop_why: str | None = None
        self._serving = False
        self._finished = False
        self._cancelled = False
        self._publisher: _Publisher | None = None  # started by serve()
        # compared against for an unknown id: the same work as for a wrong secret
        self._decoy = secrets.token_urlsafe(32)

    # -- the requests (any thread; never wait for a tick) ----------------------------------------------------------
    @property
    def frames_per_chunk(self) -> int:
        return 4 * self.chunk_frames

    def _has_encoder(self) -> bool:
        vae = self.tiny_vae
        return (
            vae is not None
            and getattr(vae, "encoder", None) is not None
            and getattr(vae, "video", None) is not None
        )

    def _need_encoder(self, field_name: str, what: str) -> None:
        if not self._has_encoder():
            raise LiveError(400, field_name, f"{what} needs the live node's tiny VAE with its encoder (taew2_1); "
                            "connect one")  # fmt: skip

    def open(self, body: dict) -> dict:
        """Open a session (``protocol.check_open``); the 201 answer. It joins the pool at the serve loop's next
        iteration (``fewstep.session`` opened then)."""
        request = check_open(body)
        if request.start_image is not None:
            self._need_encoder("start_image", "image to video")
        if request.strength is not None or any(
            c.kind == "strength" and c.value is not None for c in request.controls
        ):
            self._need_encoder("strength", "video to video")
        pool = self.pool
        start = None
        if request.start_image is not None:
            start = media.decode_image(request.start_image, pool.width, pool.height, "start_image")
        with self._lock:
            if self._finished or self._stop_why is not None:
                raise no_node()
            # a session whose close is asked for counts no more: the serve loop applies closes before joins
            live = [s for s in self._sessions.values() if s.closing is None]
            mine = sum(s.client_id == request.client_id for s in live)
            if mine >= self.limits.max_sessions_per_client:
                raise LiveError(429, "client_id", f"this client has {mine} open sessions; at most "
                                f"{self.limits.max_sessions_per_client} per client: close one first")  # fmt: skip
            if len(live) >= pool.slots:
                raise LiveError(429, "", f"all {pool.slots} session slots of this live node are taken; try "
                                "again later")  # fmt: skip
            sid = secrets.token_urlsafe(12)
            while sid in self._sessions or sid in self._closed:
                sid = secrets.token_urlsafe(12)
            secret = secrets.token_urlsafe(32)
            self._opened += 1
            tags = {"session": sid, **self.tags}
            outbox = SessionOutbox(self.limits.max_events_queued, tags=tags)
            session = _Session(self._opened, sid, secret, request, outbox, tags, start, pool.fps)
            for control in request.controls:  # scheduled with the open: in place before its first chunk
                session.sequence += 1
                session.controls.append(_Control(session.sequence, control))
            self._sessions[sid] = session
        self.transport.attach(sid, request.client_id, outbox)
        with self._lock:
            self._opening.append(sid)
            closed_meanwhile = session.state == "closed"  # the run ended between the two locks
        if closed_meanwhile:
            self.transport.detach(sid)
        self._wake.set()
        return {"session": sid, "secret": secret, "width": pool.width, "height": pool.height,
                "chunk_frames": self.chunk_frames, "frames_per_chunk": self.frames_per_chunk, "fps": pool.fps,
                "controls": list(range(1, len(request.controls) + 1)), **self.tags}  # fmt: skip

    def _find(self, session_id, secret, closed_ok: bool = False) -> _Session:
        """The session with this id and secret; unknown id and wrong secret one identical 404. A closed one (kept
        for its payloads) only with ``closed_ok``, else 409."""
        with self._lock:
            session = None
            if isinstance(session_id, str):
                session = self._sessions.get(session_id) or self._closed.get(session_id)
        expected = (session.secret if session is not None else self._decoy).encode()
        given = secret.encode("utf-8", "replace") if isinstance(secret, str) else b""
        if not hmac.compare_digest(expected, given) or session is None:
            raise no_session()
        if not closed_ok and (session.state == "closed" or session.closing is not None):
            why = session.why or session.closing
            raise LiveError(409, "", f"this session is closed ({why})")
        return session

    def control(self, session_id: str, secret: str, body: dict) -> dict:
        """A control (``protocol.check_control``), applied at the session's next chunk boundary, or at the
        boundary before chunk ``at_chunk`` (one already started: the next boundary; the event tells the chunk)."""
        session = self._find(session_id, secret)
        request = check_control(body)
        if request.kind == "strength" and request.value is not None:
            self._need_encoder("strength", "video to video")
        with self._lock:
            if len(session.controls) >= MAX_SCHEDULED_CONTROLS:
                raise LiveError(429, "control", f"{len(session.controls)} controls of this session wait for "
                                f"their chunk; at most {MAX_SCHEDULED_CONTROLS}")  # fmt: skip
            session.sequence += 1
            sequence = session.sequence
            session.controls.append(_Control(sequence, request))
        self._wake.set()
        return {"control": sequence, "kind": request.kind}

    def feed_frames(self, session_id: str, secret: str, images: list[bytes]) -> dict:
        """Input frames for video to video (PNG / JPEG bytes, each scaled to cover the session's size and
        center-cropped), queued; at most ``QUEUED_INPUT_CHUNKS`` chunks of frames ahead of the generation (429)."""
        session = self._find(session_id, secret)
        self._need_encoder("frames", "video to video")
        if not isinstance(images, list) or not images:
            raise LiveError(400, "frames", "expected a non-empty list of PNG or JPEG images")
        pool = self.pool
        frames = [
            media.decode_image(data, pool.width, pool.height, f"frames[{i}]") for i, data in enumerate(images)
        ]
        cap = QUEUED_INPUT_CHUNKS * self.frames_per_chunk
        with self._lock:
            queued = len(session.frames) + session.frames_in_pool
            if queued + len(frames) > cap:
                raise LiveError(429, "frames", f"{len(frames)} more frames do not fit: {queued} of {cap} are queued "
                                f"({QUEUED_INPUT_CHUNKS} chunks ahead of the generation); send them after the next "
                                "chunks")  # fmt: skip
            session.frames.extend(frames)
            queued += len(frames)
        self._wake.set()
        return {"queued_frames": queued}

    def payload(self, session_id: str, secret: str, chunk: int, kind: str) -> tuple[bytes, str]:
        """A kept chunk's clip (``webp``) or latents (``safetensors``): (body, content type)."""
        session = self._find(session_id, secret, closed_ok=True)
        if kind not in PAYLOAD_KINDS:
            raise LiveError(400, "kind", f"expected one of {', '.join(PAYLOAD_KINDS)}, got {kind!r}")
        with self._lock:
            kept = session.payloads.get(chunk) if isinstance(chunk, int) else None
            held = list(session.payloads)
        if kept is None:
            span = f"{held[0]}..{held[-1]}" if held else "none yet"
            raise LiveError(404, "chunk", f"chunk {chunk!r} is not kept: a session keeps its newest "
                            f"{self.limits.chunks_kept} chunks ({span})")  # fmt: skip
        clip, latents = kept
        if kind == "webp":
            if clip is None:
                raise LiveError(404, "chunk", "no clip: the live node has no tiny VAE to decode frames")
            return clip, PAYLOAD_KINDS[kind]
        return latents, PAYLOAD_KINDS[kind]

    def close(self, session_id: str, secret: str) -> dict:
        """Close a session (at the serve loop's next iteration; ``fewstep.session`` closed then). Closing a closed
        session answers the same."""
        session = self._find(session_id, secret, closed_ok=True)
        with self._lock:
            if session.state != "closed" and session.closing is None:
                session.closing = "closed by its client"
        self._wake.set()
        return {"closed": session.id}

    def status(self) -> dict:
        """Public: the node's shape and load. Never an id or a secret."""
        pool = self.pool
        with self._lock:
            sessions = len(self._sessions)
        slots = 0 if pool.closed else pool.slots
        return {**self.tags, "width": pool.width, "height": pool.height, "chunk_frames": self.chunk_frames,
                "fps": pool.fps, "slots": slots, "sessions": sessions, "free_slots": max(0, slots - sessions),
                "max_sessions_per_client": self.limits.max_sessions_per_client}  # fmt: skip

    def stop(self, why: str = "stopped by a client") -> None:
        """Stop the live run: serve() closes every session and returns at its next iteration."""
        with self._lock:
            if self._stop_why is None:
                self._stop_why = why
        self._wake.set()

    @property
    def serving(self) -> bool:
        return self._serving

    # -- the generation thread ----------------------------------------------------------------------------------
    def serve(self, check_cancel: Callable[[], None] | None = None) -> LiveReport:
        """Run until stopped or a limit is reached (see the module docstring). ``check_cancel`` is called before
        every forward and at least every 50 ms while idle; when it raises, every session is closed, the pool is
        closed and the exception propagates. Always returns (or raises) with no session open and the pool
        freed."""
        with self._lock:
            if self._serving or self._finished:
                raise RuntimeError("a LiveService serves once")
            self._serving = True
        started = time.perf_counter()
        idle_since = started
        why = None

        def cancel_check() -> None:
            if check_cancel is not None:
                try:
                    check_cancel()
                except BaseException:
                    self._cancelled = True
                    raise

        hook = None if check_cancel is None else (lambda step: cancel_check())
        # a tick's chunks of every slot in flight at most: their frames stay bounded
        self._publisher = _Publisher(max(2, self.pool.slots))
        try:
            while True:
                cancel_check()
                self._wake.clear()
                self._apply_requests()
                now = time.perf_counter()
                self._check_clients(now)
                with self._lock:
                    if self._sessions:
                        idle_since = None
                    elif idle_since is None:
                        idle_since = now
                why = self._limit_reached(now, started, idle_since)
                if why is not None:
                    break
                self._feed_inputs()
                self._put_due_controls()
                produced = False
                if self.pool.ready():
                    self._publisher.wait_for_room(cancel_check)
                    produced = self._deliver(self.pool.tick(hook))
                self._send_metrics(time.perf_counter())
                if not produced:
                    self._wake.wait(IDLE_WAIT_SECONDS)
        except BaseException as exc:
            why = "the live node was cancelled" if self._cancelled else f"the live node failed: {exc}"
            raise
        finally:
            try:
                self._close_all(why or "the live run ended")
            finally:
                self._publisher.finish()  # every event handed over is in its outbox before serve() returns
                self.pool.close()
                with self._lock:
                    self._serving, self._finished = False, True
        return LiveReport(
            why, time.perf_counter() - started, self._chunks, list(self._summaries), self.prompts.stats()
        )

    def _limit_reached(self, now: float, started: float, idle_since: float | None) -> str | None:
        limits = self.limits
        with self._lock:
            if self._stop_why is not None:
                return self._stop_why
        if limits.max_seconds is not None and now - started >= limits.max_seconds:
            return f"max_seconds reached ({limits.max_seconds:g} s)"
        if limits.max_chunks is not None and self._chunks >= limits.max_chunks:
            return f"max_chunks reached ({limits.max_chunks} chunks)"
        if (
            limits.idle_seconds is not None
            and idle_since is not None
            and now - idle_since >= limits.idle_seconds
        ):
            return f"no session for {limits.idle_seconds:g} s (idle_seconds)"
        return None

    def _apply_requests(self) -> None:
        """Closes asked for, then joins, in the order they came."""
        with self._lock:
            closing = [s for s in self._sessions.values() if s.closing is not None]
            opening = [self._sessions[sid] for sid in self._opening if sid in self._sessions]
            self._opening.clear()
        for session in closing:
            self._close(session, session.closing)
        for session in opening:
            if session.state == "opening":
                self._join(session)

    def _join(self, session: _Session) -> None:
        request = session.request
        pool = self.pool
        try:
            context = self._encode(request.prompt)
            ps = pool.join(context, request.seed, request.chunks)
        except InputError as err:
            self._close(session, f"could not join: {err.problem}")
            return
        session.pool_session, session.state = ps, "active"
        with self._lock:
            self._by_key[ps.key] = session
        try:
            if session.start is not None:
                result = pool.prefill(ps, media.start_latents(self.tiny_vae, session.start))
                session.start = None
                if result.decoded is not None:
                    session.video_frames = result.decoded.shape[1]
            if request.strength is not None:
                pool.set_strength(ps, request.strength)
        except InputError as err:
            self._close(session, f"could not start: {err.problem}")
            return
        self._put(session, EVENT_SESSION, {"state": "opened", "why": "opened by its client"})

    def _encode(self, text: str) -> Tensor:
        """A prompt through the cache; the text encoder's own failure becomes an InputError naming the prompt (the
        other sessions go on)."""
        try:
            return self.prompts.get(text, lambda: self._encode_prompt(text))
        except InputError:
            raise
        except Exception as exc:
            raise InputError("prompt", f"the text encoder failed on it: {type(exc).__name__}: {exc}") from exc

    def _put(self, session: _Session, name: str, data: dict, droppable: bool = False) -> None:
        """Queue an event for the session's client, through the publisher (in order with its chunks)."""
        self._publisher.submit(lambda: self._publish(session, name, data, droppable))

    def _publish(self, session: _Session, name: str, data: dict, droppable: bool = False) -> bool:
        """(publisher thread) Put an event into the session's outbox. A client so slow that its outbox is full of
        events that may not be dropped has its session closed by the serve loop; False then."""
        try:
            session.event(name, data, droppable=droppable)
            return True
        except OutboxFullError:
            with self._lock:
                if session.closing is None:
                    session.closing = "its client reads too slowly"
            self._wake.set()
            return False

    def _check_clients(self, now: float) -> None:
        """Suspend the sessions of gone clients, resume them when back, close them after disconnect_seconds."""
        with self._lock:
            sessions = [s for s in self._sessions.values() if s.state == "active"]
        for s in sessions:
            ps = s.pool_session
            if not self.transport.connected(s.client_id):
                if s.gone_since is None:
                    s.gone_since = now
                if now - s.gone_since >= self.limits.disconnect_seconds:
                    self._close(s, f"its client was gone for {self.limits.disconnect_seconds:g} s")
                    continue
                if not s.suspended and ps.state == "active":
                    try:
                        self.pool.suspend(ps, "its client disconnected")
                    except InputError as err:  # the pool's host copies are full: it goes on generating
                        log.info("fewstep live: could not suspend session %d: %s", s.index, err.problem)
                        continue
                    s.suspended = True
                    self._put(s, EVENT_SESSION, {"state": "suspended", "why": "its client disconnected"})
            else:
                s.gone_since = None
                if s.suspended:
                    if ps.state == "suspended":
                        self.pool.resume(ps, wait=True)  # queued for a slot when none is free
                    if ps.state == "active":
                        s.suspended = False
                        self._put(s, EVENT_SESSION, {"state": "resumed", "why": "its client is back"})

    def _feed_inputs(self) -> None:
        """Each session's queued input frames, a chunk's worth at a time, encoded and fed to the pool."""
        need = self.frames_per_chunk
        with self._lock:
            sessions = [s for s in self._sessions.values() if s.state == "active" and len(s.frames) >= need]
        for s in sessions:
            while True:
                with self._lock:
                    if len(s.frames) < need:
                        break
                    frames = torch.stack([s.frames.popleft() for _ in range(need)])
                    s.frames_in_pool += need  # counted against the bound while it is encoded
                if s.encoder is None:
                    s.encoder = TAEHVStreamEncoder(self.tiny_vae.video)
                try:
                    self.pool.feed(s.pool_session, media.input_latents(self.tiny_vae, s.encoder, frames))
                except InputError as err:
                    self._close(s, f"could not queue its input frames: {err.problem}")
                    break
            self._count_inputs(s)

    def _count_inputs(self, s: _Session) -> None:
        ps = s.pool_session
        queued = 0 if ps is None or ps.state == "closed" else len(ps.inputs)
        with self._lock:
            s.frames_in_pool = 4 * queued

    def _put_due_controls(self) -> None:
        """Controls due at each session's next chunk boundary onto the pool's queue, in the order they were sent
        (a newer one of a kind replaces an older one still queued: ``ControlQueue``)."""
        with self._lock:
            sessions = [s for s in self._sessions.values() if s.state == "active" and s.controls]
        for s in sessions:
            ps = s.pool_session
            boundary = ps.stats.chunks_generated
            with self._lock:
                due = [c for c in s.controls if c.request.at_chunk is None or c.request.at_chunk <= boundary]
                s.controls = [c for c in s.controls if c not in due]
            for control in due:
                request = control.request
                if request.kind == "stop":
                    self._put(s, EVENT_CONTROL_APPLIED, {"control": control.sequence, "kind": "stop",
                                                         "chunk": boundary, "recache": False, "recache_frames": 0,
                                                         "recache_seconds": 0.0})  # fmt: skip
                    self._close(s, "stopped by its client")
                    break
                try:
                    value = self._encode(request.value) if request.kind == "prompt" else request.value
                    pool_sequence = self.pool.control(ps, request.kind, value, request.recache)
                except InputError as err:  # refused (a re-cache without its frames, a bad encoding): reported
                    self._put(s, EVENT_CONTROL_APPLIED, {"control": control.sequence, "kind": request.kind,
                                                         "chunk": None, "recache": request.recache,
                                                         "recache_frames": 0, "recache_seconds": 0.0,
                                                         "error": err.problem})  # fmt: skip
                    continue
                s.pool_sequences[pool_sequence] = control.sequence

    def _deliver(self, report: TickReport) -> bool:
        """Take every chunk the tick made and hand it to its session. True when a chunk was made."""
        for key, why in report.failed.items():
            session = self._by_key.get(key)
            if session is not None:
                self._close(session, why)
        for key, chunk in report.chunks.items():
            session = self._by_key.get(key)
            if session is None or session.state != "active":
                continue
            session.pool_session.take()
            self._chunks += 1
            self._chunk_events(session, chunk)
            if session.state == "active":
                self._count_inputs(session)
                if session.pool_session.chunks_left == 0:
                    self._close(session, f"its {session.request.chunks} chunks are done")
        return bool(report.chunks)

    def _chunk_events(self, s: _Session, chunk) -> None:
        """(serve thread) What the chunk's events say, then handed to the publisher with its frames."""
        ps = s.pool_session
        timing = ps.stats.pool_recent[-1]
        applied = []
        for control in chunk.controls:
            sequence = s.pool_sequences.get(control.sequence)
            if sequence is None:
                continue
            recache = chunk.recache if control.recache else None
            applied.append({"control": sequence, "kind": control.kind, "chunk": control.chunk,
                            "recache": control.recache, "recache_frames": 0 if recache is None else recache.frames,
                            "recache_seconds": 0.0 if recache is None else round(recache.seconds, 4),
                            "replaced": control.replaced})  # fmt: skip
        # every control put on the pool's queue before this chunk was taken at its boundary: applied (reported
        # here) or replaced by a newer one of its kind (never applied); either way its number is done with
        s.pool_sequences.clear()
        frames = chunk.frames[0] if chunk.frames is not None and chunk.frames.shape[1] else None
        if frames is not None:
            first, last = s.video_frames, s.video_frames + frames.shape[0] - 1
        else:
            first, last = video_frame_span(chunk.start_frame, self.chunk_frames)
        s.video_frames = last + 1
        s.chunks += 1
        self._publisher.submit(lambda: self._publish_chunk(s, chunk, timing, applied, frames, (first, last)),
                               chunk=True)  # fmt: skip

    def _publish_chunk(self, s: _Session, chunk, timing, applied: list[dict], frames, span) -> None:
        """(publisher thread) The chunk's payloads kept, its metrics recorded, its events put."""
        t0 = time.perf_counter()
        clip = jpeg = None
        try:
            if frames is not None:
                clip = media.frames_to_webp(frames, self.pool.fps)
            if s.request.jpeg and frames is not None:
                jpeg = [base64.b64encode(j).decode("ascii")
                        for j in media.frames_to_jpeg(frames, s.request.jpeg_quality)]  # fmt: skip
        except LiveError as err:  # no Pillow: the latents still go out
            log.warning(
                "fewstep live: no clip for chunk %d of session %d: %s", chunk.index, s.index, err.text
            )
        latents = media.latents_to_safetensors(chunk.latents)
        s.media_seconds += time.perf_counter() - t0
        with self._lock:
            s.payloads[chunk.index] = (clip, latents)
            while len(s.payloads) > self.limits.chunks_kept:
                s.payloads.popitem(last=False)
        first, last = span
        s.metrics.record_chunk(
            (last - first + 1) / self.pool.fps, timing.latency, timing.deadline_met, timing.batch
        )
        for data in applied:
            if not self._publish(s, EVENT_CONTROL_APPLIED, data):
                return
        data = {
            "chunk": chunk.index, "chunks": s.request.chunks, "frames": [first, last],
            "seconds": round(chunk.seconds, 4), "latency": round(timing.latency, 4),
            "first_chunk_seconds": s.metrics.as_dict()["time_to_first_chunk_s"], "kv_bytes": chunk.kv_bytes,
            "batch": timing.batch, "bucket": timing.bucket, "deadline_met": timing.deadline_met, "mode": chunk.mode,
            "strength": chunk.strength, "clip": None if clip is None else CLIP_ROUTE.format(id=s.id, n=chunk.index),
            "latents": LATENTS_ROUTE.format(id=s.id, n=chunk.index), "files": [],
        }  # fmt: skip
        if jpeg is not None:
            data["jpeg"] = jpeg
        if not self._publish(s, EVENT_CHUNK, data, droppable=True):
            return
        if not timing.deadline_met:
            deadline = (4 * self.chunk_frames - (3 if chunk.index == 0 else 0)) / self.pool.fps
            self._publish(s, EVENT_DEADLINE_MISSED, {"chunk": chunk.index, "latency": round(timing.latency, 4),
                                                     "deadline": round(deadline, 4)}, droppable=True)  # fmt: skip

    def _send_metrics(self, now: float) -> None:
        with self._lock:
            sessions = [s for s in self._sessions.values() if s.state == "active" and not s.suspended]
        for s in sessions:
            if now - s.last_metrics >= self.limits.metrics_seconds:
                s.last_metrics = now
                self._publisher.submit(lambda s=s: self._publish(s, EVENT_METRICS, s.metrics.as_dict()))

    def _close(self, s: _Session, why: str) -> None:
        """Close a session (serve thread): out of the pool, its last events queued, its outbox detached; kept
        among the closed ones for its payloads."""
        if s.state == "closed":
            return
        ps = s.pool_session
        if ps is not None:
            self.pool.leave(ps, why)
        closed_at = time.perf_counter()
        with self._lock:
            s.state, s.why = "closed", why
            s.controls.clear()
            s.frames.clear()
            s.frames_in_pool = 0
            s.start = s.encoder = s.pool_session = None
            s.pool_sequences.clear()
            self._sessions.pop(s.id, None)
            if ps is not None:
                self._by_key.pop(ps.key, None)
            if self.limits.closed_sessions_kept:
                self._closed[s.id] = s
                while len(self._closed) > self.limits.closed_sessions_kept:
                    self._closed.popitem(last=False)
        self._publisher.submit(lambda: self._publish_close(s, why, closed_at))

    def _publish_close(self, s: _Session, why: str, closed_at: float) -> None:
        """(publisher thread, after the session's chunks) Its last metrics and the closed event, past the
        outbox's bound; the outbox closed and detached."""
        s.metrics.close(closed_at)
        with self._lock:
            self._summaries.append(s.summary())
        s.event(EVENT_METRICS, s.metrics.as_dict(), force=True)
        s.event(EVENT_SESSION, {"state": "closed", "why": why}, force=True)
        s.outbox.close()
        try:
            self.transport.detach(s.id)
        except Exception:  # a host's failure to let go must not keep the other sessions from closing
            log.exception("fewstep live: detaching session %d failed", s.index)

    def _close_all(self, why: str) -> None:
        with self._lock:
            sessions = list(self._sessions.values())
            self._opening.clear()
        for s in sessions:
            self._close(s, why)
