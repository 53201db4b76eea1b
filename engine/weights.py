"""Reading weight files and seeded dummy weights.

Files: ``.safetensors`` and PyTorch ``.pt/.pth/.ckpt/.bin`` state dicts. PyTorch files are always read with
``weights_only=True``, so no pickled code runs. Containers found in the wild (``{"state_dict": ...}``,
``{"model": ...}``, ``{"module": ...}``) are unwrapped, and key prefixes of full checkpoints are stripped. A
sharded safetensors checkpoint (``...-00001-of-00003.safetensors`` or its ``.safetensors.index.json``) is read
as one state dict from all of its shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zlib
from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn

from .errors import CheckpointError, InputError

StateDict = dict[str, torch.Tensor]

SAFETENSORS_SUFFIXES = (".safetensors", ".sft")
TORCH_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")
# Wrappers around the real state dict, in the order they are tried.
CONTAINER_KEYS = ("state_dict", "model", "module", "generator_ema", "generator", "ema")
# Prefixes of full checkpoints (ComfyUI / SD-style single files); the diffusion model's keys sit under them.
KNOWN_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.")


# diffusers / transformers save large models in shards: ``<stem>-00001-of-00003.safetensors`` next to
# ``<stem>.safetensors.index.json`` (Tongyi-MAI/Z-Image-Turbo's transformer/ folder has three).
SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})(?P<suffix>\.safetensors)$")
INDEX_SUFFIX = ".safetensors.index.json"


def _plain_shard_name(name: str) -> bool:
    return (
        name.endswith(".safetensors")
        and name == os.path.basename(name)
        and "/" not in name
        and "\\" not in name
        and not name.startswith(".")
        and name.isprintable()
    )


def weight_files(path: str | os.PathLike, input_name: str = "weights") -> list[str]:
    """The files a checkpoint consists of: ``path`` itself, or every shard of a sharded checkpoint when
    ``path`` is one shard (``...-00001-of-00003.safetensors``) or the shards' ``.safetensors.index.json``.

    A missing shard is an error naming it: a partial download must not load as a truncated model."""
    path = os.fspath(path)
    folder, name = os.path.split(path)
    if name.endswith(INDEX_SUFFIX):
        check_weights_file(path, input_name)
        try:
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(
                input_name, f"{path} is not a shard index (a JSON object with a 'weight_map'): {_why(exc)}"
            ) from None
        # The index is read from a file a download (or a shared workflow's folder) supplies: its shard names
        # must be plain .safetensors file names beside it, never a path that leads out of the model folder.
        bad = [n for n in names if not isinstance(n, str) or not _plain_shard_name(n)]
        if bad:
            raise CheckpointError(
                input_name,
                f"{name} names shards that are not plain .safetensors file names in its folder: "
                f"{', '.join(repr(b) for b in bad[:5])}",
            )
    elif (m := SHARD_NAME.match(name)) is not None:
        count = int(m["count"])
        names = [f"{m['stem']}-{i:05d}-of-{count:05d}{m['suffix']}" for i in range(1, count + 1)]
    else:
        return [path]
    files = [os.path.join(folder, n) for n in names]
    missing = [n for n, f in zip(names, files) if not os.path.isfile(f)]
    if missing:
        raise InputError(
            input_name,
            f"{name} is one part of a sharded checkpoint of {len(files)} files; missing next to it: "
            f"{', '.join(missing)} (download every shard into the same folder)",
        )
    return files


def read_checkpoint(path: str | os.PathLike, input_name: str = "weights") -> StateDict:
    """:func:`read_state_dict` of every file of the checkpoint (see :func:`weight_files`), merged."""
    files = weight_files(path, input_name)
    if len(files) == 1:
        return read_state_dict(files[0], input_name)
    merged: StateDict = {}
    for file in files:
        part = read_state_dict(file, input_name)
        twice = sorted(set(part) & set(merged))
        if twice:
            raise CheckpointError(
                input_name,
                f"{os.path.basename(file)} repeats tensors of an earlier shard: {', '.join(twice[:5])}",
            )
        merged.update(part)
    return merged


# a safetensors header's dtype names, as torch dtypes (the float8 names are torch's float8 types)
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def safetensors_header(path: str | os.PathLike) -> dict[str, tuple[str, list[int]]]:
    """``{name: (stored dtype name, shape)}`` of a safetensors file, read from its header alone (no tensor data).
    Raises safetensors' ``SafetensorError`` or ``OSError`` for a file it cannot read."""
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="pt") as f:
        names = f.keys()  # a safe_open handle is not iterable
        return {key: (f.get_slice(key).get_dtype(), list(f.get_slice(key).get_shape())) for key in names}


