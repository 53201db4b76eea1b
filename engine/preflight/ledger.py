"""What the pack holds now: the bytes of its loaded models, live video sessions and worker pools, by device.

The memory preflight (:mod:`.preflight`) reads it under ``FEWSTEP_MEMORY_LIMIT_GB``: the limit is for the whole
pack, so a job's budget is the limit less what the pack already holds (and never more than the device reports
free). Without the limit nothing is subtracted: the free memory the device reports (MemAvailable, or CUDA's free
memory) already excludes what the pack holds, and subtracting the ledger again would count it twice.

Entries are weak: a model, session or pool is counted while it is alive and dropped when it is garbage collected
(a ``weakref.finalize`` removes its entry), so dropping a handle frees its share of the budget. Each entry's bytes
are read when asked (a session's caches grow per prompt and are freed by ``dispose``; a model can move device).
"""

from __future__ import annotations

import itertools
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..units import format_bytes

SizeOf = Callable[[object, torch.device], int]  # (the owner, a device) -> bytes it holds there


def device_key(device: torch.device | str | None) -> torch.device:
    """``device`` with an explicit index for CUDA (``cuda`` and ``cuda:0`` are one device when 0 is current)."""
    device = torch.device(device or "cpu")
    if device.type == "cuda" and device.index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return torch.device("cuda", index)
    return device


def tensor_bytes_on(module: torch.nn.Module, device: torch.device) -> int:
    """Bytes of ``module``'s parameters and buffers stored on ``device`` (shared storages counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if device_key(tensor.device) != device:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


@dataclass(frozen=True)
class Holding:
    """What one kind of owner holds on a device: ``count`` owners, ``nbytes`` in all."""

    kind: str
    count: int
    nbytes: int

    def describe(self) -> str:
        return f"{self.count} {self.kind}{'s' if self.count != 1 else ''} {format_bytes(self.nbytes)}"


class MemoryLedger:
    """Bytes the pack holds, by kind (``model``, ``session``, ``worker pool``) and device. See the module doc."""

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, str, SizeOf]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def hold(self, owner: object, kind: str, size_of: SizeOf) -> None:
        """Count ``size_of(owner, device)`` bytes as held while ``owner`` is alive (once per owner)."""
        with self._lock:
            if any(ref() is owner for ref, _, _ in list(self._entries.values())):
                return
            key = next(self._ids)
            self._entries[key] = (weakref.ref(owner), kind, size_of)
        weakref.finalize(owner, self._drop, key)

    def hold_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Count a loaded model's weights (its parameters and buffers, on whichever device they are)."""
        self.hold(model, "model", tensor_bytes_on)
        return model

    def _drop(self, key: int) -> None:
        # no lock: a finalizer runs wherever the garbage collector does, possibly in this thread while it holds
        # the lock (a deadlock); one dict.pop is atomic, and readers iterate over a copy of the entries
        self._entries.pop(key, None)

    def holdings(self, device: torch.device | str | None = None) -> list[Holding]:
        """What is held on ``device`` by kind, in the order the kinds were first held (kinds holding 0 left out).
        On the CPU this includes the resident memory of the local ranks of this process's worker pools."""
        device = device_key(device)
        entries = list(self._entries.values())
        by_kind: dict[str, list[int]] = {}
        for ref, kind, size_of in entries:
            owner = ref()
            nbytes = 0 if owner is None else int(size_of(owner, device))
            if nbytes > 0:
                by_kind.setdefault(kind, []).append(nbytes)
        if device.type == "cpu":
            pools = worker_pool_bytes()
            if pools:
                by_kind.setdefault("worker pool", []).extend(pools)
        return [Holding(kind, len(sizes), sum(sizes)) for kind, sizes in by_kind.items()]

    def held_bytes(self, device: torch.device | str | None = None) -> int:
        return sum(h.nbytes for h in self.holdings(device))

    def describe(self, device: torch.device | str | None = None) -> str:
        """``"3 models 2.10 GiB, 1 session 200.00 MiB"`` ("" when nothing is held on ``device``)."""
        return ", ".join(h.describe() for h in self.holdings(device))


def process_resident_bytes(pid: int) -> int:
    """VmRSS of process ``pid`` from /proc (0 when it is gone or off Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def worker_pool_bytes() -> list[int]:
    """Resident bytes of each live worker pool of this process (the sum over its local ranks, measured).

    Read from the pool module's registry only when that module was imported: a process that never started a
    pool imports nothing of the parallel engine here."""
    pool_module = sys.modules.get(__name__.rsplit(".", 2)[0] + ".parallel.pool")
    if pool_module is None:
        return []
    sizes = []
    for pool in list(getattr(pool_module, "_LIVE", ())):
        if getattr(pool, "closed", True):
            continue
        nbytes = sum(process_resident_bytes(pid) for pid in pool.pids())
        if nbytes:
            sizes.append(nbytes)
    return sizes


def session_bytes_on(session, device: torch.device) -> int:
    """A video session's caches on ``device`` (0 once disposed)."""
    return session.nbytes if device_key(getattr(session, "device", "cpu")) == device else 0


# The pack's one ledger (a host process runs one pack: its loaders and sessions all record here).
LEDGER = MemoryLedger()

__all__ = ["LEDGER", "Holding", "MemoryLedger", "device_key", "process_resident_bytes", "tensor_bytes_on"]
