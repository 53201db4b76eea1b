"""Cold start: how long after a process starts its first result appears, against ``import torch`` alone.

Each case is a whole process, started from nothing (``python -c ...`` or ``python -m fewstep ...``), timed from
``Popen`` to the first stdout line that shows its result (the import's ``ready``, ``stream``'s ``chunk 0:``,
``generate``'s ``wrote .../image.png``) and to its exit. The cases run interleaved, one of each per round, so a
busy moment of the machine falls on all of them. Reported per case: median (min-max) over the rounds, and the
median's distance from ``import torch``'s, which is what the package adds on top of PyTorch's own import.

    python bench/cold_start.py                    # 7 rounds, every case
    python bench/cold_start.py --rounds 3 --python /path/to/other/venv/bin/python   # another tree or venv

The goal (issue 35): the first chunk of ``stream --model wan-tiny`` and the first image of ``generate --model
flux-tiny`` within 0.5 s of ``import torch``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_SECONDS = 0.5

# name -> (arguments after the interpreter, the stdout line that marks the result)
CASES = {
    "import torch": (["-c", "import torch; print('ready', flush=True)"], r"^ready$"),
    "import fewstep.engine": (["-c", "import fewstep.engine; print('ready', flush=True)"], r"^ready$"),
    "stream wan-tiny: first chunk": (
        ["-m", "fewstep", "stream", "--model", "wan-tiny", "--chunks", "2"],
        r"^chunk 0:",
    ),
    "generate flux-tiny: first image": (
        ["-m", "fewstep", "generate", "--model", "flux-tiny", "--decode", "tiny", "--out", "{out}"],
        r"^wrote .*image\.png",
    ),
}


def run_once(python: str, argv: list[str], marker: str, out_dir: str, env: dict) -> tuple[float, float]:
    """(seconds to the marker line, seconds to exit) of one process."""
    argv = [a.replace("{out}", out_dir) for a in argv]
    pattern = re.compile(marker)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [python, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=out_dir
    )
    first = None
    for line in proc.stdout:
        if first is None and pattern.search(line.rstrip("\n")):
            first = time.perf_counter() - t0
    err = proc.stderr.read()
    code = proc.wait()
    total = time.perf_counter() - t0
    if code != 0 or first is None:
        raise SystemExit(f"{' '.join(argv)} failed (exit {code}, marker seen: {first is not None}):\n{err}")
    return first, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable, help="the interpreter to time (default: this one)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--threads", type=int, default=None, help="OMP_NUM_THREADS for the processes (default unset)"
    )
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    ap.add_argument("--quick", action="store_true", help="3 rounds (what bench/run_all runs)")
    args = ap.parse_args()
    if args.quick:
        args.rounds = min(args.rounds, 3)
    names = [n.strip() for n in args.cases.split(",")]
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    firsts: dict[str, list[float]] = {n: [] for n in names}
    exits: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="fewstep-cold-") as out_dir:
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate who runs first
            for name in order:
                argv, marker = CASES[name]
                first, total = run_once(args.python, argv, marker, out_dir, env)
                firsts[name].append(first)
                exits[name].append(total)
    base = statistics.median(firsts["import torch"]) if "import torch" in firsts else None
    print(
        f"## cold start, {args.rounds} rounds, {args.python}; 1-min load {os.getloadavg()[0]:.2f} at the end\n"
    )
    print("| case | result at s, median (min-max) | after import torch | exit at s, median (min-max) |")
    print("|---|---|---|---|")
    rows = {}
    for name in names:
        f, e = firsts[name], exits[name]
        med = statistics.median(f)
        delta = "-" if base is None or name == "import torch" else f"+{med - base:.2f} s"
        print(
            f"| {name} | {med:.2f} ({min(f):.2f}-{max(f):.2f}) | {delta} | "
            f"{statistics.median(e):.2f} ({min(e):.2f}-{max(e):.2f}) |"
        )
        rows[name] = {"first": f, "exit": e}
    summary = []
    for name in names:
        if name == "import torch" or base is None:
            continue
        after = statistics.median(firsts[name]) - base
        goal = name.startswith(("stream", "generate"))
        summary.append(
            {"metric": f"cold start: {name}, seconds after import torch", "value": f"{after:.2f} s",
             "goal": f"<= {GOAL_SECONDS} s" if goal else None, "met": after <= GOAL_SECONDS if goal else None}
        )  # fmt: skip
    payload = {"python": args.python, "rounds": args.rounds, "cases": rows, "summary": summary}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=2)
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    (results / "cold_start.json").write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
