"""Causal video streaming on CPU: per-chunk time and KV memory over a stream, and cached against uncached generation.

    python bench/causal_stream.py                          # wan-mid, 192x192 px, chunk 3, window 9, sinks 0 and 3
    python bench/causal_stream.py --size 256x256 --window 12 --rounds 5 --lengths 2,4,6,8
    python bench/causal_stream.py --quick                  # 2 streams per sink setting, lengths 2 and 4 (< 90 s)

Stream: ``VideoSession(...).chunks(n)`` over ``n = 2 x window / chunk`` chunks, ``--rounds`` streams per sink
setting (A/B interleaved), per chunk the median of ``ChunkResult.seconds`` over rounds. A chunk's time is its 4
denoising forwards (chunk queries against the cache) plus the previous chunk's deferred clean-context pass (one
more forward, ``commit_seconds``); chunk 0 has no commit, so it is the first-chunk latency. Flatness = time of the
last chunk / time of the first chunk whose forwards all read a full window (goal <= 1.1x), ratio per round.

Cached vs uncached: the same video (same seed) from ``VideoSession`` (construction included) and from
``recompute_video`` (every denoising step reruns the whole prefix under a block-causal mask), timed back to back
per round for each video length. Predicted ratio = analytic FLOPs of the recompute / of the cached run: linear
layers 2 x weights x tokens, attention 4 x Nq x Nk x dim per layer (self and cross); the analytic linear FLOPs are
checked against ``FlopCounterMode`` (which does not count attention on the CPU).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from _common import header, median, parse_args, parse_px, save, setup_threads
from torch.utils.flop_counter import FlopCounterMode

from fewstep.engine import load_dit
from fewstep.engine.causal import CausalConfig, VideoSession
from fewstep.engine.causal.reference import recompute_video

STEPS = 4  # wan-dmd-4step
TARGET_FLAT = 1.1
MB = 2**20
QUICK = {"rounds": 2, "lengths": "2,4", "recompute_rounds": 1}  # --quick defaults (explicit flags win)


# -- FLOPs ---------------------------------------------------------------------------------------------------------
def forward_flops(p, frames: int, tpf: int, key_tokens: int, text_kv: bool) -> tuple[int, int]:
    """(linear, attention) FLOPs of one forward over ``frames`` latent frames of ``tpf`` tokens, batch 1."""
    n, d, L = frames * tpf, p.dim, p.num_layers
    patch = math.prod(p.patch_size)
    per_token = p.in_dim * patch * d + L * (6 * d * d + 2 * d * p.ffn_dim) + d * p.out_dim * patch
    per_frame = p.freq_dim * d + d * d + 6 * d * d  # time embedding and projection
    linear = 2 * (n * per_token + frames * per_frame) + (text_flops_kv(p) if text_kv else 0)
    return linear, L * 4 * n * (key_tokens + p.text_len) * d


def text_flops_kv(p) -> int:
    """Cross-attention keys and values of the (padded) prompt, all layers."""
    return p.num_layers * 2 * 2 * p.text_len * p.dim * p.dim


def video_flops(p, cfg: CausalConfig, tpf: int, n: int) -> dict:
    """Analytic FLOPs of an n-chunk video, cached and recomputed, per chunk and in total."""
    c, w = cfg.chunk_frames, cfg.window_frames
    text_embed = 2 * p.text_len * (p.text_dim * p.dim + p.dim * p.dim)  # once per video on both sides
    cached, recompute = [], []
    for k in range(n):
        lin, att = forward_flops(p, c, tpf, min((k + 1) * c, w) * tpf, text_kv=False)
        # as timed: a chunk carries the previous chunk's clean pass; the last one's is deferred, never run
        commit = forward_flops(p, c, tpf, min(k * c, w) * tpf, text_kv=False) if k else (0, 0)
        cached.append((STEPS * lin + commit[0], STEPS * att + commit[1]))
        lin, att = forward_flops(p, (k + 1) * c, tpf, (k + 1) * c * tpf, text_kv=True)
        recompute.append((STEPS * lin, STEPS * att))
    cached[0] = (cached[0][0] + text_embed + text_flops_kv(p), cached[0][1])  # cross K/V cached once
    recompute[0] = (recompute[0][0] + text_embed, recompute[0][1])
    out = {"cached_per_chunk_gflop": [sum(x) / 1e9 for x in cached]}
    out["recompute_per_chunk_gflop"] = [sum(x) / 1e9 for x in recompute]
    for name, rows in (("cached", cached), ("recompute", recompute)):
        out[f"{name}_linear_gflop"] = sum(x[0] for x in rows) / 1e9
        out[f"{name}_attention_gflop"] = sum(x[1] for x in rows) / 1e9
        out[f"{name}_gflop"] = out[f"{name}_linear_gflop"] + out[f"{name}_attention_gflop"]
    return out


def counted_linear_gflop(fn) -> float:
    """FlopCounterMode's total without attention ops (it counts GEMMs and convolutions; SDPA not on the CPU)."""
    with FlopCounterMode(display=False) as fc:
        fn()
    return sum(v for k, v in fc.get_flop_counts()["Global"].items() if "attention" not in str(k)) / 1e9


