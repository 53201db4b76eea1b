"""``bench/interactive_video.py`` runs in a tiny mode (one small case, one window, one round): the script itself is
tested, its report's structure and the facts that do not depend on the machine (forwards, frames re-cached)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_the_bench_runs_tiny_and_reports_every_ratio(tmp_path):
    out = tmp_path / "interactive_video.json"
    r = subprocess.run(
        [sys.executable, str(BENCH / "interactive_video.py"), "--quick", "--cases", "wan-tiny@32x48", "--windows",
         "6", "--rounds", "1", "--threads", "1", "--out", str(out)],
        capture_output=True, text=True, cwd=BENCH.parent,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["quick"] is True and report["rounds"] == 1 and report["steps"] == 4
    (case,) = report["cases"]
    (row,) = case["rows"]
    assert row["window_frames"] == 6 and row["prefill_frames"] == 6
    assert row["recache_frames"] == [6]  # the full window, no sinks: every frame recomputed
    assert {k: v["steps"] for k, v in row["v2v"].items()} == {
        "0.5": 1,
        "1": 4,
    }  # wan-dmd-4step below 0.5: one
    assert row["prefill_predicted"] == 1 / 5 and row["recache_predicted"] == 2 / 5
    for ratio in (row["prefill_vs_chunk_per_frame"], row["recache_vs_chunk"], row["v2v"]["0.5"]["vs_t2v"]):
        assert 0 < ratio["min"] <= ratio["median"] <= ratio["max"]
    assert [s["metric"].split(": ")[1] for s in report["summary"]] == [
        "prefill / T2V chunk, seconds per frame",
        "re-cache / T2V chunk seconds",
        "V2V / T2V chunk seconds, strength 0.5 / 1.0",
    ]
    assert "| window | T2V chunk s |" in r.stdout
