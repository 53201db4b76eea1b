"""Many realtime video streams of one model on one device: their chunks batched into one forward per denoising step.

A :class:`SessionPool` serves one shape group (size, chunk frames, window, sinks, KV storage, RoPE mode, schedule
and steps): up to ``slots`` streams (:class:`PoolSession`) whose KV windows live in one :class:`~.kv_cache.KVSlotPool`
allocated once, and whose text keys / values live in per-slot rows of the pool beside them. Sessions join, switch
prompts, leave, are suspended to host memory and resumed at chunk boundaries; each keeps its own seed, generator,
prompt, position and stream decoder.

A tick (:meth:`SessionPool.tick`) is vLLM's scheduling step brought to causal video: the batch is rebuilt from the
sessions whose next chunk is due (active, the consumer has taken its last chunk, chunks still wanted), taken in
round-robin order (the session served longest ago first) and cut into batches of at most the largest bucket. Each
batch runs the deferred clean-context commit of the sessions that have one (one batched forward), then the
chunk's denoising steps (one batched forward each), at the smallest bucket size that holds it (``buckets``: static
shapes, so a compiled or CUDA-graph step is captured once per bucket; padded rows write nowhere anyone reads and
are dropped). Every row attends only to its own slot (fill state, sinks, RoPE offset, quantized tier), reads its
own prompt's rows and draws its noise from its own generator: a session's video equals its solo
:class:`~.session.VideoSession` run with the same seed, prompt and config whatever shares the batch: bit for bit on
the CPU, because nothing a row computes depends on the other rows (Wan embeds each row on its own; a row whose window
is full attends unmasked beside filling rows, ``BatchedKV``); ``tests/engine/causal/test_session_pool.py``.

Admission is by bytes: the pool's memory (every slot's KV window by the KV cache's one formula, the prompt rows,
the activations of the largest bucket, the stream decoders) is checked by the memory preflight before anything is
allocated, and ``slots`` is what fits the budget. A join finds a free slot or takes a suspended session's; when
none is free it is refused (an :class:`InputError` with the bytes of a slot and the pool's) or, with
``wait=True``, queued and admitted at a later tick when a slot frees. Nothing is allocated past the pool's
storage: memory is flat over any run of joins and leaves.

Interactive sessions (issue 32), per session inside the batches, each as its solo :class:`~.session.VideoSession`
does it and with its formulas (``session.py``: ``commit_prefill``, ``chunk_sigmas`` / ``chunk_start``,
``apply_controls``): :meth:`SessionPool.prefill` commits start frames (image to video, video extension) by solo
eager forwards on the session's own slot cache before its first chunk; :meth:`SessionPool.feed` and
:meth:`SessionPool.set_strength` make it restyle input chunks (video to video); :meth:`SessionPool.set_prompt`
with ``recache`` switches its prompt with a KV re-cache (its pending chunk committed under the old prompt, then
one solo forward over its window's frames on its slot, ``prompt_switch.recache_window``);
:meth:`SessionPool.control` queues a prompt / strength / seed control applied at its next chunk boundary and
reported on that chunk. Rows of one batch share one sigma list, so a tick groups its due sessions by the strength
their chunk runs at (text to video one group, video to video one per strength: ``TickReport.strengths``), each
group cut into batches as above; video-to-video rows commit the K/V of their last step (no clean-context pass). A
video-to-video session with less than a chunk of input queued is not due: the tick skips it and reports it
(``TickReport.starved``). Each slot keeps its session's clean latents of the window
(:class:`~.kv_cache.CleanFrames`, allocated with the slots, counted in a slot's bytes and in admission).

Swap: :meth:`SessionPool.suspend` moves a session's whole state (``session_state.SessionState``: every K/V buffer
with its scales and sink copies, its prompt rows, the clean latents awaiting commit and those of its window, the
generator, the position and the stream decoder) to host memory and frees its slot (its queued input frames and
controls stay on the session: a client may feed or steer a suspended session); :meth:`SessionPool.resume` restores it into any free
slot and the video continues exactly. :meth:`SessionPool.suspend_idle` is the simple policy: a session whose
consumer has not taken its last chunk for ``timeout`` seconds is suspended.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..checks import check_seed
from ..errors import InputError
from ..latent_formats import WAN21
from ..preflight.budget import check_fits, memory_budget
from ..preflight.ledger import LEDGER, session_bytes_on
from ..run import Run
from ..sampling import sample_dmd, schedule_sigmas
from ..units import format_bytes
from .controls import AppliedControl, ControlQueue
from .kv_cache import BatchedKV, CleanFrames, KVSlotPool, check_kv_head_dim
from .prefill import PrefillResult, prefill_blocks
from .prompt_switch import RecacheReport, check_recache, recache_window
from .session import (
    RECENT_CHUNKS,
    CausalConfig,
    ChunkResult,
    SessionStats,
    apply_controls,
    check_context,
    check_control,
    check_latents,
    check_size,
    check_tiny_vae,
    chunk_sigmas,
    chunk_start,
    commit_prefill,
    run_parts,
    session_bytes,
)
from .session_state import SessionState, capture_state, restore_state, take_host_parts, with_host_parts
from .video_to_video import InputFrames

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8)
VIDEO_FPS = 16  # Wan 2.1's frame rate: a chunk of c latent frames is 4c video frames, due every 4c / 16 s
# TickHook(step): before every batched forward of a tick (step None: the clean-context commit); a host's Cancel
TickHook = Callable[["int | None"], None]


@dataclass(frozen=True)
class PoolTiming:
    """What a pool session remembers of a chunk (no tensors): when it was due, how long it waited for its batch,
    how long until it was done, the batch it ran in and whether it met its deadline."""

    index: int
    start_frame: int
    tick: int
    batch: int  # sessions in the batch (before padding)
    bucket: int  # the batch's bucketed size
    waited: float  # seconds from due to the start of its batch
    latency: float  # seconds from due to done
    deadline_met: bool


@dataclass
class PoolSessionStats(SessionStats):
    deadlines_met: int = 0
    pool_recent: deque[PoolTiming] = field(default_factory=lambda: deque(maxlen=RECENT_CHUNKS))


class PoolSession:
    """One stream of a :class:`SessionPool` (a handle: every operation goes through the pool)."""

    def __init__(self, pool: SessionPool, key: str, seed: int, chunks: int | None):
        self.pool, self.key, self.seed = pool, key, seed
        self.state = "waiting"  # waiting (for a slot) | active | suspended | closed
        self.why = ""  # why it was suspended or closed
        self.slot: int | None = None
        self.cache = None  # its slot's KVCache (views of the pool's storage) while it holds a slot
        self.generator = torch.Generator(device=pool.device).manual_seed(seed)
        self.pending: torch.Tensor | None = None  # the last chunk's clean latents, not yet committed
        self.decoder = None if pool.tiny_vae is None else pool.tiny_vae.stream_decoder()
        self.stats = PoolSessionStats()
        self.chunks_left = chunks  # None: until it leaves
        self.outbox: ChunkResult | None = None  # its newest chunk until the consumer takes it
        self.due_since = time.perf_counter()  # when its next chunk became due
        self._done_at = 0.0  # when its newest chunk was done
        self.last_served = -1  # the tick that last gave it a chunk (round-robin order)
        self.context: torch.Tensor | None = (
            None  # the prompt as given (re-embedded on resume into a new slot)
        )
        self.next_context: torch.Tensor | None = None  # a prompt switch taking effect at the next chunk
        self.saved: SessionState | None = None  # host copy while suspended
        self.error: InputError | None = None  # why it stopped, when the pool stopped it
        self.resume_when_taken = (
            False  # suspended by the idle policy: queued to resume once its chunk is taken
        )
        self.next_recache = False  # the waiting prompt switch re-caches the window (LongLive)
        # interactive state, kept on the session (host memory) whether it holds a slot or not
        self.clean: CleanFrames | None = None  # its slot's clean latents of the window, while it holds a slot
        self.inputs = InputFrames(1, pool.model.params.in_dim, pool.latent_hw, pool.config.chunk_frames)
        self.strength: float | None = None  # None: text to video; else each chunk restyles an input chunk
        self.controls = ControlQueue()
        self.unreported: list[AppliedControl] = []  # applied, not yet reported on a chunk
        self.recache_report: RecacheReport | None = None  # the last re-cache, reported with the next chunk

    @property
    def frames_generated(self) -> int:
        if self.saved is not None:
            return self.saved.frames_generated
        committed = 0 if self.cache is None else self.cache.frames_committed
        return committed + (0 if self.pending is None else self.pool.config.chunk_frames)

    def take(self) -> ChunkResult | None:
        """The consumer takes the session's newest chunk (its next chunk is due from now on)."""
        chunk, self.outbox = self.outbox, None
        if chunk is not None:
            self.due_since = time.perf_counter()
        return chunk

    @property
    def ready(self) -> bool:
        return self.state == "active" and self.outbox is None and self.chunks_left != 0

    def __repr__(self) -> str:
        return f"PoolSession({self.key}, {self.state}, slot {self.slot}, {self.frames_generated} frames)"


