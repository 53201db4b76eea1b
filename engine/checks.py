"""Checks of user-given tensors and numbers shared by the entry points (sampling, VAE, stream batch).

Each check costs one reduction on the happy path; the details of a failure (how many values, where the first
one is) are only computed once it has failed.
"""

from __future__ import annotations

import math

import torch

from .errors import InputError

SEED_MAX = 2**64 - 1  # ComfyUI's seed widgets and torch.Generator.manual_seed take the unsigned 64-bit range


def check_finite(tensor: torch.Tensor, input_name: str, what: str) -> None:
    """Refuse NaN / Inf in ``tensor`` (``what`` names it in the message, e.g. "the latent")."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    bad = ~torch.isfinite(tensor)
    if not bool(bad.any()):
        return
    first = [int(i) for i in bad.nonzero()[0]]
    raise InputError(
        input_name,
        f"{what}: {int(bad.sum())} of {tensor.numel()} values are NaN or infinite (the first at index {first})",
    )


def check_image_size(
    height: int | None, width: int | None, multiple: int, why: str, where: str | None = None
) -> None:
    """Each of ``height`` / ``width`` (pixels; None: not given) a positive multiple of ``multiple``; ``why`` says
    where the multiple comes from. The one wording of this check, for the engine, the planner and the CLI."""
    for input_name, v in (("height", height), ("width", width)):
        if v is not None and (v <= 0 or v % multiple):
            raise InputError(input_name, f"{v} px is not a positive multiple of {multiple} ({why})", where)


def check_finite_number(value: float, input_name: str) -> None:
    if not math.isfinite(float(value)):
        raise InputError(input_name, f"expected a finite number, got {value}")


def check_seed(seed, input_name: str = "seed") -> int:
    """A seed as torch's generators take it: an integer in [0, 2^64 - 1]."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise InputError(input_name, f"expected an integer in [0, 2^64 - 1], got {seed!r}")
    return seed
