"""Few-step samplers and schedules (k-diffusion conventions)."""

from .samplers import (
    FLOW,
    RENOISING_SAMPLERS,
    SAMPLERS,
    VE,
    SigmaSpace,
    default_noise_sampler,
    sample_dmd,
    sample_euler,
    sample_lcm,
    sample_tcd,
)
from .schedules import SCHEDULES, SchedulePreset, explicit_sigmas, schedule_sigmas

__all__ = [
    "FLOW",
    "VE",
    "SigmaSpace",
    "SAMPLERS",
    "RENOISING_SAMPLERS",
    "SCHEDULES",
    "SchedulePreset",
    "default_noise_sampler",
    "explicit_sigmas",
    "sample_dmd",
    "sample_euler",
    "sample_lcm",
    "sample_tcd",
    "schedule_sigmas",
]
