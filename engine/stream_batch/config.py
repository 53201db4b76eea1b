"""Settings of a stream batch: which timesteps, how many frames per push, which residual-CFG mode, the filter.

``t_index_list`` indexes the sigmas of a schedule preset of the engine (``schedule`` for ``schedule_steps``
steps, e.g. ``flux.1-schnell`` at 50 steps: ``sigma_i = 1 - i / 50``). Indices must be strictly increasing,
which makes the sigmas strictly decreasing (the first index is the noisiest step), and lie in
``[0, schedule_steps - 1]`` (so every step sigma is > 0; the last step always lands on 0). The first sigma is the
img2img strength: the input latent is noised to ``(1 - s0) x_in + s0 n``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import InputError
from ..sampling import SCHEDULES, schedule_sigmas

CFG_MODES = ("none", "self", "initialize", "full")
STREAM_SAMPLERS = ("euler", "renoise")


def parse_t_index_list(value: str | Sequence[int], input_name: str = "t_index_list") -> tuple[int, ...]:
    """``"16, 32"`` (commas or spaces) or a sequence of ints -> a tuple of ints (range is checked later)."""
    if isinstance(value, str):
        parts = value.replace(",", " ").split()
        try:
            value = [int(p) for p in parts]
        except ValueError as exc:
            raise InputError(
                input_name, f"expected whole numbers separated by commas (e.g. '16,32'), got {value!r}"
            ) from exc
    out = tuple(int(v) for v in value)
    if not out:
        raise InputError(input_name, "the list is empty; give at least one schedule index, e.g. '16,32'")
    return out


@dataclass(frozen=True)
class StreamConfig:
    t_index_list: tuple[int, ...] = (16, 32)
    schedule: str = "flux.1-schnell"
    schedule_steps: int = 50
    sampler: str = "euler"  # "euler": the flow ODE step; "renoise": StreamDiffusion's LCM update, fixed noise
    frame_buffer_size: int = 1
    cfg_mode: str = "none"
    guidance_scale: float = 1.2
    delta: float = 1.0  # StreamDiffusion's scale on the stock noise (self / initialize); see .guidance
    similarity_threshold: float = 1.0  # >= 1: the filter is off
    max_skip_frames: int = 10

    @property
    def steps(self) -> int:
        return len(self.t_index_list)

    @property
    def cfg_active(self) -> bool:
        """CFG runs in modes other than 'none' when the scale is not 1 (the engine's convention)."""
        return self.cfg_mode != "none" and self.guidance_scale != 1.0

    @property
    def needs_negative(self) -> bool:
        return self.cfg_active and self.cfg_mode in ("initialize", "full")

    def check(self) -> None:
        if self.schedule not in SCHEDULES:
            raise InputError("schedule", f"unknown schedule {self.schedule!r}; known: {', '.join(SCHEDULES)}")
        if self.schedule_steps < 1:
            raise InputError("schedule_steps", f"expected at least 1 step, got {self.schedule_steps}")
        idx = self.t_index_list
        if not idx:
            raise InputError(
                "t_index_list", "the list is empty; give at least one schedule index, e.g. '16,32'"
            )
        bad = [i for i in idx if not 0 <= i < self.schedule_steps]
        if bad:
            raise InputError(
                "t_index_list",
                f"indices {bad} are out of range: {self.schedule} at {self.schedule_steps} steps has indices "
                f"0..{self.schedule_steps - 1} (index i is the sigma before step i; the final 0 is implied)",
            )
        if any(b <= a for a, b in zip(idx, idx[1:], strict=False)):
            raise InputError(
                "t_index_list",
                f"{list(idx)} is not strictly increasing; indices must increase so that the sigmas strictly "
                "decrease (first the noisiest step), e.g. '16,32'",
            )
        if self.sampler not in STREAM_SAMPLERS:
            raise InputError(
                "sampler", f"unknown sampler {self.sampler!r}; known: {', '.join(STREAM_SAMPLERS)}"
            )
        if self.frame_buffer_size < 1:
            raise InputError("frame_buffer_size", f"expected at least 1, got {self.frame_buffer_size}")
        if self.cfg_mode not in CFG_MODES:
            raise InputError("cfg_mode", f"unknown CFG mode {self.cfg_mode!r}; known: {', '.join(CFG_MODES)}")
        if not math.isfinite(self.delta) or self.delta < 0:
            raise InputError(
                "delta", f"expected a scale >= 0 on the stock noise (1: unscaled), got {self.delta}"
            )
        if not 0.0 <= self.similarity_threshold <= 1.0:
            raise InputError(
                "similarity_threshold",
                f"expected a cosine similarity in [0, 1] (1 turns the filter off), got {self.similarity_threshold}",
            )
        if self.max_skip_frames < 0:
            raise InputError("max_skip_frames", f"expected 0 or more, got {self.max_skip_frames}")

    def step_sigmas(self, image_seq_len: int) -> torch.Tensor:
        """``[T + 1]`` float32: the sigma of each step, then 0 (where the last step lands)."""
        self.check()
        full = schedule_sigmas(self.schedule, self.schedule_steps, image_seq_len=image_seq_len)
        picked = full[list(self.t_index_list)].float()
        if bool((picked <= 0).any()) or bool((picked[1:] >= picked[:-1]).any()):
            raise InputError(
                "t_index_list",
                f"{list(self.t_index_list)} picks sigmas {[round(float(s), 4) for s in picked]} from "
                f"{self.schedule}; they must be > 0 and strictly decreasing",
            )
        uses_delta = self.cfg_active and self.cfg_mode in ("self", "initialize") and self.delta != 1.0
        if uses_delta and float(picked[0]) >= 1.0:
            raise InputError(
                "delta",
                f"delta {self.delta:g} scales the stock noise, which is undefined at sigma 1 (t_index "
                f"{self.t_index_list[0]} of {self.schedule} is pure noise); start at a later index or use delta 1",
            )
        return torch.cat([picked, picked.new_zeros(1)])

    def rows_per_forward(self, occupied_steps: int | None = None, new_group: bool = True) -> int:
        """Rows of the one DiT forward that advances the buffer.

        ``occupied_steps`` is how many of the T step slots hold a frame group (T in the steady state, fewer
        during warm-up and flush); ``new_group`` whether a group entered at the first step in this forward.
        Steady state: none / self ``T * fb``; initialize ``(T + 1) * fb``; full ``2 * T * fb``; with
        ``guidance_scale == 1`` every mode makes ``T * fb``.
        """
        fb = self.frame_buffer_size
        n = (self.steps if occupied_steps is None else occupied_steps) * fb
        if not self.cfg_active:
            return n
        if self.cfg_mode == "full":
            return 2 * n
        if self.cfg_mode == "initialize" and new_group:
            return n + fb
        return n

    def describe(self, sigmas: torch.Tensor | None = None) -> str:
        cfg = "off" if not self.cfg_active else f"{self.cfg_mode} x{self.guidance_scale:g}"
        if self.cfg_active and self.cfg_mode in ("self", "initialize") and self.delta != 1.0:
            cfg += f" delta {self.delta:g}"
        sig = "" if sigmas is None else f" (sigmas {', '.join(f'{float(s):.3g}' for s in sigmas[:-1])})"
        return (
            f"T={self.steps} steps: t_index_list {','.join(map(str, self.t_index_list))} of {self.schedule} "
            f"x{self.schedule_steps}{sig}, frame buffer {self.frame_buffer_size}, sampler {self.sampler}, CFG {cfg}"
        )
