"""Prompt text -> conditioning: the synthetic stand-in encoder (deterministic per text, the stream CLI's seeded
prompt unchanged) and the LRU cache of encoded prompts (bounded, thread-safe, counting hits and misses)."""

from __future__ import annotations

import hashlib
import threading

import pytest
import torch

from fewstep.cli.stream import synthetic_prompt
from fewstep.engine.prompt_embeddings import (
    PromptEmbeddingCache,
    seeded_text_embedding,
    synthetic_text_embedding,
    text_seed,
)


def test_the_stream_clis_seeded_prompt_keeps_its_exact_values():
    # the construction before it moved: randn of a generator seeded with seed + 1
    for seed in (0, 7, 2**64 - 1):
        before = torch.randn(1, 64, 4096, generator=torch.Generator().manual_seed((seed + 1) % 2**64))
        assert torch.equal(synthetic_prompt(seed, 64, 4096), before)
        assert torch.equal(seeded_text_embedding(seed, 64, 4096), before)


def test_a_texts_embedding_is_the_seeded_prompt_of_its_sha256():
    text = "a red fox running through snow"
    seed = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") >> 1
    assert text_seed(text) == seed < 2**63
    got = synthetic_text_embedding(text, text_tokens=16, text_dim=32)
    assert got.shape == (1, 16, 32) and got.dtype == torch.float32 and got.device.type == "cpu"
    assert torch.equal(got, seeded_text_embedding(seed, 16, 32))


def test_the_embedding_is_deterministic_and_differs_per_text():
    a = synthetic_text_embedding("a red fox", 8, 16)
    assert torch.equal(a, synthetic_text_embedding("a red fox", 8, 16))
    assert not torch.equal(a, synthetic_text_embedding("a red fox ", 8, 16))
    assert not torch.equal(a, synthetic_text_embedding("un renard roux é", 8, 16))
    assert synthetic_text_embedding("x").shape == (1, 512, 4096)  # Wan 2.1's text_len and umT5's width


def _cached(cache, text, calls=None, size=(4, 8)):
    def encode():
        if calls is not None:
            calls.append(text)
        return synthetic_text_embedding(text, *size)

    return cache.get(text, encode)


def test_the_cache_encodes_each_text_once_and_drops_the_least_recently_used():
    calls = []
    cache = PromptEmbeddingCache(max_entries=2)
    a = _cached(cache, "a", calls)
    _cached(cache, "b", calls)
    assert torch.equal(_cached(cache, "a", calls), a)  # a hit, and "a" is now the most recent
    _cached(cache, "c", calls)  # evicts "b"
    assert "b" not in cache and "a" in cache and len(cache) == 2
    _cached(cache, "b", calls)
    assert calls == ["a", "b", "c", "b"]
    assert (cache.hits, cache.misses, cache.evictions) == (1, 4, 2)


def test_the_cache_is_bounded_in_bytes():
    one = 4 * 8 * 4  # a [1, 4, 8] float32 embedding
    cache = PromptEmbeddingCache(max_bytes=3 * one)
    for text in "abcd":
        _cached(cache, text)
    assert len(cache) == 3 and cache.nbytes == 3 * one and "a" not in cache
    assert cache.stats() == {"hits": 0, "misses": 4, "evictions": 1, "entries": 3, "bytes": 3 * one,
                             "max_bytes": 3 * one}  # fmt: skip
    # an embedding larger than the whole cache is returned, not kept (nothing else is evicted for it)
    big = _cached(cache, "big", size=(16, 8))
    assert big.shape == (1, 16, 8) and "big" not in cache and len(cache) == 3


def test_the_cache_keeps_cpu_copies_of_prompt_embeddings_and_keys_them_by_encoder():
    from fewstep.engine.text_encoders import PromptEmbedding

    class Encoder:
        def __init__(self, key):
            self.key, self.calls = key, 0

        def encode(self, prompt):
            self.calls += 1
            return PromptEmbedding(torch.full((1, 2, 3), float(len(prompt))), torch.ones(1, 5))

    cache = PromptEmbeddingCache()
    first, second = (
        Encoder("flux|/a|float32|max_sequence_length=256"),
        Encoder("flux|/b|float32|max_sequence_length=256"),
    )
    e = cache.embed(first, "fox")
    assert cache.embed(first, "fox") is e and first.calls == 1
    cache.embed(second, "fox")  # another encoder's embedding of the same text is its own entry
    assert second.calls == 1 and len(cache) == 2 and cache.nbytes == 2 * e.nbytes == 2 * (6 + 5) * 4
    assert e.context.device.type == "cpu" and e.pooled.device.type == "cpu"


def test_the_cache_keeps_a_cpu_copy():
    source = torch.ones(1, 2, 3)
    cache = PromptEmbeddingCache(max_entries=1)
    kept = cache.get("x", lambda: source)
    assert kept.device.type == "cpu" and torch.equal(kept, source)


def test_the_cache_refuses_a_bound_below_one():
    with pytest.raises(ValueError, match="max_entries: expected an integer >= 1, got 0"):
        PromptEmbeddingCache(max_entries=0)
    with pytest.raises(ValueError, match="max_bytes: expected an integer >= 1, got -1"):
        PromptEmbeddingCache(max_bytes=-1)


def test_the_cache_is_thread_safe():
    cache = PromptEmbeddingCache(max_entries=4)
    texts = [f"p{i % 6}" for i in range(300)]

    def worker(offset):
        for t in texts[offset:] + texts[:offset]:
            cache.get(t, lambda: torch.zeros(1))

    threads = [threading.Thread(target=worker, args=(i * 7,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache) == 4 and cache.nbytes == 4 * 4
    assert cache.hits + cache.misses == 4 * len(texts)
