"""The fewstep inference engine: self-contained, no ComfyUI import anywhere below this package.

Public API::

    from fewstep.engine import load_dit, open_model, sample_latent, TextCondition
    model = load_dit("flux1-schnell.safetensors")          # or "dummy:flux-tiny"
    handle = open_model("dummy:flux-tiny")                  # model + how to run it
    latent, report = sample_latent(handle, [cond], torch.zeros(1, 16, 32, 32), steps=4)
"""

from .attention import BACKENDS as ATTENTION_BACKENDS
from .attention import attention, use_attention_backend
from .conditioning import TextCondition
from .errors import CheckpointError, FewStepError, InputError
from .handle import ModelHandle, open_model
from .latent_formats import FLUX1, LatentFormat
from .loader import DUMMY_PREFIX, load_dit, preset_of
from .models.registry import FAMILIES, all_presets
from .text_to_image import SampleReport, SampleRequest, noise_for, sample, sample_latent
from .vae import TINY_VARIANTS, TinyVAE, load_tiny_vae

__all__ = [
    "ATTENTION_BACKENDS",
    "CheckpointError",
    "DUMMY_PREFIX",
    "FAMILIES",
    "FLUX1",
    "FewStepError",
    "InputError",
    "LatentFormat",
    "ModelHandle",
    "SampleReport",
    "SampleRequest",
    "TINY_VARIANTS",
    "TinyVAE",
    "TextCondition",
    "all_presets",
    "attention",
    "load_dit",
    "load_tiny_vae",
    "noise_for",
    "open_model",
    "preset_of",
    "sample",
    "sample_latent",
    "use_attention_backend",
]
