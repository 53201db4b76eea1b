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
  retained frames contiguously, then the chunk (:meth:`WindowSpec.cache_position`). Distances stay bounded by the
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
over the sink frames of every layer, from an unrotated copy of them (``sink_k{i}``, taken once when the sinks are
committed), so the rounding of a sink never accumulates over a long stream. Scores and outputs equal those of the
cache positions read directly (``tests/engine/causal/test_causal_session.py``: the no-cache reference at cache positions).

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
  it takes no mask); elsewhere (and while the window fills) each layer's quantized part is dequantized into a
  transient buffer, concatenated with the full-precision part and attended to, one layer at a time (so the
  transient memory is one layer's window, not the cache's). Until a frame ages out, an int8/int4 stream is
  identical to a ``"bf16"`` one.

:class:`CrossAttentionCache` holds the text keys and values of every layer, computed once per prompt.

Where each concern lives (each a small piece; :class:`KVCache` composes them and owns the tensors):

* ``window.py``: :class:`WindowSpec` (which frames a chunk sees) and ``SlotRing`` (which frame each slot holds:
  the sinks, the full-precision ring, the quantized ring; host integers);
* ``sinks.py``: ``SinkKeys``, the sinks' re-positioning under ``rope="cache"``;
* ``quantized.py``: the storage settings, :class:`KVStorage` (``kv_dtype``, ``keep_recent_chunks``; checked
  once, when built, by :func:`check_kv_storage`), and int8 / int4 storage: :class:`QuantizedKV`, the
  quantization of the frames that age out of the full-precision ring;
* ``bytes.py``: THE formula for a cache's bytes (:func:`kv_cache_bytes`, :class:`KVFrames`): the cache allocates
  its slots by it, and the planner, a session's memory preflight and a pool session's size count with it;
* ``layer.py``: ``LayerView``, one layer's write, read and attention during a forward;
* ``cache.py``: :class:`KVCache` (the storage, the per-chunk tensors, ``begin`` / ``commit``);
* ``slots.py``: :class:`KVSlotPool`, the storage of several streams allocated once (one slot each, a
  :class:`KVCache` per slot over views of it), and :class:`BatchedKV`, one forward over several slots;
* ``cross.py``: :class:`CrossAttentionCache`;
* ``clean_frames.py``: :class:`CleanFrames`, the clean latents of the frames the cache holds, and ``recache.py``:
  :class:`RecacheView`, the forward that recomputes their K/V under a new prompt (LongLive's re-cache).
"""

from .bytes import (
    KV_DTYPES,
    KV_LAYOUTS,
    KVBytes,
    KVFrames,
    KVLayout,
    clean_frames_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_layout,
    kv_pool_bytes,
)
from .cache import KVCache
from .clean_frames import CleanFrames
from .cross import CrossAttentionCache
from .layer import LayerView
from .quantized import KVStorage, QuantizedKV, check_kv_head_dim, check_kv_storage
from .recache import RecacheView, recache_frames
from .sinks import SinkKeys
from .slots import BatchedKV, KVSlotPool
from .window import ROPE_MODES, SlotRing, WindowSpec, check_window

__all__ = [
    "KV_DTYPES",
    "BatchedKV",
    "CleanFrames",
    "RecacheView",
    "clean_frames_bytes",
    "recache_frames",
    "KVSlotPool",
    "kv_pool_bytes",
    "KV_LAYOUTS",
    "ROPE_MODES",
    "CrossAttentionCache",
    "KVBytes",
    "KVCache",
    "KVFrames",
    "KVLayout",
    "KVStorage",
    "LayerView",
    "QuantizedKV",
    "SinkKeys",
    "SlotRing",
    "WindowSpec",
    "check_kv_head_dim",
    "check_kv_storage",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "check_window",
    "kv_layout",
]
