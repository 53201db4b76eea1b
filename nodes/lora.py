"""FewStepLoraLoader: a LoRA from ComfyUI's loras folder on a FEWSTEP_MODEL; FewStepLoraPreset: the sampling
settings a step-distillation LoRA was published with.

The loader returns a new handle that carries the patch (``engine.lora.apply_lora``); the input handle, which
ComfyUI may have cached and hand to other nodes, is left as it was, and the output keeps its ``host`` patcher so
ComfyUI's memory manager still sees one model. The weights are merged by the run that uses the handle.
"""

from __future__ import annotations

import os
import tempfile

from ..engine.loader import DUMMY_PREFIX
from ..engine.lora import apply_lora
from ..engine.lora.dummy import dummy_lora_name, write_dummy_lora
from ..engine.lora.presets import LORA_PRESETS, lora_preset
from .base import CATEGORY, ReturnsModel, model_input, reports_input_errors
from .host import list_model_files, model_file_path, temp_directory

# dummy choice -> (rank, seed) of the random LoRA it writes for the connected model
DUMMY_LORAS = {f"{DUMMY_PREFIX}random-rank8": (8, 0)}
DUMMY_SCALE = 0.01  # each delta entry about 1% of a unit weight: visible in the output, far from breaking it
SUBFOLDER = ("fewstep", "loras")


def dummy_lora_folder() -> str:
    """Where dummy LoRA files go: ComfyUI's temp folder (emptied at each server start), else the system's."""
    return os.path.join(temp_directory() or tempfile.gettempdir(), *SUBFOLDER)


def lora_choices() -> list[str]:
    return list_model_files("loras") + list(DUMMY_LORAS)


class FewStepLoraLoader(ReturnsModel):
    DESCRIPTION = (
        "Applies a LoRA from models/loras to a FEWSTEP_MODEL at a strength (ComfyUI's arithmetic: strength x "
        "alpha / rank x up @ down). Reads ComfyUI, diffusers / PEFT, kohya, XLabs and lightx2v namings for FLUX.1, "
        "FLUX.2, Z-Image and Wan; any entry that fits no weight of the model is an error that lists it. Chain "
        "loaders to stack LoRAs. The input model is not changed: the output carries the LoRA and the run that "
        "uses it merges the weights. 'dummy:random-rank8' writes a seeded random LoRA for the connected model "
        "(every linear layer) and reads it back, for trying workflows without files."
    )
    CATEGORY = f"{CATEGORY}/loaders"
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": model_input("or another LoRA loader"),
                "lora_name": (
                    lora_choices(),
                    {
                        "tooltip": "A file in models/loras (Hyper-FLUX.1-dev-8steps-lora.safetensors, "
                        "Wan21_CausVid_bidirect2_T2V_1_3B_lora_rank32.safetensors...), or dummy:random-rank8 "
                        "for a seeded random LoRA of the connected model."
                    },
                ),
                "strength": (
                    "FLOAT",
                    {
                        "default": 1.0,
                        "min": -10.0,
                        "max": 10.0,
                        "step": 0.01,
                        "tooltip": "How much of the LoRA to add (0: none, 1: as trained; negative subtracts). "
                        "Distillation LoRAs publish theirs: Hyper-FLUX 0.125, Turbo-Alpha 1.0 (FewStepLoraPreset).",
                    },
                ),
            }
        }

    @reports_input_errors("FewStepLoraLoader", file_lists=("lora_name",))
    def load(self, model, lora_name, strength=1.0):
        if lora_name in DUMMY_LORAS:
            rank, seed = DUMMY_LORAS[lora_name]
            path = os.path.join(dummy_lora_folder(), dummy_lora_name(model.model, rank, seed))
            # the same model, rank and seed give the same bytes: a file already written is read as it is
            if not os.path.isfile(path):
                write_dummy_lora(model.model, path, rank=rank, seed=seed, scale=DUMMY_SCALE)
        else:
            path = model_file_path("loras", lora_name, "lora_name")
        return (apply_lora(model, path, strength, input_name="lora_name"),)


class FewStepLoraPreset:
    DESCRIPTION = (
        "The sampling settings a step-distillation LoRA was published with: steps, cfg, FLUX.1-dev guidance and "
        "LoRA strength, to connect to the sampler's steps / cfg, the prompt's guidance and the LoRA loader's "
        "strength (what is not connected keeps its widget's value). 'settings' names the schedule to pick and "
        "the source of the numbers."
    )
    CATEGORY = f"{CATEGORY}/loaders"
    RETURN_TYPES = ("INT", "FLOAT", "FLOAT", "FLOAT", "STRING")
    RETURN_NAMES = ("steps", "cfg", "guidance", "strength", "settings")
    FUNCTION = "preset"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "preset": (
                    list(LORA_PRESETS),
                    {
                        "default": next(iter(LORA_PRESETS)),
                        "tooltip": "; ".join(p.describe() for p in LORA_PRESETS.values()),
                    },
                ),
            }
        }

    @reports_input_errors("FewStepLoraPreset")
    def preset(self, preset):
        p = lora_preset(preset)
        return (p.steps, p.cfg, p.guidance, p.strength, p.describe())
