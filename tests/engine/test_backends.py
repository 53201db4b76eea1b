"""A run's backends: SDPA equals written-out softmax attention; the attention backend and the kernel mode are
per-run values handed to every forward (no process-global or thread-local switch), checked with clear errors."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from fewstep.engine import DEFAULT_BACKENDS, Backends, InputError, RunOptions, open_model, open_run
from fewstep.engine.models.flux import random_inputs


def _reference(q, k, v, mask=None):
    scores = torch.einsum("blhd,bmhd->bhlm", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhlm,bmhd->blhd", scores.softmax(-1), v)


def test_sdpa_matches_reference_and_layout():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 3, 16, generator=g) for n in (5, 7, 7))
    out = Backends("sdpa").attention(q, k, v)
    assert out.shape == (2, 5, 3, 16)
    assert torch.allclose(out, _reference(q, k, v), atol=1e-6)
    assert torch.equal(DEFAULT_BACKENDS.attention(q, k, v), out)  # auto on the CPU is SDPA


def test_boolean_mask_means_may_attend():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 2, 8, generator=g) for _ in range(3))
    mask = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    assert torch.allclose(Backends().attention(q, k, v, mask=mask), _reference(q, k, v, mask), atol=1e-6)


def test_unknown_names_are_refused():
    with pytest.raises(
        ValueError, match="attention backend 'xformers': expected one of auto, sdpa, flash-attn"
    ):
        Backends("xformers")
    with pytest.raises(ValueError, match="unknown kernel mode 'fast'"):
        Backends(kernel_mode="fast")
    handle = open_model("dummy:flux-tiny")
    with pytest.raises(InputError, match="input 'attention': unknown attention backend 'xformers'"):
        open_run(handle, RunOptions(attention_backend="xformers"))


def test_a_run_takes_the_handles_backend_unless_its_options_name_one(monkeypatch):
    handle = open_model("dummy:flux-tiny", attention_backend="sdpa")
    monkeypatch.delenv("FEWSTEP_KERNELS", raising=False)
    assert open_run(handle).backends == Backends("sdpa", "auto")
    assert open_run(handle, RunOptions(attention_backend="auto")).backends.attention_backend == "auto"
    monkeypatch.setenv("FEWSTEP_KERNELS", "reference")  # read when a run opens, by the run, not by the model
    assert open_run(handle).backends.kernel_mode == "reference"
    assert open_run(handle, RunOptions(kernel_mode="auto")).backends.kernel_mode == "auto"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error path")
def test_flash_attn_on_cpu_is_a_clear_error():
    handle = open_model("dummy:flux-tiny")
    with pytest.raises(InputError, match="flash-attn was requested but is not usable here"):
        open_run(handle, RunOptions(attention_backend="flash-attn"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error path")
def test_two_threads_run_one_model_with_their_own_backends():
    """The backend travels with the forward: a thread whose run asks for flash-attn (not usable on the CPU) fails
    with its error while another thread, on the same model at the same time, runs SDPA and gets the reference."""
    model = open_model("dummy:flux-tiny").model
    inputs = random_inputs(model.params, 64, 64, 8)
    with torch.inference_mode():
        expected = model(**inputs)
    results: dict[str, object] = {}
    barrier = threading.Barrier(2)

    def run(name: str, backends: Backends):
        barrier.wait()
        try:
            with torch.inference_mode():
                for _ in range(3):
                    results[name] = model(**inputs, backends=backends)
        except InputError as err:
            results[name] = err

    threads = [
        threading.Thread(target=run, args=("sdpa", Backends("sdpa"))),
        threading.Thread(target=run, args=("flash", Backends("flash-attn"))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(results["sdpa"], expected)
    assert isinstance(results["flash"], InputError) and "flash-attn needs CUDA" in str(results["flash"])


# -- one run, one composition point ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_one_run_composes_the_handles_features_each_switchable_off():
    """open_run takes the handle's compile feature and step-cache gate; RunOptions switches each off on its own,
    and the sampled latent is the same either way (aot_eager compile, a gate forced on at 12 steps)."""
    from conftest import make_cond

    from fewstep.engine import sample_latent
    from fewstep.engine.compile import attach_compile
    from fewstep.engine.step_cache import STEP_CACHE_FEATURE, make_gate

    plain = open_model("dummy:flux-tiny")
    gate = make_gate("first_block", 1.0, force=True)
    handle = attach_compile(plain, "full", "off", backend="aot_eager").with_feature(STEP_CACHE_FEATURE, gate)
    sigmas = torch.linspace(1.0, 0.0, 13)
    run = open_run(handle, sigmas=sigmas, sampler="euler")
    assert run.compiled is not None and run.step_cache is not None and run.model is not plain.model
    bare = open_run(handle, RunOptions(compile=False, step_cache=False), sigmas=sigmas, sampler="euler")
    assert (
        bare.compiled is None and bare.step_cache is None and bare.gate is None and bare.model is plain.model
    )
    run.abort()
    bare.abort()

    cond, latent = make_cond(plain.params), torch.zeros(1, 16, 8, 8)
    ref, _ = sample_latent(plain, [cond], latent, steps=2)
    out, report = sample_latent(handle, [cond], latent, steps=2, options=RunOptions(step_cache=False))
    assert report.cache is None and report.compile is not None and (out - ref).abs().max() <= 1e-4
    out, report = sample_latent(handle, [cond], latent, steps=2, options=RunOptions(compile=False))
    assert report.compile is None and report.cache is not None


def test_the_runs_kernel_mode_reaches_every_forward(monkeypatch):
    """A sampling run in kernel mode ``triton`` calls the kernels in that mode (spied), ``reference`` never does."""
    from conftest import make_cond

    from fewstep import kernels
    from fewstep.engine import sample_latent

    seen: list[tuple[str, str]] = []

    def spy(name):
        real = getattr(kernels, name)

        def call(*args, mode="auto", fallbacks=None, **layout):
            assert isinstance(fallbacks, kernels.KernelFallbacks)  # the run's record travels with its mode
            seen.append((name, mode))
            return real(*args, mode="reference", **layout)  # the CPU has no Triton driver

        return call

    for name in ("rms_norm", "adaln_modulate", "apply_rope"):
        monkeypatch.setattr(kernels, name, spy(name))
    handle = open_model("dummy:flux-tiny")
    cond, latent = make_cond(handle.params), torch.zeros(1, 16, 8, 8)
    sample_latent(handle, [cond], latent, steps=1, options=RunOptions(kernel_mode="triton"))
    kernels_called = {"rms_norm", "adaln_modulate", "apply_rope"}
    assert {n for n, _ in seen} == kernels_called and {m for _, m in seen} == {"triton"}
    seen.clear()
    sample_latent(handle, [cond], latent, steps=1, options=RunOptions(kernel_mode="reference"))
    assert {n for n, _ in seen} == kernels_called and {m for _, m in seen} == {"reference"}


def test_a_bad_kernel_mode_in_the_environment_is_said_once(monkeypatch, caplog):
    from fewstep.engine import settings

    monkeypatch.setattr(settings, "_warned", set())
    monkeypatch.setenv("FEWSTEP_KERNELS", "fastest")
    handle = open_model("dummy:flux-tiny")
    modes = [open_run(handle).backends.kernel_mode for _ in range(3)]
    assert modes == ["auto"] * 3
    assert caplog.text.count("ignoring FEWSTEP_KERNELS='fastest'") == 1
