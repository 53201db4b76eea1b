"""Sequence parallelism on CPU: 2 ranks against 1, and the bytes a rank sends per step against the formula.

    python bench/parallel.py                   # flux-tiny 512, 768 and 1024 px, 4 steps, 5 rounds
    python bench/parallel.py --quick           # flux-mid 512 px, 2 rounds (~80 s on 2 cores)
    python bench/parallel.py --cases flux-tiny@1024x1024 --rounds 3 --threads 2
    python bench/parallel.py --cases flux2-mid@512x512,zimage-mid@512x512 --rounds 2   # FLUX.2, Z-Image

Every side samples the same 4-step FLUX.1-schnell run (dummy weights, fp32, one prompt of ``--txt`` tokens, cfg 1:
one forward per step) and returns the same latent (checked, <= 1e-5):

* **single**: ``sample_latent`` in this process, ``--threads / 2`` torch threads;
* **pool x1**: a worker pool of one rank (ulysses 1 x ring 1): the sequence-parallel code path at degree 1 plus
  the pool's dispatch (job and result through the TCP store, progress polling), ``--threads / 2`` threads;
* **ulysses 2** and **ring 2**: one pool of two ranks, ``--threads / 2`` threads each, the job's degrees (2, 1) and
  (1, 2).

The sides are timed interleaved, the order rotating each round; speed-up = single time / 2-rank time per round,
median (min-max) and best-of (min / min). Next to it, the *work split*: the CPU seconds of the single process
over those of the busiest rank (``/proc/<pid>/stat``), median over rounds. It approximates the speed-up with a free
core per rank: two ranks that wait for each other in every block lose wall time whenever either is descheduled,
so on a busy machine the wall-clock ratio collapses first. The CPU seconds include what gloo burns while a rank
waits for its peer, so under heavy load the work split reads low too; only an idle machine gives the real ratio. ``--threads`` (default: this machine's cores) is what the two-rank pool
uses in all: each rank gets half, and so does the single process, a rank's worth of the machine (on a 2-core
machine: 1 thread per rank against 1 thread; ``bench/run_all --threads 2`` means the same). The goal (>= 1.5x
for 2 ranks) is on a compute-bound case, flux-mid at 512 px: 1024 image tokens through a 768-wide model, so the
forward's FLOPs (linear in the per-rank tokens, and attention) dwarf the traffic. flux-tiny's forward is so
small that the replicated parts and the waits weigh more (its ratios are printed too, without a goal).
What limits the ratio: the text tokens are replicated (every rank runs them through every block), the embedding
and the final layer run on every token on every rank, and each block waits for its all-to-alls.

**Bytes per step.** Each rank counts the bytes it sends per collective (``engine.parallel.mesh.CommStats``);
rank 0's counts divided by the steps are compared with the formula, per forward (B batch rows, N image tokens,
S = N / world per rank, T text tokens, H heads of D, C hidden width, e bytes per element, L = double + single
blocks)::

    Ulysses (u):  L x [(u-1)/u x 4 B S H D e  (q, k, v out, the output back; all-to-all)
                       + (u-1) B T (H/u) D e   (text rows, all-gather over heads)]
    ring (r):     L x (r-1) x 2 B S H D e      (K/V blocks around the ring)
    stream:       (world-1) B S C e            (the blocks' output, all-gathered for the final layer)

plus one 4-byte all-reduce per step (ranks agree on cancellation). On a CUDA machine a GPU section times one GPU
in this process against a one-rank pool on NCCL (the SP code path at degree 1), which bounds the overhead of
the pool: one machine with one GPU cannot run two ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from _common import header, median, parse_px, save, setup_threads

from fewstep.engine import TextCondition, open_model, sample_latent
from fewstep.engine.models.zimage import padded_length
from fewstep.engine.parallel import ParallelConfig, WorkerPool, image_sharding, parallel_sample

TARGET_RATIO = 1.5
GOAL_CASE = "flux-mid@512x512"
TOL = 1e-5
QUICK = {"cases": GOAL_CASE, "rounds": 2, "gpu_cases": "flux-mid@1024x1024"}
SIDES = ("single", "pool x1", "ulysses 2", "ring 2")
DEGREES = {"ulysses 2": (2, 1), "ring 2": (1, 2), "pool x1": (1, 1)}


def per_rank_threads(total: int | None) -> int:
    """Half of the pool's thread budget (default: this machine's cores) for each rank and the single process."""
    return max(1, (total or len(os.sched_getaffinity(0))) // 2)


def condition(handle, tokens: int, seed: int = 0) -> TextCondition:
    """Seeded conditioning of the handle's family (FLUX.1: T5 tokens and a pooled vector; FLUX.2, Z-Image: tokens)."""
    g = torch.Generator().manual_seed(seed)
    spec, params = handle.family.image, handle.params
    pooled = spec.pooled_dim(params)
    return TextCondition(
        torch.randn(1, tokens, spec.context_dim(params), generator=g),
        None if pooled is None else torch.randn(1, pooled, generator=g),
        3.5,
    )


