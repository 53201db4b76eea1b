"""The stream batch (issue 9): StreamDiffusion-style img2img over a frame sequence on FLUX.1-schnell."""

from __future__ import annotations

from .graph import Graph, Node, Out, workflow
from .nodes import IMAGE_BATCH_NOTE
from .parts import flux_text, save_video

STREAM_FILES = """- diffusion_models/flux1-schnell.safetensors
- vae_approx/taef1.safetensors (both halves in one file: huggingface.co/madebyollin/taef1's diffusion_pytorch_model.safetensors, saved under this name; taef1_encoder.pth + taef1_decoder.pth from github.com/madebyollin/taesd load too): both halves are used
- text_encoders/t5xxl_fp16.safetensors and text_encoders/clip_l.safetensors
- input/: a short video to stylise (frames of equal size, multiples of 16 px)"""


def stream_batch(g: Graph, model: Out, tiny: Out, frames: Out, cond: Out, col: int, **widgets) -> Node:
    return g.add(
        "FewStepStreamBatch",
        "FewStep Stream Batch (2 steps per frame)",
        col,
        model=model,
        tiny_vae=tiny,
        frames=frames,
        positive=cond,
        **widgets,
    )


def stylize_frames(g: Graph, model: Out, cond: Out, dummy: bool, prefix: str, **schedule) -> None:
    """The stream batch over a frame sequence, its report and the saved video.

    The frames are an input video's, encoded by TAEF1; in a dummy twin six plain 64x64 frames (three blue,
    then three orange, so the similarity filter has repeats to skip) through dummy:taef1.
    """
    if dummy:
        tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (dummy TAEF1)", 1, vae_name="dummy:taef1")
        blue = g.add("EmptyImage", "Frames 1-3 (blue)", 2, width=64, height=64, batch_size=3, color=0x3366CC)
        orange = g.add(
            "EmptyImage", "Frames 4-6 (orange)", 2, width=64, height=64, batch_size=3, color=0xEE8833
        )
        frames = g.add("ImageBatch", "Frame sequence", 2, image1=blue[0], image2=orange[0])
    else:
        video = g.add("LoadVideo", "Input video", 1, file="input.mp4")
        frames = g.add("GetVideoComponents", "Video frames", 2, video=video[0])
        tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (TAEF1)", 2, vae_name="taef1.safetensors")
    out = stream_batch(
        g,
        model,
        tiny[0],
        frames[0],
        cond,
        3,
        similarity_threshold=0.98,
        max_skip_frames=10,
        seed=42,
        **schedule,
    )
    g.add("PreviewAny", "Report (fps, frames skipped)", 3, ui_height=200, source=out[1])
    save_video(g, out[0], 4, prefix)


@workflow("flux_schnell_stream_batch")
def flux_schnell_stream_batch(g: Graph) -> None:
    g.note = f"""Stylise a frame sequence in realtime style: StreamDiffusion's stream batch on FLUX.1-schnell.

Each frame is encoded by TAEF1, noised to the first of the t_index_list steps and denoised through the
listed steps (here steps 2 and 3 of schnell's own 4-step grid: sigmas 0.5 and 0.25, like img2img at denoise
0.5; "1,2,3" keeps more of the prompt, "3" more of the input); frames at different steps share one batched forward, so the throughput is one frame per DiT
forward while each frame still gets every listed step. Near-identical consecutive frames are skipped
(similarity_threshold < 1). The report gives frames per second and frames skipped. The output has as many
frames as the input.

Files (ComfyUI/models/... and ComfyUI/input/):
{STREAM_FILES}

No files? Open flux_schnell_stream_batch_dummy.json."""
    model = g.add(
        "FewStepDiTLoader", "FewStep DiT Loader (FLUX.1-schnell)", 1, model_name="flux1-schnell.safetensors"
    )
    cond = flux_text(g, 1)
    stylize_frames(
        g, model[0], cond[0], False, "fewstep/stream_batch", t_index_list="2,3", schedule="flux.1-schnell",
        schedule_steps=4,
    )  # fmt: skip


@workflow("flux_schnell_stream_batch_dummy")
def flux_schnell_stream_batch_dummy(g: Graph) -> None:
    g.note = f"""The stream batch with no model files (random weights, CPU, seconds).

Six 64x64 frames: three blue, then three orange. With similarity_threshold 0.98 the filter skips repeats of
a near-identical frame (seeded, so the same frames every run) and the report says which. Random weights: the
output frames are noise.

{IMAGE_BATCH_NOTE}

Needs no files. For real stylisation open flux_schnell_stream_batch.json."""
    model = g.add("FewStepDiTLoader", "FewStep DiT Loader (dummy weights)", 1, model_name="dummy:flux-tiny")
    cond = g.add("FewStepSyntheticConditioning", "Synthetic conditioning (no text encoder)", 1)
    stylize_frames(
        g, model[0], cond[0], True, "fewstep/stream_batch_dummy", t_index_list="20,35", schedule="flux.1-schnell",
        schedule_steps=50,
    )  # fmt: skip
