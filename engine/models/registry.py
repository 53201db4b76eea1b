"""Model families, their presets and the checkpoint layouts each one is recognised by.

A *family* is an architecture the engine implements (FLUX.1 today; Wan 2.1 joins with causal video). A
*layout* is one way its weights are named in files found in the wild; every layout converts to the family's
official key names, which are the model's own attribute names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..latent_formats import FLUX1, WAN21, LatentFormat
from . import flux, flux_checkpoint, wan, wan_checkpoint

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Layout:
    name: str
    description: str
    matches: Callable[[set[str]], bool]
    to_official: Callable[[StateDict], StateDict] = field(default=lambda sd: sd)


@dataclass(frozen=True)
class Family:
    name: str
    model_class: type
    presets: dict
    layouts: tuple[Layout, ...]
    params_from_state_dict: Callable
    latent_format: LatentFormat
    # velocity(model, x [B, C, H, W] in model latent space, sigma [B], cond) -> dx/dsigma
    velocity: Callable


FAMILIES: dict[str, Family] = {
    "flux": Family(
        name="flux",
        model_class=flux.Flux,
        presets=flux.PRESETS,
        layouts=(
            Layout(
                "flux (official)",
                "BFL flux1-*.safetensors: double_blocks.*, single_blocks.*, img_in.*",
                flux_checkpoint.is_official,
            ),
            Layout(
                "flux (diffusers)",
                "diffusers FluxTransformer2DModel: transformer_blocks.*, "
                "single_transformer_blocks.*, x_embedder.*",
                flux_checkpoint.is_diffusers,
                flux_checkpoint.diffusers_to_official,
            ),
        ),
        params_from_state_dict=flux_checkpoint.params_from_state_dict,
        latent_format=FLUX1,
        velocity=flux.flux_velocity,
    ),
    "wan": Family(
        name="wan",
        model_class=wan.Wan,
        presets=wan.PRESETS,
        layouts=(
            Layout(
                "wan (official)",
                "Wan2.1 / Self-Forcing / CausVid / ComfyUI repacks: blocks.*, "
                "patch_embedding.*, text_embedding.*",
                wan_checkpoint.is_official,
            ),
        ),
        params_from_state_dict=wan_checkpoint.params_from_state_dict,
        latent_format=WAN21,
        velocity=wan.wan_velocity,
    ),
}


def all_presets() -> dict[str, tuple[Family, object]]:
    return {name: (fam, params) for fam in FAMILIES.values() for name, params in fam.presets.items()}


def family_of(model) -> Family:
    for fam in FAMILIES.values():
        if isinstance(model, fam.model_class):
            return fam
    raise TypeError(f"{type(model).__name__} is not a model of a known family ({', '.join(FAMILIES)})")


def find_layout(keys: set[str]) -> tuple[Family, Layout] | None:
    for fam in FAMILIES.values():
        for layout in fam.layouts:
            if layout.matches(keys):
                return fam, layout
    return None


def known_layouts() -> str:
    return "; ".join(f"{lay.name} ({lay.description})" for fam in FAMILIES.values() for lay in fam.layouts)
