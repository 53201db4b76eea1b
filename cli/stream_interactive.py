"""``stream --init-latents``, ``--input-video`` / ``--strength`` and ``--prompt-switch``: a stream that starts
from given latent frames (image to video, video extension), restyles an input video chunk by chunk (video to
video) and switches prompts between chunks, with or without a KV re-cache (``engine.causal.session``).

Every file is checked before the model is loaded (the batch, which the prompt or a resumed snapshot fixes,
once the session is open, before its first chunk): a bad file or value is one error naming the flag, not a
failure after minutes of loading. The latent files hold ComfyUI's raw Wan 2.1 latent layout (what core's
``VAEEncode`` with the Wan 2.1 VAE gives, and what ``--out`` writes): ``WAN21.process_in`` maps them to the
model's space.

The input video is fed to the session as a live source would feed it: one chunk's frames before each chunk,
never more than the next chunk ahead (the session's queue holds at most ``MAX_QUEUED_CHUNKS``). A prompt
switch is sent through the session's control channel before its chunk, so the chunk reports it (and its
re-cache) the way a live client sees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engine.causal.prefill import prefill_blocks
from ..engine.causal.session import check_context
from ..engine.causal.video_to_video import check_strength
from ..engine.errors import InputError
from ..engine.latent_formats import WAN21
from .common import load_condition
from .files import read_tensors, tensor_named

LATENT_KEY = "latent"
RECACHE_SUFFIX = ":recache"
# what the three flags are called when they cannot combine with another flag
INTERACTIVE_FLAGS = {"init_latents": "--init-latents", "input_video": "--input-video",
                     "prompt_switch": "--prompt-switch"}  # fmt: skip
LAYOUT = "ComfyUI's raw Wan 2.1 latent [batch, 16, frames, height / 8, width / 8]"


def add_arguments(p) -> None:
    p.add_argument(
        "--init-latents",
        metavar="FILE",
        default=None,
        help=f"start from these clean latent frames: a safetensors with '{LATENT_KEY}', {LAYOUT} (core's "
        "VAEEncode with the Wan 2.1 VAE); committed into the KV cache before the first chunk (image to video: 1 "
        "frame; video extension: whole chunks, or one frame more); the chunks continue after them (default: "
        "none, the stream starts from noise)",
    )
    p.add_argument(
        "--input-video",
        metavar="FILE",
        default=None,
        help=f"restyle this video chunk by chunk (video to video): a safetensors with '{LATENT_KEY}', {LAYOUT}; "
        "each chunk takes the next --chunk-frames input frames, fed as a live source feeds them, noised to "
        "--strength and denoised; --chunks defaults to the whole chunks the input holds, more is refused "
        "(default: none, text to video)",
    )
    p.add_argument(
        "--strength",
        type=float,
        default=None,
        help="with --input-video: the share of noise in (0, 1] each input chunk is restyled from (0.3 keeps "
        "most of the input, 1.0 ignores it); the chunk runs the schedule's steps below it and no clean-context "
        "pass (default: none; required with --input-video)",
    )
    p.add_argument(
        "--prompt-switch",
        metavar="CHUNK:CONDFILE|TEXT[:recache]",
        action="append",
        default=[],
        help="from chunk CHUNK of this run (0-based) on, the prompt in CONDFILE (a safetensors as --cond reads; "
        "with --text-encoder, CHUNK:TEXT[:recache], the prompt's text); "
        "with :recache the K/V of the frames in the window are recomputed under the new prompt first "
        "(LongLive), without only the cross-attention changes (CausVid); repeatable, one switch a chunk; "
        "each switch prints its re-cache frames and seconds beside the chunk's (default: none)",
    )


def interactive_fields(chunk) -> dict:
    """A chunk's interactive report fields: its mode and strength, the controls applied at it, its re-cache."""
    controls = [
        {"kind": a.kind, "sequence": a.sequence, "chunk": a.chunk, "recache": a.recache,
         "replaced": a.replaced, "detail": a.detail}
        for a in chunk.controls
    ]  # fmt: skip
    recache = chunk.recache
    return {
        "mode": chunk.mode,
        "strength": chunk.strength,
        "controls": controls,
        "recache": None
        if recache is None
        else {"frames": recache.frames, "start_frame": recache.start_frame, "seconds": recache.seconds},
    }


