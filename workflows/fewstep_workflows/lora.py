"""Step-distillation LoRAs (issue 19): FLUX.1-dev in 8 steps with Hyper-FLUX, and causal Wan video with a CausVid
LoRA. Each real workflow has a ``_dummy`` twin whose LoRA loader writes a seeded random LoRA for the dummy model."""

from __future__ import annotations

from .graph import Graph, workflow
from .parts import (
    FLUX_SIDE_FILES,
    PROMPT,
    VideoInputs,
    causal_video,
    decode_and_save,
    dummy_wan_inputs,
    fewstep_sampler,
    save_latent_and_report,
    wan_text,
)

HYPER_FLUX = "Hyper-FLUX.1-dev-8steps-lora.safetensors"
CAUSVID_LORA = "Wan21_CausVid_bidirect2_T2V_1_3B_lora_rank32.safetensors"

HYPER_NOTE = """Hyper-FLUX.1-dev-8steps (ByteDance/Hyper-SD, trajectory-segmented consistency distillation) is a LoRA
that lets FLUX.1-dev make an image in 8 steps instead of its usual 28. FewStep LoRA Preset gives the settings
its model card publishes: 8 steps, guidance 3.5, LoRA strength 0.125 (the LoRA was trained to be applied that
weakly), on FLUX.1-dev's own schedule (shift grows with resolution). The preset's outputs are connected to the
sampler's steps, the prompt's guidance and the LoRA's strength; disconnect one to set it yourself.
FLUX.1-Turbo-Alpha (alimama-creative) works the same way: preset flux.1-turbo-alpha-8step (strength 1.0)."""


@workflow("flux_dev_hyper_lora")
def flux_dev_hyper_lora(g: Graph) -> None:
    g.note = f"""FLUX.1-dev in 8 steps with the Hyper-FLUX LoRA, on the FewStep engine.

{HYPER_NOTE}

Files (ComfyUI/models/...):
- diffusion_models/flux1-dev.safetensors (huggingface.co/black-forest-labs/FLUX.1-dev: accept its licence first)
- loras/{HYPER_FLUX} (huggingface.co/ByteDance/Hyper-SD)
{FLUX_SIDE_FILES}

No files? Open flux_dev_hyper_lora_dummy.json."""
    preset = g.add(
        "FewStepLoraPreset", "LoRA preset (Hyper-FLUX 8 steps)", 1, preset="hyper-flux.1-dev-8step"
    )
    base = g.add("FewStepDiTLoader", "FewStep DiT Loader (FLUX.1-dev)", 1, model_name="flux1-dev.safetensors")
    model = g.add(
        "FewStepLoraLoader", "FewStep LoRA Loader (Hyper-FLUX)", 2, model=base[0], lora_name=HYPER_FLUX,
        strength=preset[3],
    )  # fmt: skip
    clip = g.add(
        "DualCLIPLoader", "Load text encoders (T5-XXL + CLIP-L)", 2, clip_name1="t5xxl_fp16.safetensors",
        clip_name2="clip_l.safetensors", type="flux",
    )  # fmt: skip
    cond = g.add(
        "CLIPTextEncodeFlux", "Prompt", 2, clip=clip[0], clip_l=PROMPT, t5xxl=PROMPT, guidance=preset[2]
    )
    latent = g.add("EmptySD3LatentImage", "Image size", 3, width=1024, height=1024, batch_size=1)
    sampler = fewstep_sampler(
        g, "FewStep Sampler (8 steps)", 3, model[0], cond[0], latent[0], steps=preset[0], schedule="flux.1-dev",
    )  # fmt: skip
    g.add("PreviewAny", "Sampler report", 4, ui_height=200, source=sampler[1])
    g.add("PreviewAny", "Preset settings", 1, ui_height=140, source=preset[4])
    decode_and_save(g, sampler[0], 4, "fewstep/flux_dev_hyper_lora")


@workflow("flux_dev_hyper_lora_dummy")
def flux_dev_hyper_lora_dummy(g: Graph) -> None:
    g.note = """The Hyper-FLUX 8-step graph with no model files (random weights, a few seconds on a CPU).

dummy:flux-tiny-guidance is a tiny FLUX.1-dev-shaped transformer (with the guidance embedding, so the sampler
follows the dev schedule), and the LoRA loader's dummy:random-rank8 writes a seeded random rank-8 LoRA for it
(every linear layer, ComfyUI's naming) into ComfyUI's temp folder (temp/fewstep/loras) and reads it back like a
downloaded file. The output is noise; the report shows the 8 steps and the LoRA applied.

Needs no files. For real images open flux_dev_hyper_lora.json."""
    preset = g.add(
        "FewStepLoraPreset", "LoRA preset (Hyper-FLUX 8 steps)", 1, preset="hyper-flux.1-dev-8step"
    )
    base = g.add(
        "FewStepDiTLoader", "FewStep DiT Loader (dummy FLUX.1-dev)", 1, model_name="dummy:flux-tiny-guidance"
    )
    model = g.add(
        "FewStepLoraLoader", "FewStep LoRA Loader (random LoRA)", 2, model=base[0],
        lora_name="dummy:random-rank8", strength=preset[3],
    )  # fmt: skip
    cond = g.add(
        "FewStepSyntheticConditioning", "Synthetic conditioning (no text encoder)", 2, model=base[0],
        guidance=preset[2],
    )  # fmt: skip
    latent = g.add("EmptySD3LatentImage", "Image size", 2, width=128, height=128, batch_size=1)
    sampler = fewstep_sampler(
        g, "FewStep Sampler (8 steps)", 3, model[0], cond[0], latent[0], steps=preset[0], schedule="flux.1-dev",
    )  # fmt: skip
    save_latent_and_report(g, sampler, 4, "fewstep/flux_dev_hyper_lora_dummy")
    g.add("PreviewAny", "Preset settings", 3, ui_height=140, source=preset[4])


