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

Interactive inputs (engine.causal: prefill, video_to_video, prompt_switch):

* ``start_latent`` (sampler): a Wan 2.1 LATENT (core VAEEncode with the Wan 2.1 VAE, or FewStepTinyVAEEncode with
  taew2_1) of ``k x chunk_frames`` or ``1 + k x chunk_frames`` latent frames, committed to the KV cache before the
  first chunk (image to video, video extension). The outputs start with it: its latent frames lead the LATENT and
  its decoded frames the IMAGE, as Self-Forcing's output includes its initial latent.
* ``input_latent`` / ``input_images`` + ``strength`` (sampler and Continue): video to video. Two inputs because
  ComfyUI takes one type per input: a LATENT as VAEEncode gives it, or IMAGE frames that the session's tiny VAE
  (taew2_1) encodes. Each chunk restyles the next ``chunk_frames`` latent frames, fed one chunk ahead as a live
  source would; an input covering fewer whole chunks than ``num_chunks`` makes fewer chunks (the leftover frames of
  a partial chunk are not used; the report says how many were). ``strength`` 0.7 by default: StreamDiffusionV2's
  single-stream driver's ``noise_scale`` (``streamv2v/inference_wo_batch.py``); with wan-dmd-4step it runs 2 of the
  4 steps. After the run the session is back to text to video.
* ``recache`` (Continue, with a new ``positive``): the LongLive switch, the window's K/V recomputed under the new
  prompt; off (the default) keeps the CausVid switch that saved workflows were made with.

On a worker pool (``parallel``): a start latent of whole chunks and an input video run there (its workers
commit the start in the session's start job; the input is fed as far ahead as the session's queue allows, so
a job restyles up to 8 chunks); ``recache`` and a start with a lone first frame (an image, or 1 + whole chunks)
are refused, naming ``parallel`` / ``start_latent``: the sharded workers run only a chunk's shape.

A reference whose session used any of them is rebuilt by replaying its node runs (the start, each run's switch,
chunks and input video), so a stale or freed reference gives the same video as the first run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..engine.causal import ROPE_MODES, CausalConfig, SessionStore, VideoSession
from ..engine.causal.kv_cache import KV_DTYPES
from ..engine.causal.prefill import prefill_blocks
from ..engine.causal.recipe import SessionRecipe
from ..engine.causal.session import ChunkTiming
from ..engine.causal.video_to_video import MAX_QUEUED_CHUNKS, v2v_sigmas
from ..engine.errors import InputError
from ..engine.latent_formats import WAN21, WAN22
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
class Segment:
    """One node run on a session, as a rebuild replays it: a prompt switch at its start (Continue's
    ``positive``, with ``recache`` or not), then ``chunks`` chunks, restyling ``inputs`` when given."""

    chunks: int
    context: torch.Tensor | None = field(default=None, repr=False)  # [B, L, 4096] on the CPU
    recache: bool = False
    # the input video restyled (model latent space, CPU): chunk_frames latent frames per chunk
    inputs: torch.Tensor | None = field(default=None, repr=False)
    strength: float | None = None


