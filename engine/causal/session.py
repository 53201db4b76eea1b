"""Chunk-by-chunk causal video generation as a session that can run on, switch prompts and stream its output.

Per chunk of ``chunk_frames`` latent frames: fresh noise, then N denoising steps of the DMD re-noise sampler on
the ``wan-dmd-4step`` schedule (each step attends to the KV cache and rewrites the chunk's slots), then the chunk
is handed out (latents, and frames when a tiny VAE is attached). Its clean-context pass (the model run once more
on the clean chunk at timestep ``context_noise``, which commits the chunk's K/V) is deferred until the next
chunk starts: a stream that stops never pays for it, and one that continues later gets exactly the same video.

A :class:`VideoSession` owns everything that lives across chunks: the KV cache, the cross-attention cache, the
frame position, the prompt and the random generator. ``set_prompt`` switches the prompt as CausVid does (only
the cross-attention cache is rebuilt; the self-attention cache carries the video on); ``dispose`` frees it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ..cache import causal_chunk_decision
from ..errors import InputError
from ..latent_formats import WAN21
from ..sampling import sample_dmd, schedule_sigmas
from .kv_cache import CrossAttentionCache, KVCache, WindowSpec, check_kv_storage


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

    @property
    def window(self) -> WindowSpec:
        return WindowSpec(self.chunk_frames, self.window_frames, self.sink_frames)


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

    @property
    def raw(self) -> torch.Tensor:
        """ComfyUI's raw Wan 2.1 VAE latent (per-channel mean/std undone)."""
        return WAN21.process_out(self.latents)


