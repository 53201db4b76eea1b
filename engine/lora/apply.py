"""``apply_lora``: the engine API behind ``FewStepLoraLoader`` and the CLI's ``--lora``.

On a :class:`~fewstep.engine.handle.ModelHandle` it returns a new handle that carries the patch (chained LoRAs
accumulate in order); the handle's model is shared and untouched until a run of the new handle merges the
patches into it (``merge.ensure_patches``, called by ``engine.run``), and a run of the original handle puts the
base weights back. Removing or changing a LoRA is a new handle: the base file is never read again.

On a bare ``nn.Module`` (no handle to carry patches) it returns a merged copy and leaves the module as it was.
"""

from __future__ import annotations

import copy
import math
import os

from torch import nn

from ..errors import CheckpointError
from ..handle import ModelHandle
from .file import read_lora
from .merge import ensure_patches
from .patch import LoraPatch


def apply_lora(
    model_or_handle, path: str | os.PathLike | LoraPatch, strength: float = 1.0, input_name: str = "lora"
):
    """``model_or_handle`` with the LoRA at ``path`` (or an already read :class:`LoraPatch`) at ``strength``."""
    if isinstance(model_or_handle, ModelHandle):
        handle = model_or_handle
        patch = _patch_for(handle.model, path, strength, input_name)
        return handle.replace(loras=handle.loras + (patch,))
    if isinstance(model_or_handle, nn.Module):
        patch = _patch_for(model_or_handle, path, strength, input_name)
        merged = copy.deepcopy(model_or_handle)
        ensure_patches(merged, (patch,), input_name)
        return merged
    raise TypeError(f"apply_lora takes a ModelHandle or an nn.Module, not {type(model_or_handle).__name__}")


def _patch_for(model: nn.Module, path, strength, input_name) -> LoraPatch:
    # read_lora checks it too, but a LoraPatch given here is not read again
    if not math.isfinite(float(strength)):
        raise CheckpointError("strength", f"{float(strength)} is not a finite number")
    if isinstance(path, LoraPatch):
        return path if float(strength) == path.strength else path.with_strength(strength)
    return read_lora(path, model, strength, input_name)
