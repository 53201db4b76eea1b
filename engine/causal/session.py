"""Chunk-by-chunk causal video generation as a session that can run on, switch prompts and stream its output.

Per chunk of ``chunk_frames`` latent frames: fresh noise, then N denoising steps of the DMD re-noise sampler on
the ``wan-dmd-4step`` schedule (each step attends to the KV cache and rewrites the chunk's slots), then the chunk
is handed out (latents, and frames when a tiny VAE is attached). Its clean-context pass (``clean_context``: the
model run once more on the clean chunk at timestep ``context_noise``, which commits the chunk's K/V) is deferred until the next
chunk starts: a stream that stops never pays for it, and one that continues later gets exactly the same video.

A :class:`VideoSession` owns everything that lives across chunks: the KV cache, the cross-attention cache, the
frame position, the prompt, the random generator, the clean latents of the window and the control queue.
``set_prompt`` switches the prompt as CausVid does (only the cross-attention cache is rebuilt; the self-attention
cache carries the video on), or with ``recache`` as LongLive does (``prompt_switch.py``); ``dispose`` frees it.
Interactive sessions (``docs/interactive-video.md``): ``prefill`` starts from clean frames (``prefill.py``),
``feed`` / ``set_strength`` restyle input chunks (``video_to_video.py``), ``control`` queues a prompt, strength or
seed for the next chunk boundary (``controls.py``).

Memory stays flat for a stream of any length: a session keeps only what the next chunk needs (the caches, the
last chunk's clean latents until its deferred commit, the stream decoder's state) and bounded statistics
(:class:`SessionStats`); each chunk's latents and frames belong to the caller once yielded. Before allocating,
the session's bytes are estimated and refused when they cannot fit the device (:func:`check_session_fits`).

One caller at a time: a session refuses a second concurrent ``chunks`` / ``set_prompt`` (another thread, or a
second generator interleaved with an unfinished one) with an :class:`InputError` rather than corrupting its cache.
``before_forward(chunk, step)`` runs before every DiT forward (``step`` None for the clean-context pass), so a
host's Cancel stops within one forward (within one transformer block with a cancel check in the run's options:
``engine.run``); a chunk interrupted that way leaves the session as it was before the
chunk (the random generator is restored), so continuing it later gives the uninterrupted video. Each chunk's
output is checked once for NaN / Inf (one read back with the copy to the CPU, no per-step sync).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ..backends import DEFAULT_BACKENDS
from ..checks import check_finite, check_finite_number, check_image_size, check_seed
from ..errors import InputError
from ..latent_formats import WAN21
from ..preflight.budget import check_fits
from ..preflight.ledger import LEDGER, session_bytes_on
from ..run import Run, RunBlocks
from ..sampling import sample_dmd, schedule_sigmas
from ..vae.tiny import variants_for
from .clean_context import clean_context_pass
from .controls import AppliedControl, ControlQueue
from .kv_cache import (
    KV_LAYOUTS,
    CleanFrames,
    CrossAttentionCache,
    KVCache,
    KVStorage,
    WindowSpec,
    check_kv_head_dim,
    clean_frames_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
)
from .prefill import PrefillResult, prefill_blocks
from .prompt_switch import RecacheReport, check_recache, recache_window
from .video_to_video import InputFrames, check_strength, noised_input, v2v_sigmas

# ``before_forward(chunk index, denoising step or None for the clean-context pass)``, called before every forward
ForwardHook = Callable[[int, "int | None"], None]

RECENT_CHUNKS = 64  # chunk timings a session keeps (a caller that wants every chunk's timing keeps its own)


@dataclass(frozen=True)
class CausalConfig:
    chunk_frames: int = 3
    window_frames: int = 21  # Self-Forcing attends to the whole 21-latent-frame video
    sink_frames: int = 0
    schedule: str = "wan-dmd-4step"
    steps: int | None = None  # None: the schedule's own count
    context_noise: float = 0.0  # timestep (0..1000 scale) of the clean-context pass
    rope: str = "cache"
    kv_dtype: str = "bf16"  # bf16: the compute dtype, unquantized; int8 / int4: see kv_cache
    keep_recent_chunks: int = 1  # int8 / int4: completed chunks kept in the compute dtype

    def __post_init__(self):
        """Checked once, here: the window, the KV storage settings and the clean-context timestep (an
        :class:`InputError` naming the input, which the node or command that built the config locates). What
        depends on the model (int4 needs an even head_dim) is checked when a session opens."""
        window = WindowSpec(self.chunk_frames, self.window_frames, self.sink_frames)
        # frozen: the one WindowSpec and the one KVStorage of this config, each checked when built
        object.__setattr__(self, "_storage", KVStorage(window, self.kv_dtype, self.keep_recent_chunks))
        check_finite_number(self.context_noise, "context_noise")
        if not 0 <= self.context_noise <= 1000:
            raise InputError(
                "context_noise",
                f"{self.context_noise} is not a timestep in [0, 1000] (0: the clean chunk, as Self-Forcing commits)",
            )

    @property
    def window(self) -> WindowSpec:
        return self._storage.window

    @property
    def storage(self) -> KVStorage:
        """The KV cache's storage settings (the window, ``kv_dtype``, ``keep_recent_chunks``): a ``KVCache``
        takes them as they are, unchecked."""
        return self._storage


@dataclass
class ChunkResult:
    index: int
    start_frame: int
    latents: torch.Tensor  # [B, C, F, h, w] in the model's latent space, float32, on the CPU
    frames: torch.Tensor | None  # [B, k, 3, H, W] in [0, 1] when a tiny VAE is attached
    seconds: float  # from the end of the previous chunk (includes its deferred commit)
    commit_seconds: float  # the previous chunk's clean-context pass, run at the start of this one
    kv_bytes: int  # allocated by the self-attention cache (quantized storage with its scales included)
    kv_bytes_used: int  # occupied slots
    step_cache: object = None  # step-cache telemetry of the chunk, when a gate was forced on
    mode: str = "t2v"  # "v2v": restyled from an input chunk (engine.causal.video_to_video)
    strength: float | None = None  # v2v: the sigma the input chunk was noised to
    controls: tuple[AppliedControl, ...] = ()  # controls that took effect at this chunk's start
    recache: RecacheReport | None = (
        None  # a prompt switch's re-cache run at this chunk's start (or before it)
    )

    @property
    def raw(self) -> torch.Tensor:
        """ComfyUI's raw Wan 2.1 VAE latent (per-channel mean/std undone)."""
        return WAN21.process_out(self.latents)


