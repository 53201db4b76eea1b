"""Model families, their presets and the checkpoint layouts each one is recognised by.

A *family* is an architecture the engine implements: the image DiTs FLUX.1, FLUX.2 and Z-Image, and the video
DiT Wan 2.1. A *layout* is one way its weights are named in files found in the wild; every layout converts to
the family's official key names, which are the model's own attribute names.

Image families also carry an :class:`ImageSpec`: what the image sampler, the nodes, the planner and the speed
features need to know of them (latent geometry, conditioning widths, their default schedule), so none of that
code asks "is this FLUX?".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..latent_formats import FLUX1, FLUX2, WAN21, LatentFormat
from . import flux, flux2, flux2_checkpoint, flux_checkpoint, wan, wan_checkpoint, zimage, zimage_checkpoint

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Layout:
    name: str
    description: str
    matches: Callable[[set[str]], bool]
    to_official: Callable[[StateDict], StateDict] = field(default=lambda sd: sd)


@dataclass(frozen=True)
class ImageSpec:
    """How an image family meets the sampler and everything around it.

    ``token_patch``: LATENT pixels per image token along each side (FLUX.1 and Z-Image pack 2x2 patches; FLUX.2's
    LATENT is already patchified by its VAE, one token a latent pixel). ``context_dim`` / ``pooled_dim``: the
    conditioning widths of a model's params (``pooled_dim`` None: no pooled vector). ``text_encoder``: which
    ComfyUI text-encoder setup produces that conditioning, for error messages. ``guidance``: whether the params
    have a distilled-guidance embedding. ``schedule``: the default schedule preset of the family's few-step model;
    ``guided_schedule``: the preset of its guidance-distilled dev model (FLUX.1-dev, FLUX.2-dev), if any.
    ``drops_masked_tokens``: the reference pipeline feeds only the unmasked text tokens (Z-Image: Tongyi and
    diffusers pass ``prompt_embeds[i][mask[i]]``); otherwise padding tokens are attended to like any other.
    """

    token_patch: int
    context_dim: Callable[[object], int]
    pooled_dim: Callable[[object], int | None]
    text_encoder: Callable[[object], str]
    guidance: Callable[[object], bool]
    schedule: str
    description: str = ""  # the architecture in a few words, for messages
    guided_schedule: str | None = None
    drops_masked_tokens: bool = False

    def schedule_for(self, params) -> str:
        """The schedule a model of these params runs by default: the few-step preset, or for a guidance-distilled
        dev model (FLUX.1-dev, FLUX.2-dev, many-step models) its dev preset."""
        if self.guidance(params) and self.guided_schedule is not None:
            return self.guided_schedule
        return self.schedule

    def image_tokens(self, latent_h: int, latent_w: int) -> int:
        return (latent_h // self.token_patch) * (latent_w // self.token_patch)


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
    image: ImageSpec | None = None  # None: a video family (Wan), sampled by the causal video session

    @property
    def is_image(self) -> bool:
        return self.image is not None


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
        image=ImageSpec(
            token_patch=2,
            context_dim=lambda p: p.context_in_dim,
            pooled_dim=lambda p: p.vec_in_dim,
            text_encoder=lambda p: (
                "T5-XXL tokens and a pooled CLIP-L vector (DualCLIPLoader type flux, CLIPTextEncodeFlux)"
            ),
            guidance=lambda p: p.guidance_embed,
            schedule="flux.1-schnell",
            description="FLUX.1 (BFL MMDiT)",
            guided_schedule="flux.1-dev",
        ),
    ),
    "flux2": Family(
        name="flux2",
        model_class=flux2.Flux2,
        presets=flux2.PRESETS,
        layouts=(
            Layout(
                "flux2 (official)",
                "BFL flux2-*.safetensors / ComfyUI repacks: double_blocks.*, single_blocks.*, "
                "double_stream_modulation_img.*, single_stream_modulation.*",
                flux2_checkpoint.is_official,
            ),
            Layout(
                "flux2 (diffusers)",
                "diffusers Flux2Transformer2DModel: transformer_blocks.*, single_transformer_blocks.*, "
                "double_stream_modulation_img.*",
                flux2_checkpoint.is_diffusers,
                flux2_checkpoint.diffusers_to_official,
            ),
        ),
        params_from_state_dict=flux2_checkpoint.params_from_state_dict,
        latent_format=FLUX2,
        velocity=flux2.flux2_velocity,
        image=ImageSpec(
            token_patch=1,
            context_dim=lambda p: p.context_in_dim,
            pooled_dim=lambda p: None,
            text_encoder=flux2.text_encoder_for,
            guidance=lambda p: p.guidance_embed,
            schedule="flux.2-klein",
            description="FLUX.2 (BFL MMDiT, shared modulation)",
            guided_schedule="flux.2-dev",
        ),
    ),
    "zimage": Family(
        name="zimage",
        model_class=zimage.ZImage,
        presets=zimage.PRESETS,
        layouts=(
            Layout(
                "zimage (official)",
                "Tongyi-MAI Z-Image / diffusers ZImageTransformer2DModel: all_x_embedder.*, noise_refiner.*, "
                "context_refiner.*, layers.*",
                zimage_checkpoint.is_official,
            ),
            Layout(
                "zimage (ComfyUI)",
                "ComfyUI repack (Lumina-2 NextDiT names): x_embedder.*, cap_embedder.*, layers.N.attention.qkv.*",
                zimage_checkpoint.is_comfy,
                zimage_checkpoint.comfy_to_official,
            ),
        ),
        params_from_state_dict=zimage_checkpoint.params_from_state_dict,
        latent_format=FLUX1,
        velocity=zimage.zimage_velocity,
        image=ImageSpec(
            token_patch=2,
            context_dim=lambda p: p.cap_feat_dim,
            pooled_dim=lambda p: None,
            text_encoder=lambda p: (
                f"Qwen3-4B caption features, {p.cap_feat_dim} wide (CLIPLoader type lumina2 "
                "/ z_image with qwen_3_4b)"
            ),
            guidance=lambda p: False,
            schedule="z-image-turbo",
            description="Z-Image (Tongyi S3-DiT)",
            drops_masked_tokens=True,
        ),
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


def image_families() -> list[Family]:
    return [fam for fam in FAMILIES.values() if fam.is_image]


def find_layout(keys: set[str]) -> tuple[Family, Layout] | None:
    for fam in FAMILIES.values():
        for layout in fam.layouts:
            if layout.matches(keys):
                return fam, layout
    return None


def known_layouts() -> str:
    return "; ".join(f"{lay.name} ({lay.description})" for fam in FAMILIES.values() for lay in fam.layouts)