def check_weights_file(path: str | os.PathLike, input_name: str = "weights") -> int:
    """The size in bytes of a weights file that exists and is not empty (else a clear error)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise InputError(input_name, f"{path} is a folder, not a weights file")
    if not os.path.isfile(path):
        raise InputError(input_name, f"weights file not found: {path}")
    size = os.path.getsize(path)
    if size == 0:
        raise InputError(input_name, f"{path} is empty (0 bytes): an interrupted download or copy?")
    return size


def _why(exc: BaseException) -> str:
    """An exception as one readable clause, even when its message is empty."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def read_state_dict(path: str | os.PathLike, input_name: str = "weights") -> StateDict:
    """Load every tensor of a weights file onto the CPU, exactly as stored (no dtype conversion)."""
    path = os.fspath(path)
    check_weights_file(path, input_name)
    lower = path.lower()
    if lower.endswith(SAFETENSORS_SUFFIXES):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path, device="cpu")
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(
                input_name, f"{path} is not a readable safetensors file ({_why(exc)})"
            ) from exc
    if lower.endswith(TORCH_SUFFIXES):
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            # mmap needs the zip format; old-style files load without it.
            obj = _torch_load_plain(path, input_name)
        except Exception as exc:  # noqa: BLE001 - the unpickler raises many types
            raise CheckpointError(
                input_name,
                f"{path} is not a plain PyTorch state dict (weights_only loading refused it: {_why(exc)})",
            ) from exc
        return _unwrap(obj, path, input_name)
    raise InputError(
        input_name,
        f"unsupported weights file type {os.path.splitext(path)[1]!r}; "
        f"expected one of {', '.join(SAFETENSORS_SUFFIXES + TORCH_SUFFIXES)}",
    )


def _torch_load_plain(path: str, input_name: str):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(
            input_name,
            f"{path} is not a plain PyTorch state dict (weights_only loading refused it: {_why(exc)})",
        ) from exc


def _is_tensor_dict(obj) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def _unwrap(obj, path: str, input_name: str) -> StateDict:
    for _ in range(3):
        if _is_tensor_dict(obj):
            return obj
        if not isinstance(obj, dict):
            break
        inner = next((obj[k] for k in CONTAINER_KEYS if isinstance(obj.get(k), dict)), None)
        if inner is None:
            break
        obj = inner
    what = type(obj).__name__
    if isinstance(obj, dict):
        what = f"a dict whose entries are {sorted({type(v).__name__ for v in obj.values()})}"
    raise CheckpointError(input_name, f"{path} does not hold a state dict of tensors (found {what})")


def strip_known_prefix(sd: StateDict) -> StateDict:
    """Keep the diffusion model's keys of a full checkpoint and drop its prefix.

    ``model.diffusion_model.`` selects the diffusion model inside a full checkpoint (which also holds the VAE
    and text encoders); ``diffusion_model.`` and ``model.`` are stripped when every key carries them.
    """
    full = "model.diffusion_model."
    if any(k.startswith(full) for k in sd):
        return {k[len(full) :]: v for k, v in sd.items() if k.startswith(full)}
    for prefix in KNOWN_PREFIXES[1:]:
        if all(k.startswith(prefix) for k in sd):
            return {k[len(prefix) :]: v for k, v in sd.items()}
    return sd


def top_level_summary(keys: Iterable[str], limit: int = 12) -> str:
    counts = Counter(k.split(".", 1)[0] for k in keys)
    parts = [f"{name} ({n})" for name, n in counts.most_common(limit)]
    if len(counts) > limit:
        parts.append(f"... {len(counts) - limit} more")
    return ", ".join(parts)