@dataclass(frozen=True)
class ChunkTiming:
    """What a session remembers of a chunk it handed out (no tensors)."""

    index: int
    start_frame: int
    seconds: float
    commit_seconds: float
    kv_bytes: int
    kv_bytes_used: int

    @classmethod
    def of(cls, chunk: ChunkResult) -> ChunkTiming:
        return cls(chunk.index, chunk.start_frame, chunk.seconds, chunk.commit_seconds, chunk.kv_bytes,
                   chunk.kv_bytes_used)  # fmt: skip


@dataclass
class SessionStats:
    """Bounded statistics: counts and totals, and the timings of the last ``RECENT_CHUNKS`` chunks."""

    chunks_generated: int = 0
    frames_decoded: int = 0  # video frames the tiny VAE has produced (0 without one)
    seconds_total: float = 0.0
    first_chunk_seconds: float | None = None
    recent: deque[ChunkTiming] = field(default_factory=lambda: deque(maxlen=RECENT_CHUNKS))

    def record(self, chunk: ChunkResult) -> ChunkTiming:
        timing = ChunkTiming.of(chunk)
        if self.first_chunk_seconds is None:
            self.first_chunk_seconds = chunk.seconds
        self.chunks_generated += 1
        self.frames_decoded += 0 if chunk.frames is None else chunk.frames.shape[1]
        self.seconds_total += chunk.seconds
        self.recent.append(timing)
        return timing


