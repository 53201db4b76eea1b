"""``bench/device_check --smoke``: the prepared GPU check runs on a CPU with tiny presets, so CI tests the script
itself: the report's structure, the GPU-only checks skipped with their reason, one check's failure recorded while
the others run, the time budget."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPT = BENCH / "device_check"
ORDER = ["matmul_rate", "triton_kernels", "flash_attn_vs_sdpa", "attention_layout", "schnell_graph_equals_eager",
         "schnell_speed",
         "schnell_mfu", "wan_graph_equals_eager", "wan_fps", "interactive", "wan_sessions", "live"]  # fmt: skip
GPU_ONLY = {"triton_kernels", "flash_attn_vs_sdpa", "schnell_graph_equals_eager", "wan_graph_equals_eager"}
CHECK_KEYS = {"name", "title", "status", "seconds", "reason", "error", "traceback", "peak_memory_gib", "results",
              "summary"}  # fmt: skip


def _run(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=BENCH.parent
    )


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("device")
    r = _run("--smoke", "--out", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads((out / "device.json").read_text()), (out / "device.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="smoke mode is the CPU run; this machine has a GPU")
@pytest.mark.slow
def test_smoke_report_structure(smoke):
    report, _ = smoke
    assert report["mode"] == "smoke" and report["stopped_early"] is False
    assert {"machine", "setup", "started", "budget_s", "wall_s", "checks", "summary"} <= set(report)
    assert report["machine"]["gpu"] is None and report["setup"]["flux_preset"] == "flux-tiny"
    assert [c["name"] for c in report["checks"]] == ORDER
    for c in report["checks"]:
        assert set(c) == CHECK_KEYS and c["error"] is None, c
        if c["name"] in GPU_ONLY:
            assert c["status"] == "skipped" and c["results"] == {}
            assert "GPU" in c["reason"] and c["seconds"] == 0.0
        else:
            assert c["status"] == "ok" and c["reason"] is None and c["summary"]
    for r in report["summary"]:
        assert set(r) == {"metric", "value", "goal", "met"}
        assert r["met"] is None  # goals are judged on a GPU only


@pytest.mark.skipif(torch.cuda.is_available(), reason="smoke mode is the CPU run; this machine has a GPU")
@pytest.mark.slow
def test_smoke_measurements_are_plausible(smoke):
    report, _ = smoke
    checks = {c["name"]: c["results"] for c in report["checks"]}
    assert checks["matmul_rate"]["tflops"] > 0 and checks["matmul_rate"]["dtype"] == "float32"
    layouts = {k: v for k, v in checks["attention_layout"].items() if k != "summary"}
    assert len(layouts) == 2 and all(v["max_abs_diff"] == 0 and v["ratio"] > 0 for v in layouts.values())
    speed = checks["schnell_speed"]
    assert speed["eager_s"] > 0 and speed["compiled_s"] > 0 and speed["sample_latent_s"] > 0
    assert speed["compiled_graph_s"] is None and "CUDA GPU" in speed["compiled_graph_skipped"]
    assert speed["compile"]["frames"] >= 1 and speed["compile"]["recompiles"] == 0
    mfu = checks["schnell_mfu"]
    assert set(mfu["forward_s"]) == {"eager", "compiled"} and all(v > 0 for v in mfu["mfu"].values())
    assert mfu["matmul_tflops"] == checks["matmul_rate"]["tflops"]  # the measured rate is the denominator
    fps = checks["wan_fps"]
    assert set(fps["runs"]) == {"bf16 eager", "bf16 compiled", "int8 eager", "int8 compiled"}
    for run in fps["runs"].values():
        assert len(run["chunk_seconds"]) == fps["chunks"] == fps["window_frames"] // fps["chunk_frames"] + 3
        assert run["video_fps"] == pytest.approx(4 * run["latent_fps"]) and run["video_fps"] > 0
    assert fps["runs"]["bf16 eager"]["compile"] is None
    assert fps["runs"]["bf16 compiled"]["compile"]["frames_compiled"] >= 1
    pool = checks["wan_sessions"]
    assert set(pool["runs"]) == {"1", "2", "4"} and pool["timed_chunks"] == 3
    for n, run in pool["runs"].items():
        assert len(run["tick_s"]) == len(run["solo_n_chunks_s"]) == 1 + pool["timed_chunks"]
        assert run["batches"] == [[int(n)]] * 4  # one batch of all N sessions per tick
        assert run["session_chunks_per_s_batched"] > 0 and run["session_chunks_per_s_solo"] > 0
        assert run["max_rel_err"] <= run["tol"] == 1e-5  # fp32: the batched rows are the solo chunks
    assert pool["runs"]["1"]["planner_gain_h200"] == pytest.approx(1.0)
    live = checks["live"]
    assert set(live["runs"]) == {"wan-tiny"} and live["chunks_per_session"] == 3
    for n, run in live["runs"]["wan-tiny"].items():
        assert len(run["sessions"]) == int(n) and run["wall_s"] > 0
        for session in run["sessions"]:
            assert session["chunks"] == 3 and session["stall_events"] == 0  # every event read at once
            assert session["metrics"]["chunks"] == 3
        got = run["summary"]
        assert (
            got["ttfc_s"] > 0
            and got["inter_chunk_p50_s"] > 0
            and got["inter_chunk_p99_s"] >= got["inter_chunk_p50_s"]
        )
        assert sum(got["batch_sizes"].values()) == 3 * int(n)
        assert run["planner_h200"]["batches"] == [int(n)]
    assert live["runs"]["wan-tiny"]["4"]["max_rel_err_vs_solo"] <= 1e-5
    inter = checks["interactive"]
    assert inter["recache_frames"] == [inter["window_frames"]] == [9]  # past the window, no sinks: all held
    assert len(inter["t2v_chunk_s"]) == len(inter["recache_s"]) == len(inter["prefill_one_frame_s"]) == 2
    assert set(inter["v2v_vs_t2v"]) == {"0.5", "1"} and all(x > 0 for x in inter["v2v_vs_t2v"].values())
    # fp32 on the CPU: a prefill of generated frames writes the K/V their clean passes wrote; a first V2V chunk
    # at strength 1.0 is the first T2V chunk
    assert inter["prefill_continues_rel_err"] <= inter["tol"] == 1e-5
    assert inter["v2v_first_chunk_rel_err"] <= 1e-5


@pytest.mark.skipif(torch.cuda.is_available(), reason="smoke mode is the CPU run; this machine has a GPU")
@pytest.mark.slow
def test_smoke_markdown_lists_every_check_and_metric(smoke):
    report, md = smoke
    assert md.startswith("# Device check (`bench/device_check --smoke`)")
    for c in report["checks"]:
        assert f"| {c['name']} | {c['status']} |" in md
    for r in report["summary"]:
        assert f"| {r['metric']} | {r['value']} |" in md


@pytest.mark.slow
def test_spent_budget_stops_before_any_check(tmp_path):
    r = _run("--smoke", "--budget", "0", "--only", "matmul_rate,schnell_speed,wan_graph_equals_eager",
             "--out", str(tmp_path))  # fmt: skip
    assert r.returncode == 1
    report = json.loads((tmp_path / "device.json").read_text())
    assert report["stopped_early"] is True
    assert [(c["name"], c["status"]) for c in report["checks"]] == [
        ("matmul_rate", "not run"),
        ("schnell_speed", "not run"),
        ("wan_graph_equals_eager", "skipped"),  # skipped for the machine first: the reason is the GPU
    ]
    assert report["checks"][0]["reason"] == "the time budget is spent"


def test_bad_arguments():
    r = _run("--smoke", "--only", "matmul_rate,warp_speed")
    assert r.returncode == 2 and "unknown check(s) warp_speed; known: matmul_rate, " in r.stderr
    if not torch.cuda.is_available():
        r = _run()
        assert r.returncode == 2 and "no CUDA device here; run with --smoke" in r.stderr


def test_a_failing_check_is_recorded_and_the_next_still_runs():
    sys.path.insert(0, str(BENCH))
    try:
        from device.checks import Check
        from device.runner import Context, Failed, Models, run_check, setup_for
    finally:
        sys.path.remove(str(BENCH))
    setup = setup_for(smoke=True)
    ctx = Context(setup, Models(setup), deadline=float("inf"))

    def broken(ctx):
        raise ValueError("the kernel returned NaN\nsecond line")

    def mismatch(ctx):
        raise Failed("replay differs from eager: relative error 3.0e-01", {"rel_err": 0.3})

    results = [run_check(ctx, Check(name, name, fn)) for name, fn in
               [("broken", broken), ("mismatch", mismatch), ("fine", lambda ctx: {"x": 1, "summary": []})]]  # fmt: skip
    assert [r.status for r in results] == ["error", "failed", "ok"]
    assert results[0].error == "ValueError: the kernel returned NaN" and results[0].traceback[-2:] == [
        "ValueError: the kernel returned NaN",
        "second line",
    ]
    assert results[1].reason.startswith("replay differs") and results[1].results == {"rel_err": 0.3}
    assert results[2].results == {"x": 1}


def test_kernel_comparison_passes_the_references_and_names_a_wrong_kernel():
    """The GPU check's comparison code, run on the CPU with the references standing in for the Triton module."""
    from types import SimpleNamespace

    from fewstep.kernels import kv_quant, norms, rope

    sys.path.insert(0, str(BENCH))
    try:
        from device.checks import compare_kernels
    finally:
        sys.path.remove(str(BENCH))
    shapes = {"kv": (1, 6, 2, 32), "kv_old": 9, "heads": (1, 5, 2, 32), "hidden": (1, 4, 48)}
    references = SimpleNamespace(
        quantize_kv=kv_quant.quantize_kv, dequantize_kv=kv_quant.dequantize_kv,
        quantized_attention=kv_quant.quantized_attention, rms_norm=norms.rms_norm,
        adaln_modulate=norms.adaln_modulate, apply_rope=rope.apply_rope,
    )  # fmt: skip
    results, bad = compare_kernels(references, torch.device("cpu"), shapes)
    assert bad == [] and len(results) == 2 * (3 * 2 + 3)  # per dtype: 3 KV kernels x 2 widths, 3 others
    assert all(r.get("rel_err", 0.0) == 0.0 and r.get("identical", True) for r in results.values())
    wrong = SimpleNamespace(
        **{**vars(references), "rms_norm": lambda x, w, eps: norms.rms_norm(x, w, eps) * 1.1}
    )
    _, bad = compare_kernels(wrong, torch.device("cpu"), shapes)
    assert [b.split(":")[0] for b in bad] == ["rms_norm float32", "rms_norm bfloat16"]


