"""Video to video, streamed: a session restyles input latent chunks as they arrive (StreamDiffusionV2's
``CausalStreamInferencePipeline``, chenfengxu714/StreamDiffusionV2 ``models/wan/causal_stream_inference.py``).

Each input chunk (``chunk_frames`` latent frames of an encoded input video) is noised to the start sigma
``strength`` (``(1 - s) x + s n``, the flow-matching interpolation their driver computes from ``noise_scale``) and
denoised by the causal model in the schedule's steps below that sigma (:func:`v2v_sigmas`), attending to the
rolling KV window. As in their loop there is no clean-context pass: the chunk's keys and values are the ones its
last denoising step wrote (one forward per chunk fewer than text to video). With the ``wan-v2v-4step`` schedule at
its first sigma this equals their loop within 1e-5 while their cache holds the stream
(``tests/engine/causal/test_v2v_streamdiffusionv2.py``); once their ring is full it is not a window (a chunk's
first denoising step overwrites the slot of the previous chunk's last step, its other steps evict the next one),
so a longer stream differs from theirs there, by design: ours evicts the oldest non-sink frame.

Of their additions: the fixed ``noise_scale`` / first timestep pair is ``strength``; their motion-aware noise
(``compute_noise_scale_and_step``: the noise scale follows the L2 distance of consecutive input frames, lagged
by 0.9) and the adaptive sink refresh (a sink frame whose keys drift from the newest frame's below a cosine
threshold is overwritten, per layer) and the stream batch over denoising steps (one forward holds the chunks of
every step, for pipeline parallelism on several GPUs) are not implemented: see ``docs/interactive-video.md``.

:class:`InputFrames` is a session's bounded queue of input latent frames (a live client feeds frames as they
arrive; a chunk takes ``chunk_frames`` of them).
"""

from __future__ import annotations

import numbers
from collections import deque

import torch

from ..checks import check_finite_number
from ..errors import InputError

MAX_QUEUED_CHUNKS = 8  # input chunks a session holds ahead of its generation (a faster producer is refused)


def check_strength(strength: float, input_name: str = "strength") -> float:
    """``strength`` in (0, 1]: the sigma an input chunk is noised to (1: pure noise, text to video)."""
    # a string or a bool would pass float() (or fail in it with a bare ValueError naming no input)
    if isinstance(strength, bool) or not isinstance(strength, numbers.Real):
        raise InputError(input_name, f"expected a number in (0, 1], got {strength!r}")
    check_finite_number(strength, input_name)
    strength = float(strength)
    if not 0.0 < strength <= 1.0:
        raise InputError(
            input_name,
            f"{strength} is not in (0, 1]: the share of noise an input chunk is restyled from (0.3 keeps most of "
            "the input, 1.0 ignores it)",
        )
    return strength


def v2v_sigmas(sigmas: torch.Tensor, strength: float) -> torch.Tensor:
    """The sigmas of a chunk restyled at ``strength``: ``strength`` itself, then the schedule's sigmas below it,
    then 0. With ``strength`` equal to a sigma of the schedule, the schedule's tail from there."""
    below = [float(s) for s in sigmas[:-1] if float(s) < strength - 1e-7]
    return torch.tensor([strength, *below, 0.0], dtype=sigmas.dtype)


def noised_input(latents: torch.Tensor, strength: float, noise: torch.Tensor) -> torch.Tensor:
    """``(1 - strength) x + strength n``: the input chunk at the start sigma of its denoising."""
    return (1.0 - strength) * latents + strength * noise


class InputFrames:
    """A bounded queue of input latent frames ``[B, C, h, w]`` each (float32 on the session's device)."""

    def __init__(self, batch: int, channels: int, latent_hw: tuple[int, int], chunk_frames: int):
        self.shape = (batch, channels, *latent_hw)
        self.chunk_frames = chunk_frames
        self.capacity = MAX_QUEUED_CHUNKS * chunk_frames
        self._frames: deque[torch.Tensor] = deque()

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self._frames)

    def push(self, latents: torch.Tensor, where: str | None = None, input_name: str = "input_video") -> int:
        """Queue ``latents [B, C, F, h, w]``; refused whole (nothing queued) if it does not fit the queue."""
        b, c, h, w = self.shape
        if (
            not isinstance(latents, torch.Tensor)
            or latents.ndim != 5
            or latents.shape[0] != b
            or latents.shape[1] != c
            or tuple(latents.shape[3:]) != (h, w)
        ):
            got = list(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
            raise InputError(
                input_name,
                f"input latents are {got}; this session takes [{b}, {c}, frames, {h}, {w}] (batch, Wan 2.1 "
                "latent channels, frames, the session's latent height and width)",
                where,
            )
        if not latents.is_floating_point() or not bool(torch.isfinite(latents).all()):
            raise InputError(input_name, "input latents must be finite floating-point values", where)
        frames = latents.shape[2]
        if len(self._frames) + frames > self.capacity:
            raise InputError(
                input_name,
                f"{frames} more input frames do not fit: {len(self._frames)} of {self.capacity} are queued "
                f"({MAX_QUEUED_CHUNKS} chunks ahead of the generation); send them after the next chunks",
                where,
            )
        for i in range(frames):
            self._frames.append(latents[:, :, i].detach().float().clone())
        return frames

    def ready(self) -> bool:
        return len(self._frames) >= self.chunk_frames

    def take(self) -> torch.Tensor:
        """The next chunk's input ``[B, C, chunk_frames, h, w]`` (removed from the queue)."""
        frames = [self._frames.popleft() for _ in range(self.chunk_frames)]
        return torch.stack(frames, dim=2)

    def peek(self) -> torch.Tensor:
        """The next chunk's input, left queued (a chunk that is interrupted takes it again)."""
        return torch.stack(list(self._frames)[: self.chunk_frames], dim=2)

    def drop(self) -> None:
        for _ in range(self.chunk_frames):
            self._frames.popleft()

    def clear(self) -> None:
        self._frames.clear()

    def state(self) -> list[torch.Tensor]:
        return list(self._frames)

    def load_state(self, frames: list[torch.Tensor]) -> None:
        self._frames = deque(frames)
