"""A KV slot pool: the K/V storage of several video streams allocated once, one slot per stream, and the view a
forward over a batch of those streams reads (:class:`BatchedKV`).

Storage. For every layer, each buffer a :class:`~.cache.KVCache` holds (``k{i}``, ``v{i}``, the sinks' unrotated
key copies, the quantized ring with its scales and zero points) is one tensor with a leading slot axis. A slot's
:class:`~.cache.KVCache` is built on views of its rows (:meth:`KVSlotPool.slot_cache`): its window, its sinks, its
quantization of aged frames, its bookkeeping (``begin`` / ``commit``) are the single-stream code, unchanged, writing
into the shared storage. The full-precision buffers are stored flat, ``[slots x window_tokens + chunk_tokens, H,
D]``: the extra chunk of rows at the end is where the padded rows of a batch write (a batch runs at a bucketed size
with static shapes; a padded row must write somewhere that no stream reads).

A batched forward. :class:`BatchedKV` gathers, for a batch of rows (each a slot, or padding), the per-chunk
tensors of the slots' caches into tensors of fixed shapes preallocated per bucket size: the flat token rows each
row writes, which key slots each row sees, the rotations of each row's chunk. A layer then writes every row's keys
and values with one ``index_copy_`` into the flat storage and attends over the rows' windows gathered by slot
(``index_select``): each row sees only its own slot, with its own fill state, sink positions and quantized tier.
The rows' sessions may be at different positions and fill states: the visibility mask is per row, and dropped
(None: the unmasked entry point of a compiled step) once every row's window is full.
"""

from __future__ import annotations

import torch

from ....kernels.kv_quant import QuantizedAttentionInputs
from ...attention import gather_rows
from ...backends import DEFAULT_BACKENDS, Backends
from ...rope import RopeFreqs
from .bytes import KVFrames, kv_pool_bytes
from .cache import KVCache
from .quantized import QUANTIZED_PARTS, KVStorage, QuantizedKV, quantized_rows


