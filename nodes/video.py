"""Causal video nodes: generate a video chunk by chunk with a rolling KV cache, and continue it later.

A FEWSTEP_SESSION is a reference to a live stream kept in a bounded LRU (``FEWSTEP_MAX_SESSIONS``, default 4;
``FEWSTEP_SESSION_GB``, default half of the memory of the device the sessions run on). Sessions are freed when
ComfyUI unloads their model (its "free memory" endpoint, or another model needing the memory; a FewStepCompile'd
model included) and when they fall out of the LRU; a Continue on a freed session rebuilds it (below).

ComfyUI caches node outputs like any other node's (the same inputs run once), while a session is a live object
that FewStepCausalContinue moves forward. Each reference therefore records the frame position it was made at and
how to rebuild the session (prompts, seed, settings): when a Continue runs on a reference whose session has since
moved on (a re-run with another num_chunks or prompt, or two Continues on one sampler) or was freed (LRU, memory
released), the session is rebuilt up to that position first, so a graph always produces the same video as a
fresh run and a cached sampler output never hands on a dead session. The prompts a reference keeps for that are
bounded (``FEWSTEP_MAX_PROMPTS`` different prompts, default 8; a prompt used again is kept once): past the bound a
stale reference cannot be rebuilt, and says so.

Each finished chunk is also streamed to the client that queued the prompt (nodes/chunk_stream.py: a WebP clip
in the temp folder and a ``fewstep.chunk`` websocket event).

Cancel is checked before every DiT forward (each denoising step and each clean-context pass), and the progress
bar advances per denoising step; each chunk's last frame is the preview.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..engine.causal import ROPE_MODES, CausalConfig, SessionStore, VideoSession
from ..engine.causal.kv_cache import KV_DTYPES
from ..engine.causal.recipe import SessionRecipe
from ..engine.causal.session import ChunkTiming
from ..engine.errors import InputError
from ..engine.preflight.budget import check_fits
from ..engine.sampling import SCHEDULES
from ..engine.settings import MAX_MEMORY_GB, env_float, env_int
from ..engine.units import format_bytes
from .base import CATEGORY, model_input, reports_input_errors, seed_input, single_prompt
from .chunk_stream import ChunkStream
from .host import Progress, check_interrupt, comfy_module, preview_payload
from .inputs import register_object_type
from .model_management import load_for_run
from .parallel import FEWSTEP_PARALLEL, run_options
from .vae import FEWSTEP_TINY_VAE

FEWSTEP_SESSION = "FEWSTEP_SESSION"
log = logging.getLogger(__name__)

# The most FEWSTEP_MAX_SESSIONS / FEWSTEP_MAX_PROMPTS may ask for: sessions are bounded by bytes as well, but each
# keeps a model's KV window; a kept prompt is a text embedding of a few MB, and every session reference keeps its own.
MAX_SESSIONS_SETTING = 1024
MAX_PROMPTS_SETTING = 256
_SESSION_GB = env_float(
    "FEWSTEP_SESSION_GB", None, minimum=0.0, maximum=MAX_MEMORY_GB, default_text="half of the device's memory"
)
SESSIONS = SessionStore(
    max_sessions=env_int("FEWSTEP_MAX_SESSIONS", 4, minimum=1, maximum=MAX_SESSIONS_SETTING),
    max_bytes=None if _SESSION_GB is None else int(_SESSION_GB * 2**30),  # None: from device memory
)
# different prompts a session reference keeps to rebuild its session
MAX_PROMPTS = env_int("FEWSTEP_MAX_PROMPTS", 8, minimum=1, maximum=MAX_PROMPTS_SETTING)


@dataclass(frozen=True)
class SessionRef:
    """What flows along a FEWSTEP_SESSION link."""

    key: str  # the live session in SESSIONS
    position: int  # latent frames the session had generated when this reference was made
    recipe: SessionRecipe = field(repr=False)


register_object_type(FEWSTEP_SESSION, SessionRef, "a FEWSTEP_SESSION from FewStepCausalVideoSampler")


def _recipe(model, width, height, config, seed, tiny_vae, context, options) -> SessionRecipe:
    """The engine's recipe for this node's inputs and run options (a connected worker pool among them)."""
    return SessionRecipe(
        model, width, height, config, seed, tiny_vae, ((0, context),), MAX_PROMPTS, options=options
    )


def _free_sessions_on_unload(handle) -> None:
    """Drop a model's sessions when ComfyUI unloads the model (their caches are useless without it)."""
    patcher = handle.host
    ext = comfy_module("comfy.patcher_extension")
    if patcher is None or ext is None or patcher.get_callbacks(ext.CallbacksMP.ON_DETACH, "fewstep-sessions"):
        return
    model = handle.model

    def on_detach(_patcher, unpatch_all=True, *_):
        # ComfyUI also detaches (unpatch_all=False) whenever it re-loads a model that is already loaded; only a
        # real unload (free memory, or memory needed elsewhere) drops the sessions.
        if unpatch_all:  # a compiled run's session holds a stand-in: compare the model it runs
            SESSIONS.dispose_where(lambda s: getattr(s, "base_model", s.model) is model)

    patcher.add_callback_with_key(ext.CallbacksMP.ON_DETACH, "fewstep-sessions", on_detach)