@dataclass(frozen=True)
class TickReport:
    """One tick: the chunks it produced (by session key), its batches' sizes and buckets, and its seconds."""

    tick: int
    chunks: dict[str, ChunkResult]
    batches: tuple[int, ...]
    buckets: tuple[int, ...]
    seconds: float
    failed: dict[str, str]  # sessions the tick stopped (non-finite output), with why
    # the strength each batch ran at (None: text to video): rows of one batch share one sigma list
    strengths: tuple[float | None, ...] = ()
    # video-to-video sessions that were due but had fewer than a chunk of input frames queued: skipped
    starved: tuple[str, ...] = ()


class SessionPool:
    """Several causal video streams of one model batched per denoising step (see the module docstring)."""

    def __init__(
        self,
        model,
        height: int,
        width: int,
        config: CausalConfig | None = None,
        max_sessions: int = 8,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        tiny_vae=None,
        max_bytes: int | None = None,
        fps: float = VIDEO_FPS,
        idle_timeout: float | None = None,
        max_suspended: int | None = None,
        max_waiting: int = 64,
        where: str | None = None,
        run: Run | None = None,
    ):
        """``max_sessions``: the most slots wanted; fewer are allocated when the memory budget (``max_bytes``,
        else the memory preflight's) holds fewer, and none past it. ``buckets``: the batch sizes a forward runs at
        (sorted; sizes above the slot count are dropped). ``idle_timeout``: the swap policy, applied at every tick
        (:meth:`suspend_idle`; None: off): a session whose consumer leaves its chunk untaken that long is suspended,
        and resumed (queued like a join) once the consumer takes it. ``max_suspended`` (default: the slot count)
        bounds the sessions holding a host copy (suspended, or queued to resume) and ``max_waiting`` the joins
        queued for a slot, so the host memory of a pool is bounded too. ``run``: as for :class:`~.session.VideoSession` (its
        backends, weights keeper and cancel check); a sharded run (a worker pool's rank) is refused."""
        p = model.params
        self.where = where
        self._ensure_weights, self.blocks, self.backends, self.base_model = run_parts(model, run)
        if self.blocks.sharding is not None:
            raise InputError("pool", "a session pool runs on one device; this run is sharded over a worker "
                             "pool (run it without sequence parallelism)", where)  # fmt: skip
        config = config or CausalConfig()
        self.model, self.config, self.fps, self.idle_timeout = model, config, fps, idle_timeout
        for name, value in (("max_suspended", max_suspended), ("max_waiting", max_waiting)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise InputError(name, f"expected a count >= 0, got {value!r}", where)
        check_kv_head_dim(config.kv_dtype, p.head_dim, where)
        check_size(p, height, width, where)
        if tiny_vae is not None:
            check_tiny_vae(tiny_vae, p, where)
        if not isinstance(max_sessions, int) or max_sessions < 1:
            raise InputError("max_sessions", f"expected at least 1 session, got {max_sessions!r}", where)
        if not buckets or any(not isinstance(b, int) or b < 1 for b in buckets):
            raise InputError("buckets", f"batch sizes must be positive integers, got {buckets!r}", where)
        self.height, self.width = height, width
        self.latent_hw = (height // 8, width // 8)
        self.grid_hw = (self.latent_hw[0] // p.patch_size[1], self.latent_hw[1] // p.patch_size[2])
        self.sigmas = schedule_sigmas(config.schedule, config.steps, input_name="schedule")
        self.device = next(model.parameters()).device
        self.dtype = model.patch_embedding.weight.dtype
        self.tiny_vae = tiny_vae
        tokens = self.grid_hw[0] * self.grid_hw[1]
        self.tokens_per_frame = tokens
        self.slot_bytes = self._slot_bytes()
        slots = self._slots_that_fit(max_sessions, buckets, max_bytes)
        self.buckets = tuple(sorted({b for b in buckets if b <= slots} | {min(max(buckets), slots)}))
        self.max_batch = self.buckets[-1]
        check_fits(self.bytes_needed(slots, self.max_batch), self.device, "max_sessions", where,
                   hint="Use fewer max_sessions, a smaller window_frames or a smaller width / height")  # fmt: skip
        self.kv = KVSlotPool(p.num_layers, slots, tokens, p.num_heads, p.head_dim, config.storage, self.dtype,
                             self.device, config.rope)  # fmt: skip
        # every slot's text keys / values, [slots, text_len, H, D] per layer (a row per session's prompt)
        self.cross = [
            tuple(torch.zeros(slots, p.text_len, p.num_heads, p.head_dim, dtype=self.dtype, device=self.device)
                  for _ in range(2))
            for _ in range(p.num_layers)
        ]  # fmt: skip
        self._batched = {b: BatchedKV(self.kv, b) for b in self.buckets}
        # every slot's clean latents of its window (a prompt switch's re-cache recomputes their K/V)
        self.clean_slots = [CleanFrames(config.window, 1, p.in_dim, self.latent_hw, self.device)
                            for _ in range(slots)]  # fmt: skip
        self._free_slots = list(range(slots))
        self.max_suspended = slots if max_suspended is None else max_suspended
        self.max_waiting = max_waiting
        self.sessions: dict[str, PoolSession] = {}
        self._waiting: deque[tuple[PoolSession, torch.Tensor]] = deque()
        self._keys = itertools.count(1)
        self.ticks = 0
        self.tick_log: deque[tuple[int, tuple[int, ...], float]] = deque(maxlen=RECENT_CHUNKS)
        self._lock = threading.RLock()
        self.closed = False
        LEDGER.hold(self, "session pool", session_bytes_on)

    # -- bytes and admission -------------------------------------------------------------------------------------
    def _slot_bytes(self) -> dict[str, int]:
        """One session's share: its KV window (the one formula), its prompt rows, its clean latents, its stream
        decoder."""
        p, c = self.model.params, self.config
        parts = session_bytes(p, 1, self.height, self.width, c, self.dtype, self.tokens_per_frame, p.num_heads,
                              self.tiny_vae)  # fmt: skip
        elt = self.dtype.itemsize
        return {
            "KV window": parts["KV window"],
            "prompt rows": 2 * p.num_layers * p.text_len * p.dim * elt,
            "clean latents": parts["clean latents"],
            "stream decoder": parts.get("stream decoder activations", 0) + parts.get("decoded frames", 0),
        }

    def bytes_needed(self, slots: int, batch: int) -> dict[str, int]:
        """The pool's bytes for ``slots`` sessions run ``batch`` at a time, by part (the preflight's parts)."""
        p = self.model.params
        one = session_bytes(p, 1, self.height, self.width, self.config, self.dtype, self.tokens_per_frame,
                            p.num_heads, None)  # fmt: skip
        kv = KVSlotPool.bytes_for(p.num_layers, slots, self.tokens_per_frame, p.num_heads, p.head_dim,
                                  self.config.storage, self.dtype, self.config.rope)  # fmt: skip
        return {
            "KV slots": kv,
            "prompt rows": slots * self.slot_bytes["prompt rows"],
            "clean latents": slots * self.slot_bytes["clean latents"],
            "batch activations": batch * (one["chunk activations"] + one["prompt padding"]),
            "stream decoders": slots * self.slot_bytes["stream decoder"],
        }

    def _slots_that_fit(self, wanted: int, buckets, max_bytes: int | None) -> int:
        budget = memory_budget(self.device).usable if max_bytes is None else int(max_bytes)
        per = sum(self.slot_bytes.values())
        slots = wanted
        while slots > 0 and sum(self.bytes_needed(slots, min(max(buckets), slots)).values()) > budget:
            slots -= 1
        if slots == 0:
            need = self.bytes_needed(1, 1)
            raise InputError(
                "max_sessions",
                f"not one session fits: a session needs about {format_bytes(sum(need.values()))} ("
                + ", ".join(f"{k} {format_bytes(v)}" for k, v in need.items() if v)
                + f") and the budget is {format_bytes(budget)}; refused before allocating. Use a smaller "
                "window_frames, kv_dtype int8 / int4, or a smaller width / height",
                self.where,
            )
        if slots < wanted:
            log.info("fewstep: session pool of %d slots (%d wanted; %s each, budget %s)", slots, wanted,
                     format_bytes(per), format_bytes(budget))  # fmt: skip
        return slots

    @property
    def host_bytes(self) -> int:
        """Bytes of the host copies of suspended sessions (bounded by ``max_suspended``)."""
        return sum(s.saved.nbytes for s in list(self.sessions.values()) if s.saved is not None)

    @property
    def slots(self) -> int:
        return self.kv.slots

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds on its device: the KV slots, the prompt rows and the clean latents."""
        if self.closed:
            return 0
        cross = sum(k.nbytes + v.nbytes for k, v in self.cross)
        return self.kv.nbytes + cross + sum(c.nbytes for c in self.clean_slots)

    # -- joining and leaving -------------------------------------------------------------------------------------
    def join(
        self, context: torch.Tensor, seed: int = 0, chunks: int | None = None, wait: bool = False
    ) -> PoolSession:
        """A new session with prompt ``context [1, L, 4096]`` and ``seed``, for ``chunks`` chunks (None: until it
        leaves). It takes a free slot, else a suspended session's (kept on the host); when every slot holds an
        active session it is refused, or with ``wait`` queued until a slot frees (its state is then
        ``"waiting"``)."""
        with self._lock:
            self._check_open()
            check_context(self.model.params, context, 1, self.where)
            try:
                seed = check_seed(seed)
            except InputError as err:
                raise err.located(self.where) if self.where else err from None
            if chunks is not None and (not isinstance(chunks, int) or chunks < 1):
                raise InputError("chunks", f"expected at least 1 chunk (or None: until it leaves), got {chunks!r}",
                                 self.where)  # fmt: skip
            if not self._free_slots:  # refused before it takes a key: keys count sessions
                if not wait:
                    raise self._full_error()
                if sum(s.saved is None for s, _ in self._waiting) >= self.max_waiting:
                    raise InputError("pool", f"all {self.slots} slots hold active sessions and {self.max_waiting} "
                                     "joins already wait for one (max_waiting); try again later", self.where)  # fmt: skip
            session = PoolSession(self, f"s{next(self._keys)}", seed, chunks)
            session.context = context
            if self._admit(session, context):
                return session
            if not wait:
                raise self._full_error()
            self._waiting.append((session, context))
            self.sessions[session.key] = session
            return session

    def join_saved(
        self, state: SessionState, seed: int, chunks: int | None = None, wait: bool = False
    ) -> PoolSession:
        """A new session continuing a saved state (a snapshot's, ``engine.causal.snapshot.join_from_snapshot``,
        checked against this pool's model and shape group by its reader): it joins as a resume does, into a free
        slot, or refused / queued (``wait``) when none is free."""
        with self._lock:
            self._check_open()
            session = PoolSession(self, f"s{next(self._keys)}", seed, chunks)
            # its queued inputs and controls live on the session, as a suspended one's do
            session.saved, session.state = take_host_parts(state, session, pooled=True), "suspended"
            self.sessions[session.key] = session
            try:
                self.resume(session, wait=wait)
            except BaseException:
                self.sessions.pop(session.key, None)
                session.state, session.saved = "closed", None
                raise
            return session

    def state_of(self, session: PoolSession) -> SessionState:
        """``session``'s whole state between ticks (a copy on the host; a suspended session's host copy itself),
        for a snapshot (``engine.causal.snapshot.save_pool_session``)."""
        with self._lock:
            self._check_member(session)
            if session.next_context is not None:
                raise InputError("session", f"{session.key} has a prompt switch waiting for its next chunk; save "
                                 "it after that chunk", self.where)  # fmt: skip
            if session.state == "suspended":
                return with_host_parts(session.saved, session, pooled=True)
            if session.state != "active":
                raise InputError(
                    "session", f"{session.key} is {session.state}: it has no state to save", self.where
                )
            self._ensure_weights()
            return capture_state(session, self)

    def check_open(self) -> None:
        """An :class:`InputError` once the pool is closed."""
        self._check_open()

    def ensure_weights(self) -> None:
        """The pool's weights as its run computes with them (a handle's LoRA merged back if another run unmerged it)."""
        self._ensure_weights()

    def _full_error(self) -> InputError:
        per = sum(self.slot_bytes.values())
        return InputError(
            "pool",
            f"all {self.slots} slots hold active sessions; a session needs about {format_bytes(per)} ("
            + ", ".join(f"{k} {format_bytes(v)}" for k, v in self.slot_bytes.items() if v)
            + f") and the pool holds {format_bytes(self.nbytes)} for {self.slots}: join with wait=True to be "
            "admitted when a slot frees, or suspend or close a session",
            self.where,
        )

    def _admit(self, session: PoolSession, context: torch.Tensor | None) -> bool:
        slot = self._take_slot()
        if slot is None:
            return False
        self.sessions[session.key] = session
        session.slot, session.state = slot, "active"
        session.cache = self.kv.slot_cache(slot, self.backends)
        session.clean = self.clean_slots[slot]
        session.clean.load_state(
            torch.zeros((), dtype=session.clean.latents.dtype), [None] * len(session.clean.frames)
        )
        try:
            if session.saved is not None:  # a resumed session: its state goes back into this slot
                restore_state(session.saved, session, self)
                session.saved = None
            else:
                self._fill_prompt(session, context)
        except BaseException:
            # a half-restored slot must not run as an active session: the slot frees again, a resume stays
            # suspended with its host copy (it can be resumed again), a join is no member
            self._release_slot(session)
            if session.saved is not None:
                session.state = "suspended"
            else:
                session.state = "closed"
                self.sessions.pop(session.key, None)
            raise
        session.due_since = time.perf_counter()
        return True

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop(0)
        return None

    def _release_slot(self, session: PoolSession) -> None:
        if session.slot is not None:
            self._free_slots.append(session.slot)
            self._free_slots.sort()
        session.slot, session.cache, session.clean = None, None, None

    def _fill_prompt(self, session: PoolSession, context: torch.Tensor) -> None:
        self._ensure_weights()
        with torch.inference_mode():
            embedded = self.model.embed_context(context.to(self.device))
            for block, (k_rows, v_rows) in zip(self.model.blocks, self.cross):
                k, v = block.cross_attn.context_kv(embedded, self.backends)
                k_rows[session.slot].copy_(k[0])
                v_rows[session.slot].copy_(v[0])
        session.context = context

    def set_prompt(self, session: PoolSession, context: torch.Tensor, recache: bool = False) -> None:
        """Switch ``session``'s prompt from its next chunk on. Without ``recache`` CausVid's switch: its KV window
        carries on. With ``recache`` (LongLive): at its next chunk boundary its pending chunk is committed under
        the old prompt, then its window's K/V are recomputed under the new one (a solo forward on its slot,
        ``engine.causal.prompt_switch``), reported on that chunk's ``ChunkResult.recache``. A newer switch
        replaces one still waiting."""
        with self._lock:
            self._check_member(session)
            check_context(self.model.params, context, 1, self.where)
            if recache:
                self._check_recache(session)
            session.next_context, session.next_recache = context, bool(recache)

    def _check_recache(self, session: PoolSession) -> None:
        """A re-cache needs its frames' clean latents (checked on an active session; a suspended one's are
        checked when it is resumed into a slot, at its boundary)."""
        if session.cache is not None and session.clean is not None:
            pending = 0 if session.pending is None else session.pending.shape[2]
            check_recache(session.cache, session.clean, pending, self.where)

    # -- interactive inputs: a start, input video, controls (as VideoSession's, per session) -----------------------
    def prefill(self, session: PoolSession, latents: torch.Tensor) -> PrefillResult:
        """Start ``session`` from clean latent frames ``[1, C, F, h, w]`` (model latent space): image to video or
        video extension (``engine.causal.prefill``), committed into its slot by solo forwards on the plain model
        (no batched or compiled step is recompiled). Only before its first chunk, while it holds a slot; a prompt
        switch waiting for its next chunk takes effect first."""
        name = "start_latent"
        with self._lock:
            self._check_member(session)
            if session.state != "active":
                raise InputError(name, f"{session.key} is {session.state}: a start latent is committed into a "
                                 "slot; prefill the session once it is active", self.where)  # fmt: skip
            if session.frames_generated:
                raise InputError(
                    name, f"{session.key} has generated {session.frames_generated} frames already; a start "
                    "latent is only taken before the first chunk (join a new session)", self.where,
                )  # fmt: skip
            c = self.config.chunk_frames
            check_latents(self.model.params, latents, self.latent_hw, 1, name, self.where)
            try:
                blocks = prefill_blocks(latents.shape[2], c, name)
            except InputError as err:
                raise (err.located(self.where) if self.where else err) from None
            self._ensure_weights()
            with torch.inference_mode():
                self._switch_prompt(session, None)
                t0 = time.perf_counter()
                x_all = latents.to(self.device, torch.float32)

                def forward(x, start, _whole_chunk):
                    self._solo_forward(session, x, 0.0, start)

                start = commit_prefill(blocks, x_all, c, forward, session.cache, session.clean)
                decoded = None
                if session.decoder is not None:
                    raw = self.tiny_vae.raw_to_latent(WAN21.process_out(x_all))
                    decoded = session.decoder.push(raw).float().cpu()
                    session.stats.frames_decoded += decoded.shape[1]
                return PrefillResult(start, tuple(blocks), x_all.cpu(), decoded, time.perf_counter() - t0)

    def feed(self, session: PoolSession, latents: torch.Tensor) -> int:
        """Queue input latent frames ``[1, C, F, h, w]`` (model latent space) for ``session``'s video to video;
        each of its chunks takes ``chunk_frames`` of them. Returns the frames queued now."""
        with self._lock:
            self._check_member(session)
            return session.inputs.push(latents, self.where)

    def set_strength(self, session: PoolSession, strength: float | None) -> None:
        """``session`` restyles its input from its next chunk at ``strength`` (0, 1] (None: back to text to
        video), now; a live client queues it with :meth:`control`. A video-to-video session is due only with a
        chunk of input queued (else a tick skips it: ``TickReport.starved``)."""
        with self._lock:
            self._check_member(session)
            session.strength = check_control(self.model.params, "strength", strength, 1, self.where)

    def control(self, session: PoolSession, kind: str, value, recache: bool = False) -> int:
        """Queue a control on ``session`` (``engine.causal.controls``: ``prompt`` with ``recache`` or not,
        ``strength``, ``seed``), checked now, applied at its next chunk boundary and reported on that chunk's
        ``ChunkResult.controls``; returns its sequence number. Does not wait for a running tick (the queue is
        thread-safe)."""
        self._check_member(session)
        value = check_control(self.model.params, kind, value, 1, self.where)
        if kind == "prompt" and recache:
            self._check_recache(session)
        return session.controls.put(kind, value, recache)

    def leave(self, session: PoolSession, why: str = "left") -> None:
        """Close ``session`` and free its slot (or its place in the queue, or its host copy)."""
        with self._lock:
            if session.state == "closed":
                return
            self._waiting = deque((s, c) for s, c in self._waiting if s is not session)
            self._release_slot(session)
            session.state, session.why = "closed", why
            session.saved = session.pending = session.decoder = session.outbox = None
            session.inputs.clear()
            session.controls.take()
            self.sessions.pop(session.key, None)
            self._admit_waiting()

    # -- swap ------------------------------------------------------------------------------------------------
    def suspend(self, session: PoolSession, why: str = "suspended") -> SessionState:
        """Move ``session``'s whole state to host memory and free its slot (at a chunk boundary: between ticks).
        Returns the host copy (kept by the session until :meth:`resume`)."""
        with self._lock:
            self._check_member(session)
            if session.state != "active":
                raise InputError("session", f"{session.key} is {session.state}, not active: it holds no slot",
                                 self.where)  # fmt: skip
            held = [s for s in self.sessions.values() if s.saved is not None]
            if len(held) >= self.max_suspended:
                raise InputError(
                    "session",
                    f"{len(held)} sessions already wait in host memory ({format_bytes(self.host_bytes)}); the pool "
                    f"keeps at most {self.max_suspended} (max_suspended): resume or close one first",
                    self.where,
                )
            session.saved = capture_state(session, self, device="cpu", host_parts=False)
            self._release_slot(session)
            session.pending = None
            session.state, session.why = "suspended", why
            self._admit_waiting()
            return session.saved

    def resume(self, session: PoolSession, wait: bool = False) -> bool:
        """Restore a suspended session into a free slot; False (``wait``) when none is free yet (it is then
        queued and resumed at a later tick), else an :class:`InputError` when none is free."""
        with self._lock:
            self._check_member(session)
            if session.state != "suspended":
                raise InputError("session", f"{session.key} is {session.state}, not suspended", self.where)
            if self._admit(session, None):
                return True
            if not wait:
                raise self._full_error()
            session.state = "waiting"
            self._waiting.append((session, None))
            return False

    def suspend_idle(self, timeout: float, now: float | None = None) -> list[PoolSession]:
        """The simple policy: suspend every active session whose consumer has left its newest chunk untaken for
        ``timeout`` seconds. Returns them."""
        now = time.perf_counter() if now is None else now
        with self._lock:  # a join or leave of another thread must not change the sessions while they are read
            idle = [s for s in self.sessions.values()
                    if s.state == "active" and s.outbox is not None and now - s._done_at >= timeout]  # fmt: skip
            held = sum(s.saved is not None for s in self.sessions.values())
            idle = idle[: max(0, self.max_suspended - held)]  # the host copies stay bounded (max_suspended)
            for s in idle:
                self.suspend(s, f"its consumer took no chunk for {timeout:g} s")
                s.resume_when_taken = True
            return idle

    def _admit_waiting(self) -> None:
        """Admit queued joins and resumes while slots are free; a queued one takes a suspended session's slot
        only when none is free (suspended sessions hold no slot: their slots are free already)."""
        while self._waiting and self._free_slots:
            session, context = self._waiting.popleft()
            self._admit(session, context)

    # -- ticks ---------------------------------------------------------------------------------------------------
    def ready(self) -> list[PoolSession]:
        """Sessions whose next chunk is due, the one served longest ago first (round-robin)."""
        ready = [s for s in list(self.sessions.values()) if s.ready]  # a copy: another thread may join
        # ties (never served, or served at the same tick) in the order the sessions joined: "s10" joined after "s2"
        return sorted(ready, key=lambda s: (s.last_served, int(s.key[1:])))

    def tick(self, before_forward: TickHook | None = None) -> TickReport:
        """One chunk for every session whose next chunk is due, in batches of at most the largest bucket. Each
        chunk goes to its session's outbox (and the report); the consumer takes it with ``session.take()``."""
        with self._lock:
            self._check_open()
            if self.idle_timeout is not None:
                self.suspend_idle(self.idle_timeout)
            for s in self.sessions.values():  # idle ones whose consumer came back: queued like a join
                if s.state == "suspended" and s.resume_when_taken and s.outbox is None:
                    s.state, s.resume_when_taken = "waiting", False
                    self._waiting.append((s, None))
            self._admit_waiting()
            self._ensure_weights()
            t0 = time.perf_counter()
            chunks, failed, sizes, buckets, strengths = {}, {}, [], [], []
            groups, starved = self._due_groups(before_forward)
            for strength, due in groups.items():
                for i in range(0, len(due), self.max_batch):
                    batch = due[i : i + self.max_batch]
                    bucket = next(b for b in self.buckets if b >= len(batch))
                    produced, stopped = self._run_batch(batch, bucket, before_forward, strength)
                    chunks.update(produced)
                    failed.update(stopped)
                    sizes.append(len(batch))
                    buckets.append(bucket)
                    strengths.append(strength)
            seconds = time.perf_counter() - t0
            report = TickReport(self.ticks, chunks, tuple(sizes), tuple(buckets), seconds, failed,
                                tuple(strengths), tuple(starved))  # fmt: skip
            self.tick_log.append((self.ticks, tuple(sizes), seconds))
            self.ticks += 1
            return report

    @torch.inference_mode()
    def _due_groups(self, before_forward: TickHook | None) -> tuple[dict, list[str]]:
        """The ready sessions at their chunk boundary: each one's waiting prompt switch and queued controls
        applied (they may change its mode), then grouped by the strength their chunk runs at (rows of a batch
        share one sigma list: text to video is one group, video to video one per strength), each group in
        round-robin order. A video-to-video session with less than a chunk of input queued is not due:
        skipped, reported as starved (its applied controls are reported with its next chunk)."""
        groups: dict[float | None, list[PoolSession]] = {}
        starved = []
        for s in self.ready():
            self._switch_prompt(s, before_forward)
            self._apply_controls(s, before_forward)
            if s.strength is not None and not s.inputs.ready():
                starved.append(s.key)
                continue
            groups.setdefault(s.strength, []).append(s)
        return groups, starved

    def _switch_prompt(self, session: PoolSession, before_forward: TickHook | None) -> None:
        """The switch :meth:`set_prompt` left waiting for ``session``'s next chunk boundary."""
        if session.next_context is not None:
            self._switch_to(session, session.next_context, session.next_recache, before_forward)
            session.next_context, session.next_recache = None, False

    def _switch_to(
        self, session: PoolSession, context, recache: bool, before_forward
    ) -> RecacheReport | None:
        if recache:
            self._check_recache(session)
            self._commit_pending([session], before_forward)  # its pending chunk's K/V under the old prompt
        self._fill_prompt(session, context)
        if not recache:
            return None
        if before_forward is not None:
            before_forward(None)
        session.recache_report = recache_window(
            self.base_model, session.cache, session.clean, self._no_context(1), self._slot_cross([session]),
            self.config.context_noise, self.grid_hw, self.model.frame_rope, self.backends, self.blocks(None),
        )  # fmt: skip
        return session.recache_report

    def _apply_controls(self, session: PoolSession, before_forward: TickHook | None) -> None:
        def reseed(seed: int) -> None:
            session.generator.manual_seed(seed)
            session.seed = seed

        apply_controls(
            session.controls, session.stats.chunks_generated, session.unreported,
            lambda context, recache: self._switch_to(session, context, recache, before_forward),
            lambda strength: setattr(session, "strength", strength), reseed,
        )  # fmt: skip

    def _no_context(self, rows: int) -> torch.Tensor:
        """The ``context_embedded`` of a forward whose text keys / values come from the prompt rows (its
        dtype is all the model reads of it)."""
        return torch.empty(rows, 0, self.model.params.dim, dtype=self.dtype, device=self.device)

    def _slot_cross(self, sessions: list[PoolSession]) -> _SlotCross:
        return _SlotCross(self.cross, torch.tensor([s.slot for s in sessions], device=self.device))

    def _solo_forward(
        self, session: PoolSession, x: torch.Tensor, timestep: float, start: int
    ) -> torch.Tensor:
        """One eager forward over ``x``'s frames at ``start`` on ``session``'s own slot cache (a prefill's block:
        a lone frame is a partial ``begin``), writing their K/V; as a solo session's forward."""
        frames = x.shape[2]
        session.cache.begin(start, frames, self.grid_hw, self.model.frame_rope)
        t = torch.full((1, frames), float(timestep), dtype=torch.float32, device=x.device)
        return self.base_model(x, t, context_embedded=self._no_context(1), kv=session.cache,
                               cross_kv=self._slot_cross([session]), block_runner=self.blocks(None),
                               backends=self.backends)  # fmt: skip

    def _commit_pending(self, committing: list[PoolSession], before_forward: TickHook | None) -> None:
        """The deferred clean-context passes of ``committing`` (each with a pending chunk), one batched forward."""
        committing = [s for s in committing if s.pending is not None]
        if not committing:
            return
        if before_forward is not None:
            before_forward(None)
        self._begin(committing)
        bucket = next(b for b in self.buckets if b >= len(committing))
        x = self._padded([s.pending for s in committing], bucket)
        self._forward(committing, bucket, x, self.config.context_noise)
        for s in committing:
            s.cache.commit()
            s.pending = None

    def _noise(self, session: PoolSession, shape) -> torch.Tensor:
        g = session.generator
        return torch.randn(shape, generator=g, device=g.device, dtype=torch.float32)

    @torch.inference_mode()
    def _forward(self, batch: list[PoolSession], bucket: int, x: torch.Tensor, timestep) -> torch.Tensor:
        """One batched forward over the chunks of ``batch`` (each session's cache has ``begin`` its chunk)."""
        kv = self._batched[bucket]
        kv.prepare([s.slot for s in batch], [s.cache for s in batch])
        c = self.config.chunk_frames
        rows = kv.row_slots
        cross = _SlotCross(self.cross, rows)
        t = torch.as_tensor(timestep, dtype=torch.float32, device=x.device).reshape(-1, 1).expand(bucket, c)
        return self.model(x, t, context_embedded=self._no_context(bucket), kv=kv, cross_kv=cross, block_runner=self.blocks(None),
                          backends=self.backends)  # fmt: skip

    def _begin(self, batch: list[PoolSession]) -> None:
        c = self.config.chunk_frames
        for s in batch:
            s.cache.begin(s.cache.frames_committed, c, self.grid_hw, self.model.frame_rope)

    def _padded(self, parts: list[torch.Tensor], bucket: int) -> torch.Tensor:
        x = torch.cat(parts)
        if bucket > len(parts):
            x = torch.cat([x, x.new_zeros(bucket - len(parts), *x.shape[1:])])
        return x

    # in inference mode throughout, as a solo session's chunk: the commit pass's input (the pending latents
    # padded into a batch) is then an inference tensor like the steps' input, so a compiled step is not
    # recompiled for the other dispatch key set each phase
    @torch.inference_mode()
    def _run_batch(self, batch: list[PoolSession], bucket: int, before_forward: TickHook | None,
                   strength: float | None = None):  # fmt: skip
        """One chunk for each session of ``batch``, all text to video (``strength`` None) or all video to video
        at ``strength`` (their input chunks queued)."""
        c = self.config.chunk_frames
        shape = (1, self.model.params.in_dim, c, *self.latent_hw)
        started = time.perf_counter()
        rng = [s.generator.get_state() for s in batch]
        try:
            self._commit_pending(batch, before_forward)
            commit_s = time.perf_counter() - started
            self._begin(batch)
            sigmas = chunk_sigmas(self.sigmas, strength).to(self.device)
            n = len(batch)
            finite_steps: list[torch.Tensor] = []

            def noise(*_):
                return self._padded([self._noise(s, shape) for s in batch], bucket)

            def denoised(x, sigma, **_):
                if before_forward is not None:
                    before_forward(len(finite_steps))
                out = x - sigma.view(-1, 1, 1, 1, 1) * self._forward(batch, bucket, x, sigma[0] * 1000.0)
                finite_steps.append(torch.isfinite(out[:n]).flatten(1).all(1))
                return out

            with torch.inference_mode():
                source = None
                if strength is not None:
                    source = self._padded([s.inputs.peek().to(self.device) for s in batch], bucket)
                x = chunk_start(sigmas, strength, noise(), source)
                x0 = sample_dmd(denoised, x, sigmas, noise_sampler=noise, disable=True)
        except BaseException:
            for s, state in zip(batch, rng):  # as a solo session: the chunk can be run again
                s.generator.set_state(state)
            raise
        latents_all = x0[:n].float().cpu()
        finite = torch.stack(finite_steps).all(0).tolist()
        produced, stopped = {}, {}
        for row, s in enumerate(batch):
            start = s.cache.frames_committed
            if not finite[row]:
                err = InputError("model", f"{s.key}: chunk {s.stats.chunks_generated} (latent frames {start}-"
                                 f"{start + c - 1}): the denoised latents hold NaN or infinite values; the session "
                                 "was stopped", self.where)  # fmt: skip
                s.error = err
                stopped[s.key] = str(err)
                self.leave(s, "non-finite output")
                continue
            clean = x0[row : row + 1]
            if strength is None:
                s.pending = clean  # its clean-context pass is deferred to its next chunk
            else:  # video to video: the last step's K/V stay (StreamDiffusionV2), no clean-context pass
                s.cache.commit()
                s.inputs.drop()
            s.clean.write(start, clean)
            frames = None
            if s.decoder is not None:
                raw = self.tiny_vae.raw_to_latent(WAN21.process_out(clean.float()))
                frames = s.decoder.push(raw).float().cpu()
            finished = time.perf_counter()
            chunk = ChunkResult(
                index=s.stats.chunks_generated, start_frame=start, latents=latents_all[row : row + 1],
                frames=frames, seconds=finished - started, commit_seconds=commit_s, kv_bytes=s.cache.nbytes,
                kv_bytes_used=s.cache.bytes_used(), mode="t2v" if strength is None else "v2v", strength=strength,
                controls=tuple(s.unreported), recache=s.recache_report,
            )  # fmt: skip
            s.unreported, s.recache_report = [], None
            s.stats.record(chunk)
            deadline = (4 * c - (3 if chunk.index == 0 else 0)) / self.fps
            latency = finished - s.due_since
            timing = PoolTiming(chunk.index, start, self.ticks, len(batch), bucket,
                                max(0.0, started - s.due_since), latency, latency <= deadline)  # fmt: skip
            s.stats.deadlines_met += timing.deadline_met
            s.stats.pool_recent.append(timing)
            s.outbox, s._done_at, s.last_served = chunk, finished, self.ticks
            if s.chunks_left is not None:
                s.chunks_left -= 1
            produced[s.key] = chunk
        return produced, stopped

    # -- lifecycle -------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise InputError("pool", "this session pool was closed; open a new one", self.where)

    def _check_member(self, session: PoolSession) -> None:
        self._check_open()
        if session.pool is not self or session.state == "closed":
            raise InputError("session", f"{session.key} is not a live session of this pool", self.where)

    def close(self) -> None:
        """Close every session and free the pool's storage."""
        with self._lock:
            for s in list(self.sessions.values()):
                self.leave(s, "pool closed")
            self.closed = True
            self.kv = None
            self.cross = []
            self.clean_slots = []
            self._batched = {}

    def report(self) -> dict:
        """Per tick batch sizes and seconds (the recent ones), and per session its chunks and deadlines."""
        return {
            "slots": self.slots,
            "buckets": list(self.buckets),
            "ticks": [{"tick": t, "batches": list(b), "seconds": s} for t, b, s in list(self.tick_log)],
            "sessions": {
                k: {
                    "state": s.state,
                    "chunks": s.stats.chunks_generated,
                    "deadlines_met": s.stats.deadlines_met,
                }
                for k, s in list(self.sessions.items())  # a copy: read while another thread joins or leaves
            },
        }


class _SlotCross:
    """The ``cross_kv`` of a batched forward: each row's prompt keys / values, gathered by slot."""

    def __init__(self, rows_by_layer, row_slots: torch.Tensor):
        self.rows_by_layer, self.row_slots = rows_by_layer, row_slots

    def layer(self, index: int):
        k, v = self.rows_by_layer[index]
        return k.index_select(0, self.row_slots), v.index_select(0, self.row_slots)

    def capture_state(self) -> tuple:
        return tuple((k.data_ptr(), v.data_ptr()) for k, v in self.rows_by_layer) + (
            self.row_slots.data_ptr(),
        )
