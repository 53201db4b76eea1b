"""Interactive causal video (issue 32): image to video, video extension, video to video, and a prompt switch
that re-caches the KV window. Each real workflow encodes its input with core VAEEncode and the Wan 2.1 VAE; its
dummy twin encodes plain frames with the dummy TAEW2.1 (no files)."""

from __future__ import annotations

from .causal_video import continue_graph
from .graph import Graph, Out, workflow
from .nodes import IMAGE_BATCH_NOTE
from .parts import (
    VIDEO_PROMPT,
    VIDEO_PROMPT_2,
    WAN_FILES,
    VideoInputs,
    causal_video,
    dummy_wan_inputs,
    self_forcing_inputs,
)

WAN_VAE_FILE = (
    "- vae/wan_2.1_vae.safetensors (huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged), to encode the input"
)
STYLE_PROMPT = "a watercolor painting, soft washes of color, visible paper texture, loose brush strokes"
DUMMY_SIZE = dict(width=96, height=64, chunk_frames=2, window_frames=6, sink_frames=1, seed=7)
REAL_SIZE = dict(width=832, height=480, chunk_frames=3, window_frames=21, seed=7)


def wan_vae_encode(g: Graph, frames: Out, col: int, title: str) -> Out:
    """Core VAEEncode with the Wan 2.1 VAE: ComfyUI's raw Wan 2.1 LATENT, 1 + (frames - 1) / 4 latent frames."""
    vae = g.add("VAELoader", "Load VAE (Wan 2.1)", col, vae_name="wan_2.1_vae.safetensors")
    return g.add("VAEEncode", title, col, pixels=frames, vae=vae[0])[0]


def scaled(g: Graph, frames: Out, col: int) -> Out:
    """Frames resized and center-cropped to the video's size (the sampler refuses any other size)."""
    return g.add(
        "ImageScale", "Resize to 832x480", col, image=frames, upscale_method="lanczos", width=832, height=480,
        crop="center",
    )[0]  # fmt: skip


def input_video(g: Graph, col: int, frames: int = 0) -> Out:
    """The frames of ComfyUI/input/input.mp4 (the first ``frames`` of them when given), resized."""
    video = g.add("LoadVideo", "Input video", col, file="input.mp4")
    images = g.add("GetVideoComponents", "Video frames", col, video=video[0])[0]
    if frames:
        images = g.add("ImageFromBatch", f"First {frames} frames", col + 1, image=images, batch_index=0,
                       length=frames)[0]  # fmt: skip
    return scaled(g, images, col + 1)


def tiny_encoded(g: Graph, tiny: Out, count: int, title: str) -> Out:
    """``count`` plain 96x64 frames through the tiny VAE's encoder (4 frames per latent frame)."""
    frames = g.add("EmptyImage", title, 1, width=96, height=64, batch_size=count, color=0x3366CC)
    return g.add("FewStepTinyVAEEncode", "Tiny VAE encode", 2, tiny_vae=tiny, pixels=frames[0])[0]


@workflow("wan_causal_image_to_video")
def wan_causal_image_to_video(g: Graph) -> None:
    g.note = f"""Image to video with a causal Wan 2.1 student: the video starts at your image.

The image (ComfyUI/input, resized to 832x480) is encoded by the Wan 2.1 VAE into one latent frame and given to
the sampler's start_latent: it is committed to the KV cache before the first chunk (Self-Forcing's initial
latent), then 7 chunks of 3 latent frames continue it. The outputs start with the image's own frame, so the
saved video begins at the picture (1 + 84 frames at 16 fps). The report gives the prefill's seconds.

Files (ComfyUI/models/...):
{WAN_FILES}
{WAN_VAE_FILE}

No files? Open wan_causal_image_to_video_dummy.json."""
    inputs = self_forcing_inputs(g)
    picture = g.add("LoadImage", "Start image", 1, image="example.png")
    start = wan_vae_encode(g, scaled(g, picture[0], 2), 2, "Encode the image (Wan 2.1 VAE)")
    causal_video(g, inputs, "FewStep Causal Video Sampler (image to video)", "Report (prefill)",
                 "fewstep/wan_image_to_video", num_chunks=7, start_latent=start, **REAL_SIZE)  # fmt: skip


