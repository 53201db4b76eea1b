"""Pieces several workflows share: the prompts, the text-encoder and output nodes, the dummy inputs that stand
in for model files, and the FewStep sampler with the shipped settings.

A workflow and its dummy twin are one graph fed two ways: the graph function takes :class:`ImageInputs` or
:class:`VideoInputs`, which the real workflow fills from model files and text encoders, and the dummy twin from
the tiny ``dummy:`` presets and synthetic conditioning (no files, runs on a CPU). The text encoders take two
layout columns where the synthetic conditioning takes none, so the inputs also say where the graph goes on.
"""

from __future__ import annotations

from dataclasses import dataclass

from .graph import SELF_FORCING_URL, Graph, Node, Out

PROMPT = "a red fox sitting in fresh snow at sunrise, soft golden light, detailed fur, shallow depth of field"
FLUX_SIDE_FILES = """- text_encoders/t5xxl_fp16.safetensors and text_encoders/clip_l.safetensors
  (huggingface.co/comfyanonymous/flux_text_encoders)
- vae/ae.safetensors (the FLUX VAE)"""


def flux_text(g: Graph, col: int) -> Node:
    clip = g.add(
        "DualCLIPLoader",
        "Load text encoders (T5-XXL + CLIP-L)",
        col,
        clip_name1="t5xxl_fp16.safetensors",
        clip_name2="clip_l.safetensors",
        type="flux",
    )
    return g.add(
        "CLIPTextEncodeFlux", "Prompt", col + 1, clip=clip[0], clip_l=PROMPT, t5xxl=PROMPT, guidance=3.5
    )


def decode_and_save(g: Graph, latent: Out, col: int, prefix: str) -> None:
    vae = g.add("VAELoader", "Load VAE", col, vae_name="ae.safetensors")
    image = g.add("VAEDecode", "Decode", col, samples=latent, vae=vae[0])
    g.add("SaveImage", "Save image", col + 1, ui_height=420, images=image[0], filename_prefix=prefix)


def save_latent_and_report(
    g: Graph, sampler: Node, col: int, prefix: str, report: str = "Sampler report", report_height: int = 200
) -> None:
    """What a dummy image workflow ends with: the sampler's latent saved (random weights give noise, not a
    picture) and its report shown."""
    g.add("SaveLatent", "Save latent", col, samples=sampler[0], filename_prefix=prefix)
    g.add("PreviewAny", report, col, ui_height=report_height, source=sampler[1])


def dummy_flux_inputs(g: Graph, size: int = 256) -> tuple[Node, Node, Node]:
    """(model, conditioning, latent) with no files: dummy:flux-tiny, synthetic embeddings, an empty latent."""
    model = g.add("FewStepDiTLoader", "FewStep DiT Loader (dummy weights)", 1, model_name="dummy:flux-tiny")
    cond = g.add("FewStepSyntheticConditioning", "Synthetic conditioning (no text encoder)", 1)
    latent = g.add("EmptySD3LatentImage", "Image size", 1, width=size, height=size, batch_size=1)
    return model, cond, latent


@dataclass(frozen=True)
class ImageInputs:
    """A FLUX image workflow's model, conditioning and latent, and the first layout column after them."""

    model: Out
    cond: Out
    latent: Out
    col: int
    dummy: bool

    def save(self, g: Graph, latent: Out, col: int, prefix: str) -> None:
        """The real model's image (full VAE decode); the dummy twin keeps the latent (random weights: noise)."""
        if self.dummy:
            g.add("SaveLatent", "Save latent", col, samples=latent, filename_prefix=prefix)
        else:
            decode_and_save(g, latent, col, prefix)


def flux1_inputs(g: Graph, size: int = 1024, variant: str = "schnell") -> ImageInputs:
    """FLUX.1 [``variant``: schnell or dev] from its file, T5-XXL + CLIP-L, an empty ``size`` x ``size`` latent."""
    model = g.add(
        "FewStepDiTLoader",
        f"FewStep DiT Loader (FLUX.1-{variant})",
        1,
        model_name=f"flux1-{variant}.safetensors",
    )
    cond = flux_text(g, 1)
    latent = g.add("EmptySD3LatentImage", "Image size", 1, width=size, height=size, batch_size=1)
    return ImageInputs(model[0], cond[0], latent[0], col=3, dummy=False)


def dummy_image_inputs(g: Graph) -> ImageInputs:
    model, cond, latent = dummy_flux_inputs(g)
    return ImageInputs(model[0], cond[0], latent[0], col=2, dummy=True)


def fewstep_sampler(
    g: Graph,
    title: str,
    col: int,
    model: Out,
    cond: Out,
    latent: Out,
    steps: int = 4,
    schedule: str = "flux.1-schnell",
    **inputs,
) -> Node:
    """FewStepSampler with the shipped settings: seed 42, euler, no CFG."""
    return g.add(
        "FewStepSampler",
        title,
        col,
        model=model,
        positive=cond,
        latent_image=latent,
        seed=42,
        steps=steps,
        schedule=schedule,
        sampler="euler",
        cfg=1.0,
        **inputs,
    )