def check_keys(model: nn.Module, sd: StateDict, source: str, input_name: str = "weights") -> None:
    """Raise a :class:`CheckpointError` listing missing and unexpected keys (never load non-strictly)."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    wrong_shape = sorted(
        f"{k} {tuple(sd[k].shape)} (model expects {tuple(expected[k].shape)})"
        for k in set(expected) & set(sd)
        if tuple(sd[k].shape) != tuple(expected[k].shape)
    )
    if not (missing or unexpected or wrong_shape):
        return
    lines = [f"{source} does not match the {type(model).__name__} architecture inferred from it:"]
    for label, items in (
        ("missing keys", missing),
        ("unexpected keys", unexpected),
        ("wrong shapes", wrong_shape),
    ):
        if items:
            shown = ", ".join(items[:20]) + (f", ... ({len(items) - 20} more)" if len(items) > 20 else "")
            lines.append(f"  {len(items)} {label}: {shown}")
    raise CheckpointError(input_name, "\n".join(lines))


def check_finite_weights(sd: StateDict, source: str, input_name: str = "weights") -> None:
    """Refuse a file whose tensors hold NaN / Inf: the model would only ever produce NaN images from it."""
    bad = []
    for key, t in sd.items():
        if not t.is_floating_point():
            continue
        if t.element_size() == 1:  # isfinite has no fp8 kernel; every fp8 value is exact in float16
            t = t.to(torch.float16)
        if not bool(torch.isfinite(t).all()):
            bad.append(key)
    if bad:
        shown = ", ".join(bad[:5]) + (f", ... ({len(bad) - 5} more)" if len(bad) > 5 else "")
        raise CheckpointError(
            input_name,
            f"{source}: {shown} {'hold' if len(bad) > 1 else 'holds'} NaN or infinite values; "
            "the file is corrupt or was saved after a diverged training step",
        )


def _param_seed(seed: int, name: str) -> int:
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63)


def materialize_(model: nn.Module, dev: torch.device) -> None:
    """Give a model built on the meta device uninitialised storage on ``dev``, in place (``to_empty``'s effect).
    ``to_empty`` goes through ``empty_like`` from the meta device, whose Python decomposition imports sympy (~0.3 s
    of a cold start); ``torch.empty`` with the shape and dtype does not."""
    empty = {
        name: torch.empty(t.shape, dtype=t.dtype, device=dev)
        for name, t in model.state_dict(keep_vars=True).items()
    }
    model.load_state_dict(empty, assign=True, strict=True)
    stray = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if stray:  # a non-persistent buffer is not in the state dict: a model must not keep one built on meta
        raise RuntimeError(f"{type(model).__name__}: tensors left on the meta device: {', '.join(stray)}")


@torch.no_grad()
def dummy_init_(model: nn.Module, seed: int = 0) -> None:
    """Seeded random weights, like vLLM's ``dummy`` load format, reproducible per parameter name.

    Matrices and convolution kernels get ``N(0, 1/fan_in)`` (activations keep their scale through the
    network), 1-D norm scales and weights ``1 + N(0, 0.1^2)`` and biases ``N(0, 0.02^2)``. Each parameter's generator is seeded from ``seed`` and its
    name, so a parameter's values do not depend on which other parameters exist. Numbers are drawn on the
    parameter's device: the same seed gives the same weights on every CPU, and on every GPU of one kind.
    """
    for name, param in model.named_parameters():
        gen = torch.Generator(device=param.device).manual_seed(_param_seed(seed, name))
        values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
        if param.ndim >= 2:
            fan_in = param[0].numel()
            values.normal_(0.0, fan_in**-0.5, generator=gen)
        elif name.endswith(("scale", "weight")):
            values.normal_(0.0, 0.1, generator=gen).add_(1.0)
        else:
            values.normal_(0.0, 0.02, generator=gen)
        param.copy_(values)


DIGEST_SAMPLES = 4096  # values read per tensor by model_digest


@torch.no_grad()
def model_digest(model: nn.Module, samples: int = DIGEST_SAMPLES) -> str:
    """A fingerprint of ``model``'s weights (hex sha256), cheap for a large model: it covers every tensor of its
    state dict (parameters and persistent buffers) by name, shape and dtype, and up to ``samples`` of its values,
    evenly spaced over the flattened tensor (first and last included; every value of a smaller tensor), hashed
    as their stored bytes. The samples are gathered where the weights live and copied to the CPU together.

    What it does not cover: two models that differ only in values that are not sampled share a digest (a LoRA
    changes whole matrices, so its merge changes the digest; a fine-tune of a few values might not). It is
    computed anew on every call, never cached: a LoRA merge writes through ``.data``, which bumps no version
    counter a cache could key on."""
    digest = hashlib.sha256()
    picked = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        tensor = tensor.detach()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}\n".encode())
        flat = tensor.reshape(-1)
        if flat.numel() > samples:
            index = torch.arange(samples, device=flat.device) * (flat.numel() - 1) // (samples - 1)
            flat = flat.index_select(0, index)
        picked.append(
            flat.contiguous().view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
        )
    if picked:
        if len({p.device for p in picked}) == 1:  # the usual case: one copy to the host
            values = torch.cat(picked).cpu()
        else:  # weights split over devices (offloaded): in state-dict order all the same
            values = torch.cat([p.cpu() for p in picked])
        digest.update(values.numpy().tobytes())
    return digest.hexdigest()
