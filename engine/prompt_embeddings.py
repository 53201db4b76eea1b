"""The cache of encoded prompts, and the synthetic stand-in for a text encoder with dummy weights.

Encoding a prompt is one of the fixed costs that surface once steps are few (a T5-XXL forward beside four DiT
steps). :class:`PromptEmbeddingCache` keeps encoded prompts so a prompt is never encoded twice in a process: the
CLI encodes every prompt of a run through one (``engine.text_encoders``), and a live session (``engine.live``),
which receives prompts as text at any time, encodes them on the generation thread through one (a client toggling
between two prompts costs one encoding each).

With dummy weights and no text encoder, :func:`synthetic_text_embedding` stands in for one: a deterministic
function of the text, so a live run and a ``stream --script`` run of the same script get the same conditioning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

# the stream CLI's synthetic prompt (``--text-tokens``) default; the live node and ``stream --script`` pass the
# model's ``params.text_len`` instead, so both give the same tensor
STREAM_TEXT_TOKENS = 64
UMT5_DIM = 4096


def seeded_text_embedding(seed: int, text_tokens: int, text_dim: int = UMT5_DIM) -> torch.Tensor:
    """The seeded synthetic umT5 prompt ``[1, text_tokens, text_dim]`` (float32, CPU) a stream of ``seed`` uses
    without --cond (``cli/stream.py`` ``synthetic_prompt``)."""
    return torch.randn(1, text_tokens, text_dim, generator=torch.Generator().manual_seed((seed + 1) % 2**64))


def text_seed(text: str) -> int:
    """The seed a prompt text stands for: the first 8 bytes of its UTF-8 SHA-256, big-endian, shifted right by one
    (63 bits: a valid seed everywhere)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") >> 1


def synthetic_text_embedding(text: str, text_tokens: int = 512, text_dim: int = UMT5_DIM) -> torch.Tensor:
    """A stand-in text encoder for dummy weights: ``[1, text_tokens, text_dim]`` float32 on the CPU, a
    deterministic function of ``text`` (:func:`seeded_text_embedding` of :func:`text_seed`).

    Which ``text_tokens``: callers pass the model's ``params.text_len`` (Wan reads at most that many tokens; 512
    for Wan 2.1, wan-tiny's included). The live node without a CLIP connected and ``stream --script`` both call
    ``synthetic_text_embedding(text, text_tokens=model.params.text_len)``, so they agree; the 512 default is that
    value for Wan 2.1. (``stream``'s seeded synthetic prompt without a script keeps its own ``--text-tokens``
    default, :data:`STREAM_TEXT_TOKENS`.)"""
    return seeded_text_embedding(text_seed(text), text_tokens, text_dim)


# What a cache holds at most by default: 256 MiB is ~128 FLUX.1 prompts (T5 256 x 4096 float32 = 4 MiB) or 32
# Wan prompts (512 x 4096 = 8 MiB); a prompt's tensors are small next to any DiT, but a live server runs for hours
DEFAULT_MAX_BYTES = 256 * 2**20


def _cpu(value):
    """A CPU copy of an encoded prompt (a tensor, or a PromptEmbedding's tensors): a device copy would hold device
    memory per entry."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu")
    if dataclasses.is_dataclass(value):
        moved = {
            f.name: getattr(value, f.name).detach().to("cpu")
            for f in dataclasses.fields(value)
            if isinstance(getattr(value, f.name), torch.Tensor)
        }
        return dataclasses.replace(value, **moved)
    raise TypeError(f"a prompt cache holds tensors or PromptEmbeddings, not {type(value).__name__}")


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return int(value.nbytes)


class PromptEmbeddingCache:
    """Encoded prompts, least recently used dropped first, bounded in bytes (``max_bytes``) and optionally in
    entries (``max_entries``). One cache serves every caller of a process: the CLI (``generate``, ``stream``,
    ``encode``), the engine API (:meth:`embed`) and a live run's prompt switches.

    A key says everything an embedding depends on: :meth:`embed` uses ``(encoder.key, prompt)`` (the encoder's
    folders, dtype and settings, ``engine.text_encoders.TextEncoder.key``); a caller with one fixed encoder (a live
    run) may key by the text alone. Entries are CPU copies. An embedding larger than ``max_bytes`` is returned
    without being kept. Thread-safe; the encoding runs outside the lock (two threads missing the same key may both
    encode it, and the second result replaces the first). ``hits`` / ``misses`` / ``evictions`` count since
    creation; :meth:`stats` reports them with the bytes held."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_entries: int | None = None):
        for name, value in (("max_bytes", max_bytes), ("max_entries", max_entries)):
            if value is None and name == "max_entries":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, tuple[object, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, key: Hashable, encode: Callable[[], object]):
        """The value kept under ``key``, or ``encode()``'s result (kept as a CPU copy, and returned so)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return entry[0]
            self.misses += 1
        value = _cpu(encode())
        size = _nbytes(value)
        if size > self.max_bytes:
            return value
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (value, size)
            self._bytes += size
            while self._bytes > self.max_bytes or (
                self.max_entries is not None and len(self._entries) > self.max_entries
            ):
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped
                self.evictions += 1
        return value

    def embed(self, encoder, prompt: str):
        """``encoder.encode(prompt)`` (an ``engine.text_encoders.TextEncoder``) through the cache."""
        return self.get((encoder.key, prompt), lambda: encoder.encode(prompt))

    def stats(self) -> dict:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                    "entries": len(self._entries), "bytes": self._bytes, "max_bytes": self.max_bytes}  # fmt: skip

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