WAN_BASE = "wan2.1_t2v_1.3B_bf16.safetensors"

CAUSVID_NOTE = """The setup: the plain Wan2.1-T2V-1.3B base (a 50-step model) plus Kijai's CausVid LoRA
(huggingface.co/Kijai/WanVideo_comfy), the difference between CausVid's few-step DMD student and that base,
extracted at rank 32 ("bidirect2": from CausVid's bidirectional student, which denoises a whole clip at once).
The LoRA is what makes the base a 4-step model; the preset gives its 4 steps of the [1000, 750, 500, 250]
shift-5 schedule, no CFG, strength 1.0 (users run CausVid LoRAs at 0.3 to 1 and 4 to 8 steps).

What the causal sampler changes: it runs the patched model chunk by chunk with a rolling KV cache, while this
LoRA was distilled for whole-clip (bidirectional) attention. Expect it to work less well than a model trained
causally: for that, load Self-Forcing (self_forcing_dmd.pt, the wan_causal_video workflow) without a LoRA. This
graph is the base-plus-LoRA path for people whose Wan setup is a LoRA; nothing here was checked against real
weights (no GPU or model files were available when it was built). CausVid's weights are licensed for
non-commercial use only (check the model card)."""


@workflow("wan_causal_lora")
def wan_causal_lora(g: Graph) -> None:
    g.note = f"""Causal Wan 2.1 video with a step-distillation LoRA (CausVid), on the FewStep engine.

{CAUSVID_NOTE}

Files (ComfyUI/models/...):
- diffusion_models/{WAN_BASE} (huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged)
- loras/{CAUSVID_LORA} (huggingface.co/Kijai/WanVideo_comfy)
- text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors (huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged)
- vae_approx/taew2_1.safetensors (huggingface.co/Kijai/WanVideo_comfy)

No files? Open wan_causal_lora_dummy.json."""
    preset = g.add("FewStepLoraPreset", "LoRA preset (CausVid 4 steps)", 1, preset="causvid-wan2.1-4step")
    base = g.add("FewStepDiTLoader", "FewStep DiT Loader (Wan 2.1 1.3B)", 1, model_name=WAN_BASE)
    _, cond = wan_text(g, 1, "a corgi running along a beach at sunset, waves rolling in, tracking shot")
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (TAEW2.1)", 1, vae_name="taew2_1.safetensors")
    model = g.add(
        "FewStepLoraLoader", "FewStep LoRA Loader (CausVid)", 2, model=base[0], lora_name=CAUSVID_LORA,
        strength=preset[3],
    )  # fmt: skip
    g.add("PreviewAny", "Preset settings", 2, ui_height=140, source=preset[4])
    causal_video(
        g, VideoInputs(model[0], cond[0], tiny[0], col=3), "FewStep Causal Video Sampler (LoRA)", "Report",
        "fewstep/wan_causal_lora", width=832, height=480, num_chunks=7, chunk_frames=3, window_frames=21,
        sink_frames=0, schedule="wan-dmd-4step", steps=preset[0], seed=7,
    )  # fmt: skip


@workflow("wan_causal_lora_dummy")
def wan_causal_lora_dummy(g: Graph) -> None:
    g.note = """Causal video with a LoRA and no model files (random weights; a few seconds on a CPU).

dummy:wan-tiny is a tiny Wan-shaped transformer; the LoRA loader's dummy:random-rank8 writes a seeded random
rank-8 LoRA for it into ComfyUI's temp folder (temp/fewstep/loras) and reads it back like a downloaded file; the
causal sampler runs the patched model chunk by chunk. The video is noise.

Needs no files. For real video open wan_causal_lora.json."""
    preset = g.add("FewStepLoraPreset", "LoRA preset (CausVid 4 steps)", 1, preset="causvid-wan2.1-4step")
    inputs = dummy_wan_inputs(g)
    model = g.add(
        "FewStepLoraLoader", "FewStep LoRA Loader (random LoRA)", 2, model=inputs.model,
        lora_name="dummy:random-rank8", strength=preset[3],
    )  # fmt: skip
    g.add("PreviewAny", "Preset settings", 2, ui_height=140, source=preset[4])
    causal_video(
        g, VideoInputs(model[0], inputs.cond, inputs.tiny, col=3), "FewStep Causal Video Sampler (LoRA)",
        "Report", "fewstep/wan_causal_lora_dummy", width=96, height=64, num_chunks=3, chunk_frames=2,
        window_frames=6, sink_frames=1, schedule="wan-dmd-4step", steps=preset[0], seed=7,
    )  # fmt: skip
