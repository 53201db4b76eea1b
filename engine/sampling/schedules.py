"""Noise schedules: functions returning a decreasing ``sigmas`` tensor (float32) that ends in 0.

``sigma`` is the flow-matching noise level (``x = (1 - sigma) x0 + sigma noise``); the model timestep is
``1000 * sigma`` for every family here. Each preset reproduces its model's reference sampler; the default step
count is the reference's, and each step is one DiT forward (two with CFG):

==================  =====  =============================================================================
preset              steps  sigmas
==================  =====  =============================================================================
flux.1-schnell      4      ``linspace(1, 0, N + 1)`` -- unshifted (BFL ``get_schedule(shift=False)``)
flux.1-dev          28     ``linspace(1, 0, N + 1)`` through ``time_shift(mu)``, ``mu`` linear in the
                           image token count from 0.5 at 256 tokens to 1.15 at 4096 (BFL ``get_schedule``)
flux.2-klein        4      ``linspace(1, 0, N + 1)`` through ``time_shift(mu)`` with FLUX.2's empirical
                           ``mu(tokens, N)`` (below); the distilled klein 4B / 9B run 4 steps, no CFG
                           (guidance 1), no guidance embedding
flux.2-dev          50     the same schedule at 50 steps; dev's distilled guidance (4 by default) is
                           embedded, it comes with the conditioning (FluxGuidance), not from CFG
sd3-turbo           4      ``shift_3(linspace(1, shift_3(0.001), N))`` then 0 -- diffusers
                           ``FlowMatchEulerDiscreteScheduler(shift=3)`` and the SD3.5 reference, which both
                           apply the shift to an already-shifted ``sigma_min``: [1, .8577, .6022, .0089, 0]
z-image-turbo       8      ``shift_3(linspace(1, 1/N, N))`` then 0 = 8 DiT forwards, the official count
                           ("8 NFEs"). Tongyi-MAI/Z-Image ``inference.py``: 8 steps, guidance 0, its
                           scheduler with ``sigma_min = 0`` (``linspace(1000, 0, N + 1)[:-1] / 1000``,
                           shift 3, no dynamic shift); diffusers 0.42 ``ZImagePipeline``: the same sigmas
                           (``linspace(1, 1/N, N)`` into ``FlowMatchEulerDiscreteScheduler(shift=3)``), 8
                           steps in its example. The first diffusers pipeline's ``num_inference_steps=9``
                           made ``linspace(1, 0, 9)``, shifted, and skipped the final ``t = 0`` step:
                           also these 8 forwards. (This preset said 9 steps before: 9 forwards, one more
                           than the reference.)
wan-dmd-4step       4      Self-Forcing's ``denoising_step_list`` [1000, 750, 500, 250] warped through the
                           shift-5 flow table: ``shift_5(1 - k/N)`` then 0 = [1, .9375, .8333, .625, 0]
wan-v2v-4step       4      StreamDiffusionV2's video-to-video ``denoising_step_list`` [700, 500, 400, 200]
                           (``configs/wan_causal_dmd_v2v.yaml``, its final 0 dropped as ``t2v: false``
                           does) warped through their shift-8 flow table (``warp_denoising_step: true``):
                           ``shift_8(t / 1000)`` then 0 = [.9492, .8889, .8421, .6667, 0]. ``N`` steps
                           take the first ``N`` timesteps (their ``--step N``), so at most 4. Made for
                           video to video at ``strength`` = its first sigma (``v2v_sigmas`` then gives
                           the list unchanged); text to video on it starts from noise scaled by .9492
==================  =====  =============================================================================

``shift_s(u) = s u / (1 + (s - 1) u)``; ``time_shift(mu)(t) = e^mu / (e^mu + 1/t - 1)``.

FLUX.2's ``mu`` (black-forest-labs/flux2 ``src/flux2/sampling.py``: ``get_schedule`` ->
``compute_empirical_mu`` and ``generalized_time_snr_shift(t, mu, 1.0)``; diffusers 0.42
``pipeline_flux2.compute_empirical_mu``, copied into ``pipeline_flux2_klein``, whose scheduler shifts
``linspace(1, 1/N, N)`` by the same ``mu`` -- the same points, ``time_shift`` maps 0 to 0): for an image of
``L`` tokens (one token per 16x16 px) and ``N`` steps, ``mu = a2 L + b2`` above 4300 tokens; otherwise ``mu``
is linear in ``N`` through ``mu(N=10) = a1 L + b1`` and ``mu(N=200) = a2 L + b2``, with ``a1 = 8.73809524e-5``,
``b1 = 1.89833333``, ``a2 = 1.6927e-4``, ``b2 = 0.45666666``. So fewer steps shift harder: 1024x1024 (4096
tokens) at 4 steps has ``mu = 2.2912``, at 50 steps ``mu = 2.0234``.

``denoise < 1`` follows ComfyUI: build the schedule for ``int(steps / denoise)`` steps and keep its last
``steps + 1`` sigmas (FLUX.2's ``mu`` then reads the longer step count).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import InputError


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """Static flow shift ``s u / (1 + (s - 1) u)`` (SD3, Wan, Z-Image)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def time_shift(mu: float, sigmas: torch.Tensor) -> torch.Tensor:
    """FLUX's exponential time shift ``e^mu / (e^mu + 1/t - 1)``; maps 1 -> 1 and 0 -> 0."""
    return math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))