@dataclass(frozen=True)
class PromptSwitch:
    chunk: int
    path: str
    recache: bool
    context: torch.Tensor = field(repr=False)
    spec: str = ""  # as given on the command line


@dataclass
class Interactive:
    """What the three flags asked for, read and checked (latents in the model's space, on the CPU)."""

    init_latents: torch.Tensor | None = None
    input_video: torch.Tensor | None = None
    strength: float | None = None
    switches: dict[int, PromptSwitch] = field(default_factory=dict)

    def input_chunk(self, index: int, chunk_frames: int) -> torch.Tensor:
        return self.input_video[:, :, index * chunk_frames : (index + 1) * chunk_frames]


def requested(args) -> bool:
    return any(getattr(args, dest) for dest in INTERACTIVE_FLAGS) or args.strength is not None


def check_combinations(args, pool: bool) -> None:
    """Before anything is read: the flags these three cannot go with, and ``--strength`` without an input."""
    if not requested(args):
        return
    if pool and args.init_latents and args.max_sessions is not None and args.max_sessions < args.sessions:
        raise InputError(
            "--init-latents",
            f"a start is committed into a session's slot when it joins; --max-sessions {args.max_sessions} below "
            f"--sessions {args.sessions} makes sessions wait for a slot (give every session one, or leave "
            "--init-latents out)",
        )
    if args.init_latents and args.resume:
        raise InputError(
            "--init-latents", "starts a new stream from its frames; a resumed stream is past its start (leave "
            "out one of --init-latents and --resume)",
        )  # fmt: skip
    if args.strength is not None and not args.input_video:
        raise InputError(
            "--strength",
            "restyles an input video: give --input-video FILE (without it the stream is text to video)",
        )


def read_latents(path: str, flag: str, height: int, width: int) -> torch.Tensor:
    """A latent file's ``latent``, checked against the stream's size, in the model's latent space."""
    latents = tensor_named(read_tensors(path, flag), LATENT_KEY, path, flag)
    h, w = height // 8, width // 8
    if latents.ndim != 5:
        raise InputError(flag, f"{path}: '{LATENT_KEY}' is {list(latents.shape)}; expected {LAYOUT}")
    channels = WAN21.channels
    if latents.shape[1] != channels:
        raise InputError(
            flag,
            f"{path}: '{LATENT_KEY}' has {latents.shape[1]} channels; Wan 2.1 latents have {channels} "
            "(the Wan 2.1 VAE's; Wan 2.2's 48-channel VAE is another latent space)",
        )
    lh, lw = latents.shape[3:]
    if (lh, lw) != (h, w):
        raise InputError(
            flag,
            f"{path}: latents of {lh}x{lw} latent pixels ({8 * lw}x{8 * lh} px); this stream is {width}x{height} "
            f"px ({h}x{w} latent pixels): give --width {8 * lw} --height {8 * lh}, or encode the video at "
            f"{width}x{height}",
        )
    if latents.shape[2] < 1 or latents.shape[0] < 1:
        raise InputError(flag, f"{path}: '{LATENT_KEY}' {list(latents.shape)} holds no frames")
    if not latents.is_floating_point() or not bool(torch.isfinite(latents).all()):
        raise InputError(flag, f"{path}: '{LATENT_KEY}' must hold finite floating-point values")
    return WAN21.process_in(latents.float())


