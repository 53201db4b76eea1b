"""Refuse work that cannot fit, before allocating it.

Every entry point that allocates something sized by user input (weights, activations, a KV window, decoded
frames) first adds up its estimate and calls :func:`check_fits`, which compares it with the memory free on the
device it will run on (host RAM on a CPU). A refusal is an :class:`InputError` naming the input that made the
work too big, the estimate by part and the limit, instead of an allocator traceback minutes later.

``FEWSTEP_MEMORY_LIMIT_GB`` caps what the whole pack may use (a shared server, or tests): the budget is the limit
less what the pack already holds (:mod:`.ledger`: loaded models, live video sessions, worker pools), and never more
than the device reports free. A refusal then lists what is held, so that a user knows what to free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..errors import InputError
from ..settings import MAX_MEMORY_GB, env_float
from ..units import format_bytes
from .ledger import LEDGER, Holding

# Keep a margin for what the estimate does not see (allocator fragmentation, the host's own working set).
USABLE_FRACTION = 0.9


def _meminfo(field: str) -> int | None:
    """A field of /proc/meminfo in bytes (None off Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _physical_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def _cgroup_limit() -> tuple[int, int] | None:
    """(limit, usage) of this process's cgroup memory controller, v2 or v1, when a limit is set."""
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_path) as f:
                raw = f.read().strip()
            if raw == "max" or int(raw) >= (1 << 60):
                return None
            with open(usage_path) as f:
                return int(raw), int(f.read().strip())
        except (OSError, ValueError):
            continue
    return None


def _host_available_bytes() -> int:
    """MemAvailable (the physical size off Linux), capped by what a cgroup memory limit leaves."""
    available = _meminfo("MemAvailable")
    available = _physical_bytes() if available is None else available
    cgroup = _cgroup_limit()
    return available if cgroup is None else min(available, max(0, cgroup[0] - cgroup[1]))


def _host_total_bytes() -> int:
    """MemTotal (the physical size off Linux), capped by a cgroup memory limit when set."""
    total = _meminfo("MemTotal")
    total = _physical_bytes() if total is None else total
    cgroup = _cgroup_limit()
    return total if cgroup is None else min(total, cgroup[0])


def _limit_bytes() -> int | None:
    limit_gb = env_float(
        "FEWSTEP_MEMORY_LIMIT_GB",
        None,
        minimum=0.0,
        maximum=MAX_MEMORY_GB,
        default_text="no limit but the device's",
    )
    return None if limit_gb is None else int(limit_gb * 2**30)


def device_free_bytes(device: torch.device | str | None = None) -> int:
    """What the device reports this process can still allocate (free GPU memory, or available host RAM).

    This already excludes what the pack holds (its models' weights and caches are allocated), so nothing is
    subtracted from it here."""
    device = torch.device(device or "cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return _host_available_bytes()


@dataclass(frozen=True)
class MemoryBudget:
    """What work may still allocate on one device, read once: the refusal of :func:`check_fits` states the very
    figures its decision used (the ledger measures worker pools live, so a second read could differ)."""

    device: torch.device
    free: int  # what the device reports this process can still allocate (device_free_bytes)
    limit: int | None  # FEWSTEP_MEMORY_LIMIT_GB in bytes (None: unset)
    holdings: tuple[Holding, ...]  # what the pack holds on the device (read only under the limit)

    @property
    def held(self) -> int:
        return sum(h.nbytes for h in self.holdings)

    @property
    def available(self) -> int:
        """The device's free memory and, under the limit, no more than the limit less what the pack holds."""
        if self.limit is None:
            return self.free
        # the device's free memory has the pack's holdings taken out already: the min subtracts them once
        return min(self.free, max(0, self.limit - self.held))

    @property
    def usable(self) -> int:
        """What one estimate may add up to (:data:`USABLE_FRACTION` of :attr:`available`)."""
        return int(self.available * USABLE_FRACTION)


def memory_budget(device: torch.device | str | None = None) -> MemoryBudget:
    """The device's :class:`MemoryBudget` now (the one place ``FEWSTEP_MEMORY_LIMIT_GB`` and the ledger meet)."""
    device = torch.device(device or "cpu")
    free = device_free_bytes(device)
    limit = _limit_bytes()
    holdings = tuple(LEDGER.holdings(device)) if limit is not None else ()
    return MemoryBudget(device, free, limit, holdings)


def available_bytes(device: torch.device | str | None = None) -> int:
    """Bytes this process can still allocate on ``device`` (:attr:`MemoryBudget.available`)."""
    return memory_budget(device).available


def check_fits(
    parts: dict[str, int],
    device: torch.device | str | None,
    input_name: str,
    where: str | None = None,
    hint: str = "",
) -> int:
    """Raise an :class:`InputError` on ``input_name`` when the sum of ``parts`` (bytes) does not fit ``device``.

    Returns the total. ``parts`` names what the bytes are for (``{"weights": ..., "kv window": ...}``); the
    message lists them, the total and the budget; ``hint`` says what to change (a smaller preset, fewer frames).
    """
    total = int(sum(parts.values()))
    budget = memory_budget(device)
    if total > budget.usable:
        detail = ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items() if v)
        dev = budget.device
        where_mem = "free GPU memory" if dev.type == "cuda" else "available host memory"
        held = ""
        if budget.holdings:
            held = (
                f". FEWSTEP_MEMORY_LIMIT_GB allows the pack {format_bytes(budget.limit)} in all and it already "
                f"holds {format_bytes(budget.held)} on {dev} ({', '.join(h.describe() for h in budget.holdings)})"
                ": free some of it (unload models, end video sessions) or raise the limit"
            )
        raise InputError(
            input_name,
            f"this needs about {format_bytes(total)} ({detail}) but only {format_bytes(budget.usable)} of "
            f"{where_mem} can be used on {dev}; refused before allocating"
            + (f". {hint}" if hint else "")
            + held,
            where,
        )
    return total


def total_bytes(device: torch.device | str | None = None) -> int:
    """The memory size of ``device`` (GPU memory, or host RAM), capped by ``FEWSTEP_MEMORY_LIMIT_GB``: a stable
    base for default budgets (what is free changes with every model loaded)."""
    device = torch.device(device or "cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = _host_total_bytes()
    limit = _limit_bytes()
    return total if limit is None else min(total, limit)