def flux_mu(image_seq_len: int, base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """Resolution dependence of FLUX.1-dev's shift: linear in tokens, 256 -> base, 4096 -> max."""
    m = (max_shift - base_shift) / (4096 - 256)
    return m * image_seq_len + (base_shift - m * 256)


def flux2_mu(image_seq_len: int, steps: int) -> float:
    """FLUX.2's empirical shift (BFL ``compute_empirical_mu``): see the module docstring."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    mu_200 = a2 * image_seq_len + b2
    if image_seq_len > 4300:
        return float(mu_200)
    mu_10 = a1 * image_seq_len + b1
    slope = (mu_200 - mu_10) / 190.0
    return float(slope * steps + (mu_200 - 200.0 * slope))


def _with_zero(sigmas: torch.Tensor) -> torch.Tensor:
    return torch.cat([sigmas.float(), sigmas.new_zeros(1)])


def flux_schnell_sigmas(steps: int, image_seq_len: int | None = None) -> torch.Tensor:
    return torch.linspace(1, 0, steps + 1)


def flux_dev_sigmas(steps: int, image_seq_len: int) -> torch.Tensor:
    return time_shift(flux_mu(image_seq_len), torch.linspace(1, 0, steps + 1))


def flux2_sigmas(steps: int, image_seq_len: int) -> torch.Tensor:
    """FLUX.2 (klein and dev): BFL ``get_schedule(num_steps, image_seq_len)``."""
    return time_shift(flux2_mu(image_seq_len, steps), torch.linspace(1, 0, steps + 1))


def sd3_turbo_sigmas(steps: int, image_seq_len: int | None = None, shift: float = 3.0) -> torch.Tensor:
    sigma_min = shift_sigmas(torch.tensor(1 / 1000), shift)
    return _with_zero(shift_sigmas(torch.linspace(1.0, float(sigma_min), steps), shift))


def z_image_turbo_sigmas(steps: int, image_seq_len: int | None = None, shift: float = 3.0) -> torch.Tensor:
    return _with_zero(shift_sigmas(torch.linspace(1.0, 1.0 / steps, steps), shift))


def wan_dmd_sigmas(steps: int, image_seq_len: int | None = None, shift: float = 5.0) -> torch.Tensor:
    timesteps = torch.linspace(1000, 0, steps + 1)[:-1]
    return _with_zero(shift_sigmas(timesteps / 1000, shift))


STREAMDIFFUSIONV2_TIMESTEPS = (700, 500, 400, 200)  # configs/wan_causal_dmd_v2v.yaml, without its final 0


def wan_v2v_sigmas(steps: int, image_seq_len: int | None = None, shift: float = 8.0) -> torch.Tensor:
    """StreamDiffusionV2's first ``steps`` timesteps through their shift-8 table (see the module docstring).
    Their warp indexes the table ``shift(linspace(1, 0, 1001))`` at ``1000 - t``: the point ``u = t / 1000``."""
    if steps > len(STREAMDIFFUSIONV2_TIMESTEPS):
        raise InputError(
            "steps",
            f"wan-v2v-4step has StreamDiffusionV2's {len(STREAMDIFFUSIONV2_TIMESTEPS)} timesteps "
            f"{list(STREAMDIFFUSIONV2_TIMESTEPS)} (N steps take the first N), got {steps} steps",
        )
    timesteps = torch.tensor(STREAMDIFFUSIONV2_TIMESTEPS[:steps], dtype=torch.float32)
    return _with_zero(shift_sigmas(timesteps / 1000, shift))


def explicit_sigmas(values: Sequence[float] | str, input_name: str = "sigmas") -> torch.Tensor:
    """A user's list, e.g. ``"1, 0.75, 0.5, 0.25"``; a final 0 is appended when missing."""
    if isinstance(values, str):
        try:
            values = [float(v) for v in values.replace(",", " ").split()]
        except ValueError as exc:
            raise InputError(input_name, f"expected numbers separated by commas, got {values!r}") from exc
    values = list(values)
    for i, v in enumerate(values):
        # NaN compares false with everything, so the ordering check below would let it through
        if not math.isfinite(float(v)):
            raise InputError(
                input_name, f"sigma {i} is {float(v)}: not a finite number; sigmas are numbers in [0, 1]"
            )
    sig = torch.tensor(values, dtype=torch.float32)
    if sig.numel() == 0:
        raise InputError(input_name, "the sigma list is empty")
    if sig[-1] != 0:
        sig = _with_zero(sig)
    if sig.numel() < 2 or bool((sig[1:] >= sig[:-1]).any()) or bool(sig[0] > 1) or bool((sig < 0).any()):
        raise InputError(
            input_name, f"sigmas must be strictly decreasing within [0, 1] and end in 0, got {sig.tolist()}"
        )
    return sig


@dataclass(frozen=True)
class SchedulePreset:
    name: str
    steps: int
    sigmas: Callable[[int, int], torch.Tensor]
    sampler: str
    cfg: float
    description: str


SCHEDULES: dict[str, SchedulePreset] = {
    p.name: p
    for p in (
        SchedulePreset(
            "flux.1-schnell", 4, flux_schnell_sigmas, "euler", 1.0, "FLUX.1-schnell: 4 steps, unshifted"
        ),
        SchedulePreset(
            "flux.1-dev",
            28,
            flux_dev_sigmas,
            "euler",
            1.0,
            "FLUX.1-dev: 28 steps, shift grows with resolution (guidance is embedded, not CFG)",
        ),
        SchedulePreset(
            "flux.2-klein",
            4,
            flux2_sigmas,
            "euler",
            1.0,
            "FLUX.2 klein 4B / 9B (distilled): 4 steps, no CFG, shift grows with resolution, falls with steps",
        ),
        SchedulePreset(
            "flux.2-dev",
            50,
            flux2_sigmas,
            "euler",
            1.0,
            "FLUX.2-dev: 50 steps, FLUX.2's shift (guidance 4 is embedded: it comes with the conditioning)",
        ),
        SchedulePreset("sd3-turbo", 4, sd3_turbo_sigmas, "euler", 1.0, "SD3.5-Large-Turbo: 4 steps, shift 3"),
        SchedulePreset(
            "z-image-turbo",
            8,
            z_image_turbo_sigmas,
            "euler",
            1.0,
            "Z-Image-Turbo: 8 steps (8 DiT forwards, the official count), shift 3, no CFG",
        ),
        SchedulePreset(
            "wan-dmd-4step",
            4,
            wan_dmd_sigmas,
            "dmd",
            1.0,
            "Self-Forcing / CausVid DMD students: [1000, 750, 500, 250] warped by shift 5",
        ),
        SchedulePreset(
            "wan-v2v-4step",
            4,
            wan_v2v_sigmas,
            "dmd",
            1.0,
            "StreamDiffusionV2 video to video: [700, 500, 400, 200] warped by shift 8 (strength = .9492)",
        ),
    )
}


def schedule_sigmas(
    preset: str,
    steps: int | None = None,
    image_seq_len: int = 4096,
    denoise: float = 1.0,
    input_name: str = "schedule",
) -> torch.Tensor:
    """Sigmas of a preset for ``steps`` steps (the preset's own count when None) and a denoise strength."""
    if preset not in SCHEDULES:
        raise InputError(input_name, f"unknown schedule {preset!r}; known: {', '.join(SCHEDULES)}")
    p = SCHEDULES[preset]
    steps = p.steps if steps is None else int(steps)
    if steps < 1:
        raise InputError("steps", f"expected at least 1 step, got {steps}")
    if not 0.0 < denoise <= 1.0:
        raise InputError("denoise", f"expected a value in (0, 1], got {denoise}")
    if denoise < 1.0:
        total = int(steps / denoise)
        return p.sigmas(total, image_seq_len)[-(steps + 1) :].float()
    return p.sigmas(steps, image_seq_len).float()


def trim_for_denoise(sigmas: torch.Tensor, denoise: float) -> torch.Tensor:
    """For an explicit list: keep the tail whose first sigma is at most ``denoise`` (at least one step)."""
    if denoise >= 1.0:
        return sigmas
    keep = int((sigmas[:-1] <= denoise + 1e-6).sum())
    return sigmas[-(max(keep, 1) + 1) :]
