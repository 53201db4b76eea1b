"""The fewstep inference engine: self-contained, no ComfyUI import anywhere below this package.

Public API::

    from fewstep.engine import load_dit, open_model, sample_latent, TextCondition
    model = load_dit("flux1-schnell.safetensors")          # or "dummy:flux-tiny"
    handle = open_model("dummy:flux-tiny")                  # model + how to run it
    handle = apply_lora(handle, "my_lora.safetensors", 0.8)   # a LoRA, merged by the runs that use it
    latent, report = sample_latent(handle, [cond], torch.zeros(1, 16, 32, 32), steps=4)
"""

from .attention import BACKENDS as ATTENTION_BACKENDS
from .backends import DEFAULT_BACKENDS, Backends
from .conditioning import TextCondition
from .errors import CheckpointError, FewStepError, InputError
from .handle import ModelHandle, open_model
from .latent_formats import FLUX1, LatentFormat
from .loader import DUMMY_PREFIX, load_dit, preset_of
from .lora import apply_lora
from .models.registry import FAMILIES, all_presets
from .run import Run, RunOptions, open_run
from .text_to_image import SampleReport, SampleRequest, noise_for, sample, sample_latent
from .vae import TINY_VARIANTS, TinyVAE, load_tiny_vae

__all__ = [
    "ATTENTION_BACKENDS",
    "Backends",
    "DEFAULT_BACKENDS",
    "CheckpointError",
    "DUMMY_PREFIX",
    "FAMILIES",
    "FLUX1",
    "FewStepError",
    "InputError",
    "LatentFormat",
    "ModelHandle",
    "Run",
    "RunOptions",
    "SampleReport",
    "SampleRequest",
    "TINY_VARIANTS",
    "TinyVAE",
    "TextCondition",
    "all_presets",
    "apply_lora",
    "load_dit",
    "load_tiny_vae",
    "open_run",
    "noise_for",
    "open_model",
    "preset_of",
    "sample",
    "sample_latent",
]
