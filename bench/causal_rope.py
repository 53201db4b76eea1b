"""Cache-relative RoPE against absolute RoPE in the causal stream, per-chunk time against the window, and where a
steady chunk's CPU time goes.

    python bench/causal_rope.py               # wan-mid, 192x192 px (144 tokens a frame), 2 threads, 4 rounds
    python bench/causal_rope.py --quick       # 2 rounds, windows 2,4,8 (< 3 min)
    python bench/causal_rope.py --threads 1 --windows 2,4,8,16,24

Three parts, one process, the same random weights:

1. **Side by side** (chunk 3, window 9): the steady per-chunk seconds of the default stream (``rope="cache"``, no
   sinks), of ``rope="absolute"``, and of ``rope="cache"`` with 3 sinks (the sinks' keys re-positioned once a
   chunk). The streams of a round run back to back, rounds interleaved; a chunk's time is ``ChunkResult.seconds``
   (its denoising forwards plus the previous chunk's clean pass); steady = the chunks from the first one whose
   forwards and carried clean pass all read a full window; per mode the median over rounds of each round's
   median. The max abs difference of the cache and absolute latents is printed (no sinks: the same computation).
2. **Window sweep** (chunk 2): steady per-chunk seconds for each window, against the analytic FLOPs of a steady
   chunk (``engine.plan.wan_forward_flops``: the static cache reads every slot of the window; steps + 1 forwards),
   fixed part (projections, FFN, cross-attention) and per-frame part (self-attention over the window).
   ``predicted`` = FLOPs(w) / one throughput, fitted by least squares over every window of the mode (time
   proportional to FLOPs, no intercept); the ratio measured / predicted is the check (within 10%). The time and
   FLOP ratios to the smallest window are printed too.
3. **Profile** of one steady chunk (``torch.profiler``, CPU): self time by category, an op counted under its
   outermost aten op: ``aten::linear`` (its ``addmm`` and the bias copy inside it) is GEMM,
   ``aten::scaled_dot_product_attention`` is attention, the rest by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch
from _common import header, median, parse_px, save, setup_threads, summary_row
from torch.profiler import ProfilerActivity, profile

from fewstep.engine import load_dit
from fewstep.engine.causal import CausalConfig, VideoSession
from fewstep.engine.models.wan import PRESETS, Wan, tokens_per_frame
from fewstep.engine.plan.flops import wan_forward_flops

STEPS = 4  # wan-dmd-4step
GEMM_OPS = {"aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::bmm", "aten::baddbmm"}
ATTENTION_OPS = {"aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu"}


def steady_from(cfg: CausalConfig) -> int:
    """Index of the first chunk whose denoising forwards and carried clean pass all read a full window."""
    return math.ceil(cfg.window_frames / cfg.chunk_frames)


def stream(model, ctx, w: int, h: int, cfg: CausalConfig, chunks: int):
    session = VideoSession(model, ctx, h, w, cfg, seed=0)
    try:
        results = list(session.chunks(chunks))
    finally:
        session.dispose()
    return results


def steady_seconds(results, cfg: CausalConfig) -> float:
    return median([r.seconds for r in results[steady_from(cfg) :]])


def chunk_flops(p, cfg: CausalConfig, tpf: int) -> tuple[float, float]:
    """(fixed, per window frame) FLOPs of a steady chunk: steps + 1 forwards, each reading the whole window."""
    passes = STEPS + 1
    at = {w: wan_forward_flops(p, cfg.chunk_frames, tpf, w * tpf).total * passes for w in (1, 2)}
    return at[1] - (at[2] - at[1]), at[2] - at[1]


# -- 1. side by side -----------------------------------------------------------------------------------------------
def side_by_side(model, ctx, w, h, chunk, window, rounds, sinks):
    modes = {
        "cache (default)": CausalConfig(chunk_frames=chunk, window_frames=window),
        "absolute": CausalConfig(chunk_frames=chunk, window_frames=window, rope="absolute"),
        f"cache, {sinks} sinks": CausalConfig(chunk_frames=chunk, window_frames=window, sink_frames=sinks),
    }
    n = steady_from(modes["absolute"]) + 3
    times = {name: [] for name in modes}
    latents = {}
    for _ in range(rounds):
        for name, cfg in modes.items():
            results = stream(model, ctx, w, h, cfg, n)
            times[name].append(steady_seconds(results, cfg))
            latents[name] = torch.cat([r.latents for r in results], dim=2)
    diff = (latents["cache (default)"] - latents["absolute"]).abs().max().item()
    rows = [
        {"mode": name, "steady_seconds": median(t), "min_max": [min(t), max(t)]} for name, t in times.items()
    ]
    return {
        "chunk": chunk,
        "window": window,
        "chunks": n,
        "rows": rows,
        "cache_vs_absolute_max_abs_diff": diff,
    }


# -- 2. window sweep -----------------------------------------------------------------------------------------------
def window_sweep(model, ctx, w, h, chunk, windows, rounds, tpf):
    modes = ("cache", "absolute")
    times = {(m, win): [] for m in modes for win in windows}
    for _ in range(rounds):
        for win in windows:
            for m in modes:
                cfg = CausalConfig(chunk_frames=chunk, window_frames=win, rope=m)
                times[(m, win)].append(
                    steady_seconds(stream(model, ctx, w, h, cfg, steady_from(cfg) + 3), cfg)
                )
    fixed, per_frame = chunk_flops(model.params, CausalConfig(chunk_frames=chunk), tpf)
    base = windows[0]
    flops_at = {win: fixed + per_frame * win for win in windows}
    # seconds per FLOP, least squares through the origin over the windows (one throughput per mode)
    per_flop = {
        m: sum(median(times[(m, win)]) * flops_at[win] for win in windows)
        / sum(f * f for f in flops_at.values())
        for m in modes
    }
    rows = []
    for win in windows:
        flops = fixed + per_frame * win
        row = {"window": win, "gflop": flops / 1e9, "flops_ratio": flops / (fixed + per_frame * base)}
        for m in modes:
            t = median(times[(m, win)])
            row[f"{m}_seconds"] = t
            row[f"{m}_time_ratio"] = t / median(times[(m, base)])
            row[f"{m}_measured_over_predicted"] = t / (flops * per_flop[m])
        rows.append(row)
    fit = {m: 1 / per_flop[m] / 1e9 for m in modes}  # GFLOP/s of the fitted throughput
    return {"chunk": chunk, "fixed_gflop": fixed / 1e9, "per_frame_gflop": per_frame / 1e9, "rows": rows,
            "fitted_gflops": fit}  # fmt: skip


# -- 3. profile ----------------------------------------------------------------------------------------------------
def outermost_aten(event):
    name, parent = event.name, event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            name = parent.name
        parent = parent.cpu_parent
    return name


def profile_chunk(model, ctx, w, h, cfg: CausalConfig):
    session = VideoSession(model, ctx, h, w, cfg, seed=0)
    try:
        it = session.chunks(steady_from(cfg) + 1)
        for _ in range(steady_from(cfg)):
            next(it)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            result = next(it)
        it.close()
    finally:
        session.dispose()
    by: dict[str, float] = {}
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        top = outermost_aten(e)
        key = "GEMM" if top in GEMM_OPS else "attention" if top in ATTENTION_OPS else top
        by[key] = by.get(key, 0.0) + e.self_cpu_time_total / 1e6
    total = sum(by.values())
    share = {k: v / total for k, v in sorted(by.items(), key=lambda kv: -kv[1])}
    return {"chunk_seconds": result.seconds, "op_seconds": total, "share": share,
            "gemm_plus_attention": share.get("GEMM", 0) + share.get("attention", 0)}  # fmt: skip


# -- output --------------------------------------------------------------------------------------------------------
def print_side(r):
    print(f"### Steady per-chunk seconds (chunk {r['chunk']}, window {r['window']}, {r['chunks']} chunks)\n")
    print("| mode | steady s (min-max) | vs cache (default) |\n|---|---|---|")
    ref = r["rows"][0]["steady_seconds"]
    for row in r["rows"]:
        lo, hi = row["min_max"]
        print(
            f"| {row['mode']} | {row['steady_seconds']:.3f} ({lo:.3f}-{hi:.3f}) | {row['steady_seconds'] / ref:.2f} |"
        )
    print(
        f"\nmax |cache - absolute| over the latents (no sinks): {r['cache_vs_absolute_max_abs_diff']:.1e}\n"
    )


def print_sweep(r):
    print(
        f"### Steady per-chunk time against the window (chunk {r['chunk']}): FLOPs per steady chunk "
        f"{r['fixed_gflop']:.1f} GFLOP fixed + {r['per_frame_gflop']:.2f} GFLOP per window frame\n"
    )
    print(
        "| window | GFLOP | FLOPs vs first | cache s | cache time vs first | measured / predicted "
        "| absolute s | absolute time vs first | measured / predicted |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in r["rows"]:
        print(
            f"| {row['window']} | {row['gflop']:.1f} | {row['flops_ratio']:.2f} | {row['cache_seconds']:.3f} "
            f"| {row['cache_time_ratio']:.2f} | {row['cache_measured_over_predicted']:.2f} "
            f"| {row['absolute_seconds']:.3f} | {row['absolute_time_ratio']:.2f} "
            f"| {row['absolute_measured_over_predicted']:.2f} |"
        )
    fit = ", ".join(f"{m} {v:.1f} GFLOP/s" for m, v in r["fitted_gflops"].items())
    print(f"\npredicted = FLOPs / the fitted throughput ({fit})\n")


def print_profile(name, r):
    print(
        f"### Profile of one steady chunk, {name} ({r['chunk_seconds']:.2f} s, ops {r['op_seconds']:.2f} s)\n"
    )
    print(f"GEMM + attention: **{100 * r['gemm_plus_attention']:.1f}%** of the ops' CPU time\n")
    print("| category | share |\n|---|---|")
    for k, v in list(r["share"].items())[:10]:
        print(f"| {k} | {100 * v:.1f}% |")
    print()


def summary(out: dict) -> list[dict]:
    """Rows for bench/run_all: the default against absolute RoPE, the sweep against FLOPs, the profile."""
    rows = []
    if "side_by_side" in out:
        t = {r["mode"]: r["steady_seconds"] for r in out["side_by_side"]["rows"]}
        ratio = t["cache (default)"] / t["absolute"]
        metric = "causal stream, steady per-chunk time rope=cache / rope=absolute"
        rows.append(summary_row(metric, f"{ratio:.2f}x", "<= 1.05x", ratio <= 1.05))
    if "sweep" in out:
        worst = max(abs(r["cache_measured_over_predicted"] - 1) for r in out["sweep"]["rows"])
        metric = "causal stream, per-chunk time vs window: worst |measured / FLOP-predicted - 1|"
        rows.append(summary_row(metric, f"{100 * worst:.0f}%", "<= 10%", worst <= 0.10))
    for name, r in out.get("profile", {}).items():
        metric = f"causal stream, GEMM + attention share of a steady chunk, {name}"
        rows.append(summary_row(metric, f"{100 * r['gemm_plus_attention']:.1f}%"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="wan-mid")
    ap.add_argument("--size", default="192x192", help="width x height in pixels")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--sweep-rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=3, help="side by side: latent frames per chunk")
    ap.add_argument("--window", type=int, default=9, help="side by side: window in latent frames")
    ap.add_argument("--sinks", type=int, default=3, help="side by side: sinks of the third mode")
    ap.add_argument("--sweep-chunk", type=int, default=2)
    ap.add_argument("--windows", default="2,4,8,16")
    ap.add_argument("--profile-presets", default="wan-mid", help="comma list; e.g. wan-mid,wan2.1-1.3b")
    ap.add_argument(
        "--profile-layers", type=int, default=4, help="layers of a profiled preset (width is kept)"
    )
    ap.add_argument("--skip", default="", help="comma list of parts to skip: side, sweep, profile")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.sweep_rounds, args.windows = 2, 2, "2,4,8"
    threads = setup_threads(args.threads)
    env = header(f"Causal stream RoPE and per-chunk cost ({args.preset}, {args.size} px)")
    w, h = parse_px(args.size)
    model = load_dit(f"dummy:{args.preset}")
    ctx = torch.randn(1, 16, model.params.text_dim, generator=torch.Generator().manual_seed(0))
    tpf = tokens_per_frame(model.params, h // 8, w // 8)
    print(f"{tpf} tokens a frame, {threads} threads, {args.rounds} rounds\n")
    skip = set(filter(None, args.skip.split(",")))
    out = {"env": env, "preset": args.preset, "size": args.size, "tokens_per_frame": tpf}
    if "side" not in skip:
        out["side_by_side"] = side_by_side(model, ctx, w, h, args.chunk, args.window, args.rounds, args.sinks)
        print_side(out["side_by_side"])
    if "sweep" not in skip:
        windows = [int(v) for v in args.windows.split(",")]
        out["sweep"] = window_sweep(model, ctx, w, h, args.sweep_chunk, windows, args.sweep_rounds, tpf)
        print_sweep(out["sweep"])
    if "profile" not in skip:
        out["profile"] = {}
        for name in args.profile_presets.split(","):
            layers = dataclasses.replace(PRESETS[name], num_layers=args.profile_layers)
            m = model if name == args.preset else Wan(layers).eval()
            c = ctx if m is model else torch.randn(1, 16, m.params.text_dim)
            cfg = CausalConfig(chunk_frames=args.chunk, window_frames=args.window)
            out["profile"][name] = profile_chunk(m, c, w, h, cfg)
            print_profile(
                name if m is model else f"{name} width, {args.profile_layers} layers", out["profile"][name]
            )
    out["summary"] = summary(out)
    save("causal_rope", out)


if __name__ == "__main__":
    main()
