"""KV caches for chunk-by-chunk causal video generation.

:class:`KVCache` holds the self-attention keys and values of every transformer layer in buffers preallocated
once (``[batch, window_frames * tokens_per_frame, heads, head_dim]`` each, or split into full-precision and
quantized storage, see *Storage*): written in place, never concatenated, so its memory is flat for a stream of
any length. Static shapes (gpt-fast's discipline): every chunk step reads the whole window, and what changes
from chunk to chunk lives in device tensors of fixed shapes that :meth:`KVCache.begin` rewrites in place (the
token slots written, ``index_copy_``; the visibility of every slot; the RoPE positions of the chunk and of every
slot and their rotations). The bookkeeping behind them is host-side integers: nothing is read back (no
``.item()``). While the window fills, attention masks the empty slots; once every slot is visible there is no
mask and a step is a pure tensor function of fixed shapes (one graph for ``torch.compile`` or a CUDA graph).

Slots: the first ``sink_frames`` latent frames of the video keep slots ``[0, S)`` forever; the other frames
share a ring of ``R = window - S`` frame slots, so writing a new chunk evicts the oldest non-sink frames. A
chunk's queries see the sinks, the newest retained frames and the chunk itself: ``window_frames`` frames at
most. Every denoising step of a chunk rewrites the chunk's slots; the clean pass writes them for good and
:meth:`KVCache.commit` moves on to the next chunk.

RoPE positions (``rope``):

* ``"cache"`` (default): keys are read at their position *in the cache*: sinks at ``0 .. S-1``, then the
  retained frames contiguously, then the chunk (:meth:`KVCache.position_of`). Distances stay bounded by the
  window, so a stream runs past any position table (the StreamingLLM choice). Until the first eviction these
  are the absolute positions; without sinks, attention is the same as with absolute positions at any length.
* ``"absolute"``: every key at its absolute frame index (Self-Forcing / CausVid). Distances between the chunk and
  the sinks grow without bound.

How ``"cache"`` costs no more than ``"absolute"``: a RoPE score depends only on the difference of the query's
and the key's positions, and the cache positions of the chunk and of every retained non-sink frame are their
absolute frame indices minus one offset ``o = oldest retained frame - S`` (the same for all of them). So both
modes rotate queries and non-sink keys at their absolute frame index, keys once, when they are written (never
again: a frame that ages out into the quantized ring is quantized already rotated and read without rotation).
Only the sinks differ: under ``"cache"`` a sink ``s`` must sit at ``s + o`` in that frame of reference, and ``o``
moves when the window slides, at most once a chunk. :meth:`KVCache.begin` then rewrites the sinks' keys, one pass
over the sink frames of every layer, from an unrotated copy of them (``sink_keys``, taken once when the sinks are
committed), so the rounding of a sink never accumulates over a long stream. Scores and outputs equal those of the
cache positions read directly (``tests/test_causal.py``: the no-cache reference at cache positions).

Storage (``kv_dtype``):

* ``"bf16"`` (default): every slot unquantized, in the compute dtype of the model (bf16 on a GPU; float32 when
  the model computes in float32, as on the CPU). The name says what a GPU stream stores.
* ``"int8"`` / ``"int4"``: only the newest frames stay in the compute dtype. The sinks and a ring of
  ``(keep_recent_chunks + 1) x chunk_frames`` frame slots (the current chunk and the newest ``keep_recent_chunks``
  completed chunks) are full precision; the other ``window - sinks - (keep_recent_chunks + 1) x chunk_frames``
  frames of the window live in a second ring of quantized slots (``fewstep.kernels.kv_quant``: one float16 scale
  and zero point per (token, head), codes in uint8, int4 two per byte). A completed frame is quantized once,
  when the next chunk takes its full-precision slot, and only if it is still in the window; it is never written
  again. Sinks are never quantized: every chunk attends to them, so their error would be paid forever, and
  they are few. Reads dequantize (keys are stored rotated: no rotation on the read): on CUDA the attention
  kernel dequantizes the quantized keys tile by tile (``kernels.quantized_attention``, once the window is full:
  it takes no mask); elsewhere (and while the window fills) each layer's quantized part is dequantized into a transient buffer, concatenated with
  the full-precision part and attended to, one layer at a time (so the transient memory is one layer's window,
  not the cache's). Until a frame ages out, an int8/int4 stream is
  identical to a ``"bf16"`` one.

:class:`CrossAttentionCache` holds the text keys and values of every layer, computed once per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ... import kernels
from ...kernels.kv_quant import QuantizedAttentionInputs, group_bytes, packed_dim
from ..backends import DEFAULT_BACKENDS, Backends
from ..errors import InputError
from ..rope import RopeFreqs

ROPE_MODES = ("cache", "absolute")
KV_DTYPES = ("bf16", "int8", "int4")
_KV_BITS = {"bf16": None, "int8": 8, "int4": 4}


@dataclass(frozen=True)
class WindowSpec:
    """How many latent frames a chunk sees: ``window_frames`` in all, the first ``sink_frames`` kept forever.

    Checked once, when it is built (an :class:`InputError` naming the input; the node or command that built it
    locates it): every holder of a ``WindowSpec`` may rely on it."""

    chunk_frames: int
    window_frames: int
    sink_frames: int = 0

    def __post_init__(self):
        check_window(self.chunk_frames, self.window_frames, self.sink_frames)

    @property
    def ring_frames(self) -> int:
        return self.window_frames - self.sink_frames

    def cache_offset(self, chunk_start: int) -> int:
        """``o``: absolute frame index - cache position of the non-sink frames the chunk starting at
        ``chunk_start`` reads (its own and the retained ones): the oldest retained non-sink frame - sinks, >= 0."""
        s = self.sink_frames
        return max(s, chunk_start + self.chunk_frames - self.ring_frames) - s

    def cache_position(self, frame: int, chunk_start: int) -> int:
        """The cache-relative RoPE frame position (``rope="cache"``) of ``frame`` as the chunk starting at
        ``chunk_start`` reads it: sinks at their index, the other frames contiguously after them."""
        return frame if frame < self.sink_frames else frame - self.cache_offset(chunk_start)

    def visible(self, chunk_start: int, key_frame: int) -> bool:
        """Whether a query in the chunk starting at ``chunk_start`` sees ``key_frame`` (for reference masks)."""
        end = chunk_start + self.chunk_frames
        return key_frame < end and (key_frame < self.sink_frames or key_frame >= end - self.ring_frames)


def check_window(c: int, w: int, s: int) -> None:
    """Whether a chunk of ``c`` latent frames, a window of ``w`` and ``s`` sinks fit together (``WindowSpec``)."""
    if c < 1:
        raise InputError("chunk_frames", f"expected at least 1 latent frame per chunk, got {c}")
    if w < c:
        raise InputError(
            "window_frames",
            f"the window ({w} latent frames) is smaller than a chunk ({c}); a chunk must see at least itself",
        )
    if s < 0 or s >= w:
        raise InputError(
            "sink_frames", f"{s} sink frames do not fit a window of {w} frames (need 0 <= sink < window)"
        )
    if s + c > w:
        raise InputError(
            "window_frames",
            f"the window ({w}) must hold the {s} sink frames and a chunk of {c} (at least {s + c})",
        )


def check_kv_storage(
    kv_dtype: str, keep_recent_chunks: int, window: WindowSpec, head_dim: int | None, where: str | None = None
) -> int | None:
    """The quantization bits of ``kv_dtype`` (None: unquantized), or an :class:`InputError`. ``head_dim`` None:
    the settings alone (a ``CausalConfig`` when it is built); the model's part is :func:`check_kv_head_dim`."""
    if kv_dtype not in _KV_BITS:
        raise InputError(
            "kv_dtype",
            f"unsupported KV storage {kv_dtype!r}; expected bf16 (the compute dtype, unquantized), int8 or int4",
            where,
        )
    bits = _KV_BITS[kv_dtype]
    if bits is None:
        return None
    if head_dim is not None:
        check_kv_head_dim(kv_dtype, head_dim, where)
    c, ring = window.chunk_frames, window.ring_frames
    most = ring // c - 1
    if keep_recent_chunks < 0 or keep_recent_chunks > most:
        raise InputError(
            "keep_recent_chunks",
            f"{keep_recent_chunks} recent chunks: the current chunk and the recent ones ({c} latent frames each) "
            f"must fit the {ring} frames of the window outside the sinks (window {window.window_frames} - sinks "
            f"{window.sink_frames}), so 0 to {most}",
            where,
        )
    return bits


