"""Schedules equal their reference formulas, with the exact numbers of the reference samplers."""

from __future__ import annotations

import math

import pytest
import torch

from fewstep.engine import InputError
from fewstep.engine.sampling import SCHEDULES, explicit_sigmas, schedule_sigmas


def _close(a, b, tol=1e-6):
    assert torch.allclose(
        torch.as_tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32), atol=tol
    ), a


def test_every_schedule_ends_in_zero_and_decreases():
    for name, preset in SCHEDULES.items():
        s = schedule_sigmas(name)
        assert len(s) == preset.steps + 1 and s[-1] == 0 and s[0] == 1, name
        assert bool((s[1:] < s[:-1]).all()), name
        assert s.dtype == torch.float32


def test_flux_schnell_is_unshifted():
    _close(schedule_sigmas("flux.1-schnell"), [1.0, 0.75, 0.5, 0.25, 0.0])


@pytest.mark.parametrize("tokens,mu", [(256, 0.5), (4096, 1.15), (1024, 0.5 + 0.65 * 768 / 3840)])
def test_flux_dev_shift_depends_on_resolution(tokens, mu):
    s = schedule_sigmas("flux.1-dev", image_seq_len=tokens)
    assert len(s) == 29
    t = torch.linspace(1, 0, 29)
    expected = [math.exp(mu) / (math.exp(mu) + (1 / float(v) - 1)) if v > 0 else 0.0 for v in t]
    _close(s, expected, 1e-6)


def test_sd3_turbo_matches_diffusers_flow_match_euler_shift_3():
    _close(schedule_sigmas("sd3-turbo"), [1.0, 0.85769230, 0.60215056, 0.00892857, 0.0])


def test_z_image_turbo():
    _close(
        schedule_sigmas("z-image-turbo"),
        [1.0, 0.96, 0.913043, 0.857143, 0.789474, 0.705882, 0.6, 0.461538, 0.272727, 0.0],
    )
    # the first diffusers pipeline's "9 steps = 8 DiT forwards" schedule is this preset at 8 steps
    _close(schedule_sigmas("z-image-turbo", 8), [1.0, 0.954545, 0.9, 0.833333, 0.75, 0.642857, 0.5, 0.3, 0.0])


def test_wan_dmd_4step_is_self_forcing_warped_list():
    s = schedule_sigmas("wan-dmd-4step")
    _close(s, [1.0, 0.9375, 0.8333333, 0.625, 0.0])
    _close(s[:-1] * 1000, [1000.0, 937.5, 833.3333, 625.0], 1e-3)


def test_denoise_keeps_the_tail_of_a_longer_schedule():
    _close(schedule_sigmas("flux.1-schnell", 4, denoise=0.5), [0.5, 0.375, 0.25, 0.125, 0.0])


def test_explicit_lists():
    _close(explicit_sigmas("1, 0.6, 0.2"), [1.0, 0.6, 0.2, 0.0])
    _close(explicit_sigmas([0.9, 0.5, 0.0]), [0.9, 0.5, 0.0])
    with pytest.raises(InputError, match="strictly decreasing"):
        explicit_sigmas("0.5, 0.7")
    with pytest.raises(InputError, match="numbers separated by commas"):
        explicit_sigmas("1, x")
    with pytest.raises(InputError, match="empty"):
        explicit_sigmas("")


def test_bad_schedule_inputs():
    with pytest.raises(InputError, match="unknown schedule 'flux-dev'; known: flux.1-schnell"):
        schedule_sigmas("flux-dev")
    with pytest.raises(InputError, match="input 'steps'"):
        schedule_sigmas("flux.1-schnell", 0)
    with pytest.raises(InputError, match="input 'denoise'"):
        schedule_sigmas("flux.1-schnell", 4, denoise=1.5)
