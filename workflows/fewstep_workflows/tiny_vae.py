"""The tiny autoencoders: a few-step image decoded by TAEF1, and an encode/decode round trip."""

from __future__ import annotations

from .graph import Graph, Out, workflow
from .parts import FLUX_SIDE_FILES, dummy_image_inputs, flux1_inputs, tiny_decoded_image


@workflow("flux_schnell_tiny_decode")
def flux_schnell_tiny_decode(g: Graph) -> None:
    g.note = f"""FLUX.1-schnell in 4 steps, decoded with the tiny autoencoder TAEF1.

With a 4-step model the full VAE becomes a large share of the time; TAEF1 (a few MB) decodes in
milliseconds at slightly lower detail. The sampler also sends a TAEF1 preview of each step's x0 to the
progress bar (preview = true).

Files (ComfyUI/models/...):
- diffusion_models/flux1-schnell.safetensors
- vae_approx/taef1.safetensors (both halves in one file: huggingface.co/madebyollin/taef1's diffusion_pytorch_model.safetensors, saved under this name; taef1_encoder.pth + taef1_decoder.pth from github.com/madebyollin/taesd load too)
{FLUX_SIDE_FILES.splitlines()[0]}
{FLUX_SIDE_FILES.splitlines()[1]}

No files? Open flux_schnell_tiny_decode_dummy.json."""
    inputs = flux1_inputs(g, 1024)
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (TAEF1)", inputs.col, vae_name="taef1.safetensors")
    tiny_decoded_image(
        g, inputs, tiny[0], "FewStep Sampler (4 steps, previews)", "Tiny decode", 420, "fewstep/schnell_tiny"
    )


@workflow("flux_schnell_tiny_decode_dummy")
def flux_schnell_tiny_decode_dummy(g: Graph) -> None:
    g.note = """Few-step sampling plus tiny-VAE decode with no model files (random weights, CPU, seconds).

dummy:flux-tiny and dummy:taef1 have seeded random weights, so the saved image is noise; the workflow checks
the install and shows the path latent -> tiny decode -> image, with per-step previews.

Needs no files. For real images open flux_schnell_tiny_decode.json."""
    inputs = dummy_image_inputs(g)
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (dummy TAEF1)", inputs.col, vae_name="dummy:taef1")
    tiny_decoded_image(
        g,
        inputs,
        tiny[0],
        "FewStep Sampler (4 steps, previews)",
        "Tiny decode",
        300,
        "fewstep/schnell_tiny_dummy",
    )


def round_trip(g: Graph, picture: Out, tiny: Out, save_height: int, prefix: str) -> None:
    latent = g.add("FewStepTinyVAEEncode", "Tiny encode", 2, tiny_vae=tiny, pixels=picture)
    image = g.add("FewStepTinyVAEDecode", "Tiny decode", 2, tiny_vae=tiny, samples=latent[0])
    g.add("SaveImage", "Save round trip", 3, ui_height=save_height, images=image[0], filename_prefix=prefix)


@workflow("tiny_vae_round_trip")
def tiny_vae_round_trip(g: Graph) -> None:
    g.note = """Encode an image with a tiny VAE and decode it again (TAEF1 here).

Shows what the tiny autoencoder keeps: compare the saved image with the input. Swap the loader's file for
taesd / taesdxl / taesd3 / taef2 to try other latent spaces; the LATENT in between is ComfyUI's raw VAE
latent, so ComfyUI's own VAEDecode with ae.safetensors decodes it too.

Files: vae_approx/taef1.safetensors (both halves in one file: huggingface.co/madebyollin/taef1's diffusion_pytorch_model.safetensors, saved under this name; taef1_encoder.pth + taef1_decoder.pth from github.com/madebyollin/taesd load too); an image in
ComfyUI/input (height and width divisible by 8)."""
    picture = g.add("LoadImage", "Image", 1, image="example.png")
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (TAEF1)", 1, vae_name="taef1.safetensors")
    round_trip(g, picture[0], tiny[0], 420, "fewstep/round_trip")


@workflow("tiny_vae_round_trip_dummy")
def tiny_vae_round_trip_dummy(g: Graph) -> None:
    g.note = """Tiny-VAE encode then decode with no files: a plain-colour image through dummy:taef1.

Random weights, so the output is not the input; the workflow checks shapes and the IMAGE <-> LATENT path.

Needs no files. tiny_vae_round_trip.json does this with real TAEF1 weights and your image."""
    picture = g.add("EmptyImage", "Plain image", 1, width=256, height=256, batch_size=1, color=0x3366CC)
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (dummy TAEF1)", 1, vae_name="dummy:taef1")
    round_trip(g, picture[0], tiny[0], 300, "fewstep/round_trip_dummy")
