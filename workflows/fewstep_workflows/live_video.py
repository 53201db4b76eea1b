"""Live video (issue 33): the FewStep Live Video node serving sessions to clients until it is stopped. The real
workflow encodes clients' prompts with umT5-XXL on the server; its dummy twin runs with no files (synthetic prompt
embeddings, random weights) and stops by itself shortly after its last session closes."""

from __future__ import annotations

from .graph import Graph, Node, Out, workflow
from .parts import WAN_FILES

PROTOCOL_NOTE = """How to use it: queue this workflow once, then from a client (python -m fewstep live --server
http://127.0.0.1:8188 --script script.json, or your own code) open a session with POST /fewstep/live/sessions
(prompt, seed, your websocket clientId): the answer holds the session id and its secret. Each chunk arrives as a
fewstep.chunk event on your websocket only as soon as it is made; steer the session with POST
/fewstep/live/sessions/<id>/control (a new prompt, with or without re-cache; a seed; stop), the secret in the
X-FewStep-Secret header. Stop the node with Cancel (or POST /fewstep/live/stop); its report shows each session's
metrics. While it runs, ComfyUI's queue is busy: prompts queued meanwhile run after it returns."""


def live_video(g: Graph, model: Out, tiny: Out, col: int, clip: Out | None = None, **widgets) -> Node:
    """The live node and its report under it."""
    links = {"clip": clip} if clip is not None else {}
    live = g.add(
        "FewStepLiveVideo", "FewStep Live Video", col, model=model, tiny_vae=tiny, **links, **widgets
    )
    g.add("PreviewAny", "Report (per session metrics)", col, ui_height=260, source=live[0])
    return live


@workflow("live_video")
def live_video_real(g: Graph) -> None:
    g.note = f"""Live video from ComfyUI: a causal Wan 2.1 student (Self-Forcing) served to several clients at once,
each steering its own session while it runs.

Up to 4 sessions share the model; their chunks (3 latent frames, 12 video frames at 832x480) are batched into
one forward per denoising step. Clients' prompts are text, encoded on the server by umT5-XXL (a prompt sent again
is not encoded twice). TAEW2.1 decodes each chunk into a clip. The node stops after an hour, after 5 minutes with
no session open, on Cancel or on POST /fewstep/live/stop.

{PROTOCOL_NOTE}

Files (ComfyUI/models/...):
{WAN_FILES}

No files? Open live_video_dummy.json."""
    model = g.add(
        "FewStepDiTLoader", "FewStep DiT Loader (Self-Forcing)", 1, model_name="self_forcing_dmd.pt"
    )
    clip = g.add(
        "CLIPLoader", "Load umT5-XXL", 1, clip_name="umt5_xxl_fp8_e4m3fn_scaled.safetensors", type="wan"
    )
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (TAEW2.1)", 1, vae_name="taew2_1.safetensors")
    live_video(g, model[0], tiny[0], 2, clip=clip[0], width=832, height=480, chunk_frames=3, window_frames=21,
               sink_frames=0)  # fmt: skip


@workflow("live_video_dummy")
def live_video_dummy(g: Graph) -> None:
    g.note = f"""Live video with no model files (random weights, CPU): the protocol end to end in seconds.

dummy:wan-tiny at 96x64, chunks of 2 latent frames, dummy TAEW2.1. With no text encoder connected, clients'
prompts become synthetic embeddings (a deterministic function of the text: the same as python -m fewstep
stream --script uses, so a live run and an engine run of one script give the same latents). The video is noise.
This twin stops 15 s after its last session closed (idle_seconds; raise it to have more time to connect).

{PROTOCOL_NOTE}

Needs no files. For real video open live_video.json."""
    model = g.add("FewStepDiTLoader", "FewStep DiT Loader (dummy Wan)", 1, model_name="dummy:wan-tiny")
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (dummy TAEW2.1)", 1, vae_name="dummy:taew2_1")
    live_video(g, model[0], tiny[0], 2, width=96, height=64, chunk_frames=2, window_frames=6, sink_frames=1,
               max_seconds=600.0, idle_seconds=15.0)  # fmt: skip
