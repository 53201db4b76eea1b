"""Residual classifier-free guidance (StreamDiffusion's RCFG) in rectified-flow terms, and the step update.

Flow matching: ``x_s = (1 - s) x0 + s n``; the model returns the velocity ``v = n - x0``, so
``x0_hat = x - s v`` and ``n_hat = x + (1 - s) v``. Both are affine in ``v`` with coefficients that depend only
on ``(x, s)``, so guidance written on eps (StreamDiffusion), on x0 or on the velocity is the same combination:

    v = v_u + g (v_c - v_u)            <=>   x0 = x0_u + g (x0_c - x0_u)

StreamDiffusion (DDPM ``x_t = a_t x0 + b_t eps``, LCM) replaces the unconditional eps by ``delta * stock_noise``,
where the stock noise starts as the noise added to the input frame and, after each step, becomes
``n_next + (a_next / b_next) (x0_hat - x0_stock)`` (``x0_stock``: the x0 the stock noise implies). By induction
that recursion has a closed form: ``stock_k = (x_k - a_k x_ref) / b_k``, the noise that explains the current
latent as a noisy copy of a fixed reference ``x_ref``. (Exact with LCM's boundary scalings c_skip = 0,
c_out = 1, which is what they are at the timesteps used; flow models have no boundary condition.) In flow
terms the unconditional prediction is therefore the one whose x0 *is* the reference:

    n_ref = (x_k - (1 - s_k) x_ref) / s_k,   v_u = n_ref - x_ref = (x_k - x_ref) / s_k
    x0_cfg = x_ref + g (x0_c - x_ref)

so guidance pushes each step's prediction away from the reference, towards the prompt. With the ``renoise``
sampler (StreamDiffusion's update: x0, then re-noise with the fixed noise of the next step) this closed form
*is* the official recursion (tests/engine/stream_batch/test_stream_batch.py runs both); with ``euler`` (the flow ODE step, which does
not re-noise) the recursion has no meaning of its own and the closed form defines the reference. The modes differ in
the reference and in how many rows the forward carries:

* ``none``  -- no guidance: ``v = v_c``.
* ``self``  -- ``x_ref = x_in``, the frame's own input latent (the noise actually added points back to it). No
  extra rows.
* ``initialize`` -- ``x_ref = x0_u = x_{s0} - s0 v_u(x_{s0}, s0)`` from a real unconditional (negative-prompt)
  forward at the frame's first step (one extra row per new frame), then reused for the frame's later steps.
* ``full`` -- a real unconditional forward at every step: ``2 N`` rows.

StreamDiffusion's ``delta`` scales the stock noise it uses as the unconditional eps (``eps_u = delta * stock``;
the recursion itself carries the unscaled stock noise, so the closed form above still holds). In flow terms:

    x0_u = delta x_ref + (1 - delta) x_k / (1 - s_k),   v_u = (x_k - x0_u) / s_k

which is ``(x_k - x_ref) / s_k`` at ``delta = 1`` (the default). ``delta != 1`` divides by ``1 - s``: it is
undefined at ``s = 1`` (a pure-noise first step, t_index 0 of an unshifted schedule), where an eps-parametrised
DDPM never goes (its alpha stays > 0); the config refuses that combination.

Guidance runs when ``guidance_scale != 1`` (the engine's CFG convention); StreamDiffusion runs it only when the
scale is > 1 (below 1 it silently drops the CFG).
"""

from __future__ import annotations

import torch


def residual_velocity(
    x: torch.Tensor, sigma: torch.Tensor, x_ref: torch.Tensor, delta: float = 1.0
) -> torch.Tensor:
    """The unconditional velocity of residual CFG: at ``delta = 1`` the one that denoises ``x`` to ``x_ref``;
    otherwise the stock noise scaled by ``delta`` (see the module docstring), which needs ``sigma < 1``."""
    if delta == 1.0:
        return (x - x_ref) / sigma
    x0_u = delta * x_ref + (1 - delta) * x / (1 - sigma)
    return (x - x0_u) / sigma


def guided_velocity(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    return v_uncond + scale * (v_cond - v_uncond)


def advance(
    sampler: str,
    x: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    velocity: torch.Tensor,
    noise_next: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step from ``sigma`` to ``sigma_next``: returns ``(x0_hat, x_next)``.

    ``euler``: ``x + (s' - s) v`` (the flow ODE; FLUX-schnell's sampler). ``renoise``: ``(1 - s') x0 + s' n'``
    with ``n'`` the fixed noise of the next step slot (StreamDiffusion's LCM update). At ``s' = 0`` both give x0.
    """
    x0 = x - sigma * velocity
    if sampler == "euler":
        return x0, x + (sigma_next - sigma) * velocity
    return x0, (1 - sigma_next) * x0 + sigma_next * noise_next
