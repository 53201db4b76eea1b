"""``stream --save-session FILE`` and ``stream --resume FILE``: a stream saved after its last chunk and continued
later, in another process, with the same video (``engine.causal.snapshot``). Only the files the user names are
read or written."""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

from ..engine.causal.snapshot import read_snapshot_settings, resume_session, save_session
from ..engine.errors import InputError

# the stream flags a snapshot fixes: dest -> (CausalConfig field, or the snapshot's own setting)
SAVED_SETTINGS = {
    "height": "height", "width": "width", "seed": "seed", "chunk_frames": "chunk_frames",
    "window_frames": "window_frames", "sink_frames": "sink_frames", "steps": "steps", "schedule": "schedule",
    "context_noise": "context_noise", "rope": "rope", "kv_dtype": "kv_dtype",
    "keep_recent_chunks": "keep_recent_chunks",
}  # fmt: skip
# a resumed stream continues its saved prompt: the flags that make a prompt do not apply
PROMPT_FLAGS = {"cond": "--cond", "text_tokens": "--text-tokens", "prompt": "--prompt"}


class _Given(argparse._StoreAction):
    """A plain ``store`` that also records that the user gave the flag (``args.given``): with ``--resume``, a
    flag the user gave is checked against the snapshot, one left at its default takes the snapshot's value."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        namespace.given = {*getattr(namespace, "given", ()), self.dest}


def add_snapshot_arguments(p: argparse.ArgumentParser) -> None:
    """``--save-session`` and ``--resume``; called after the settings flags are added (it tracks them)."""
    p.add_argument("--save-session", default=None, metavar="FILE",
                   help="after the last chunk, save the session (KV window, prompt rows, generator, position, "
                   "stream decoder) to FILE, one safetensors file that --resume continues (default: not saved)")  # fmt: skip
    p.add_argument("--resume", default=None, metavar="FILE",
                   help="continue the session saved in FILE (by --save-session) for --chunks more chunks, with the "
                   "same video as an uninterrupted stream; the size, seed and window settings come from FILE "
                   "(a conflicting flag is refused), the model flags must give the model it was saved from (default: a "
                   "new stream)")  # fmt: skip
    tracked = set(SAVED_SETTINGS) | set(PROMPT_FLAGS)
    for action in p._actions:  # argparse has no public hook for "was this flag given"
        if action.dest in tracked and type(action) is argparse._StoreAction:
            action.__class__ = _Given


def apply_snapshot_settings(args) -> None:
    """With ``--resume``: refuse flags that conflict with the snapshot, then take its settings (before the model is
    loaded: only the header is read)."""
    if not args.resume:
        return
    given = getattr(args, "given", set())
    for dest, flag in PROMPT_FLAGS.items():
        if dest in given:
            raise InputError(
                flag, "a resumed stream continues its saved prompt; leave the flag out with --resume"
            )
    settings = read_snapshot_settings(args.resume, input_name="--resume")
    saved = {**dataclasses.asdict(settings.config), "height": settings.height, "width": settings.width,
             "seed": settings.seed}  # fmt: skip
    for dest, key in SAVED_SETTINGS.items():
        value = getattr(args, dest)
        if dest in given and value != saved[key]:
            flag = "--" + dest.replace("_", "-")
            raise InputError(flag, f"{value} conflicts with {os.path.basename(args.resume)}, saved with {saved[key]} "
                             "(a resumed stream keeps the settings it was saved with; leave the flag out)")  # fmt: skip
        setattr(args, dest, saved[key])


def check_save_path(args) -> None:
    """Fail before generating when ``--save-session`` cannot be written."""
    path = args.save_session
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder):
        raise InputError("--save-session", f"{path}: expected a file path in an existing folder")


def open_resumed(args, handle, vae):
    """(session, compile run or None, report fields) of ``--resume``: the model checked against the snapshot."""
    started = time.perf_counter()
    session, compiled = resume_session(handle, args.resume, vae, "stream", config=None, height=args.height,
                                       width=args.width, input_name="--resume")  # fmt: skip
    info = {"path": args.resume, "bytes": os.path.getsize(args.resume), "from_chunk": session.stats.chunks_generated,
            "from_latent_frame": session.frames_generated, "load_seconds": time.perf_counter() - started}  # fmt: skip
    return session, compiled, info


def save_if_asked(args, session) -> dict | None:
    """``--save-session``: the snapshot written after the last chunk (report fields), or None."""
    if not args.save_session:
        return None
    started = time.perf_counter()
    size = save_session(session, args.save_session)
    return {"path": args.save_session, "bytes": size, "seconds": time.perf_counter() - started,
            "next_chunk": session.stats.chunks_generated}  # fmt: skip
