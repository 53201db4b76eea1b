"""The step-cache gate: First-Block-Cache on FLUX.1-dev, the gate refusing a 4-step schedule, and the native
MODEL gate."""

from __future__ import annotations

from .graph import Graph, workflow
from .parts import (
    FLUX_SIDE_FILES,
    decode_and_save,
    dummy_flux_inputs,
    fewstep_sampler,
    first_block_gate,
    flux1_inputs,
    flux_text,
    save_latent_and_report,
)


@workflow("flux_dev_step_cache")
def flux_dev_step_cache(g: Graph) -> None:
    g.note = f"""FLUX.1-dev in 28 steps with the FewStep step-cache gate (First-Block-Cache).

FewStep Cache Gate attaches a step cache to the model (the model itself is shared, not changed). Before
the run it reads the schedule: 28 flux.1-dev steps move the noise level by ~0.03 per step, so caching can
pay and the gate turns on. On each step block 0 runs; when its residual changed by less than the threshold
(0.08: relative L1 change) since the last computed step, the other blocks are skipped and their last
residual is reused. The sampler's report lists the decision, the steps computed and skipped, the change
measured at each step (* = skipped) and the estimated speed-up. Threshold 0 gives exactly the uncached image.

Files (ComfyUI/models/...):
- diffusion_models/flux1-dev.safetensors (huggingface.co/black-forest-labs/FLUX.1-dev, gated), or an fp8 file
{FLUX_SIDE_FILES}

No files? Open flux_dev_step_cache_dummy.json."""
    inputs = flux1_inputs(g, variant="dev")
    gate = first_block_gate(g, "FewStep Cache Gate (First-Block-Cache)", 2, inputs.model, 0.08)
    sampler = fewstep_sampler(
        g,
        "FewStep Sampler (28 steps)",
        3,
        gate[0],
        inputs.cond,
        inputs.latent,
        steps=28,
        schedule="flux.1-dev",
    )
    g.add("PreviewAny", "Sampler report (cache telemetry)", 3, ui_height=260, source=sampler[1])
    decode_and_save(g, sampler[0], 4, "fewstep/flux_dev_step_cache")


@workflow("flux_dev_step_cache_dummy")
def flux_dev_step_cache_dummy(g: Graph) -> None:
    g.note = """The step-cache gate with no model files (random weights, runs on a CPU in seconds).

Random weights react very differently to neighbouring timesteps (block 0's residual changes by ~60% per
step, a trained FLUX by a few %), so this graph uses threshold 0.7 to show skipped steps in the report; with
a real model use ~0.08. The output is noise-like, not a picture.

Needs no files. For real images open flux_dev_step_cache.json."""
    model, cond, latent = dummy_flux_inputs(g)
    gate = first_block_gate(g, "FewStep Cache Gate (First-Block-Cache)", 2, model[0], 0.7)
    sampler = fewstep_sampler(
        g, "FewStep Sampler (28 steps)", 2, gate[0], cond[0], latent[0], steps=28, schedule="flux.1-dev"
    )
    save_latent_and_report(
        g,
        sampler,
        3,
        "fewstep/flux_dev_step_cache_dummy",
        "Sampler report (cache telemetry)",
        report_height=260,
    )


@workflow("flux_schnell_cache_gate_refuses")
def flux_schnell_cache_gate_refuses(g: Graph) -> None:
    g.note = f"""FLUX.1-schnell in 4 steps with the step-cache gate attached: the gate refuses, and says why.

A distilled 4-step schedule moves the noise level by 0.25 per step; every step is a turning point, so a
step cache would skip nothing or corrupt the image. FewStep Cache Gate reads the schedule before the run,
turns itself off and the sampler's report says: "off: 4-step distilled few-step schedule: adjacent steps
differ by 0.250 in sigma ...". The image is exactly the uncached one. 'force' overrides (not advised).

Files (ComfyUI/models/...):
- diffusion_models/flux1-schnell.safetensors (huggingface.co/Comfy-Org/flux1-schnell), or an fp8 file
{FLUX_SIDE_FILES}

No files? Open flux_schnell_cache_gate_refuses_dummy.json."""
    inputs = flux1_inputs(g)
    gate = first_block_gate(g, "FewStep Cache Gate", 2, inputs.model, 0.08)
    sampler = fewstep_sampler(g, "FewStep Sampler (4 steps)", 3, gate[0], inputs.cond, inputs.latent)
    g.add("PreviewAny", "Sampler report (the gate's reason)", 3, ui_height=200, source=sampler[1])
    decode_and_save(g, sampler[0], 4, "fewstep/flux_schnell_cache_gate")


@workflow("flux_schnell_cache_gate_refuses_dummy")
def flux_schnell_cache_gate_refuses_dummy(g: Graph) -> None:
    g.note = """The step-cache gate refusing a 4-step schedule, with no model files (random weights).

The report's 'step cache' line gives the reason; the latent is exactly the uncached one.

Needs no files. For real images open flux_schnell_cache_gate_refuses.json."""
    model, cond, latent = dummy_flux_inputs(g)
    gate = first_block_gate(g, "FewStep Cache Gate", 2, model[0], 0.08)
    sampler = fewstep_sampler(g, "FewStep Sampler (4 steps)", 2, gate[0], cond[0], latent[0])
    save_latent_and_report(
        g, sampler, 3, "fewstep/flux_schnell_cache_gate_dummy", "Sampler report (the gate's reason)"
    )


@workflow("native_flux_dev_cache_gate")
def native_flux_dev_cache_gate(g: Graph) -> None:
    g.note = f"""FLUX.1-dev in 28 steps on ComfyUI's own model, with the FewStep cache gate.

FewStep Cache Gate (native MODEL) patches a clone of the model through ComfyUI's wrappers (no copy, no
monkeypatch): before sampling it reads the schedule and decides whether skipping steps can pay. At 28 steps
it is on and skips the steps where the model's input changed by less than the threshold; with a 4-step
schedule it turns itself off and says why in the console. LoRAs and other patches still apply.

Files (ComfyUI/models/...):
- diffusion_models/flux1-dev.safetensors
{FLUX_SIDE_FILES}"""
    model = g.add("UNETLoader", "Load Diffusion Model (FLUX.1-dev)", 1, unet_name="flux1-dev.safetensors")
    cond = flux_text(g, 1)
    latent = g.add("EmptySD3LatentImage", "Image size", 1, width=1024, height=1024, batch_size=1)
    gate = g.add(
        "FewStepCacheGateNative", "FewStep Cache Gate (native)", 3, model=model[0], method="input_change",
        threshold=0.1, start=0.1, end=1.0, force=False, cfg_cutoff=1.0,
    )  # fmt: skip
    guider = g.add("BasicGuider", "Guider (no CFG)", 3, model=gate[0], conditioning=cond[0])
    noise = g.add("RandomNoise", "Noise", 3, noise_seed=42)
    sigmas = g.add(
        "FewStepSchedule", "FewStep Schedule (28 steps)", 3, schedule="flux.1-dev", steps=28, width=1024,
        height=1024,
    )  # fmt: skip
    sampler = g.add("FewStepSamplerSelect", "FewStep Sampler Select", 3, sampler="euler")
    out = g.add(
        "SamplerCustomAdvanced", "SamplerCustomAdvanced", 4, noise=noise[0], guider=guider[0], sampler=sampler[0],
        sigmas=sigmas[0], latent_image=latent[0],
    )  # fmt: skip
    decode_and_save(g, out[0], 4, "fewstep/native_dev_cache_gate")