class VideoSession:
    """A causal video stream of a Wan-family model (see the module docstring)."""

    def __init__(
        self,
        model,
        context: torch.Tensor,
        height: int,
        width: int,
        config: CausalConfig | None = None,
        seed: int = 0,
        tiny_vae=None,
        where: str | None = None,
        run: Run | None = None,
    ):
        """``run``: the run this session computes in (``engine.run.open_run``; :func:`..recipe.open_session`
        opens it), whose forward ``model`` is. The session starts no feature itself; from the run it takes:
        ``backends`` (attention, norms, RoPE and KV quantization), ``weights_keeper`` (called before the session's
        weights are read, each prompt and each call of :meth:`chunks`, so the handle's LoRA stays merged when
        another handle ran the model in between), ``blocks`` (the block runner around every forward: the cancel
        check between blocks, and on a rank of a worker pool the sharding's runner, whose layout the cache then
        holds: this rank's share of each frame's tokens and of the heads), the chunk step cache
        (:meth:`engine.run.Run.chunk_step_cache`) and ``base_model`` (the engine model ``model`` stands for when it
        is a compiled wrapper, so a host can free the sessions of a model it unloads). It keeps none of the run's
        handle (see ``Run.weights_keeper``). None: ``model`` runs plain, eager, in one process, with the default
        backends."""
        p = model.params
        self._ensure_weights, self.blocks, self.backends, self.base_model = run_parts(model, run)
        config = config or CausalConfig()
        self.model, self.config, self.where = model, config, where
        check_kv_head_dim(config.kv_dtype, p.head_dim, where)  # the config checked the rest when it was built
        check_size(p, height, width, where)
        check_context(p, context, None, where)
        if tiny_vae is not None:
            check_tiny_vae(tiny_vae, p, where)
        try:
            seed = check_seed(seed)
        except InputError as err:
            raise (err.located(where) if where else err) from None
        self.seed = seed  # what a snapshot records (engine.causal.snapshot)
        self.latent_hw = (height // 8, width // 8)
        self.grid_hw = (self.latent_hw[0] // p.patch_size[1], self.latent_hw[1] // p.patch_size[2])
        self.sigmas = schedule_sigmas(config.schedule, config.steps, input_name="schedule")
        self.device = device = next(model.parameters()).device
        self.dtype = model.patch_embedding.weight.dtype
        self.batch = context.shape[0]
        tokens_per_frame, heads = self.grid_hw[0] * self.grid_hw[1], p.num_heads
        if self.blocks.sharding is not None:  # a rank of a worker pool: its share of the tokens and heads
            tokens_per_frame, heads = self.blocks.sharding.kv_layout(tokens_per_frame, heads)
        check_session_fits(
            session_bytes(p, self.batch, height, width, config, self.dtype, tokens_per_frame, heads, tiny_vae),
            device, where,
        )  # fmt: skip
        self.cache = KVCache(
            layers=p.num_layers, batch=self.batch, tokens_per_frame=tokens_per_frame,
            heads=heads, head_dim=p.head_dim, storage=config.storage, dtype=self.dtype, device=device,
            rope=config.rope, backends=self.backends,
        )  # fmt: skip
        self.cross = CrossAttentionCache()
        # the clean latents of the frames the cache holds: a prompt switch's re-cache recomputes their K/V
        self.clean = CleanFrames(config.window, self.batch, p.in_dim, self.latent_hw, device)
        self.inputs = InputFrames(self.batch, p.in_dim, self.latent_hw, config.chunk_frames)  # video to video
        self.strength: float | None = None  # None: text to video; else each chunk restyles an input chunk
        self.controls = ControlQueue()
        self._unreported: list[AppliedControl] = []  # applied before a chunk that has not completed yet
        self._recache: RecacheReport | None = None  # the last re-cache, reported with the next chunk
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.tiny_vae, self.decoder = tiny_vae, None if tiny_vae is None else tiny_vae.stream_decoder()
        # the run's step cache for chunks (engine.run.ChunkStepCache; normally refused: DMD re-noises every step)
        self.chunk_cache = None if run is None else run.chunk_step_cache(self.sigmas, "dmd")
        self.stats = SessionStats()
        self._pending: torch.Tensor | None = None  # the last chunk's clean latents, not yet committed
        self._context = None
        self._frames_at_dispose = 0
        self._in_use = threading.Lock()  # held by the one caller generating or switching the prompt
        self.disposed = False
        # its caches count in the memory ledger while it is alive and not disposed (nbytes is 0 then)
        LEDGER.hold(self, "session", session_bytes_on)
        self.set_prompt(context)

    # -- state -----------------------------------------------------------------------------------------------------
    @property
    def frames_generated(self) -> int:
        if self.cache is None:
            return self._frames_at_dispose
        return self.cache.frames_committed + (0 if self._pending is None else self.config.chunk_frames)

    @property
    def cache_decision(self):
        """The step-cache gate's verdict on this session's chunks (None without a gate)."""
        return None if self.chunk_cache is None else self.chunk_cache.decision

    @property
    def nbytes(self) -> int:
        if self.cache is None:
            return 0
        context = 0 if self._context is None else self._context.nbytes
        return self.cache.nbytes + self.cross.nbytes + context + self.clean.nbytes + self.inputs.nbytes

    def set_prompt(self, context: torch.Tensor, recache: bool = False) -> RecacheReport | None:
        """Use ``context [B, L, 4096]`` from the next chunk on, now (between chunks; a live client queues it
        with :meth:`control` instead). Without ``recache`` only the cross-attention cache changes (CausVid): the
        self-attention cache carries the video on. With ``recache`` the pending chunk is committed under the
        old prompt, then the window's K/V are recomputed under the new one (LongLive;
        ``engine.causal.prompt_switch``); returns what that cost."""
        self._check_alive()
        check_context(self.model.params, context, self.batch, self.where)
        self._claim()
        try:
            self._check_alive()
            self._ensure_weights()
            with torch.inference_mode():
                return self._switch_prompt(context, recache, None, None)
        finally:
            self._release()

    def _check_recache(self) -> None:
        pending = 0 if self._pending is None else self._pending.shape[2]
        check_recache(self.cache, self.clean, pending, self.where)

    def _switch_prompt(self, context, recache: bool, chunk_index, before_forward) -> RecacheReport | None:
        if recache:
            self._check_unsharded("a prompt switch with recache")
            self._check_recache()
            self._commit(chunk_index or 0, before_forward)  # the pending chunk's K/V under the old prompt
        self._context = self.model.embed_context(context.to(self.device))
        # every layer's text K/V now, outside the steps (a step only reads them: no host branch on it)
        self.cross.fill(self.model.blocks, self._context, self.backends)  # in place: a captured step replays
        if not recache:
            return None
        if before_forward is not None:
            before_forward(chunk_index, None)
        report = recache_window(
            self.base_model, self.cache, self.clean, self._context, self.cross, self.config.context_noise,
            self.grid_hw, self._rope_fn(), self.backends, self.blocks(None),
        )  # fmt: skip
        self._recache = report
        return report

    # -- interactive inputs: a start, input video, controls ------------------------------------------------------
    def prefill(self, latents: torch.Tensor, before_forward: ForwardHook | None = None) -> PrefillResult:
        """Start from clean latent frames ``[B, C, F, h, w]`` (model latent space; ``ChunkResult.raw`` is the
        inverse): image to video (1 frame) or video extension (``engine.causal.prefill``). Only before the
        first chunk."""
        self._check_alive()
        name = "start_latent"
        if self.frames_generated:
            raise InputError(
                name, f"the session has generated {self.frames_generated} frames already; a start latent is "
                "only taken before the first chunk (start a new session)", self.where,
            )  # fmt: skip
        self._check_latents(latents, name)
        # located here: prefill_blocks knows the input, not the node or command that gave it
        blocks = _located(lambda frames: prefill_blocks(frames, self.config.chunk_frames, name), self.where)(
            latents.shape[2]
        )
        if blocks[0] != self.config.chunk_frames:
            self._check_unsharded("a start latent of one frame more than whole chunks")
        self._claim()
        try:
            self._check_alive()
            self._ensure_weights()
            with torch.inference_mode():
                t0 = time.perf_counter()
                # a copy made here is an inference tensor, as a chunk's are: the caller's own tensor (which .to
                # returns as is when already float32 on the device) would be a new guard for a compiled step
                x_all = latents.to(self.device, torch.float32, copy=True)

                def forward(x, start, whole_chunk):
                    if before_forward is not None:
                        before_forward(0, None)
                    self._velocity(x, 0.0, start, model=self.model if whole_chunk else self.base_model)

                start = commit_prefill(
                    blocks, x_all, self.config.chunk_frames, forward, self.cache, self.clean
                )
                decoded = None
                if self.decoder is not None:
                    raw = self.tiny_vae.raw_to_latent(WAN21.process_out(x_all))
                    decoded = self.decoder.push(raw).float().cpu()
                    self.stats.frames_decoded += decoded.shape[1]
                return PrefillResult(start, tuple(blocks), x_all.cpu(), decoded, time.perf_counter() - t0)
        finally:
            self._release()

    def feed(self, latents: torch.Tensor) -> int:
        """Queue input latent frames ``[B, C, F, h, w]`` (model latent space) for video to video; each chunk
        takes ``chunk_frames`` of them. Returns the frames queued now."""
        self._check_alive()
        return self.inputs.push(latents, self.where)

    def set_strength(self, strength: float | None) -> None:
        """Video to video from the next chunk at ``strength`` (0, 1] (None: back to text to video), now; a live
        client queues it with :meth:`control`."""
        self.strength = None if strength is None else _located(check_strength, self.where)(strength)

    def control(self, kind: str, value, recache: bool = False) -> int:
        """Queue a control (``engine.causal.controls``: ``prompt`` with ``recache`` or not, ``strength``,
        ``seed``), checked now, applied at the next chunk boundary; returns its sequence number."""
        self._check_alive()
        value = check_control(self.model.params, kind, value, self.batch, self.where)
        if kind == "prompt" and recache:  # now: refused at the boundary, it would be requeued at every chunk
            self._check_unsharded("a prompt switch with recache")
            self._check_recache()
        return self.controls.put(kind, value, recache)

    def _apply_controls(self, index: int, before_forward) -> None:
        def reseed(seed: int) -> None:
            self.generator.manual_seed(seed)
            self.seed = seed

        apply_controls(
            self.controls, index, self._unreported,
            lambda context, recache: self._switch_prompt(context, recache, index, before_forward),
            lambda strength: setattr(self, "strength", strength), reseed,
        )  # fmt: skip

    def _check_latents(self, latents, name: str) -> None:
        check_latents(self.model.params, latents, self.latent_hw, self.batch, name, self.where)

    def _check_unsharded(self, what: str) -> None:
        if self.blocks.sharding is not None:
            raise InputError(
                "session",
                f"{what} runs a forward that is not a chunk's shape, which a sharded worker pool does not run; "
                "use one worker",
                self.where,
            )

    def dispose(self) -> None:
        """Free the caches; the session cannot be continued afterwards. While a call is generating (another
        thread), the caches are freed when its current chunk ends and that call stops with an error."""
        self.disposed = True
        if self._in_use.acquire(blocking=False):
            try:
                self._free()
            finally:
                self._in_use.release()

    def _free(self) -> None:
        if self.cache is not None:
            self._frames_at_dispose = self.frames_generated
        self.cache = self.cross = self._context = self._pending = self.decoder = None
        self.clean = None
        if self.inputs is not None:
            self.inputs.clear()

    def _claim(self) -> None:
        claim(self._in_use, self.where)

    def _release(self) -> None:
        self._in_use.release()
        # disposed while this call held it: free now (checked after releasing, so that a dispose racing with the
        # release either sees the session free and frees it itself, or is seen here)
        if self.disposed and self._in_use.acquire(blocking=False):
            try:
                self._free()
            finally:
                self._in_use.release()

    def _check_alive(self) -> None:
        if self.disposed:
            raise InputError(
                "session",
                "this session was disposed (or evicted to free memory); start a new one",
                self.where,
            )

    # -- generation ------------------------------------------------------------------------------------------------
    def _rope_fn(self):
        rope_fn = self.model.frame_rope
        if self.blocks.sharding is not None:  # this rank's frames of the sharded tokens
            rope_fn = self.blocks.sharding.frame_rope(rope_fn)
        return rope_fn

    def _velocity(
        self, x: torch.Tensor, timestep: float | torch.Tensor, start: int, block_runner=None, model=None
    ) -> torch.Tensor:
        """One forward over ``x``'s frames at ``start`` (a chunk; a prefill's lone frame runs on ``model``, the
        plain one), writing their K/V."""
        frames = x.shape[2]
        block_runner = self.blocks(block_runner)
        self.cache.begin(start, frames, self.grid_hw, self._rope_fn())
        t = (
            torch.as_tensor(timestep, dtype=torch.float32, device=x.device)
            .reshape(-1, 1)
            .expand(self.batch, frames)
        )
        return (model or self.model)(
            x,
            t,
            context_embedded=self._context,
            kv=self.cache,
            cross_kv=self.cross,
            block_runner=block_runner,
            backends=self.backends,
        )

    def _commit(self, chunk_index: int, before_forward: ForwardHook | None) -> float:
        if self._pending is None:
            return 0.0
        if before_forward is not None:
            before_forward(chunk_index, None)
        t0 = time.perf_counter()
        clean_context_pass(self._velocity, self.cache, self._pending, self.config.context_noise)
        self._pending = None
        return time.perf_counter() - t0

    def _noise(self, shape) -> torch.Tensor:
        return torch.randn(shape, generator=self.generator, device=self.generator.device, dtype=torch.float32)

    def chunks(self, n: int, before_forward: ForwardHook | None = None) -> Iterator[ChunkResult]:
        """Generate ``n`` more chunks, yielding each as soon as it is denoised.

        ``before_forward(chunk, step)`` runs before every DiT forward: ``step`` is the denoising step (0-based),
        or None for the clean-context pass that commits the previous chunk at the start of ``chunk``. An
        exception it raises (a host's Cancel) stops the call within one forward; the session stays as it was
        before the interrupted chunk, so continuing it later gives the same video."""
        self._check_alive()
        if n < 1:
            raise InputError("chunks", f"expected at least 1 chunk, got {n}", self.where)
        self._claim()
        try:
            self._ensure_weights()
            for _ in range(n):
                self._check_alive()  # disposed by another caller between chunks
                yield self._chunk(before_forward)
        finally:
            self._release()

    @torch.inference_mode()
    def _chunk(self, before_forward: ForwardHook | None) -> ChunkResult:
        index = self.stats.chunks_generated
        # controls first (a reseed is the chunk's noise); one applied stays applied if the chunk is interrupted
        self._apply_controls(index, before_forward)
        rng = self.generator.get_state()
        try:
            result = self._generate_chunk(index, before_forward)
        except BaseException:
            # the deferred commit and the chunk's K/V writes are idempotent; the noise drawn is not
            self.generator.set_state(rng)
            raise
        result.controls, self._unreported = tuple(self._unreported), []
        result.recache, self._recache = self._recache, None
        return result

    def _generate_chunk(self, index: int, before_forward: ForwardHook | None) -> ChunkResult:
        c = self.config.chunk_frames
        shape = (self.batch, self.model.params.in_dim, c, *self.latent_hw)
        strength = self.strength
        if strength is not None and not self.inputs.ready():
            raise InputError(
                "input_video",
                f"chunk {index} restyles an input chunk (video to video at strength {strength:g}) but "
                f"{len(self.inputs)} of its {c} input latent frames are queued; feed the input first",
                self.where,
            )
        sigmas = chunk_sigmas(self.sigmas, strength).to(self.generator.device)
        t0 = time.perf_counter()
        commit_s = self._commit(index, before_forward)
        start = self.cache.frames_committed

        # a step-cache run, only when the gate was forced on for causal chunks
        run = None if self.chunk_cache is None else self.chunk_cache.start_chunk()
        finite_steps: list[torch.Tensor] = []  # one flag per step, read back once with the chunk

        def denoised(x, sigma, start=start, run=run, **_):
            if before_forward is not None:
                before_forward(index, len(finite_steps))
            runner = None
            if run is not None:
                run.begin_step(sigma)
                runner = run.block_runner()
            out = x - sigma.view(-1, 1, 1, 1, 1) * self._velocity(x, sigma[0] * 1000.0, start, runner)
            finite_steps.append(torch.isfinite(out).all())
            return out

        source = None if strength is None else self.inputs.peek().to(self.device)
        x = chunk_start(sigmas, strength, self._noise(shape), source)
        x0 = sample_dmd(denoised, x, sigmas, noise_sampler=lambda *_: self._noise(shape), disable=True)
        telemetry = run.finish() if run is not None else None
        latents = x0.float().cpu()
        finite = torch.stack(finite_steps).tolist()
        if not all(finite):
            raise InputError(
                "model",
                f"{self._chunk_name(index, start)}: the denoised latents hold NaN or infinite values, first after "
                f"denoising step {finite.index(False) + 1} of {len(finite)}; the weights or the conditioning hold "
                "NaN/Inf, or the compute dtype overflowed",
                self.where,
            )
        if strength is None:
            self._pending = x0  # its clean-context pass is deferred to the next chunk's start
        else:  # video to video: the last step's K/V stay (StreamDiffusionV2), no clean-context pass
            self.cache.commit()
            self.inputs.drop()
        self.clean.write(start, x0)
        frames = None
        if self.decoder is not None:
            raw = self.tiny_vae.raw_to_latent(WAN21.process_out(x0.float()))
            frames = self.decoder.push(raw).float().cpu()
            if not bool(torch.isfinite(frames).all()):
                self.dispose()  # its stream decoder has taken in the chunk: the session cannot go on
                raise InputError(
                    "tiny_vae",
                    f"{self._chunk_name(index, start)}: the decoded frames hold NaN or infinite values (the "
                    "latents are finite); check the tiny VAE's weights. The session was stopped",
                    self.where,
                )
        result = ChunkResult(
            index=index, start_frame=start, latents=latents, frames=frames, seconds=time.perf_counter() - t0,
            commit_seconds=commit_s, kv_bytes=self.cache.nbytes, kv_bytes_used=self.cache.bytes_used(),
            step_cache=telemetry, mode="t2v" if strength is None else "v2v", strength=strength,
        )  # fmt: skip
        self.stats.record(result)
        return result

    def _chunk_name(self, index: int, start: int) -> str:
        return f"chunk {index} (latent frames {start}-{start + self.config.chunk_frames - 1})"

    def run(
        self,
        n: int,
        callback: Callable[[ChunkResult], None] | None = None,
        before_forward: ForwardHook | None = None,
    ) -> list[ChunkResult]:
        out = []
        chunks = self.chunks(n) if before_forward is None else self.chunks(n, before_forward)
        for chunk in chunks:
            if callback is not None:
                callback(chunk)
            out.append(chunk)
        return out


def run_parts(model, run: Run | None):
    """(weights keeper, block runner, backends, base model) a session takes from its run; without one, ``model``
    runs plain, eager, in one process, with the default backends."""
    if run is None:
        return (lambda: None), RunBlocks(), DEFAULT_BACKENDS, model
    return run.weights_keeper, run.blocks, run.backends, run.base_model


# -- what a solo session and a pool session share (one owner per formula) ------------------------------------------
def chunk_sigmas(sigmas: torch.Tensor, strength: float | None) -> torch.Tensor:
    """A chunk's sigmas: the schedule's for text to video, ``v2v_sigmas`` for an input chunk at ``strength``."""
    return sigmas if strength is None else v2v_sigmas(sigmas, strength)


def chunk_start(
    sigmas: torch.Tensor, strength: float | None, noise: torch.Tensor, source: torch.Tensor | None
) -> torch.Tensor:
    """A chunk's latents before its first step: noise at the first sigma (text to video), or the input chunk
    ``source`` noised to ``strength`` (video to video). Elementwise: rows batched together get what each gets
    alone."""
    return sigmas[0] * noise if strength is None else noised_input(source, strength, noise)


def commit_prefill(blocks, latents: torch.Tensor, chunk_frames: int, forward, cache: KVCache,
                   clean: CleanFrames) -> int:  # fmt: skip
    """Commit the start frames ``latents [B, C, F, h, w]`` in ``blocks`` (:func:`.prefill.prefill_blocks`): per
    block ``forward(x, start, whole_chunk)`` (one forward at timestep 0 writing the block's K/V), the commit, and
    its clean latents kept for a re-cache. Returns the frames committed."""
    start = 0
    # interrupted (a Cancel between blocks): the session is left unstarted, as before the prefill
    unstarted, clean_unstarted = cache.host_state(), list(clean.frames)
    try:
        for n in blocks:
            x = latents[:, :, start : start + n].contiguous()  # a chunk's strides: no new guard when compiled
            forward(x, start, n == chunk_frames)
            cache.commit()
            clean.write(start, x)
            start += n
    except BaseException:
        cache.load_host_state(unstarted)
        clean.frames = clean_unstarted
        raise
    return start


def check_control(p, kind: str, value, batch: int, where: str | None = None):
    """A control's value checked as it is queued (``engine.causal.controls``); returns it normalized."""
    if kind == "prompt":
        check_context(p, value, batch, where)
    elif kind == "strength":
        value = None if value is None else _located(check_strength, where)(value)
    elif kind == "seed":
        value = _located(check_seed, where)(value)
    else:
        raise InputError("control", f"unknown control {kind!r}; expected prompt, strength or seed", where)
    return value


def apply_controls(queue: ControlQueue, index: int, unreported: list, switch_prompt, set_strength,
                   reseed) -> None:  # fmt: skip
    """Apply the controls queued on ``queue`` at the boundary of chunk ``index``: ``switch_prompt(context,
    recache) -> RecacheReport | None``, ``set_strength(strength | None)``, ``reseed(seed)``. Each applied one is
    recorded and appended to ``unreported`` (reported with the next chunk that completes); one that raises (a
    host's Cancel in a re-cache) is put back with those after it, unless a newer one of its kind has come."""
    taken = queue.take()
    for i, (control, replaced) in enumerate(taken):
        try:
            detail = ""
            if control.kind == "prompt":
                report = switch_prompt(control.value, control.recache)
                if report is not None:
                    detail = f"re-cached {report.frames} frames in {report.seconds:.3f} s"
            elif control.kind == "strength":
                set_strength(control.value)
                detail = "text to video" if control.value is None else f"strength {control.value:g}"
            else:
                reseed(control.value)
                detail = f"seed {control.value}"
        except BaseException:
            queue.requeue(taken[i:])
            raise
        applied = AppliedControl(control.kind, control.sequence, index, control.recache, replaced, detail)
        queue.record(applied)
        unreported.append(applied)


def check_latents(
    p, latents, latent_hw: tuple[int, int], batch: int, name: str, where: str | None = None
) -> None:
    """Start or input latents ``[batch, C, F, h, w]`` of a session of ``latent_hw`` and ``batch``."""
    h, w = latent_hw
    if not isinstance(latents, torch.Tensor) or latents.ndim != 5:
        got = list(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
        raise InputError(name, f"latents {got}; expected [batch, {p.in_dim}, frames, {h}, {w}]", where)
    b, c, _, lh, lw = latents.shape
    if c != p.in_dim:
        raise InputError(
            name, f"{c} latent channels; this Wan model takes {p.in_dim} (Wan 2.1 VAE latents)", where
        )
    if (lh, lw) != (h, w) or b != batch:
        raise InputError(
            name,
            f"latents of batch {b} and {lh}x{lw} latent pixels; this session is batch {batch} at "
            f"{h}x{w} ({8 * h}x{8 * w} px)",
            where,
        )
    if not latents.is_floating_point() or not bool(torch.isfinite(latents).all()):
        raise InputError(name, "latents must be finite floating-point values", where)


def session_bytes(
    p, batch: int, height: int, width: int, config: CausalConfig, dtype: torch.dtype, tokens_per_frame: int,
    heads: int, tiny_vae=None,
) -> dict[str, int]:  # fmt: skip
    """Estimated bytes a session allocates, by part: the KV window (exact, as :class:`KVCache` allocates it), the
    cross-attention cache of a prompt (exact), the prompt's padding to ``text_len`` before it is embedded, one
    chunk's activations and, with a tiny VAE, what its stream decoder needs for one chunk: its full-resolution
    activations and the decoded frames (``tiny_vae.decode_bytes``, the formula of the module that owns the
    decoder: a chunk is decoded with all its frames at once)."""
    elt = torch.empty((), dtype=dtype).element_size()
    window = config.window
    chunk_tokens = tokens_per_frame * window.chunk_frames
    window_tokens = tokens_per_frame * window.window_frames
    latent_hw = (height // 8, width // 8)
    parts = {
        "KV window": kv_cache_bytes(p.num_layers, batch, tokens_per_frame, heads, p.head_dim, window, dtype,
                                    config.kv_dtype, config.keep_recent_chunks, config.rope).window,
        "cross-attention cache": (2 * p.num_layers + 1) * batch * p.text_len * p.dim * elt,
        # embed_context pads the float32 umT5 tokens to text_len: the zeros and the concatenation live together
        "prompt padding": 2 * batch * p.text_len * p.text_dim * 4,
        # a block's working set (hidden states, FFN, q/k/v) plus one layer's window read back for attention
        "chunk activations": batch * chunk_tokens * (p.ffn_dim + 6 * p.dim) * 4
        + batch * window_tokens * kv_bytes_per_token(1, heads, p.head_dim, KV_LAYOUTS["bf16"], elt),
        # the window's clean latents, for a prompt switch's re-cache (kv_cache.clean_frames)
        "clean latents": clean_frames_bytes(window, batch, p.in_dim, latent_hw),
    }  # fmt: skip
    if tiny_vae is not None:
        decode = tiny_vae.decode_bytes(batch, window.chunk_frames, height, width)
        parts["stream decoder activations"] = decode["decoder activations"]
        parts["decoded frames"] = decode["RGB output"]
    return parts


def check_session_fits(
    parts: dict[str, int], device, where: str | None = None, input_name: str | None = None, hint: str = ""
) -> int:
    """``check_fits`` on a session's parts, naming the input behind the largest one (``input_name`` if given)."""
    owner = {"KV window": "window_frames", "cross-attention cache": "context"}
    # the prompt padding is the model's own (text_len x its text width): no input of the session sizes it
    largest = max((k for k in parts if k != "prompt padding"), key=parts.get)
    if input_name is None:
        input_name = owner.get(largest, "width")
    if not hint and largest == "stream decoder activations":
        hint = (
            "Use a smaller width / height or fewer chunk_frames (the tiny VAE decodes a whole chunk at once)"
        )
    hint = hint or "Use a smaller window_frames, a smaller width / height, or a smaller model"
    return check_fits(parts, device, input_name, where, hint)


def _located(check, where: str | None):
    def checked(value):
        try:
            return check(value)
        except InputError as err:
            raise (err.located(where) if where else err) from None

    return checked


def claim(lock: threading.Lock, where: str | None) -> None:
    """Take a session's one-caller lock, or refuse the second caller (never wait: a queue run would hang)."""
    if not lock.acquire(blocking=False):
        raise InputError(
            "session",
            "this session is generating in another call (another thread or queue run, or an unfinished "
            "chunks() loop); a session is used by one caller at a time: wait for that call to finish, or "
            "start a second session",
            where,
        )


def check_size(p, height: int, width: int, where: str | None = None) -> None:
    why = f"8x VAE downscaling and {p.patch_size[1]}x{p.patch_size[2]} patches"
    check_image_size(height, width, 8 * p.patch_size[1], why, where)


def check_context(p, context: torch.Tensor, batch: int | None, where: str | None = None) -> None:
    if not isinstance(context, torch.Tensor) or not context.is_floating_point():
        got = context.dtype if isinstance(context, torch.Tensor) else type(context).__name__
        raise InputError("context", f"conditioning of {got}; expected float umT5 token features", where)
    if context.ndim != 3 or context.shape[-1] != p.text_dim:
        raise InputError(
            "context",
            f"conditioning is {list(context.shape)}; Wan expects umT5 tokens [batch, "
            f"tokens, {p.text_dim}] (e.g. CLIPTextEncode with the umt5_xxl text encoder)",
            where,
        )
    if context.shape[1] > p.text_len:
        raise InputError("context", f"{context.shape[1]} tokens; Wan reads at most {p.text_len}", where)
    if batch is not None and context.shape[0] != batch:
        raise InputError(
            "context", f"conditioning batch {context.shape[0]} differs from the session's {batch}", where
        )
    if context.numel() == 0 or context.shape[1] == 0:
        raise InputError("context", f"conditioning {list(context.shape)} holds no text tokens", where)
    try:
        check_finite(context, "context", "conditioning")
    except InputError as err:
        raise (err.located(where) if where else err) from None


def check_tiny_vae(vae, p, where: str | None = None) -> None:
    """The tiny AE must decode Wan 2.1's LATENT: the channel count alone would let HunyuanVideo's taehv (also 16
    channels) decode Wan latents into wrong colours without a word."""
    v = vae.variant
    if v.kind != "video" or v.comfy_format != WAN21 or v.channels != p.in_dim:
        fits = " or ".join(f.name for f in variants_for(WAN21, kind="video"))
        raise InputError(
            "tiny_vae",
            f"{v.name} ({v.models}) decodes {v.channels}-channel {v.kind} latents; this Wan 2.1 model "
            f"makes {p.in_dim}-channel Wan 2.1 video latents (use {fits})",
            where,
        )
