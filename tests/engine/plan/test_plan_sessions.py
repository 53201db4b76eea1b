"""The planner's batched session-pool tick (engine/plan/sessions.py): its FLOPs against a counted pool tick, N = 1
against the per-chunk prediction, FLOPs scaling with the rows computed, the GEMM-size model's arithmetic, the CLI's
``--sessions``."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from fewstep.engine import InputError, load_dit
from fewstep.engine.causal import CausalConfig
from fewstep.engine.causal.session_pool import DEFAULT_BUCKETS, SessionPool
from fewstep.engine.models.wan import PRESETS
from fewstep.engine.plan import GPUS, measure_flops, plan_preset, wan_forward_flops, wan_tokens_per_frame
from fewstep.engine.plan.sessions import (
    batch_sizes,
    fill_rows,
    plan_session_tick,
    ridge_rows,
    session_scan,
    wan_gemms,
    wave_efficiency,
)

WAN_1_3B = PRESETS["wan2.1-1.3b"]
TPF_480P = 1560  # 832 x 480 px: 52 x 30 patches of 2x2 on the 1/8 latent


@pytest.fixture(scope="module")
def wan():
    return load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("sessions", [1, 2, 3])
def test_tick_flops_equal_a_counted_pool_tick(wan, sessions):
    """A steady tick (every session has a clean pass pending) of a real pool, counted: the batches run at the
    pool's buckets, so 3 sessions compute 4 rows."""
    config = CausalConfig(chunk_frames=2, window_frames=4, steps=3)
    pool = SessionPool(wan, 32, 48, config, max_sessions=4)
    context = torch.randn(1, 9, 4096, generator=torch.Generator().manual_seed(0))
    members = [pool.join(context, seed=i) for i in range(sessions)]
    for _ in range(2):  # past the first chunk: a clean pass is pending for each
        pool.tick()
        for s in members:
            s.take()
    counted = measure_flops(lambda: pool.tick())
    tick = plan_session_tick(wan.params, sessions, wan_tokens_per_frame(wan.params, 32, 48), 2, 4, 3)
    assert counted.total == tick.flops.total
    assert counted.attention == tick.flops.attention
    assert tick.computed_rows == pool.buckets[next(i for i, b in enumerate(pool.buckets) if b >= sessions)]
    pool.close()


def test_one_session_is_the_per_chunk_prediction():
    for gpu in ("h100", "h200"):
        plan = plan_preset("wan2.1-1.3b", gpu=gpu, vae=False, sessions=1)
        tick = plan["session_tick"]
        assert tick["flops"] == 5 * plan["flops_per_forward"]  # 4 steps + the clean pass
        assert tick["seconds"] == pytest.approx(plan["predicted_chunk_seconds"], rel=1e-12)
        assert tick["solo_seconds_per_chunk"] == tick["seconds"] and tick["gain"] == pytest.approx(1.0)


@pytest.mark.parametrize("sessions", [1, 2, 4, 8, 16])
def test_flops_scale_with_the_rows_computed(sessions):
    """N sessions' chunks in one forward: N x one session's FLOPs, every part (each row attends to its own
    window: attention is N x per session, not (N x chunk)^2); with buckets, the padded rows count too."""
    one = plan_session_tick(WAN_1_3B, 1, TPF_480P, buckets=None)
    tick = plan_session_tick(WAN_1_3B, sessions, TPF_480P, buckets=None)
    assert tick.flops == one.flops.times(sessions)
    assert tick.gemm_rows == sessions * 3 * TPF_480P
    assert tick.flops.attention == 5 * sessions * 30 * 4 * 4680 * (21 * 1560 + 512) * 1536
    padded = plan_session_tick(WAN_1_3B, 3, TPF_480P)
    assert padded.batches == (4,) and padded.flops == one.flops.times(4)
    assert plan_session_tick(WAN_1_3B, 11, TPF_480P).batches == (8, 4)


