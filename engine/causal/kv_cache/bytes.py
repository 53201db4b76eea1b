"""The one formula for a KV cache's bytes: what :class:`~.cache.KVCache` allocates (its slots per storage tier
come from :meth:`KVFrames.allocated`), what the cost planner, a session's memory preflight and a pool session's
size count (:func:`kv_cache_bytes`), and what a cache uses as it fills (:meth:`KVFrames.nbytes` of its filled
slots).

Per token, every layer: K and V of ``heads x head_dim`` values, in the compute dtype, or quantized
(``kernels.kv_quant``: codes, ``head_dim`` bytes for int8 and ``head_dim / 2`` for int4, plus a float16 scale and
zero point per (token, head) row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ....kernels import kv_quant
from ...errors import InputError
from .window import WindowSpec


@dataclass(frozen=True)
class KVLayout:
    """How ``kv_dtype`` stores a (token, head) row of K or V once it is out of the full-precision slots."""

    name: str
    bits: int | None  # None: unquantized, in the compute dtype (bf16 on a GPU)
    note: str

    def group_bytes(self, head_dim: int, element_size: int = 2) -> int:
        """Bytes of one (token, head) row of K or of V (unquantized: ``element_size``, the compute dtype's)."""
        if self.bits is None:
            return element_size * head_dim
        return kv_quant.group_bytes(head_dim, self.bits)  # codes + float16 scale + float16 zero point


KV_LAYOUTS: dict[str, KVLayout] = {
    k.name: k
    for k in (
        KVLayout("bf16", None, "the compute dtype, unquantized"),
        KVLayout("int8", 8, "uint8 codes + fp16 scale and zero point per (token, head)"),
        KVLayout("int4", 4, "two 4-bit codes per byte + fp16 scale and zero point per (token, head)"),
    )
}
KV_DTYPES = tuple(KV_LAYOUTS)


def kv_layout(name: str, input_name: str = "kv_dtype") -> KVLayout:
    if name not in KV_LAYOUTS:
        raise InputError(input_name, f"unknown KV cache dtype {name!r}; known: {', '.join(KV_LAYOUTS)}")
    return KV_LAYOUTS[name]


def kv_bytes_per_token(
    layers: int, heads: int, head_dim: int, layout: KVLayout, element_size: int = 2
) -> int:
    """K and V of one token over every layer (batch 1), as ``layout`` stores it (``element_size``: the compute
    dtype's, for unquantized rows)."""
    return 2 * layers * heads * layout.group_bytes(head_dim, element_size)


@dataclass(frozen=True)
class KVFrames:
    """Latent frames of K/V by how they are stored: ``full`` frames of K and V in the compute dtype (the sinks
    included), ``quantized`` frames of K and V (int8 / int4), ``sink_copies`` frames of unrotated sink keys (K
    only, compute dtype). Either the slots a cache allocates (:meth:`allocated`) or the ones it fills."""

    full: int
    quantized: int
    sink_copies: int

    @classmethod
    def allocated(cls, window: WindowSpec, bits: int | None, keep_recent_chunks: int, rope: str) -> KVFrames:
        """The slots of a cache: unquantized, the whole window in the compute dtype; quantized, the sinks and the
        current and ``keep_recent_chunks`` newest chunks in the compute dtype and the rest of the window
        quantized; ``rope="cache"`` adds a copy of the sinks' keys (``sinks.py``)."""
        ring = window.ring_frames
        full_ring = ring if bits is None else (keep_recent_chunks + 1) * window.chunk_frames
        sink_copies = window.sink_frames if rope == "cache" else 0
        return cls(window.sink_frames + full_ring, ring - full_ring, sink_copies)

    def nbytes(self, tokens_per_frame: int, full_token: int, quantized_token: int) -> int:
        """Bytes of these frames; ``full_token`` / ``quantized_token``: K and V of one token, every layer and
        batch row, in the compute dtype / quantized."""
        keys_only = full_token // 2
        return tokens_per_frame * (
            self.full * full_token + self.quantized * quantized_token + self.sink_copies * keys_only
        )


@dataclass(frozen=True)
class KVBytes:
    per_token: int  # as stored for good (quantized for int8 / int4), every batch row
    per_chunk: int  # one chunk's tokens at per_token
    window: int  # the cache's allocation: KVCache.nbytes
    full_frames: int  # frame slots kept in the compute dtype (all of them unquantized)
    quantized_frames: int

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def kv_cache_bytes(
    layers: int, batch: int, tokens_per_frame: int, heads: int, head_dim: int, window: WindowSpec,
    dtype: torch.dtype = torch.bfloat16, kv_dtype: str = "bf16", keep_recent_chunks: int = 1, rope: str = "cache",
) -> KVBytes:  # fmt: skip
    """The bytes of a ``KVCache`` built with the same arguments (``dtype``: the compute dtype), computed without
    allocating: the cache allocates exactly ``.window`` bytes (``KVCache.nbytes``)."""
    layout = kv_layout(kv_dtype)
    element_size = dtype.itemsize
    full_token = batch * kv_bytes_per_token(layers, heads, head_dim, KV_LAYOUTS["bf16"], element_size)
    token = batch * kv_bytes_per_token(layers, heads, head_dim, layout, element_size)
    frames = KVFrames.allocated(window, layout.bits, keep_recent_chunks, rope)
    return KVBytes(
        per_token=token,
        per_chunk=token * tokens_per_frame * window.chunk_frames,
        window=frames.nbytes(tokens_per_frame, full_token, token),
        full_frames=frames.full,
        quantized_frames=frames.quantized,
    )


def kv_pool_bytes(
    layers: int, slots: int, tokens_per_frame: int, heads: int, head_dim: int, window: WindowSpec,
    dtype: torch.dtype = torch.bfloat16, kv_dtype: str = "bf16", keep_recent_chunks: int = 1, rope: str = "cache",
) -> int:  # fmt: skip
    """The bytes a :class:`~.slots.KVSlotPool` of ``slots`` streams allocates: ``slots`` caches of batch 1 (each
    :func:`kv_cache_bytes`), plus one chunk of full-precision K and V per layer where a batch's padded rows write."""
    one = kv_cache_bytes(layers, 1, tokens_per_frame, heads, head_dim, window, dtype, kv_dtype, keep_recent_chunks,
                         rope)  # fmt: skip
    padding = (
        tokens_per_frame
        * window.chunk_frames
        * kv_bytes_per_token(layers, heads, head_dim, KV_LAYOUTS["bf16"], dtype.itemsize)
    )
    return slots * one.window + padding


CLEAN_LATENT_DTYPE = torch.float32  # a chunk's denoised latents, as the sampler returns them


def clean_frames_bytes(window: WindowSpec, batch: int, channels: int, latent_hw: tuple[int, int]) -> int:
    """The bytes of a session's :class:`~.clean_frames.CleanFrames`: the clean latents of ``window_frames``
    frames (float32), kept so that a prompt switch can re-cache the window (``kv_cache.recache``)."""
    h, w = latent_hw
    return window.window_frames * batch * channels * h * w * CLEAN_LATENT_DTYPE.itemsize
