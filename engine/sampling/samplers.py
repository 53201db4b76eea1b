"""Few-step samplers: small pure functions in k-diffusion's calling convention.

``sample_x(model, x, sigmas, extra_args=None, callback=None, disable=None, ...)``: ``model(x, sigma, **extra_args)``
returns the *denoised* estimate (x0) for a batch at noise level ``sigma [B]``; ``sigmas`` is a decreasing
schedule ending in 0; ``x`` enters already noised to ``sigmas[0]``. The same functions drive the engine's own
models and, wrapped as ComfyUI ``KSAMPLER`` objects, ComfyUI's native models.

The noise level ``sigma`` means different things in different parametrisations; samplers that re-noise need
to know which (``sigma_space``):

* :data:`FLOW` (rectified flow: FLUX, SD3, Wan, Z-Image): ``x = (1 - sigma) * x0 + sigma * noise``;
* :data:`VE` (k-diffusion's variance-exploding view of eps/v models: SD1.5, SDXL): ``x = x0 + sigma * noise``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import trange


@dataclass(frozen=True)
class SigmaSpace:
    """``x_sigma = alpha(sigma) * x0 + sigma * noise``."""

    name: str
    alpha: Callable[[torch.Tensor], torch.Tensor]

    def noise_scaling(self, sigma, noise: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        return self.alpha(sigma) * x0 + sigma * noise


FLOW = SigmaSpace("flow", lambda s: 1 - s)
VE = SigmaSpace("ve", lambda s: torch.ones_like(s) if isinstance(s, torch.Tensor) else 1.0)


def default_noise_sampler(x: torch.Tensor, seed: int | None = None):
    """Fresh Gaussian noise per call, from a generator seeded once (ComfyUI's convention for the seed)."""
    generator = None
    if seed is not None:
        generator = torch.Generator(device=x.device).manual_seed(seed)
    return lambda sigma, sigma_next: torch.randn(
        x.size(), dtype=x.dtype, layout=x.layout, device=x.device, generator=generator
    )


def _report(callback, x, i, sigma, denoised):
    if callback is not None:
        callback({"x": x, "i": i, "sigma": sigma, "sigma_hat": sigma, "denoised": denoised})


@torch.no_grad()
def sample_euler(model, x, sigmas, extra_args=None, callback=None, disable=None):
    """First-order ODE step; for a flow model exactly ``x += (sigma_next - sigma) * velocity``."""
    extra_args = {} if extra_args is None else extra_args
    s_in = x.new_ones([x.shape[0]])
    for i in trange(len(sigmas) - 1, disable=disable):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        _report(callback, x, i, sigmas[i], denoised)
        d = (x - denoised) / sigmas[i]
        x = x + d * (sigmas[i + 1] - sigmas[i])
    return x


# Latent Consistency Models' boundary condition (Luo et al. 2023; diffusers LCMScheduler): the consistency
# function is c_skip(t) * x + c_out(t) * x0_pred with t on the 0..1000 training-timestep scale.
LCM_SIGMA_DATA = 0.5
LCM_TIMESTEP_SCALING = 10.0


def lcm_boundary_scalings(timestep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scaled = timestep * LCM_TIMESTEP_SCALING
    c_skip = LCM_SIGMA_DATA**2 / (scaled**2 + LCM_SIGMA_DATA**2)
    c_out = scaled / (scaled**2 + LCM_SIGMA_DATA**2) ** 0.5
    return c_skip, c_out


@torch.no_grad()
def sample_lcm(
    model,
    x,
    sigmas,
    extra_args=None,
    callback=None,
    disable=None,
    noise_sampler=None,
    sigma_space=FLOW,
    boundary_condition=False,
    timestep_of_sigma=None,
):
    """Multistep consistency sampling (LCM): x0 from the consistency function, re-noised to the next sigma.

    With ``boundary_condition=False`` (the default, ComfyUI's ``lcm``) the model's x0 is used as is: that is
    DMD's update, and :func:`sample_dmd` is this function with the default. With ``boundary_condition=True``
    the LCM scheduler's ``c_skip * x + c_out * x0`` is applied, with ``t = timestep_of_sigma(sigma)`` (default ``1000 * sigma``,
    the flow-matching timestep); it only matters for t below ~1 where c_skip is not negligible.
    """
    extra_args = {} if extra_args is None else extra_args
    if noise_sampler is None:
        noise_sampler = default_noise_sampler(x, seed=extra_args.get("seed"))
    timestep_of_sigma = timestep_of_sigma or (lambda s: s * 1000.0)
    s_in = x.new_ones([x.shape[0]])
    for i in trange(len(sigmas) - 1, disable=disable):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        if boundary_condition:
            c_skip, c_out = lcm_boundary_scalings(timestep_of_sigma(sigmas[i]))
            denoised = c_skip * x + c_out * denoised
        _report(callback, x, i, sigmas[i], denoised)
        x = denoised
        if sigmas[i + 1] > 0:
            x = sigma_space.noise_scaling(sigmas[i + 1], noise_sampler(sigmas[i], sigmas[i + 1]), denoised)
    return x


def sample_dmd(
    model, x, sigmas, extra_args=None, callback=None, disable=None, noise_sampler=None, sigma_space=FLOW
):
    """Distribution-matching-distilled students (DMD2, CausVid, Self-Forcing): predict x0, then re-noise it
    with *fresh* noise to the next sigma. Nothing of the current noise survives a step.

    That is LCM's multistep update without its boundary condition, so it runs :func:`sample_lcm` with
    ``boundary_condition=False``; the name stays because the causal video students are sampled by it.
    """
    return sample_lcm(
        model, x, sigmas, extra_args, callback, disable, noise_sampler, sigma_space, boundary_condition=False
    )


@torch.no_grad()
def sample_tcd(
    model,
    x,
    sigmas,
    extra_args=None,
    callback=None,
    disable=None,
    noise_sampler=None,
    gamma=0.3,
    sigma_space=FLOW,
):
    """Trajectory Consistency Distillation's strategic stochastic sampling (Zheng et al. 2024).

    From sigma, go deterministically (DDIM, using the model's x0 and implied noise) to the earlier level
    ``s = (1 - gamma) * sigma_next``, then forward-diffuse from ``s`` to ``sigma_next`` with fresh noise.
    ``gamma = 0`` is the deterministic DDIM/Euler step, ``gamma = 1`` re-noises x0 completely (as LCM/DMD).
    The forward transition keeps the marginals exact: ``x_next = a * x_s + sqrt(sigma_next^2 - a^2 s^2) * z``
    with ``a = alpha(sigma_next) / alpha(s)``.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"TCD gamma must be in [0, 1], got {gamma}")
    extra_args = {} if extra_args is None else extra_args
    if noise_sampler is None:
        noise_sampler = default_noise_sampler(x, seed=extra_args.get("seed"))
    s_in = x.new_ones([x.shape[0]])
    alpha = sigma_space.alpha
    for i in trange(len(sigmas) - 1, disable=disable):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        denoised = model(x, sigma * s_in, **extra_args)
        _report(callback, x, i, sigma, denoised)
        eps = (x - alpha(sigma) * denoised) / sigma
        s = (1.0 - gamma) * sigma_next
        x = alpha(s) * denoised + s * eps
        if sigma_next > 0 and gamma > 0:
            a = alpha(sigma_next) / alpha(s)
            extra = (sigma_next**2 - (a * s) ** 2).clamp(min=0.0).sqrt()
            x = a * x + extra * noise_sampler(sigma, sigma_next)
    return x


SAMPLERS: dict[str, Callable] = {
    "euler": sample_euler,
    "dmd": sample_dmd,
    "lcm": sample_lcm,
    "tcd": sample_tcd,
}
# Samplers that throw away the current noise each step (a step cache can never reuse across them).
RENOISING_SAMPLERS = frozenset({"dmd", "lcm", "tcd"})
