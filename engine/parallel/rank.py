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
from ..preflight.budget import device_free_bytes


class JobCancelledError(Exception):
    """The host asked to stop the current job (every rank stops at the same step)."""


def describe_device(device: torch.device) -> dict:
    """The rank's device as its start-up record states it; ``free_bytes`` is the memory preflight's figure for it
    (what this process can still allocate there), the one its job-time checks use."""
    if device.type == "cuda":
        _free, total = torch.cuda.mem_get_info(device)
        return {"device": str(device), "name": torch.cuda.get_device_name(device),
                "free_bytes": device_free_bytes(device), "total_bytes": total}  # fmt: skip
    return {"device": "cpu", "name": "cpu", "free_bytes": device_free_bytes(device), "total_bytes": None}


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
