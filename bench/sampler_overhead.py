"""Sampler-loop overhead at 4 steps: ``sample_latent`` against 4 bare DiT forwards, same run, same inputs.

    python bench/sampler_overhead.py                          # flux-tiny and flux-mid, 256x256 px
    python bench/sampler_overhead.py --presets flux-mid --size 512x512 --rounds 8
    python bench/sampler_overhead.py --quick                  # euler only, 3 rounds (< 1 min)

overhead = (loop time - 4 x forward time) / (4 x forward time), where loop time is one
``sample_latent(handle, [cond], latent, steps=4, schedule="flux.1-schnell", sampler=...)`` call and forward
time is one ``handle.model(...)`` call on the packed inputs ``flux_velocity`` builds (packed latent, ids,
T5 tokens, pooled vector). Each sampler run is paired with a 4-forward run right before it (A/B alternating);
the reported overhead is the median of the per-pair ratios. A first row "A/A" times 4 forwards against 4
forwards the same way: the noise floor of the run. Everything ``sample_latent`` does besides the 4
forwards counts as overhead: validation, schedule, noise, latent format, packing, the sampler's own math.
"""

from __future__ import annotations

import argparse
import math

import torch
from _common import flux_inputs, header, median, parse_args, parse_px, save, setup_threads, timed

from fewstep.engine import RunOptions, TextCondition, open_model, sample_latent
from fewstep.engine.sampling import SAMPLERS

STEPS = 4
TARGET = 0.02
NOISE_FLOOR = "A/A"  # 4 forwards timed against 4 forwards: the spread a zero overhead shows in this run
QUICK = {"samplers": "euler", "rounds": 3, "min_time": 0.1}  # --quick defaults (explicit flags win)
# flux-tiny's forward is a few ms, so any fixed per-step cost is a large share of it by construction: the 2%
# goal is about models whose forward is at least flux-mid's (hundreds of ms on a CPU, a real model on a GPU).
GOAL_PRESETS = {"flux-mid"}


