#!/usr/bin/env python3
"""Issue 29 before / after: the engine consolidation must not change speed. Two checkouts, the same commands,
interleaved in one run.

    git worktree add /tmp/old <commit before the consolidation>
    python bench/before_after/consolidation.py --old /tmp/old              # ~6 min on 2 cores, --rounds 5
    python bench/before_after/consolidation.py --old /tmp/old --rounds 3 --threads 2

Each case is a whole ``python -m fewstep ...`` process (what a user runs), run once per round in each checkout,
old and new alternating which goes first. The figures come from the commands' own ``--json`` reports (per-step and
per-chunk seconds, timed inside the process after loading) and from the process's wall time (start-up included).
The ratio column is new / old per round (below 1: the new tree is faster), its median and min-max over rounds.

Cases (dummy weights, the CPU, ``OMP_NUM_THREADS=--threads``):

* ``generate``: ``flux-mid`` 128x128 px, 4 steps of the flux.1-schnell schedule: median step, the sampling loop;
* ``stream bf16`` / ``stream int8``: ``wan-mid`` 64x96 px, 16 chunks of 3 latent frames, a 9-frame window: median
  seconds of the chunks whose window is full (chunk 3 on; each includes the previous chunk's clean-context pass),
  and the first chunk;
* ``import``: ``python -c "import fewstep.engine"``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"

STREAM = ["stream", "--model", "wan-mid", "--height", "64", "--width", "96", "--chunks", "16", "--chunk-frames", "3",
          "--window-frames", "9", "--json"]  # fmt: skip
CASES = {
    "generate": [
        "generate",
        "--model",
        "flux-mid",
        "--height",
        "128",
        "--width",
        "128",
        "--steps",
        "4",
        "--json",
    ],
    "stream bf16": [*STREAM, "--kv-dtype", "bf16"],
    "stream int8": [*STREAM, "--kv-dtype", "int8"],
    "import": None,
}


def figures(case: str, report: dict | None) -> dict[str, float]:
    """The case's figures in ms from its JSON report."""
    if case == "generate":
        steps = report["timings"]["per_step_s"]
        return {
            "step_ms": 1e3 * statistics.median(steps),
            "sampling_ms": 1e3 * report["timings"]["sampling_s"],
        }
    if case.startswith("stream"):
        chunks = report["chunks"]
        return {
            "full_window_chunk_ms": 1e3 * statistics.median(c["seconds"] for c in chunks[3:]),
            "first_chunk_ms": 1e3 * report["first_chunk_seconds"],
        }
    return {}


def run_case(case: str, path: Path, threads: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(path), "OMP_NUM_THREADS": str(threads), "FEWSTEP_KERNELS": "auto"}
    args = CASES[case]
    cmd = (
        [sys.executable, "-c", "import fewstep.engine"]
        if args is None
        else [sys.executable, "-m", "fewstep", *args]
    )
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{case} failed in {path}:\n{done.stderr[-2000:]}")
    report = json.loads(done.stdout) if args is not None else None
    return {**figures(case, report), "process_ms": 1e3 * wall}


def linked(checkout: Path, folder: Path) -> Path:
    """A folder holding ``fewstep -> checkout``, for PYTHONPATH (the checkout is the package itself)."""
    folder.mkdir(parents=True)
    (folder / "fewstep").symlink_to(checkout.resolve())
    return folder


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3g} ({min(xs):.3g}-{max(xs):.3g})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, type=Path, help="checkout of the tree before the consolidation")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES))
    args = ap.parse_args()
    cases = args.cases.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"old": linked(args.old, Path(tmp) / "old"), "new": linked(ROOT, Path(tmp) / "new")}
        samples = {(c, t): [] for c in cases for t in trees}
        for case in cases:  # warm the file cache and compile the .pyc of both trees
            for tree in trees.values():
                run_case(case, tree, args.threads)
        for r in range(args.rounds):
            for case in cases:
                order = ("old", "new") if r % 2 == 0 else ("new", "old")
                for name in order:
                    samples[case, name].append(run_case(case, trees[name], args.threads))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    load = os.getloadavg()[0]
    print(f"threads {args.threads}, rounds {args.rounds}, 1-min load at the end {load:.2f}\n")
    print("| case | figure | old ms, median (min-max) | new ms | new / old per round, median (min-max) |")
    print("|---|---|---|---|---|")
    rows = []
    for case in cases:
        for key in samples[case, "old"][0]:
            old = [s[key] for s in samples[case, "old"]]
            new = [s[key] for s in samples[case, "new"]]
            ratios = [n / o for n, o in zip(new, old)]
            rows.append({"case": case, "figure": key, "old_ms": old, "new_ms": new, "ratios": ratios})
            print(f"| {case} | {key} | {spread(old)} | {spread(new)} | {spread(ratios)} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "consolidation.json").write_text(
        json.dumps({"threads": args.threads, "rounds": args.rounds, "load": load, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
