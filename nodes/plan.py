"""FewStepCostPlan: the bill of a job (FLOPs, forwards, KV and weight bytes, predicted seconds) before it runs."""

from __future__ import annotations

import json
import logging

from ..engine.ops import weight_bytes
from ..engine.plan import DEFAULT_MFU, GPUS, KV_LAYOUTS, WEIGHT_DTYPE_BYTES, plan_cost
from .base import ALL_FAMILIES, CATEGORY, model_input, reports_input_errors

NODE = "FewStepCostPlan"
log = logging.getLogger(__name__)


class FewStepCostPlan:
    DESCRIPTION = (
        "Prints the cost of a job on the connected model before you queue it: FLOPs per DiT forward and in all "
        "(steps x CFG rows; for causal video, chunks x (steps + clean pass) with attention growing until the KV "
        "window fills), VAE decode FLOPs, weight bytes by dtype, KV-cache bytes per token / chunk / window "
        "(bf16, int8, int4) and predicted seconds on a GPU preset at the given MFU. Nothing is run."
    )
    CATEGORY = f"{CATEGORY}/utils"
    RETURN_TYPES = ("STRING", "STRING")
    RETURN_NAMES = ("bill", "json")
    FUNCTION = "plan"
    OUTPUT_NODE = True  # runs when queued on its own; the bill is also logged to the console

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": model_input(ALL_FAMILIES),
                "width": (
                    "INT",
                    {"default": 0, "min": 0, "max": 8192, "step": 16,
                     "tooltip": "Width in px; 0: the family's default (1024 images, 832 Wan)."},
                ),
                "height": (
                    "INT",
                    {"default": 0, "min": 0, "max": 8192, "step": 16,
                     "tooltip": "Height in px; 0: the family's default (1024 images, 480 Wan)."},
                ),
                "steps": (
                    "INT",
                    {"default": 0, "min": 0, "max": 200,
                     "tooltip": "Denoising steps; 0: the family's default schedule preset (4 schnell, klein and Wan "
                                "students, 8 Z-Image-Turbo, 28 FLUX.1-dev, 50 FLUX.2-dev)."},
                ),
                "cfg": (
                    "FLOAT",
                    {"default": 1.0, "min": 0.0, "max": 30.0, "step": 0.1,
                     "tooltip": "CFG scale; != 1 assumes a negative prompt: 2 rows per step (image models only)."},
                ),
                "batch": ("INT", {"default": 1, "min": 1, "max": 64, "tooltip": "Images or videos per job."}),
                "gpu": (
                    list(GPUS),
                    {"default": "h100", "tooltip": "GPU preset: its dense bf16 tensor-core peak and memory."},
                ),
                "mfu": (
                    "FLOAT",
                    {"default": DEFAULT_MFU, "min": 0.01, "max": 1.0, "step": 0.01,
                     "tooltip": "Model FLOP utilisation assumed: seconds = FLOPs / (peak x mfu)."},
                ),
                "weight_dtype": (
                    list(WEIGHT_DTYPE_BYTES),
                    {"default": "bf16", "tooltip": "Weight storage assumed for the GPU-memory check."},
                ),
            },
            "optional": {
                "text_tokens": (
                    "INT",
                    {"default": 0, "min": 0, "max": 512,
                     "tooltip": "Image models: text tokens per prompt; 0: what the pipeline feeds (FLUX.1 256 "
                                "schnell-like / 512 dev-like, FLUX.2 512, Z-Image at most 512). Wan always reads 512."},
                ),
                "frames": (
                    "INT",
                    {"default": 81, "min": 1, "max": 100001, "step": 4,
                     "tooltip": "Wan: video frames, 4k + 1 (81 = 21 latent frames). Ignored for images."},
                ),
                "chunk_frames": (
                    "INT",
                    {"default": 3, "min": 1, "max": 64, "tooltip": "Wan: latent frames per chunk."},
                ),
                "window_frames": (
                    "INT",
                    {"default": 21, "min": 1, "max": 1024,
                     "tooltip": "Wan: latent frames a chunk attends to (sinks and the chunk included)."},
                ),
                "sink_frames": (
                    "INT",
                    {"default": 0, "min": 0, "max": 1024, "tooltip": "Wan: first latent frames kept forever."},
                ),
                "kv_dtype": (
                    list(KV_LAYOUTS),
                    {"default": "bf16",
                     "tooltip": "Wan: KV-cache storage; int8/int4 quantize the frames older than the recent chunks."},
                ),
                "keep_recent_chunks": (
                    "INT",
                    {"default": 1, "min": 0, "max": 64,
                     "tooltip": "Wan, int8/int4: completed chunks kept unquantized besides the current one."},
                ),
            },
        }  # fmt: skip

    @reports_input_errors(NODE)
    def plan(self, model, width, height, steps, cfg, batch, gpu, mfu, weight_dtype, text_tokens=0, frames=81,
             chunk_frames=3, window_frames=21, sink_frames=0, kv_dtype="bf16", keep_recent_chunks=1):  # fmt: skip
        video = not model.family.is_image
        settings = {
            "height": height or None,
            "width": width or None,
            "steps": steps or None,
            "cfg": cfg,
            "batch": batch,
            "gpu": gpu,
            "mfu": mfu,
            "weight_dtype": weight_dtype,
            "text_tokens": (text_tokens or None) if not video else None,
        }
        if video:
            settings |= {"frames": frames, "chunk_frames": chunk_frames, "window_frames": window_frames,
                         "sink_frames": sink_frames, "kv_dtype": kv_dtype}  # fmt: skip
            if kv_dtype != "bf16":
                settings["keep_recent_chunks"] = keep_recent_chunks
        plan = plan_cost(
            model.params, name=model.preset, loaded_weight_bytes=weight_bytes(model.model), **settings
        )
        bill = plan.table()
        log.info("%s\n%s", NODE, bill)
        return bill, json.dumps(plan.fields)