def _device_checks():
    sys.path.insert(0, str(BENCH))
    try:
        from device import checks
    finally:
        sys.path.remove(str(BENCH))
    return checks


def test_live_transport_reads_every_event_and_waits_for_the_closes():
    """The live check's in-process host: an outbox is drained the moment an event is put (no drop, no stall),
    per session, and wait_closed returns once every session's closed event came."""
    from fewstep.engine.live import SessionOutbox

    checks = _device_checks()
    transport = checks.InProcessTransport()
    boxes = {sid: SessionOutbox(max_events=2) for sid in ("a", "b")}
    for sid, box in boxes.items():
        transport.attach(sid, f"client-{sid}", box)
    for k in range(5):  # more than the outbox holds: read at once, nothing dropped
        boxes["a"].put("fewstep.chunk", {"chunk": k}, droppable=True)
    boxes["a"].put("fewstep.session", {"state": "closed", "why": "done"})
    assert not transport.wait_closed(["a", "b"], timeout=0.01)
    boxes["b"].put("fewstep.session", {"state": "closed", "why": "done"})
    assert transport.wait_closed(["a", "b"], timeout=0.01)
    assert [d["chunk"] for _, e, d in transport.events["a"] if e == "fewstep.chunk"] == [0, 1, 2, 3, 4]
    assert boxes["a"].dropped == 0 and len(transport.events["b"]) == 1


