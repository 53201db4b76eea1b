"""FLUX.2 [klein] and Z-Image-Turbo (issue 16): real workflows for a current ComfyUI, dummy twins for 0.3.64."""

from __future__ import annotations

from .graph import Graph, Node, Out, workflow
from .nodes import IMAGE_BATCH_NOTE
from .parts import PROMPT, ImageInputs, decode_and_save, fewstep_sampler, tiny_decoded_image
from .stream import stylize_frames

KLEIN_FILES = """- diffusion_models/flux-2-klein-4b.safetensors (huggingface.co/black-forest-labs/FLUX.2-klein-4B, Apache-2.0;
  the same file is in huggingface.co/Comfy-Org/Flux-2-Klein-4B under split_files/diffusion_models/)
- text_encoders/qwen_3_4b.safetensors (Qwen3-4B: huggingface.co/Comfy-Org/Flux-2-Klein-4B split_files/text_encoders/)
- vae_approx/taef2.safetensors (huggingface.co/madebyollin/taef2, both halves in one file; taef2_decoder.pth
  from github.com/madebyollin/taesd loads too); for full-quality decoding ComfyUI's VAEDecode with
  vae/flux2-vae.safetensors (Comfy-Org/Flux-2-Klein-4B split_files/vae/) decodes the same LATENT"""
ZIMAGE_FILES = """- diffusion_models/z_image_turbo_bf16.safetensors (huggingface.co/Comfy-Org/z_image_turbo; Tongyi-MAI/Z-Image-Turbo's
  sharded transformer/ folder loads too: pick any of its shards)
- text_encoders/qwen_3_4b.safetensors (Qwen3-4B: huggingface.co/Comfy-Org/z_image_turbo split_files/text_encoders/)"""
ZIMAGE_PROMPT = PROMPT


# ComfyUI 0.3.64 (CI's server) has neither CLIPLoader type flux2 nor EmptyFlux2LatentImage, and its CLIPLoader
# type lumina2 loads Gemma-2 only: the real workflows below need a current ComfyUI, the dummy twins do not.
CURRENT_COMFYUI = "Needs a current ComfyUI (FLUX.2 and Z-Image text encoders; 0.3.64 has neither)."


def qwen_text(g: Graph, col: int, clip_type: str, title: str) -> Node:
    """Qwen3-4B through ComfyUI's CLIPLoader (type flux2: FLUX.2 klein's stacked layers; lumina2: Z-Image)."""
    clip = g.add("CLIPLoader", title, col, clip_name="qwen_3_4b.safetensors", type=clip_type)
    return g.add("CLIPTextEncode", "Prompt", col + 1, text=ZIMAGE_PROMPT, clip=clip[0])


def synthetic_qwen(g: Graph, col: int, width: int, title: str) -> Node:
    """Stand-in Qwen3 features: no pooled vector, no distilled guidance."""
    return g.add(
        "FewStepSyntheticConditioning", title, col, tokens=16, width=width, pooled_width=0, guidance=0.0
    )


def klein_image(g: Graph, inputs: ImageInputs, tiny: Out, save_height: int, prefix: str) -> None:
    tiny_decoded_image(
        g, inputs, tiny, "FewStep Sampler (klein, 4 steps)", "Tiny decode (TAEF2)", save_height, prefix,
        schedule="flux.2-klein",
    )  # fmt: skip


@workflow("flux2_klein_tiny_decode")
def flux2_klein_tiny_decode(g: Graph) -> None:
    g.note = f"""FLUX.2 [klein] 4B in 4 steps with the FewStep engine, decoded by the tiny autoencoder TAEF2.

klein is step-distilled: the flux.2-klein schedule runs 4 steps (its shift follows the image size), no CFG and
no distilled guidance, one DiT forward per step. The prompt is encoded by Qwen3-4B (CLIPLoader type flux2: three
of its hidden layers stacked, 7680 wide), which ComfyUI does from 0.9.2 on: older versions, 0.8.0 included, encode
Qwen3-4B 2560 wide for Z-Image whatever the type, and the FewStep Sampler stops with a width error. The LATENT is ComfyUI's FLUX.2 latent (128 channels at 1/16 of the
image size, from Empty Flux 2 Latent); TAEF2 decodes it in milliseconds at lower detail than the full VAE.
{CURRENT_COMFYUI}

Files (ComfyUI/models/...):
{KLEIN_FILES}

No files? Open flux2_klein_tiny_decode_dummy.json."""
    model = g.add(
        "FewStepDiTLoader",
        "FewStep DiT Loader (FLUX.2 klein 4B)",
        1,
        model_name="flux-2-klein-4b.safetensors",
    )
    cond = qwen_text(g, 1, "flux2", "Load text encoder (Qwen3-4B, FLUX.2)")
    latent = g.add(
        "EmptyFlux2LatentImage", "Image size (FLUX.2 latent)", 1, width=1024, height=1024, batch_size=1
    )
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (TAEF2)", 3, vae_name="taef2.safetensors")
    klein_image(
        g,
        ImageInputs(model[0], cond[0], latent[0], col=3, dummy=False),
        tiny[0],
        420,
        "fewstep/flux2_klein_tiny",
    )