class KVSlotPool:
    """K/V storage for ``slots`` streams of one shape group, allocated once (:func:`.bytes.kv_pool_bytes` bytes)."""

    def __init__(
        self,
        layers: int,
        slots: int,
        tokens_per_frame: int,
        heads: int,
        head_dim: int,
        storage: KVStorage,
        dtype: torch.dtype,
        device,
        rope: str = "cache",
    ):
        self.layers, self.slots, self.tokens_per_frame = layers, slots, tokens_per_frame
        self.heads, self.head_dim, self.storage, self.dtype, self.rope = heads, head_dim, storage, dtype, rope
        self.device = torch.device(device)
        window, bits = storage.window, storage.bits
        self.frames = KVFrames.allocated(window, bits, storage.keep_recent_chunks, rope)
        self.full_tokens = self.frames.full * tokens_per_frame  # per slot
        self.chunk_tokens = window.chunk_frames * tokens_per_frame
        self.tensors: dict[str, torch.Tensor] = {}
        t = tokens_per_frame
        for i in range(layers):
            for name in (f"k{i}", f"v{i}"):  # flat, with the padded rows' chunk at the end
                self.tensors[name] = torch.zeros(
                    slots * self.full_tokens + self.chunk_tokens, heads, head_dim, dtype=dtype, device=device
                )
            if self.frames.sink_copies:
                self.tensors[f"sink_k{i}"] = torch.zeros(
                    slots, self.frames.sink_copies * t, heads, head_dim, dtype=dtype, device=device
                )
            if self.frames.quantized:
                for name in ("k", "v"):
                    for suffix, (row, kind) in zip(QUANTIZED_PARTS, quantized_rows(heads, head_dim, bits)):
                        self.tensors[f"{name}q{i}{suffix}"] = torch.zeros(
                            slots, self.frames.quantized * t, *row, dtype=kind, device=device
                        )

    @property
    def nbytes(self) -> int:
        """Bytes allocated: :func:`.bytes.kv_pool_bytes` of this pool."""
        return sum(t.nbytes for t in self.tensors.values())

    @classmethod
    def bytes_for(
        cls, layers, slots, tokens_per_frame, heads, head_dim, storage: KVStorage, dtype, rope
    ) -> int:
        """What a pool built with these arguments allocates (the one formula, ``bytes.py``)."""
        w = storage.window
        return kv_pool_bytes(layers, slots, tokens_per_frame, heads, head_dim, w, dtype, storage.kv_dtype,
                             storage.keep_recent_chunks, rope)  # fmt: skip

    def slot_rows(self, name: str, slot: int) -> torch.Tensor:
        """Slot ``slot``'s rows of buffer ``name`` as ``[1, tokens, ...]`` (a view of the shared storage)."""
        tensor = self.tensors[name]
        if name[0] in "kv" and name[1:].isdigit():
            n = self.full_tokens
            return tensor[slot * n : (slot + 1) * n].unsqueeze(0)
        return tensor[slot : slot + 1]

    def flat_full(self, name: str) -> torch.Tensor:
        """A full-precision buffer as ``[slots, full tokens, H, D]`` (without the padded rows' chunk)."""
        return self.tensors[name][: self.slots * self.full_tokens].view(
            self.slots, self.full_tokens, self.heads, self.head_dim
        )

    def slot_cache(self, slot: int, backends: Backends = DEFAULT_BACKENDS) -> KVCache:
        """A fresh :class:`KVCache` (empty window) over slot ``slot``: its storage zeroed (a slot's previous
        stream leaves nothing behind: masked keys read as zero, never as a stale NaN), its buffers views."""
        self.clear_slot(slot)

        def storage_of(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            rows = self.slot_rows(name, slot)
            if tuple(rows.shape) != tuple(shape) or rows.dtype != dtype:  # the cache and the pool disagree
                raise RuntimeError(
                    f"slot buffer {name}: pool {list(rows.shape)} {rows.dtype}, cache {list(shape)}"
                )
            return rows

        return KVCache(
            layers=self.layers, batch=1, tokens_per_frame=self.tokens_per_frame, heads=self.heads,
            head_dim=self.head_dim, storage=self.storage, dtype=self.dtype, device=self.device, rope=self.rope,
            backends=backends, storage_of=storage_of,
        )  # fmt: skip

    def clear_slot(self, slot: int) -> None:
        for name in self.tensors:
            self.slot_rows(name, slot).zero_()


class BatchedKV:
    """The ``kv`` a forward over a batch of pool rows reads (see the module docstring). One per bucket size,
    its tensors preallocated and rewritten in place by :meth:`prepare` (a captured step reads the same tensors
    every tick)."""

    def __init__(self, pool: KVSlotPool, rows: int):
        self.pool, self.rows = pool, rows
        device, c_tokens = pool.device, pool.chunk_tokens
        slot_tokens = (pool.frames.full + pool.frames.quantized) * pool.tokens_per_frame
        self.row_slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.write_rows = torch.zeros(rows * c_tokens, dtype=torch.long, device=device)
        self.key_visible = torch.zeros(rows, slot_tokens, dtype=torch.bool, device=device)
        self._freqs: RopeFreqs | None = None
        self._masked = True
        # while some rows' windows are full and others still fill: the rows of each kind (see `split`)
        self.split: tuple[torch.Tensor, torch.Tensor] | None = None
        self._splits: dict[tuple[bool, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._pattern: tuple[bool, ...] = ()
        self.bits = pool.storage.bits

    def prepare(self, slots: list[int], caches: list[KVCache]) -> None:
        """Rows ``0..n-1`` for the streams in ``slots`` whose caches have ``begin`` the chunk this forward runs;
        rows ``n..`` are padding: they write into the padded rows' chunk and read (and see) row 0's slot, their
        outputs are dropped."""
        n, pool = len(slots), self.pool
        pad = self.rows - n
        chunk = pool.chunk_tokens
        self.row_slots.copy_(torch.tensor(slots + [slots[0]] * pad))
        trash = pool.slots * pool.full_tokens + torch.arange(chunk, device=pool.device)
        for row, (slot, cache) in enumerate(zip(slots, caches)):
            self.write_rows[row * chunk : (row + 1) * chunk].copy_(
                cache.write_index + slot * pool.full_tokens
            )
            self.key_visible[row].copy_(cache.key_visible)
        for row in range(n, self.rows):
            self.write_rows[row * chunk : (row + 1) * chunk].copy_(trash)
            self.key_visible[row].copy_(caches[0].key_visible)
        freqs = [c.query_rope() for c in caches] + [caches[0].query_rope()] * pad
        cos, sin = torch.cat([f.cos for f in freqs]), torch.cat([f.sin for f in freqs])
        if self._freqs is None or self._freqs.cos.shape != cos.shape or self._freqs.cos.device != cos.device:
            self._freqs = RopeFreqs(cos.clone(), sin.clone())
        else:
            self._freqs.cos.copy_(cos)
            self._freqs.sin.copy_(sin)
        full = tuple(c.slots.all_visible for c in caches) + (caches[0].slots.all_visible,) * pad
        self._masked = not all(full)
        self._pattern = full
        # A row whose window is full attends unmasked, as its solo stream does: the masked kernel rounds otherwise,
        # and a session's video must not depend on the fill state of the rows beside it. Mixed batches attend in
        # two calls, each row with its own kind (row lists kept per pattern: fixed tensors for a captured step).
        self.split = None
        if self._masked and any(full):
            if full not in self._splits:
                rows = [[r for r, f in enumerate(full) if f], [r for r, f in enumerate(full) if not f]]
                self._splits[full] = tuple(
                    torch.tensor(r, dtype=torch.long, device=pool.device) for r in rows
                )
            self.split = self._splits[full]

    # -- what a forward reads (the interface of KVCache) ---------------------------------------------------------
    def query_rope(self) -> RopeFreqs:
        return self._freqs

    def key_mask(self) -> torch.Tensor | None:
        """``[rows, 1, 1, slot tokens]``: the keys each row may see (None once every row's window is full)."""
        return self.key_visible.view(self.rows, 1, 1, -1) if self._masked else None

    def layer(self, index: int) -> BatchedLayerView:
        return BatchedLayerView(self, index)

    def capture_state(self) -> tuple:
        """As :meth:`KVCache.capture_state`: the mask-or-not branch and the addresses a captured step reads."""
        tensors = [*self.pool.tensors.values(), self.row_slots, self.write_rows, self.key_visible]
        if self._freqs is not None:
            tensors += [self._freqs.cos, self._freqs.sin]
        if self.split is not None:
            tensors += list(self.split)
        return (self.rows, self.key_mask() is None, self._pattern, tuple(t.data_ptr() for t in tensors))


class BatchedLayerView:
    """One layer's attention for a batch of pool rows (as :class:`~.layer.LayerView` for one stream)."""

    def __init__(self, kv: BatchedKV, index: int):
        pool = kv.pool
        self.kv, self.pool, self.index = kv, pool, index
        self.mask = kv.key_mask()

    def key_mask(self) -> torch.Tensor | None:
        return self.mask

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backends: Backends) -> torch.Tensor:
        """Write each row's chunk ``k, v [rows, C*T, H, D]`` (k unrotated) into its slot and attend each row to
        its own slot's window."""
        kv, pool, i = self.kv, self.pool, self.index
        k = backends.apply_rope(k, kv.query_rope())
        keys, values = pool.tensors[f"k{i}"], pool.tensors[f"v{i}"]
        heads, head_dim = k.shape[2], k.shape[3]
        keys.index_copy_(0, kv.write_rows, k.reshape(-1, heads, head_dim).to(keys.dtype))
        values.index_copy_(0, kv.write_rows, v.reshape(-1, heads, head_dim).to(values.dtype))
        head_major = backends.reads_head_major(q)  # the gather writes what the attention reads best
        k_read = gather_rows(pool.flat_full(f"k{i}"), kv.row_slots, head_major)
        v_read = gather_rows(pool.flat_full(f"v{i}"), kv.row_slots, head_major)
        quant = None
        if pool.frames.quantized:
            quant = tuple(
                QuantizedKV(*(pool.tensors[f"{name}q{i}{suffix}"].index_select(0, kv.row_slots)
                              for suffix in QUANTIZED_PARTS))
                for name in ("k", "v")
            )  # fmt: skip
        mask = self.mask
        if quant is not None and mask is None and backends.uses_fused_quantized_attention(q):
            kq, vq = quant
            inputs = QuantizedAttentionInputs(q, k_read.to(q.dtype), v_read, kq.parts(), vq.parts(), None, None,
                                              kv.bits)  # fmt: skip
            return backends.quantized_attention(inputs)
        if quant is not None:
            kq, vq = quant
            k_read = torch.cat((k_read, backends.dequantize_kv(*kq.parts(), kv.bits, k_read.dtype)), dim=1)
            v_read = torch.cat((v_read, backends.dequantize_kv(*vq.parts(), kv.bits, v_read.dtype)), dim=1)
        k_read = k_read.to(q.dtype)
        if mask is not None and self.kv.split is not None:  # full rows unmasked, filling rows masked
            full, filling = self.kv.split
            out = torch.empty_like(q)
            out[full] = backends.attention(q[full], k_read[full], v_read[full])
            out[filling] = backends.attention(
                q[filling], k_read[filling], v_read[filling], mask=mask[filling]
            )
            return out
        return backends.attention(q, k_read, v_read, mask=mask)
