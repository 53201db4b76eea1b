"""``stream --script FILE``: a stream that follows a control script (``cli/control_script.py``): its prompt, seed,
chunks, start image, input video and the controls sent between chunks, as a live client sends them to a FewStep
Live Video node. With ``--sessions N`` there is one ``--script`` per session: session ``i`` follows the ``i``-th.

Script prompts are text. Outside ComfyUI there is no text encoder, so they are embedded with
``engine.prompt_embeddings.synthetic_text_embedding(text, params.text_len, params.text_dim)``, the embedding the live
node uses without a CLIP connected: a live run and ``stream --script`` of the same script give the same latents.
That stand-in is meaningless for real weights, which are refused (``--prompt-switch`` with ``--cond`` files takes
real umT5 embeddings).
"""

from __future__ import annotations

from ..engine.errors import InputError
from .control_script import ControlScript, read_script

# flags the script replaces (what it gives per session), refused beside --script
REPLACED_FLAGS = {
    "cond": ("--cond", "the script's 'prompt'"),
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
        "follows the i-th script). Prompts are text, embedded with the synthetic text embedding the live node "
        "uses without a CLIP: dummy weights only (default: none)",
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
    if args.weights != "dummy":
        raise InputError(
            "--script",
            "script prompts are text, and outside ComfyUI there is no text encoder: they are embedded with the "
            "synthetic text embedding, which only dummy weights take (with real weights use --prompt-switch "
            "with --cond files, or run the script against a live node with `python -m fewstep live`)",
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
            if getattr(script, field) is not None:
                raise InputError(
                    "--script",
                    f"{script.path}: '{field}': stream --script does not read images or videos yet (it needs "
                    "the tiny VAE's encoder); run the script against a live node with `python -m fewstep live`",
                )
    return scripts


class PromptTexts:
    """Script prompt text -> its synthetic embedding for this model (each text embedded once per run)."""

    def __init__(self, params):
        self.params = params
        self._embedded: dict = {}

    def __call__(self, text: str):
        from ..engine.prompt_embeddings import synthetic_text_embedding

        if text not in self._embedded:
            self._embedded[text] = synthetic_text_embedding(text, self.params.text_len, self.params.text_dim)
        return self._embedded[text]


class ScriptDriver:
    """Sends a session what the script's client sends before each chunk (its controls), and reports what took
    effect; the interface of ``stream_interactive.Driver``. ``session``: a VideoSession or a pool session's
    ``PoolSessionCalls``."""

    def __init__(self, script: ControlScript, session, embed: PromptTexts):
        self.script, self.session, self.embed = script, session, embed
        self.switch_rows: list[dict] = []  # every control that took effect, as --json's `script_controls`

    def before_chunk(self, run_chunk: int) -> None:
        for control in self.script.controls_at(run_chunk):
            value = self.embed(control.value) if control.kind == "prompt" else control.value
            self.session.control(control.kind, value, recache=control.recache)

    def chunk_fields(self, run_chunk: int, chunk) -> tuple[dict, str]:
        controls = [
            {"kind": a.kind, "sequence": a.sequence, "chunk": a.chunk, "recache": a.recache,
             "replaced": a.replaced, "detail": a.detail}
            for a in chunk.controls
        ]  # fmt: skip
        recache = chunk.recache
        fields = {
            "mode": chunk.mode,
            "strength": chunk.strength,
            "controls": controls,
            "recache": None
            if recache is None
            else {"frames": recache.frames, "start_frame": recache.start_frame, "seconds": recache.seconds},
        }
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
