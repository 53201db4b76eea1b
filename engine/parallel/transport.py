"""Jobs and results through the pool's TCP store: tensors and plain values only, in parts the store accepts.

Payloads are ``torch.save`` bytes read back with ``weights_only=True``: dicts, lists, tuples, numbers, strings,
None and tensors, never arbitrary pickled objects, so a process that can reach the store still cannot make a
rank or the host run code by sending it data. The store rejects values over 8 MiB, so payloads travel in parts
of at most ``PART_BYTES``; the header (the part count) is written last, so a reader that sees it sees every part.
"""

from __future__ import annotations

import io
import time

import torch

PART_BYTES = 4 << 20


def dumps(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def loads(data: bytes):
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def put(store, key: str, value) -> int:
    """Write ``value`` under ``key``; returns its size in bytes."""
    data = dumps(value)
    parts = max(1, -(-len(data) // PART_BYTES))
    for i in range(parts):
        store.set(f"{key}/part{i}", data[i * PART_BYTES : (i + 1) * PART_BYTES])
    store.set(key, str(parts))
    return len(data)


def ready(store, key: str) -> bool:
    return store.check([key])


def get(store, key: str):
    parts = int(store.get(key).decode())
    return loads(b"".join(store.get(f"{key}/part{i}") for i in range(parts)))


def delete(store, key: str) -> None:
    if not store.check([key]):
        return
    parts = int(store.get(key).decode())
    store.delete_key(key)
    for i in range(parts):
        store.delete_key(f"{key}/part{i}")


def counter(store, key: str) -> int:
    return store.add(key, 0)


class Poll:
    """Sleep between store polls: short right after activity, longer (at most ``longest`` s) when idle."""

    def __init__(self, shortest: float = 0.001, longest: float = 0.02):
        self.shortest, self.longest = shortest, longest
        self.delay = shortest

    def wait(self) -> None:
        time.sleep(self.delay)
        self.delay = min(self.longest, self.delay * 2)

    def reset(self) -> None:
        self.delay = self.shortest
