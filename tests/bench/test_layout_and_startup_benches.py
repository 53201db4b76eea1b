"""The issue-35 benchmarks run (one short round each): the attention-layout A/B, the tiny-VAE convolution A/B
and the cold-start timer. Their figures depend on the machine; what is asserted is what does not: the outputs of
the two layouts and of the fused and plain convolutions are identical, and every case reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _run(*argv: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=BENCH.parent)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r


def test_attention_layout_bench_finds_identical_outputs():
    r = _run(str(BENCH / "attention_layout.py"), "--quick", "--size", "128x128")
    report = json.loads((BENCH / "results" / "attention_layout.json").read_text())
    assert set(report["results"]) == {"flux", "wan-causal"}
    assert all(case["max_abs_diff"] == 0 for case in report["results"].values())
    assert "| flux | 1 |" in r.stdout and "| wan-causal | 1 |" in r.stdout


def test_tiny_vae_conv_bench_finds_identical_outputs():
    _run(str(BENCH / "tiny_vae_convs.py"), "--quick", "--sizes", "192x192", "--threads", "1")
    report = json.loads((BENCH / "results" / "tiny_vae_convs.json").read_text())
    assert [row["variant"] for row in report["rows"]] == ["taef1", "taef2"]
    assert all(
        row["max_abs_diff"] == 0 and row["fused_gflops"] > 0 and row["ae_gflops"] > 0
        for row in report["rows"]
    )
    assert {(s["variant"], s["fused"]) for s in report["profile"]} == {
        ("taef1", True),
        ("taef1", False),
        ("taef2", True),
        ("taef2", False),
    }


def test_cold_start_bench_times_whole_processes(tmp_path):
    out = tmp_path / "cold.json"
    r = _run(str(BENCH / "cold_start.py"), "--rounds", "1", "--cases", "import torch,import fewstep.engine",
             "--json", str(out))  # fmt: skip
    report = json.loads(out.read_text())
    for case in ("import torch", "import fewstep.engine"):
        first, exit_ = report["cases"][case]["first"][0], report["cases"][case]["exit"][0]
        assert 0 < first <= exit_
    assert "| import fewstep.engine |" in r.stdout
