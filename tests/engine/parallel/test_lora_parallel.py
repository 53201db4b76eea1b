"""Worker pools receive the handle's LoRAs: each rank reads the same file (once), checks it holds the host's
deltas, merges it for the job and restores the base weights for a job without it; results equal the
single-process runs. One gloo pool of 2 ranks (CPU)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from conftest import make_cond
from test_lora import write_lora

from fewstep.engine import InputError, open_model, sample_latent
from fewstep.engine.causal import CausalConfig, VideoSession
from fewstep.engine.lora import apply_lora, merged_weights
from fewstep.engine.parallel import ParallelConfig, RemoteVideoSession, WorkerPool, parallel_sample
from fewstep.engine.run import open_run

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is needed"
)

TOL = 1e-5


@pytest.fixture(scope="module")
def pool():
    config = ParallelConfig(mode="sp", ulysses_degree=2, backend="gloo", timeout=30.0, threads_per_rank=1)
    pool = WorkerPool(config).start()
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("loras")


def test_pool_sampling_with_a_lora_equals_the_single_process_run_and_a_base_job_after_it_the_base(
    pool, lora_dir
):
    flux = open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32)
    path = lora_dir / "flux.safetensors"
    write_lora(path, flux.model, scale=0.2)
    cond = make_cond(flux.params, tokens=7, seed=1)
    latent = torch.zeros(1, 16, 8, 12)  # 4 x 6 = 24 image tokens, 12 per rank
    kwargs = {"seed": 5, "steps": 3}
    base_ref, _ = sample_latent(flux, [cond], latent, **kwargs)
    lora = apply_lora(flux, path, 0.8)
    lora_ref, _ = sample_latent(lora, [cond], latent, **kwargs)
    assert (lora_ref - base_ref).abs().max() > 100 * TOL  # the LoRA changes the image
    # the host's model holds the merged LoRA now: the job's checksum is of the base weights, and is accepted
    out, _ = parallel_sample(pool, lora, [cond], latent, **kwargs)
    assert (out - lora_ref).abs().max() <= TOL
    base_out, _ = parallel_sample(
        pool, flux, [cond], latent, **kwargs
    )  # the workers restore the base weights
    assert (base_out - base_ref).abs().max() <= TOL
    other = apply_lora(flux, path, -0.5)  # another strength: the ranks re-merge the patch they already read
    other_ref, _ = sample_latent(other, [cond], latent, **kwargs)
    other_out, _ = parallel_sample(pool, other, [cond], latent, **kwargs)
    assert (other_out - other_ref).abs().max() <= TOL
    ping = pool.run({"kind": "task", "name": "ping"})
    assert (ping["loras_read"], ping["models_loaded"]) == (
        1,
        1,
    )  # neither the LoRA nor the base file read again


def test_pool_video_with_a_lora_equals_the_single_process_session_across_a_base_job(pool, lora_dir):
    wan = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32)
    path = lora_dir / "wan.safetensors"
    write_lora(path, wan.model, scale=0.3)
    lora = apply_lora(wan, path, 1.0)
    ctx = torch.randn(1, 9, 4096, generator=torch.Generator().manual_seed(1))
    config = CausalConfig(chunk_frames=2, window_frames=5, sink_frames=1, steps=2)
    run = open_run(lora)
    local = VideoSession(run.model, ctx, 32, 48, config, seed=3, run=run)
    expected = [c.latents for c in local.run(2)]
    base_local = [c.latents for c in VideoSession(open_run(wan).model, ctx, 32, 48, config, seed=3).run(1)]
    remote = RemoteVideoSession(pool, lora, ctx, 32, 48, config, seed=3)
    got = [c.latents for c in remote.run(1)]
    # a base-handle session on the same workers in between: their model runs without the LoRA
    base_remote = [c.latents for c in RemoteVideoSession(pool, wan, ctx, 32, 48, config, seed=3).run(1)]
    got += [c.latents for c in remote.run(1)]  # the LoRA session's ranks merge it again before its forwards
    assert (torch.cat(got, 2) - torch.cat(expected, 2)).abs().max() <= TOL
    assert (base_remote[0] - base_local[0]).abs().max() <= TOL
    assert (expected[0] - base_local[0]).abs().max() > 100 * TOL


def test_a_lora_that_differs_on_the_workers_is_refused_naming_the_file(pool, lora_dir):
    flux = open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32)
    path = lora_dir / "changed.safetensors"
    write_lora(path, flux.model, seed=4)
    lora = apply_lora(flux, path, 1.0)
    write_lora(path, flux.model, seed=5)  # the file changed after the host read it
    cond = make_cond(flux.params, tokens=4)
    with pytest.raises(InputError) as err:
        parallel_sample(pool, lora, [cond], torch.zeros(1, 16, 8, 8), steps=1)
    assert f"read the LoRA {os.fspath(path)} but it differs from the one on the host" in str(err.value)
    assert str(err.value).startswith("input 'lora': rank ")
    patch = lora.loras[0]
    gone = dataclasses.replace(patch, path=os.fspath(lora_dir / "missing.safetensors"))
    with pytest.raises(InputError, match="input 'lora'.*missing.safetensors"):
        parallel_sample(pool, flux.replace(loras=(gone,)), [cond], torch.zeros(1, 16, 8, 8), steps=1)
    assert pool.alive  # every rank refused before any collective
    assert merged_weights(flux.model).backup_bytes() == 0  # nothing merged on the host for a pool job


def test_pool_sampling_of_an_fp8_model_with_a_lora_equals_the_single_process_run(pool, lora_dir):
    """fp8 storage: every rank rounds its merge stochastically with the same per-weight seed as the host."""
    fp8 = open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32, weight_dtype=torch.float8_e4m3fn)
    path = lora_dir / "fp8.safetensors"
    write_lora(path, fp8.model, scale=0.2)
    lora = apply_lora(fp8, path, 1.0)
    cond = make_cond(fp8.params, tokens=7, seed=1)
    latent = torch.zeros(1, 16, 8, 12)
    ref, _ = sample_latent(lora, [cond], latent, seed=5, steps=2)
    out, _ = parallel_sample(pool, lora, [cond], latent, seed=5, steps=2)
    assert (out - ref).abs().max() <= TOL