def test_live_summary_of_the_closing_metrics():
    checks = _device_checks()

    def metrics(ttfc, p50, p99, rtf, attained, stalls, batches):
        return {"time_to_first_chunk_s": ttfc, "inter_chunk_p50_s": p50, "inter_chunk_p99_s": p99,
                "realtime_factor": rtf, "deadline_attainment": attained, "viewer_stalls": stalls,
                "batch_sizes": batches}  # fmt: skip

    run = {"sessions": [
        {"metrics": metrics(1.0, 0.5, 0.7, 1.2, 1.0, 0, {"2": 3}), "stall_events": 0},
        {"metrics": metrics(3.0, 0.7, 0.9, 0.8, 0.5, 2, {"1": 1, "2": 3}), "stall_events": 1},
    ]}  # fmt: skip
    assert checks.live_summary(run, 0.75) == {
        "ttfc_s": 2.0, "ttfc_max_s": 3.0, "inter_chunk_p50_s": 0.6, "inter_chunk_p99_s": 0.9,
        "realtime_factor": 1.0, "steady_realtime_factor": 0.75 / 0.6, "deadline_attainment": 0.5,
        "viewer_stalls": 2, "stall_events": 1, "batch_sizes": {"1": 1, "2": 6},
    }  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="smoke mode is the CPU run; this machine has a GPU")
@pytest.mark.slow  # ~10 s on 2 idle cores (interpreter start, 3 pools), over 20 s when they are shared
def test_live_check_alone(tmp_path):
    """``--only live``: 1, 2 and 4 clients on the engine's LiveService, every session's 3 chunks and closing
    metrics; the planner's H200 prediction beside them."""
    r = _run("--smoke", "--only", "live", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (check,) = json.loads((tmp_path / "device.json").read_text())["checks"]
    assert check["status"] == "ok" and len(check["summary"]) == 4  # 3 client counts + the exactness row
    runs = check["results"]["runs"]["wan-tiny"]
    for n in ("1", "2", "4"):
        assert [s["chunks"] for s in runs[n]["sessions"]] == [3] * int(n)
        assert all(s["metrics"]["chunks"] == 3 for s in runs[n]["sessions"])
        assert runs[n]["why_stopped"] == "the device check is done"
    # fp32 on the CPU: 4 batched live sessions make their solo sessions' latents (same prompt text, same seed)
    assert runs["4"]["max_rel_err_vs_solo"] <= runs["4"]["tol"] == 1e-5 and "tol" not in runs["2"]