@workflow("wan_causal_image_to_video_dummy")
def wan_causal_image_to_video_dummy(g: Graph) -> None:
    g.note = """Image to video with no model files (random weights, CPU): a plain 96x64 picture encoded by the
dummy TAEW2.1 into one latent frame is the start latent; 3 chunks of 2 latent frames follow it. The video is
noise; the report shows the prefill.

Needs no files. For real video open wan_causal_image_to_video.json."""
    inputs = dummy_wan_inputs(g)
    start = tiny_encoded(g, inputs.tiny, 1, "Start image (plain)")
    causal_video(g, inputs, "FewStep Causal Video Sampler (image to video)", "Report (prefill)",
                 "fewstep/wan_image_to_video_dummy", num_chunks=3, start_latent=start, **DUMMY_SIZE)  # fmt: skip


@workflow("wan_causal_extend_video")
def wan_causal_extend_video(g: Graph) -> None:
    g.note = f"""Extend a video with a causal Wan 2.1 student.

The first 33 frames of ComfyUI/input/input.mp4 (resized to 832x480) are encoded by the Wan 2.1 VAE into 9 latent
frames (1 + 32 / 4) and given to the sampler's start_latent: committed to the KV cache in 3 blocks of 3 frames,
then 4 new chunks continue the video. A start takes a whole number of chunks or one frame more (here 9 = 3 x 3):
another clip length is refused with the lengths that fit. To extend from the end of a longer video, set the
batch_index of "First 33 frames" to its frame count minus 33. The saved video is the input followed by its
continuation.

Files (ComfyUI/models/...):
{WAN_FILES}
{WAN_VAE_FILE}

No files? Open wan_causal_extend_video_dummy.json."""
    inputs = self_forcing_inputs(g)
    start = wan_vae_encode(g, input_video(g, 1, frames=33), 2, "Encode the clip (Wan 2.1 VAE)")
    causal_video(g, inputs, "FewStep Causal Video Sampler (extension)", "Report (prefill)",
                 "fewstep/wan_extend_video", num_chunks=4, start_latent=start, **REAL_SIZE)  # fmt: skip


@workflow("wan_causal_extend_video_dummy")
def wan_causal_extend_video_dummy(g: Graph) -> None:
    g.note = """Video extension with no model files (random weights, CPU): 16 plain frames encoded by the dummy
TAEW2.1 into 4 latent frames (2 chunks) are the start; 2 chunks continue them. The video is noise.

Needs no files. For real video open wan_causal_extend_video.json."""
    inputs = dummy_wan_inputs(g)
    start = tiny_encoded(g, inputs.tiny, 16, "Clip to extend (16 plain frames)")
    causal_video(g, inputs, "FewStep Causal Video Sampler (extension)", "Report (prefill)",
                 "fewstep/wan_extend_video_dummy", num_chunks=2, start_latent=start, **DUMMY_SIZE)  # fmt: skip


@workflow("wan_causal_video_to_video")
def wan_causal_video_to_video(g: Graph) -> None:
    g.note = f"""Video to video: restyle a video chunk by chunk with a causal Wan 2.1 student (StreamDiffusionV2).

ComfyUI/input/input.mp4 (resized to 832x480) is encoded by the Wan 2.1 VAE and given to input_latent. Each
chunk takes the next 3 latent frames of it, noises them to strength 0.7 and denoises them under the prompt in
the schedule's steps below 0.7 (2 of 4), attending to the restyled chunks before it through the KV cache. Lower
strength keeps more of the input, 1.0 ignores it. num_chunks 7 covers 21 latent frames (81 video frames); a
shorter video makes fewer chunks (the report says how many).

Files (ComfyUI/models/...):
{WAN_FILES}
{WAN_VAE_FILE}

No files? Open wan_causal_video_to_video_dummy.json."""
    model = g.add(
        "FewStepDiTLoader", "FewStep DiT Loader (Self-Forcing)", 1, model_name="self_forcing_dmd.pt"
    )
    clip = g.add(
        "CLIPLoader", "Load umT5-XXL", 1, clip_name="umt5_xxl_fp8_e4m3fn_scaled.safetensors", type="wan"
    )
    style = g.add("CLIPTextEncode", "Style prompt", 2, text=STYLE_PROMPT, clip=clip[0])
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (TAEW2.1)", 1, vae_name="taew2_1.safetensors")
    source = wan_vae_encode(g, input_video(g, 1), 2, "Encode the video (Wan 2.1 VAE)")
    causal_video(g, VideoInputs(model[0], style[0], tiny[0], col=3), "FewStep Causal Video Sampler (restyle)",
                 "Report (video to video)", "fewstep/wan_video_to_video", num_chunks=7, input_latent=source,
                 strength=0.7, **REAL_SIZE)  # fmt: skip


