"""The host's API on a pool: sampling and causal video that look like their single-process versions.

``parallel_sample(pool, handle, ...)`` takes ``sample_latent``'s arguments (``parallel_sample_request`` a
:class:`~..text_to_image.SampleRequest`) and returns the same ``(latent,
SampleReport)``; :class:`RemoteVideoSession` behaves like a ``VideoSession`` whose chunks are computed by the
pool. Everything that can be checked here is checked before a job is sent (inputs, divisibility of heads and
tokens by the degrees, memory for the local workers), so bad input is an ``InputError`` naming the input and the
workers never see it. The workers load the model from ``handle.source`` (a file path, which must exist on every
machine of the pool, or ``dummy:<preset>``) in the handle's dtypes, once, and check that their weights match the
host's.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence

import torch

from ..causal.controls import AppliedControl, ControlQueue
from ..causal.kv_cache import (
    KV_LAYOUTS,
    check_kv_head_dim,
    kv_bytes_per_token,
    kv_cache_bytes,
)
from ..causal.prefill import PrefillResult, prefill_blocks
from ..causal.session import (
    CausalConfig,
    ChunkResult,
    SessionStats,
    VideoSession,
    check_context,
    check_control,
    check_latents,
    check_size,
    check_tiny_vae,
    claim,
)
from ..causal.video_to_video import InputFrames, check_strength
from ..compile.feature import COMPILE_FEATURE
from ..conditioning import TextCondition
from ..errors import InputError
from ..handle import ModelHandle
from ..latent_formats import WAN21
from ..ops import Linear, weight_bytes
from ..preflight.budget import check_fits
from ..sampling import schedule_sigmas
from ..step_cache import STEP_CACHE_FEATURE
from ..text_to_image import SampleReport, SampleRequest, check_sample_inputs
from ..units import format_bytes
from . import transport
from .config import ParallelConfig
from .jobs import dtype_name, fingerprint, request_to_job
from .pool import WorkerPool, get_pool
from .sharding import image_sharding

COMPILE_NOT_APPLIED = "compile: not applied on the pool's workers (they run the model eagerly)"


@dataclasses.dataclass(frozen=True)
class OnPool:
    """``RunOptions.pool``: the run is computed by the worker pool of ``config`` (started if needed), not by this
    process. ``engine.run.placement`` hands it the whole run: an image sampling request (:meth:`sample`) or a
    causal video session (:meth:`open_video_session`); its workers open their share of it as this process
    would (``engine.parallel.jobs``: the same ``open_run`` and session opener, with their sharding)."""

    config: ParallelConfig
    where: str | None = None  # who starts the pool (named in its start-up errors)
    interrupt: Callable[[], None] | None = None  # the host's cancel check while the ranks start
    # the host's own bookkeeping of a pool in use, called with ``config`` each time it is used (ComfyUI: its
    # memory manager, whose unload stops the workers)
    on_use: Callable[[ParallelConfig], None] | None = None

    def __post_init__(self):
        if not isinstance(self.config, ParallelConfig):
            raise InputError(
                "parallel", "expected a FEWSTEP_PARALLEL from FewStepParallelLauncher", self.where
            )

    def pool(self, where: str | None = None) -> WorkerPool:
        """The running pool (started if needed; ``where``: who asks, else :attr:`where`)."""
        pool = get_pool(self.config, where or self.where, interrupt=self.interrupt)
        if self.on_use is not None:
            self.on_use(self.config)
        return pool

    def sample(self, handle: ModelHandle, request: SampleRequest) -> tuple[torch.Tensor, SampleReport]:
        """:func:`parallel_sample_request` on the pool."""
        return parallel_sample_request(self.pool(), handle, request)

    def open_video_session(self, handle: ModelHandle, context: torch.Tensor, height: int, width: int,
                           config: CausalConfig, seed: int, tiny_vae=None, where: str | None = None):  # fmt: skip
        """A :class:`RemoteVideoSession` on the pool (``causal.recipe.open_session`` with this placement)."""
        return RemoteVideoSession(
            self.pool(where), handle, context, height, width, config, seed, tiny_vae, where
        )


def model_spec(handle: ModelHandle) -> dict:
    """How a worker loads the same model: source, dtypes, attention backend, a checksum to compare, and the
    handle's LoRAs (each worker reads the same files, by absolute path, and merges them itself as this process
    does).

    The checksum is of the BASE weights (``engine.lora.base_state_dict``: the host model may hold another
    handle's merged LoRA at this moment) and is taken for every job (not cached): weights changed in place outside
    a LoRA since the last job must make the workers, which load the file, refuse the job rather than return the
    unchanged model's result."""
    model = handle.model
    linear = next((m.weight.dtype for m in model.modules() if isinstance(m, Linear)), handle.dtype)
    return {
        "source": handle.source, "dtype": dtype_name(handle.dtype), "weight_dtype": dtype_name(linear),
        "attention": handle.attention_backend, "seed": 0, "fingerprint": fingerprint(model),
        "weight_bytes": weight_bytes(model),
        "loras": [{"path": os.path.abspath(p.path), "strength": float(p.strength), "digest": float(p.digest)}
                  for p in handle.loras],
    }  # fmt: skip


def check_sequence_parallel(
    degrees: tuple[int, int], heads: int, tokens: int, what: str, input_name: str
) -> None:
    """Heads must split over the Ulysses degree, the sharded tokens over every rank."""
    u, r = degrees
    if heads % u:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise InputError(
            "ulysses_degree",
            f"the model has {heads} attention heads, which do not split over ulysses degree {u}; choose a "
            f"divisor of {heads} ({', '.join(map(str, divisors[:-1]))} or {divisors[-1]}; the ring degree has "
            "no such limit)",
        )
    if tokens % (u * r):
        raise InputError(
            input_name,
            f"{tokens} {what} do not split over ulysses {u} x ring {r} = {u * r} ranks; choose a size whose "
            f"{what} are a multiple of {u * r}",
        )


def check_image_sequence_parallel(
    family: str, params, latent_h: int, latent_w: int, degrees: tuple[int, int]
) -> None:
    """Whether an image model of ``family`` / ``params`` shards a ``latent_h x latent_w`` LATENT over ``degrees``:
    its heads over the Ulysses degree, the tokens its block runner splits (Z-Image: the padded image tokens)
    over every rank. Raises the :class:`InputError` of :func:`check_sequence_parallel`."""
    sharding = image_sharding(family)
    tokens = sharding.sharded_tokens(params, latent_h, latent_w)
    check_sequence_parallel(degrees, sharding.heads(params), tokens, sharding.tokens_described, "latent")


def check_local_workers_fit(pool: WorkerPool, spec: dict) -> None:
    """Before a CPU pool loads a model: the local workers together must fit in this machine's memory.

    The memory preflight's check on the host (``check_fits``: its margin, the cgroup cap and
    ``FEWSTEP_MEMORY_LIMIT_GB`` less what the pack holds, the workers' resident memory included), for what loading
    adds: each local worker's copy of the weights. The workers' baseline was checked when they started
    (``ParallelConfig.check_memory``); GPU workers check their own device before loading
    (``WorkerContext.check_model_fits``), as every rank does."""
    key = (spec["source"], spec["dtype"], spec["weight_dtype"], spec["attention"])
    if pool.model_key == key or pool.backend != "gloo":
        return
    workers, weights = len(pool.procs), int(spec["weight_bytes"])
    check_fits(
        {f"{workers} local workers x {format_bytes(weights)} model weights": workers * weights},
        "cpu",
        "parallel",
        hint="Each local worker loads the whole model: start fewer local ranks (local_ranks, the degrees) and "
        "join the others from other machines, or use a smaller dtype",
    )
    pool.model_key = key


def _refuse_step_cache(handle: ModelHandle) -> None:
    if handle.feature(STEP_CACHE_FEATURE) is not None:
        raise InputError(
            "model",
            "a step cache (FewStepCacheGate) and the worker pool cannot be combined: each rank would decide on "
            "its own tokens; remove the gate or the parallel input",
        )


def parallel_sample(
    pool: WorkerPool,
    handle: ModelHandle,
    positive: Sequence[TextCondition],
    latent: torch.Tensor,
    *,
    degrees: tuple[int, int] | None = None,
    mode: str | None = None,
    comm: dict | None = None,
    **fields,
) -> tuple[torch.Tensor, SampleReport]:
    """``sample_latent`` on the pool: the request's fields as keywords (see :func:`parallel_sample_request`)."""
    request = SampleRequest(positive, latent, **fields)
    return parallel_sample_request(pool, handle, request, degrees=degrees, mode=mode, comm=comm)


def parallel_sample_request(
    pool: WorkerPool,
    handle: ModelHandle,
    request: SampleRequest,
    *,
    degrees: tuple[int, int] | None = None,
    mode: str | None = None,
    comm: dict | None = None,
) -> tuple[torch.Tensor, SampleReport]:
    """``sample`` on the pool: the same request, the same result (see the module docstring).

    ``request.callback`` receives ``{"i": step}`` per finished step (no intermediate latents cross the pool);
    an exception it raises cancels the job on every rank and propagates. ``mode`` ("sp" / "dp") and ``degrees``
    override the pool's for this job (the degrees' product must stay the pool's size). ``comm``, when given, is
    filled with rank 0's communication counts (``CommStats.snapshot()``: bytes sent and calls per collective)."""
    check_sample_inputs(handle, request.positive, request.negative, request.latent, request.sampler)
    _refuse_step_cache(handle)
    # explicit sigmas are checked by the workers' run; a named schedule is built here, once for every rank
    sigmas = request.sigmas
    if sigmas is None:
        sigmas = request.schedule_for(handle)
    latent, callback = request.latent, request.callback
    config = pool.config
    mode = mode or config.mode
    if mode not in ("sp", "dp"):
        raise InputError(
            "mode", f"unknown parallel mode {mode!r}; expected sp (sequence parallel) or dp (data parallel)"
        )
    degrees = job_degrees(pool, degrees)
    if mode == "sp":
        check_image_sequence_parallel(
            handle.family.name, handle.params, int(latent.shape[-2]), int(latent.shape[-1]), degrees
        )
    spec = model_spec(handle)
    check_local_workers_fit(pool, spec)
    job = {
        "kind": "sample", "model": spec, "request": request_to_job(dataclasses.replace(request, sigmas=sigmas)),
        "degrees": list(degrees), "mode": mode,
    }  # fmt: skip

    def on_progress(count: int) -> None:
        for i in range(seen[0], count):
            if callback is not None:
                callback({"i": i})
        seen[0] = count

    seen = [0]
    t0 = time.perf_counter()
    result = pool.run(job, on_progress=on_progress)
    on_progress(result["report"]["steps"])
    wall = time.perf_counter() - t0
    report = SampleReport(**result["report"])
    if comm is not None:
        comm.update(result.get("comm", {}))
    sent = result.get("comm", {}).get("total", 0)
    if handle.feature(COMPILE_FEATURE) is not None:
        report.notes.append(COMPILE_NOT_APPLIED)
    report.notes = [
        *report.notes,
        f"parallel: {_describe(mode, pool.world, degrees)}, backend {pool.backend}; {wall:.3f} s with dispatch; rank 0 sent "
        f"{sent / 2**20:.2f} MiB ({sent / max(1, report.model_calls) / 2**20:.2f} MiB per forward)",
    ]
    return result["latent"], report


def _describe(mode: str, world: int, degrees) -> str:
    if mode == "dp":
        return f"data parallel over {world} ranks"
    return f"sequence parallel ulysses {degrees[0]} x ring {degrees[1]}"


def job_degrees(pool: WorkerPool, degrees) -> tuple[int, int]:
    """The (ulysses, ring) split of a job: the pool's, or an override that uses all of its ranks."""
    if not degrees:
        u, r = pool.config.degrees
        return (u, r) if u * r == pool.world else (1, pool.world)
    u, r = (int(d) for d in degrees)
    if u < 1 or r < 1 or u * r != pool.world:
        raise InputError(
            "parallel", f"ulysses {u} x ring {r} = {u * r} ranks, but the pool has {pool.world}; the degrees' "
            "product must equal the world size",
        )  # fmt: skip
    return u, r


@dataclasses.dataclass(frozen=True)
class RemoteCacheInfo:
    """What the video report reads from a session's KV cache, for one rank's share."""

    per_token: int
    tokens_per_frame: int

    def bytes_per_token(self) -> int:
        return self.per_token


class RemoteVideoSession:
    """A causal video session computed by a pool (sequence parallel): the interface of ``VideoSession`` that
    the video nodes use. Each rank holds its share of the KV cache; rank 0 streams the chunks back.

    Interactive inputs, as ``VideoSession`` takes them, except what a sharded session refuses (a forward that is
    not a chunk's shape: a start latent with a lone first frame, a prompt switch with re-cache; refused here, with
    the engine's message, before any job): :meth:`prefill` with whole chunks is the session's start job (the
    workers commit the frames before any chunk); :meth:`feed` / :meth:`set_strength` keep the input queue here,
    and each job carries exactly the input chunks its chunks restyle (a job makes as many chunks as are queued, the
    next job takes what was fed meanwhile), which the workers feed one chunk ahead; :meth:`control` queues here
    and is sent with the next job, whose first chunk applies it (a control sent while a job runs waits for the
    next job, not only the next chunk)."""

    _keys = itertools.count(1)

    def __init__(self, pool: WorkerPool, handle: ModelHandle, context: torch.Tensor, height: int, width: int,
                 config: CausalConfig | None = None, seed: int = 0, tiny_vae=None, where: str | None = None,
                 degrees: tuple[int, int] | None = None):  # fmt: skip
        config = config or CausalConfig()
        p = handle.params
        if pool.config.mode != "sp":
            raise InputError(
                "parallel",
                "the causal video sampler runs sequence parallel: set the launcher's mode to sp",
                where,
            )
        _refuse_step_cache(handle)
        check_kv_head_dim(config.kv_dtype, p.head_dim, where)  # the config checked the rest when it was built
        check_size(p, height, width, where)
        check_context(p, context, None, where)
        self.degrees = job_degrees(pool, degrees)
        u, r = self.degrees
        grid = (height // 8 // p.patch_size[1], width // 8 // p.patch_size[2])
        tokens = grid[0] * grid[1]
        check_sequence_parallel(
            self.degrees, p.num_heads, tokens, "tokens per latent frame (16x16 px each)", "width"
        )
        if r > 1 and config.kv_dtype != "bf16":
            raise InputError(
                "kv_dtype",
                f"{config.kv_dtype} KV storage with ring degree {r}: use ulysses only, or bf16",
                where,
            )
        if tiny_vae is not None:
            check_tiny_vae(tiny_vae, p, where)
        self.pool, self.handle, self.model = pool, handle, handle.model
        self.config, self.seed, self.where = config, int(seed), where
        self.height, self.width, self.batch = height, width, context.shape[0]
        self.sigmas = schedule_sigmas(config.schedule, config.steps, input_name="schedule")
        self.key = f"{pool.id}-video{next(self._keys)}"
        self.tiny_vae = tiny_vae
        self.decoder = tiny_vae.stream_decoder() if tiny_vae is not None else None
        self.stats = SessionStats()
        # each rank's cache: its ring part of every frame's tokens, its Ulysses part of the heads
        rank_tokens, rank_heads = tokens // r, p.num_heads // u
        full = KV_LAYOUTS["bf16"]
        per_token = kv_bytes_per_token(p.num_layers, rank_heads, p.head_dim, full, handle.dtype.itemsize)
        self.cache = RemoteCacheInfo(per_token, rank_tokens)
        self.kv_bytes_per_rank = kv_cache_bytes(
            p.num_layers, self.batch, rank_tokens, rank_heads, p.head_dim, config.window, handle.dtype,
            config.kv_dtype, config.keep_recent_chunks, config.rope,
        ).window  # fmt: skip
        self.cache_decision = None
        self.frames_generated = 0
        self.started = False
        self.latent_hw = (height // 8, width // 8)
        # video to video: the input queue lives here (bounded as a session's); jobs carry what their chunks take
        self.inputs = InputFrames(self.batch, p.in_dim, self.latent_hw, config.chunk_frames)
        self.strength: float | None = None
        self.controls = ControlQueue()
        self._context = context.float().cpu()
        self._new_prompt = None
        self._taken: dict = {}  # kind -> (control, replaced) sent with the running job, not yet reported applied
        self._disposed = False
        self._in_use = threading.Lock()  # held by the one caller generating

    @property
    def disposed(self) -> bool:
        return self._disposed or self.pool.closed

    @property
    def parallel_summary(self) -> str:
        """One report line: how the pool splits the work (the KV figures of the report are per rank)."""
        line = f"{_describe('sp', self.pool.world, self.degrees)}, backend {self.pool.backend}; KV cache figures are per rank"
        return line if self.handle.feature(COMPILE_FEATURE) is None else f"{line}\n{COMPILE_NOT_APPLIED}"

    @property
    def nbytes(self) -> int:
        """Bytes of KV cache the pool's ranks allocate for this session, all ranks together (what the session
        store's byte-bounded LRU counts): each of the ``ulysses x ring`` ranks holds a ``KVCache`` of its ring part
        of every frame's tokens and its Ulysses part of the heads, ``kv_cache_bytes`` of that layout (int8 / int4
        tiers and the sinks' key copies included). Both splits are exact (checked when the session is made), so
        the sum equals the bytes of the unsplit cache. The ranks' cross-attention caches are not counted."""
        ulysses, ring = self.degrees
        return ulysses * ring * self.kv_bytes_per_rank

    def set_prompt(self, context: torch.Tensor, recache: bool = False) -> None:
        """The next job's prompt (only the cross-attention cache changes, CausVid); ``recache`` is refused as a
        sharded session refuses it."""
        self._check_alive()
        check_context(self.handle.params, context, self.batch, self.where)
        if recache:
            self._refuse_sharded("a prompt switch with recache")
        claim(self._in_use, self.where)  # not while a job runs: its prompt is already sent
        try:
            self._new_prompt = context.float().cpu()
        finally:
            self._in_use.release()

    def _refuse_sharded(self, what: str) -> None:
        # the words of VideoSession._check_unsharded: the workers' sessions would refuse it so
        raise InputError(
            "session",
            f"{what} runs a forward that is not a chunk's shape, which a sharded worker pool does not run; "
            "use one worker",
            self.where,
        )

    def prefill(self, latents: torch.Tensor, before_forward=None) -> PrefillResult:
        """``VideoSession.prefill`` on the pool: the start job commits the clean frames ``[B, C, F, h, w]`` (a
        whole number of chunks) on every rank before any chunk; the start frames are decoded here, as the chunks
        are. ``before_forward(0, None)`` runs here for each prefill forward the workers report."""
        self._check_alive()
        name = "start_latent"
        if self.started or self.frames_generated:
            raise InputError(
                name, f"the session has generated {self.frames_generated} frames already; a start latent is "
                "only taken before the first chunk (start a new session)", self.where,
            )  # fmt: skip
        check_latents(self.handle.params, latents, self.latent_hw, self.batch, name, self.where)
        try:
            blocks = prefill_blocks(latents.shape[2], self.config.chunk_frames, name)
        except InputError as err:
            raise (err.located(self.where) if self.where else err) from None
        if blocks[0] != self.config.chunk_frames:
            self._refuse_sharded("a start latent of one frame more than whole chunks")
        claim(self._in_use, self.where)
        try:
            start = latents.detach().float().cpu().clone()
            hook = None if before_forward is None else (lambda _chunk, _step: before_forward(0, None))
            done = _run_to_end(self._run_job(0, hook, prefill=start))
            info = done["prefill"]
            decoded = None
            if self.decoder is not None:
                with torch.inference_mode():
                    raw = self.tiny_vae.raw_to_latent(WAN21.process_out(start))
                    decoded = self.decoder.push(raw).float().cpu()
                self.stats.frames_decoded += decoded.shape[1]
            return PrefillResult(int(info["frames"]), tuple(info["blocks"]), start, decoded, info["seconds"])
        finally:
            self._in_use.release()

    def feed(self, latents: torch.Tensor) -> int:
        """Queue input latent frames ``[B, C, F, h, w]`` (model latent space) for video to video, here; each
        chunk's job carries its ``chunk_frames`` of them. Returns the frames queued now."""
        self._check_alive()
        return self.inputs.push(latents, self.where)

    def set_strength(self, strength: float | None) -> None:
        """Video to video from the next chunk at ``strength`` (0, 1] (None: text to video)."""
        if strength is not None:
            try:
                strength = check_strength(strength)
            except InputError as err:
                raise (err.located(self.where) if self.where else err) from None
        self.strength = strength

    def control(self, kind: str, value, recache: bool = False) -> int:
        """Queue a control (``prompt`` without re-cache, ``strength``, ``seed``), checked now; sent with the
        next job, applied at its first chunk. Returns its sequence number."""
        self._check_alive()
        value = check_control(self.handle.params, kind, value, self.batch, self.where)
        if kind == "prompt":
            if recache:
                self._refuse_sharded("a prompt switch with recache")
            value = value.float().cpu()
        return self.controls.put(kind, value, recache)

    def dispose(self) -> None:
        if not self._disposed and not self.pool.closed:
            self.pool.drop_sessions.append(self.key)  # freed on the workers with the next job
        self._disposed = True
        self.decoder = None

    def _chunk_limit(self) -> int:
        """The most a chunk (or the job's result) of this session can be: its latent frames at 4 bytes a value,
        with up to 64 latent channels at 1/8 of the size (Wan 2.1 has 16), plus the record around them."""
        height, width = -(-self.height // 8), -(-self.width // 8)
        values = self.batch * self.config.chunk_frames * 64 * height * width
        return transport.RECORD_BYTES + 4 * values + transport.message_limit({"context": self._context})

    def _check_alive(self) -> None:
        if self.disposed:
            raise InputError(
                "session",
                "this session was disposed, or its worker pool was stopped (freed memory, an error, or the "
                "launcher's settings changed); run the video sampler again",
                self.where,
            )

    def chunks(self, n: int, before_forward=None):
        """Generate ``n`` more chunks on the pool, yielding each as rank 0 streams it back.

        ``before_forward(chunk, None)`` runs on this host each time the workers report a forward (they report one
        before every DiT forward): an exception it raises (ComfyUI's Cancel) cancels the job, and the workers stop
        within one forward, as an in-process :class:`VideoSession` does. Text to video is one job; video to video
        one job per run of queued input chunks (what is fed while a job's chunks are yielded goes with the next)."""
        self._check_alive()
        if n < 1:
            raise InputError("chunks", f"expected at least 1 chunk, got {n}", self.where)
        claim(self._in_use, self.where)  # one caller at a time, as an in-process session
        try:
            left = n
            while left:
                count = self._job_chunks(left)
                yield from self._run_job(count, before_forward)
                left -= count
        finally:
            self._in_use.release()

    def _job_chunks(self, left: int) -> int:
        """How many of ``left`` chunks the next job makes: all of them in text to video, else as many as the
        queued input covers (the engine's refusal when it covers none)."""
        strength = self.strength
        for control in self.controls.pending():  # a strength control takes effect at the job's first chunk
            if control.kind == "strength":
                strength = control.value
        if strength is None:
            return left
        c = self.config.chunk_frames
        ready = len(self.inputs) // c
        if not ready:
            raise InputError(
                "input_video",
                f"chunk {self.stats.chunks_generated} restyles an input chunk (video to video at strength "
                f"{strength:g}) but {len(self.inputs)} of its {c} input latent frames are queued; feed the input "
                "first",
                self.where,
            )
        return min(left, ready)

    def _run_job(self, n: int, before_forward, prefill: torch.Tensor | None = None):
        job = {"kind": "video", "model": model_spec(self.handle), "key": self.key, "chunks": int(n),
               "degrees": list(self.degrees), "strength": self.strength}  # fmt: skip
        new_prompt = self._new_prompt
        if new_prompt is not None:  # a prompt set before the first job is the one the session starts with
            self._context = new_prompt
        if not self.started:
            job.update(start=True, context=self._context, height=self.height, width=self.width, seed=self.seed,
                       config=dataclasses.asdict(self.config))  # fmt: skip
        elif new_prompt is not None:
            job["context"] = new_prompt
        if prefill is not None:
            job["prefill"] = prefill
        if n:
            taken = self.controls.take()
            job["controls"] = [{"kind": c.kind, "value": c.value, "recache": c.recache} for c, _ in taken]
            strength = next((c.value for c, _ in taken if c.kind == "strength"), self.strength)
            if strength is not None:  # the input chunks this job's chunks restyle, oldest first
                job["inputs"] = torch.stack(self.inputs.state()[: n * self.config.chunk_frames], dim=2)
        else:
            taken = []
        self._taken = {c.kind: (c, replaced) for c, replaced in taken}  # reported back with the chunks
        try:
            check_local_workers_fit(self.pool, job["model"])
        except BaseException:
            self._requeue_controls()
            raise
        pool = self.pool
        n_job = pool.submit(job, self._chunk_limit())
        self.started, self._new_prompt = True, None
        events = pool.events(n_job, "causal video")
        forwards = 0  # reported by the workers so far
        try:
            while True:
                try:
                    kind, payload = next(events)
                except StopIteration as done:
                    self.frames_generated = done.value["frames_generated"]
                    return done.value
                if kind == "chunk":
                    yield self._chunk(payload)
                elif kind == "progress" and before_forward is not None:
                    for _ in range(payload - forwards):  # polls may see several forwards at once
                        before_forward(self.stats.chunks_generated, None)
                    forwards = payload
        except GeneratorExit:
            pool.cancel(
                n_job
            )  # the consumer stopped (ComfyUI's interrupt): stop the ranks at their next forward
            self._disposed = True
            raise
        except InputError:
            self._requeue_controls()  # the session goes on: what did not take effect is sent again
            raise
        except BaseException:
            pool.cancel(n_job)
            self._disposed = True
            raise

    def _requeue_controls(self) -> None:
        taken, self._taken = self._taken, {}
        if taken:
            self.controls.requeue(list(taken.values()))

    def _chunk(self, payload: dict) -> ChunkResult:
        latents = payload["latents"]
        frames = None
        if self.decoder is not None:  # as VideoSession decodes, here on the host (push moves it to the VAE)
            raw = WAN21.process_out(latents.float())
            with torch.inference_mode():
                frames = self.decoder.push(self.tiny_vae.raw_to_latent(raw)).float().cpu()
        controls = tuple(self._applied(item) for item in payload.get("controls", ()))
        mode = payload.get("mode", "t2v")
        chunk = ChunkResult(
            index=payload["index"], start_frame=payload["start_frame"], latents=latents, frames=frames,
            seconds=payload["seconds"], commit_seconds=payload["commit_seconds"], kv_bytes=payload["kv_bytes"],
            kv_bytes_used=payload["kv_bytes_used"], mode=mode, strength=payload.get("strength"),
            controls=controls,
        )  # fmt: skip
        if mode == "v2v":
            self.inputs.drop()  # restyled: its input frames leave the queue
        self.frames_generated = chunk.start_frame + self.config.chunk_frames
        self.stats.record(chunk)  # bounded: timings only, the chunk goes to the caller
        return chunk

    def _applied(self, item: dict) -> AppliedControl:
        """A control the workers applied, under this host's sequence number; its effect mirrored here."""
        control, replaced = self._taken.pop(item["kind"])
        if control.kind == "strength":
            self.strength = control.value
        elif control.kind == "seed":
            self.seed = control.value
        else:
            self._context = control.value
        applied = AppliedControl(
            control.kind, control.sequence, item["chunk"], control.recache, replaced, item["detail"]
        )
        self.controls.record(applied)
        return applied

    run = VideoSession.run  # the same loop over ``self.chunks(n)``


def _run_to_end(job):
    """Run a job generator that yields no chunk to its end; its result."""
    try:
        while True:
            next(job)
    except StopIteration as done:
        return done.value