@dataclass
class SessionStats:
    chunks: list[ChunkResult] = field(default_factory=list)
    first_chunk_seconds: float | None = None


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
        step_cache=None,
        parallel=None,
    ):
        """``parallel``: a sequence-parallel layout (``engine.parallel.CausalSharding``) when this session is one
        rank of a worker pool; its cache then holds this rank's share of each frame's tokens and of the heads."""
        p = model.params
        config = config or CausalConfig()
        self.model, self.config, self.where = model, config, where
        config.window.check(where)
        check_kv_storage(config.kv_dtype, config.keep_recent_chunks, config.window, p.head_dim, where)
        check_size(p, height, width, where)
        self.latent_hw = (height // 8, width // 8)
        self.grid_hw = (self.latent_hw[0] // p.patch_size[1], self.latent_hw[1] // p.patch_size[2])
        self.sigmas = schedule_sigmas(config.schedule, config.steps, input_name="schedule")
        device = next(model.parameters()).device
        self.dtype = model.patch_embedding.weight.dtype
        self.batch = context.shape[0]
        self.parallel = parallel
        tokens_per_frame, heads = self.grid_hw[0] * self.grid_hw[1], p.num_heads
        if parallel is not None:
            tokens_per_frame, heads = parallel.kv_layout(tokens_per_frame, heads)
        self.cache = KVCache(
            layers=p.num_layers, batch=self.batch, tokens_per_frame=tokens_per_frame,
            heads=heads, head_dim=p.head_dim, window=config.window, dtype=self.dtype, device=device,
            rope=config.rope, kv_dtype=config.kv_dtype, keep_recent_chunks=config.keep_recent_chunks,
        )  # fmt: skip
        self.cross = CrossAttentionCache()
        self.generator = torch.Generator(device=device).manual_seed(int(seed))
        self.decoder = None
        if tiny_vae is not None:
            check_tiny_vae(tiny_vae, p, where)
            self.tiny_vae, self.decoder = tiny_vae, tiny_vae.stream_decoder()
        # A step-cache gate (engine.cache) normally refuses a causal chunk: 4 DMD steps re-noise every step.
        self.step_cache = step_cache
        self.cache_decision = causal_chunk_decision(step_cache, self.sigmas, "dmd") if step_cache else None
        self.stats = SessionStats()
        self._pending: torch.Tensor | None = None  # the last chunk's clean latents, not yet committed
        self._context = None
        self.disposed = False
        self.set_prompt(context)

    # -- state -----------------------------------------------------------------------------------------------------
    @property
    def frames_generated(self) -> int:
        return self.cache.frames_committed + (0 if self._pending is None else self.config.chunk_frames)

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes + self.cross.nbytes + (0 if self._context is None else self._context.nbytes)

    def set_prompt(self, context: torch.Tensor) -> None:
        """Use ``context [B, L, 4096]`` from the next chunk on (the self-attention cache is kept)."""
        self._check_alive()
        check_context(self.model.params, context, self.batch, self.where)
        with torch.inference_mode():
            self._context = self.model.embed_context(context.to(self.cache.k[0].device))
        self.cross.reset()

    def dispose(self) -> None:
        """Free the caches; the session cannot be continued afterwards."""
        self.cache = self.cross = self._context = self._pending = self.decoder = None
        self.disposed = True

    def _check_alive(self) -> None:
        if self.disposed:
            raise InputError(
                "session",
                "this session was disposed (or evicted to free memory); start a new one",
                self.where,
            )

    # -- generation ------------------------------------------------------------------------------------------------
    def _velocity(
        self, x: torch.Tensor, timestep: float | torch.Tensor, start: int, block_runner=None
    ) -> torch.Tensor:
        c = self.config.chunk_frames
        rope_fn = self.model.frame_rope
        if self.parallel is not None:
            rope_fn, block_runner = (
                self.parallel.frame_rope(rope_fn),
                self.parallel.block_runner(block_runner),
            )
        self.cache.begin(start, c, self.grid_hw, rope_fn)
        t = (
            torch.as_tensor(timestep, dtype=torch.float32, device=x.device)
            .reshape(-1, 1)
            .expand(self.batch, c)
        )
        return self.model(
            x,
            t,
            context_embedded=self._context,
            kv=self.cache,
            cross_kv=self.cross,
            block_runner=block_runner,
        )

    def _commit(self) -> float:
        if self._pending is None:
            return 0.0
        t0 = time.perf_counter()
        self._velocity(self._pending, self.config.context_noise, self.cache.frames_committed)
        self.cache.commit()
        self._pending = None
        return time.perf_counter() - t0

    def _noise(self, shape) -> torch.Tensor:
        return torch.randn(shape, generator=self.generator, device=self.generator.device, dtype=torch.float32)

    @torch.inference_mode()
    def chunks(self, n: int) -> Iterator[ChunkResult]:
        """Generate ``n`` more chunks, yielding each as soon as it is denoised."""
        self._check_alive()
        if n < 1:
            raise InputError("chunks", f"expected at least 1 chunk, got {n}", self.where)
        c = self.config.chunk_frames
        shape = (self.batch, self.model.params.in_dim, c, *self.latent_hw)
        sigmas = self.sigmas.to(self.generator.device)
        for _ in range(n):
            t0 = time.perf_counter()
            commit_s = self._commit()
            start = self.cache.frames_committed

            run = None  # a step-cache run, only when the gate was forced on for causal chunks
            if self.cache_decision is not None and self.cache_decision.enabled:
                run = self.step_cache.start_run(self.model, self.sigmas, "dmd", context="causal chunk")

            def denoised(x, sigma, start=start, run=run, **_):
                runner = None
                if run is not None:
                    run.begin_step(sigma)
                    runner = run.block_runner()
                return x - sigma.view(-1, 1, 1, 1, 1) * self._velocity(x, sigma[0] * 1000.0, start, runner)

            x = sigmas[0] * self._noise(shape)
            x0 = sample_dmd(denoised, x, sigmas, noise_sampler=lambda *_: self._noise(shape), disable=True)
            telemetry = run.finish() if run is not None else None
            self._pending = x0
            frames = None
            if self.decoder is not None:
                frames = self.decoder.push(self.tiny_vae.raw_to_latent(WAN21.process_out(x0.float())))
            result = ChunkResult(
                index=len(self.stats.chunks), start_frame=start, latents=x0.float().cpu(),
                frames=None if frames is None else frames.float().cpu(), seconds=time.perf_counter() - t0,
                commit_seconds=commit_s, kv_bytes=self.cache.nbytes, kv_bytes_used=self.cache.bytes_used(),
                step_cache=telemetry,
            )  # fmt: skip
            if self.stats.first_chunk_seconds is None:
                self.stats.first_chunk_seconds = result.seconds
            self.stats.chunks.append(result)
            yield result

    def run(self, n: int, callback: Callable[[ChunkResult], None] | None = None) -> list[ChunkResult]:
        out = []
        for chunk in self.chunks(n):
            if callback is not None:
                callback(chunk)
            out.append(chunk)
        return out


def check_size(p, height: int, width: int, where: str | None = None) -> None:
    step = 8 * p.patch_size[1]
    for name, v in (("height", height), ("width", width)):
        if v <= 0 or v % step:
            raise InputError(
                name,
                f"{v} px is not a positive multiple of {step} (8x VAE downscaling and "
                f"{p.patch_size[1]}x{p.patch_size[2]} patches)",
                where,
            )


def check_context(p, context: torch.Tensor, batch: int | None, where: str | None = None) -> None:
    if context.ndim != 3 or context.shape[-1] != p.text_dim:
        raise InputError(
            "positive",
            f"conditioning is {list(context.shape)}; Wan expects umT5 tokens [batch, "
            f"tokens, {p.text_dim}] (e.g. CLIPTextEncode with the umt5_xxl text encoder)",
            where,
        )
    if context.shape[1] > p.text_len:
        raise InputError("positive", f"{context.shape[1]} tokens; Wan reads at most {p.text_len}", where)
    if batch is not None and context.shape[0] != batch:
        raise InputError(
            "positive", f"conditioning batch {context.shape[0]} differs from the session's {batch}", where
        )


def check_tiny_vae(vae, p, where: str | None = None) -> None:
    v = vae.variant
    if v.kind != "video" or v.channels != p.in_dim:
        raise InputError(
            "tiny_vae",
            f"{v.name} decodes {v.channels}-channel {v.kind} latents; this Wan model "
            f"makes {p.in_dim}-channel video latents (use taew2_1)",
            where,
        )
