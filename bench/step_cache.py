"""Step-cache gating: 28-step cached vs uncached (wall time, DiT forwards, deviation) and the gate's cost at 4 steps.

    python bench/step_cache.py                 # flux-mid, 128x128 px, first_block at 3 thresholds + teacache/magcache
    python bench/step_cache.py --quick         # 64x64 px, first_block at 2 thresholds, 1 round (< 90 s)
    python bench/step_cache.py --size 256x256 --rounds 3 --thresholds 0.05,0.1,0.2

**28 steps** (``flux.1-dev`` schedule, euler, cfg 1): per round the uncached run and each cached configuration
are timed back to back (same inputs, same seed); speed-up = uncached time / cached time per round, median over
rounds. Forwards = DiT forwards that ran every block (``SampleReport.model_calls``) and those the cache served
(``cache_probes``: First-Block-Cache runs block 0 and the head on those). Deviation = max |cached - uncached| /
max |uncached| of the output latent. *Estimated* = the telemetry's block-evaluation ratio.

Dummy weights are not smooth in time: a random time MLP on a sinusoidal embedding of ``1000 * sigma`` makes
block 0's residual change by ~60% between adjacent steps (a trained FLUX changes by a few %), so no threshold a
real model would use skips anything (the ``raw`` row shows it: the gate says so instead of faking savings). The
cached rows use the same model with its time MLP's output layer scaled by 0.1 (``smooth``): ~8% per step.

**Gate overhead at 4 steps** (``flux.1-schnell``, where the gate refuses): a run with the gate attached against
one without, in A/B pairs, next to A/A pairs (no gate on both sides: the noise floor of this run); plus the cost
of the decision itself (``start_run`` + ``finish``), timed alone. Goal: not measurable (within the A/A noise).
"""

from __future__ import annotations

import argparse
import timeit

import torch
from _common import RESULTS, flux_inputs, header, median, parse_args, parse_px, save, setup_threads, timed

from fewstep.engine import TextCondition, open_model, sample_latent
from fewstep.engine.step_cache import STEP_CACHE_FEATURE, make_gate

STEPS = 28
QUICK = {
    "size": "64x64",
    "txt": 16,
    "rounds": 1,
    "thresholds": "0.1,0.2",
    "extra": False,
    "overhead_rounds": 4,
}
SMOOTHING = 0.1


def smooth(model) -> None:
    with torch.no_grad():
        model.time_in.out_layer.weight.mul_(SMOOTHING)
        model.time_in.out_layer.bias.mul_(SMOOTHING)


