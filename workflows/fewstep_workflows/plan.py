"""The cost planner (issue 10): the bill of a job before it is queued."""

from __future__ import annotations

from .graph import SELF_FORCING_URL, Graph, workflow


@workflow("cost_plan")
def cost_plan(g: Graph) -> None:
    g.note = f"""The bill of a job before you queue it: FLOPs per DiT forward, number of forwards, weight and
KV-cache bytes, and predicted seconds on a chosen GPU at a chosen efficiency (MFU).

Left: FLUX.1-schnell at 1024x1024 in 4 steps on an H200. Right: causal Wan 2.1-1.3B, 81 frames at 832x480,
chunks of 3 latent frames, a 21-frame window, KV in int8. Width / height / steps 0 mean "the model's usual".
The planner reads only the model's configuration (load the file you would sample with).

Files (ComfyUI/models/diffusion_models/): flux1-schnell.safetensors, self_forcing_dmd.pt ({SELF_FORCING_URL}:
the Missing Models dialog lists it but cannot download a .pt; download it yourself).
No files? Open cost_plan_dummy.json."""
    flux = g.add(
        "FewStepDiTLoader", "FewStep DiT Loader (FLUX.1-schnell)", 1, model_name="flux1-schnell.safetensors"
    )
    bill = g.add(
        "FewStepCostPlan", "Cost plan: schnell 1024 px, 4 steps", 2, model=flux[0], width=1024, height=1024,
        steps=4, gpu="h200",
    )  # fmt: skip
    g.add("PreviewAny", "Bill (FLUX)", 3, ui_height=320, source=bill[0])
    wan = g.add("FewStepDiTLoader", "FewStep DiT Loader (Self-Forcing)", 1, model_name="self_forcing_dmd.pt")
    video = g.add(
        "FewStepCostPlan", "Cost plan: causal video 81 frames", 2, model=wan[0], width=832, height=480, steps=4,
        gpu="h200", frames=81, chunk_frames=3, window_frames=21, kv_dtype="int8",
    )  # fmt: skip
    g.add("PreviewAny", "Bill (video)", 3, ui_height=320, source=video[0])


@workflow("cost_plan_dummy")
def cost_plan_dummy(g: Graph) -> None:
    g.note = """The cost planner on the tiny dummy presets (no files): FLUX-tiny at 256x256 in 4 steps, and
Wan-tiny causal video with an int4 KV cache. The same node gives the bill of the real models (cost_plan.json).
The JSON output is what `python -m fewstep plan --json` prints."""
    flux = g.add("FewStepDiTLoader", "FewStep DiT Loader (dummy FLUX)", 1, model_name="dummy:flux-tiny")
    bill = g.add(
        "FewStepCostPlan",
        "Cost plan: FLUX-tiny",
        2,
        model=flux[0],
        width=256,
        height=256,
        steps=4,
        gpu="h100",
    )
    g.add("PreviewAny", "Bill (FLUX-tiny)", 3, ui_height=320, source=bill[0])
    g.add("PreviewAny", "Bill as JSON", 3, ui_height=200, source=bill[1])
    wan = g.add("FewStepDiTLoader", "FewStep DiT Loader (dummy Wan)", 1, model_name="dummy:wan-tiny")
    video = g.add(
        "FewStepCostPlan", "Cost plan: Wan-tiny video", 2, model=wan[0], width=96, height=64, steps=4,
        gpu="h100", frames=29, chunk_frames=2, window_frames=6, sink_frames=1, kv_dtype="int4",
    )  # fmt: skip
    g.add("PreviewAny", "Bill (Wan-tiny)", 3, ui_height=320, source=video[0])