@dataclass(frozen=True)
class SessionRef:
    """What flows along a FEWSTEP_SESSION link."""

    key: str  # the live session in SESSIONS
    position: int  # latent frames the session had generated when this reference was made
    recipe: SessionRecipe = field(repr=False)
    # a session started from a start latent, restyling an input video or switched with a re-cache is rebuilt by
    # replaying its node runs (the recipe replays plain chunks and cross-attention switches only)
    start: torch.Tensor | None = field(default=None, repr=False)  # the prefill (model latent space, CPU)
    segments: tuple[Segment, ...] = field(default=(), repr=False)

    @property
    def interactive(self) -> bool:
        return self.start is not None or any(s.recache or s.inputs is not None for s in self.segments)

    def after(self, key: str, position: int, recipe: SessionRecipe, segment: Segment) -> SessionRef:
        """The reference a node run on this one hands on."""
        if not recipe.rebuildable:  # past FEWSTEP_MAX_PROMPTS nothing is kept to rebuild with (bounds memory)
            return SessionRef(key, position, recipe)
        return SessionRef(key, position, recipe, self.start, (*self.segments, segment))


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
                       where: str, start_frames: int = 0) -> None:  # fmt: skip
    """The outputs of a run stay in host memory until the node returns: refuse a run whose outputs cannot fit
    (``start_frames``: a start latent's frames, output before the chunks)."""
    frames = chunks * config.chunk_frames + start_frames
    latent = batch * 16 * frames * (height // 8) * (width // 8) * 4
    images = batch * 4 * frames * 3 * height * width * 4 if decodes else 0
    # the per-chunk parts and their concatenation exist together once
    hint = "Generate fewer chunks per run (FewStepCausalContinue carries the session on), or a smaller video"
    check_fits({f"outputs of {chunks} chunks": 2 * (latent + images)}, "cpu", "num_chunks", where, hint)


def _wan_latent(latent, input_name: str, width: int, height: int, batch: int) -> torch.Tensor:
    """A ComfyUI Wan 2.1 video LATENT checked against the node's video, in the model's latent space [B, 16, F,
    h, w] (float32, CPU); a batch of 1 is used for every prompt of a batched conditioning."""
    samples = latent["samples"]
    encode = "VAEEncode with the Wan 2.1 VAE, or FewStepTinyVAEEncode with taew2_1"
    if samples.ndim != 5:
        raise InputError(
            input_name,
            f"a LATENT of shape {list(samples.shape)}; expected a Wan 2.1 video LATENT [batch, 16, frames, "
            f"height/8, width/8] ({encode})",
        )
    b, c, _, h, w = samples.shape
    if c != WAN21.channels:
        kind = {4: " (an SD 1.x / SDXL image latent)", WAN22.channels: " (a Wan 2.2 VAE latent)"}.get(c, "")
        raise InputError(
            input_name,
            f"{c} latent channels{kind}; this Wan 2.1 model takes the Wan 2.1 VAE's 16-channel latents ({encode})",
        )
    if (h * 8, w * 8) != (height, width):
        raise InputError(
            input_name,
            f"a latent of {w * 8}x{h * 8} px ({w}x{h} latent pixels); this video is {width}x{height} px (set "
            "width and height to the latent's, or resize the image before encoding it)",
        )
    if b not in (1, batch):
        raise InputError(
            input_name, f"a latent batch of {b}; the conditioning's batch is {batch} (or give 1)"
        )
    if not samples.is_floating_point() or not bool(torch.isfinite(samples).all()):
        raise InputError(input_name, "the latent must hold finite floating-point values")
    return WAN21.process_in(samples.float().cpu()).expand(batch, -1, -1, -1, -1).contiguous()


def _input_video(
    input_latent, input_images, tiny_vae, width: int, height: int, batch: int, chunk_frames: int
):
    """The input video of a video-to-video run in the model's latent space (CPU), from ``input_latent`` or from
    ``input_images`` encoded by the session's tiny VAE; None without one."""
    if input_latent is not None and input_images is not None:
        raise InputError("input_images", "give the input video once: input_latent or input_images, not both")
    if input_images is not None:
        if tiny_vae is None:
            raise InputError(
                "input_images",
                "IMAGE frames are encoded by the tiny VAE (taew2_1): connect tiny_vae to FewStepCausalVideoSampler, "
                "or encode the frames with VAEEncode (Wan 2.1 VAE) and connect input_latent instead",
            )
        if input_images.ndim != 4 or input_images.shape[-1] != 3:
            raise InputError("input_images", f"expected IMAGE frames [frames, height, width, 3]; got "
                             f"{list(input_images.shape)}")  # fmt: skip
        if tuple(input_images.shape[1:3]) != (height, width):
            raise InputError(
                "input_images",
                f"frames of {input_images.shape[2]}x{input_images.shape[1]} px; this video is {width}x{height} px "
                "(resize the frames, or set width and height to theirs)",
            )
        frames = input_images.permute(0, 3, 1, 2).unsqueeze(0)  # one video [1, T, 3, H, W]
        try:
            raw = tiny_vae.encode_raw(frames).float().cpu()
        except InputError as err:
            # a tiny VAE loaded without its encoder is the tiny_vae's fault, not the frames'
            err.input_name = "tiny_vae" if err.input_name == "vae" else "input_images"
            raise
        input_latent, input_name = {"samples": raw}, "input_images"
    elif input_latent is not None:
        input_name = "input_latent"
    else:
        return None
    latents = _wan_latent(input_latent, input_name, width, height, batch)
    if latents.shape[2] < chunk_frames:
        raise InputError(
            input_name,
            f"{latents.shape[2]} latent frames do not fill one chunk of {chunk_frames} (4 video frames make a latent "
            "frame); give a longer video",
        )
    return latents


def _restyled_chunks(num_chunks: int, inputs: torch.Tensor | None, chunk_frames: int) -> int:
    """Chunks a run makes: ``num_chunks``, or fewer when the input video covers fewer whole chunks."""
    return num_chunks if inputs is None else min(num_chunks, inputs.shape[2] // chunk_frames)


def _generate(session, chunks: int, inputs, strength, before_forward, on_chunk=None) -> None:
    """``chunks`` chunks of ``session``; with ``inputs`` (model latent space), each restyles its ``chunk_frames``
    of them at ``strength``, fed one chunk ahead as a live source would (the session's queue is bounded)."""
    c = session.config.chunk_frames
    # on a worker pool each job carries the input chunks queued when it is sent: queued as far ahead as the
    # session's bounded queue allows, a job makes up to that many chunks (one ahead would be one job per chunk)
    ahead = 1 if isinstance(session, VideoSession) else MAX_QUEUED_CHUNKS
    fed = 0

    def feed_until(count: int) -> None:
        nonlocal fed
        while fed < min(count, chunks):
            session.feed(inputs[:, :, fed * c : (fed + 1) * c])
            fed += 1

    if inputs is not None:
        session.set_strength(strength)
        feed_until(ahead)
    try:
        for i, chunk in enumerate(session.chunks(chunks, before_forward=before_forward)):
            if inputs is not None:
                feed_until(i + 1 + ahead)
            if on_chunk is not None:
                on_chunk(i, chunk)
    finally:
        if inputs is not None:  # an interrupted run leaves no input queued for the next node run
            if session.inputs is not None:
                session.inputs.clear()
            session.set_strength(None)


def _rebuild(ref: SessionRef, where: str):
    """A new session advanced to ``ref.position``: the recipe's replay, or for a session with a start latent,
    an input video or a re-cache switch the replay of its node runs."""
    recipe = ref.recipe
    if not ref.interactive or not recipe.rebuildable:
        return recipe.rebuild(ref.position, where, before_forward=_cancel_hook)
    session, compiled = recipe.open(recipe.prompts[0][1], where)
    try:
        if ref.start is not None:
            session.prefill(ref.start, before_forward=_cancel_hook)
        for segment in ref.segments:
            if segment.context is not None:
                session.set_prompt(segment.context, recache=segment.recache)
            _generate(session, segment.chunks, segment.inputs, segment.strength, _cancel_hook)
    except BaseException:
        session.dispose()
        raise
    finally:
        if compiled is not None:
            compiled.finish()
    return session


def _session_batch(recipe: SessionRecipe, context) -> int:
    """The session's batch, known before it is rebuilt: its first prompt's (or the new prompt's, when the recipe
    kept none; the session checks that one against its own)."""
    if recipe.prompts:
        return recipe.prompts[0][1].shape[0]
    return 1 if context is None else context.shape[0]


def _refuse_on_pool(options, start, chunk_frames: int, recache: bool) -> None:
    """What a session on a worker pool cannot run (its sharded workers run only a chunk's shape), refused before
    the pool is asked for anything: a re-cache, and a start latent with a lone first frame."""
    if options.in_process:
        return
    if recache:
        raise InputError(
            "parallel",
            "recache runs in this process only: a session on a worker pool switches the prompt without it "
            "(its sharded workers do not run the re-cache's forward); disconnect parallel, or turn recache off",
        )
    if start is not None and start.shape[2] % chunk_frames:
        frames = start.shape[2]
        raise InputError(
            "start_latent",
            f"{_count(frames, 'latent frame')}: on a worker pool a start takes whole chunks of {chunk_frames} "
            f"({chunk_frames}, {2 * chunk_frames}, ... frames); a lone first frame (an image, or one frame more "
            "than whole chunks) runs in this process only (disconnect parallel)",
        )


def _run(session: VideoSession, chunks: int, node: str, inputs=None, strength=None, prefill=None,
         recache=None):  # fmt: skip
    """Generate, with Cancel checked before every forward, progress per denoising step and each chunk's last
    frame as the preview. ``inputs``: the input video (restyled at ``strength``); ``prefill``: the start's
    ``PrefillResult``, whose latents and frames come first in the outputs; ``recache``: a switch's report."""
    per_step = isinstance(session, VideoSession)
    sigmas = session.sigmas if inputs is None else v2v_sigmas(session.sigmas, strength)
    steps = len(sigmas) - 1
    progress = Progress(chunks * steps if per_step else chunks, desc=node)
    first_index = session.stats.chunks_generated
    stream = ChunkStream(chunks, session.config.chunk_frames)

    def before_forward(chunk: int, step: int | None) -> None:
        check_interrupt()
        if step is not None:
            progress.update((chunk - first_index) * steps + step)

    parts, frames, timings = [], [], []
    if prefill is not None:  # the video starts at the given frames (as Self-Forcing's output does)
        parts.append(WAN21.process_out(prefill.latents))
        if prefill.decoded is not None and prefill.decoded.shape[1]:
            frames.append(prefill.decoded)

    def on_chunk(i, chunk):
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

    try:
        _generate(session, chunks, inputs, strength, before_forward, on_chunk)
    finally:
        stream.close()  # the clips still being written: their events come before the node's own
        progress.close()
    latent = torch.cat(parts, dim=2)
    b, _, _, h, w = latent.shape
    if frames:
        images = torch.cat(frames, dim=1).flatten(0, 1).permute(0, 2, 3, 1).contiguous()
    else:
        images = torch.zeros(0, h * 8, w * 8, 3)
    report = _report(session, timings)
    extra = []
    if prefill is not None:
        extra.append(
            f"prefill: {_count(prefill.frames, 'start latent frame')} in {prefill.seconds:.2f} s "
            f"({prefill.seconds_per_frame:.3f} s/frame, forwards of {'+'.join(map(str, prefill.blocks))} frames)"
        )
    if recache is not None:
        chunk_s = timings[0].seconds if timings else 0.0
        extra.append(
            f"re-cache: {recache.frames} window frames recomputed under the new prompt in {recache.seconds:.2f} s "
            f"(the next chunk: {chunk_s:.2f} s)"
        )
    if inputs is not None:
        used = chunks * session.config.chunk_frames
        extra.append(
            f"video to video: {_count(chunks, 'chunk')} restyled at strength {strength:g} "
            f"({_count(steps, 'step')} each), {used} of the input's {inputs.shape[2]} latent frames used"
        )
    return latent, images, "\n".join([report, *extra])


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


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


STRENGTH_INPUT = (
    "FLOAT",
    {
        "default": 0.7,
        "min": 0.01,
        "max": 1.0,
        "step": 0.01,
        "tooltip": "Video to video only (with input_latent / input_images): the noise each input chunk is restyled "
        "from, 0.01..1. Low keeps the input's look, 1.0 ignores the input (text to video).",
    },
)


def _input_video_inputs(sampler: bool) -> dict:
    where = "this node's tiny_vae (taew2_1)" if sampler else "the sampler's tiny_vae (taew2_1)"
    return {
        "input_latent": (
            "LATENT",
            {
                "tooltip": "Video to video: a Wan 2.1 video LATENT to restyle (VAEEncode with the Wan 2.1 VAE), "
                "chunk_frames latent frames per chunk; a shorter input makes fewer chunks than num_chunks."
            },
        ),
        "input_images": (
            "IMAGE",
            {
                "tooltip": f"Video to video: IMAGE frames to restyle, encoded by {where}, 4 frames per latent "
                "frame, at the video's width and height. Instead of input_latent."
            },
        ),
        "strength": STRENGTH_INPUT,
    }


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
        "when a tiny VAE (taew2_1) is given, and a session that FewStepCausalContinue extends. Optional: a "
        "start_latent to begin from (image to video, video extension) and an input video to restyle chunk by "
        "chunk (input_latent or input_images, with strength)."
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
                "start_latent": (
                    "LATENT",
                    {
                        "tooltip": "Image to video / video extension: a Wan 2.1 LATENT (VAEEncode with the Wan 2.1 "
                        "VAE) the video starts from, committed to the KV cache before the first chunk; 1 + k x "
                        "chunk_frames or k x chunk_frames latent frames. Its frames come first in the outputs."
                    },
                ),
                **_input_video_inputs(sampler=True),
            },
        }

    @reports_input_errors("FewStepCausalVideoSampler", {"context": "positive", "chunks": "num_chunks"})
    def generate(self, model, positive, width, height, num_chunks, chunk_frames, window_frames, sink_frames,
                 schedule, steps, seed, tiny_vae=None, context_noise=0.0, rope="cache", kv_dtype="bf16",
                 keep_recent_chunks=1, parallel=None, start_latent=None, input_latent=None, input_images=None,
                 strength=0.7):  # fmt: skip
        where = "FewStepCausalVideoSampler"
        _check_wan(model, where)
        config = CausalConfig(chunk_frames=chunk_frames, window_frames=window_frames, sink_frames=sink_frames,
                              schedule=schedule, steps=steps, context_noise=context_noise, rope=rope,
                              kv_dtype=kv_dtype, keep_recent_chunks=keep_recent_chunks)  # fmt: skip
        context = _prompt(positive, "positive")
        batch = context.shape[0]
        start = None
        if start_latent is not None:  # checked before any work: a wrong latent fails fast
            start = _wan_latent(start_latent, "start_latent", width, height, batch)
            prefill_blocks(start.shape[2], chunk_frames, "start_latent")
        inputs = _input_video(input_latent, input_images, tiny_vae, width, height, batch, chunk_frames)
        chunks = _restyled_chunks(num_chunks, inputs, chunk_frames)
        _check_outputs_fit(batch, width, height, config, chunks, tiny_vae is not None, where,
                           0 if start is None else start.shape[2])  # fmt: skip
        # in this process, or on the connected pool (the engine opens the session there: engine.run.placement)
        options = run_options(parallel, where)
        _refuse_on_pool(options, start, chunk_frames, False)
        if options.in_process:  # with a pool the workers hold the model; this process does not run it
            load_for_run(model)
        recipe = _recipe(model, width, height, config, seed, tiny_vae, context.cpu(), options)
        session, compiled = recipe.open(context, where)
        key = SESSIONS.add(session)
        _free_sessions_on_unload(model)
        try:
            prefill = None if start is None else session.prefill(start, before_forward=_cancel_hook)
            latent, images, report = _run(session, chunks, where, inputs, strength, prefill)
        finally:
            telemetry = compiled.finish() if compiled is not None else None
        if telemetry is not None:
            report += "\n" + "\n".join(telemetry.summary_lines())
        SESSIONS.touch(key)
        segment = Segment(chunks, inputs=inputs, strength=None if inputs is None else strength)
        ref = SessionRef(key, 0, recipe, start).after(key, session.frames_generated, recipe, segment)
        return ({"samples": latent}, images, ref, report)


