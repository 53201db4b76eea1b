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

from fewstep.engine.models import flux2, zimage
from fewstep.engine.models.flux import random_inputs
from fewstep.engine.models.registry import family_of

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


def summary_row(metric: str, value: str, goal: str | None = None, met: bool | None = None) -> dict:
    """One row of a script's ``"summary"`` (what ``bench/run_all`` tabulates)."""
    return {"metric": metric, "value": value, "goal": goal, "met": met}


def peer_rows(
    time_metric: str, diff_metric: str, r: dict, max_diff: float, diff_note: str = ""
) -> list[dict]:
    """The two summary rows of a side-by-side run against a peer implementation: the peer's time / ours
    (``r["ratio"]``, ``r["ratio_best_of"]``) and the max abs difference of the outputs (``r["max_abs_diff"]``)."""
    return [
        summary_row(time_metric, f"{r['ratio']:.2f}x (best-of {r['ratio_best_of']:.2f}x)"),
        summary_row(
            diff_metric,
            f"{r['max_abs_diff']:.1e}{diff_note}",
            f"<= {max_diff:g}",
            r["max_abs_diff"] <= max_diff,
        ),
    ]


def parse_px(size: str) -> tuple[int, int]:
    """``"512x768"`` (width x height in pixels, multiples of 16) -> (width, height)."""
    w, h = (int(v) for v in size.lower().split("x"))
    if w % 16 or h % 16:
        raise SystemExit(f"image size {size} is not a multiple of 16")
    return w, h


flux_inputs = random_inputs  # Flux.forward keyword arguments for a width x height px image

# forward keyword arguments of each image family for a width x height px image (16 px a token in all three)
DIT_INPUTS = {"flux": random_inputs, "flux2": flux2.random_inputs, "zimage": zimage.random_inputs}


def dit_inputs(model, width: int, height: int, txt: int, batch: int = 1) -> dict:
    """``model(**inputs)`` keyword arguments for a ``width x height`` px image and ``txt`` text tokens, seeded."""
    return DIT_INPUTS[family_of(model).name](model.params, width, height, txt, batch)


def image_tokens(width: int, height: int) -> int:
    """Image tokens of FLUX.1, FLUX.2 and Z-Image: one per 16 x 16 px (before Z-Image's padding to 32)."""
    return (width // 16) * (height // 16)


def describe_dit(params) -> str:
    """Width, heads and blocks of an image DiT's params, for a benchmark's header line."""
    if hasattr(params, "depth_single_blocks"):  # FLUX.1 and FLUX.2
        return (
            f"hidden {params.hidden_size}, {params.num_heads} heads x {params.head_dim}, {params.depth} double + "
            f"{params.depth_single_blocks} single blocks"
        )
    return (
        f"dim {params.dim}, {params.n_heads} heads x {params.head_dim}, {params.n_refiner_layers} + "
        f"{params.n_refiner_layers} refiner + {params.n_layers} single-stream layers"
    )


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
