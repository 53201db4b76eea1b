"""Prefill: a session that starts from clean latent frames (image to video, video extension), as Self-Forcing's
``CausalInferencePipeline.inference(initial_latent=...)`` does (guandeh17/Self-Forcing,
``pipeline/causal_inference.py``).

The given frames are committed into the KV cache in blocks, each one forward at timestep 0 (their loop's
``timestep * 0``: the frames are clean), with no denoising and no random draw; generation continues after them.
They count toward the frame positions and the window like generated frames (the first ``sink_frames`` of them
become the sinks), and their clean latents are kept for a later re-cache. Blocks as theirs:

* a whole number of chunks (``k x chunk_frames`` frames): ``k`` blocks of a chunk (video extension);
* one frame more (``1 + k x chunk_frames``, an image alone being ``1``): that first frame alone, then the
  blocks (their ``independent_first_frame``), so generation continues at frame 1, ``1 + c``, ...

A whole-chunk block runs through the session's step (compiled or captured: the same shapes and tensors as a
chunk's step, only the timestep differs); a lone first frame runs eagerly on the plain model through the cache's
partial forward (``KVCache.begin`` with fewer frames), so the steady step is neither recompiled nor recaptured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError


@dataclass(frozen=True)
class PrefillResult:
    frames: int  # latent frames committed
    blocks: tuple[int, ...]  # frames per forward
    latents: torch.Tensor  # [B, C, F, h, w] the given latents (model space, float32, CPU)
    decoded: torch.Tensor | None  # [B, k, 3, H, W] their frames through the stream decoder, with a tiny VAE
    seconds: float

    @property
    def seconds_per_frame(self) -> float:
        return self.seconds / self.frames


def prefill_blocks(frames: int, chunk_frames: int, input_name: str = "start_latent") -> list[int]:
    """The frames of each prefill forward for ``frames`` start frames (see the module docstring)."""
    c = chunk_frames
    if frames < 1:
        raise InputError(input_name, "the start latent holds no frames")
    if frames % c == 0:
        return [c] * (frames // c)
    if frames % c == 1:
        return [1] + [c] * (frames // c)
    raise InputError(
        input_name,
        f"{frames} latent frames do not split into the session's chunks of {c}: a start takes a whole number "
        f"of chunks ({c}, {2 * c}, ... frames: video extension) or one frame more ({1}, {1 + c}, "
        f"{1 + 2 * c}, ...: an image, or a video from the Wan VAE whose first frame is encoded alone)",
    )
