"""Seeded random LoRA files for a model: what the loader's ``dummy:`` choices and the tests read back.

The file is written in ComfyUI's own naming (``diffusion_model.<module>.lora_down.weight`` / ``lora_up.weight`` /
``alpha``) with one low-rank pair on every linear layer of the model, so reading it goes through the same
``read_lora`` path (format detection, name resolution, shape checks) as a downloaded LoRA.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

import torch
from safetensors.torch import save_file
from torch import nn

from ..errors import InputError


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(official module name, layer) of every linear layer, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and name]


def model_fingerprint(model: nn.Module) -> str:
    """A short digest of the linear layers' names and shapes: two models share a dummy file only when it fits both."""
    text = ";".join(f"{n}:{m.out_features}x{m.in_features}" for n, m in linear_layers(model))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def dummy_lora_tensors(
    model: nn.Module, rank: int = 8, seed: int = 0, scale: float = 0.01
) -> dict[str, torch.Tensor]:
    """The file's tensors; ``scale`` is the typical size of one entry of ``up @ down`` (at alpha = rank)."""
    if rank < 1:
        raise InputError("rank", f"expected a rank of at least 1, got {rank}")
    gen = torch.Generator().manual_seed(int(seed))
    tensors: dict[str, torch.Tensor] = {}
    for name, layer in linear_layers(model):
        r = min(rank, layer.in_features, layer.out_features)
        # down ~ N(0, 1/in), up ~ N(0, scale^2 in / r): an entry of up @ down has variance
        # r * (scale^2 in / r) * (1 / in) = scale^2 whatever the layer's width (alpha = r: no extra factor)
        down = torch.randn(r, layer.in_features, generator=gen) / layer.in_features**0.5
        up = torch.randn(layer.out_features, r, generator=gen) * (scale * layer.in_features**0.5 / r**0.5)
        key = f"diffusion_model.{name}"
        tensors[f"{key}.lora_down.weight"] = down.contiguous()
        tensors[f"{key}.lora_up.weight"] = up.contiguous()
        tensors[f"{key}.alpha"] = torch.tensor(float(r))
    if not tensors:
        raise InputError("model", f"{type(model).__name__} has no linear layers to put a LoRA on")
    return tensors


def write_dummy_lora(
    model: nn.Module, path: str | os.PathLike, rank: int = 8, seed: int = 0, scale: float = 0.01
) -> str:
    """Write the seeded random LoRA for ``model`` to ``path`` (atomically: a concurrent reader never sees half a
    file) and return the path. The same model, rank, seed and scale always give the same bytes."""
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    tensors = dummy_lora_tensors(model, rank, seed, scale)
    meta = {
        "fewstep_dummy": f"rank={rank} seed={seed} scale={scale}",
        "fewstep_model": model_fingerprint(model),
    }
    fd, tmp = tempfile.mkstemp(prefix=".dummy_lora_", suffix=".safetensors", dir=folder)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def dummy_lora_name(model: nn.Module, rank: int, seed: int) -> str:
    """The file name a dummy LoRA of this model gets (one file per model shape, rank and seed)."""
    return f"dummy_lora_{model_fingerprint(model)}_rank{rank}_seed{seed}.safetensors"
