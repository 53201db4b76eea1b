"""Putting the engine's models under ComfyUI's memory manager.

ComfyUI frees or offloads the models it knows through ``ModelPatcher`` objects listed in
``comfy.model_management.current_loaded_models``. Our loaders wrap each engine model in a ModelPatcher and
load it with ``load_models_gpu`` before every run, so:

* when another model needs the GPU, ComfyUI offloads ours to its offload device (CPU);
* when the user (or an API client) asks ComfyUI to free memory (``POST /free {"unload_models": true}``, the
  Manager's "Unload models" button), ``unload_all_models`` moves ours off the GPU, and dropping the cached
  node outputs releases it entirely.

ModelPatcher keeps bookkeeping attributes on the module it manages; it manages a small host module that
holds the engine model, so nothing is written onto the engine model itself.
"""

from __future__ import annotations

from torch import nn

from .host import comfy_module, offload_device, torch_device


class ManagedDiT(nn.Module):
    """What ComfyUI's ModelPatcher sees: a container around the engine model."""

    def __init__(self, diffusion_model: nn.Module):
        super().__init__()
        self.diffusion_model = diffusion_model


def make_patcher(model: nn.Module):
    """A ComfyUI ModelPatcher for ``model``, or None outside ComfyUI."""
    mp = comfy_module("comfy.model_patcher")
    if mp is None:
        return None
    return mp.ModelPatcher(ManagedDiT(model), load_device=torch_device(), offload_device=offload_device())


def load_for_run(handle) -> None:
    """Ask ComfyUI to place the model on its compute device (evicting others if needed)."""
    mm = comfy_module("comfy.model_management")
    if mm is None or handle.host is None:
        return
    # Full load: engine layers have no partial-offload path, so ComfyUI must not leave some on the CPU.
    mm.load_models_gpu([handle.host], force_full_load=True)