def check_kv_head_dim(kv_dtype: str, head_dim: int, where: str | None = None) -> None:
    """The model's part of a KV storage choice: int4 packs two values of the head dimension per byte."""
    if _KV_BITS.get(kv_dtype) == 4 and head_dim % 2:
        raise InputError(
            "kv_dtype",
            f"int4 packs two values per byte along the head dimension; this model's head_dim {head_dim} is odd "
            "(use int8 or bf16)",
            where,
        )


@dataclass(frozen=True)
class QuantizedKV:
    """One layer's quantized K or V: ``data [B, N, H, D or D/2]`` uint8, ``scale, zero [B, N, H]`` float16."""

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.data, self.scale, self.zero


class _LayerView:
    """The cache as one layer's self-attention sees it during a forward: that layer's storage (K/V buffers and
    quantized parts) and references to the per-chunk tensors every layer shares (slots written, visibility,
    rotations). It holds no layer index and no cache: a block compiled once traces the ``attend`` of every layer
    with the same guards (tensors of the same shapes), so regional compilation needs no eager attend."""

    def __init__(self, cache: KVCache, keys: torch.Tensor, values: torch.Tensor, quant):
        self.keys, self.values = keys, values
        self.quant: tuple[QuantizedKV, QuantizedKV] | None = quant  # None without quantized storage
        self.write_index, self.mask = cache.write_index, cache.key_mask()
        self.query_freqs, self.bits = cache.query_rope(), cache.bits
        self._visible_rows = cache.visible_rows  # read() only (inspection): never called in a forward

    def key_mask(self) -> torch.Tensor | None:
        """As :meth:`KVCache.key_mask` for this chunk (None: the window is full, unmasked)."""
        return self.mask

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backends: Backends) -> torch.Tensor:
        """Write the chunk's ``k, v [B, C*T, H, D]`` (k unrotated) into its slots and attend to the whole
        window, computed with the run's ``backends``. Every tensor here has the same shape for every chunk: the slots written come from the
        ``write_index`` buffer, the slots hidden (empty, or out of the window) from ``key_visible``."""
        keys, values = self.keys, self.values
        # rotated once, here: at the chunk's absolute frame positions in both RoPE modes (see the module docstring)
        k = backends.apply_rope(k, self.query_freqs)
        keys.index_copy_(1, self.write_index, k.to(keys.dtype))
        values.index_copy_(1, self.write_index, v.to(values.dtype))
        mask = self.mask
        # the fused kernel takes no mask; it only runs once every slot is visible (the window is full)
        if self.quant is not None and mask is None and backends.uses_fused_quantized_attention(q):
            return self._fused_quantized_attention(q, backends)
        k_read, v_read = self.read_window(backends)
        return backends.attention(q, k_read.to(q.dtype), v_read, mask=mask)

    def read_window(self, backends: Backends = DEFAULT_BACKENDS) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (stored rotated: as this chunk reads them) and values of every slot, visible or not, in slot
        order: full-precision slots, then the quantized ones dequantized into transient tensors. Fixed shapes.
        Without quantized storage these are the cache's own buffers (no copy)."""
        k_read, v_read = self.keys, self.values
        if self.quant is not None:
            kq, vq = self.quant
            k_read = torch.cat((k_read, backends.dequantize_kv(*kq.parts(), self.bits, k_read.dtype)), dim=1)
            v_read = torch.cat((v_read, backends.dequantize_kv(*vq.parts(), self.bits, v_read.dtype)), dim=1)
        return k_read, v_read

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The visible slots only, in the order of ``KVCache.read_frames`` (for inspection and tests: the forward
        reads :meth:`read_window` under the visibility mask, which needs no shape that changes)."""
        k_read, v_read = self.read_window()
        rows = self._visible_rows()
        return k_read.index_select(1, rows), v_read.index_select(1, rows)

    def _fused_quantized_attention(self, q: torch.Tensor, backends: Backends) -> torch.Tensor:
        """As ``attention(q, *read_window())``, the quantized slots dequantized in the kernel (stored rotated:
        the kernel rotates nothing)."""
        k, v = self.keys, self.values
        kq, vq = self.quant
        inputs = QuantizedAttentionInputs(q, k.to(q.dtype), v, kq.parts(), vq.parts(), None, None, self.bits)
        return backends.quantized_attention(inputs)


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
        kv_dtype: str = "bf16",
        keep_recent_chunks: int = 1,
        kernel_mode: str = "auto",
    ):
        """``kernel_mode``: the run's kernel mode (``Backends.kernel_mode``), for the quantization of frames that
        age out of the full-precision ring (in :meth:`begin`, outside any forward)."""
        super().__init__()
        if rope not in ROPE_MODES:
            raise InputError("rope", f"unknown RoPE mode {rope!r}; expected one of {', '.join(ROPE_MODES)}")
        self.window = window  # checked when it was built
        self.bits = check_kv_storage(kv_dtype, keep_recent_chunks, window, head_dim)
        self.kv_dtype, self.keep_recent_chunks = kv_dtype, keep_recent_chunks
        self.kernel_mode = kernels.check_mode(kernel_mode)
        self.tokens_per_frame = tokens_per_frame
        self.layers = layers
        self.rope = rope
        # frame slots: [0, sinks) for the sinks, then a ring of `full_ring` full-precision slots; quantized
        # storage: a ring of `quant_ring` slots (see the module docstring)
        ring = window.ring_frames
        self.full_ring = ring if self.bits is None else (keep_recent_chunks + 1) * window.chunk_frames
        self.quant_ring = ring - self.full_ring
        full_frames = window.sink_frames + self.full_ring
        shape = (batch, full_frames * tokens_per_frame, heads, head_dim)
        self._storage: list[str] = []  # the K/V buffers (what nbytes counts)
        for i in range(layers):
            for name in (f"k{i}", f"v{i}"):
                self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device), persistent=False)
                self._storage.append(name)
        # rope="cache" with sinks: each layer's sink keys unrotated, the source `begin` re-positions them from
        self.sink_copies = rope == "cache" and window.sink_frames > 0
        if self.sink_copies:
            sink_shape = (batch, window.sink_frames * tokens_per_frame, heads, head_dim)
            for i in range(layers):
                self.register_buffer(
                    f"sink_k{i}", torch.zeros(sink_shape, dtype=dtype, device=device), persistent=False
                )
                self._storage.append(f"sink_k{i}")
        if self.quant_ring:
            tokens = self.quant_ring * tokens_per_frame
            for i in range(layers):
                for name in ("k", "v"):
                    parts = (
                        (f"{name}q{i}", (batch, tokens, heads, packed_dim(head_dim, self.bits)), torch.uint8),
                        (f"{name}q{i}_scale", (batch, tokens, heads), torch.float16),
                        (f"{name}q{i}_zero", (batch, tokens, heads), torch.float16),
                    )
                    for buffer, size, kind in parts:
                        self.register_buffer(
                            buffer, torch.zeros(size, dtype=kind, device=device), persistent=False
                        )
                        self._storage.append(buffer)
        # Per-chunk bookkeeping as device tensors of fixed shapes, rewritten in place by `begin` (so a forward,
        # compiled or replayed from a CUDA graph, reads the same tensors every chunk): the token slots the
        # chunk writes, and which token slots (full precision, then quantized) its queries see.
        # Not registered buffers: the module's buffers are exactly the K/V storage (nbytes, planned_bytes);
        # `_apply` moves these with them.
        slots = full_frames + self.quant_ring
        self.write_index = torch.zeros(
            window.chunk_frames * tokens_per_frame, dtype=torch.long, device=device
        )
        self.key_visible = torch.zeros(slots * tokens_per_frame, dtype=torch.bool, device=device)
        # RoPE frame positions of the chunk's frames (their absolute indices, in both modes) and their rotations
        # (float32 tables from float64 angles, `Wan.frame_rope`, whatever `.to(dtype)` does to the storage)
        self.chunk_positions = torch.zeros(window.chunk_frames, dtype=torch.long, device=device)
        self._query_freqs: RopeFreqs | None = None
        # host mirrors (plain integers, never read back from the device: no sync)
        self.frames_committed = 0  # frames whose clean K/V are final
        self.slot_frame: list[int | None] = [None] * full_frames  # which frame each full-precision slot holds
        self.quant_slot_frame: list[int | None] = [None] * self.quant_ring  # ... and each quantized slot
        self.frames_quantized = 0  # frames quantized so far (each once)
        self.sinks_copied = 0  # sink frames whose unrotated keys are in the sink copies (rope="cache")
        self.sink_offset = 0  # the offset the sink slots' keys are rotated at (see the module docstring)
        self._chunk: tuple[int, int] | None = None
        self._visible_slots: list[int] = []
        self._all_visible = False

    _BOOKKEEPING = ("write_index", "key_visible", "chunk_positions")

    def _apply(self, fn, recurse=True):
        """``.to()`` / ``.cuda()`` / ``.half()``: the storage as nn.Module converts it, and the bookkeeping to
        the storage's device (integer tensors: ``fn`` leaves their dtype alone)."""
        super()._apply(fn, recurse)
        for name in self._BOOKKEEPING:
            setattr(self, name, fn(getattr(self, name)))
        freqs = self._query_freqs
        if freqs is not None:
            device = self.write_index.device
            self._query_freqs = RopeFreqs(freqs.cos.to(device), freqs.sin.to(device))
        return self

    # -- storage: read through the registered buffers, so `.to()` / `.cuda()` leave no stale alias -----------------
    def layer_kv(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"k{index}"), getattr(self, f"v{index}")

    def sink_keys(self, index: int) -> torch.Tensor:
        """Layer ``index``'s unrotated sink keys ``[B, S*T, H, D]`` (``rope="cache"`` with sinks)."""
        return getattr(self, f"sink_k{index}")

    def layer_quant(self, index: int) -> tuple[QuantizedKV, QuantizedKV]:
        return tuple(
            QuantizedKV(*(getattr(self, f"{name}q{index}{part}") for part in ("", "_scale", "_zero")))
            for name in ("k", "v")
        )

    @property
    def k(self) -> list[torch.Tensor]:
        return [self.layer_kv(i)[0] for i in range(self.layers)]

    @property
    def v(self) -> list[torch.Tensor]:
        return [self.layer_kv(i)[1] for i in range(self.layers)]

    @property
    def k_quant(self) -> list[QuantizedKV]:
        return [self.layer_quant(i)[0] for i in range(self.layers)] if self.quant_ring else []

    @property
    def v_quant(self) -> list[QuantizedKV]:
        return [self.layer_quant(i)[1] for i in range(self.layers)] if self.quant_ring else []

    # -- accounting ----------------------------------------------------------------------------------------------
    @staticmethod
    def planned_bytes(
        layers: int, batch: int, tokens_per_frame: int, heads: int, head_dim: int, window: WindowSpec,
        dtype: torch.dtype, kv_dtype: str = "bf16", keep_recent_chunks: int = 1, rope: str = "cache",
    ) -> int:  # fmt: skip
        """The :attr:`nbytes` a cache built with these arguments will allocate, computed without allocating (the
        memory preflight refuses a window that cannot fit before its buffers are zero-filled)."""
        bits = _KV_BITS[kv_dtype]
        ring = window.ring_frames
        full_ring = ring if bits is None else (keep_recent_chunks + 1) * window.chunk_frames
        rows = 2 * layers * batch * tokens_per_frame * heads  # K and V rows per frame slot, all layers
        elt = torch.empty((), dtype=dtype).element_size()
        full = (window.sink_frames + full_ring) * rows * head_dim * elt
        quantized = 0 if bits is None else (ring - full_ring) * rows * group_bytes(head_dim, bits)
        sink_copies = window.sink_frames * rows // 2 * head_dim * elt if rope == "cache" else 0  # keys only
        return full + quantized + sink_copies

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V storage (every layer's buffers, scales and zero points and sink copies included; the
        per-chunk bookkeeping, a few integers per slot, is not counted)."""
        return sum(getattr(self, name).nbytes for name in self._storage)

    def bytes_per_token(self) -> int:
        """``2 x heads x head_dim x layers x element size``: K and V of one full-precision token, all layers."""
        k0 = self.layer_kv(0)[0]
        b, _, h, d = k0.shape
        return 2 * h * d * self.layers * k0.element_size()

    def quantized_bytes_per_token(self) -> int:
        """``2 x heads x (codes + scale + zero point) x layers``: K and V of one quantized token (0 if none)."""
        if self.bits is None:
            return 0
        b, _, h, d = self.layer_kv(0)[0].shape
        return 2 * h * group_bytes(d, self.bits) * self.layers

    def bytes_used(self) -> int:
        """Bytes of the occupied slots (full precision and quantized) and sink copies, all layers and the whole
        batch."""
        full = sum(f is not None for f in self.slot_frame) * self.bytes_per_token()
        quant = sum(f is not None for f in self.quant_slot_frame) * self.quantized_bytes_per_token()
        copies = self.sinks_copied * self.bytes_per_token() // 2  # keys only
        return (full + quant + copies) * self.tokens_per_frame * self.layer_kv(0)[0].shape[0]

    # -- positions -----------------------------------------------------------------------------------------------
    def slot_of(self, frame: int) -> int:
        """The full-precision slot of ``frame``."""
        s = self.window.sink_frames
        return frame if frame < s else s + (frame - s) % self.full_ring

    def quant_slot_of(self, frame: int) -> int:
        """The quantized slot of a (non-sink) ``frame`` once it aged out of the full-precision ring."""
        return (frame - self.window.sink_frames) % self.quant_ring

    def position_of(self, frame: int, chunk_start: int) -> int:
        """RoPE frame position of ``frame`` as read by the chunk starting at ``chunk_start`` (what attention
        computes; the stored rotations differ from it by one offset, see the module docstring)."""
        return frame if self.rope == "absolute" else self.window.cache_position(frame, chunk_start)

    # -- one chunk -----------------------------------------------------------------------------------------------
    def begin(self, chunk_start: int, frames: int, grid_hw: tuple[int, int], rope_fn) -> None:
        """Prepare forwards over the chunk ``[chunk_start, chunk_start + frames)``: rewrite the bookkeeping
        tensors in place (host-to-device copies of values computed on the host; nothing is read back).

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
        if self.quant_ring:
            self._age_out(chunk)
        written = []
        for frame in chunk:
            slot = self.slot_of(frame)
            self.slot_frame[slot] = frame
            written.append(slot)
        by_slot = self.slot_frame + self.quant_slot_frame
        visible = [f is not None and self.window.visible(chunk_start, f) for f in by_slot]
        self._visible_slots = [i for i, seen in enumerate(visible) if seen]
        self._all_visible = all(visible)
        tokens = torch.arange(t)
        self.write_index.copy_((torch.tensor(written)[:, None] * t + tokens).flatten())
        self.key_visible.copy_(torch.tensor(visible).repeat_interleave(t))
        self.chunk_positions.copy_(torch.tensor(list(chunk)))
        self._query_freqs = _refill(self._query_freqs, rope_fn(self.chunk_positions, grid_hw))
        if self.sink_copies:
            self._reposition_sinks(chunk_start, grid_hw, rope_fn)
        self._chunk = (chunk_start, frames)

    def _reposition_sinks(self, chunk_start: int, grid_hw: tuple[int, int], rope_fn) -> None:
        """``rope="cache"``: keep unrotated copies of the sink keys committed since the last chunk, then rotate
        every sink's keys to ``s + o`` for this chunk's offset ``o`` when it moved (at most once a chunk, one
        pass over the sink frames, always from the copies: no rounding accumulates)."""
        t, device = self.tokens_per_frame, self.write_index.device
        committed = min(self.window.sink_frames, self.frames_committed)
        if committed > self.sinks_copied:
            # written by their chunk's queries' rotation, at their absolute index (o is 0 while a sink is written)
            written = rope_fn(torch.arange(self.sinks_copied, committed, device=device), grid_hw)
            rows = slice(self.sinks_copied * t, committed * t)
            for i in range(self.layers):
                keys = self.layer_kv(i)[0][:, rows]
                unrotated = kernels.apply_rope(keys, written.cos, -written.sin, mode=self.kernel_mode)
                self.sink_keys(i)[:, rows].copy_(unrotated)
            self.sinks_copied = committed
        offset = self.window.cache_offset(chunk_start)
        if offset == self.sink_offset or not self.sinks_copied:
            return
        n = self.sinks_copied  # offset > 0 only once every sink is committed (and copied)
        freqs = rope_fn(torch.arange(n, device=device) + offset, grid_hw)
        for i in range(self.layers):
            rotated = kernels.apply_rope(
                self.sink_keys(i)[:, : n * t], freqs.cos, freqs.sin, mode=self.kernel_mode
            )
            self.layer_kv(i)[0][:, : n * t].copy_(rotated)
        self.sink_offset = offset

    def _age_out(self, chunk: range) -> None:
        """Quantize the completed frames whose full-precision slots ``chunk`` is about to take, if they are
        still in its window (each frame once: it never returns to a full-precision slot)."""
        t = self.tokens_per_frame
        runs: list[list[int]] = []  # [first full slot, first quantized slot, frames]
        for frame in chunk:
            slot = self.slot_of(frame)
            old = self.slot_frame[slot]
            if old is None or old == frame:
                continue
            self.slot_frame[slot] = None
            if not self.window.visible(chunk.start, old):
                continue
            quant = self.quant_slot_of(old)
            self.quant_slot_frame[quant] = old
            if runs and runs[-1][0] + runs[-1][2] == slot and runs[-1][1] + runs[-1][2] == quant:
                runs[-1][2] += 1
            else:
                runs.append([slot, quant, 1])
        for full_slot, quant_slot, n in runs:
            src = slice(full_slot * t, (full_slot + n) * t)
            dst = slice(quant_slot * t, (quant_slot + n) * t)
            for i in range(self.layers):
                for full, quant in zip(self.layer_kv(i), self.layer_quant(i)):
                    for buffer, part in zip(
                        quant.parts(), kernels.quantize_kv(full[:, src], self.bits, mode=self.kernel_mode)
                    ):
                        buffer[:, dst].copy_(part)
            self.frames_quantized += n

    def key_mask(self) -> torch.Tensor | None:
        """The keys this chunk's queries may see, ``[1, 1, 1, slots * T]`` (None once every slot is visible:
        the window is full and the step is a pure function of fixed shapes, unmasked)."""
        return None if self._all_visible else self.key_visible.view(1, 1, 1, -1)

    def visible_rows(self) -> torch.Tensor:
        """Token indices (into :meth:`_LayerView.read_window`) of the visible slots, in slot order."""
        t = self.tokens_per_frame
        rows = (torch.tensor(self._visible_slots, dtype=torch.long)[:, None] * t + torch.arange(t)).flatten()
        return rows.to(self.key_visible.device)

    def read_frames(self) -> list[int]:
        """The frames the current chunk reads, in the order of ``layer(i).read()``'s tokens."""
        by_slot = self.slot_frame + self.quant_slot_frame
        return [by_slot[i] for i in self._visible_slots]

    def query_rope(self) -> RopeFreqs:
        return self._query_freqs

    def layer(self, index: int) -> _LayerView:
        return _LayerView(self, *self.layer_kv(index), self.layer_quant(index) if self.quant_ring else None)

    def capture_state(self) -> tuple:
        """The host state a captured step branches on, hashable: whether the window is full (unmasked) or still
        filling (masked), and the addresses of every tensor a step reads, which a CUDA graph holds (a moved or
        rebuilt cache is another key)."""
        q = self.query_rope()
        rope = [] if q is None else [q.cos, q.sin]
        tensors = [*self.buffers(), self.write_index, self.key_visible, *rope]
        return (self.key_mask() is None, tuple(t.data_ptr() for t in tensors))

    def commit(self) -> None:
        """The current chunk's clean K/V are written: the next chunk may begin."""
        if self._chunk is None:
            raise InputError("chunk", "no chunk to commit")
        self.frames_committed = self._chunk[0] + self._chunk[1]
        self._chunk = None


