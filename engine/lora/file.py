"""Reading a LoRA file for one model: ``read_lora(path, model, strength) -> LoraPatch``.

The file is read like a checkpoint (safetensors, or a PyTorch state dict with ``weights_only``), refused when a
tensor is not finite, converted to official names (``formats``) and checked against the model: every delta must
name one of its parameters with the shape that parameter (or its row slice) has, and up / down must agree on
the rank. Nothing is applied here.
"""

from __future__ import annotations

import logging
import math
import os

import torch
from torch import nn

from ..errors import CheckpointError
from ..models.registry import family_of
from ..preflight import check_fits
from ..weights import check_finite_weights, check_weights_file, read_state_dict
from .formats import convert, key_patterns
from .patch import LoraPatch, deltas_digest

log = logging.getLogger(__name__)


def read_lora(
    path: str | os.PathLike, model: nn.Module, strength: float = 1.0, input_name: str = "lora"
) -> LoraPatch:
    path = os.fspath(path)
    name = os.path.basename(path)
    strength = float(strength)
    if not torch.isfinite(torch.tensor(strength)):
        raise CheckpointError("strength", f"{strength} is not a finite number")
    _check_file_fits(path, input_name)
    sd = read_state_dict(path, input_name)
    bad = {k: type(v).__name__ for k, v in sd.items() if not isinstance(v, torch.Tensor)}
    if bad:
        raise CheckpointError(input_name, f"{name} holds entries that are not tensors: {key_patterns(bad)}")
    check_finite_weights(sd, name, input_name)
    family = family_of(model).name
    converted = convert(sd, model, family, name, input_name)
    _check_shapes(converted.deltas, model, family, name, input_name)
    if converted.text_encoder_keys:
        log.warning(
            "%s: %d text-encoder entries not applied (this node patches the diffusion model; apply the file to the "
            "text encoder with ComfyUI's LoraLoader): %s",
            name, len(converted.text_encoder_keys), key_patterns(converted.text_encoder_keys),
        )  # fmt: skip
    patch = LoraPatch(
        name=name,
        path=path,
        strength=strength,
        format=converted.format,
        family=family,
        deltas=tuple(converted.deltas),
        digest=deltas_digest(converted.deltas),
        text_encoder_keys=len(converted.text_encoder_keys),
    )
    log.info("read LoRA %s", patch.describe())
    return patch


def _check_shapes(deltas, model: nn.Module, family: str, source: str, input_name: str) -> None:
    params = dict(model.named_parameters())
    wrong = []
    for d in deltas:
        param = params[d.key]
        if d.is_low_rank:
            if d.up.shape[1] != d.down.shape[0]:
                raise CheckpointError(
                    input_name,
                    f"{source}: {d.source}: up {tuple(d.up.shape)} and down {tuple(d.down.shape)} disagree on the "
                    f"rank ({d.up.shape[1]} vs {d.down.shape[0]}): a corrupt or mis-converted LoRA",
                )
            if d.rank == 0:
                raise CheckpointError(input_name, f"{source}: {d.source} has rank 0")
        if d.rows is not None and d.rows[0] + d.rows[1] > param.shape[0]:
            wrong.append(f"{d.source} -> rows {d.rows} of {d.key} {tuple(param.shape)}")
            continue
        want = d.shape_on(param.shape)
        got = d.delta_shape()
        # a convolution delta may arrive flattened ([out, in*k*k]); anything else must match exactly
        if got != want and not (len(want) > 2 and got[0] == want[0] and math.prod(got) == math.prod(want)):
            wrong.append(f"{d.source} -> {d.key}: delta {got}, weight {want}")
    if wrong:
        shown = "; ".join(wrong[:6]) + (f"; ... {len(wrong) - 6} more" if len(wrong) > 6 else "")
        raise CheckpointError(
            input_name,
            f"{source} does not fit this {family} model ({len(wrong)} of {len(deltas)} deltas have the wrong shape: "
            f"a LoRA for another size or variant): {shown}",
        )


def _check_file_fits(path: str, input_name: str) -> None:
    """The file is read whole into host memory: refuse one that cannot fit before reading it."""
    size = check_weights_file(path, input_name)
    check_fits({"LoRA file": size}, "cpu", input_name, hint="Free host memory or use a smaller LoRA file")