def measure(preset: str, size: str, txt: int, samplers: list[str], rounds: int, min_s: float) -> dict:
    handle = open_model(f"dummy:{preset}")
    w, h = parse_px(size)
    inputs = flux_inputs(handle.params, w, h, txt)
    cond = TextCondition(inputs["txt"], inputs["y"])
    latent = torch.zeros(1, handle.params.latent_channels, h // 8, w // 8)

    def forwards():
        backends = RunOptions().backends_for(handle)  # what the sampler's run hands every forward
        with torch.inference_mode():
            for _ in range(STEPS):
                handle.model(**inputs, backends=backends)

    def loop(sampler):
        if sampler == NOISE_FLOOR:
            return forwards
        return lambda: sample_latent(
            handle, [cond], latent, steps=STEPS, schedule="flux.1-schnell", sampler=sampler
        )

    # Repeat each side `inner` times per timing so that one timing lasts at least `min_s`.
    inner = max(1, math.ceil(min_s / timed(forwards)))

    def repeated(fn):
        return lambda: [fn() for _ in range(inner)]

    for s in samplers:  # warm-up
        loop(s)(), forwards()
    fwd: dict[str, list[float]] = {s: [] for s in samplers}
    run: dict[str, list[float]] = {s: [] for s in samplers}
    for _ in range(rounds):
        for s in samplers:
            fwd[s].append(timed(repeated(forwards)) / inner)
            run[s].append(timed(repeated(loop(s))) / inner)
    rows = []
    for s in samplers:
        ratios = [(r - f) / f for f, r in zip(fwd[s], run[s])]
        rows.append(
            {
                "sampler": s,
                "loop_ms": median(run[s]) * 1e3,
                "forwards_ms": median(fwd[s]) * 1e3,
                "overhead": median(ratios),
                "overhead_min_max": [min(ratios), max(ratios)],
                "overhead_best_of": (min(run[s]) - min(fwd[s])) / min(fwd[s]),
                "overhead_ms_per_step": median([(r - f) / STEPS for f, r in zip(fwd[s], run[s])]) * 1e3,
            }
        )
    return {
        "preset": preset,
        "size": size,
        "image_tokens": inputs["img"].shape[1],
        "text_tokens": txt,
        "steps": STEPS,
        "rounds": rounds,
        "inner_repeats": inner,
        "forward_ms": median([x for s in samplers for x in fwd[s]]) * 1e3 / STEPS,
        "samplers": rows,
    }


def print_results(results: list[dict]) -> None:
    print(
        f"overhead = (sample_latent time - {STEPS} x forward) / ({STEPS} x forward); median of A/B pairs "
        f"(min-max); best-of = from min times. Target <= {TARGET:.0%}. Row A/A: 4 forwards vs 4 forwards "
        "(noise floor).\n"
    )
    print(
        "| preset | image | forward ms | sampler | loop ms | 4 x forward ms | overhead (min-max) "
        "| best-of | overhead ms / step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for res in results:
        for r in res["samplers"]:
            lo, hi = r["overhead_min_max"]
            print(
                f"| {res['preset']} | {res['size']} ({res['image_tokens']}+{res['text_tokens']} tok) "
                f"| {res['forward_ms']:.2f} | {r['sampler']} | {r['loop_ms']:.2f} | {r['forwards_ms']:.2f} "
                f"| **{r['overhead']:+.2%}** ({lo:+.1%}..{hi:+.1%}) | {r['overhead_best_of']:+.2%} "
                f"| {r['overhead_ms_per_step']:.3f} |"
            )
    print(
        "\nThe per-step cost (last column) is fixed: it does not grow with the model. On the tiny preset it is"
        "\ncompared with a forward of a few ms, so the percentage is large by construction; the mid preset"
        "\n(and real checkpoints, whose forwards are slower still) is the one the <= 2% goal is about."
    )
    # The smallest model measures the fixed per-step cost best (least forward-time noise around it).
    small = min(results, key=lambda r: r["forward_ms"])
    cost = median([r["overhead_ms_per_step"] for r in small["samplers"] if r["sampler"] != NOISE_FLOOR])
    projected = ", ".join(f"{r['preset']} {cost / r['forward_ms']:.2%}" for r in results)
    print(f"\nPer-step cost on {small['preset']} (median over samplers): {cost:.3f} ms; as a share of each")
    print(f"preset's forward (the overhead a noise-free run would show): {projected}.")


def summary(results: list[dict]) -> list[dict]:
    """Rows for the suite table (bench/run_all): the median overhead over samplers per preset, a ratio."""
    out = []
    for res in results:
        rows = [r for r in res["samplers"] if r["sampler"] != NOISE_FLOOR]
        noise = next(r for r in res["samplers"] if r["sampler"] == NOISE_FLOOR)
        overhead = median([r["overhead"] for r in rows])
        goal = res["preset"] in GOAL_PRESETS
        # an A/A pair (zero overhead by construction) off by more than the goal: this run cannot decide it
        resolved = abs(noise["overhead"]) <= TARGET
        verdict = "" if resolved or not goal else "; inconclusive: the A/A noise exceeds the goal"
        out.append(
            {
                "metric": f"sampler-loop overhead at {STEPS} steps over {STEPS} bare forwards, {res['preset']} "
                f"{res['size']} ({'/'.join(r['sampler'] for r in rows)}, median)",
                "value": f"{overhead:+.2%} (A/A noise {noise['overhead']:+.2%}{verdict})",
                "goal": f"<= {TARGET:.0%}" if goal else None,
                "met": overhead <= TARGET if goal and resolved else None,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="flux-tiny,flux-mid")
    ap.add_argument("--size", default="256x256", help="image size in px, WxH")
    ap.add_argument("--txt", type=int, default=128, help="text tokens")
    ap.add_argument("--samplers", default=",".join(SAMPLERS))
    ap.add_argument("--rounds", type=int, default=5, help="A/B pairs per sampler")
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds per timing (inner repeats)")
    args = parse_args(ap, QUICK)

    setup_threads(args.threads)
    env = header(f"Sampler-loop overhead at {STEPS} steps (CPU)")
    samplers = [NOISE_FLOOR, *args.samplers.split(",")]
    results = [
        measure(p, args.size, args.txt, samplers, args.rounds, args.min_time) for p in args.presets.split(",")
    ]
    print_results(results)
    save(
        "sampler_overhead",
        {"env": env, "quick": args.quick, "target": TARGET, "results": results, "summary": summary(results)},
    )


if __name__ == "__main__":
    main()
