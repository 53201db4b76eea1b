"""Few-step image sampling: FLUX.1-schnell on the FewStep engine, and FewStep's schedule on ComfyUI's own path."""

from __future__ import annotations

from .graph import Graph, workflow
from .parts import (
    FLUX_SIDE_FILES,
    decode_and_save,
    dummy_flux_inputs,
    fewstep_sampler,
    flux1_inputs,
    flux_text,
    save_latent_and_report,
)


@workflow("flux_schnell_fewstep")
def flux_schnell_fewstep(g: Graph) -> None:
    g.note = f"""FLUX.1-schnell in 4 steps with the FewStep engine.

FewStep DiT Loader loads the diffusion transformer into the pack's own engine; ComfyUI's text encoders
and VAE do the rest. FewStep Sampler runs the schnell schedule (4 steps, euler, no CFG: one DiT forward
per step) and its 'report' output lists the sigmas and the time of each step.

Files (ComfyUI/models/...):
- diffusion_models/flux1-schnell.safetensors (huggingface.co/Comfy-Org/flux1-schnell), or an fp8 file
{FLUX_SIDE_FILES}

No files? Open flux_schnell_fewstep_dummy.json: the same sampler with random weights."""
    inputs = flux1_inputs(g)
    sampler = fewstep_sampler(g, "FewStep Sampler (4 steps)", 3, inputs.model, inputs.cond, inputs.latent)
    g.add("PreviewAny", "Sampler report", 3, ui_height=200, source=sampler[1])
    decode_and_save(g, sampler[0], 4, "fewstep/flux_schnell")


@workflow("flux_schnell_fewstep_dummy")
def flux_schnell_fewstep_dummy(g: Graph) -> None:
    g.note = """FewStep sampling with no model files at all (runs on a CPU in seconds).

'dummy:flux-tiny' builds a tiny FLUX-shaped transformer with seeded random weights, and FewStep
Synthetic Conditioning stands in for the text encoders (random T5/CLIP-shaped embeddings). The output
is noise-like, not a picture: the workflow is for checking an install and trying the sampler settings.
The latent is written to output/fewstep/ by SaveLatent; the report shows sigmas and step times.

Needs no files. For real images open flux_schnell_fewstep.json."""
    model, cond, latent = dummy_flux_inputs(g)
    sampler = fewstep_sampler(g, "FewStep Sampler (4 steps)", 2, model[0], cond[0], latent[0])
    save_latent_and_report(g, sampler, 3, "fewstep/flux_schnell_dummy")


@workflow("native_fewstep_schedule")
def native_fewstep_schedule(g: Graph) -> None:
    g.note = f"""FLUX.1-schnell on ComfyUI's own model path, with FewStep's schedule and sampler.

ComfyUI loads and runs the model (Load Diffusion Model, SamplerCustomAdvanced), so LoRAs and other
MODEL patches apply as usual; FewStep Schedule supplies the SIGMAS and FewStep Sampler Select the
SAMPLER. Keep the schedule's width/height equal to the image size (flux.1-dev's shift depends on it).

Files (ComfyUI/models/...):
- diffusion_models/flux1-schnell.safetensors (huggingface.co/Comfy-Org/flux1-schnell)
{FLUX_SIDE_FILES}"""
    model = g.add(
        "UNETLoader", "Load Diffusion Model (FLUX.1-schnell)", 1, unet_name="flux1-schnell.safetensors"
    )
    cond = flux_text(g, 1)
    latent = g.add("EmptySD3LatentImage", "Image size", 1, width=1024, height=1024, batch_size=1)
    guider = g.add("BasicGuider", "Guider (no CFG)", 3, model=model[0], conditioning=cond[0])
    noise = g.add("RandomNoise", "Noise", 3, noise_seed=42)
    sigmas = g.add(
        "FewStepSchedule", "FewStep Schedule", 3, schedule="flux.1-schnell", steps=4, width=1024, height=1024
    )
    sampler = g.add("FewStepSamplerSelect", "FewStep Sampler Select", 3, sampler="euler")
    out = g.add(
        "SamplerCustomAdvanced",
        "SamplerCustomAdvanced",
        4,
        noise=noise[0],
        guider=guider[0],
        sampler=sampler[0],
        sigmas=sigmas[0],
        latent_image=latent[0],
    )
    decode_and_save(g, out[0], 4, "fewstep/native_schnell")


@workflow("fewstep_schedule_dummy")
def fewstep_schedule_dummy(g: Graph) -> None:
    g.note = """The SIGMAS that FewStep Schedule hands to ComfyUI's samplers, shown without any model.

ComfyUI's native sampling needs a MODEL, which core nodes cannot make without a model file, so this
workflow only builds two schedules and previews them: FLUX.1-schnell (4 steps, unshifted) and FLUX.1-dev
(28 steps, shifted by resolution; change width/height to see the shift move).

Needs no files. native_fewstep_schedule.json uses these schedules with a real model."""
    schnell = g.add("FewStepSchedule", "Schedule: FLUX.1-schnell", 1, schedule="flux.1-schnell", steps=4)
    dev = g.add("FewStepSchedule", "Schedule: FLUX.1-dev", 1, schedule="flux.1-dev", steps=28)
    g.add("PreviewAny", "Sigmas (schnell)", 2, ui_height=140, source=schnell[0])
    g.add("PreviewAny", "Sigmas (dev)", 2, ui_height=240, source=dev[0])