def first_block_gate(g: Graph, title: str, col: int, model: Out, threshold: float) -> Node:
    return g.add(
        "FewStepCacheGate",
        title,
        col,
        model=model,
        method="first_block",
        threshold=threshold,
        start=0.1,
        end=1.0,
        force=False,
        cfg_cutoff=1.0,
    )


VIDEO_PROMPT = "a corgi running along a beach at sunset, waves rolling in, tracking shot"
VIDEO_PROMPT_2 = "the corgi stops and looks at the camera, waves splash around its paws"
WAN_FILES = f"""- diffusion_models/self_forcing_dmd.pt (Self-Forcing, the Wan2.1-T2V-1.3B student): {SELF_FORCING_URL}
  (download it yourself: the Missing Models dialog lists it but cannot download a .pt; Copy URL), or another CausVid / Self-Forcing
  checkpoint
- text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors (huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged)
- vae_approx/taew2_1.safetensors (huggingface.co/Kijai/WanVideo_comfy; taew2_1.pth from github.com/madebyollin/taehv
  loads too)"""


def wan_text(g: Graph, col: int, text: str, title: str = "Prompt") -> tuple[Node, Node]:
    """(text encoder, prompt) nodes."""
    clip = g.add(
        "CLIPLoader", "Load umT5-XXL", col, clip_name="umt5_xxl_fp8_e4m3fn_scaled.safetensors", type="wan"
    )
    return clip, g.add("CLIPTextEncode", title, col + 1, text=text, clip=clip[0])


def tiny_decoded_image(
    g: Graph, inputs: ImageInputs, tiny: Out, title: str, decode_title: str, save_height: int, prefix: str,
    **sampler_inputs,
) -> None:  # fmt: skip
    """The sampler with a tiny-VAE preview of each step, the tiny decode of its latent, its report, the image."""
    col = inputs.col
    sampler = fewstep_sampler(
        g,
        title,
        col,
        inputs.model,
        inputs.cond,
        inputs.latent,
        preview_vae=tiny,
        preview=True,
        **sampler_inputs,
    )
    image = g.add("FewStepTinyVAEDecode", decode_title, col + 1, tiny_vae=tiny, samples=sampler[0])
    g.add("PreviewAny", "Sampler report", col + 1, ui_height=200, source=sampler[1])
    g.add("SaveImage", "Save image", col + 2, ui_height=save_height, images=image[0], filename_prefix=prefix)


@dataclass(frozen=True)
class VideoInputs:
    """A causal Wan workflow's model, prompt and tiny VAE, and the first layout column after them."""

    model: Out
    cond: Out
    tiny: Out
    col: int


def self_forcing_inputs(g: Graph) -> VideoInputs:
    """The Self-Forcing student from its file, the prompt through umT5-XXL, TAEW2.1."""
    model = g.add(
        "FewStepDiTLoader", "FewStep DiT Loader (Self-Forcing)", 1, model_name="self_forcing_dmd.pt"
    )
    _, cond = wan_text(g, 1, VIDEO_PROMPT)
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (TAEW2.1)", 1, vae_name="taew2_1.safetensors")
    return VideoInputs(model[0], cond[0], tiny[0], col=3)


def dummy_wan_inputs(g: Graph) -> VideoInputs:
    """No files: dummy:wan-tiny, synthetic umT5-shaped embeddings, dummy TAEW2.1."""
    model = g.add("FewStepDiTLoader", "FewStep DiT Loader (dummy Wan)", 1, model_name="dummy:wan-tiny")
    cond = g.add("FewStepSyntheticConditioning", "Synthetic umT5 prompt", 1, pooled_width=0, guidance=0.0)
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (dummy TAEW2.1)", 1, vae_name="dummy:taew2_1")
    return VideoInputs(model[0], cond[0], tiny[0], col=2)


def causal_video(
    g: Graph, inputs: VideoInputs, title: str, report: str, prefix: str, latent_prefix: str = "", **widgets
) -> Node:
    """The causal video sampler and its report under it, right of the inputs, and the saved video in the next
    column; with ``latent_prefix`` the latent is saved too (in that column, the video moving one column on)."""
    video = g.add(
        "FewStepCausalVideoSampler", title, inputs.col, model=inputs.model, positive=inputs.cond,
        tiny_vae=inputs.tiny, **widgets,
    )  # fmt: skip
    g.add("PreviewAny", report, inputs.col, ui_height=200, source=video[3])
    if latent_prefix:
        g.add("SaveLatent", "Save latent", inputs.col + 1, samples=video[0], filename_prefix=latent_prefix)
    save_video(g, video[1], inputs.col + 1 + bool(latent_prefix), prefix)
    return video


def save_video(g: Graph, frames: Out, col: int, prefix: str) -> None:
    g.add(
        "SaveAnimatedWEBP",
        "Save video (16 fps)",
        col,
        ui_height=420,
        images=frames,
        filename_prefix=prefix,
        fps=16.0,
        lossless=False,
        quality=85,
        method="default",
    )
