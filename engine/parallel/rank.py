"""What a rank reports about itself: its device and free memory, a failure as a store record, and the job
cancellation it raises.

Both the serving loop (``worker``) and the job handlers (``jobs``) write these, so they live apart from either:
``jobs`` imports this module, never ``worker``, and ``worker`` imports ``jobs`` for the loop it serves.
"""

from __future__ import annotations

import os
import socket
import traceback

import torch

from ..errors import InputError


class JobCancelledError(Exception):
    """The host asked to stop the current job (every rank stops at the same step)."""


def describe_device(device: torch.device) -> dict:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {"device": str(device), "name": torch.cuda.get_device_name(device), "free_bytes": free,
                "total_bytes": total}  # fmt: skip
    return {"device": "cpu", "name": "cpu", "free_bytes": available_memory(), "total_bytes": None}


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def error_record(err: BaseException, rank: int) -> dict:
    """A failure as the host reads it from ``error/<n>/<rank>`` or ``fatal/<rank>``."""
    record = {
        "rank": rank,
        "type": type(err).__name__,
        "message": str(err),
        "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__))[-4000:],
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }
    if isinstance(err, InputError):
        record.update(input_name=err.input_name, problem=err.problem)
    return record
