"""The clean latents of the frames a KV cache holds: what a re-cache (``recache.py``) recomputes their K/V from.

One preallocated ring of ``window_frames`` latent frames (float32, the denoised latents as the sampler returns
them), frame ``f`` at ring position ``f mod window_frames``: the frames a re-cache may need (every frame while the
stream is within the window, then the ring's ``window - sinks`` newest committed frames) never share a position,
and a chunk being generated only overwrites frames no re-cache needs once that chunk is committed (a switch
commits the pending chunk first). Its bytes are :func:`.bytes.clean_frames_bytes`, counted by the session's
memory preflight and a pool slot's size.
"""

from __future__ import annotations

import torch

from .bytes import CLEAN_LATENT_DTYPE
from .window import WindowSpec


class CleanFrames:
    def __init__(self, window: WindowSpec, batch: int, channels: int, latent_hw: tuple[int, int], device):
        self.window_frames = window.window_frames
        self.latents = torch.zeros(
            (batch, channels, self.window_frames, *latent_hw), dtype=CLEAN_LATENT_DTYPE, device=device
        )
        self.frames: list[int | None] = [None] * self.window_frames  # which frame each position holds

    @property
    def nbytes(self) -> int:
        return self.latents.nbytes

    def write(self, start: int, latents: torch.Tensor) -> None:
        """Keep ``latents [B, C, F, h, w]``, the clean latents of frames ``start .. start + F - 1``."""
        for i in range(latents.shape[2]):
            position = (start + i) % self.window_frames
            self.latents[:, :, position].copy_(latents[:, :, i])
            self.frames[position] = start + i

    def holds(self, frames: range) -> bool:
        return all(self.frames[f % self.window_frames] == f for f in frames)

    def read(self, frames: range) -> torch.Tensor:
        """The clean latents of ``frames`` ``[B, C, F, h, w]`` (each must still be kept)."""
        positions = [f % self.window_frames for f in frames]
        lost = [f for f, p in zip(frames, positions) if self.frames[p] != f]
        if lost:
            raise ValueError(f"the clean latents of frames {lost} are no longer kept")
        index = torch.tensor(positions, device=self.latents.device)
        return self.latents.index_select(2, index)

    def state(self) -> tuple[torch.Tensor, list[int | None]]:
        """What a swap or a snapshot keeps: the ring and which frame each position holds."""
        return self.latents, list(self.frames)

    def load_state(self, latents: torch.Tensor, frames: list[int | None]) -> None:
        self.latents.copy_(latents)
        self.frames = list(frames)