@workflow("flux2_klein_tiny_decode_dummy")
def flux2_klein_tiny_decode_dummy(g: Graph) -> None:
    g.note = """FLUX.2 [klein] sampling and TAEF2 decode with no model files (random weights, CPU, seconds).

dummy:flux2-tiny is a tiny FLUX.2-shaped transformer (klein's interface: 128 latent channels, 7680-wide text
features, no guidance embedding) and dummy:taef2 a TAEF2-shaped autoencoder, both with seeded random weights: the
saved image is noise. Synthetic conditioning stands in for Qwen3-4B.

The start LATENT: ComfyUI 0.3.x before FLUX.2 has no Empty Flux 2 Latent node, so the tiny AE encodes a plain
image into a FLUX.2 LATENT of the right shape ([1, 128, 8, 8] for 128x128 px). At denoise 1 the sampler starts
from pure noise (sigma 1), so only the shape of that latent is used, as with an empty one.

Needs no files. For real images open flux2_klein_tiny_decode.json (a current ComfyUI)."""
    model = g.add("FewStepDiTLoader", "FewStep DiT Loader (dummy FLUX.2)", 1, model_name="dummy:flux2-tiny")
    cond = synthetic_qwen(g, 1, 7680, "Synthetic Qwen3-4B features (klein, 7680)")
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (dummy TAEF2)", 1, vae_name="dummy:taef2")
    picture = g.add("EmptyImage", "Image size (any picture)", 2, width=128, height=128, batch_size=1, color=0)
    latent = g.add(
        "FewStepTinyVAEEncode", "FLUX.2 LATENT of that size", 2, tiny_vae=tiny[0], pixels=picture[0]
    )
    klein_image(
        g,
        ImageInputs(model[0], cond[0], latent[0], col=3, dummy=True),
        tiny[0],
        300,
        "fewstep/flux2_klein_dummy",
    )


@workflow("zimage_turbo_t2i")
def zimage_turbo_t2i(g: Graph) -> None:
    g.note = f"""Z-Image-Turbo in 8 steps with the FewStep engine, decoded by ComfyUI's VAEDecode.

Z-Image-Turbo (Tongyi-MAI, 6B, single-stream S3-DiT) is distilled for 8 DiT forwards without CFG: the
z-image-turbo schedule (shift 3) runs them. Qwen3-4B encodes the prompt (CLIPLoader type lumina2, 2560-wide
features); the image latent and the VAE are FLUX.1's (16 channels at 1/8: Empty SD3 Latent, ae.safetensors).
{CURRENT_COMFYUI}

Files (ComfyUI/models/...):
{ZIMAGE_FILES}
- vae/ae.safetensors (the FLUX.1 VAE, which Z-Image uses)

No files? Open zimage_turbo_t2i_dummy.json."""
    model = g.add(
        "FewStepDiTLoader",
        "FewStep DiT Loader (Z-Image-Turbo)",
        1,
        model_name="z_image_turbo_bf16.safetensors",
    )
    cond = qwen_text(g, 1, "lumina2", "Load text encoder (Qwen3-4B, Z-Image)")
    latent = g.add("EmptySD3LatentImage", "Image size", 1, width=1024, height=1024, batch_size=1)
    sampler = fewstep_sampler(
        g, "FewStep Sampler (Z-Image-Turbo, 8 steps)", 3, model[0], cond[0], latent[0], steps=8,
        schedule="z-image-turbo",
    )  # fmt: skip
    g.add("PreviewAny", "Sampler report", 3, ui_height=200, source=sampler[1])
    decode_and_save(g, sampler[0], 4, "fewstep/zimage_turbo")