def _prompt(conditioning, input_name: str) -> torch.Tensor:
    """The video session's prompt: the context tokens of the single entry (Wan has no pooled vector)."""
    refusal = "the video sampler takes one prompt (use ConditioningConcat or encode a single prompt)"
    return single_prompt(conditioning, input_name, refusal).context


def _cancel_hook(chunk: int, step: int | None) -> None:
    check_interrupt()


def _check_outputs_fit(batch: int, width: int, height: int, config: CausalConfig, chunks: int, decodes: bool,
                       where: str) -> None:  # fmt: skip
    """The outputs of a run stay in host memory until the node returns: refuse a run whose outputs cannot fit."""
    frames = chunks * config.chunk_frames
    latent = batch * 16 * frames * (height // 8) * (width // 8) * 4
    images = batch * 4 * frames * 3 * height * width * 4 if decodes else 0
    # the per-chunk parts and their concatenation exist together once
    hint = "Generate fewer chunks per run (FewStepCausalContinue carries the session on), or a smaller video"
    check_fits({f"outputs of {chunks} chunks": 2 * (latent + images)}, "cpu", "num_chunks", where, hint)


def _run(session: VideoSession, chunks: int, node: str):
    """Generate, with Cancel checked before every forward, progress per denoising step and each chunk's last
    frame as the preview."""
    per_step = isinstance(session, VideoSession)
    steps = len(session.sigmas) - 1
    progress = Progress(chunks * steps if per_step else chunks, desc=node)
    first_index = session.stats.chunks_generated
    stream = ChunkStream(chunks, session.config.chunk_frames)

    def before_forward(chunk: int, step: int | None) -> None:
        check_interrupt()
        if step is not None:
            progress.update((chunk - first_index) * steps + step)

    parts, frames, timings = [], [], []
    try:
        for i, chunk in enumerate(session.chunks(chunks, before_forward=before_forward)):
            check_interrupt()
            parts.append(chunk.raw)
            timings.append(ChunkTiming.of(chunk))
            decoded = 0 if chunk.frames is None else chunk.frames.shape[1]
            stream.publish(chunk, session.stats.frames_decoded - decoded)
            preview = None
            if chunk.frames is not None and chunk.frames.shape[1]:
                frames.append(chunk.frames)
                preview = preview_payload(chunk.frames[0, -1].permute(1, 2, 0))
            progress.update((i + 1) * steps if per_step else i + 1, preview)
    finally:
        stream.close()  # the clips still being written: their events come before the node's own
        progress.close()
    latent = torch.cat(parts, dim=2)
    b, _, _, h, w = latent.shape
    if frames:
        images = torch.cat(frames, dim=1).flatten(0, 1).permute(0, 2, 3, 1).contiguous()
    else:
        images = torch.zeros(0, h * 8, w * 8, 3)
    return latent, images, _report(session, timings)


def _report(session: VideoSession, recent: list[ChunkTiming]) -> str:
    c = session.config
    lines = [
        f"{len(recent)} chunks x {c.chunk_frames} latent frames (frames {recent[0].start_frame}-"
        f"{recent[-1].start_frame + c.chunk_frames - 1}); window {c.window_frames}, sinks {c.sink_frames}, "
        f"RoPE {c.rope}, {len(session.sigmas) - 1} steps",
        "seconds per chunk: " + ", ".join(f"{r.seconds:.2f}" for r in recent),
        f"first chunk latency: {session.stats.first_chunk_seconds:.2f} s",
        f"KV cache: {format_bytes(recent[-1].kv_bytes, 1)} allocated, {format_bytes(recent[-1].kv_bytes_used, 1)} used "
        f"({session.cache.bytes_per_token()} B/token, {session.cache.tokens_per_frame} tokens/frame)",
    ]
    if session.cache_decision is not None:
        lines.append(f"step cache: {session.cache_decision.line()}")
    if getattr(session, "parallel_summary", None):  # a RemoteVideoSession: computed by a worker pool
        lines.append(f"parallel: {session.parallel_summary}")
    return "\n".join(lines)


def _check_wan(model, node: str) -> None:
    if model.family.name != "wan":
        raise InputError(
            "model",
            f"{node} runs Wan-family video models (CausVid / Self-Forcing students); got a "
            f"{model.family.name} model",
        )


class ReturnsVideoChunks:
    """The outputs of both causal video nodes: the chunks made by this run (LATENT and decoded frames), the
    session to continue, the report."""

    RETURN_TYPES = ("LATENT", "IMAGE", FEWSTEP_SESSION, "STRING")
    RETURN_NAMES = ("latent", "frames", "session", "report")


class FewStepCausalVideoSampler(ReturnsVideoChunks):
    DESCRIPTION = (
        "Autoregressive video (CausVid / Self-Forcing on Wan 2.1): chunks of latent frames, each denoised in a few "
        "steps while attending to earlier chunks through a rolling KV cache (sink frames kept, oldest frames "
        "evicted), so memory stays flat however long the video runs. Outputs the LATENT video, decoded frames "
        "when a tiny VAE (taew2_1) is given, and a session that FewStepCausalContinue extends."
    )
    CATEGORY = f"{CATEGORY}/video"
    FUNCTION = "generate"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": model_input("a Wan 2.1 causal student"),
                "positive": ("CONDITIONING", {"tooltip": "umT5 prompt encoding [B, tokens, 4096]."}),
                "width": (
                    "INT",
                    {"default": 832, "min": 16, "max": 4096, "step": 16, "tooltip": "Video width in px."},
                ),
                "height": (
                    "INT",
                    {"default": 480, "min": 16, "max": 4096, "step": 16, "tooltip": "Video height in px."},
                ),
                "num_chunks": (
                    "INT",
                    {"default": 7, "min": 1, "max": 10000, "tooltip": "Chunks to generate now."},
                ),
                "chunk_frames": (
                    "INT",
                    {
                        "default": 3,
                        "min": 1,
                        "max": 64,
                        "tooltip": "Latent frames per chunk (each latent frame is 4 video frames).",
                    },
                ),
                "window_frames": (
                    "INT",
                    {
                        "default": 21,
                        "min": 1,
                        "max": 4096,
                        "tooltip": "Latent frames a chunk "
                        "attends to, sinks and itself included; older frames are evicted.",
                    },
                ),
                "sink_frames": (
                    "INT",
                    {
                        "default": 0,
                        "min": 0,
                        "max": 4096,
                        "tooltip": "First latent frames kept in the window forever (attention sinks).",
                    },
                ),
                "schedule": (
                    list(SCHEDULES),
                    {
                        "default": "wan-dmd-4step",
                        "tooltip": "Denoising schedule per chunk (DMD re-noise sampler).",
                    },
                ),
                "steps": (
                    "INT",
                    {"default": 4, "min": 1, "max": 100, "tooltip": "Denoising steps per chunk."},
                ),
                "seed": seed_input("Seed of the session's noise."),
            },
            "optional": {
                "tiny_vae": (FEWSTEP_TINY_VAE, {"tooltip": "taew2_1: decode each chunk as it is generated."}),
                "context_noise": (
                    "FLOAT",
                    {
                        "default": 0.0,
                        "min": 0.0,
                        "max": 1000.0,
                        "step": 1.0,
                        "tooltip": "Timestep (0..1000) of the clean pass that commits a chunk.",
                    },
                ),
                "rope": (
                    list(ROPE_MODES),
                    {
                        "default": "cache",
                        "tooltip": "cache: key positions relative to the cache "
                        "(streams of any length); absolute: Self-Forcing's absolute frame positions.",
                    },
                ),
                "kv_dtype": (
                    list(KV_DTYPES),
                    {
                        "default": "bf16",
                        "tooltip": "KV cache storage. bf16: unquantized, in the model's compute dtype. int8 / "
                        "int4: completed chunks older than keep_recent_chunks are stored quantized (0.52x / "
                        "0.27x of bf16 per frame), sinks and recent chunks stay unquantized.",
                    },
                ),
                "keep_recent_chunks": (
                    "INT",
                    {
                        "default": 1,
                        "min": 0,
                        "max": 4096,
                        "tooltip": "With int8 / int4: completed chunks kept unquantized besides the current one "
                        "(they must fit the window next to it and the sinks).",
                    },
                ),
                "parallel": (
                    FEWSTEP_PARALLEL,
                    {
                        "tooltip": "A worker pool from FewStepParallelLauncher (mode sp): each rank holds its "
                        "share of every frame's tokens and of the KV cache; chunks stream back from rank 0."
                    },
                ),
            },
        }

    @reports_input_errors("FewStepCausalVideoSampler", {"context": "positive", "chunks": "num_chunks"})
    def generate(self, model, positive, width, height, num_chunks, chunk_frames, window_frames, sink_frames,
                 schedule, steps, seed, tiny_vae=None, context_noise=0.0, rope="cache", kv_dtype="bf16",
                 keep_recent_chunks=1, parallel=None):  # fmt: skip
        _check_wan(model, "FewStepCausalVideoSampler")
        config = CausalConfig(chunk_frames=chunk_frames, window_frames=window_frames, sink_frames=sink_frames,
                              schedule=schedule, steps=steps, context_noise=context_noise, rope=rope,
                              kv_dtype=kv_dtype, keep_recent_chunks=keep_recent_chunks)  # fmt: skip
        context = _prompt(positive, "positive")
        _check_outputs_fit(context.shape[0], width, height, config, num_chunks, tiny_vae is not None,
                           "FewStepCausalVideoSampler")  # fmt: skip
        # in this process, or on the connected pool (the engine opens the session there: engine.run.placement)
        options = run_options(parallel, "FewStepCausalVideoSampler")
        if options.in_process:  # with a pool the workers hold the model; this process does not run it
            load_for_run(model)
        recipe = _recipe(model, width, height, config, seed, tiny_vae, context.cpu(), options)
        session, compiled = recipe.open(context, "FewStepCausalVideoSampler")
        key = SESSIONS.add(session)
        _free_sessions_on_unload(model)
        try:
            latent, images, report = _run(session, num_chunks, "FewStepCausalVideoSampler")
        finally:
            telemetry = compiled.finish() if compiled is not None else None
        if telemetry is not None:
            report += "\n" + "\n".join(telemetry.summary_lines())
        SESSIONS.touch(key)
        return ({"samples": latent}, images, SessionRef(key, session.frames_generated, recipe), report)


