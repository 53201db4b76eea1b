"""``stream --script FILE``: a stream that follows a control script (``cli/control_script.py``): its prompt, seed,
chunks, start image, input video and the controls sent between chunks, as a live client sends them to a FewStep
Live Video node. With ``--sessions N`` there is one ``--script`` per session: session ``i`` follows the ``i``-th.

Script prompts are text. With ``--text-encoder DIR`` (Wan's umT5-XXL) they are encoded as Wan's pipeline encodes
them, before the model loads (``cli/text_prompts.py``). Without one they are embedded with
``engine.prompt_embeddings.synthetic_text_embedding(text, params.text_len, params.text_dim)``, the embedding the live
node uses without a CLIP connected: a live run and ``stream --script`` of the same script give the same latents.
That stand-in is meaningless for real weights, which then need --text-encoder.

A start image and an input video are decoded and encoded as the live node decodes and encodes what a client sends
(``engine.live.media.decode_image``: scaled to cover the stream's size and center-cropped; the start image
through the tiny VAE's ``encode_raw`` and prefilled; the input frames ``4 x --chunk-frames`` at a time through a
``TAEHVStreamEncoder``, fed one chunk ahead): they need ``--tiny-vae`` (with an encoder: taew2_1).
"""

from __future__ import annotations

import itertools

import torch

from ..engine.errors import InputError
from ..engine.latent_formats import WAN21
from .control_script import ControlScript, read_script
from .stream_interactive import interactive_fields

MAX_START_IMAGE_BYTES = 8 << 20  # what the live routes take

# flags the script replaces (what it gives per session), refused beside --script
REPLACED_FLAGS = {
    "cond": ("--cond", "the script's 'prompt'"),
    "prompt": ("--prompt", "the script's 'prompt'"),
    "prompt_switch": ("--prompt-switch", "the script's prompt controls"),
    "chunks": ("--chunks", "the script's 'chunks'"),
    "latent_frames": ("--latent-frames", "the script's 'chunks'"),
    "init_latents": ("--init-latents", "the script's 'start_image'"),
    "input_video": ("--input-video", "the script's 'input_video'"),
    "strength": ("--strength", "the script's 'strength'"),
    "resume": ("--resume", "a new stream (the script's start)"),
}


def add_arguments(p) -> None:
    p.add_argument(
        "--script",
        metavar="FILE",
        action="append",
        default=[],
        help="follow a control script (JSON: prompt, seed, chunks, start_image, input_video + strength, and "
        "controls: prompt switches with or without re-cache, strength, seed, stop at given chunks), the format "
        "`python -m fewstep live` sends to a live node; repeat once per session with --sessions N (session i "
        "follows the i-th script). Prompts are text: encoded with --text-encoder, else embedded with the "
        "synthetic text embedding the live node uses without a CLIP (dummy weights only); a start_image or input_video needs --tiny-vae, which encodes "
        "it as the live node does (default: none)",
    )


def requested(args) -> bool:
    return bool(getattr(args, "script", None))


def prepare(args) -> list[ControlScript] | None:
    """The scripts read and checked before anything is loaded (None without --script); the flags they replace
    refused."""
    if not requested(args):
        return None
    for dest, (flag, instead) in REPLACED_FLAGS.items():
        value = getattr(args, dest, None)
        if value:
            raise InputError(flag, f"cannot be combined with --script, which gives {instead}")
    if args.weights != "dummy" and not args.text_encoder:
        raise InputError(
            "--script",
            "script prompts are text: with real weights give --text-encoder DIR (Wan's umT5-XXL folder) to encode "
            "them; without one they are embedded with the synthetic text embedding, which only dummy weights take",
        )
    if len(args.script) != args.sessions:
        raise InputError(
            "--script",
            f"{len(args.script)} scripts for --sessions {args.sessions}: give one --script per session (session i "
            "follows the i-th)",
        )
    scripts = [read_script(path, "--script", require_chunks=True) for path in args.script]
    for script in scripts:
        for field in ("start_image", "input_video"):
            if getattr(script, field) is not None and not args.tiny_vae:
                raise InputError(
                    "--script",
                    f"{script.path}: '{field}' is encoded with the tiny VAE, as the live node encodes it: give "
                    "--tiny-vae (dummy:taew2_1 with dummy weights, taew2_1.pth)",
                )
        if script.start_image is not None:  # read and decoded now: a bad image fails before the model loads
            ScriptMedia(script, args.width, args.height).check_start()
    return scripts


