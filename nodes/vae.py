"""Tiny-VAE nodes: load a TAESD / TAEHV autoencoder, decode LATENT -> IMAGE, encode IMAGE -> LATENT.

LATENT is ComfyUI's raw VAE latent (``[B, C, H, W]`` images, ``[B, C, T, H, W]`` video); IMAGE is
``[B, H, W, 3]`` in [0, 1] (video frames are stacked along the batch). The family's scale and shift are
applied on the way in and out, so these nodes interoperate with ComfyUI's own VAEDecode / VAEEncode. taef2 takes
and gives FLUX.2's 128-channel LATENT (its 32-channel latent 2x2-patchified, as ComfyUI's FLUX.2 VAE has it).
"""

from __future__ import annotations

import torch

from ..engine.errors import InputError
from ..engine.loader import DUMMY_PREFIX
from ..engine.vae import TINY_VARIANTS, TinyVAE, load_tiny_vae
from .base import CATEGORY, reports_input_errors
from .host import list_model_files, model_file_path, torch_device
from .inputs import register_object_type

FEWSTEP_TINY_VAE = "FEWSTEP_TINY_VAE"
register_object_type(FEWSTEP_TINY_VAE, TinyVAE, "a FEWSTEP_TINY_VAE from FewStepTinyVAELoader")
DTYPES = {"auto": None, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def images_to_nchw(images: torch.Tensor, input_name: str) -> torch.Tensor:
    if images.ndim != 4 or images.shape[-1] != 3:
        raise InputError(
            input_name, f"expected a ComfyUI IMAGE [batch, height, width, 3]; got {list(images.shape)}"
        )
    return images.permute(0, 3, 1, 2)


def nchw_to_images(x: torch.Tensor) -> torch.Tensor:
    return x.permute(0, 2, 3, 1).float().cpu().contiguous()


class FewStepTinyVAELoader:
    DESCRIPTION = (
        "Loads a tiny autoencoder from models/vae_approx (TAESD family: taesd, taesdxl, taesd3, taef1, "
        "taef2, taesana; TAEHV video: taew2_1, lighttaew2_1, taew2_2, taehv), or dummy:<variant>; .pth or "
        ".safetensors. The file name tells variants with the same tensors apart (taew2_1 / lighttaew2_1 / taehv: "
        "the names ComfyUI's VAELoader uses load as those). Given "
        "one half of a TAESD pair (taef1_decoder.pth), the other half next to it is loaded too; madebyollin's "
        "Hugging Face taef1 / taef2 files (diffusers layout) hold both halves."
    )
    CATEGORY = f"{CATEGORY}/vae"
    RETURN_TYPES = (FEWSTEP_TINY_VAE,)
    RETURN_NAMES = ("tiny_vae",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "vae_name": (
                    list_model_files("vae_approx") + [DUMMY_PREFIX + v for v in TINY_VARIANTS],
                    {
                        "tooltip": "A file in models/vae_approx (e.g. taef1.safetensors, taew2_1.safetensors, "
                        "taef1_decoder.pth), or "
                        "dummy:<variant> for random weights."
                    },
                ),
                "dtype": (
                    list(DTYPES),
                    {"default": "auto", "tooltip": "auto: fp16 on GPUs, fp32 on the CPU."},
                ),
            }
        }

    @reports_input_errors("FewStepTinyVAELoader", {"vae": "vae_name"}, file_lists=("vae_name",))
    def load(self, vae_name, dtype="auto"):
        source = (
            vae_name
            if vae_name.startswith(DUMMY_PREFIX)
            else model_file_path("vae_approx", vae_name, "vae_name")
        )
        device = torch_device()
        chosen = DTYPES[dtype] or (torch.float16 if device.type == "cuda" else torch.float32)
        return (load_tiny_vae(source, device=device, dtype=chosen, input_name="vae"),)


class FewStepTinyVAEDecode:
    DESCRIPTION = (
        "Decodes a LATENT with a tiny VAE: an image latent [B,C,H,W] or a video latent [B,C,T,H,W] "
        "(frames come out stacked along the batch); taef2 decodes FLUX.2's 128-channel LATENT. Milliseconds "
        "instead of seconds; lower detail."
    )
    CATEGORY = f"{CATEGORY}/vae"
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("image",)
    FUNCTION = "decode"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "tiny_vae": (FEWSTEP_TINY_VAE, {"tooltip": "From FewStepTinyVAELoader."}),
                "samples": (
                    "LATENT",
                    {"tooltip": "Latent in ComfyUI's raw VAE space (as samplers output it)."},
                ),
            }
        }

    @reports_input_errors("FewStepTinyVAEDecode", {"latent": "samples"})
    def decode(self, tiny_vae, samples):
        x = tiny_vae.decode_raw(samples["samples"], "latent")
        if x.ndim == 5:  # [B, T, 3, H, W] -> frames along the batch
            x = x.flatten(0, 1)
        return (nchw_to_images(x),)


class FewStepTinyVAEEncode:
    DESCRIPTION = (
        "Encodes IMAGE to LATENT (ComfyUI's raw VAE space) with a tiny VAE. With a video variant the "
        "images are the frames of one video (4 frames per latent frame; the last frame is repeated to "
        "fill a group)."
    )
    CATEGORY = f"{CATEGORY}/vae"
    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("latent",)
    FUNCTION = "encode"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "tiny_vae": (
                    FEWSTEP_TINY_VAE,
                    {"tooltip": "From FewStepTinyVAELoader (its encoder is needed)."},
                ),
                "pixels": (
                    "IMAGE",
                    {
                        "tooltip": "Images in [0, 1]; height and width divisible by 8 (32 for "
                        "taesana, 16 for taef2 and taew2_2)."
                    },
                ),
            }
        }

    @reports_input_errors("FewStepTinyVAEEncode", {"images": "pixels"})
    def encode(self, tiny_vae, pixels):
        x = images_to_nchw(pixels, "images")
        if tiny_vae.variant.kind == "video":
            x = x.unsqueeze(0)
        return ({"samples": tiny_vae.encode_raw(x).cpu()},)