def parse_switch(spec: str, text: bool = False) -> tuple[int, str, bool]:
    """``CHUNK:CONDFILE[:recache]`` -> (chunk, path, recache). The path may hold colons (``C:\\prompts\\a``):
    only the text before the first colon is the chunk, and a trailing ``:recache`` the choice."""
    chunk_text, sep, rest = spec.partition(":")
    recache = rest.endswith(RECACHE_SUFFIX)
    path = rest.removesuffix(RECACHE_SUFFIX) if recache else rest
    try:
        chunk = int(chunk_text)
    except ValueError:
        chunk = None
    if not sep or not path or chunk is None:
        if text:
            raise InputError(
                "--prompt-switch",
                f"{spec!r}: expected CHUNK:TEXT or CHUNK:TEXT:recache (a chunk number of this run, then the prompt "
                "--text-encoder encodes)",
            )
        raise InputError(
            "--prompt-switch",
            f"{spec!r}: expected CHUNK:CONDFILE or CHUNK:CONDFILE:recache (a chunk number of this run, a "
            "safetensors with 'context' as --cond reads)",
        )
    return chunk, path, recache


def read_switches(specs: list[str], text: bool = False) -> dict[int, PromptSwitch]:
    """Each ``--prompt-switch``, its file read as ``--cond`` reads it (errors naming ``--prompt-switch``). With
    ``text`` (--text-encoder given) the value is the prompt's text (``CHUNK:TEXT[:recache]``; the text may hold
    colons): its context is set once the text is encoded, before the model loads."""
    switches: dict[int, PromptSwitch] = {}
    for spec in specs:
        chunk, path, recache = parse_switch(spec, text)
        if chunk in switches:
            raise InputError(
                "--prompt-switch",
                f"{spec!r}: chunk {chunk} already switches to {switches[chunk].path} "
                f"({switches[chunk].spec!r}); one prompt switch a chunk",
            )
        if text:
            switches[chunk] = PromptSwitch(chunk, path, recache, None, spec)
            continue
        try:
            context = load_condition(path, None, "--prompt-switch").context
        except InputError as err:
            raise InputError("--prompt-switch", f"{spec!r}: {err.problem}") from None
        switches[chunk] = PromptSwitch(chunk, path, recache, context, spec)
    return switches


def prepare(args) -> Interactive | None:
    """The three flags read and checked before anything is loaded; None when none is given. Sets
    ``args.chunks`` to the whole chunks of ``--input-video`` when neither --chunks nor --latent-frames is given."""
    if not requested(args):
        return None
    c = args.chunk_frames
    out = Interactive()
    if args.init_latents:
        out.init_latents = read_latents(args.init_latents, "--init-latents", args.height, args.width)
        prefill_blocks(out.init_latents.shape[2], c, "--init-latents")  # the frame count splits into blocks
    if args.input_video:
        if args.strength is None:
            raise InputError("--strength", "is required with --input-video: the share of noise in (0, 1] each "
                             "input chunk is restyled from (0.3 keeps most of the input, 1.0 ignores it)")  # fmt: skip
        out.strength = check_strength(args.strength, "--strength")
        out.input_video = read_latents(args.input_video, "--input-video", args.height, args.width)
        frames = out.input_video.shape[2]
        covered = frames // c
        if covered < 1:
            raise InputError(
                "--input-video",
                f"{args.input_video} holds {frames} latent frames, fewer than one chunk of {c} (--chunk-frames)",
            )
        if args.chunks is None and args.latent_frames is None:
            args.chunks = covered
        elif chunks_asked(args) > covered:
            raise InputError(
                "--input-video",
                f"{args.input_video} holds {frames} latent frames: {covered} chunks of {c}; "
                f"{chunks_asked(args)} chunks were asked for (give --chunks {covered} or fewer, or leave "
                "--chunks out for the whole input)",
            )
    out.switches = read_switches(args.prompt_switch, text=bool(getattr(args, "text_encoder", None)))
    n = chunks_asked(args)
    for chunk, switch in sorted(out.switches.items()):
        if not 0 <= chunk < n:
            raise InputError(
                "--prompt-switch",
                f"{switch.spec!r}: chunk {chunk} is not a chunk of this run (0 to {n - 1}, {n} chunks)",
            )
    return out


