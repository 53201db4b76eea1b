"""The planner's live-session prediction (engine/plan/live.py): every metric from the per-tick model's formula
(no timings), one session against the per-chunk bill, the sessions that stay realtime and fit, the CLI's
``--live``."""

from __future__ import annotations

import argparse
import json

import pytest

from fewstep.engine import InputError
from fewstep.engine.models.wan import PRESETS
from fewstep.engine.plan import GPUS, plan_preset, wan_prompt_flops
from fewstep.engine.plan.live import plan_live
from fewstep.engine.plan.sessions import plan_session_tick
from fewstep.engine.plan.vae import taehv_decode_flops

WAN_1_3B = PRESETS["wan2.1-1.3b"]
TPF_480P = 1560  # 832 x 480 px


def _rate(gpu: str, mfu: float = 0.5) -> float:
    return GPUS[gpu].peak_flops * mfu


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_every_metric_follows_the_tick_model(gpu):
    live = plan_live(WAN_1_3B, 480, 832, (1, 2, 3, 4, 8), gpu=gpu)
    decode = taehv_decode_flops("taew2_1", 3, 60, 104) / _rate(gpu)
    prompt = wan_prompt_flops(WAN_1_3B).total / _rate(gpu)
    assert live["prompt_seconds"] == prompt and live["tokens_per_frame"] == TPF_480P
    intervals = {}
    for r in live["predictions"]:
        n = r["sessions"]
        tick = plan_session_tick(WAN_1_3B, n, TPF_480P, gpu=gpu)
        interval = tick.seconds + n * decode
        intervals[n] = interval
        assert r["batches"] == list(tick.batches) and r["tick_seconds"] == tick.seconds
        assert (
            r["interval_seconds"] == r["inter_chunk_p50_seconds"] == r["inter_chunk_p99_seconds"] == interval
        )
        assert r["chunk_video_seconds"] == 12 / 16 and r["first_chunk_video_seconds"] == 9 / 16
        assert r["realtime_factor"] == pytest.approx(0.75 / interval, rel=1e-12)
        assert r["deadline_met"] is (interval <= 0.75) and r["deadline_attainment"] == float(interval <= 0.75)
        assert r["stall_seconds_per_chunk"] == pytest.approx(max(0.0, interval - 0.75), abs=1e-15)
        assert r["viewer_stalls_per_chunk"] == (0 if interval <= 0.75 else 1)
        # a first chunk: every prompt's per-prompt work, steps forwards of the batch (no clean pass), the decodes
        assert r["first_chunk_seconds"] == pytest.approx(
            n * prompt + tick.seconds * 4 / 5 + n * decode, rel=1e-12
        )
        assert r["first_chunk_deadline_met"] is (r["first_chunk_seconds"] <= 9 / 16)
    for n in (2, 3, 4, 8):
        joining = next(r for r in live["predictions"] if r["sessions"] == n)["first_chunk_seconds_joining"]
        before = plan_session_tick(WAN_1_3B, n - 1, TPF_480P, gpu=gpu).seconds + (n - 1) * decode
        assert joining == pytest.approx(before + prompt + intervals[n], rel=1e-12)
    one = live["predictions"][0]
    assert one["first_chunk_seconds_joining"] == one["first_chunk_seconds"]
    assert intervals[3] > intervals[2]  # 3 sessions run padded to a batch of 4


def test_one_session_is_the_per_chunk_bill():
    """Without a tiny VAE one live session's interval is the planner's full-window chunk and its TTFC the first
    chunk (steps forwards + the per-prompt work): the same formulas."""
    for gpu in ("h100", "h200"):
        plan = plan_preset("wan2.1-1.3b", gpu=gpu, vae=False, live=(1,))
        (r,) = plan["live"]["predictions"]
        assert plan["live"]["tiny_vae"] is None and r["decode_seconds"] == 0.0
        assert r["interval_seconds"] == pytest.approx(plan["predicted_chunk_seconds"], rel=1e-12)
        assert r["first_chunk_seconds"] == pytest.approx(plan["predicted_first_chunk_seconds"], rel=1e-12)


def test_wan_1_3b_at_480p_stays_realtime_for_one_session():
    """At MFU 0.5 one 480p chunk (4 steps + the clean pass) takes about 0.41 s of a 0.75 s chunk: one session is
    realtime, two batched are not (batching gains only ~2.5 % per session-chunk there). The memory holds 12
    sessions on an H100, 22 on an H200: weights + N x (KV window + cross K/V)."""
    for gpu, fit in (("h100", 12), ("h200", 22)):
        plan = plan_preset("wan2.1-1.3b", gpu=gpu, live=(1, 2, 4, 8))
        live = plan["live"]
        assert [r["deadline_met"] for r in live["predictions"]] == [True, False, False, False]
        per_session = plan["kv_bytes_window"] + plan["cross_kv_bytes"]
        assert live["sessions_that_fit"] == fit == int((GPUS[gpu].memory_gb * 1e9 - plan["weight_bytes"])
                                                        // per_session)  # fmt: skip
        assert live["realtime_sessions"] == 1 and live["realtime_sessions_that_fit"] == 1
        assert [r["fits_gpu_memory"] for r in live["predictions"]] == [True] * 4
        assert live["predictions"][0]["first_chunk_deadline_met"]


def test_realtime_sessions_scan_the_deadline():
    """A smaller chunk of the same model (fewer tokens) keeps more sessions realtime: the scan stops at the last
    count whose interval meets the deadline."""
    live = plan_live(WAN_1_3B, 240, 416, (1,), gpu="h200", tiny_vae=None)
    n = live["realtime_sessions"]
    assert n >= 2

    def interval(k):
        return plan_session_tick(WAN_1_3B, k, 390, gpu="h200").seconds

    assert interval(n) <= 0.75 < interval(n + 1)
    assert live["sessions_that_fit"] is None and live["realtime_sessions_that_fit"] == n


def test_bad_live_settings_are_refused():
    with pytest.raises(InputError, match="input 'live': expected session counts >= 1, got \\[0\\]"):
        plan_preset("wan2.1-1.3b", live=(0,))
    with pytest.raises(InputError, match="input 'live': live sessions are streams of batch 1 each"):
        plan_preset("wan2.1-1.3b", live=(1,), batch=2)
    with pytest.raises(InputError, match="input 'live': flux.2-klein-4b makes images"):
        plan_preset("flux.2-klein-4b", live=(1,))


def _plan_cli(*argv: str) -> int:
    from fewstep.cli import plan as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return command.run(parser.parse_args(list(argv)))


def test_cli_live(capsys):
    assert _plan_cli("--model", "wan2.1-1.3b", "--gpu", "h200", "--live", "--json") == 0
    live = json.loads(capsys.readouterr().out)["live"]
    assert [r["sessions"] for r in live["predictions"]] == [1, 2, 4, 8] and live["gpu"] == "h200"
    assert _plan_cli("--model", "wan2.1-1.3b", "--live", "1,3") == 0
    out = capsys.readouterr().out
    assert (
        "| live, 1 session " in out
        and "| live, 3 sessions" in out
        and "| live sessions that stay realtime" in out
    )
    assert "batches 4" in out  # 3 sessions padded to the bucket of 4
    with pytest.raises(InputError, match="input '--live': expected comma-separated session counts >= 1"):
        _plan_cli("--model", "wan2.1-1.3b", "--live", "1,x")


def test_cli_live_error_names_the_flag(capsys):
    from fewstep.cli import main

    assert main(["plan", "--model", "flux.2-klein-4b", "--live"]) == 2
    assert "input '--live': flux.2-klein-4b makes images" in capsys.readouterr().err
