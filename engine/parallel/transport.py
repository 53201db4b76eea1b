"""Jobs and results through the pool's TCP store: tensors and plain values only, sealed with the pool's secret.

torch's TCPStore has no authentication: any process that reaches its port can list, read, write and delete keys.
So every payload (a job, a result, a video chunk, an error report, a rank's record) is sealed with
ChaCha20-Poly1305 (the ``cryptography`` package's AEAD) under a key derived (HKDF-SHA256) from the pool's secret
(``FEWSTEP_POOL_TOKEN``) and the pool's id. A message travels as parts of at most ``PART_BYTES`` (the store rejects
values over 8 MiB) and a header written last; each is sealed on its own, bound to the key name, and each part also
to the message's random id, its index and the part count, so parts cannot be moved, reordered or mixed between
messages. A reader authenticates the header before it reads any part (a planted header costs one small read),
refuses a message larger than the caller says the job can produce, authenticates each part as it is read, and
deletes a message that fails. A client without the secret reads only ciphertext, and a message it plants, or one it
copies under another key or into another pool, is refused (:class:`ForgedMessageError`). Counters and flags
(progress, heartbeats, cancel, shutdown) stay plain store values: a client on the machine can still disturb a job
or stop the pool, but not feed it data.

Payloads are ``torch.save`` bytes read back with ``weights_only=True``: dicts, lists, tuples, numbers, strings,
None and tensors, never arbitrary pickled objects.
"""

from __future__ import annotations

import base64
import binascii
import io
import secrets
import struct
import time

import torch
import torch.distributed as dist

from ..errors import FewStepError, InputError