class ScriptMedia:
    """One session's start image and input video, decoded as the live node decodes a client's images and encoded
    with the tiny VAE as it encodes them (its own stream encoder: one per session)."""

    def __init__(self, script: ControlScript, width: int, height: int):
        self.script, self.width, self.height = script, width, height
        self._start = None
        self._frames = None  # the input video's frame bytes, read as they are needed
        self.encoder = None
        self.frames_used = 0

    def _decode(self, data: bytes, field: str) -> torch.Tensor:
        from ..engine.live.media import decode_image

        try:
            return decode_image(data, self.width, self.height, field)
        except InputError as err:
            raise InputError("--script", f"{self.script.path}: '{field}': {err.problem}") from None

    @property
    def start(self) -> torch.Tensor | None:
        """The start image ``[3, H, W]`` in [0, 1], or None."""
        if self._start is None and self.script.start_image is not None:
            path = self.script.start_image
            try:
                with open(path, "rb") as f:
                    data = f.read(MAX_START_IMAGE_BYTES + 1)
            except OSError as exc:
                raise InputError("--script", f"{self.script.path}: 'start_image': cannot read {path} "
                                 f"({exc.strerror or exc})") from None  # fmt: skip
            if len(data) > MAX_START_IMAGE_BYTES:
                raise InputError("--script", f"{self.script.path}: 'start_image': larger than the "
                                 f"{MAX_START_IMAGE_BYTES >> 20} MiB a live session takes")  # fmt: skip
            self._start = self._decode(data, "start_image")
        return self._start

    def check_start(self) -> None:
        self.start  # noqa: B018 - reading it decodes it: a bad image is refused here

    def start_latents(self, vae) -> torch.Tensor | None:
        """The start image as one latent frame ``[1, C, 1, h, w]`` in the model's space (what the node prefills)."""
        if self.start is None:
            return None
        with torch.inference_mode():
            raw = vae.encode_raw(self.start[None, None].clamp(0, 1))
        return WAN21.process_in(raw.float().cpu())

    def input_latents(self, vae, chunk_frames: int, run_chunk: int) -> torch.Tensor:
        """The next ``4 x chunk_frames`` input frames encoded: ``[1, C, chunk_frames, h, w]`` (model space)."""
        from ..engine.vae.taehv import TAEHVStreamEncoder
        from .live import input_frames

        if self._frames is None:
            self._frames = input_frames(self.script.input_video, self.script.path)
        need = 4 * chunk_frames
        data = list(itertools.islice(self._frames, need))
        if len(data) < need:
            raise InputError(
                "--script",
                f"{self.script.path}: 'input_video' holds {self.frames_used + len(data)} frames: "
                f"{self.frames_used // need} chunks of {need} (4 x --chunk-frames); the script makes "
                f"{self.script.chunks_to_run} chunks (chunk {run_chunk} has no input)",
            )
        frames = torch.stack(
            [self._decode(b, f"input_video frame {self.frames_used + i}") for i, b in enumerate(data)]
        )
        self.frames_used += need
        if self.encoder is None:
            self.encoder = TAEHVStreamEncoder(vae.video)
        with torch.inference_mode():
            z = self.encoder.push(frames[None].to(vae.device, vae.dtype))  # [1, k, C, h, w]
            raw = vae.latent_to_raw(z.transpose(1, 2).float())
        return WAN21.process_in(raw.float().cpu())


class PromptTexts:
    """Script prompt text -> its embedding for this model: ``encoded`` (the texts --text-encoder encoded before the
    model loaded), else the synthetic embedding (each text embedded once per run)."""

    def __init__(self, params, encoded: dict | None = None):
        self.params = params
        self._embedded: dict = dict(encoded or {})

    def __call__(self, text: str):
        from ..engine.prompt_embeddings import synthetic_text_embedding

        if text not in self._embedded:
            self._embedded[text] = synthetic_text_embedding(text, self.params.text_len, self.params.text_dim)
        return self._embedded[text]


class ScriptDriver:
    """Sends a session what the script's client sends before each chunk (its controls), and reports what took
    effect; the interface of ``stream_interactive.Driver``. ``session``: a VideoSession or a pool session's
    ``PoolSessionCalls``."""

    def __init__(self, script: ControlScript, session, embed: PromptTexts, media: ScriptMedia | None = None,
                 vae=None, chunk_frames: int = 0):  # fmt: skip
        self.script, self.session, self.embed = script, session, embed
        self.media, self.vae, self.chunk_frames = media, vae, chunk_frames
        self.switch_rows: list[dict] = []  # every control that took effect, as --json's `script_controls`
        if (
            script.strength is not None
        ):  # video to video from the first chunk, as the node sets it at the join
            session.set_strength(script.strength)

    def before_chunk(self, run_chunk: int) -> None:
        if (
            self.script.input_video is not None
        ):  # the chunk's input frames, one chunk ahead as a client sends them
            self.session.feed(self.media.input_latents(self.vae, self.chunk_frames, run_chunk))
        for control in self.script.controls_at(run_chunk):
            value = self.embed(control.value) if control.kind == "prompt" else control.value
            self.session.control(control.kind, value, recache=control.recache)

    def chunk_fields(self, run_chunk: int, chunk) -> tuple[dict, str]:
        fields = interactive_fields(chunk)
        recache = chunk.recache
        notes = []
        for control in self.script.controls_at(run_chunk):
            if control.kind == "prompt":
                text = control.value if len(control.value) <= 40 else control.value[:37] + "..."
                if control.recache and recache is not None:
                    what = f"re-cache of {recache.frames} frames {recache.seconds:.3f} s"
                else:
                    what = "cross-attention only"
                notes.append(f"prompt switch to {text!r}: {what}")
            else:
                notes.append(f"{control.kind} {'text to video' if control.value is None else control.value}")
            self.switch_rows.append(
                {"chunk": chunk.index, "script_index": control.index, "kind": control.kind,
                 "value": control.value, "recache": control.recache,
                 "recache_frames": None if recache is None or control.kind != "prompt" else recache.frames,
                 "recache_seconds": None if recache is None or control.kind != "prompt" else recache.seconds}
            )  # fmt: skip
        return fields, f" ({'; '.join(notes)})" if notes else ""
