"""Sampling settings published with the step-distillation LoRAs: steps, schedule, guidance, LoRA strength.

A preset only says what its authors recommend; the ``FewStepLoraPreset`` node outputs these numbers for the user
to connect (a connected value is the user's choice, an unconnected widget keeps what the user typed), so a preset
never overrides a setting behind the user's back. The schedules are the engine's own
(``engine.sampling.schedules``): ``flux.1-dev`` is FLUX.1-dev's flow-matching schedule with its
resolution-dependent shift, ``wan-dmd-4step`` the timesteps [1000, 750, 500, 250] warped by shift 5.

Sources (each preset's ``source`` names where its numbers are published; the model cards themselves could not be
opened here, so each line says what backs it):

* ByteDance/Hyper-SD, ``Hyper-FLUX.1-dev-8steps-lora.safetensors``: 8 steps, guidance 3.5, LoRA scale 0.125
  (checked: Hyper-SD's published diffusers example fuses the file at ``lora_scale=0.125`` and samples
  ``num_inference_steps=8, guidance_scale=3.5``).
* alimama-creative/FLUX.1-Turbo-Alpha (its file is ``diffusion_pytorch_model.safetensors``): 8 steps, guidance
  3.5, LoRA scale 1.0, FLUX.1-dev's own scheduler (not checked here: from the model card as issue 19 cites it).
* lightx2v, Wan2.1 T2V 14B step / CFG distillation LoRA (``lightx2v/Wan2.1-Distill-Loras``,
  ``wan2.1_t2v_14b_lora_rank64_lightx2v_4step.safetensors``): 4 steps, denoising list [1000, 750, 500, 250],
  ``sample_shift`` 5, CFG off, strength 1.0 (checked: lightx2v's ``configs/distill/wan21/
  wan_t2v_distill_lora_4step_cfg.json``).
* Kijai/WanVideo_comfy ``Wan21_CausVid_*_lora_rank32``: CausVid extracted as LoRAs; users run 4 to 8 steps at
  cfg 1 and strength 0.3 to 1 (community usage, no official card). The preset takes the 4-step end at 1.0.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError


@dataclass(frozen=True)
class LoraPreset:
    name: str
    family: str  # the model family the LoRA is for ("flux", "wan")
    lora_file: str  # the published file name
    steps: int
    schedule: str  # a key of engine.sampling.SCHEDULES
    cfg: float  # classifier-free guidance (1: none)
    guidance: float  # FLUX.1-dev's distilled guidance, carried by the conditioning (0: not used)
    strength: float
    source: str
    note: str = ""

    def describe(self) -> str:
        guidance = f", guidance {self.guidance:g}" if self.guidance else ""
        return (
            f"{self.name}: {self.lora_file} at strength {self.strength:g}, {self.steps} steps, schedule "
            f"{self.schedule}, cfg {self.cfg:g}{guidance} (source: {self.source})"
            + (f"; {self.note}" if self.note else "")
        )


LORA_PRESETS: dict[str, LoraPreset] = {
    p.name: p
    for p in (
        LoraPreset(
            "hyper-flux.1-dev-8step",
            "flux",
            "Hyper-FLUX.1-dev-8steps-lora.safetensors",
            steps=8,
            schedule="flux.1-dev",
            cfg=1.0,
            guidance=3.5,
            strength=0.125,
            source="huggingface.co/ByteDance/Hyper-SD",
        ),
        LoraPreset(
            "flux.1-turbo-alpha-8step",
            "flux",
            "FLUX.1-Turbo-Alpha (diffusion_pytorch_model.safetensors)",
            steps=8,
            schedule="flux.1-dev",
            cfg=1.0,
            guidance=3.5,
            strength=1.0,
            source="huggingface.co/alimama-creative/FLUX.1-Turbo-Alpha",
        ),
        LoraPreset(
            "lightx2v-wan2.1-4step",
            "wan",
            "wan2.1_t2v_14b_lora_rank64_lightx2v_4step.safetensors",
            steps=4,
            schedule="wan-dmd-4step",
            cfg=1.0,
            guidance=0.0,
            strength=1.0,
            source="huggingface.co/lightx2v/Wan2.1-Distill-Loras (configs/distill/wan21/wan_t2v_distill_lora_4step_cfg.json)",
            note="for Wan2.1-T2V-14B (a 14B LoRA does not fit the 1.3B model)",
        ),
        LoraPreset(
            "causvid-wan2.1-4step",
            "wan",
            "Wan21_CausVid_bidirect2_T2V_1_3B_lora_rank32.safetensors",
            steps=4,
            schedule="wan-dmd-4step",
            cfg=1.0,
            guidance=0.0,
            strength=1.0,
            source="huggingface.co/Kijai/WanVideo_comfy",
            note="4 to 8 steps and strength 0.3 to 1 are used; fewer steps want the higher strength",
        ),
    )
}


def lora_preset(name: str, input_name: str = "preset") -> LoraPreset:
    if name not in LORA_PRESETS:
        raise InputError(input_name, f"unknown LoRA preset {name!r}; known: {', '.join(LORA_PRESETS)}")
    return LORA_PRESETS[name]