class FewStepCausalContinue(ReturnsVideoChunks):
    DESCRIPTION = (
        "Continues a causal video session for more chunks, optionally with a new prompt (only the "
        "cross-attention cache is rebuilt, as in CausVid's prompt switching; with recache the window's KV cache "
        "is recomputed under it, as in LongLive) or restyling an input video. Outputs the new chunks."
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
                "recache": (
                    "BOOLEAN",
                    {
                        "default": False,
                        "tooltip": "With a new positive: recompute the KV cache of the frames in the window "
                        "under the new prompt (LongLive), so the old prompt does not linger. Off: only the "
                        "cross-attention cache changes (CausVid), as before.",
                    },
                ),
                **_input_video_inputs(sampler=False),
            },
        }

    @reports_input_errors("FewStepCausalContinue", {"context": "positive", "chunks": "num_chunks"})
    def extend(self, session, num_chunks, positive=None, recache=False, input_latent=None, input_images=None,
               strength=0.7):  # fmt: skip
        if not isinstance(session, SessionRef):
            raise InputError("session", "expected a FEWSTEP_SESSION from FewStepCausalVideoSampler")
        where = "FewStepCausalContinue"
        key, recipe = session.key, session.recipe
        context = None if positive is None else _prompt(positive, "positive")
        recache = bool(recache and context is not None)  # a re-cache belongs to a prompt switch
        inputs = _input_video(input_latent, input_images, recipe.tiny_vae, recipe.width, recipe.height,
                              _session_batch(recipe, context),
                              recipe.config.chunk_frames)  # fmt: skip
        chunks = _restyled_chunks(num_chunks, inputs, recipe.config.chunk_frames)
        if recipe.options is not None:
            _refuse_on_pool(recipe.options, None, recipe.config.chunk_frames, recache)
        if recipe.in_process:  # with a pool the workers hold the model
            load_for_run(recipe.model)
        live = SESSIONS.get(key, where) if SESSIONS.alive(key) else None
        if live is None or live.frames_generated != session.position:
            # freed, or moved on since this reference was made (ComfyUI re-ran this node on a cached output)
            log.info("fewstep: %s rebuilds the session to latent frame %d (%s)", where, session.position,
                     "it was freed" if live is None else "it has moved on")  # fmt: skip
            live = _rebuild(session, where)
            key = SESSIONS.add(live)
        live.where = where
        _check_outputs_fit(live.batch, recipe.width, recipe.height, recipe.config, chunks,
                           recipe.tiny_vae is not None, where)  # fmt: skip
        report_recache = None
        if context is not None:
            report_recache = (
                live.set_prompt(context, recache=recache) if recache else live.set_prompt(context)
            )
            recipe = recipe.with_prompt(live.frames_generated, context.cpu())
        latent, images, report = _run(live, chunks, where, inputs, strength, recache=report_recache)
        SESSIONS.touch(key)
        kept = None if context is None else recipe.prompts[-1][1] if recipe.rebuildable else None
        segment = Segment(chunks, kept, recache, inputs, None if inputs is None else strength)
        return (
            {"samples": latent},
            images,
            session.after(key, live.frames_generated, recipe, segment),
            report,
        )