def deviation(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


def measure_28(preset: str, size: str, txt: int, thresholds: list[float], rounds: int, extra: bool) -> dict:
    w, h = parse_px(size)
    handle = open_model(f"dummy:{preset}")
    inputs = flux_inputs(handle.params, w, h, txt)
    cond = TextCondition(inputs["txt"], inputs["y"])
    latent = torch.zeros(1, handle.params.latent_channels, h // 8, w // 8)

    def run(hd):
        return sample_latent(hd, [cond], latent, steps=STEPS, schedule="flux.1-dev", seed=0)

    rows = []
    if extra:  # the raw dummy weights: the gate is on, the measured change is far above any usual threshold
        gate = make_gate("first_block", 0.1)
        out, report = run(handle.with_feature(STEP_CACHE_FEATURE, gate))
        changes = [c for c in report.cache.as_dict()["changes"] if c is not None]
        rows.append({"label": "raw first_block 0.1", "model_calls": report.model_calls,
                     "probes": report.cache_probes, "median_change": median(changes)})  # fmt: skip
    smooth(handle.model)
    configs = [(f"first_block {t:g}", make_gate("first_block", t)) for t in thresholds]
    if extra:
        configs.append(
            ("teacache 0.4 (flux.1 poly)", make_gate("teacache", 0.4, teacache_coefficients="flux.1"))
        )
        path = str(RESULTS / "step_cache_magcache.json")
        run(
            handle.with_feature(STEP_CACHE_FEATURE, make_gate("magcache", magcache_file=path, calibrate=True))
        )
        configs.append(("magcache 0.05 (calibrated)", make_gate("magcache", 0.05, magcache_file=path)))
    handles = [(label, handle.with_feature(STEP_CACHE_FEATURE, gate)) for label, gate in configs]
    base, base_report = run(handle)  # warm-up and the reference output
    # Per round: the uncached run, then every cached configuration (in alternating order), each compared with
    # that round's uncached time.
    uncached: list[float] = []
    times: dict[str, list[float]] = {label: [] for label, _ in handles}
    results: dict[str, tuple] = {}
    for r in range(rounds):
        uncached.append(timed(lambda: run(handle)))
        for label, hd in handles if r % 2 == 0 else handles[::-1]:
            box = {}
            times[label].append(timed(lambda hd=hd, box=box: box.update(res=run(hd))))
            results[label] = box["res"]
    for label, _ in handles:
        out, report = results[label]
        pairs = [u / c for u, c in zip(uncached, times[label])]
        t = report.cache
        rows.append({
            "label": f"smooth {label}", "model_calls": report.model_calls, "probes": report.cache_probes,
            "skipped": t.skipped_steps, "speedup": median(pairs), "speedup_min_max": [min(pairs), max(pairs)],
            "estimated": t.estimated_speedup, "deviation": deviation(out, base),
            "rms_deviation": float((out - base).pow(2).mean().sqrt() / base.pow(2).mean().sqrt()),
            "uncached_s": median(uncached), "cached_s": median(times[label]),
        })  # fmt: skip
    return {"preset": preset, "size": size, "image_tokens": inputs["img"].shape[1], "text_tokens": txt,
            "steps": STEPS, "rounds": rounds, "uncached_model_calls": base_report.model_calls, "rows": rows}  # fmt: skip


def measure_overhead(preset: str, size: str, txt: int, rounds: int) -> dict:
    w, h = parse_px(size)
    handle = open_model(f"dummy:{preset}")
    inputs = flux_inputs(handle.params, w, h, txt)
    cond = TextCondition(inputs["txt"], inputs["y"])
    latent = torch.zeros(1, handle.params.latent_channels, h // 8, w // 8)
    gate = make_gate("first_block", 0.08)
    gated = handle.with_feature(STEP_CACHE_FEATURE, gate)

    def run(hd):
        return lambda: sample_latent(hd, [cond], latent, steps=4, schedule="flux.1-schnell", seed=0)

    _, report = run(gated)()
    assert not report.cache.decision.enabled
    run(handle)()
    ab, aa = [], []
    for _ in range(rounds):
        plain = timed(run(handle))
        ab.append(timed(run(gated)) / plain - 1)
        plain = timed(run(handle))
        aa.append(timed(run(handle)) / plain - 1)
    sigmas = torch.tensor(report.sigmas)
    n = 2000
    decision_s = timeit.timeit(lambda: gate.start_run(handle.model, sigmas, "euler").finish(), number=n) / n
    forward_s = median([timed(run(handle)) for _ in range(2)]) / 4
    return {"preset": preset, "size": size, "rounds": rounds, "overhead": median(ab), "overhead_min_max":
            [min(ab), max(ab)], "aa": median(aa), "aa_min_max": [min(aa), max(aa)], "decision_us": decision_s * 1e6,
            "decision_share_of_4_steps": decision_s / (4 * forward_s), "reason": report.cache.decision.reason}  # fmt: skip


def print_results(res: dict, over: dict) -> None:
    print(f"### {STEPS} steps, {res['preset']} {res['size']} ({res['image_tokens']}+{res['text_tokens']} tokens), "
          f"flux.1-dev schedule, euler; {res['rounds']} round(s); uncached: {res['uncached_model_calls']} forwards\n")  # fmt: skip
    print(
        "| configuration | forwards (+ served) | skipped | wall speed-up (min-max) | estimated | deviation max | rms |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        if "speedup" not in r:
            print(f"| {r['label']} | {r['model_calls']} (+{r['probes']}) | 0 | - | - | median block-0 change "
                  f"{r['median_change']:.2f} | - |")  # fmt: skip
            continue
        lo, hi = r["speedup_min_max"]
        print(f"| {r['label']} | {r['model_calls']} (+{r['probes']}) | {r['skipped']} | **{r['speedup']:.2f}x** "
              f"({lo:.2f}-{hi:.2f}) | {r['estimated']:.2f}x | {r['deviation']:.2%} | {r['rms_deviation']:.2%} |")  # fmt: skip
    print(
        f"\n### Gate overhead at 4 steps ({over['preset']} {over['size']}, flux.1-schnell; the gate refuses)\n"
    )
    print(f"reason: {over['reason']}\n")
    print("| pair | median (min-max) over rounds |")
    print("|---|---|")
    lo, hi = over["overhead_min_max"]
    print(f"| gate vs no gate | **{over['overhead']:+.2%}** ({lo:+.1%}..{hi:+.1%}) |")
    lo, hi = over["aa_min_max"]
    print(f"| A/A (no gate vs no gate) | {over['aa']:+.2%} ({lo:+.1%}..{hi:+.1%}) |")
    print(f"\nThe decision itself (start_run + finish): {over['decision_us']:.0f} us = "
          f"{over['decision_share_of_4_steps']:.4%} of the 4-step run.")  # fmt: skip


def summary(res: dict, over: dict) -> list[dict]:
    rows = []
    for r in res["rows"]:
        if "speedup" not in r:
            rows.append({"metric": f"{res['preset']} {res['size']} {STEPS} steps, {r['label']} (dummy weights)",
                         "value": f"{r['model_calls']}/{STEPS} forwards: nothing skipped, median change "
                         f"{r['median_change']:.2f}", "goal": None, "met": None})  # fmt: skip
            continue
        rows.append({
            "metric": f"{res['preset']} {res['size']} {STEPS} steps, {r['label']}: cached vs uncached wall time",
            "value": f"{r['speedup']:.2f}x ({r['model_calls']}/{STEPS} full forwards, est. {r['estimated']:.2f}x, "
            f"max deviation {r['deviation']:.2%})",
            "goal": "fewer forwards than uncached", "met": r["model_calls"] < res["uncached_model_calls"],
        })  # fmt: skip
    noise = max(abs(v) for v in over["aa_min_max"])
    rows.append({
        "metric": f"gate overhead at 4 steps ({over['preset']} {over['size']}, refused), gate vs no gate",
        "value": f"{over['overhead']:+.2%} (A/A {over['aa']:+.2%}, noise +-{noise:.1%}; decision "
        f"{over['decision_share_of_4_steps']:.3%} of the run)",
        "goal": "not measurable (within the A/A noise)", "met": abs(over["overhead"]) <= noise,
    })  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="flux-mid")
    ap.add_argument("--size", default="128x128", help="image size in px, WxH")
    ap.add_argument("--txt", type=int, default=32, help="text tokens")
    ap.add_argument("--thresholds", default="0.05,0.1,0.2", help="first_block thresholds")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds of the 28-step runs")
    ap.add_argument("--overhead-rounds", type=int, default=8, help="A/B and A/A pairs at 4 steps")
    ap.add_argument(
        "--no-extra", dest="extra", action="store_false", help="skip raw / teacache / magcache rows"
    )
    args = parse_args(ap, QUICK)
    setup_threads(args.threads)
    env = header("Step-cache gating (CPU)")
    thresholds = [float(t) for t in args.thresholds.split(",")]
    res = measure_28(args.preset, args.size, args.txt, thresholds, args.rounds, args.extra)
    over = measure_overhead(args.preset, args.size, args.txt, args.overhead_rounds)
    print_results(res, over)
    save("step_cache", {"env": env, "quick": args.quick, "steps": res, "overhead": over,
                        "summary": summary(res, over)})  # fmt: skip


if __name__ == "__main__":
    main()
