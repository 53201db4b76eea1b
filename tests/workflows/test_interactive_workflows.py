"""The interactive causal video workflows' dummy twins (image to video, extension, video to video, a prompt switch
with re-cache), run through the pack's nodes in this process; tests/e2e runs the same files on a real ComfyUI."""

from __future__ import annotations

import pytest
import torch
from test_workflows import load, run_in_process

# name -> (sampler title, its latent frames, its decoded video frames, lines its report holds)
SAMPLERS = {
    "wan_causal_image_to_video_dummy": (
        "FewStep Causal Video Sampler (image to video)", 7, 25, ("prefill: 1 start latent frame in ",),
    ),
    "wan_causal_extend_video_dummy": (
        "FewStep Causal Video Sampler (extension)", 8, 29, ("prefill: 4 start latent frames in ", "2+2 frames"),
    ),
    "wan_causal_video_to_video_dummy": (
        "FewStep Causal Video Sampler (restyle)", 6, 21,
        ("video to video: 3 chunks restyled at strength 0.7 (2 steps each), 6 of the input's 6 latent frames",),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_interactive_dummy_workflow_runs_through_the_nodes(name):
    title, latent_frames, video_frames, lines = SAMPLERS[name]
    latent, frames, session, report = run_in_process(load(f"{name}.api.json"))[title]
    assert tuple(latent["samples"].shape) == (1, 16, latent_frames, 8, 12)
    assert tuple(frames.shape) == (video_frames, 64, 96, 3)
    assert session.position == latent_frames
    for line in lines:
        assert line in report, report


def test_prompt_recache_dummy_workflow_runs_through_the_nodes():
    outputs = run_in_process(load("wan_causal_prompt_recache_dummy.api.json"))
    latent, frames, _, report = outputs["Continue: second prompt (KV re-cache)"]
    assert tuple(latent["samples"].shape) == (1, 16, 4, 8, 12) and tuple(frames.shape) == (16, 64, 96, 3)
    assert "re-cache: 4 window frames recomputed under the new prompt in " in report
    assert torch.isfinite(outputs["Join the frames"][0]).all()
