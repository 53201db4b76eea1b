"""``python -m fewstep stream --sessions N``: N streams in one session pool, run as a user runs the CLI (in process,
through ``fewstep.cli.main``; the memory refusals in a subprocess, whose budget the environment sets)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from fewstep.cli import main
from fewstep.cli.stream_pool import check_pool_flags, percentile
from fewstep.engine.errors import InputError

# wan-tiny at 32x48 (6 tokens per frame); a 4-frame window with a sink frame slides from the third chunk on
SMALL = ["stream", "--model", "wan-tiny", "--height", "32", "--width", "48", "--chunk-frames", "2",
         "--window-frames", "4", "--sink-frames", "1"]  # fmt: skip
TOLERANCE = 1e-5  # the batched GEMMs round differently from batch 1 (the bound, fp32 on the CPU)


def _run(capsys, *args) -> str:
    assert main([*SMALL, *args]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def _report(capsys, *args) -> dict:
    return json.loads(_run(capsys, *args, "--json"))


def _error(capsys, *args) -> str:
    assert main([*SMALL, *args]) == 2
    return capsys.readouterr().err.strip()


def _latents(folder) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "latents.safetensors"))


@pytest.mark.parametrize(
    ("sessions", "chunks", "extra", "pool_only"),
    [
        (2, 3, ["--tiny-vae", "dummy:taew2_1"], []),
        # batches of 2 and 3 padded up to 4 rows: the padded rows change nobody's video
        (3, 4, ["--kv-dtype", "int8", "--keep-recent-chunks", "0", "--rope", "absolute"],
         ["--buckets", "1,4", "--max-sessions", "4"]),
    ],
    ids=["bf16-cache-tiny-vae", "int8-absolute-padded"],
)  # fmt: skip
def test_each_session_writes_what_a_single_stream_of_its_seed_writes(
    capsys, tmp_path, sessions, chunks, extra, pool_only
):
    _run(capsys, "--chunks", str(chunks), "--seed", "7", "--sessions", str(sessions), "--join-every", "1",
         "--out", str(tmp_path / "pool"), *extra, *pool_only)  # fmt: skip
    for i in range(sessions):
        _run(
            capsys,
            "--chunks",
            str(chunks),
            "--seed",
            str(7 + i),
            "--out",
            str(tmp_path / f"single_{i}"),
            *extra,
        )
        pooled, single = _latents(tmp_path / "pool" / f"session_{i}"), _latents(tmp_path / f"single_{i}")
        assert (
            pooled.keys() == single.keys()
        )  # latents (and the decoded frames with --tiny-vae), one file format
        for name in single:
            assert pooled[name].shape == single[name].shape
            torch.testing.assert_close(pooled[name], single[name], rtol=0, atol=TOLERANCE)
    report = json.loads((tmp_path / "pool" / "stream.json").read_text())
    assert [s["seed"] for s in report["sessions"]] == [7 + i for i in range(sessions)]
    assert [s["files"]["latents"] for s in report["sessions"]] == [
        str(tmp_path / "pool" / f"session_{i}" / "latents.safetensors") for i in range(sessions)
    ]
    if "--tiny-vae" in extra:  # each session's video beside its latents, as a single stream writes it
        assert all(len(s["files"]["video"]) == 1 for s in report["sessions"])


def test_with_cond_every_session_reads_that_prompt(capsys, tmp_path):
    cond = tmp_path / "cond.safetensors"
    save_file({"context": torch.randn(1, 16, 4096, generator=torch.Generator().manual_seed(3))}, str(cond))
    _run(capsys, "--chunks", "2", "--cond", str(cond), "--sessions", "2", "--out", str(tmp_path / "pool"))
    _run(capsys, "--chunks", "2", "--cond", str(cond), "--seed", "1", "--out", str(tmp_path / "single"))
    torch.testing.assert_close(
        _latents(tmp_path / "pool" / "session_1")["latent"], _latents(tmp_path / "single")["latent"],
        rtol=0, atol=TOLERANCE,
    )  # fmt: skip


def test_join_every_shapes_the_batches(capsys):
    report = _report(capsys, "--chunks", "3", "--sessions", "3", "--join-every", "2")
    # session i joins at tick 2i and runs 3 chunks: ticks 0-2, 2-4 and 4-6
    assert [t["batches"] for t in report["ticks"]] == [[1], [1], [2], [1], [2], [1], [1]]
    assert [t["sessions"] for t in report["ticks"]] == [[0], [0], [0, 1], [1], [1, 2], [2], [2]]
    assert [t["buckets"] for t in report["ticks"]] == [[1], [1], [2], [1], [2], [1], [1]]
    assert [[c["tick"] for c in s["chunks"]] for s in report["sessions"]] == [[0, 1, 2], [2, 3, 4], [4, 5, 6]]
    assert [[c["batch"] for c in s["chunks"]] for s in report["sessions"]] == [
        [1, 1, 2],
        [2, 1, 2],
        [2, 1, 1],
    ]
    assert [s["join_tick"] for s in report["sessions"]] == [0, 2, 4]
    chunk = report["sessions"][1]["chunks"][0]
    assert set(chunk) == {"index", "start_frame", "tick", "batch", "bucket", "waited", "latency", "deadline",
                          "deadline_met", "seconds", "commit_seconds", "kv_bytes", "kv_bytes_used"}  # fmt: skip
    # the deadline of a chunk is its video frames at 16 fps: 4 * 2 - 3 for the first chunk, 4 * 2 after it
    assert [c["deadline"] for c in report["sessions"][0]["chunks"]] == [5 / 16, 8 / 16, 8 / 16]
    assert report["slots"] == 3 and report["pool_bytes"] > 0 and report["chunks_per_session"] == 3


def test_a_tick_is_cut_into_batches_of_the_largest_bucket(capsys):
    report = _report(capsys, "--chunks", "2", "--sessions", "3", "--buckets", "1,2")
    assert [t["batches"] for t in report["ticks"]] == [[2, 1], [2, 1]]
    assert [t["buckets"] for t in report["ticks"]] == [[2, 1], [2, 1]]
    assert report["buckets"] == [1, 2]


def test_sessions_past_the_slots_wait_for_one(capsys, tmp_path):
    report = _report(capsys, "--latent-frames", "4", "--sessions", "3", "--max-sessions", "2", "--out",
                     str(tmp_path / "pool"))  # fmt: skip
    assert report["slots"] == 2
    # sessions 0 and 1 hold both slots for their 2 chunks; session 2 takes a slot when they leave
    assert [t["sessions"] for t in report["ticks"]] == [[0, 1], [0, 1], [2], [2]]
    # in the slot session 0 left: nothing of session 0's window reaches its video
    _run(capsys, "--chunks", "2", "--seed", "2", "--out", str(tmp_path / "single"))
    torch.testing.assert_close(
        _latents(tmp_path / "pool" / "session_2")["latent"], _latents(tmp_path / "single")["latent"],
        rtol=0, atol=TOLERANCE,
    )  # fmt: skip
    out = _run(capsys, "--chunks", "1", "--sessions", "2", "--max-sessions", "1")
    assert "the pool holds 1 slots for 2 sessions: the others wait for a free slot" in out


@pytest.mark.parametrize("every", [1, 2])
def test_swap_every_gives_the_same_latents_as_without(capsys, tmp_path, every):
    _run(capsys, "--chunks", "4", "--sessions", "2", "--join-every", "1", "--out", str(tmp_path / "plain"))
    _run(capsys, "--chunks", "4", "--sessions", "2", "--join-every", "1", "--swap-every", str(every),
         "--out", str(tmp_path / "swapped"))  # fmt: skip
    for i in range(2):
        plain, swapped = (
            _latents(tmp_path / "plain" / f"session_{i}"),
            _latents(tmp_path / "swapped" / f"session_{i}"),
        )
        torch.testing.assert_close(swapped["latent"], plain["latent"], rtol=0, atol=TOLERANCE)
    report = json.loads((tmp_path / "swapped" / "stream.json").read_text())
    # suspended after every `every`-th chunk of its own but the last (a finished session leaves instead)
    after = [k for k in range(3) if (k + 1) % every == 0]
    for session in report["sessions"]:
        assert [w["after_chunk"] for w in session["swaps"]] == after
        assert all(w["bytes"] > 0 and w["resume_seconds"] is not None for w in session["swaps"])
    assert report["swaps"]["count"] == 2 * len(after)
    assert report["swaps"]["bytes"] == sum(w["bytes"] for s in report["sessions"] for w in s["swaps"])


def test_swap_every_without_sessions_swaps_the_one_stream(capsys, tmp_path):
    """--swap-every alone runs the single stream through a pool of one slot: the same video, swapped."""
    _run(capsys, "--chunks", "3", "--swap-every", "1", "--out", str(tmp_path / "swapped"))
    _run(capsys, "--chunks", "3", "--out", str(tmp_path / "single"))
    torch.testing.assert_close(
        _latents(tmp_path / "swapped" / "session_0")["latent"], _latents(tmp_path / "single")["latent"],
        rtol=0, atol=TOLERANCE,
    )  # fmt: skip


def test_text_output_has_a_line_per_tick_and_a_summary_per_session(capsys, tmp_path):
    out = _run(capsys, "--chunks", "2", "--sessions", "2", "--join-every", "1", "--swap-every", "1",
               "--out", str(tmp_path))  # fmt: skip
    lines = out.splitlines()
    ticks = [line for line in lines if line.startswith("tick ")]
    assert [line.rsplit(", ", 1)[0] for line in ticks] == [
        "tick 0: sessions 0, batch 1 (bucket 1)",
        "tick 1: sessions 0, 1, batch 2 (bucket 2)",
        "tick 2: sessions 1, batch 1 (bucket 1)",
    ]
    assert all(line.endswith(" s") for line in ticks)
    summaries = [line for line in lines if line.startswith("session ") and "chunks, first chunk" in line]
    assert [line.split(":")[0] for line in summaries] == ["session 0 (seed 0)", "session 1 (seed 1)"]
    assert all("deadlines met" in line and "p99" in line and "waited mean" in line for line in summaries)
    assert "session 0: suspended after chunk 0" in out and "session 0: resumed into slot" in out
    assert "2 swaps: " in out and f"wrote {tmp_path / 'stream.json'}" in out


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--sessions", "0"], "input '--sessions': expected at least 1, got 0"),
        (["--sessions", "2", "--join-every", "-1"], "input '--join-every': expected at least 0, got -1"),
        (["--swap-every", "-2"], "input '--swap-every': expected at least 0, got -2"),
        (["--sessions", "2", "--max-sessions", "0"], "input '--max-sessions': expected at least 1, got 0"),
        (["--sessions", "2", "--buckets", "1,x"],
         "input '--buckets': expected positive batch sizes separated by commas (1,2,4,8), got '1,x'"),
        (["--sessions", "2", "--buckets", "0"],
         "input '--buckets': expected positive batch sizes separated by commas (1,2,4,8), got '0'"),
        (["--seed", str(2**64 - 1), "--sessions", "2"],
         f"input '--seed': session 1's seed {2**64 - 1} + 1 = {2**64} is past 2^64 - 1; use a smaller --seed or "
         "fewer --sessions"),
        (["--sessions", "2", "--chunks", "0"], "input '--chunks': expected at least 1, got 0"),
    ],
)  # fmt: skip
def test_bad_pool_flags_are_one_line_naming_the_flag(capsys, args, expected):
    assert _error(capsys, *args) == f"error: fewstep stream: {expected}"


def test_a_single_stream_flag_is_refused_with_a_pool():
    args = argparse.Namespace(sessions=2, max_sessions=None, join_every=0, swap_every=0, seed=0, buckets="1,2",
                              save_session="s.safetensors")  # fmt: skip
    with pytest.raises(
        InputError, match="input '--save-session': saves or continues one stream; it cannot be "
    ):
        check_pool_flags(args)


def test_a_pool_that_does_not_fit_the_memory_is_refused_naming_max_sessions(tmp_path):
    # 10 MiB for the pack: the weights (1.6 MiB) fit, not one session at 256x256 (a 21-frame window)
    r = subprocess.run(
        [sys.executable, "-m", "fewstep", "stream", "--model", "wan-tiny", "--height", "256", "--width", "256",
         "--sessions", "2", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, env={**os.environ, "FEWSTEP_MEMORY_LIMIT_GB": "0.01"},
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: fewstep stream: input '--max-sessions': not one session fits: a session "
                               "needs about ")  # fmt: skip
    assert "refused before allocating" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not os.listdir(tmp_path / "out")  # nothing written


def test_percentile_is_the_nearest_rank():
    values = [0.4, 0.1, 0.3, 0.2]
    assert [percentile(values, q) for q in (1, 50, 75, 99, 100)] == [0.1, 0.2, 0.3, 0.4, 0.4]


@pytest.mark.slow
def test_compile_applies_to_the_pool_and_keeps_the_latents(capsys, tmp_path):
    """--compile runs every batched step compiled (open_session_pool on the compiled handle), same video."""
    common = ("--chunks", "3", "--sessions", "2", "--join-every", "1")
    _run(capsys, *common, "--out", str(tmp_path / "eager"))
    report = _report(capsys, *common, "--compile", "regional", "--compile-backend", "aot_eager", "--out",
                     str(tmp_path / "compiled"))  # fmt: skip
    assert report["compile"]["frames_compiled"] > 0 and report["compile"]["failures"] == []
    for i in range(2):
        torch.testing.assert_close(
            _latents(tmp_path / "compiled" / f"session_{i}")["latent"],
            _latents(tmp_path / "eager" / f"session_{i}")["latent"],
            rtol=0, atol=TOLERANCE,
        )  # fmt: skip


def test_a_session_whose_output_is_not_finite_stops_the_run_naming_it(capsys, tmp_path, monkeypatch):
    from fewstep.engine.causal.session_pool import SessionPool

    forward = SessionPool._forward

    def nan_forward(self, batch, bucket, x, timestep):
        return forward(self, batch, bucket, x, timestep) * float("nan")

    monkeypatch.setattr(SessionPool, "_forward", nan_forward)
    err = _error(capsys, "--chunks", "2", "--sessions", "2", "--seed", "4", "--out", str(tmp_path))
    assert err.startswith(
        "error: fewstep stream: input '--model': session 0 (seed 4): chunk 0 (latent frames 0-1): the denoised "
        "latents hold NaN or infinite values; the session was stopped"
    ), err
    assert not os.path.exists(tmp_path / "session_0" / "latents.safetensors")  # no half-written file
