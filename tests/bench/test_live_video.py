"""``bench/live_video.py``: its arithmetic on made-up client records (fast), and the script itself through a real
ComfyUI server in ``--quick`` mode (slow: a server start, the live node, 1 and 2 clients)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def lv():
    sys.path.insert(0, str(BENCH))
    try:
        import live_video
    finally:
        sys.path.remove(str(BENCH))
    return live_video


def _client(ttfc, p50, p99, rtf, attained, stalls, batches, arrivals, stall_events=0):
    metrics = {"time_to_first_chunk_s": ttfc, "inter_chunk_p50_s": p50, "inter_chunk_p99_s": p99,
               "realtime_factor": rtf, "deadline_attainment": attained, "viewer_stalls": stalls,
               "batch_sizes": batches, "chunks": len(arrivals)}  # fmt: skip
    return {"metrics": metrics, "arrivals": arrivals, "states": [("opened", ""), ("closed", "done")],
            "chunk_events": [{"chunk": k} for k in range(len(arrivals))], "stall_events": stall_events}  # fmt: skip


def test_a_row_is_the_clients_metrics_combined(lv):
    outs = [
        _client(1.0, 0.5, 0.6, 1.5, 1.0, 0, {"2": 3}, [1.1, 1.6, 2.2]),
        _client(2.0, 0.7, 0.9, 0.9, 2 / 3, 1, {"1": 1, "2": 2}, [2.1, 2.5, 3.5], stall_events=1),
    ]
    row = lv.summarize(outs)
    assert {k: row[k] for k in ("clients", "chunks", "ttfc_s", "ttfc_max_s", "inter_chunk_p50_s",
                                "inter_chunk_p99_s", "realtime_factor", "deadline_attainment", "viewer_stalls",
                                "stall_events", "batch_sizes", "client_ttfc_s")} == {
        "clients": 2, "chunks": [3, 3], "ttfc_s": 1.5, "ttfc_max_s": 2.0, "inter_chunk_p50_s": 0.6,
        "inter_chunk_p99_s": 0.9, "realtime_factor": 1.2, "deadline_attainment": 2 / 3, "viewer_stalls": 1,
        "stall_events": 1, "batch_sizes": {"1": 1, "2": 5}, "client_ttfc_s": 1.6,
    }  # fmt: skip
    # client view: intervals between arrivals, (0.5, 0.6) and (0.4, 1.0): p50 0.55 and 0.7, p99 the largest
    assert row["client_inter_chunk_p50_s"] == pytest.approx(0.625)
    assert row["client_inter_chunk_p99_s"] == pytest.approx(0.4 + 0.6 * 0.99)
    table = lv.table([row])
    assert (
        "| 2 | 1.500 (2.000) | 0.600 / 0.900 | 1.20x | 67% | 1 (1) | 1: 1, 2: 5 | 1.600, 0.625 / 0.994 |"
        in table
    )
    # the `live` CLI's clients (--client cli) record no arrival times: no client view, the rest the same
    cli = lv.summarize([{**o, "arrivals": []} for o in outs])
    assert cli["client_ttfc_s"] is cli["client_inter_chunk_p50_s"] is cli["client_inter_chunk_p99_s"] is None
    assert cli["chunks"] == [3, 3] and cli["ttfc_s"] == 1.5 and "| -, - / - |" in lv.table([cli])
    with pytest.raises(RuntimeError, match="without a fewstep.metrics event"):
        lv.summarize([{**outs[0], "metrics": None}])


def test_the_workflow_gets_room_for_every_client(lv, tmp_path):
    graph = {"1": {"class_type": "FewStepLiveVideo", "inputs": {"max_sessions": 2, "idle_seconds": 300.0,
                                                                 "model": ["2", 0]}},
             "2": {"class_type": "FewStepLoadModel", "inputs": {}}}  # fmt: skip
    path = tmp_path / "wf.json"
    path.write_text(json.dumps(graph))
    node = lv.live_workflow(path, 4)["1"]["inputs"]
    assert node == {"max_sessions": 4, "idle_seconds": 0.0, "model": ["2", 0]}
    path.write_text(json.dumps({"2": graph["2"]}))
    with pytest.raises(SystemExit, match="no FewStepLiveVideo node"):
        lv.live_workflow(path, 4)


def test_the_prediction_table_is_the_planner(lv):
    planned = lv.predictions((1, 2))
    assert set(planned) == {"h100", "h200"}
    table = lv.prediction_table(planned)
    first = planned["h200"]["predictions"][0]
    assert f"| h200 | 1 | {first['first_chunk_seconds']:.3f} " in table and "| met |" in table
    assert "sessions that stay realtime: h100 1 (memory holds 12), h200 1 (memory holds 22)" in table


@pytest.mark.slow
@pytest.mark.parametrize("client", ["threads", "cli"])
def test_quick_run_through_a_real_server(lv, tmp_path, client):
    comfyui = lv.comfyui_dir(None)
    if comfyui is None:
        pytest.skip("no ComfyUI checkout (COMFYUI_DIR)")
    if not lv.WORKFLOW.exists():
        pytest.skip(f"{lv.WORKFLOW.name} is not built")
    out = tmp_path / "live_video.json"
    r = subprocess.run([sys.executable, str(BENCH / "live_video.py"), "--quick", "--threads", "1", "--client", client,
                        "--out", str(out)],
                       capture_output=True, text=True, cwd=BENCH.parent, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["quick"] is True and report["client"] == client
    assert [row["clients"] for row in report["rows"]] == [1, 2]
    for row in report["rows"]:
        n = row["clients"]
        assert row["chunks"] == [3] * n  # every chunk event reached its client
        assert sum(row["batch_sizes"].values()) == 3 * n
        for s in row["sessions"]:
            assert s["states"][-1][0] == "closed" and len(s["chunk_events"]) == 3
            if client == "threads":  # its own websocket saw the whole session
                assert s["states"][0][0] == "opened" and len(s["arrivals"]) == 3
            assert s["metrics"]["chunks"] == 3
        assert 0 < row["ttfc_s"] <= row["ttfc_max_s"] and row["inter_chunk_p50_s"] <= row["inter_chunk_p99_s"]
    assert report["node_status"]["status_str"] == "success"
    assert isinstance(report["node_report"], str) and report["node_report"]  # the node's own report, printed
    assert "| clients | TTFC s (max) |" in r.stdout and "sessions that stay realtime" in r.stdout
