"""Quantized storage (``kv_dtype`` int8 / int4): the settings check, one layer's quantized K or V, and the
quantization of the frames that age out of the full-precision ring.

Only the newest frames stay in the compute dtype: the sinks and a ring of ``(keep_recent_chunks + 1) x
chunk_frames`` frame slots (the current chunk and the newest ``keep_recent_chunks`` completed chunks); the other
frames of the window live in a second ring of quantized slots (``kernels.kv_quant``: one float16 scale and zero
point per (token, head), codes in uint8, int4 two per byte). A completed frame is quantized once, when the next
chunk takes its full-precision slot (:meth:`.window.SlotRing.age_out`), and only if it is still in the window; it
is never written again. Keys are quantized as stored, rotated, so reads rotate nothing. Sinks are never
quantized: every chunk attends to them, so their error would be paid forever, and they are few.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ....kernels.kv_quant import packed_dim
from ...backends import Backends
from ...errors import InputError
from .bytes import KV_LAYOUTS
from .window import AgedRun, WindowSpec

# buffer name suffixes of one layer's quantized K or V: codes, scales, zero points
QUANTIZED_PARTS = ("", "_scale", "_zero")


@dataclass(frozen=True)
class KVStorage:
    """How a cache stores its window: ``kv_dtype`` (bf16: the compute dtype, unquantized; int8 / int4: the frames
    older than the current and ``keep_recent_chunks`` newest chunks quantized).

    Checked once, when it is built, against its ``window`` (:func:`check_kv_storage`; an :class:`InputError`
    naming the input): a ``CausalConfig`` builds one, a ``KVCache`` takes it and never checks it again. What
    depends on the model (int4 needs an even head_dim, :func:`check_kv_head_dim`) is checked when a session opens."""

    window: WindowSpec
    kv_dtype: str = "bf16"
    keep_recent_chunks: int = 1

    def __post_init__(self):
        check_kv_storage(self.kv_dtype, self.keep_recent_chunks, self.window, head_dim=None)

    @property
    def bits(self) -> int | None:
        """The quantization bits (None: unquantized)."""
        return KV_LAYOUTS[self.kv_dtype].bits


def check_kv_storage(
    kv_dtype: str, keep_recent_chunks: int, window: WindowSpec, head_dim: int | None, where: str | None = None
) -> int | None:
    """The quantization bits of ``kv_dtype`` (None: unquantized), or an :class:`InputError`. ``head_dim`` None:
    the settings alone (a :class:`KVStorage` when it is built); the model's part is :func:`check_kv_head_dim`."""
    if kv_dtype not in KV_LAYOUTS:
        raise InputError(
            "kv_dtype",
            f"unsupported KV storage {kv_dtype!r}; expected bf16 (the compute dtype, unquantized), int8 or int4",
            where,
        )
    bits = KV_LAYOUTS[kv_dtype].bits
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
    if KV_LAYOUTS[kv_dtype].bits == 4 and head_dim % 2:
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


def quantized_rows(heads: int, head_dim: int, bits: int) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """Per token, the (shape, dtype) of each part of a quantized K or V (in the order of
    :data:`QUANTIZED_PARTS`): ``heads`` rows of codes, a scale and a zero point per row."""
    return (
        ((heads, packed_dim(head_dim, bits)), torch.uint8),
        ((heads,), torch.float16),
        ((heads,), torch.float16),
    )


def quantize_aged(
    runs: list[AgedRun],
    layers: Iterable[tuple[tuple[torch.Tensor, torch.Tensor], tuple[QuantizedKV, QuantizedKV]]],
    tokens_per_frame: int,
    bits: int,
    backends: Backends,
) -> int:
    """Quantize each run of aged-out frames from its full-precision slots into its quantized slots, in every
    layer (``layers``: each layer's full-precision ``(K, V)`` and quantized ``(K, V)``), with the run's
    ``backends`` (its kernel mode and its record of kernel fallbacks). Returns the frames."""
    t = tokens_per_frame
    layers = list(layers)
    for run in runs:
        src = slice(run.full_slot * t, (run.full_slot + run.frames) * t)
        dst = slice(run.quant_slot * t, (run.quant_slot + run.frames) * t)
        for full_kv, quant_kv in layers:
            for full, quant in zip(full_kv, quant_kv):
                for buffer, part in zip(quant.parts(), backends.quantize_kv(full[:, src], bits)):
                    buffer[:, dst].copy_(part)
    return sum(run.frames for run in runs)
