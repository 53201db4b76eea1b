"""FewStepDiTLoader: a diffusion transformer from ComfyUI's diffusion_models folder, or dummy weights."""

from __future__ import annotations

from ..engine.attention import BACKENDS
from ..engine.handle import open_model
from ..engine.loader import DUMMY_PREFIX
from ..engine.models.registry import all_presets
from ..engine.ops import COMPUTE_DTYPES, WEIGHT_DTYPES
from .base import CATEGORY, ReturnsModel, reports_input_errors
from .host import list_model_files, model_file_path, torch_device
from .model_management import make_patcher


def dummy_choices() -> list[str]:
    return [DUMMY_PREFIX + name for name in sorted(all_presets())]


class FewStepDiTLoader(ReturnsModel):
    DESCRIPTION = (
        "Loads a diffusion transformer for the FewStep samplers: FLUX.1 (official BFL or diffusers layout), "
        "FLUX.2 klein / dev (BFL, ComfyUI repack or diffusers layout), Z-Image (Tongyi / diffusers or ComfyUI repack) "
        "or Wan 2.1 (official, Self-Forcing / CausVid / ComfyUI repacks); safetensors (one file, or any shard of a "
        "sharded diffusers checkout: the other shards are read from the same folder) or .pt. The architecture is "
        "read from the tensors, never from the file name. 'dummy:<preset>' builds seeded random weights of that "
        "preset, for trying workflows without files."
    )
    CATEGORY = f"{CATEGORY}/loaders"
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model_name": (
                    list_model_files("diffusion_models") + dummy_choices(),
                    {
                        "tooltip": "A file in models/diffusion_models (flux1-schnell.safetensors, "
                        "flux-2-klein-4b.safetensors, z_image_turbo_bf16.safetensors, self_forcing_dmd.pt...), or "
                        "dummy:<preset> for random weights (flux2-tiny / zimage-tiny: the FLUX.2 / Z-Image "
                        "architecture at test size)."
                    },
                ),
                "weight_dtype": (
                    [k for k, v in WEIGHT_DTYPES.items() if k == "default" or v is not None],
                    {
                        "default": "default",
                        "tooltip": "How linear-layer weights are stored. default: fp8 files "
                        "stay fp8, others use the compute dtype. fp8 halves memory versus bf16; layers are upcast "
                        "one at a time when they run.",
                    },
                ),
                "compute_dtype": (
                    list(COMPUTE_DTYPES),
                    {
                        "default": "auto",
                        "tooltip": "Activation dtype. auto: bf16 on GPUs that support it, "
                        "fp16 on older GPUs, fp32 on the CPU.",
                    },
                ),
                "attention": (
                    list(BACKENDS),
                    {
                        "default": "auto",
                        "tooltip": "Attention backend. auto uses flash-attn when installed and "
                        "the GPU and dtype allow it, else PyTorch SDPA.",
                    },
                ),
            }
        }

    @reports_input_errors(
        "FewStepDiTLoader", {"weights": "model_name", "attention": "attention"}, file_lists=("model_name",)
    )
    def load(self, model_name, weight_dtype="default", compute_dtype="auto", attention="auto"):
        source = (
            model_name
            if model_name.startswith(DUMMY_PREFIX)
            else model_file_path("diffusion_models", model_name, "model_name")
        )
        device = torch_device()
        handle = open_model(
            source,
            weight_dtype=WEIGHT_DTYPES[weight_dtype],
            dtype=COMPUTE_DTYPES[compute_dtype],
            device=device,
            attention_backend=attention,
            input_name="weights",
        )
        patcher = make_patcher(handle.model)
        if patcher is not None:
            handle = handle.replace(host=patcher)
        return (handle,)