def chunks_asked(args) -> int:
    from .stream import chunk_count

    return chunk_count(args)


def check_with_session(inter: Interactive, session, params=None, batch: int | None = None) -> None:
    """Once the session (or pool: ``params`` and ``batch`` 1) is open, before its first chunk: what depends on the
    model and the prompt (the batch, the prompts' widths)."""
    params = session.model.params if params is None else params
    batch = session.batch if batch is None else batch
    for flag, latents in (("--init-latents", inter.init_latents), ("--input-video", inter.input_video)):
        if latents is not None and latents.shape[0] != batch:
            raise InputError(
                flag,
                f"latents of batch {latents.shape[0]}; the stream's prompt has batch {batch} (one video a "
                "prompt row)",
            )
    for switch in inter.switches.values():
        try:
            check_context(params, switch.context, batch)
        except InputError as err:
            raise InputError("--prompt-switch", f"{switch.spec!r}: {err.problem}") from None


def prefill_report(result, path: str) -> dict:
    return {"path": path, "frames": result.frames, "blocks": list(result.blocks), "seconds": result.seconds,
            "seconds_per_frame": result.seconds_per_frame,
            "video_frames": 0 if result.decoded is None else result.decoded.shape[1]}  # fmt: skip


def prefill_line(report: dict) -> str:
    blocks = report["blocks"]
    return (
        f"start: {report['frames']} latent frames of {report['path']} committed in {len(blocks)} forward"
        f"{'s' if len(blocks) > 1 else ''} ({' + '.join(map(str, blocks))}), {report['seconds']:.3f} s "
        f"({report['seconds_per_frame']:.4f} s a frame)"
    )


class Driver:
    """Sends a session what a live client would send before each chunk: the input chunk, the prompt switch.
    ``session``: a :class:`VideoSession`, or anything with its ``feed`` / ``control`` / ``set_strength`` (a pool
    session through :func:`pool_session_calls`)."""

    def __init__(self, inter: Interactive | None, session, chunk_frames: int):
        self.inter, self.session, self.c = inter, session, chunk_frames
        self.switch_rows: list[dict] = []
        if inter is not None and inter.strength is not None:
            session.set_strength(inter.strength)

    def before_chunk(self, run_chunk: int) -> None:
        """Before this run's chunk ``run_chunk`` (0-based) is generated."""
        if self.inter is None:
            return
        if self.inter.input_video is not None:
            self.session.feed(self.inter.input_chunk(run_chunk, self.c))
        switch = self.inter.switches.get(run_chunk)
        if switch is not None:
            self.session.control("prompt", switch.context, recache=switch.recache)

    def chunk_fields(self, run_chunk: int, chunk) -> tuple[dict, str]:
        """(the chunk's interactive report fields, the text its line gets beside its seconds)."""
        fields = interactive_fields(chunk)
        recache = chunk.recache
        note = ""
        switch = None if self.inter is None else self.inter.switches.get(run_chunk)
        if switch is not None and any(a.kind == "prompt" for a in chunk.controls):
            if switch.recache and recache is not None:
                what = f"re-cache of {recache.frames} frames {recache.seconds:.3f} s"
            else:
                what = "cross-attention only"
            note = f" (prompt switch to {switch.path}: {what})"
            self.switch_rows.append({
                "chunk": chunk.index, "cond": switch.path, "recache": switch.recache,
                "recache_frames": None if recache is None else recache.frames,
                "recache_seconds": None if recache is None else recache.seconds, "chunk_seconds": chunk.seconds,
            })  # fmt: skip
        return fields, note


class PoolSessionCalls:
    """A pool session's ``feed`` / ``control`` / ``set_strength``, as a :class:`Driver` sends them."""

    def __init__(self, pool, session):
        self.pool, self.session = pool, session

    def feed(self, latents):
        return self.pool.feed(self.session, latents)

    def control(self, kind, value, recache=False):
        return self.pool.control(self.session, kind, value, recache)

    def set_strength(self, strength):
        self.pool.set_strength(self.session, strength)