def empty_latent(handle, width: int, height: int, device="cpu") -> torch.Tensor:
    fmt = handle.family.latent_format
    return torch.zeros(1, fmt.channels, height // fmt.downscale, width // fmt.downscale, device=device)


def sharded_shape(handle) -> tuple[int, int, int]:
    """(heads, width, sharded blocks) of an image DiT: FLUX.1 / FLUX.2 every block; Z-Image its layers (the
    refiners run whole on every rank, in the embed stage)."""
    p = handle.params
    if handle.family.name == "zimage":
        return p.n_heads, p.dim, p.n_layers
    return p.num_heads, p.hidden_size, p.depth + p.depth_single_blocks


def expected_bytes_per_step(
    handle, batch: int, image_tokens: int, text_tokens: int, degrees, elt: int = 4
) -> dict:
    """The formula of the module docstring, per kind of collective (one forward per step, cfg 1).
    ``image_tokens``: the sharded ones (Z-Image: padded to 32); ``text_tokens``: the replicated ones (Z-Image:
    the caption padded to 32)."""
    u, r = degrees
    world = u * r
    s = image_tokens // world
    h, c, blocks = sharded_shape(handle)
    d = c // h
    x = batch * s * h * d * elt  # one of q, k, v or the output, on one rank
    out = {}
    if u > 1:
        out["all_to_all"] = blocks * (3 * x * (u - 1) // u + x * (u - 1) // u)
        if text_tokens:
            out["gather_heads"] = blocks * (u - 1) * batch * text_tokens * (h // u) * d * elt
    if r > 1:
        out["ring"] = blocks * (r - 1) * 2 * x
    if world > 1:
        out["gather_stream"] = (world - 1) * batch * s * c * elt
    out["all_reduce"] = 4
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_case(case: str, args, pools: dict) -> dict:
    preset, size = case.split("@")
    width, height = parse_px(size)
    handle = open_model(f"dummy:{preset}", device="cpu", dtype=torch.float32)
    p = handle.params
    cond = condition(handle, args.txt)
    latent = empty_latent(handle, width, height)
    image_tokens = image_sharding(handle.family.name).sharded_tokens(p, latent.shape[-2], latent.shape[-1])
    text_tokens = padded_length(args.txt, p.seq_multiple) if handle.family.name == "zimage" else args.txt
    kwargs = {"seed": 0, "steps": args.steps, "schedule": "flux.1-schnell", "sampler": "euler"}

    def single():
        return sample_latent(handle, [cond], latent, **kwargs)

    def on_pool(name):
        pool = pools["x1"] if name == "pool x1" else pools["x2"]
        return lambda: parallel_sample(pool, handle, [cond], latent, degrees=DEGREES[name], **kwargs)

    runs = {"single": single, **{name: on_pool(name) for name in SIDES[1:]}}
    outputs, comm = {}, {}
    for name, fn in runs.items():  # warm-up: loads the model on the workers, checks equality
        out, report = fn()
        outputs[name] = out
        if name != "single":
            comm[name] = report.notes[-1]
    reference = outputs["single"]
    max_diff = {
        name: float((out - reference).abs().max()) for name, out in outputs.items() if name != "single"
    }

    times = {name: [] for name in SIDES}
    cpu = {name: [] for name in SIDES}  # seconds of CPU: this process (single), the busiest rank (pools)
    for i in range(args.rounds):
        order = SIDES[i % len(SIDES) :] + SIDES[: i % len(SIDES)]
        for name in order:
            pids = [] if name == "single" else (pools["x1"] if name == "pool x1" else pools["x2"]).pids()
            before, c0, t0 = [cpu_seconds(p) for p in pids], time.process_time(), time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
            if name == "single":
                cpu[name].append(time.process_time() - c0)
            else:
                cpu[name].append(max(cpu_seconds(p) - b for p, b in zip(pids, before, strict=True)))

    result = {
        "preset": preset, "size": f"{width}x{height}", "image_tokens": image_tokens, "text_tokens": args.txt,
        "steps": args.steps, "heads": sharded_shape(handle)[0], "hidden": sharded_shape(handle)[1],
        "max_abs_diff": max_diff,
        "seconds": times, "median_seconds": {k: median(v) for k, v in times.items()}, "cpu_seconds": cpu,
    }  # fmt: skip
    for name in SIDES[1:]:
        ratios = [a / b for a, b in zip(times["single"], times[name], strict=True)]
        result[f"speedup {name}"] = {
            "median": median(ratios), "min": min(ratios), "max": max(ratios),
            "best_of": min(times["single"]) / min(times[name]),
            "work_split": median([a / b for a, b in zip(cpu["single"], cpu[name], strict=True)]),
        }  # fmt: skip
    result["comm"] = measure_comm(pools["x2"], handle, cond, latent, image_tokens, text_tokens)
    return result


def measure_comm(pool, handle, cond, latent, image_tokens: int, text_tokens: int) -> dict:
    """Rank 0's bytes per step (each kind of collective) against the formula, for both 2-rank splits."""
    out = {}
    steps = 2
    for name in ("ulysses 2", "ring 2"):
        comm: dict = {}
        parallel_sample(pool, handle, [cond], latent, steps=steps, degrees=DEGREES[name], comm=comm)
        sent = comm["bytes_sent"]
        measured = {k: v // steps for k, v in sent.items()}
        expected = expected_bytes_per_step(handle, 1, image_tokens, text_tokens, DEGREES[name])
        out[name] = {
            "measured": measured, "expected": expected, "calls": comm["calls"],
            "measured_total": sum(measured.values()), "expected_total": sum(expected.values()),
            "equal": measured == expected and all(v % steps == 0 for v in sent.values()),
        }  # fmt: skip
    return out


def run_gpu(args) -> list[dict]:
    """One GPU: this process against a one-rank NCCL pool (the SP code path at degree 1)."""
    results = []
    pool = None
    try:
        config = ParallelConfig(mode="sp", ulysses_degree=1, ring_degree=1, backend="auto", timeout=300.0)
        pool = WorkerPool(config).start()
        for case in args.gpu_cases.split(","):
            preset, size = case.split("@")
            width, height = parse_px(size)
            handle = open_model(f"dummy:{preset}", device="cuda", dtype=torch.bfloat16)
            cond = condition(handle, args.txt).to("cuda", torch.bfloat16)
            latent = empty_latent(handle, width, height, device="cuda")
            kwargs = {"seed": 0, "steps": args.steps, "schedule": "flux.1-schnell", "sampler": "euler"}

            def single(handle=handle, cond=cond, latent=latent, kwargs=kwargs):
                out = sample_latent(handle, [cond], latent, **kwargs)[0]
                torch.cuda.synchronize()
                return out

            def pooled(handle=handle, cond=cond, latent=latent, kwargs=kwargs):
                return parallel_sample(pool, handle, [cond], latent, **kwargs)[0]

            a, b = single().float().cpu(), pooled().float().cpu()
            times = {"single": [], "pool x1": []}
            for i in range(args.rounds):
                for name, fn in ((("single", single), ("pool x1", pooled)) if i % 2 == 0
                                 else (("pool x1", pooled), ("single", single))):  # fmt: skip
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            ratios = [p / s for s, p in zip(times["single"], times["pool x1"], strict=True)]
            results.append({
                "case": case, "device": torch.cuda.get_device_name(0), "backend": pool.backend,
                "max_abs_diff": float((a - b).abs().max()), "seconds": times,
                "overhead": median(ratios) - 1.0, "overhead_min": min(ratios) - 1.0,
                "ms_per_run": {k: 1e3 * median(v) for k, v in times.items()},
            })  # fmt: skip
    except Exception as err:  # noqa: BLE001 - the CPU part stands; the failure is reported
        results.append({"error": f"{type(err).__name__}: {err}"})
    finally:
        if pool is not None:
            pool.shutdown()
    return results


def print_results(results: list[dict], threads: int) -> None:
    print(f"### Time per 4-step run (median of rounds), {threads} thread(s) per process / rank\n")
    print("| case | tokens img + txt | single | pool x1 | ulysses 2 | ring 2 | speed-up ulysses 2 | speed-up ring 2 "
          "| work split (CPU s) ulysses 2 / ring 2 | pool x1 overhead | max abs diff |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        m = r["median_seconds"]
        su, sr, s1 = r["speedup ulysses 2"], r["speedup ring 2"], r["speedup pool x1"]
        print(
            f"| {r['preset']} {r['size']} | {r['image_tokens']} + {r['text_tokens']} | {m['single']:.3f} s "
            f"| {m['pool x1']:.3f} s | {m['ulysses 2']:.3f} s | {m['ring 2']:.3f} s "
            f"| {su['median']:.2f}x ({su['min']:.2f}-{su['max']:.2f}, best {su['best_of']:.2f}x) "
            f"| {sr['median']:.2f}x ({sr['min']:.2f}-{sr['max']:.2f}, best {sr['best_of']:.2f}x) "
            f"| {su['work_split']:.2f}x / {sr['work_split']:.2f}x "
            f"| {1 / s1['median'] - 1:+.1%} | {max(r['max_abs_diff'].values()):.1e} |"
        )
    print("\n### Bytes rank 0 sends per step: measured / formula\n")
    print("| case | split | all_to_all | gather_heads | ring | gather_stream | all_reduce | total | equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for name, c in r["comm"].items():
            cells = []
            for kind in ("all_to_all", "gather_heads", "ring", "gather_stream", "all_reduce"):
                got, want = c["measured"].get(kind, 0), c["expected"].get(kind, 0)
                cells.append(f"{got:,} / {want:,}" if got or want else "-")
            print(f"| {r['preset']} {r['size']} | {name} | {' | '.join(cells)} | {c['measured_total']:,} / "
                  f"{c['expected_total']:,} | {c['equal']} |")  # fmt: skip


def print_gpu(results: list[dict]) -> None:
    print("\n### One GPU: this process vs a one-rank pool (SP code path at degree 1)\n")
    for r in results:
        if "error" in r:
            print(f"GPU section failed: {r['error']}")
            continue
        ms = r["ms_per_run"]
        print(f"- {r['case']} on {r['device']} ({r['backend']}): {ms['single']:.1f} ms vs {ms['pool x1']:.1f} ms "
              f"per run, overhead {r['overhead']:+.1%} (min {r['overhead_min']:+.1%}), max abs diff "
              f"{r['max_abs_diff']:.1e}")  # fmt: skip


def summary(results: list[dict], gpu: list[dict], threads: int) -> list[dict]:
    rows = []
    for r in results:
        case = f"{r['preset']}@{r['size']}"
        goal = case == GOAL_CASE
        for name in ("ulysses 2", "ring 2"):
            s = r[f"speedup {name}"]
            rows.append({
                "metric": f"sequence parallel 2 ranks ({name}) vs 1 process, {r['preset']} {r['size']}, "
                f"{r['steps']} steps, CPU, {threads} thread(s) per rank vs {threads} thread(s)",
                "value": f"{s['median']:.2f}x (min-max {s['min']:.2f}-{s['max']:.2f}, best-of {s['best_of']:.2f}x; "
                f"work split by CPU time {s['work_split']:.2f}x)",
                "goal": f">= {TARGET_RATIO}x" if goal else None,
                "met": s["median"] >= TARGET_RATIO if goal else None,
            })  # fmt: skip
        s1 = r["speedup pool x1"]
        rows.append({
            "metric": f"pool of 1 rank (SP path at degree 1 + dispatch) vs in-process, {r['preset']} {r['size']}",
            "value": f"{1 / s1['median'] - 1:+.1%} time", "goal": None, "met": None,
        })  # fmt: skip
        for name, c in r["comm"].items():
            rows.append({
                "metric": f"bytes per step rank 0 sends, {name}, {r['preset']} {r['size']}",
                "value": f"{c['measured_total']:,} measured, {c['expected_total']:,} by the formula",
                "goal": "= formula", "met": c["equal"],
            })  # fmt: skip
        rows.append({
            "metric": f"2-rank and 1-rank pool outputs vs single process, {r['preset']} {r['size']}",
            "value": f"max abs diff {max(r['max_abs_diff'].values()):.1e}", "goal": f"<= {TOL:g}",
            "met": max(r["max_abs_diff"].values()) <= TOL,
        })  # fmt: skip
    for g in gpu:
        if "error" in g:
            rows.append(
                {"metric": "one GPU, SP path at degree 1", "value": g["error"], "goal": None, "met": None}
            )
            continue
        rows.append({
            "metric": f"one GPU ({g['device']}), one-rank pool (SP path at degree 1) vs in-process, {g['case']}",
            "value": f"{g['overhead']:+.1%} time ({g['ms_per_run']['pool x1']:.1f} vs "
            f"{g['ms_per_run']['single']:.1f} ms per run)",
            "goal": None, "met": None,
        })  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="flux-tiny@768x768,flux-tiny@1024x1024,flux-mid@512x512",
                    help="preset@WxH, comma-separated (CPU)")  # fmt: skip
    ap.add_argument("--txt", type=int, default=16, help="prompt tokens (replicated on every rank)")
    ap.add_argument("--steps", type=int, default=4, help="sampling steps (flux.1-schnell schedule)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (each runs every side once)")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads of the two-rank pool in all; each rank and the single process get half "
                    "(default: the machine's cores)")  # fmt: skip
    ap.add_argument("--gpu-cases", default="flux-mid@1024x1024,flux-mid@2048x2048",
                    help="preset@WxH for the GPU section (only when CUDA is available)")  # fmt: skip
    ap.add_argument("--no-gpu", action="store_true", help="skip the GPU section")
    ap.add_argument("--quick", action="store_true", help=f"short run for bench/run_all: defaults {QUICK}")
    if "--quick" in sys.argv[1:]:
        ap.set_defaults(**QUICK)
    args = ap.parse_args()
    threads = setup_threads(per_rank_threads(args.threads))
    env = header("Sequence parallelism: 2 ranks vs 1 (gloo, CPU)")
    print(f"{threads} thread(s) in this process and in each rank (2 ranks: {2 * threads} threads)\n")
    pools = {}
    try:
        for key, (u, r) in (("x1", (1, 1)), ("x2", (2, 1))):
            config = ParallelConfig(mode="sp", ulysses_degree=u, ring_degree=r, backend="gloo", timeout=120.0,
                                    threads_per_rank=threads)  # fmt: skip
            pools[key] = WorkerPool(config).start()
        results = [run_case(case, args, pools) for case in args.cases.split(",")]
    finally:
        for pool in pools.values():
            pool.shutdown()
    print_results(results, threads)
    gpu = []
    if torch.cuda.is_available() and not args.no_gpu:
        gpu = run_gpu(args)
        print_gpu(gpu)
    rows = summary(results, gpu, threads)
    print("\n| metric | value | goal | met |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['metric']} | {row['value']} | {row['goal'] or '-'} | "
              f"{row['met'] if row['met'] is not None else '-'} |")  # fmt: skip
    save("parallel", {"env": env, "quick": args.quick, "threads_per_rank": threads, "target_ratio": TARGET_RATIO,
                      "results": results, "gpu": gpu, "summary": rows,
                      "loadavg_1min_at_end": os.getloadavg()[0]})  # fmt: skip


if __name__ == "__main__":
    main()
