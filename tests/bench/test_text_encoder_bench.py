"""``bench/text_encoder.py`` runs on the tiny encoders (one round): the script itself is tested, its report's
structure and what does not depend on the machine (the families, the prompts encoded and served from the cache)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_the_bench_measures_every_family(tmp_path):
    pytest.importorskip("transformers", reason="transformers not installed (the text extra)")
    out = tmp_path / "text_encoder.json"
    r = subprocess.run(
        [sys.executable, str(BENCH / "text_encoder.py"), "--quick", "--rounds", "1", "--threads", "1", "--out",
         str(out)], capture_output=True, text=True, cwd=BENCH.parent,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [row["family"] for row in report["rows"]] == ["flux", "flux2", "zimage", "wan"]
    for row in report["rows"]:
        # the warm-up and one distinct prompt encoded, that prompt then served from the cache
        assert row["stats"]["misses"] == 2 and row["stats"]["hits"] == 1
        assert row["encode_s"] > 0 and row["cache_hit_s"] > 0
    assert report["rows"][3]["dit_forward_s"] is None  # Wan is a video model: no image forward beside it
    assert "| family | encoder |" in r.stdout