# -- runs ----------------------------------------------------------------------------------------------------------
def clock(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def cached_video(model, ctx, w, h, cfg, n):
    session = VideoSession(model, ctx, h, w, cfg, seed=0)
    return list(session.chunks(n))


def stream_results(runs: list, cfg: CausalConfig, sinks: int) -> dict:
    c, w = cfg.chunk_frames, cfg.window_frames
    full = math.ceil(w / c)  # first chunk whose denoising forwards and carried commit all read a full window
    chunks = []
    for k, rs in enumerate(zip(*runs)):
        secs, commits = [r.seconds for r in rs], [r.commit_seconds for r in rs]
        chunks.append(
            {
                "index": k,
                "start_frame": rs[0].start_frame,
                "read_frames": min((k + 1) * c, w),
                "commit_read_frames": min(k * c, w) if k else 0,
                "seconds": median(secs),
                "seconds_min_max": [min(secs), max(secs)],
                "commit_seconds": median(commits),
                "denoise_seconds": median([s - m for s, m in zip(secs, commits)]),
                "kv_bytes": rs[0].kv_bytes,
                "kv_bytes_used": rs[0].kv_bytes_used,
            }
        )
    out = {
        "sinks": sinks,
        "full_window_chunk": full,
        "chunks": chunks,
        "first_chunk_seconds": chunks[0]["seconds"],
        "kv_bytes_flat": len({ch["kv_bytes"] for ch in chunks}) == 1,
    }
    if len(chunks) > full + 1:  # a last chunk after the first full-window one
        flat = [run[-1].seconds / run[full].seconds for run in runs]
        out["last_over_full"] = median(flat)
        out["last_over_full_min_max"] = [min(flat), max(flat)]
        out["last_over_full_best_of"] = min(r[-1].seconds for r in runs) / min(r[full].seconds for r in runs)
    return out


def cached_vs_recompute(model, ctx, w, h, cfg, tpf: int, lengths: list[int], rounds: int, warmup: int):
    if warmup:  # the longest recompute runs every prefix shape of the shorter ones
        cached_video(model, ctx, w, h, cfg, max(lengths))
        recompute_video(model, ctx, h, w, max(lengths), cfg, seed=0)
    times = {n: ([], []) for n in lengths}
    diffs = {n: 0.0 for n in lengths}
    for _ in range(rounds):
        for n in lengths:  # A/B back to back: load on the machine hits both sides alike
            tc, cached = clock(lambda n=n: cached_video(model, ctx, w, h, cfg, n))
            tr, recomputed = clock(lambda n=n: recompute_video(model, ctx, h, w, n, cfg, seed=0))
            times[n][0].append(tc)
            times[n][1].append(tr)
            cached = torch.cat([r.latents for r in cached], dim=2)
            diffs[n] = max(diffs[n], (cached - recomputed).abs().max().item())
    rows = []
    for n in lengths:
        tc, tr = times[n]
        ratios = [r / c for c, r in zip(tc, tr)]
        fl = video_flops(model.params, cfg, tpf, n)
        rows.append(
            {
                "chunks": n,
                "frames": n * cfg.chunk_frames,
                "cached_seconds": median(tc),
                "recompute_seconds": median(tr),
                "measured_ratio": median(ratios),
                "measured_ratio_min_max": [min(ratios), max(ratios)],
                "measured_ratio_best_of": min(tr) / min(tc),
                "predicted_ratio": fl["recompute_gflop"] / fl["cached_gflop"],
                "cached_gflops": fl["cached_gflop"] / median(tc),
                "recompute_gflops": fl["recompute_gflop"] / median(tr),
                "max_abs_diff": diffs[n],
                **fl,
            }
        )
    n = min(lengths)  # analytic linear FLOPs against FlopCounterMode, shortest video
    check = {
        "chunks": n,
        "cached_counted": counted_linear_gflop(lambda: cached_video(model, ctx, w, h, cfg, n)),
        "recompute_counted": counted_linear_gflop(lambda: recompute_video(model, ctx, h, w, n, cfg)),
        "cached_analytic": rows[0]["cached_linear_gflop"],
        "recompute_analytic": rows[0]["recompute_linear_gflop"],
    }
    return rows, check


# -- output --------------------------------------------------------------------------------------------------------
def print_stream(res: list[dict], cfg: CausalConfig, rounds: int) -> None:
    print(
        f"### Per-chunk time over a stream (chunk {cfg.chunk_frames}, window {cfg.window_frames} latent frames)\n"
    )
    print(
        f"Median over {rounds} streams (min-max). A chunk's time = {STEPS} denoising forwards of the chunk + "
        "the previous chunk's\ndeferred clean pass (commit, 1 forward); chunk 0 has no commit (first-chunk "
        "latency). Key frames read:\nby the denoising forwards / by the commit carried.\n"
    )
    print(
        "| sinks | chunk | frames | key frames read | seconds (min-max) | commit s | denoise s | KV MB | used MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res:
        for ch in r["chunks"]:
            lo, hi = ch["seconds_min_max"]
            f0 = ch["start_frame"]
            print(
                f"| {r['sinks']} | {ch['index']} | {f0}-{f0 + cfg.chunk_frames - 1} "
                f"| {ch['read_frames']} / {ch['commit_read_frames'] or '-'} | {ch['seconds']:.3f} ({lo:.3f}-{hi:.3f}) "
                f"| {ch['commit_seconds']:.3f} | {ch['denoise_seconds']:.3f} | {ch['kv_bytes'] / MB:.1f} "
                f"| {ch['kv_bytes_used'] / MB:.1f} |"
            )
    print(
        f"\nFlatness = last chunk / first chunk whose forwards all read a full window (chunk "
        f"{res[0]['full_window_chunk']}), per stream, median (min-max); best-of = min/min. Goal <= {TARGET_FLAT}x.\n"
    )
    print(
        "| sinks | first-chunk latency s | full-window chunk s | last chunk s | last / full-window (min-max) "
        "| best-of | KV MB flat |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in res:
        last, flat = r["chunks"][-1], "yes" if r["kv_bytes_flat"] else "NO"
        cells = ["n/a (stream too short)"] * 3
        if "last_over_full" in r:
            lo, hi = r["last_over_full_min_max"]
            cells = [
                f"{r['chunks'][r['full_window_chunk']]['seconds']:.3f}",
                f"**{r['last_over_full']:.3f}x** ({lo:.2f}-{hi:.2f})",
                f"{r['last_over_full_best_of']:.3f}x",
            ]
        print(
            f"| {r['sinks']} | {r['first_chunk_seconds']:.3f} | {cells[0]} | {last['seconds']:.3f} "
            f"| {cells[1]} | {cells[2]} | {flat} ({last['kv_bytes'] / MB:.1f}) |"
        )


def print_recompute(rows: list[dict], check: dict, rounds: int) -> None:
    print("\n### Cached vs no-cache recompute, same video (sinks 0, same seed)\n")
    print(
        f"Whole-video seconds, median over {rounds} back-to-back pairs; measured ratio = recompute / cached "
        "per pair,\nmedian (min-max), best-of = min/min. Predicted = analytic FLOP ratio (same GFLOP/s on "
        "both sides).\n"
    )
    print(
        "| chunks (frames) | cached s | recompute s | measured ratio (min-max) | best-of | predicted ratio "
        "| GFLOP cached / recompute | GFLOP/s cached / recompute | max abs diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["measured_ratio_min_max"]
        print(
            f"| {r['chunks']} ({r['frames']}) | {r['cached_seconds']:.2f} | {r['recompute_seconds']:.2f} "
            f"| **{r['measured_ratio']:.2f}x** ({lo:.2f}-{hi:.2f}) | {r['measured_ratio_best_of']:.2f}x "
            f"| {r['predicted_ratio']:.2f}x | {r['cached_gflop']:.1f} / {r['recompute_gflop']:.1f} "
            f"| {r['cached_gflops']:.1f} / {r['recompute_gflops']:.1f} | {r['max_abs_diff']:.1e} |"
        )
    last = rows[-1]
    print(
        f"\nAnalytic GFLOP per chunk, {last['chunks']}-chunk video (linear + attention; cached: 4 forwards + the "
        "previous\nchunk's clean pass, as timed; chunk 0 includes the text embedding, and on the cached side the "
        "prompt's\ncross-attention K/V, computed once):\n"
    )
    print("| chunk | cached | recompute | ratio |")
    print("|---|---|---|---|")
    for k, (c, r) in enumerate(zip(last["cached_per_chunk_gflop"], last["recompute_per_chunk_gflop"])):
        print(f"| {k} | {c:.1f} | {r:.1f} | {r / c:.2f} |")
    print(
        f"\nAttention share of the FLOPs, {last['chunks']} chunks: cached "
        f"{last['cached_attention_gflop'] / last['cached_gflop']:.0%}, recompute "
        f"{last['recompute_attention_gflop'] / last['recompute_gflop']:.0%}."
    )
    ok = all(
        abs(check[f"{s}_counted"] - check[f"{s}_analytic"]) <= 1e-6 * check[f"{s}_analytic"]
        for s in ("cached", "recompute")
    )
    print(
        f"Linear GFLOP, {check['chunks']} chunks, analytic vs FlopCounterMode: cached "
        f"{check['cached_analytic']:.2f} / {check['cached_counted']:.2f}, recompute "
        f"{check['recompute_analytic']:.2f} / {check['recompute_counted']:.2f} ({'agree' if ok else 'DIFFER'})."
    )


def summary(res: list[dict], rows: list[dict], check: dict, preset: str, size: str) -> list[dict]:
    """Rows for the suite table (bench/run_all): ratios measured side by side, and the analytic FLOP checks."""
    out = []
    for r in res:
        if "last_over_full" in r:
            out.append(
                {
                    "metric": f"causal stream flatness: last chunk / first full-window chunk time, {preset} {size}, "
                    f"sinks {r['sinks']}",
                    "value": f"{r['last_over_full']:.3f}x (best-of {r['last_over_full_best_of']:.3f}x)",
                    "goal": f"<= {TARGET_FLAT}x",
                    "met": r["last_over_full"] <= TARGET_FLAT,
                }
            )
        out.append(
            {
                "metric": f"causal stream KV cache allocation constant over the stream, sinks {r['sinks']}",
                "value": "yes" if r["kv_bytes_flat"] else "no",
                "goal": "constant",
                "met": r["kv_bytes_flat"],
            }
        )
    for r in rows:
        out.append(
            {
                "metric": f"no-cache recompute / cached video time, {r['chunks']} chunks ({r['frames']} latent frames)",
                "value": f"{r['measured_ratio']:.2f}x (FLOP prediction {r['predicted_ratio']:.2f}x)",
                "goal": None,
                "met": None,
            }
        )
    agree = all(
        abs(check[f"{s}_counted"] - check[f"{s}_analytic"]) <= 1e-6 * check[f"{s}_analytic"]
        for s in ("cached", "recompute")
    )
    out.append(
        {
            "metric": "causal video analytic linear FLOPs vs FlopCounterMode (cached and recompute)",
            "value": "equal" if agree else "differ",
            "goal": "equal",
            "met": agree,
        }
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="wan-mid")
    ap.add_argument("--size", default="192x192", help="frame size in px, WxH (multiples of 16)")
    ap.add_argument("--txt", type=int, default=32, help="prompt tokens (padded to 512 by the model)")
    ap.add_argument("--chunk", type=int, default=3, help="latent frames per chunk")
    ap.add_argument("--window", type=int, default=9, help="latent frames a chunk sees")
    ap.add_argument("--sinks", default="0,3", help="sink frame counts to stream with, comma-separated")
    ap.add_argument("--chunks", type=int, default=None, help="stream length (default: 2 x window / chunk)")
    ap.add_argument("--rounds", type=int, default=5, help="streams per sink setting")
    ap.add_argument("--lengths", default="2,4,6", help="video lengths in chunks for cached vs recompute")
    ap.add_argument("--recompute-rounds", type=int, default=3, help="cached/recompute pairs per length")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs before each part")
    ap.add_argument("--rope", default="cache")
    args = parse_args(ap, QUICK)

    setup_threads(args.threads)
    env = header("Causal video streaming: per-chunk time and cached vs recompute (CPU)")
    torch.manual_seed(0)
    model = load_dit(f"dummy:{args.preset}")
    p = model.params
    w, h = parse_px(args.size)
    tpf = (h // 8 // p.patch_size[1]) * (w // 8 // p.patch_size[2])
    n = args.chunks or 2 * args.window // args.chunk
    ctx = torch.randn(1, args.txt, p.text_dim, generator=torch.Generator().manual_seed(0))
    print(
        f"`dummy:{args.preset}` (dim {p.dim}, {p.num_heads} heads x {p.head_dim}, {p.num_layers} layers), fp32, "
        f"{args.size} px = {tpf} tokens per latent frame, {args.chunk * tpf} per chunk; {STEPS} steps, "
        f"rope={args.rope}\n"
    )

    def config(sinks: int) -> CausalConfig:
        return CausalConfig(args.chunk, args.window, sinks, rope=args.rope)

    sinks = [int(s) for s in args.sinks.split(",")]
    runs = {s: [] for s in sinks}
    for _ in range(args.warmup):
        for s in sinks:
            cached_video(model, ctx, w, h, config(s), n)
    for _ in range(args.rounds):  # sink settings interleaved
        for s in sinks:
            runs[s].append(cached_video(model, ctx, w, h, config(s), n))
    res = [stream_results(runs[s], config(s), s) for s in sinks]
    print_stream(res, config(0), args.rounds)

    lengths = [int(x) for x in args.lengths.split(",")]
    rows, check = cached_vs_recompute(
        model, ctx, w, h, config(0), tpf, lengths, args.recompute_rounds, args.warmup
    )
    print_recompute(rows, check, args.recompute_rounds)
    save(
        "causal_stream",
        {
            "env": env,
            "preset": args.preset,
            "size": args.size,
            "tokens_per_frame": tpf,
            "chunk_frames": args.chunk,
            "window_frames": args.window,
            "rope": args.rope,
            "target_flat": TARGET_FLAT,
            "stream": res,
            "cached_vs_recompute": rows,
            "flop_check": check,
            "quick": args.quick,
            "summary": summary(res, rows, check, args.preset, args.size),
        },
    )


if __name__ == "__main__":
    main()
