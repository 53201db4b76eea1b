"""CLI smoke tests on a tiny preset (a real subprocess, as a user runs it)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from safetensors.torch import load_file


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "fewstep", *args], capture_output=True, text=True, cwd=cwd)


def test_generate_writes_latent_and_timings(tmp_path):
    out = tmp_path / "gen"
    r = _cli(
        "generate",
        "--model",
        "flux-tiny",
        "--weights",
        "dummy",
        "--height",
        "64",
        "--width",
        "96",
        "--steps",
        "3",
        "--seed",
        "5",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    latent = load_file(str(out / "latent.safetensors"))["latent"]
    assert latent.shape == (1, 16, 8, 12) and torch.isfinite(latent).all()
    info = json.loads((out / "timings.json").read_text())
    assert info["dit_forwards"] == 3 and info["sigmas"][-1] == 0.0
    assert set(info["timings"]) == {"load_s", "prepare_s", "sampling_s", "per_step_s", "save_s"}
    assert len(info["timings"]["per_step_s"]) == 3
    # same seed, same latent
    r2 = _cli(
        "generate",
        "--model",
        "flux-tiny",
        "--height",
        "64",
        "--width",
        "96",
        "--steps",
        "3",
        "--seed",
        "5",
        "--out",
        str(tmp_path / "gen2"),
    )
    assert r2.returncode == 0
    assert torch.equal(latent, load_file(str(tmp_path / "gen2" / "latent.safetensors"))["latent"])


def test_generate_bad_input_is_a_clear_error(tmp_path):
    r = _cli("generate", "--model", "flux-tiny", "--height", "72", "--out", str(tmp_path))
    assert r.returncode == 2 and "input '--height': 72 px is not a positive multiple of 16" in r.stderr
    assert "Traceback" not in r.stderr
    r = _cli("generate", "--weights", str(tmp_path / "missing.safetensors"), "--out", str(tmp_path))
    assert r.returncode == 2 and "input '--weights': weights file not found" in r.stderr


def test_help_lists_commands():
    r = _cli("--help")
    assert r.returncode == 0 and "generate" in r.stdout and "demo" in r.stdout


def test_demo_writes_report(tmp_path):
    r = _cli("demo", "--model", "flux-tiny", "--size", "64", "--out", str(tmp_path / "demo"))
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert report["CFG"]["rows"] == [4, 4, 8]
    assert len(report["causal video stream"]["seconds"]) == 5
    assert report["weight storage"]["bytes"][2] < report["weight storage"]["bytes"][1]
    assert (tmp_path / "demo" / "report.md").read_text().startswith("# fewstep demo report")
    assert (tmp_path / "demo" / "schnell_4step.safetensors").exists()


def test_stream_reports_chunks_and_kv_bytes(tmp_path):
    r = _cli("stream", "--model", "wan-tiny", "--height", "32", "--width", "48", "--chunks", "4",
             "--chunk-frames", "2", "--window-frames", "4", "--sink-frames", "1", "--json",
             "--tiny-vae", "dummy:taew2_1", "--out", str(tmp_path))  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    per_token = 2 * 64 * 2 * 4  # K and V x dim x layers x fp32
    assert report["kv_bytes_per_token"] == per_token and report["tokens_per_frame"] == 6
    assert [c["kv_bytes"] for c in report["chunks"]] == [4 * 6 * per_token] * 4
    assert [c["kv_bytes_used"] for c in report["chunks"]] == [2 * 6 * per_token] + [4 * 6 * per_token] * 3
    assert report["first_chunk_seconds"] == report["chunks"][0]["seconds"] > 0
    saved = load_file(str(tmp_path / "latents.safetensors"))
    assert saved["latent"].shape == (1, 16, 8, 4, 6) and saved["frames"].shape == (1, 29, 3, 32, 48)


def test_stream_bad_input():
    r = _cli("stream", "--frames", "7", "--chunk-frames", "3")
    assert (
        r.returncode == 2
        and "input '--frames': 7 latent frames is not a positive multiple of the chunk (3)" in r.stderr
    )
    r = _cli("stream", "--window-frames", "2")
    assert (
        r.returncode == 2
        and "fewstep stream: input '--window-frames': the window (2 latent frames) is smaller" in r.stderr
    )
