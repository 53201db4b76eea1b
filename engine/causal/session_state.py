"""A video session's whole state at a chunk boundary, as tensors and plain values: what a swap moves to host
memory and back (:meth:`.session_pool.SessionPool.suspend` / ``resume``) and what a snapshot file holds
(:mod:`.snapshot`).

The state of a stream between two chunks is exactly: every K/V buffer of its window (full precision, the quantized
ring with its scales and zero points, the sinks' unrotated key copies) and which frame each slot holds; its
prompt's text keys / values per layer (its cross-attention rows); the clean latents of the last chunk, whose
commit is deferred to the next one; its random generator; its position (frames committed, frames quantized, the
sinks' offset, chunks generated); and its stream decoder's memory. Restored into any cache of the same shape (a
free pool slot, a new solo session), the stream continues with the same video.

Tensor names: ``kv.<buffer>`` (``KVCache``'s registered names: ``k0``, ``vq3_scale``...), ``cross.k<i>`` /
``cross.v<i>`` ``[text_len, H, D]``, ``pending`` ``[1, C, F, h, w]`` (absent when nothing awaits commit),
``generator`` (uint8, ``torch.Generator.get_state()``), ``decoder.<i>`` (the stream decoder's memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError


@dataclass
class SessionState:
    tensors: dict[str, torch.Tensor]
    meta: dict  # JSON: "kv" (KVCache.host_state), "chunks_generated", "frames_decoded", "decoder", "seed"

    @property
    def frames_generated(self) -> int:
        return self.meta["kv"]["frames_committed"] + (
            self.meta["chunk_frames"] if "pending" in self.tensors else 0
        )

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _parts(session, pool):
    """(cache, cross layers [(k, v) each [text_len, H, D]], pending, decoder, stats, generator) of a pool session
    (``pool`` given) or a solo :class:`~.session.VideoSession` (``pool`` None; batch 1 only)."""
    if pool is not None:
        cross = [(k[session.slot], v[session.slot]) for k, v in pool.cross]
        return session.cache, cross, session.pending, session.decoder, session.stats, session.generator
    if session.batch != 1:
        raise InputError(
            "session", f"a session of batch {session.batch} cannot be saved; only batch 1 can", session.where
        )
    cross = [(k[0], v[0]) for k, v in session.cross._kv]
    return session.cache, cross, session._pending, session.decoder, session.stats, session.generator


@torch.inference_mode()
def capture_state(session, pool=None, device="cpu") -> SessionState:
    """A copy of ``session``'s state on ``device`` (see the module docstring)."""
    cache, cross, pending, decoder, stats, generator = _parts(session, pool)
    if cache is None:
        raise InputError("session", "this session holds no state (it was disposed or holds no slot)")

    def copy(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device, copy=True).contiguous()

    tensors = {f"kv.{name}": copy(t[0]) for name, t in cache.named_storage().items()}
    for i, (k, v) in enumerate(cross):
        tensors[f"cross.k{i}"], tensors[f"cross.v{i}"] = copy(k), copy(v)
    if pending is not None:
        tensors["pending"] = copy(pending)
    tensors["generator"] = generator.get_state().clone()
    decoder_meta = None
    if decoder is not None:
        memory, decoder_meta = decoder.get_state()
        tensors.update({f"decoder.{i}": copy(m) for i, m in memory.items()})
    meta = {
        "kv": cache.host_state(),
        "chunk_frames": cache.storage.window.chunk_frames,
        "chunks_generated": stats.chunks_generated,
        "frames_decoded": stats.frames_decoded,
        "decoder": decoder_meta,
        "generator_device": generator.device.type,
    }
    return SessionState(tensors, meta)


@torch.inference_mode()
def restore_state(state: SessionState, session, pool=None) -> None:
    """Put ``state`` into ``session``'s fresh cache (a pool slot's, or a new solo session's: the same shapes),
    prompt rows, generator, pending latents, stream decoder and counters."""
    cache, cross, _, decoder, stats, generator = _parts(session, pool)
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
    pending = None if pending is None else pending.to(device)
    if pool is not None:
        session.pending = pending
    else:
        session._pending = pending
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
