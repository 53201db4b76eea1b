"""Schedules equal their reference formulas, with the exact numbers of the reference samplers."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import math
import os
from pathlib import Path

import pytest
import torch

from fewstep.engine import InputError
from fewstep.engine.sampling import SCHEDULES, explicit_sigmas, schedule_sigmas
from fewstep.engine.sampling.schedules import flux2_mu


def _close(a, b, tol=1e-6):
    assert torch.allclose(
        torch.as_tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32), atol=tol
    ), a


# presets that start below pure noise: made for video to video at strength = their first sigma
PARTIAL_START = {"wan-v2v-4step"}


def test_every_schedule_ends_in_zero_and_decreases():
    for name, preset in SCHEDULES.items():
        s = schedule_sigmas(name)
        assert len(s) == preset.steps + 1 and s[-1] == 0, name
        assert (s[0] < 1) if name in PARTIAL_START else (s[0] == 1), name
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


def test_z_image_turbo_default_is_the_official_8_forwards():
    assert SCHEDULES["z-image-turbo"].steps == 8
    _close(schedule_sigmas("z-image-turbo"), [1.0, 0.954545, 0.9, 0.833333, 0.75, 0.642857, 0.5, 0.3, 0.0])
    # any step count: shift_3(linspace(1, 1/N, N)) then 0
    _close(
        schedule_sigmas("z-image-turbo", 9),
        [1.0, 0.96, 0.913043, 0.857143, 0.789474, 0.705882, 0.6, 0.461538, 0.272727, 0.0],
    )


@pytest.mark.parametrize(
    "tokens,steps,expected",
    [
        (4096, None, [1.0, 0.967384, 0.908144, 0.7672, 0.0]),  # 1024x1024, klein's 4 steps
        (1024, None, [1.0, 0.958085, 0.883982, 0.717497, 0.0]),  # 512x512
        (5120, None, [1.0, 0.918485, 0.789735, 0.555944, 0.0]),  # 1280x1024: above 4300, mu ignores steps
        (4096, 8, [1.0, 0.985425, 0.966641, 0.941515, 0.906183, 0.852842, 0.763014, 0.579807, 0.0]),
    ],
)
def test_flux2_klein_sigmas(tokens, steps, expected):
    _close(schedule_sigmas("flux.2-klein", steps, image_seq_len=tokens), expected)


def test_flux2_presets_and_mu():
    assert (SCHEDULES["flux.2-klein"].steps, SCHEDULES["flux.2-dev"].steps) == (4, 50)
    assert (SCHEDULES["flux.2-klein"].cfg, SCHEDULES["flux.2-dev"].cfg) == (1.0, 1.0)
    assert flux2_mu(4096, 4) == pytest.approx(2.2911799, abs=1e-6)
    assert flux2_mu(4096, 50) == pytest.approx(2.0233512, abs=1e-6)
    assert flux2_mu(6000, 4) == flux2_mu(6000, 50) == pytest.approx(0.00016927 * 6000 + 0.45666666)
    # dev is the same schedule at its 50 steps
    assert torch.equal(schedule_sigmas("flux.2-dev", image_seq_len=4096), schedule_sigmas("flux.2-klein", 50))
    # denoise: the tail of the 8-step schedule (mu read at 8 steps)
    _close(
        schedule_sigmas("flux.2-klein", 4, image_seq_len=4096, denoise=0.5),
        [0.906183, 0.852842, 0.763014, 0.579807, 0.0],
    )


# -- the official schedulers (optional: diffusers is a test dependency; Tongyi's scheduler from a checkout) --


def _diffusers():
    return pytest.importorskip("diffusers", reason="diffusers not installed (optional cross-check)")


@pytest.mark.parametrize("preset", ["flux.2-klein", "flux.2-dev"])
@pytest.mark.parametrize("width,height", [(1024, 1024), (512, 512), (1280, 1024), (768, 1344)])
@pytest.mark.parametrize("steps", [None, 4, 8, 28])
def test_flux2_matches_diffusers_flux2_pipelines(preset, width, height, steps):
    """Flux2KleinPipeline / Flux2Pipeline prepare their timesteps as: sigmas ``linspace(1, 1/N, N)``, ``mu =
    compute_empirical_mu(tokens, N)``, a dynamic-shifting (exponential) FlowMatchEulerDiscreteScheduler."""
    diffusers = _diffusers()
    np = pytest.importorskip("numpy")
    klein = pytest.importorskip("diffusers.pipelines.flux2.pipeline_flux2_klein")
    dev = pytest.importorskip("diffusers.pipelines.flux2.pipeline_flux2")
    n = steps or SCHEDULES[preset].steps
    tokens = (width // 16) * (height // 16)
    mu = klein.compute_empirical_mu(image_seq_len=tokens, num_steps=n)
    assert mu == dev.compute_empirical_mu(image_seq_len=tokens, num_steps=n) == flux2_mu(tokens, n)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, time_shift_type="exponential"
    )
    timesteps, forwards = klein.retrieve_timesteps(
        scheduler, n, "cpu", sigmas=np.linspace(1.0, 1 / n, n), mu=mu
    )
    ours = schedule_sigmas(preset, steps, image_seq_len=tokens)
    assert forwards == len(timesteps) == len(ours) - 1 == n
    assert (ours - scheduler.sigmas).abs().max().item() <= 1e-6


@pytest.mark.parametrize("steps", [None, 4, 9])
@pytest.mark.parametrize("width,height", [(1024, 1024), (512, 768)])
def test_z_image_turbo_matches_diffusers_zimage_pipeline(steps, width, height):
    """ZImagePipeline: ``get_default_z_image_sigmas(N)`` into Z-Image-Turbo's scheduler (shift 3, no dynamic
    shift: the ``mu`` it computes is unused), one forward per timestep, no final step skipped."""
    diffusers = _diffusers()
    try:
        zpipe = importlib.import_module("diffusers.pipelines.z_image.pipeline_z_image")
    except ImportError as err:
        pytest.skip(f"diffusers {diffusers.__version__} has no ZImagePipeline here: {str(err)[:100]}")
    n = steps or SCHEDULES["z-image-turbo"].steps
    tokens = (width // 16) * (height // 16)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    mu = zpipe.calculate_shift(tokens)
    timesteps, forwards = zpipe.retrieve_timesteps(
        scheduler, n, "cpu", sigmas=zpipe.get_default_z_image_sigmas(n), mu=mu
    )
    ours = schedule_sigmas("z-image-turbo", steps, image_seq_len=tokens)
    assert forwards == len(timesteps) == len(ours) - 1 == n
    assert (ours - scheduler.sigmas).abs().max().item() <= 1e-6


def _bfl_schedule_functions() -> dict:
    """``get_schedule`` and the two functions it calls, from black-forest-labs/flux2 ``src/flux2/sampling.py``
    in a checkout named by ``FEWSTEP_FLUX2_DIR``. The module imports torchvision, PIL and its model, so only these
    three function definitions are taken from it (they use ``math`` and ``torch``)."""
    root = os.environ.get("FEWSTEP_FLUX2_DIR")
    if not root:
        pytest.skip("FEWSTEP_FLUX2_DIR not set (a black-forest-labs/flux2 checkout; optional cross-check)")
    path = next(
        (p for p in (Path(root) / "src" / "flux2", Path(root) / "flux2") if (p / "sampling.py").is_file()),
        None,
    )
    if path is None:
        pytest.skip(f"no flux2/sampling.py under {root}")
    tree = ast.parse((path / "sampling.py").read_text())
    wanted = {"get_schedule", "compute_empirical_mu", "generalized_time_snr_shift"}
    defs = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    assert {d.name for d in defs} == wanted
    namespace = {"math": math, "torch": torch, "Tensor": torch.Tensor}
    exec(compile(ast.Module(body=defs, type_ignores=[]), str(path / "sampling.py"), "exec"), namespace)
    return namespace


@pytest.mark.parametrize("tokens", [256, 1024, 4096, 4300, 4301, 8192])
@pytest.mark.parametrize("steps", [1, 4, 28, 50])
def test_flux2_matches_bfl_get_schedule(tokens, steps):
    bfl = _bfl_schedule_functions()
    expected = torch.tensor(bfl["get_schedule"](steps, tokens))
    assert bfl["compute_empirical_mu"](tokens, steps) == flux2_mu(tokens, steps)
    assert (
        schedule_sigmas("flux.2-klein", steps, image_seq_len=tokens) - expected
    ).abs().max().item() <= 1e-6


def _tongyi_scheduler():
    root = os.environ.get("FEWSTEP_ZIMAGE_DIR")
    if not root:
        pytest.skip("FEWSTEP_ZIMAGE_DIR not set (a Tongyi-MAI/Z-Image checkout; optional cross-check)")
    path = Path(root) / "src" / "zimage" / "scheduler.py"
    if not path.is_file():
        pytest.skip(f"no src/zimage/scheduler.py under {root}")
    spec = importlib.util.spec_from_file_location("fewstep_test_tongyi_scheduler", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # numpy and torch only
    return module


@pytest.mark.parametrize("steps", [None, 4, 9])
def test_z_image_turbo_matches_tongyi_scheduler(steps):
    """Tongyi's pipeline: its scheduler (shift 3 from Z-Image-Turbo's config), ``sigma_min = 0`` before
    ``set_timesteps(N)``; it skips a step only when the last timestep is 0, which it never is."""
    module = _tongyi_scheduler()
    n = steps or SCHEDULES["z-image-turbo"].steps
    scheduler = module.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    scheduler.sigma_min = 0.0
    scheduler.set_timesteps(n, mu=0.7)
    assert len(scheduler.timesteps) == n and float(scheduler.timesteps[-1]) > 0
    ours = schedule_sigmas("z-image-turbo", steps)
    assert (ours - scheduler.sigmas).abs().max().item() <= 1e-6


def test_wan_dmd_4step_is_self_forcing_warped_list():
    s = schedule_sigmas("wan-dmd-4step")
    _close(s, [1.0, 0.9375, 0.8333333, 0.625, 0.0])
    _close(s[:-1] * 1000, [1000.0, 937.5, 833.3333, 625.0], 1e-3)


def test_wan_v2v_4step_is_streamdiffusionv2_warped_list():
    """[700, 500, 400, 200] at u = t / 1000 through shift 8 (``8u / (1 + 7u)``); N steps: the first N."""
    s = schedule_sigmas("wan-v2v-4step")
    _close(s, [5.6 / 5.9, 4.0 / 4.5, 3.2 / 3.8, 1.6 / 2.4, 0.0])
    _close(schedule_sigmas("wan-v2v-4step", 2), [5.6 / 5.9, 4.0 / 4.5, 0.0])
    assert SCHEDULES["wan-v2v-4step"].sampler == "dmd"
    with pytest.raises(InputError, match="input 'steps'.*4 timesteps \\[700, 500, 400, 200\\].*got 5 steps"):
        schedule_sigmas("wan-v2v-4step", 5)


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
