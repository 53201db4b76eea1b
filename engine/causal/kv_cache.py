"""KV caches for chunk-by-chunk causal video generation.

:class:`KVCache` holds the self-attention keys and values of every transformer layer in buffers preallocated
once (``[batch, window_frames * tokens_per_frame, heads, head_dim]`` each): written in place, never
concatenated, with all bookkeeping in host-side integers (no ``.item()`` syncs), so its memory is flat for a
stream of any length and its shapes stay fixed once the window is full.

Slots: the first ``sink_frames`` latent frames of the video keep slots ``[0, S)`` forever; the other frames
share a ring of ``R = window - S`` frame slots, so writing a new chunk evicts the oldest non-sink frames. A
chunk's queries see the sinks, the newest retained frames and the chunk itself: ``window_frames`` frames at
most. Every denoising step of a chunk rewrites the chunk's slots; the clean pass writes them for good and
:meth:`KVCache.commit` moves on to the next chunk.

RoPE positions (``rope``):

* ``"cache"`` (default): keys are stored unrotated and rotated when read, by their position *in the cache*:
  sinks at ``0 .. S-1``, then the retained frames contiguously, then the chunk. Distances stay bounded by the
  window, so a stream runs past any position table (the StreamingLLM choice). Until the first eviction these
  are the absolute positions; without sinks, attention is the same as with absolute positions at any length
  (RoPE depends only on position differences).
* ``"absolute"``: keys rotated once when written, at their absolute frame index (Self-Forcing / CausVid).
  Distances between the chunk and the sinks grow without bound.

:class:`CrossAttentionCache` holds the text keys and values of every layer, computed once per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..attention import attention
from ..errors import InputError
from ..rope import RopeFreqs, apply_rope

ROPE_MODES = ("cache", "absolute")


@dataclass(frozen=True)
class WindowSpec:
    """How many latent frames a chunk sees: ``window_frames`` in all, the first ``sink_frames`` kept forever."""

    chunk_frames: int
    window_frames: int
    sink_frames: int = 0

    def check(self, where: str | None = None) -> WindowSpec:
        c, w, s = self.chunk_frames, self.window_frames, self.sink_frames
        if c < 1:
            raise InputError("chunk_frames", f"expected at least 1 latent frame per chunk, got {c}", where)
        if w < c:
            raise InputError(
                "window_frames",
                f"the window ({w} latent frames) is smaller than a chunk ({c}); "
                "a chunk must see at least itself",
                where,
            )
        if s < 0 or s >= w:
            raise InputError(
                "sink_frames",
                f"{s} sink frames do not fit a window of {w} frames (need 0 <= sink < window)",
                where,
            )
        if s + c > w:
            raise InputError(
                "window_frames",
                f"the window ({w}) must hold the {s} sink frames and a chunk of {c} (at least {s + c})",
                where,
            )
        return self

    @property
    def ring_frames(self) -> int:
        return self.window_frames - self.sink_frames

    def visible(self, chunk_start: int, key_frame: int) -> bool:
        """Whether a query in the chunk starting at ``chunk_start`` sees ``key_frame`` (for reference masks)."""
        end = chunk_start + self.chunk_frames
        return key_frame < end and (key_frame < self.sink_frames or key_frame >= end - self.ring_frames)


class _LayerView:
    """The cache as one layer's self-attention sees it during a forward."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write the chunk's ``k, v [B, C*T, H, D]`` (k unrotated) and attend to every visible slot."""
        c = self.cache
        keys, values = c.k[self.index], c.v[self.index]
        if c.rope == "absolute":
            k = apply_rope(k, c._step_query_freqs)
        for src, dst in c._write_ranges:
            keys[:, dst[0] : dst[1]].copy_(k[:, src[0] : src[1]])
            values[:, dst[0] : dst[1]].copy_(v[:, src[0] : src[1]])
        n = c._read_tokens
        k_read = keys[:, :n]
        if c.rope == "cache":
            k_read = apply_rope(k_read, c._step_key_freqs)
        return attention(q, k_read.to(q.dtype), values[:, :n])


class KVCache(nn.Module):
    """Self-attention K/V of all layers for one video stream (see the module docstring)."""

    def __init__(
        self,
        layers: int,
        batch: int,
        tokens_per_frame: int,
        heads: int,
        head_dim: int,
        window: WindowSpec,
        dtype: torch.dtype,
        device,
        rope: str = "cache",
    ):
        super().__init__()
        if rope not in ROPE_MODES:
            raise InputError("rope", f"unknown RoPE mode {rope!r}; expected one of {', '.join(ROPE_MODES)}")
        self.window = window.check()
        self.tokens_per_frame = tokens_per_frame
        self.rope = rope
        shape = (batch, window.window_frames * tokens_per_frame, heads, head_dim)
        for i in range(layers):
            self.register_buffer(f"k{i}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
            self.register_buffer(f"v{i}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.k = [getattr(self, f"k{i}") for i in range(layers)]
        self.v = [getattr(self, f"v{i}") for i in range(layers)]
        self.frames_committed = 0  # frames whose clean K/V are final
        self.slot_frame: list[int | None] = [None] * window.window_frames  # which frame each slot holds
        self._chunk: tuple[int, int] | None = None
        self._write_ranges: list[tuple[tuple[int, int], tuple[int, int]]] = []
        self._read_tokens = 0
        self._step_query_freqs: RopeFreqs | None = None
        self._step_key_freqs: RopeFreqs | None = None

    # -- accounting ----------------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes allocated by the cache (sum of ``nbytes`` of every buffer)."""
        return sum(t.nbytes for t in self.k + self.v)

    def bytes_per_token(self) -> int:
        """``2 x heads x head_dim x layers x element size``: K and V of one token over all layers."""
        b, _, h, d = self.k[0].shape
        return 2 * h * d * len(self.k) * self.k[0].element_size()

    # -- positions -----------------------------------------------------------------------------------------------
    def slot_of(self, frame: int) -> int:
        s, r = self.window.sink_frames, self.window.ring_frames
        return frame if frame < s else s + (frame - s) % r

    def position_of(self, frame: int, chunk_start: int) -> int:
        """RoPE frame position of ``frame`` as read by the chunk starting at ``chunk_start``."""
        if self.rope == "absolute" or frame < self.window.sink_frames:
            return frame
        oldest = max(
            self.window.sink_frames, chunk_start + self.window.chunk_frames - self.window.ring_frames
        )
        return self.window.sink_frames + frame - oldest

    # -- one chunk -----------------------------------------------------------------------------------------------
    def begin(self, chunk_start: int, frames: int, grid_hw: tuple[int, int], rope_fn) -> None:
        """Prepare forwards over the chunk ``[chunk_start, chunk_start + frames)``.

        ``rope_fn(frame_positions [F], (h, w)) -> RopeFreqs`` builds rotations for whole frames.
        """
        if chunk_start != self.frames_committed:
            raise InputError(
                "chunk",
                f"the next chunk must start at frame {self.frames_committed} (the frames "
                f"committed so far), not {chunk_start}",
            )
        if frames != self.window.chunk_frames:
            raise InputError("chunk", f"chunks are {self.window.chunk_frames} latent frames, got {frames}")
        if self._chunk == (chunk_start, frames):
            return
        t = self.tokens_per_frame
        chunk = range(chunk_start, chunk_start + frames)
        ranges = []
        for i, frame in enumerate(chunk):  # one range per frame, merged when contiguous
            slot = self.slot_of(frame)
            if ranges and ranges[-1][1][1] == slot * t:
                (s0, _), (d0, _) = ranges[-1]
                ranges[-1] = ((s0, (i + 1) * t), (d0, (slot + 1) * t))
            else:
                ranges.append(((i * t, (i + 1) * t), (slot * t, (slot + 1) * t)))
            self.slot_frame[slot] = frame
        occupied = min(chunk_start + frames, self.window.window_frames)
        self._write_ranges = ranges
        self._read_tokens = occupied * t
        self._chunk = (chunk_start, frames)
        positions = torch.tensor([self.position_of(f, chunk_start) for f in chunk])
        self._step_query_freqs = rope_fn(positions, grid_hw)
        if self.rope == "cache":
            slots = torch.tensor([self.position_of(self.slot_frame[s], chunk_start) for s in range(occupied)])
            self._step_key_freqs = rope_fn(slots, grid_hw)

    def query_rope(self) -> RopeFreqs:
        return self._step_query_freqs

    def layer(self, index: int) -> _LayerView:
        return _LayerView(self, index)

    def commit(self) -> None:
        """The current chunk's clean K/V are written: the next chunk may begin."""
        if self._chunk is None:
            raise InputError("chunk", "no chunk to commit")
        self.frames_committed = self._chunk[0] + self._chunk[1]
        self._chunk = None


class CrossAttentionCache:
    """Per-layer text keys/values for one prompt; :meth:`reset` when the prompt changes."""

    def __init__(self):
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def layer(self, index: int, cross_attn, context: torch.Tensor):
        if index not in self._kv:
            self._kv[index] = cross_attn.context_kv(context)
        return self._kv[index]

    def reset(self) -> None:
        self._kv.clear()

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._kv.values())
