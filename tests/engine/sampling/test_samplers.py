"""Samplers on toy models with closed-form answers (1-D Gaussian data x0 ~ N(MU, S^2)).

* ``mmse``: the exact denoiser E[x0 | x_sigma] -- what a flow model trained by regression learns; the ODE it
  defines maps noise to the data distribution, so Euler converges to N(MU, S^2) as steps grow.
* ``flow_map``: the exact probability-flow map from sigma to 0 -- what a consistency / DMD student learns; it
  turns a correctly distributed x_sigma into an exact data sample, so re-noising samplers are exact at any
  step count.
* ``trajectory_model``: an x0 prediction whose DDIM jump to TCD's intermediate level s lands exactly on the
  ODE trajectory -- what TCD's training targets; TCD with any gamma must then be exact too, which checks its
  forward re-noising from s to the next sigma.
"""

from __future__ import annotations

import pytest
import torch

from fewstep.engine.sampling import FLOW, VE, sample_dmd, sample_euler, sample_lcm, sample_tcd

MU, S = 1.5, 0.5
N = 200_000


def _var(space, t):
    return (space.alpha(t) * S) ** 2 + t**2


def mmse(space):
    def f(x, sigma, **_):
        t = sigma.view(-1, 1)
        a = space.alpha(t)
        return MU + a * S**2 / _var(space, t) * (x - a * MU)

    return f


def flow_map(space, t_to=0.0):
    """ODE map from level t to level t_to for Gaussian data: affine, matching mean and std."""

    def f(x, sigma, **_):
        t = sigma.view(-1, 1)
        tt = torch.full_like(t, t_to)
        return space.alpha(tt) * MU + (_var(space, tt) / _var(space, t)).sqrt() * (x - space.alpha(t) * MU)

    return f


def trajectory_model(space, sigmas, gamma):
    nxt = {float(a): float(b) for a, b in zip(sigmas[:-1], sigmas[1:])}

    def f(x, sigma, **_):
        t = sigma.view(-1, 1)
        s = (1 - gamma) * nxt[float(sigma[0])]
        target = flow_map(space, s)(x, sigma)
        s = torch.tensor(s)
        a_t, a_s = space.alpha(t), space.alpha(s)
        # DDIM(t -> s) with x0_hat is a_s x0 + s (x - a_t x0) / t; solve for x0 giving target
        return (target - s * x / t) / (a_s - s * a_t / t)

    return f


def _start(space, sigmas):
    g = torch.Generator().manual_seed(1)
    x0 = MU + S * torch.randn(N, 1, generator=g)
    return space.noise_scaling(sigmas[0], torch.randn(N, 1, generator=g), x0)


def _stats(x):
    return float(x.mean()), float(x.std())


FLOW_4 = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
VE_4 = torch.tensor([14.6, 3.0, 1.0, 0.3, 0.0])


@pytest.mark.parametrize("space,sigmas", [(FLOW, FLOW_4), (VE, VE_4)])
@pytest.mark.parametrize("sampler", [sample_dmd, sample_lcm])
def test_renoising_samplers_are_exact_with_a_distilled_student(space, sigmas, sampler):
    out = sampler(
        flow_map(space),
        _start(space, sigmas),
        sigmas,
        extra_args={"seed": 3},
        disable=True,
        sigma_space=space,
    )
    mean, std = _stats(out)
    assert abs(mean - MU) < 0.01 and abs(std - S) < 0.005


@pytest.mark.parametrize("space,sigmas", [(FLOW, FLOW_4), (VE, VE_4)])
@pytest.mark.parametrize("gamma", [0.0, 0.3, 0.7, 1.0])
def test_tcd_is_exact_with_a_trajectory_consistent_model(space, sigmas, gamma):
    model = trajectory_model(space, sigmas, gamma)
    out = sample_tcd(
        model,
        _start(space, sigmas),
        sigmas,
        extra_args={"seed": 3},
        disable=True,
        gamma=gamma,
        sigma_space=space,
    )
    mean, std = _stats(out)
    assert abs(mean - MU) < 0.01 and abs(std - S) < 0.005