def test_batch_sizes_follow_the_pool():
    assert DEFAULT_BUCKETS == (1, 2, 4, 8)
    assert [batch_sizes(n, DEFAULT_BUCKETS) for n in (1, 2, 3, 5, 8, 9, 17)] == [
        [1], [2], [4], [8], [8], [8, 1], [8, 8, 1]
    ]  # fmt: skip
    assert batch_sizes(5, None) == [5] and batch_sizes(5, (1, 3, 6)) == [6]


def test_the_gemms_are_the_linear_flops():
    tokens = 3 * TPF_480P
    linear = sum(g.flops(tokens) for g in wan_gemms(WAN_1_3B))
    assert linear == wan_forward_flops(WAN_1_3B, 3, TPF_480P).linear


def test_wave_model_arithmetic():
    assert wave_efficiency(128, 128, 1) == 1.0
    assert wave_efficiency(129, 128, 1) == 129 / 256  # a second, nearly empty tile
    assert wave_efficiency(128, 128, 4) == 0.25  # one tile, 4 multiprocessors
    assert wave_efficiency(4680, 1536, 132) == 4680 * 1536 / (4 * 132 * 128 * 128)  # 37 x 12 tiles: 4 waves
    assert fill_rows(1536, 132) == 1408 and fill_rows(8960, 132) == 256  # 12 and 70 column tiles
    assert ridge_rows(GPUS["h100"], 0.5) == 148 and ridge_rows(GPUS["h200"], 0.5) == 104


def test_weight_bound_chunks_batch_almost_for_free():
    """A chunk far below the ridge (a few tokens) is bound by reading the weights: N sessions cost about one."""
    tick = plan_session_tick(WAN_1_3B, 8, 1, chunk_frames=1, window_frames=1, buckets=None)
    assert tick.linear_seconds == 5 * tick.weight_read_seconds
    assert tick.gain > 6


def test_the_scan_of_wan_1_3b_at_480p():
    """One 480p chunk (4,680 rows) already spans several waves of every GEMM on an H100 / H200: batching can
    only fill the last wave (a few %), and a batch padded to its bucket (3 -> 4) costs more than it gains."""
    for gpu in ("h100", "h200"):
        scan = session_scan(WAN_1_3B, TPF_480P, gpu=gpu)
        gains = {t["sessions"]: t["gain"] for t in scan["ticks"]}
        assert scan["tokens_per_chunk"] == 4680 > scan["fill_rows"] == 1408
        assert 1.0 < gains[2] < gains[8] < 1.05 and gains[3] < 1.0
        assert scan["pays_until"] in gains


def test_bad_sessions_are_refused():
    with pytest.raises(InputError, match="input 'sessions': expected a positive integer, got 0"):
        plan_preset("wan2.1-1.3b", sessions=0)
    with pytest.raises(InputError, match="input 'sessions': a pool's sessions are streams of batch 1 each"):
        plan_preset("wan2.1-1.3b", sessions=2, batch=2)
    with pytest.raises(InputError, match="input 'sessions': flux.2-klein-4b makes images"):
        plan_preset("flux.2-klein-4b", sessions=2)


def _plan_cli(*argv: str) -> int:
    from fewstep.cli import plan as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return command.run(parser.parse_args(list(argv)))


def test_cli_sessions(capsys):
    assert _plan_cli("--model", "wan2.1-1.3b", "--sessions", "4", "--gpu", "h200", "--json", "--no-vae") == 0
    fields = json.loads(capsys.readouterr().out)
    assert fields["sessions"] == 4 and fields["session_tick"]["gemm_rows"] == 4 * 4680
    assert fields["session_tick"]["flops"] == 4 * 5 * fields["flops_per_forward"]
    assert fields["session_scan"]["gpu"] == "h200" and fields["pool_fits_gpu_memory"]
    assert _plan_cli("--model", "wan2.1-1.3b", "--sessions", "8", "--no-vae") == 0
    out = capsys.readouterr().out
    assert "| pool tick, 8 sessions" in out and "| GEMM size that fills the GPU" in out
