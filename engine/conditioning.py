"""Text conditioning as the engine sees it (converted from ComfyUI's CONDITIONING by the nodes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TextCondition:
    """One prompt's encoding.

    ``context [B, L, D]`` text-encoder tokens (T5 for FLUX), ``pooled [B, P]`` the pooled vector (CLIP-L for
    FLUX, absent for models without one), ``guidance`` the distilled-guidance strength for models with a
    guidance embedding (FLUX.1-dev), ignored by models without one.
    """

    context: torch.Tensor
    pooled: torch.Tensor | None = None
    guidance: float | None = None

    def to(self, device, dtype) -> TextCondition:
        pooled = None if self.pooled is None else self.pooled.to(device, dtype)
        return TextCondition(self.context.to(device, dtype), pooled, self.guidance)

    def repeat_to(self, batch: int) -> TextCondition:
        """Tile the prompts over ``batch`` latents as ComfyUI does (``[c0, c1, c0, c1]`` for 2 -> 4)."""
        n = self.context.shape[0]
        if n == batch:
            return self
        if batch % n:
            raise ValueError(f"conditioning batch {n} does not divide latent batch {batch}")
        reps = batch // n
        pooled = None if self.pooled is None else self.pooled.repeat(reps, 1)
        return TextCondition(self.context.repeat(reps, 1, 1), pooled, self.guidance)
