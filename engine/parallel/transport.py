"""Jobs and results through the pool's TCP store: tensors and plain values only, sealed with the pool's secret.

torch's TCPStore has no authentication: any process that reaches its port can list, read, write and delete keys.
So every payload (a job, a result, a video chunk, an error report, a rank's record) is sealed: encrypted with a
SHAKE-256 keystream and authenticated with HMAC-SHA256, both keyed from the pool's secret (``FEWSTEP_POOL_TOKEN``)
and the pool's id, over the key name as well as the bytes. A client without the secret reads only ciphertext,
and a message it plants, or one it copies under another key or into another pool, is refused
(:class:`ForgedMessageError`). Counters and flags (progress, heartbeats, cancel, shutdown) stay plain store
values: a client on the machine can still disturb a job or stop the pool, but not feed it data.

Payloads are ``torch.save`` bytes read back with ``weights_only=True``: dicts, lists, tuples, numbers, strings,
None and tensors, never arbitrary pickled objects. The store rejects values over 8 MiB, so payloads travel in parts
of at most ``PART_BYTES``; the header (the part count) is written last, so a reader that sees it sees every part.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import secrets
import time

import numpy as np
import torch

from ..errors import FewStepError

PART_BYTES = 4 << 20
MAX_PARTS = 1024  # 4 GiB: a header claiming more was not written by the pool
NONCE_BYTES = 16
TAG_BYTES = 32
TOKEN_ENV = "FEWSTEP_POOL_TOKEN"
POOL_ID_KEY = "pool_id"  # plain: a joining worker derives the pool's keys from its secret and this id


class ForgedMessageError(FewStepError):
    """A payload in the store was not written by this pool (no secret, another key, another pool)."""


class SecureStore:
    """A store client and the keys that seal this pool's payloads; the plain store calls pass through."""

    def __init__(self, store, token: bytes, pool_id: str):
        self.raw, self.pool_id = store, pool_id
        self._encrypt_key = _derive(token, b"encrypt", pool_id)
        self._mac_key = _derive(token, b"authenticate", pool_id)

    def __repr__(self) -> str:  # never the keys
        return f"SecureStore({self.pool_id})"

    @property
    def port(self) -> int:
        return self.raw.port

    def set(self, key: str, value) -> None:
        self.raw.set(key, value)

    def get(self, key: str) -> bytes:
        return self.raw.get(key)

    def check(self, keys: list[str]) -> bool:
        return self.raw.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self.raw.add(key, amount)

    def wait(self, keys: list[str], timeout=None) -> None:
        if timeout is None:
            self.raw.wait(keys)
        else:
            self.raw.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self.raw.delete_key(key)

    def list_keys(self) -> list[str]:
        return self.raw.list_keys()

    def seal(self, key: str, data: bytes) -> bytes:
        nonce = secrets.token_bytes(NONCE_BYTES)
        body = _xor(data, self._keystream(nonce, len(data)))
        return nonce + body + self._tag(key, nonce, body)

    def unseal(self, key: str, sealed: bytes) -> bytes:
        if len(sealed) < NONCE_BYTES + TAG_BYTES:
            raise _forged(key, "too short to be sealed")
        nonce, body, tag = sealed[:NONCE_BYTES], sealed[NONCE_BYTES:-TAG_BYTES], sealed[-TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(key, nonce, body)):
            raise _forged(key, "it does not authenticate with this pool's secret")
        return _xor(body, self._keystream(nonce, len(body)))

    def _keystream(self, nonce: bytes, size: int) -> bytes:
        return hashlib.shake_256(self._encrypt_key + nonce).digest(size) if size else b""

    def _tag(self, key: str, nonce: bytes, body: bytes) -> bytes:
        mac = hmac.new(self._mac_key, key.encode() + b"\0" + nonce, hashlib.sha256)
        mac.update(body)
        return mac.digest()


def new_token() -> bytes:
    """A random secret (256 bits), as the text a worker finds in ``FEWSTEP_POOL_TOKEN``."""
    return secrets.token_hex(32).encode()


def _derive(token: bytes, purpose: bytes, pool_id: str) -> bytes:
    return hmac.new(token, b"fewstep pool " + purpose + b"\0" + pool_id.encode(), hashlib.sha256).digest()


def _xor(data: bytes, stream: bytes) -> bytes:
    if not data:
        return b""
    return np.bitwise_xor(np.frombuffer(data, np.uint8), np.frombuffer(stream, np.uint8)).tobytes()


def _forged(key: str, why: str) -> ForgedMessageError:
    return ForgedMessageError(
        f"the message under {key!r} in the pool's store was not written by this pool ({why}); refused (a process "
        "that reaches the store without the pool's FEWSTEP_POOL_TOKEN wrote or changed it)"
    )


def dumps(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def loads(data: bytes):
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def put(store: SecureStore, key: str, value) -> int:
    """Seal ``value`` and write it under ``key``; returns its size in bytes."""
    data = store.seal(key, dumps(value))
    parts = max(1, -(-len(data) // PART_BYTES))
    for i in range(parts):
        store.set(f"{key}/part{i}", data[i * PART_BYTES : (i + 1) * PART_BYTES])
    store.set(key, str(parts))
    return len(data)


def ready(store, key: str) -> bool:
    return store.check([key])


def get(store: SecureStore, key: str):
    """The value under ``key``; :class:`ForgedMessageError` when the pool did not write it there."""
    header = store.get(key)
    try:
        parts = int(header.decode())
    except (UnicodeDecodeError, ValueError):
        raise _forged(key, f"a header of {len(header)} bytes that is not a part count") from None
    if not 1 <= parts <= MAX_PARTS:
        raise _forged(key, f"its header claims {parts} parts")
    names = [f"{key}/part{i}" for i in range(parts)]
    # checked first: a store get waits for a missing key, so a header claiming parts never written would hang
    if not store.check(names):
        raise _forged(key, f"its header claims {parts} parts that are not there")
    return loads(store.unseal(key, b"".join(store.get(name) for name in names)))


def delete(store, key: str) -> None:
    """Remove ``key`` and its parts. Never reads the header: a store get of a key another client just deleted
    would wait for the whole timeout."""
    store.delete_key(key)
    i = 0
    while i < MAX_PARTS and store.delete_key(f"{key}/part{i}"):
        i += 1


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
