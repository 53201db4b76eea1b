"""``python -m fewstep stream``: causal chunk-by-chunk video with a rolling KV cache, timed per chunk."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct

import torch

from ..engine.causal import ROPE_MODES, CausalConfig
from ..engine.causal.kv_cache import KV_DTYPES
from ..engine.causal.recipe import open_session
from ..engine.checks import check_seed
from ..engine.errors import InputError
from ..engine.handle import open_model
from ..engine.models.registry import FAMILIES, all_presets
from ..engine.ops import COMPUTE_DTYPES, WEIGHT_DTYPES
from ..engine.prompt_embeddings import seeded_text_embedding
from ..engine.units import format_bytes
from ..engine.vae import load_tiny_vae
from . import stream_interactive, stream_pool, stream_script
from .common import (
    RenamedUnit,
    add_compile_arguments,
    add_deprecated_alias,
    add_lora_argument,
    add_model_arguments,
    add_text_tokens_argument,
    check_at_least,
    check_lora_files,
    compile_config,
    compile_report,
    load_condition,
    prepare_out,
    progress_bar,
    say,
    source_of,
    with_compile,
    with_loras,
    write_json,
)
from .stream_snapshot import (
    add_snapshot_arguments,
    apply_snapshot_settings,
    check_save_path,
    open_resumed,
    save_if_asked,
)
from .text_prompts import add_text_encoder_arguments, check_text_flags, encode_texts, text_encoder_line
from .video import VIDEO_FPS, WEBP_MAX_BYTES, open_video, write_video

HELP = "generate a causal video chunk by chunk (Wan 2.1 students) and report per-chunk seconds and KV bytes"


def add_arguments(p) -> None:
    add_model_arguments(
        p,
        FAMILIES["wan"].presets,
        default="wan-tiny",
        model_help="Wan preset: the architecture built for dummy weights",
        checkpoints="Self-Forcing, CausVid, ComfyUI",
        elsewhere={
            name: f"{name} is a {family.name} image model, which `python -m fewstep generate --model {name}` runs"
            for name, (family, _) in all_presets().items()
            if family.is_image
        },
    )
    add_lora_argument(p)
    p.add_argument("--height", type=int, default=64, help="video height in pixels (multiple of 16)")
    p.add_argument("--width", type=int, default=96, help="video width in pixels (multiple of 16)")
    p.add_argument("--chunks", type=int, default=None, help="chunks to generate (default: 4)")
    p.add_argument(
        "--latent-frames",
        type=int,
        default=None,
        help="latent frames to generate instead of --chunks, a multiple of --chunk-frames (default: 4 chunks); "
        "n latent frames decode to 4n - 3 video frames",
    )
    p.add_argument(
        "--frames",
        action=RenamedUnit,
        message="--frames was latent frames here; use --latent-frames {value} (plan names video frames "
        "--video-frames)",
    )
    p.add_argument("--chunk-frames", type=int, default=3, help="latent frames denoised together as one chunk")
    p.add_argument(
        "--window-frames",
        type=int,
        default=21,
        help="latent frames of the rolling KV window a chunk attends to",
    )
    p.add_argument(
        "--sink-frames", type=int, default=0, help="first latent frames kept in the KV window forever"
    )
    p.add_argument("--steps", type=int, default=4, help="denoising steps per chunk")
    p.add_argument("--schedule", default="wan-dmd-4step", help="sigma schedule of each chunk's denoising")
    p.add_argument(
        "--context-noise",
        type=float,
        default=0.0,
        help="timestep (0..1000) of the pass that commits a finished chunk to the KV cache; 0: clean",
    )
    p.add_argument(
        "--rope",
        default="cache",
        choices=list(ROPE_MODES),
        help="RoPE positions of the cached keys: cache reads every key at its place in the window (sinks first, "
        "then the retained frames; distances stay bounded, so a stream runs past any position table); absolute "
        "at its frame index (Self-Forcing, CausVid). Both rotate a key once, when it is written; under cache "
        "the sink keys are rotated anew, from an unrotated copy, when the window slides",
    )
    p.add_argument(
        "--kv-dtype",
        default="bf16",
        choices=list(KV_DTYPES),
        help="KV storage: bf16 is the compute dtype, unquantized; int8 / int4 quantize completed chunks older "
        "than --keep-recent-chunks (never the sink frames)",
    )
    p.add_argument(
        "--keep-recent-chunks",
        type=int,
        default=1,
        help="with int8/int4: completed chunks kept unquantized besides the current one",
    )
    add_deprecated_alias(p, "--keep-recent", "--keep-recent-chunks", "keep_recent_chunks")
    p.add_argument("--seed", type=int, default=0, help="noise seed: the same seed gives the same video")
    add_text_tokens_argument(p, "text tokens of the synthetic umT5 prompt")
    p.add_argument(
        "--cond",
        default=None,
        help="safetensors with 'context' [B, L, 4096] (default: a seeded synthetic prompt)",
    )
    add_text_encoder_arguments(
        p, "with --text-encoder (umT5-XXL): the video's prompt, encoded as Wan's pipeline encodes it; also makes "
        "--prompt-switch take CHUNK:TEXT and lets --script run real weights (default: --cond, else a seeded "
        "synthetic prompt)",
    )  # fmt: skip
    p.add_argument(
        "--tiny-vae",
        default=None,
        help="decode each chunk to frames as it lands: dummy:taew2_1 or taew2_1.pth (default: no decode, "
        "latents only); with --out the frames are written as a video",
    )
    add_compile_arguments(p)
    p.add_argument(
        "--out",
        default=None,
        help="folder to write into (default: nothing written): latents.safetensors and stream.json; with "
        f"--tiny-vae also video.mp4 (PyAV) or video.webp (Pillow, when PyAV is absent) at {VIDEO_FPS} fps and "
        "chunks/chunk_NNNN.* as each chunk lands. The MP4 is encoded frame by frame (flat memory); Pillow "
        f"assembles a WebP in memory, so video.webp keeps at most {WEBP_MAX_BYTES // 2**20} MiB of frames and "
        "longer streams are complete only in the chunk files",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the report (with the compile telemetry) as JSON instead of a line per chunk",
    )
    stream_interactive.add_arguments(p)
    stream_script.add_arguments(p)
    add_snapshot_arguments(p)
    stream_pool.add_arguments(p)


def chunk_count(args) -> int:
    if args.latent_frames is not None:
        if args.latent_frames < 1 or args.latent_frames % args.chunk_frames:
            raise InputError(
                "--latent-frames",
                f"{args.latent_frames} latent frames is not a positive multiple of the chunk ({args.chunk_frames})",
            )
        return args.latent_frames // args.chunk_frames
    return 4 if args.chunks is None else args.chunks


def synthetic_prompt(seed: int, text_tokens: int, text_dim: int) -> torch.Tensor:
    """The seeded synthetic umT5 prompt a stream of ``seed`` uses without --cond."""
    return seeded_text_embedding(seed, text_tokens, text_dim)


def open_stream_parts(args, compiling):
    """(handle with its LoRAs and compile feature, CausalConfig, tiny VAE or None) of a stream's flags: what a
    single stream and a pool of them open alike."""
    handle = open_model(source_of(args), weight_dtype=WEIGHT_DTYPES[args.weight_dtype], dtype=COMPUTE_DTYPES[args.dtype],
                        device=args.device, input_name="--weights")  # fmt: skip
    if handle.family.name != "wan":
        raise InputError("--weights", f"stream runs Wan-family models; this is a {handle.family.name} model")
    handle = with_loras(handle, args.lora)
    config = CausalConfig(
        chunk_frames=args.chunk_frames, window_frames=args.window_frames, sink_frames=args.sink_frames,
        schedule=args.schedule, steps=args.steps, context_noise=args.context_noise, rope=args.rope,
        kv_dtype=args.kv_dtype, keep_recent_chunks=args.keep_recent_chunks,
    )  # fmt: skip
    vae = (
        load_tiny_vae(args.tiny_vae, device=handle.device, input_name="--tiny-vae") if args.tiny_vae else None
    )
    return with_compile(handle, compiling), config, vae


def encode_stream_prompts(args, scripts, interactive) -> tuple[dict, dict | None]:
    """With --text-encoder: ``({text: context [1, L, 4096]}, report)`` for every prompt of the run (--prompt, the
    --prompt-switch texts, each script's prompt and prompt controls), encoded before the model loads, the encoder
    freed; the report line printed. ``({}, None)`` without one."""
    if not args.text_encoder:
        return {}, None
    texts = [args.prompt] if args.prompt is not None else []
    if interactive is not None:
        texts += [switch.path for _, switch in sorted(interactive.switches.items())]
    for script in scripts or []:
        texts.append(script.prompt)
        texts += [c.value for c in script.controls if c.kind == "prompt"]
    if not texts:
        raise InputError("--text-encoder", "encodes --prompt, --prompt-switch CHUNK:TEXT or a --script's prompts: "
                         "give one of them")  # fmt: skip
    embeddings, report = encode_texts(args, texts)
    contexts = {text: e.context for text, e in embeddings.items()}
    if interactive is not None:
        interactive.switches = {
            chunk: dataclasses.replace(switch, context=contexts[switch.path])
            for chunk, switch in interactive.switches.items()
        }
    if not args.json:
        say(text_encoder_line(report))
    return contexts, report


def run(args) -> int:
    # --script: read and checked first (the flags it replaces are refused); it gives the seed and the chunks
    scripts = stream_script.prepare(args)
    stream_interactive.check_combinations(args, pool=stream_pool.requested(args))
    check_text_flags(args)
    if stream_pool.requested(args):  # --sessions N, --join-every, --swap-every...: many streams in one pool
        return stream_pool.run(args, scripts)
    script = scripts[0] if scripts else None
    if script is not None:
        args.seed, args.chunks = script.seed, script.chunks_to_run
    apply_snapshot_settings(args)  # --resume: the snapshot's settings (conflicting flags refused)
    check_save_path(args)
    # --init-latents, --input-video, --prompt-switch: files read and checked before anything is loaded
    interactive = stream_interactive.prepare(args)
    n_chunks = chunk_count(args)
    check_at_least(args, text_tokens=1, chunks=1)
    check_seed(args.seed)
    compiling = compile_config(args)  # a bad --compile / --cuda-graph fails before loading
    check_lora_files(args.lora)
    if args.out:
        prepare_out(args.out)
    # every prompt of the run encoded, the encoder freed, then the model loaded
    texts, text_report = encode_stream_prompts(args, scripts, interactive)
    handle, config, vae = open_stream_parts(args, compiling)
    p = handle.params
    embed = stream_script.PromptTexts(p, texts) if script is not None else None
    if script is not None:
        context = embed(script.prompt)
    elif args.prompt is not None:
        context = texts[args.prompt]
    elif args.cond:
        context = load_condition(args.cond, None).context
    else:
        context = synthetic_prompt(args.seed, args.text_tokens, p.text_dim)
    # the session's run (engine.run): the compiled forward stands for the model; finish() is its telemetry
    resumed = None
    if args.resume:  # the model checked against the snapshot, the session continued where it was saved
        session, compiled, resumed = open_resumed(args, handle, vae)
    else:
        session, compiled = open_session(
            handle, context, args.height, args.width, config, args.seed, vae, "stream"
        )
    prefill = None
    media = None
    if script is not None:  # the start image prefilled as the live node prefills it
        media = stream_script.ScriptMedia(script, args.width, args.height)
        start = media.start_latents(vae) if script.start_image is not None else None
        if start is not None:
            started = session.prefill(start)
            prefill = stream_interactive.prefill_report(started, script.start_image)
            if not args.json:
                say(stream_interactive.prefill_line(prefill))
    if interactive is not None:
        stream_interactive.check_with_session(interactive, session)
        if interactive.init_latents is not None:
            started = session.prefill(interactive.init_latents)
            prefill = stream_interactive.prefill_report(started, args.init_latents)
            if not args.json:
                say(stream_interactive.prefill_line(prefill))
    if script is not None:
        driver = stream_script.ScriptDriver(script, session, embed, media, vae, args.chunk_frames)
    else:
        driver = stream_interactive.Driver(interactive, session, args.chunk_frames)
    first_frame = 4 * session.frames_generated  # video frames before this run's (0 for a new stream)
    # Each chunk is printed, written (--out) and dropped: memory stays flat however many chunks run.
    output = StreamOutput(args.out, session, p.in_dim, n_chunks, args.chunk_frames, vae is not None,
                          args.width, args.height) if args.out else None  # fmt: skip
    if output is not None and prefill is not None:
        output.start(started.decoded)  # the start frames open the video (an image to video begins with it)
    rows = []
    steps_per_chunk = len(session.sigmas) - 1
    try:
        with (
            progress_bar("chunks", n_chunks) as chunk_bar,
            progress_bar("steps", steps_per_chunk, position=1) as step_bar,
        ):

            def before_forward(index, step):  # before every DiT forward; step None: the commit pass
                if step == 0:
                    step_bar.reset(total=steps_per_chunk)  # a chunk's denoising starts
                elif step is not None:
                    step_bar.update(step - step_bar.n)  # the steps done before this forward

            driver.before_chunk(0)  # what a live client sends before the first chunk (input frames, a switch)
            # counted by hand: enumerate keeps its last (index, chunk) tuple for reuse, which would hold the
            # previous chunk alive while the next one is generated
            run_chunk = -1
            for chunk in session.chunks(n_chunks, before_forward=before_forward):
                run_chunk += 1
                step_bar.update(step_bar.total - step_bar.n)
                chunk_bar.update()
                fields, switch_note = driver.chunk_fields(run_chunk, chunk)
                rows.append(
                    {"index": chunk.index, "start_frame": chunk.start_frame, "seconds": chunk.seconds,
                     "commit_seconds": chunk.commit_seconds, "kv_bytes": chunk.kv_bytes,
                     "kv_bytes_used": chunk.kv_bytes_used, **fields}
                )  # fmt: skip
                written = output.append(chunk) if output is not None else []
                if not args.json:
                    restyled = (
                        "" if chunk.strength is None else f", video to video at strength {chunk.strength:g}"
                    )
                    say(
                        f"chunk {chunk.index}: latent frames {chunk.start_frame}-{chunk.start_frame + args.chunk_frames - 1}"
                        f"{restyled}, {chunk.seconds:.3f} s{switch_note}, KV {format_bytes(chunk.kv_bytes_used)} of "
                        f"{format_bytes(chunk.kv_bytes)}" + "".join(f"; wrote {path}" for path in written)
                    )
                del chunk
                if run_chunk + 1 < n_chunks:  # the next chunk's input frames and switch, as they would arrive
                    driver.before_chunk(run_chunk + 1)
        if output is not None:
            output.finish()
        snapshot = save_if_asked(args, session)
    finally:
        if output is not None:
            output.abandon()  # an interrupted run leaves no half-written file
        telemetry = compiled.finish() if compiled is not None else None
    report = {
        "model": handle.describe(),
        "chunks": rows,
        "first_chunk_seconds": session.stats.first_chunk_seconds,
        "kv_dtype": args.kv_dtype,
        "keep_recent_chunks": args.keep_recent_chunks,
        "kv_bytes_per_token": session.cache.bytes_per_token(),
        "kv_quantized_bytes_per_token": session.cache.quantized_bytes_per_token(),
        "kv_frames_quantized": session.cache.frames_quantized,
        "tokens_per_frame": session.cache.tokens_per_frame,
        "kv_bytes_window": session.cache.nbytes,
        "latent_frames": n_chunks * args.chunk_frames,
        "video_frames": 4 * n_chunks * args.chunk_frames - (3 if first_frame == 0 else 0),
        "compile": compile_report(telemetry),
    }
    if resumed is not None:
        report["resumed"] = resumed
    if prefill is not None:
        report["prefill"] = prefill
    if interactive is not None and interactive.input_video is not None:
        frames = interactive.input_video.shape[2]
        report["input_video"] = {"path": args.input_video, "frames": frames, "strength": interactive.strength,
                                 "frames_used": n_chunks * args.chunk_frames,
                                 "frames_unused": frames - n_chunks * args.chunk_frames}  # fmt: skip
    if interactive is not None and interactive.switches:
        report["prompt_switches"] = driver.switch_rows
    if script is not None:
        report["script"] = {"path": script.path, "controls": driver.switch_rows}
    if snapshot is not None:
        report["snapshot"] = snapshot
    if text_report is not None:
        report["text_encoder"] = text_report
    if args.out:
        report["files"] = output.files
        write_json(os.path.join(args.out, "stream.json"), report)
    if args.json:
        print(json.dumps(report, indent=2))
    elif output is not None:
        for line in output.summary():
            print(line)
        print(f"wrote {os.path.join(args.out, 'stream.json')}")
    if snapshot is not None and not args.json:
        print(f"saved the session to {snapshot['path']} ({format_bytes(snapshot['bytes'])}); continue it with "
              f"--resume {snapshot['path']}")  # fmt: skip
    session.dispose()
    return 0


class StreamOutput:
    """What ``--out`` gets, written as each chunk lands: the latents (and decoded frames) into one
    latents.safetensors, and with frames the whole video (video.mp4 through PyAV, else video.webp through
    Pillow) plus each chunk as its own small video, watchable while the stream goes on (an MP4 is playable
    only once closed)."""

    def __init__(self, out: str, session, channels: int, n_chunks: int, chunk_frames: int, frames: bool,
                 width: int, height: int):  # fmt: skip
        latent_frames = n_chunks * chunk_frames
        tensors = {"latent": ((session.batch, channels, latent_frames, *session.latent_hw), 2)}
        if frames:  # the first chunk of a stream decodes 3 frames fewer (a resumed one is past it)
            trimmed = 3 if session.frames_generated == 0 else 0
            tensors["frames"] = ((session.batch, 4 * latent_frames - trimmed, 3, height, width), 1)
        self.out = out
        self.latents = ChunkedSafetensors(os.path.join(out, "latents.safetensors"), tensors)
        self.videos = []
        self.files: dict = {"latents": self.latents.path, "video": [], "chunks": []}
        if frames:
            os.makedirs(os.path.join(out, "chunks"), exist_ok=True)
            self.videos = [
                open_video(os.path.join(out, "video" if session.batch == 1 else f"video_{b}"), width, height)
                for b in range(session.batch)
            ]

    def start(self, decoded) -> None:
        """The decoded start frames of a prefilled stream (``--init-latents``): the first frames of the video
        (not of latents.safetensors, which holds the generated chunks)."""
        if decoded is not None:
            for video, frames in zip(self.videos, decoded):
                video.append(frames)

    def append(self, chunk) -> list[str]:
        """Write one chunk; the chunk files it wrote."""
        self.latents.append("latent", chunk.raw)
        written = []
        if chunk.frames is not None:
            self.latents.append("frames", chunk.frames)
            for b, (video, frames) in enumerate(zip(self.videos, chunk.frames)):
                video.append(frames)
                stem = f"chunk_{chunk.index:04d}" + ("" if len(self.videos) == 1 else f"_{b}")
                written.append(write_video(os.path.join(self.out, "chunks", stem), frames))
        self.files["chunks"] += written
        return written

    def finish(self) -> None:
        self.latents.finish()
        for video in self.videos:
            video.close()
            self.files["video"].append(video.path)

    def abandon(self) -> None:
        self.latents.abandon()
        for video in self.videos:
            video.abandon()

    def summary(self) -> list[str]:
        lines = [f"wrote {self.latents.path}"]
        for video in self.videos:
            lines.append(f"wrote {video.path} ({video.frames} frames at {VIDEO_FPS} fps)")
            if getattr(video, "dropped", 0):
                lines.append(
                    f"  {video.dropped} later frames are not in {os.path.basename(video.path)}: without PyAV the "
                    f"WebP is assembled in memory, bounded at {WEBP_MAX_BYTES // 2**20} MiB; they are in "
                    "the chunk files (pip install av for a full MP4)"
                )
        if self.videos:
            lines.append(
                f"wrote {len(self.files['chunks'])} chunk videos in {os.path.join(self.out, 'chunks')}"
            )
        else:
            lines.append(
                "no video: decoding frames needs --tiny-vae (taew2_1.pth; dummy:taew2_1 with dummy weights)"
            )
        return lines


class ChunkedSafetensors:
    """A float32 safetensors file written chunk by chunk: the header (every tensor's final shape) goes first, then
    each chunk's slice is written at its offsets, so nothing of a chunk stays in memory once it is written. The
    file is the one ``save_file`` writes for the whole tensors; it is written under a temporary name and renamed
    by :meth:`finish`, so an interrupted run leaves no partial file.

    ``tensors``: name -> (final shape, the axis the chunks follow each other along)."""

    def __init__(self, path: str, tensors: dict[str, tuple[tuple[int, ...], int]]):
        self.path, self.tensors = path, tensors
        header, self._base, offset = {}, {}, 0
        for name, (shape, _axis) in tensors.items():
            size = 4 * math.prod(shape)
            header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
            self._base[name] = offset
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._data = 8 + len(raw)
        self.written = dict.fromkeys(tensors, 0)  # slices written along each stream axis
        self._tmp = path + ".partial"
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - kept open across appends; closed by finish / abandon
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._file.truncate(self._data + offset)

    def append(self, name: str, part: torch.Tensor) -> None:
        """Write ``part``, the next slice of tensor ``name`` along its stream axis."""
        shape, axis = self.tensors[name]
        start, length, inner = self.written[name], part.shape[axis], math.prod(shape[axis + 1 :])
        if start + length > shape[axis]:
            raise ValueError(f"{name}: {start + length} slices along axis {axis} of {list(shape)}")
        rows = (
            part.detach().float().cpu().contiguous().numpy().reshape(math.prod(shape[:axis]), length * inner)
        )
        for outer, row in enumerate(rows):  # the slice is contiguous within each index of the leading axes
            self._file.seek(self._data + self._base[name] + 4 * (outer * shape[axis] + start) * inner)
            self._file.write(row.tobytes())
        self.written[name] += length

    def finish(self) -> None:
        for name, (shape, axis) in self.tensors.items():
            if self.written[name] != shape[axis]:
                raise ValueError(
                    f"{name}: {self.written[name]} of {shape[axis]} slices written along axis {axis}"
                )
        self._file.close()
        os.replace(self._tmp, self.path)

    def abandon(self) -> None:
        """Remove the file unless :meth:`finish` completed it."""
        if not self._file.closed:
            self._file.close()
            os.remove(self._tmp)