def test_euler_converges_to_the_data_distribution():
    """First-order method: the std error shrinks in proportion to the step size."""
    errors = []
    for steps in (25, 400):
        sigmas = torch.linspace(1, 0, steps + 1)
        mean, std = _stats(sample_euler(mmse(FLOW), _start(FLOW, sigmas), sigmas, disable=True))
        assert abs(mean - MU) < 0.01
        errors.append(abs(std - S))
    assert errors[0] < 0.04 and errors[1] < 0.003 and errors[1] < errors[0] / 8, errors


def test_one_step_dmd_with_a_plain_regression_model_collapses_to_the_mean():
    """Why few-step samplers need distilled students: the MMSE model's x0 is a posterior mean."""
    sigmas = torch.tensor([1.0, 0.0])
    mean, std = _stats(sample_dmd(mmse(FLOW), _start(FLOW, sigmas), sigmas, disable=True))
    assert abs(mean - MU) < 0.01 and std < 0.3 * S


def test_tcd_limits_equal_euler_and_dmd():
    x = _start(FLOW, FLOW_4)[:1000]
    model = mmse(FLOW)
    assert torch.allclose(
        sample_tcd(model, x, FLOW_4, gamma=0.0, disable=True),
        sample_euler(model, x, FLOW_4, disable=True),
        atol=1e-5,
    )
    assert torch.allclose(
        sample_tcd(model, x, FLOW_4, gamma=1.0, extra_args={"seed": 5}, disable=True),
        sample_dmd(model, x, FLOW_4, extra_args={"seed": 5}, disable=True),
        atol=1e-5,
    )


def test_euler_step_is_the_flow_update():
    x = torch.randn(3, 4)
    v = torch.randn(3, 4)

    def model(xx, sigma, **_):
        return xx - sigma.view(-1, 1) * v  # constant velocity v

    out = sample_euler(model, x, torch.tensor([1.0, 0.6, 0.0]), disable=True)
    assert torch.allclose(out, x - 1.0 * v, atol=1e-6)


def test_callback_and_seeded_noise():
    calls = []
    x = torch.randn(2, 3)
    a = sample_dmd(flow_map(FLOW), x, FLOW_4, extra_args={"seed": 7}, callback=calls.append, disable=True)
    b = sample_dmd(flow_map(FLOW), x, FLOW_4, extra_args={"seed": 7}, disable=True)
    c = sample_dmd(flow_map(FLOW), x, FLOW_4, extra_args={"seed": 8}, disable=True)
    assert [c["i"] for c in calls] == [0, 1, 2, 3]
    assert set(calls[0]) == {"x", "i", "sigma", "sigma_hat", "denoised"}
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_lcm_boundary_condition():
    from fewstep.engine.sampling.samplers import lcm_boundary_scalings

    c_skip, c_out = lcm_boundary_scalings(torch.tensor(0.0))
    assert float(c_skip) == 1.0 and float(c_out) == 0.0
    c_skip, c_out = lcm_boundary_scalings(torch.tensor(999.0))
    assert float(c_skip) < 1e-7 and abs(float(c_out) - 1.0) < 1e-7
    x = torch.randn(4, 2)
    plain = sample_lcm(flow_map(FLOW), x, FLOW_4, extra_args={"seed": 1}, disable=True)
    bc = sample_lcm(flow_map(FLOW), x, FLOW_4, extra_args={"seed": 1}, disable=True, boundary_condition=True)
    assert torch.allclose(plain, bc, atol=1e-5)  # c_skip ~ 0 at t >= 250


def test_tcd_rejects_bad_gamma():
    with pytest.raises(ValueError, match="gamma"):
        sample_tcd(mmse(FLOW), torch.zeros(1, 1), FLOW_4, gamma=1.5)
