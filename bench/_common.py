"""Shared bits of the bench scripts: thread setup, a header line, medians, inputs, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from fewstep.engine.models.flux import random_inputs

RESULTS = Path(__file__).resolve().parent / "results"


def setup_threads(threads: int | None) -> int:
    """``torch.set_num_threads`` (default: every core this process may use) and return the count."""
    n = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    return n


def environment() -> dict:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "loadavg_1min_at_start": os.getloadavg()[0],
    }


def header(title: str) -> dict:
    env = environment()
    print(
        f"## {title}\n\ntorch {env['torch']}, {env['threads']} threads ({env['cores']} cores), CPU; "
        f"1-min load average at start {env['loadavg_1min_at_start']:.2f} (other processes distort timings)\n"
    )
    return env


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median(xs) -> float:
    return statistics.median(xs)


def parse_px(size: str) -> tuple[int, int]:
    """``"512x768"`` (width x height in pixels, multiples of 16) -> (width, height)."""
    w, h = (int(v) for v in size.lower().split("x"))
    if w % 16 or h % 16:
        raise SystemExit(f"image size {size} is not a multiple of 16")
    return w, h


flux_inputs = random_inputs  # Flux.forward keyword arguments for a width x height px image


def save(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nresults: {path}")
    return path


def parse_args(ap, quick: dict):
    """Add the options every benchmark has (--threads, --quick) and parse; --quick applies the script's short-run
    defaults (what bench/run_all uses), explicit options still win."""
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--quick", action="store_true", help=f"short run for bench/run_all: defaults {quick}")
    if "--quick" in sys.argv[1:]:
        ap.set_defaults(**quick)
    return ap.parse_args()
