""":class:`KVCache`: the self-attention keys and values of every layer of one video stream, and the per-chunk
tensors a forward reads. It composes the pieces of the package: the slots (``window.py``), the quantized tier
(``quantized.py``), the sinks' re-positioning (``sinks.py``), the bytes (``bytes.py``) and one layer's attention
(``layer.py``); see the package docstring for the whole design."""

from __future__ import annotations

import torch
from torch import nn

from ...backends import DEFAULT_BACKENDS, Backends
from ...errors import InputError
from ...rope import RopeFreqs
from .bytes import KV_LAYOUTS, KVFrames, kv_bytes_per_token
from .layer import LayerView
from .quantized import QUANTIZED_PARTS, KVStorage, QuantizedKV, quantize_aged, quantized_rows
from .sinks import SinkKeys
from .window import ROPE_MODES, SlotRing


class KVCache(nn.Module):
    """Self-attention K/V of all layers for one video stream (see the package docstring).

    Its registered buffers are exactly the K/V storage, per layer ``i``: ``k{i}``, ``v{i}`` (the sinks and the
    full-precision ring), ``sink_k{i}`` (unrotated sink keys, ``rope="cache"`` with sinks), ``kq{i}``,
    ``vq{i}`` and their ``_scale`` / ``_zero`` (the quantized ring). Every access goes through the registered
    names, so ``.to()`` / ``.cuda()`` leave no stale alias."""

    def __init__(
        self,
        layers: int,
        batch: int,
        tokens_per_frame: int,
        heads: int,
        head_dim: int,
        storage: KVStorage,
        dtype: torch.dtype,
        device,
        rope: str = "cache",
        backends: Backends = DEFAULT_BACKENDS,
        storage_of=None,
    ):
        """``storage``: the window and how it is stored (checked when it was built: not again here; the model's
        part, :func:`.quantized.check_kv_head_dim`, when a session opens). ``backends``: the run's
        (``Run.backends``), whose kernel mode and record of kernel fallbacks the quantization of frames that age
        out of the full-precision ring and the sinks' re-positioning use (in :meth:`begin`, outside any
        forward). ``storage_of(name, shape, dtype)``: where each buffer lives when the cache does not allocate it
        itself (a slot of a :class:`~.slots.KVSlotPool` hands out views of its shared storage); None: allocated
        here, zeroed."""
        super().__init__()
        if rope not in ROPE_MODES:
            raise InputError("rope", f"unknown RoPE mode {rope!r}; expected one of {', '.join(ROPE_MODES)}")
        self.storage, self.backends = storage, backends
        self.tokens_per_frame, self.layers, self.rope = tokens_per_frame, layers, rope
        window, bits = storage.window, storage.bits
        frames = KVFrames.allocated(
            window, bits, storage.keep_recent_chunks, rope
        )  # what kv_cache_bytes counts
        self.slots = SlotRing(window, frames.full - window.sink_frames, frames.quantized)
        self.sinks = SinkKeys(window, tokens_per_frame, backends) if frames.sink_copies else None

        # Full-precision keys and values are laid out head-major when the run's attention reads them that way
        # (engine.attention): every chunk reads the whole window, so its reads are then contiguous [B, H, L, D].
        head_major = backends.reads_head_major(torch.empty(0, dtype=dtype, device=device))

        def allocate(
            name: str, frame_count: int, row: tuple[int, ...] = (heads, head_dim), kind=dtype
        ) -> None:
            shape = (batch, frame_count * tokens_per_frame, *row)
            if storage_of is None and head_major and row == (heads, head_dim):
                tensor = torch.zeros((batch, heads, shape[1], head_dim), dtype=kind, device=device).transpose(
                    1, 2
                )
            elif storage_of is None:
                tensor = torch.zeros(shape, dtype=kind, device=device)
            else:
                tensor = storage_of(name, shape, kind)
            self.register_buffer(name, tensor, persistent=False)

        for i in range(layers):  # the sinks and the full-precision ring
            allocate(f"k{i}", frames.full)
            allocate(f"v{i}", frames.full)
        for i in range(layers if frames.sink_copies else 0):  # the sinks' unrotated keys (sinks.py)
            allocate(f"sink_k{i}", frames.sink_copies)
        for i in range(layers if frames.quantized else 0):  # the quantized ring (quantized.py)
            for name in ("k", "v"):
                for suffix, (row, kind) in zip(QUANTIZED_PARTS, quantized_rows(heads, head_dim, bits)):
                    allocate(f"{name}q{i}{suffix}", frames.quantized, row, kind)
        # Per-chunk bookkeeping as device tensors of fixed shapes, rewritten in place by `begin` (so a forward,
        # compiled or replayed from a CUDA graph, reads the same tensors every chunk): the token slots the
        # chunk writes, and which token slots (full precision, then quantized) its queries see.
        # Not registered buffers: the module's buffers are exactly the K/V storage (nbytes); `_apply` moves them.
        slot_tokens = (frames.full + frames.quantized) * tokens_per_frame
        self._full_write_index = torch.zeros(
            window.chunk_frames * tokens_per_frame, dtype=torch.long, device=device
        )
        self.key_visible = torch.zeros(slot_tokens, dtype=torch.bool, device=device)
        # RoPE frame positions of the chunk's frames (their absolute indices, in both modes) and their rotations
        # (float32 tables from float64 angles, `Wan.frame_rope`, whatever `.to(dtype)` does to the storage)
        self._full_chunk_positions = torch.zeros(window.chunk_frames, dtype=torch.long, device=device)
        self._full_freqs: RopeFreqs | None = None
        # what the current forward reads: the whole-chunk tensors above, or a partial forward's own (`begin`)
        self.write_index, self.chunk_positions = self._full_write_index, self._full_chunk_positions
        self._query_freqs: RopeFreqs | None = None
        self.frames_committed = 0  # frames whose clean K/V are final
        self.frames_quantized = 0  # frames quantized so far (each once)
        self._chunk: tuple[int, int] | None = None

    _BOOKKEEPING = ("_full_write_index", "key_visible", "_full_chunk_positions")

    def _apply(self, fn, recurse=True):
        """``.to()`` / ``.cuda()`` / ``.half()``: the storage as nn.Module converts it, and the bookkeeping to
        the storage's device (integer tensors: ``fn`` leaves their dtype alone). A partial forward's transient
        tensors are dropped: the next ``begin`` rebuilds them."""
        super()._apply(fn, recurse)
        for name in self._BOOKKEEPING:
            setattr(self, name, fn(getattr(self, name)))
        partial = self.write_index is not self._full_write_index and self._chunk is not None
        self.write_index, self.chunk_positions = self._full_write_index, self._full_chunk_positions
        freqs = self._full_freqs
        if freqs is not None:
            device = self.write_index.device
            self._full_freqs = RopeFreqs(freqs.cos.to(device), freqs.sin.to(device))
        self._query_freqs = self._full_freqs
        if partial:
            self._chunk = None
        return self

    # -- storage, by layer (registered names only: see the class docstring) ------------------------------------
    def layer(self, index: int) -> LayerView:
        """Layer ``index``'s view of the cache for a forward: its storage and this chunk's tensors."""
        quant = self._layer_quant(index) if self.slots.quant_ring else None
        return LayerView(self, *self._layer_kv(index), quant)

    def _layer_kv(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"k{index}"), getattr(self, f"v{index}")

    def _layer_quant(self, index: int) -> tuple[QuantizedKV, QuantizedKV]:
        return tuple(
            QuantizedKV(*(getattr(self, f"{name}q{index}{suffix}") for suffix in QUANTIZED_PARTS))
            for name in ("k", "v")
        )

    # -- bytes: the formula of bytes.py --------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the K/V storage (every layer's buffers, scales and zero points and sink copies included; the
        per-chunk bookkeeping, a few integers per slot, is not counted)."""
        return sum(buffer.nbytes for buffer in self.buffers())

    def bytes_per_token(self) -> int:
        """``2 x heads x head_dim x layers x element size``: K and V of one full-precision token, all layers."""
        _, _, heads, head_dim = self.k0.shape
        return kv_bytes_per_token(self.layers, heads, head_dim, KV_LAYOUTS["bf16"], self.k0.element_size())

    def quantized_bytes_per_token(self) -> int:
        """``2 x heads x (codes + scale + zero point) x layers``: K and V of one quantized token (0 if none)."""
        if self.storage.bits is None:
            return 0
        _, _, heads, head_dim = self.k0.shape
        return kv_bytes_per_token(self.layers, heads, head_dim, KV_LAYOUTS[self.storage.kv_dtype])

    def bytes_used(self) -> int:
        """Bytes of the occupied slots (full precision and quantized) and sink copies, all layers and the whole
        batch."""
        full, quantized = self.slots.filled()
        filled = KVFrames(full, quantized, 0 if self.sinks is None else self.sinks.copied)
        batch = self.k0.shape[0]
        return filled.nbytes(
            self.tokens_per_frame, batch * self.bytes_per_token(), batch * self.quantized_bytes_per_token()
        )

    # -- one chunk -----------------------------------------------------------------------------------------------
    def begin(self, chunk_start: int, frames: int, grid_hw: tuple[int, int], rope_fn) -> None:
        """Prepare forwards over the chunk ``[chunk_start, chunk_start + frames)``: rewrite the bookkeeping
        tensors in place (host-to-device copies of values computed on the host; nothing is read back).

        ``rope_fn(frame_positions [F], (h, w)) -> RopeFreqs`` builds rotations for whole frames.

        ``frames`` is a whole chunk, except for a prefill's lone first frame (``engine.causal.prefill``: fewer
        frames than a chunk). Such a forward writes through transient tensors of its own size, so the fixed-shape
        tensors a compiled or captured chunk step reads stay the same objects (no recompile, no recapture).
        """
        if chunk_start != self.frames_committed:
            raise InputError(
                "chunk",
                f"the next chunk must start at frame {self.frames_committed} (the frames "
                f"committed so far), not {chunk_start}",
            )
        chunk_frames = self.storage.window.chunk_frames
        if not 1 <= frames <= chunk_frames:
            raise InputError("chunk", f"chunks are {chunk_frames} latent frames, got {frames}")
        if self._chunk == (chunk_start, frames):
            return
        t = self.tokens_per_frame
        partial = frames != chunk_frames
        chunk = range(chunk_start, chunk_start + frames)
        if self.slots.quant_ring:
            layers = ((self._layer_kv(i), self._layer_quant(i)) for i in range(self.layers))
            aged = self.slots.age_out(chunk)
            self.frames_quantized += quantize_aged(aged, layers, t, self.storage.bits, self.backends)
        written = self.slots.place(chunk)
        visible = self.slots.see(chunk_start, frames)
        tokens = torch.arange(t)
        write_index = (torch.tensor(written)[:, None] * t + tokens).flatten()
        if partial:  # transient, its own size: the whole-chunk tensors are left as they are
            device = self._full_write_index.device
            self.write_index = write_index.to(device)
            self.chunk_positions = torch.tensor(list(chunk), device=device)
            self._query_freqs = rope_fn(self.chunk_positions, grid_hw)
        else:
            self.write_index, self.chunk_positions = self._full_write_index, self._full_chunk_positions
            self.write_index.copy_(write_index)
            self.chunk_positions.copy_(torch.tensor(list(chunk)))
            self._full_freqs = _refill(self._full_freqs, rope_fn(self.chunk_positions, grid_hw))
            self._query_freqs = self._full_freqs
        self.key_visible.copy_(torch.tensor(visible).repeat_interleave(t))
        if self.sinks is not None:
            keys = [self._layer_kv(i)[0] for i in range(self.layers)]
            copies = [getattr(self, f"sink_k{i}") for i in range(self.layers)]  # unrotated (sinks.py)
            self.sinks.reposition(chunk_start, self.frames_committed, keys, copies, grid_hw, rope_fn, frames)
        self._chunk = (chunk_start, frames)

    def key_mask(self) -> torch.Tensor | None:
        """The keys this chunk's queries may see, ``[1, 1, 1, slots * T]`` (None once every slot is visible:
        the window is full and the step is a pure function of fixed shapes, unmasked)."""
        return None if self.slots.all_visible else self.key_visible.view(1, 1, 1, -1)

    def query_rope(self) -> RopeFreqs:
        return self._query_freqs

    def capture_state(self) -> tuple:
        """The host state a captured step branches on, hashable: whether the window is full (unmasked) or still
        filling (masked), and the addresses of every tensor a step reads, which a CUDA graph holds (a moved or
        rebuilt cache is another key)."""
        q = self.query_rope()
        rope = [] if q is None else [q.cos, q.sin]
        tensors = [*self.buffers(), self.write_index, self.key_visible, *rope]
        return (self.key_mask() is None, tuple(t.data_ptr() for t in tensors))

    # -- the host state beside the buffers (swap and snapshots: engine.causal.session_state) -------------------------
    def host_state(self) -> dict:
        """What the cache knows besides its buffers, as plain integers (JSON): which frame each slot holds, the
        frames committed and quantized, the sinks' copies and offset. With the buffers it is the whole cache."""
        return {
            "full": list(self.slots.full),
            "quantized": list(self.slots.quantized),
            "frames_committed": self.frames_committed,
            "frames_quantized": self.frames_quantized,
            "sinks_copied": 0 if self.sinks is None else self.sinks.copied,
            "sinks_offset": 0 if self.sinks is None else self.sinks.offset,
        }

    def load_host_state(self, state: dict) -> None:
        """The inverse of :meth:`host_state` (its buffers restored by the caller). The next ``begin`` rebuilds
        the per-chunk tensors: for a chunk already begun (a deferred commit) it places the same slots again."""
        if len(state["full"]) != len(self.slots.full) or len(state["quantized"]) != len(self.slots.quantized):
            raise InputError("session", "the saved KV slots do not match this cache's window")
        self.slots.full = list(state["full"])
        self.slots.quantized = list(state["quantized"])
        self.slots.visible_slots, self.slots.all_visible = [], False
        self.frames_committed = int(state["frames_committed"])
        self.frames_quantized = int(state["frames_quantized"])
        if self.sinks is not None:
            self.sinks.copied, self.sinks.offset = int(state["sinks_copied"]), int(state["sinks_offset"])
        self._chunk = None

    def named_storage(self) -> dict[str, torch.Tensor]:
        """Every K/V buffer by its registered name (the storage a swap moves and a snapshot saves)."""
        return dict(self.named_buffers())

    def recached(self, frames: range) -> None:
        """A re-cache (``recache.py``) rewrote the K/V of ``frames``: when they include the sinks, their unrotated
        copies are taken again from the new keys (stored at their absolute index: the stream is still within the
        window, offset 0) at the next ``begin``, which prepares every forward anew."""
        if self.sinks is not None and frames.start == 0:
            self.sinks.copied, self.sinks.offset = 0, 0
        self._chunk = None

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
