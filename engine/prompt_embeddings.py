"""Prompt text -> umT5-shaped conditioning, and a bounded cache of encoded prompts.

A live session (``engine.live``) receives prompts as text at any time; they are encoded on the generation thread
through a :class:`PromptEmbeddingCache`, so a prompt sent again (a client toggling between two prompts) is not
encoded twice. Outside ComfyUI there is no text encoder: :func:`synthetic_text_embedding` stands in for one with
dummy weights, a deterministic function of the text, so a live run and a ``stream --script`` run of the same
script get the same conditioning.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable

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


class PromptEmbeddingCache:
    """``encode(text) -> Tensor`` memoized by the prompt text: the newest ``max_entries`` prompts, least recently
    used dropped first; a CPU copy of each is kept (a device tensor would hold device memory per entry).
    Thread-safe; ``encode`` runs outside the lock (two threads missing the same text may both encode it)."""

    def __init__(self, encode: Callable[[str], torch.Tensor], max_entries: int = 32):
        if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 1:
            raise ValueError(f"max_entries: expected an integer >= 1, got {max_entries!r}")
        self._encode = encode
        self.max_entries = max_entries
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, text: str) -> torch.Tensor:
        with self._lock:
            cached = self._entries.get(text)
            if cached is not None:
                self._entries.move_to_end(text)
                self.hits += 1
                return cached
            self.misses += 1
        encoded = self._encode(text).detach().to("cpu")
        with self._lock:
            self._entries[text] = encoded
            self._entries.move_to_end(text)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return encoded

    def __contains__(self, text: str) -> bool:
        with self._lock:
            return text in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