class FewStepCausalContinue(ReturnsVideoChunks):
    DESCRIPTION = (
        "Continues a causal video session for more chunks, optionally with a new prompt (only the "
        "cross-attention cache is rebuilt, as in CausVid's prompt switching). Outputs the new chunks."
    )
    CATEGORY = f"{CATEGORY}/video"
    FUNCTION = "extend"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "session": (
                    FEWSTEP_SESSION,
                    {"tooltip": "From FewStepCausalVideoSampler or another Continue."},
                ),
                "num_chunks": ("INT", {"default": 7, "min": 1, "max": 10000, "tooltip": "Chunks to add."}),
            },
            "optional": {
                "positive": (
                    "CONDITIONING",
                    {"tooltip": "New prompt from here on (omit to keep the current one)."},
                ),
            },
        }

    @reports_input_errors("FewStepCausalContinue", {"context": "positive", "chunks": "num_chunks"})
    def extend(self, session, num_chunks, positive=None):
        if not isinstance(session, SessionRef):
            raise InputError("session", "expected a FEWSTEP_SESSION from FewStepCausalVideoSampler")
        where = "FewStepCausalContinue"
        key, recipe = session.key, session.recipe
        if recipe.in_process:  # with a pool the workers hold the model
            load_for_run(recipe.model)
        live = SESSIONS.get(key, where) if SESSIONS.alive(key) else None
        if live is None or live.frames_generated != session.position:
            # freed, or moved on since this reference was made (ComfyUI re-ran this node on a cached output)
            log.info("fewstep: %s rebuilds the session to latent frame %d (%s)", where, session.position,
                     "it was freed" if live is None else "it has moved on")  # fmt: skip
            live = recipe.rebuild(session.position, where, before_forward=_cancel_hook)
            key = SESSIONS.add(live)
        live.where = where
        _check_outputs_fit(live.batch, recipe.width, recipe.height, recipe.config, num_chunks,
                           recipe.tiny_vae is not None, where)  # fmt: skip
        if positive is not None:
            context = _prompt(positive, "positive")
            live.set_prompt(context)
            recipe = recipe.with_prompt(live.frames_generated, context.cpu())
        latent, images, report = _run(live, num_chunks, where)
        SESSIONS.touch(key)
        return ({"samples": latent}, images, SessionRef(key, live.frames_generated, recipe), report)
