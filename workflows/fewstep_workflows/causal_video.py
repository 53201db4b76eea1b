"""Causal Wan video: a streamed session, its continuation with a new prompt, and a long run with a quantized
KV window (issue 5)."""

from __future__ import annotations

from .graph import Graph, Out, workflow
from .nodes import IMAGE_BATCH_NOTE
from .parts import (
    VIDEO_PROMPT,
    VIDEO_PROMPT_2,
    WAN_FILES,
    causal_video,
    dummy_wan_inputs,
    save_video,
    self_forcing_inputs,
    wan_text,
)


@workflow("wan_causal_stream")
def wan_causal_stream(g: Graph) -> None:
    g.note = f"""Text to streaming video with a causal Wan 2.1 student (Self-Forcing / CausVid), decoded by TAEW2.1.

The video is generated 3 latent frames (12 video frames) at a time; each chunk takes 4 denoising steps and
attends to earlier chunks through a rolling KV cache, so memory stays flat. Each chunk is decoded by the tiny
VAE as soon as it is done and shown on the node. The session output can be continued
(wan_causal_continue.json). 7 chunks = 21 latent frames = 81 frames at 16 fps.

Files (ComfyUI/models/...):
{WAN_FILES}

No files? Open wan_causal_stream_dummy.json."""
    causal_video(
        g, self_forcing_inputs(g), "FewStep Causal Video Sampler", "Report", "fewstep/wan_stream",
        latent_prefix="fewstep/wan_stream", width=832, height=480, num_chunks=7, chunk_frames=3, window_frames=21,
        sink_frames=0, seed=7,
    )  # fmt: skip


@workflow("wan_causal_stream_dummy")
def wan_causal_stream_dummy(g: Graph) -> None:
    g.note = """Causal chunk-by-chunk video with no model files (random weights; a few seconds on a CPU).

dummy:wan-tiny is a tiny Wan-shaped transformer and dummy:taew2_1 a TAEW2.1-shaped decoder, both with seeded
random weights: the saved video is noise. It exercises the KV window (6 latent frames, 1 sink frame: the
oldest frames are evicted from chunk 3 on), the streaming decode and the report.

Needs no files. For real video open wan_causal_stream.json."""
    causal_video(
        g, dummy_wan_inputs(g), "FewStep Causal Video Sampler", "Report", "fewstep/wan_stream_dummy", width=96,
        height=64, num_chunks=4, chunk_frames=2, window_frames=6, sink_frames=1, seed=7,
    )  # fmt: skip


def continue_graph(
    g: Graph,
    model: Out,
    first: Out,
    second: Out,
    tiny: Out,
    size: tuple[int, int],
    chunks: tuple,
    window: int,
    prefix: str,
    recache: bool = False,
) -> None:
    video = g.add(
        "FewStepCausalVideoSampler",
        "Video: first prompt",
        3,
        model=model,
        positive=first,
        width=size[0],
        height=size[1],
        num_chunks=chunks[0],
        chunk_frames=chunks[2],
        window_frames=window,
        seed=7,
        tiny_vae=tiny,
    )
    switch = {"recache": True} if recache else {}  # off is the input's default (the CausVid switch)
    more = g.add(
        "FewStepCausalContinue",
        "Continue: second prompt" + (" (KV re-cache)" if recache else ""),
        3,
        session=video[2],
        num_chunks=chunks[1],
        positive=second,
        **switch,
    )
    frames = g.add("ImageBatch", "Join the frames", 4, image1=video[1], image2=more[1])
    g.add("PreviewAny", "Report (continuation)", 4, ui_height=200, source=more[3])
    save_video(g, frames[0], 5, prefix)


@workflow("wan_causal_continue")
def wan_causal_continue(g: Graph) -> None:
    g.note = f"""Continue a causal video with a new prompt (CausVid-style prompt switching).

The first sampler generates 4 chunks; FewStep Causal Video Continue carries the same session on for 3 more
chunks with the second prompt. Only the cross-attention (text) cache is rebuilt: the KV cache keeps the video,
so motion and content carry across the switch. Both parts' frames are joined and saved as one video.

{IMAGE_BATCH_NOTE}

Files (ComfyUI/models/...):
{WAN_FILES}

No files? Open wan_causal_continue_dummy.json."""
    model = g.add(
        "FewStepDiTLoader", "FewStep DiT Loader (Self-Forcing)", 1, model_name="self_forcing_dmd.pt"
    )
    clip, first = wan_text(g, 1, VIDEO_PROMPT, "First prompt")
    second = g.add("CLIPTextEncode", "Second prompt", 2, text=VIDEO_PROMPT_2, clip=clip[0])
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (TAEW2.1)", 1, vae_name="taew2_1.safetensors")
    continue_graph(
        g, model[0], first[0], second[0], tiny[0], (832, 480), (4, 3, 3), 21, "fewstep/wan_continue"
    )


@workflow("wan_causal_continue_dummy")
def wan_causal_continue_dummy(g: Graph) -> None:
    g.note = f"""Continue a causal video session with a new prompt, with no model files (random weights).

Same graph as wan_causal_continue.json: two synthetic prompts stand in for the text encoder.

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
    continue_graph(
        g, model[0], first[0], second[0], tiny[0], (96, 64), (2, 2, 2), 6, "fewstep/wan_continue_dummy"
    )


@workflow("wan_causal_long_int8")
def wan_causal_long_int8(g: Graph) -> None:
    g.note = f"""A long causal video with the KV window stored in int8.

20 chunks of 3 latent frames (237 video frames, ~15 s at 16 fps) through a 21-frame rolling window with 3
sink frames. The newest completed chunk stays in bf16; older chunks are quantized to int8 once, when they
age out (about half the KV memory; int4 is about a quarter). The report shows KV bytes and how many frames
are quantized. Memory stays flat however long the stream runs.

Files (ComfyUI/models/...):
{WAN_FILES}

No files? Open wan_causal_long_int8_dummy.json."""
    causal_video(
        g, self_forcing_inputs(g), "FewStep Causal Video Sampler (int8 KV)", "Report (KV bytes)",
        "fewstep/wan_long_int8", width=832, height=480, num_chunks=20, chunk_frames=3, window_frames=21,
        sink_frames=3, seed=7, kv_dtype="int8", keep_recent_chunks=1,
    )  # fmt: skip


@workflow("wan_causal_long_int8_dummy")
def wan_causal_long_int8_dummy(g: Graph) -> None:
    g.note = """A quantized KV window with no files (random weights, CPU): 6 chunks through a 6-frame window,
older chunks in int4 (keep_recent_chunks 1). The report gives KV bytes and the frames quantized. Noise output.

Needs no files. For real video open wan_causal_long_int8.json."""
    causal_video(
        g, dummy_wan_inputs(g), "FewStep Causal Video Sampler (int4 KV)", "Report (KV bytes)",
        "fewstep/wan_long_int4_dummy", width=96, height=64, num_chunks=6, chunk_frames=2, window_frames=6,
        sink_frames=1, seed=7, kv_dtype="int4", keep_recent_chunks=1,
    )  # fmt: skip