@workflow("zimage_turbo_t2i_dummy")
def zimage_turbo_t2i_dummy(g: Graph) -> None:
    g.note = """Z-Image-Turbo sampling with no model files (random weights, CPU, seconds).

dummy:zimage-tiny is a tiny Z-Image-shaped transformer (Z-Image's interface: 16-channel FLUX.1 latent, 2x2
patches, 2560-wide Qwen3 caption features, caption and image tokens padded to multiples of 32) with seeded random
weights; synthetic conditioning stands in for Qwen3-4B and dummy:taef1 for the VAE. The saved image is noise.

Needs no files. For real images open zimage_turbo_t2i.json (a current ComfyUI)."""
    model = g.add("FewStepDiTLoader", "FewStep DiT Loader (dummy Z-Image)", 1, model_name="dummy:zimage-tiny")
    cond = synthetic_qwen(g, 1, 2560, "Synthetic Qwen3-4B features (2560)")
    latent = g.add("EmptySD3LatentImage", "Image size", 1, width=128, height=128, batch_size=1)
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (dummy TAEF1)", 2, vae_name="dummy:taef1")
    sampler = fewstep_sampler(
        g, "FewStep Sampler (Z-Image-Turbo, 8 steps)", 2, model[0], cond[0], latent[0], steps=8,
        schedule="z-image-turbo",
    )  # fmt: skip
    image = g.add("FewStepTinyVAEDecode", "Tiny decode (TAEF1)", 3, tiny_vae=tiny[0], samples=sampler[0])
    g.add("PreviewAny", "Sampler report", 3, ui_height=200, source=sampler[1])
    g.add(
        "SaveImage",
        "Save image",
        4,
        ui_height=300,
        images=image[0],
        filename_prefix="fewstep/zimage_turbo_dummy",
    )


@workflow("zimage_turbo_stream_batch")
def zimage_turbo_stream_batch(g: Graph) -> None:
    g.note = f"""Stylise a frame sequence with Z-Image-Turbo: StreamDiffusion's stream batch, TAEF1 in and out.

Each frame is encoded by TAEF1, noised to the first listed step of the z-image-turbo schedule and denoised by
the listed steps (here 4 and 6 of its 8-step grid: about half strength); frames at different steps share one
batched forward, so the throughput is one frame per DiT forward. Near-identical consecutive frames are skipped
(similarity_threshold < 1). The report gives frames per second and frames skipped.
{CURRENT_COMFYUI}

Files (ComfyUI/models/... and ComfyUI/input/):
{ZIMAGE_FILES}
- vae_approx/taef1.safetensors (both halves in one file: huggingface.co/madebyollin/taef1's diffusion_pytorch_model.safetensors, saved under this name; taef1_encoder.pth + taef1_decoder.pth from github.com/madebyollin/taesd load too): both halves are used
- input/: a short video to stylise (frames of equal size, multiples of 16 px)

No files? Open zimage_turbo_stream_batch_dummy.json."""
    model = g.add(
        "FewStepDiTLoader",
        "FewStep DiT Loader (Z-Image-Turbo)",
        1,
        model_name="z_image_turbo_bf16.safetensors",
    )
    cond = qwen_text(g, 1, "lumina2", "Load text encoder (Qwen3-4B, Z-Image)")
    stylize_frames(
        g, model[0], cond[0], False, "fewstep/zimage_stream_batch", t_index_list="4,6", schedule="z-image-turbo",
        schedule_steps=8,
    )  # fmt: skip


@workflow("zimage_turbo_stream_batch_dummy")
def zimage_turbo_stream_batch_dummy(g: Graph) -> None:
    g.note = f"""The Z-Image stream batch with no model files (random weights, CPU, seconds).

Six 64x64 frames: three blue, then three orange, through dummy:zimage-tiny and dummy:taef1. With
similarity_threshold 0.98 the filter skips repeats of a near-identical frame (seeded: the same frames every run)
and the report says which. Random weights: the output frames are noise.

{IMAGE_BATCH_NOTE}

Needs no files. For real stylisation open zimage_turbo_stream_batch.json (a current ComfyUI)."""
    model = g.add("FewStepDiTLoader", "FewStep DiT Loader (dummy Z-Image)", 1, model_name="dummy:zimage-tiny")
    cond = synthetic_qwen(g, 1, 2560, "Synthetic Qwen3-4B features (2560)")
    stylize_frames(
        g, model[0], cond[0], True, "fewstep/zimage_stream_batch_dummy", t_index_list="20,35",
        schedule="z-image-turbo", schedule_steps=50,
    )  # fmt: skip
