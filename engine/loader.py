"""``load_dit``: a weights file (or ``dummy:<preset>``) in, a ready model out.

The family, layout and configuration are inferred from tensor names and shapes; nothing is guessed from the
file name. Loading is strict: a file that does not fit the inferred architecture raises an error listing the
missing and unexpected keys.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from .errors import CheckpointError, InputError
from .models.registry import FAMILIES, all_presets, find_layout, known_layouts
from .ops import Linear, is_fp8, store_linear_weights
from .weights import check_keys, dummy_init_, read_state_dict, strip_known_prefix, top_level_summary

log = logging.getLogger(__name__)

DUMMY_PREFIX = "dummy:"


def default_compute_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def resolve_device(device) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_dit(
    source: str | os.PathLike,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    weight_dtype: torch.dtype | None = None,
    seed: int = 0,
    input_name: str = "weights",
) -> nn.Module:
    """Build a diffusion transformer from a file or from ``"dummy:<preset>"``.

    ``dtype`` is the compute dtype (default: bf16 on CUDA, fp32 on CPU); every parameter is stored in it except
    the weight matrices of linear layers when ``weight_dtype`` says otherwise, or when the file stores them in
    fp8 and ``weight_dtype`` is None: fp8 weights stay fp8 and are upcast layer by layer at compute time.
    ``seed`` seeds dummy weights.
    """
    dev = resolve_device(device)
    dtype = dtype or default_compute_dtype(dev)
    source = os.fspath(source)
    if source.startswith(DUMMY_PREFIX):
        return _load_dummy(source[len(DUMMY_PREFIX) :], dtype, dev, weight_dtype, seed, input_name)

    sd = strip_known_prefix(read_state_dict(source, input_name))
    found = find_layout(set(sd))
    if found is None:
        raise CheckpointError(
            input_name,
            f"{os.path.basename(source)} is not a checkpoint layout this pack knows.\n"
            f"  top-level keys found: {top_level_summary(sd)}\n  known layouts: {known_layouts()}",
        )
    family, layout = found
    sd = layout.to_official(sd)
    params = family.params_from_state_dict(sd, os.path.basename(source))
    with torch.device("meta"):
        model = family.model_class(params)
    check_keys(model, sd, os.path.basename(source), input_name)
    # fp8 tensors keep their storage; everything else is brought to the compute dtype.
    sd = {k: (v if is_fp8(v.dtype) else v.to(dtype)) for k, v in sd.items()}
    model.load_state_dict(sd, assign=True, strict=True)
    if weight_dtype is not None:
        store_linear_weights(model, weight_dtype)
    _upcast_fp8_outside_linear_weights(model, dtype)
    log.info("loaded %s as %s (%s layout) on %s", os.path.basename(source), family.name, layout.name, dev)
    return model.to(dev).eval().requires_grad_(False)


def _upcast_fp8_outside_linear_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """Only linear weight matrices run from fp8; a stray fp8 bias or norm scale is upcast once at load."""
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if is_fp8(p.dtype) and not (isinstance(module, Linear) and name == "weight"):
                p.data = p.data.to(dtype)


def _load_dummy(preset: str, dtype, dev, weight_dtype, seed, input_name) -> nn.Module:
    presets = all_presets()
    if preset not in presets:
        raise InputError(
            input_name, f"unknown preset 'dummy:{preset}'; known presets: {', '.join(sorted(presets))}"
        )
    family, params = presets[preset]
    with torch.device("meta"):
        model = family.model_class(params)
    model = model.to_empty(device=dev).to(dtype)
    dummy_init_(model, seed)
    if weight_dtype is not None:
        store_linear_weights(model, weight_dtype)
    return model.eval().requires_grad_(False)


def preset_of(model: nn.Module) -> str | None:
    for name, (fam, params) in all_presets().items():
        if isinstance(model, fam.model_class) and model.params == params:
            return name
    return None


__all__ = ["load_dit", "preset_of", "FAMILIES", "DUMMY_PREFIX"]