@workflow("wan_causal_video_to_video_dummy")
def wan_causal_video_to_video_dummy(g: Graph) -> None:
    g.note = """Video to video with no model files (random weights, CPU): 24 plain frames are the input video
(input_images), encoded by the dummy TAEW2.1 into 6 latent frames; num_chunks asks for 4 chunks of 2 but the
input covers 3, so 3 are made, each restyled at strength 0.7. The video is noise; the report shows the chunks.

Needs no files. For real video open wan_causal_video_to_video.json."""
    inputs = dummy_wan_inputs(g)
    frames = g.add("EmptyImage", "Input video (24 plain frames)", 1, width=96, height=64, batch_size=24,
                   color=0x3366CC)  # fmt: skip
    causal_video(g, inputs, "FewStep Causal Video Sampler (restyle)", "Report (video to video)",
                 "fewstep/wan_video_to_video_dummy", num_chunks=4, input_images=frames[0], strength=0.7,
                 **DUMMY_SIZE)  # fmt: skip


@workflow("wan_causal_prompt_recache")
def wan_causal_prompt_recache(g: Graph) -> None:
    g.note = f"""Switch prompts with a KV re-cache (LongLive).

The first sampler generates 4 chunks; FewStep Causal Video Continue switches to the second prompt with recache
on: the K/V of the frames still in the window are recomputed from their clean latents under the new prompt
(one forward over the window), so the old prompt does not linger in the cache and the scene follows the new
prompt sooner than with the cross-attention switch alone (wan_causal_continue.json). The report gives the
re-cache's seconds beside the next chunk's.

{IMAGE_BATCH_NOTE}

Files (ComfyUI/models/...):
{WAN_FILES}

No files? Open wan_causal_prompt_recache_dummy.json."""
    model = g.add(
        "FewStepDiTLoader", "FewStep DiT Loader (Self-Forcing)", 1, model_name="self_forcing_dmd.pt"
    )
    clip = g.add(
        "CLIPLoader", "Load umT5-XXL", 1, clip_name="umt5_xxl_fp8_e4m3fn_scaled.safetensors", type="wan"
    )
    first = g.add("CLIPTextEncode", "First prompt", 2, text=VIDEO_PROMPT, clip=clip[0])
    second = g.add("CLIPTextEncode", "Second prompt", 2, text=VIDEO_PROMPT_2, clip=clip[0])
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (TAEW2.1)", 1, vae_name="taew2_1.safetensors")
    continue_graph(g, model[0], first[0], second[0], tiny[0], (832, 480), (4, 3, 3), 21,
                   "fewstep/wan_prompt_recache", recache=True)  # fmt: skip


@workflow("wan_causal_prompt_recache_dummy")
def wan_causal_prompt_recache_dummy(g: Graph) -> None:
    g.note = f"""A prompt switch with a KV re-cache, with no model files (random weights, CPU).

Same graph as wan_causal_prompt_recache.json: two synthetic prompts stand in for the text encoder; the report of
the Continue gives the re-cache's frames and seconds.

{IMAGE_BATCH_NOTE}

Needs no files."""
    model = g.add("FewStepDiTLoader", "FewStep DiT Loader (dummy Wan)", 1, model_name="dummy:wan-tiny")
    first = g.add(
        "FewStepSyntheticConditioning", "Synthetic prompt 1", 1, pooled_width=0, guidance=0.0, seed=1
    )
    second = g.add(
        "FewStepSyntheticConditioning", "Synthetic prompt 2", 2, pooled_width=0, guidance=0.0, seed=2
    )
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (dummy TAEW2.1)", 1, vae_name="dummy:taew2_1")
    continue_graph(g, model[0], first[0], second[0], tiny[0], (96, 64), (2, 2, 2), 6,
                   "fewstep/wan_prompt_recache_dummy", recache=True)  # fmt: skip
