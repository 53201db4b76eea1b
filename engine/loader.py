"""``load_dit``: a weights file (or ``dummy:<preset>``) in, a ready model out.

The family, layout and configuration are inferred from tensor names and shapes; nothing is guessed from the
file name. Loading is strict: a file that does not fit the inferred architecture raises an error listing the
missing and unexpected keys.
"""

from __future__ import annotations

import logging
import math
import os

import torch
from torch import nn

from .errors import CheckpointError, InputError
from .models.registry import FAMILIES, all_presets, find_layout, known_layouts
from .models.sizes import preset_parameters
from .ops import Linear, is_fp8, store_linear_weights
from .preflight import LEDGER, check_fits
from .weights import (
    SAFETENSORS_DTYPES,
    SAFETENSORS_SUFFIXES,
    check_finite_weights,
    check_keys,
    check_weights_file,
    dummy_init_,
    materialize_,
    read_checkpoint,
    safetensors_header,
    strip_known_prefix,
    top_level_summary,
    weight_files,
)

log = logging.getLogger(__name__)

DUMMY_PREFIX = "dummy:"


def default_compute_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def resolve_device(device, input_name: str = "device") -> torch.device:
    """``None`` / ``"auto"`` (CUDA when available) or a device that exists in this process."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InputError(
            input_name, f"{device!r} is not a device; expected auto, cpu, cuda or cuda:N"
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "a CUDA build that sees no GPU"
            raise InputError(
                input_name,
                f"CUDA is not available: this torch {torch.__version__} is {build}; use cpu or auto",
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(
                input_name, f"{device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    elif dev.type not in ("cpu", "mps", "xpu", "meta"):
        raise InputError(input_name, f"{device!r}: expected auto, cpu, cuda or cuda:N")
    return dev


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _preflight_file(path: str, dtype: torch.dtype, dev: torch.device, input_name: str, hint: str) -> None:
    """A file is read whole into host memory, then converted to the compute dtype where it differs.

    For safetensors the header gives every tensor's dtype and size (nothing is read); other formats are
    memory-mapped and counted by their size, assumed to need no conversion (an estimate).
    """
    files = weight_files(path, input_name)
    size = sum(check_weights_file(f, input_name) for f in files)
    converted = sum(
        _safetensors_conversion_bytes(f, dtype) for f in files if f.lower().endswith(SAFETENSORS_SUFFIXES)
    )
    host = {"weights file": size, f"conversion to {str(dtype).replace('torch.', '')}": converted}
    check_fits(host, "cpu", input_name, hint=hint)
    if dev.type != "cpu":
        check_fits({"weights": converted or size}, dev, input_name, hint=hint)


def _safetensors_conversion_bytes(path: str, dtype: torch.dtype) -> int:
    from safetensors import SafetensorError

    try:
        header = safetensors_header(path)
    except (SafetensorError, OSError, ValueError):
        return 0  # unreadable: read_state_dict says why
    return sum(
        math.prod(shape) * _dtype_bytes(dtype)
        for stored, shape in header.values()
        if stored not in ("F8_E4M3", "F8_E5M2") and SAFETENSORS_DTYPES.get(stored) != dtype
    )


def load_dit(
    source: str | os.PathLike,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    weight_dtype: torch.dtype | None = None,
    seed: int = 0,
    input_name: str = "weights",
    memory_hint: str = "",
) -> nn.Module:
    """Build a diffusion transformer from a file or from ``"dummy:<preset>"``.

    ``dtype`` is the compute dtype (default: bf16 on CUDA, fp32 on CPU); every parameter is stored in it except
    the weight matrices of linear layers when ``weight_dtype`` says otherwise, or when the file stores them in
    fp8 and ``weight_dtype`` is None: fp8 weights stay fp8 and are upcast layer by layer at compute time.
    ``seed`` seeds dummy weights. A model that cannot fit the device is refused before anything is allocated;
    ``memory_hint`` is what the refusal suggests instead (the caller knows its own options' names).
    """
    dev = resolve_device(device)
    dtype = dtype or default_compute_dtype(dev)
    source = os.fspath(source)
    if source.startswith(DUMMY_PREFIX):
        return _load_dummy(
            source[len(DUMMY_PREFIX) :], dtype, dev, weight_dtype, seed, input_name, memory_hint
        )

    _preflight_file(
        source,
        dtype,
        dev,
        input_name,
        memory_hint or "Use a smaller model, a 16-bit compute dtype or a device with more memory",
    )
    sd = strip_known_prefix(read_checkpoint(source, input_name))
    check_finite_weights(sd, os.path.basename(source), input_name)
    family, layout = _known_layout(sd, source, input_name)
    sd = layout.to_official(sd)
    params = family.params_from_state_dict(sd, os.path.basename(source))
    with torch.device("meta"):
        model = family.model_class(params)
    check_keys(model, sd, os.path.basename(source), input_name)
    # fp8 tensors keep their storage; everything else is brought to the compute dtype.
    sd = {k: (v if is_fp8(v.dtype) else v.to(dtype)) for k, v in sd.items()}
    model.load_state_dict(sd, assign=True, strict=True)
    # which naming the file used, for describe() and the tests (dummy weights have none)
    model.checkpoint_layout = layout.name
    if weight_dtype is not None:
        store_linear_weights(model, weight_dtype)
    _upcast_fp8_outside_linear_weights(model, dtype)
    log.info("loaded %s as %s (%s layout) on %s", os.path.basename(source), family.name, layout.name, dev)
    return _held(model.to(dev).eval().requires_grad_(False))


def _known_layout(sd, source: str, input_name: str):
    """``(family, layout)`` of a state dict's key names, or the error listing what was found and what is known."""
    found = find_layout(set(sd))
    if found is None:
        raise CheckpointError(
            input_name,
            f"{os.path.basename(source)} is not a checkpoint layout this pack knows.\n"
            f"  top-level keys found: {top_level_summary(sd)}\n  known layouts: {known_layouts()}",
        )
    return found


def checkpoint_params(source: str | os.PathLike, input_name: str = "weights"):
    """``(family, params)`` of a weights file (or ``"dummy:<preset>"``) without loading its tensors: safetensors
    headers give every tensor's name and shape, which become meta tensors for the layout and params inference
    :func:`load_dit` runs (other formats are read, memory-mapped). What a caller that must size or prepare
    something for the model before loading it (a text encoder run first) needs."""
    source = os.fspath(source)
    if source.startswith(DUMMY_PREFIX):
        preset = source[len(DUMMY_PREFIX) :]
        presets = all_presets()
        if preset not in presets:
            raise InputError(input_name, f"unknown preset {preset!r}; known: {', '.join(presets)}")
        return presets[preset]
    files = weight_files(source, input_name)
    if all(f.lower().endswith(SAFETENSORS_SUFFIXES) for f in files):
        from safetensors import SafetensorError

        sd = {}
        for file in files:
            check_weights_file(file, input_name)
            try:
                sd.update(
                    {
                        key: torch.empty(shape, device="meta")
                        for key, (_, shape) in safetensors_header(file).items()
                    }
                )
            except (SafetensorError, OSError) as err:
                raise CheckpointError(
                    input_name, f"{os.path.basename(file)} is not a readable safetensors file: {err}"
                ) from None
    else:
        sd = read_checkpoint(source, input_name)
    sd = strip_known_prefix(sd)
    family, layout = _known_layout(sd, source, input_name)
    return family, family.params_from_state_dict(layout.to_official(sd), os.path.basename(source))


def _held(model: nn.Module) -> nn.Module:
    """Count the model's weights in the memory ledger while it is alive (what the preflight subtracts from
    ``FEWSTEP_MEMORY_LIMIT_GB``); dropping the last reference to the model releases them."""
    return LEDGER.hold_model(model)


def _upcast_fp8_outside_linear_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """Only linear weight matrices run from fp8; a stray fp8 bias or norm scale is upcast once at load."""
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if is_fp8(p.dtype) and not (isinstance(module, Linear) and name == "weight"):
                p.data = p.data.to(dtype)


def _load_dummy(preset: str, dtype, dev, weight_dtype, seed, input_name, memory_hint="") -> nn.Module:
    presets = all_presets()
    if preset not in presets:
        raise InputError(
            input_name, f"unknown preset 'dummy:{preset}'; known presets: {', '.join(sorted(presets))}"
        )
    family, params = presets[preset]
    # Every parameter is first allocated in the compute dtype (linear weights move to weight_dtype after the
    # seeded init), so that is the peak to check.
    count = preset_parameters(family.model_class, params)
    smallest = min(family.presets, key=lambda n: _width(family.presets[n]))
    dtype_name = str(dtype).replace("torch.", "")
    check_fits(
        {f"{dtype_name} weights": count.total * _dtype_bytes(dtype)},
        dev,
        input_name,
        hint=memory_hint
        or f"Use a smaller preset (dummy:{smallest}), a 16-bit compute dtype or a device with more memory",
    )
    with torch.device("meta"):
        model = family.model_class(params).to(dtype)  # on meta: allocate once, in the compute dtype
    materialize_(model, dev)
    dummy_init_(model, seed)
    if weight_dtype is not None:
        store_linear_weights(model, weight_dtype)
    return _held(model.eval().requires_grad_(False))


def _width(params) -> int:
    return getattr(params, "hidden_size", None) or params.dim


def preset_of(model: nn.Module) -> str | None:
    for name, (fam, params) in all_presets().items():
        if isinstance(model, fam.model_class) and model.params == params:
            return name
    return None


__all__ = ["load_dit", "preset_of", "FAMILIES", "DUMMY_PREFIX"]