def _refill(buffer: RopeFreqs | None, fresh: RopeFreqs) -> RopeFreqs:
    """``fresh`` copied into ``buffer`` in place when it has the same layout (the tensors a captured forward
    reads stay the same objects), else ``fresh`` itself becomes the buffer (first chunk, or moved device)."""
    same = buffer is not None and all(
        old.shape == new.shape and old.dtype == new.dtype and old.device == new.device
        for old, new in ((buffer.cos, fresh.cos), (buffer.sin, fresh.sin))
    )
    if not same:
        return RopeFreqs(fresh.cos.clone(), fresh.sin.clone())
    buffer.cos.copy_(fresh.cos)
    buffer.sin.copy_(fresh.sin)
    return buffer


class CrossAttentionCache:
    """Per-layer text keys/values for one prompt, computed when the prompt is set (:meth:`fill`), outside any
    denoising step: a step only reads them, so it has no host branch on what is filled. :meth:`reset` (or a new
    :meth:`fill`) when the prompt changes."""

    def __init__(self):
        self._kv: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()

    def fill(self, blocks, context: torch.Tensor, backends: Backends) -> CrossAttentionCache:
        """Every layer's keys/values of ``context`` (the embedded prompt), from each block's ``cross_attn``,
        computed with the run's ``backends``."""
        self._kv = tuple(block.cross_attn.context_kv(context, backends) for block in blocks)
        return self

    def layer(self, index: int):
        """Layer ``index``'s keys/values (filled before the step)."""
        if index >= len(self._kv):
            raise InputError(
                "cross_kv",
                f"the cross-attention cache holds {len(self._kv)} layers, not layer {index}: fill() it with the "
                "prompt before a step (a step never fills it)",
            )
        return self._kv[index]

    def reset(self) -> None:
        self._kv = ()

    def capture_state(self) -> tuple:
        """The host state a captured step depends on, hashable: the addresses of every layer's keys/values."""
        return tuple((k.data_ptr(), v.data_ptr()) for k, v in self._kv)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._kv)