PART_BYTES = 4 << 20
NONCE_BYTES = 12  # ChaCha20-Poly1305
TAG_BYTES = 16
MESSAGE_ID_BYTES = 16
_HEADER = struct.Struct(">16sIQ")  # message id, part count, plaintext bytes
HEADER_BYTES = NONCE_BYTES + _HEADER.size + TAG_BYTES
MAX_MESSAGE_BYTES = (
    4 << 30
)  # what any read accepts at most (a job's payload); results and chunks are capped lower
RECORD_BYTES = 1 << 20  # a rank's record, an error report, the pool's configuration
MAX_PARTS = -(-MAX_MESSAGE_BYTES // PART_BYTES)
TOKEN_ENV = "FEWSTEP_POOL_TOKEN"
POOL_ID_KEY = "pool_id"  # plain: a joining worker derives the pool's keys from its secret and this id


class ForgedMessageError(FewStepError):
    """A payload in the store was not written by this pool (no secret, another key, another pool)."""


def _aead_class(where: str | None = None):
    try:
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
    except ImportError:  # only pools need it: the rest of the pack loads without it
        raise InputError(
            "cryptography",
            "the worker pool seals its messages with the Python package 'cryptography' (>= 42), which this Python "
            "lacks; install the pack's requirements (pip install -r requirements.txt) into it",
            where,
        ) from None
    return ChaCha20Poly1305


def require_cipher(where: str | None = None) -> None:
    """Refuse a pool that could not seal its messages, before anything starts."""
    _aead_class(where)


def _derive(token: bytes, pool_id: str) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    info = b"fewstep pool seal\0" + pool_id.encode()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(token)


class SecureStore:
    """A store client and the key that seals this pool's payloads; the plain store calls pass through."""

    def __init__(self, store, token: bytes, pool_id: str):
        self.raw, self.pool_id = store, pool_id
        self._aead = _aead_class()(_derive(token, pool_id))

    def __repr__(self) -> str:  # never the key
        return f"SecureStore({self.pool_id})"

    def clone(self) -> SecureStore:
        """The same keys over a connection of its own."""
        twin = object.__new__(SecureStore)
        twin.raw, twin.pool_id, twin._aead = self.raw.clone(), self.pool_id, self._aead
        return twin

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

    def seal(self, key: str, data: bytes, context: bytes = b"value") -> bytes:
        """``data`` encrypted and authenticated, bound to ``key`` and ``context`` (what the bytes are)."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, data, _associated(key, context))

    def unseal(self, key: str, sealed: bytes, context: bytes = b"value") -> bytes:
        from cryptography.exceptions import InvalidTag

        if len(sealed) < NONCE_BYTES + TAG_BYTES:
            raise _forged(key, "too short to be sealed")
        try:
            return self._aead.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], _associated(key, context))
        except InvalidTag:
            raise _forged(key, "it does not authenticate with this pool's secret") from None


class RendezvousStore(dist.Store):
    """The store torch.distributed forms its process groups through (gloo's rank addresses, NCCL's unique id),
    with every value sealed like a payload: a rank address planted or changed by a client without the secret is a
    :class:`ForgedMessageError` in the rank that reads it, never a connection to the planter. Counters (``add``)
    stay plain, as the pool's own counters do. Keys live under ``prefix`` in the pool's store."""

    def __init__(self, store: SecureStore, prefix: str = "pg/"):
        super().__init__()
        self.secure, self.prefix = store, prefix

    def _key(self, key: str) -> str:
        return self.prefix + key

    def set(self, key: str, value) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.secure.set(self._key(key), self.secure.seal(self._key(key), data, b"rendezvous"))

    def get(self, key: str) -> bytes:
        return self.secure.unseal(self._key(key), self.secure.get(self._key(key)), b"rendezvous")

    def compare_set(self, key: str, expected, desired) -> bytes:
        expected = expected.encode() if isinstance(expected, str) else bytes(expected)
        desired = desired.encode() if isinstance(desired, str) else bytes(desired)
        name = self._key(key)
        if not self.secure.check([name]):
            current_sealed, current = b"", b""
        else:
            current_sealed = self.secure.get(name)
            current = self.secure.unseal(name, current_sealed, b"rendezvous")
        if current != expected:
            return current
        sealed = self.secure.seal(name, desired, b"rendezvous")
        now = self.secure.raw.compare_set(name, current_sealed, sealed)  # the value after the attempt
        return desired if now == sealed else self.secure.unseal(name, now, b"rendezvous")

    def add(self, key: str, amount: int) -> int:
        return self.secure.add(self._key(key), amount)

    def wait(self, keys: list[str], timeout=None) -> None:
        self.secure.wait([self._key(k) for k in keys], timeout)

    def check(self, keys: list[str]) -> bool:
        return self.secure.check([self._key(k) for k in keys])

    def delete_key(self, key: str) -> bool:
        return self.secure.delete_key(self._key(key))

    def num_keys(self) -> int:
        return self.secure.raw.num_keys()

    def set_timeout(self, timeout) -> None:
        self.secure.raw.set_timeout(timeout)

    def clone(self) -> RendezvousStore:
        """A store of its own connection (gloo clones the store for each process group it forms)."""
        return RendezvousStore(self.secure.clone(), self.prefix)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)


def _associated(key: str, context: bytes) -> bytes:
    return b"fewstep\0" + context + b"\0" + key.encode()


TOKEN_BYTES = 32  # a secret has at least 256 random bits
TOKEN_DISTINCT = 16  # 32 random bytes have ~30 distinct values; fewer than 16 is a pattern, not a secret
TOKEN_HINT = "e.g. the output of `python -c 'import secrets; print(secrets.token_hex(32))'`"


def check_token(text: str, where: str | None = None) -> bytes:
    """The secret in ``FEWSTEP_POOL_TOKEN`` as the bytes the keys are derived from, or an :class:`InputError`
    naming the rule it breaks: at least 32 bytes written as hex or URL-safe base64, of which at least 16 distinct
    values, and not one shorter block repeated (``"a" * 64`` has the length of a secret, not its entropy)."""
    text = text.strip()
    decoded = _decode_token(text)
    problem = None
    if decoded is None:
        problem = f"{len(text)} characters that are not hex or URL-safe base64"
    elif len(decoded) < TOKEN_BYTES:
        problem = f"{len(decoded)} bytes"
    elif len(set(decoded)) < TOKEN_DISTINCT:
        problem = (
            f"only {len(set(decoded))} distinct byte values in {len(decoded)} bytes (a pattern, not random)"
        )
    else:
        period = next(
            (p for p in range(1, len(decoded) // 2 + 1) if decoded == decoded[p:] + decoded[:p]), None
        )
        if period is not None:
            problem = f"a block of {period} bytes repeated (a pattern, not random)"
    if problem is not None:
        raise InputError(
            TOKEN_ENV,
            f"{problem}; expected at least {TOKEN_BYTES} random bytes written as hex ({2 * TOKEN_BYTES} "
            f"characters) or URL-safe base64 (43 characters), {TOKEN_HINT}",
            where,
        )
    return text.encode()


def _decode_token(text: str) -> bytes | None:
    if text and len(text) % 2 == 0 and all(c in "0123456789abcdefABCDEF" for c in text):
        return bytes.fromhex(text)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    body = text.rstrip("=")
    if not body or any(c not in alphabet for c in body) or len(body) % 4 == 1:
        return None
    try:
        return base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except (binascii.Error, ValueError):
        return None


def new_token() -> bytes:
    """A random secret (256 bits), as the text a worker finds in ``FEWSTEP_POOL_TOKEN``."""
    return secrets.token_hex(32).encode()


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
    """Seal ``value`` and write it under ``key`` (parts first, the header last); returns its size in bytes."""
    data = dumps(value)
    parts = max(1, -(-len(data) // PART_BYTES))
    message_id = secrets.token_bytes(MESSAGE_ID_BYTES)
    for i in range(parts):
        chunk = data[i * PART_BYTES : (i + 1) * PART_BYTES]
        store.set(f"{key}/part{i}", store.seal(key, chunk, _part_context(message_id, i, parts)))
    store.set(key, store.seal(key, _HEADER.pack(message_id, parts, len(data)), b"header"))
    return len(data)


def _part_context(message_id: bytes, index: int, parts: int) -> bytes:
    return b"part" + message_id + struct.pack(">II", index, parts)


def ready(store, key: str) -> bool:
    return store.check([key])


def get(store: SecureStore, key: str, limit: int = RECORD_BYTES):
    """The value under ``key``; :class:`ForgedMessageError` (and the message deleted) when the pool did not write
    it there, or it is larger than ``limit`` bytes (what the caller's job can produce)."""
    try:
        return loads(_read(store, key, limit))
    except ForgedMessageError:
        delete(store, key)
        raise


def _read(store: SecureStore, key: str, limit: int) -> bytes:
    header = store.get(key)
    if len(header) != HEADER_BYTES:
        raise _forged(key, f"a header of {len(header)} bytes")
    message_id, parts, size = _HEADER.unpack(store.unseal(key, header, b"header"))
    # authentic from here on: the sizes were written by a rank of this pool
    if size > limit:
        raise _forged(key, f"{size} bytes where this job produces at most {limit}")
    if parts != max(1, -(-size // PART_BYTES)):
        raise _forged(key, f"{parts} parts for {size} bytes")
    names = [f"{key}/part{i}" for i in range(parts)]
    # checked first: a store get waits for a missing key, so a part deleted by another client would hang
    if not store.check(names):
        raise _forged(key, f"its header claims {parts} parts that are not there")
    data = bytearray()
    for i, name in enumerate(names):
        sealed = store.get(name)  # at most one part (the store's own cap) read before it is authenticated
        if len(sealed) > PART_BYTES + NONCE_BYTES + TAG_BYTES:
            raise _forged(name, f"a part of {len(sealed)} bytes")
        data += store.unseal(key, sealed, _part_context(message_id, i, parts))
    if len(data) != size:
        raise _forged(key, f"{len(data)} bytes where its header says {size}")
    return bytes(data)


def message_limit(job: dict) -> int:
    """What a job's result (or each of its parts) can be at most: its tensors' bytes four times over (a sampled
    latent has the shape of the one sent; a report adds small tensors) plus ``RECORD_BYTES`` for everything else."""
    return RECORD_BYTES + 4 * _tensor_bytes(job)


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


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
