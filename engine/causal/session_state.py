"""A video session's whole state at a chunk boundary, as tensors and plain values: what a swap moves to host
memory and back (:meth:`.session_pool.SessionPool.suspend` / ``resume``) and what a snapshot file holds
(:mod:`.snapshot`).

The state of a stream between two chunks is exactly: every K/V buffer of its window (full precision, the quantized
ring with its scales and zero points, the sinks' unrotated key copies) and which frame each slot holds; its
prompt's text keys / values per layer (its cross-attention rows); the clean latents of the last chunk, whose
commit is deferred to the next one; the clean latents of the window's frames (what a re-cache recomputes their K/V
from) and which frame each ring position holds; its random generator; its position (frames committed, frames
quantized, the sinks' offset, chunks generated); and its stream decoder's memory. Restored into any cache of the
same shape (a free pool slot, a new solo session), the stream continues with the same video.

Besides, its *host parts*, the interactive inputs a client gave it and that no slot holds: the queued input
frames of video to video, the strength, the seed, the controls queued for its next chunk boundary (a prompt as
its tensor) and those applied but not reported yet, and the last re-cache's report. A swap leaves them on the
pool session (``host_parts=False``: a client may feed or steer a suspended session); a snapshot holds them.

Tensor names: ``kv.<buffer>`` (``KVCache``'s registered names: ``k0``, ``vq3_scale``...), ``cross.k<i>`` /
``cross.v<i>`` ``[text_len, H, D]``, ``pending`` ``[1, C, F, h, w]`` (absent when nothing awaits commit),
``clean.latents`` ``[1, C, window_frames, h, w]`` (format 1 files have none: nothing kept), ``generator`` (uint8,
``torch.Generator.get_state()``), ``decoder.<i>`` (the stream decoder's memory), and the host parts: ``inputs.<i>``
``[1, C, h, w]`` (the queued input frames, oldest first), ``control.prompt`` ``[1, L, 4096]`` (a queued prompt
control's conditioning). Their JSON: ``meta["clean_frames"]`` (the frame each ring position holds) and
``meta["host"]`` (see :func:`_host_meta`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from ..errors import InputError
from .controls import KINDS, AppliedControl, Control, ControlQueue
from .prompt_switch import RecacheReport


@dataclass
class SessionState:
    tensors: dict[str, torch.Tensor]
    meta: dict  # JSON: "kv" (KVCache.host_state), "chunks_generated", "frames_decoded", "decoder", "clean_frames", "host"

    @property
    def frames_generated(self) -> int:
        return self.meta["kv"]["frames_committed"] + (
            self.meta["chunk_frames"] if "pending" in self.tensors else 0
        )

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


# the attributes a solo VideoSession and a PoolSession keep the same things under
_SOLO_NAMES = {"pending": "_pending", "unreported": "_unreported", "recache": "_recache"}
_POOL_NAMES = {"pending": "pending", "unreported": "unreported", "recache": "recache_report"}


def _parts(session, pool):
    """(cache, cross layers [(k, v) each [text_len, H, D]], attribute names) of a pool session (``pool`` given)
    or a solo :class:`~.session.VideoSession` (``pool`` None; batch 1 only)."""
    if pool is not None:
        return session.cache, [(k[session.slot], v[session.slot]) for k, v in pool.cross], _POOL_NAMES
    if session.batch != 1:
        raise InputError(
            "session", f"a session of batch {session.batch} cannot be saved; only batch 1 can", session.where
        )
    return session.cache, [(k[0], v[0]) for k, v in session.cross._kv], _SOLO_NAMES


def _copy(t: torch.Tensor, device) -> torch.Tensor:
    return t.detach().to(device, copy=True).contiguous()


@torch.inference_mode()
def capture_state(session, pool=None, device="cpu", host_parts: bool = True) -> SessionState:
    """A copy of ``session``'s state on ``device`` (see the module docstring); ``host_parts``: with its
    interactive inputs (a snapshot), or without (a swap: they stay on the session)."""
    cache, cross, names = _parts(session, pool)
    if cache is None:
        raise InputError("session", "this session holds no state (it was disposed or holds no slot)")
    generator, decoder, stats = session.generator, session.decoder, session.stats
    tensors = {f"kv.{name}": _copy(t[0], device) for name, t in cache.named_storage().items()}
    for i, (k, v) in enumerate(cross):
        tensors[f"cross.k{i}"], tensors[f"cross.v{i}"] = _copy(k, device), _copy(v, device)
    pending = getattr(session, names["pending"])
    if pending is not None:
        tensors["pending"] = _copy(pending, device)
    clean_latents, clean_frames = session.clean.state()
    tensors["clean.latents"] = _copy(clean_latents, device)
    tensors["generator"] = generator.get_state().clone()
    decoder_meta = None
    if decoder is not None:
        memory, decoder_meta = decoder.get_state()
        tensors.update({f"decoder.{i}": _copy(m, device) for i, m in memory.items()})
    meta = {
        "kv": cache.host_state(),
        "chunk_frames": cache.storage.window.chunk_frames,
        "chunks_generated": stats.chunks_generated,
        "frames_decoded": stats.frames_decoded,
        "decoder": decoder_meta,
        "generator_device": generator.device.type,
        "clean_frames": clean_frames,
    }
    state = SessionState(tensors, meta)
    return with_host_parts(state, session, pool is not None, device) if host_parts else state


def _host_meta(session, names, tensors: dict, device) -> dict:
    """The host parts' JSON (their tensors go into ``tensors``): ``strength``, ``seed``, ``inputs`` (frames
    queued), ``controls`` (queued: kind, sequence, recache, replaced and, but for a prompt, value),
    ``control_sequence`` (the next control's number), ``unreported`` (AppliedControl fields) and ``recache``
    (RecacheReport fields, or None)."""
    frames = session.inputs.state()
    for i, frame in enumerate(frames):
        tensors[f"inputs.{i}"] = _copy(frame, device)
    queue = session.controls
    # the queue's own lock: a client thread may put a control meanwhile (its number then follows the saved one)
    with queue._lock:
        queued = [queue._queued[k] for k in KINDS if k in queue._queued]
        following = next(queue._sequence)
        queue._sequence = itertools.count(following)  # the number read is given back
    controls = []
    for control, replaced in queued:
        entry = {"kind": control.kind, "sequence": control.sequence, "recache": control.recache,
                 "replaced": replaced}  # fmt: skip
        if control.kind == "prompt":
            tensors["control.prompt"] = _copy(control.value, device)
        else:
            entry["value"] = control.value
        controls.append(entry)
    report = getattr(session, names["recache"])
    return {
        "strength": session.strength,
        "seed": session.seed,
        "inputs": len(frames),
        "controls": controls,
        "control_sequence": following,
        "unreported": [dataclasses.asdict(a) for a in getattr(session, names["unreported"])],
        "recache": None if report is None else dataclasses.asdict(report),
    }


def with_host_parts(state: SessionState, session, pooled: bool, device="cpu") -> SessionState:
    """``state`` (a swap's copy, or a whole one) with ``session``'s host parts as they are now (``pooled``: a
    pool session's, else a solo session's)."""
    names = _POOL_NAMES if pooled else _SOLO_NAMES
    tensors = {k: t for k, t in state.tensors.items() if not k.startswith(("inputs.", "control."))}
    host = _host_meta(session, names, tensors, device)
    return SessionState(tensors, {**state.meta, "host": host})


@torch.inference_mode()
def restore_state(state: SessionState, session, pool=None) -> None:
    """Put ``state`` into ``session``'s fresh cache (a pool slot's, or a new solo session's: the same shapes),
    prompt rows, generator, pending latents, clean latents, stream decoder and counters, and its host parts when
    it holds them."""
    cache, cross, names = _parts(session, pool)
    generator, decoder, stats = session.generator, session.decoder, session.stats
    if state.meta["generator_device"] != generator.device.type:
        raise InputError(
            "session",
            f"the saved random generator is a {state.meta['generator_device']} generator; this session draws its "
            f"noise on {generator.device.type} (resume it on the device it was saved from)",
        )
    for name, buffer in cache.named_storage().items():
        buffer[0].copy_(state.tensors[f"kv.{name}"])
    cache.load_host_state(state.meta["kv"])
    for i, (k, v) in enumerate(cross):
        k.copy_(state.tensors[f"cross.k{i}"])
        v.copy_(state.tensors[f"cross.v{i}"])
    device = cache.write_index.device
    pending = state.tensors.get("pending")
    setattr(session, names["pending"], None if pending is None else pending.to(device))
    clean = state.tensors.get("clean.latents")
    if clean is None:  # a format 1 snapshot: no clean latents kept (a re-cache has nothing to recompute)
        session.clean.load_state(torch.zeros(()), [None] * len(session.clean.frames))
    else:
        session.clean.load_state(clean, state.meta["clean_frames"])
    generator.set_state(state.tensors["generator"].clone())
    if decoder is not None:
        if state.meta["decoder"] is None:
            raise InputError(
                "session", "the saved session has no stream decoder state; open it without a tiny VAE"
            )
        memory = {k.split(".", 1)[1]: t for k, t in state.tensors.items() if k.startswith("decoder.")}
        decoder.set_state(memory, state.meta["decoder"])
    stats.chunks_generated = int(state.meta["chunks_generated"])
    stats.frames_decoded = int(state.meta["frames_decoded"])
    host = state.meta.get("host")
    if host is not None:
        _restore_host(host, state.tensors, session, names)


def take_host_parts(state: SessionState, session, pooled: bool) -> SessionState:
    """Restore ``state``'s host parts (if it holds them) into ``session`` now, and return ``state`` without them:
    a pool session joining from a snapshot keeps its host parts itself from the start, also while it waits for a
    slot (as a suspended session does)."""
    host = state.meta.get("host")
    if host is None:
        return state
    _restore_host(host, state.tensors, session, _POOL_NAMES if pooled else _SOLO_NAMES)
    tensors = {k: t for k, t in state.tensors.items() if not k.startswith(("inputs.", "control."))}
    return SessionState(tensors, {k: v for k, v in state.meta.items() if k != "host"})


def _restore_host(host: dict, tensors: dict, session, names) -> None:
    session.inputs.load_state([tensors[f"inputs.{i}"].clone() for i in range(host["inputs"])])
    session.strength, session.seed = host["strength"], host["seed"]
    queue = ControlQueue()
    for entry in host["controls"]:
        value = tensors["control.prompt"].clone() if entry["kind"] == "prompt" else entry["value"]
        control = Control(entry["kind"], value, entry["recache"], entry["sequence"])
        queue._queued[entry["kind"]] = (control, entry["replaced"])
    queue._sequence = itertools.count(host["control_sequence"])
    session.controls = queue
    setattr(session, names["unreported"], [AppliedControl(**a) for a in host["unreported"]])
    report = host["recache"]
    setattr(session, names["recache"], None if report is None else RecacheReport(**report))
