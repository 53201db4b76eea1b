"""Session pool on CPU: N sessions' chunks batched into one forward per step against N solo chunks; swap and snapshots.

    python bench/session_pool.py                    # wan-tiny 128x128 and wan-mid 208x112, N = 1, 2, 4, 8
    python bench/session_pool.py --threads 1        # the same on a machine others share (~2 min on 2 cores)
    python bench/session_pool.py --quick            # N = 1, 2, 4, one round, wan-mid at 112x64 (< 2 min)
    python bench/session_pool.py --cases wan-mid@832x480 --sessions 1,2 --rounds 1 --window 3   # a 480p chunk

Per case (``preset@WxH``: dummy weights, fp32 weights and KV; chunk 3 latent frames, window 6, 4 steps) and
per N: a :class:`SessionPool` of N sessions (seeds 0..N-1, one prompt) and N solo :class:`VideoSession`\\ s with
the same seeds and config, both advanced past their first chunk (so every chunk carries its predecessor's
clean-context pass: the steady state). A round times, for every N, one pool tick (one batched commit pass and 4
batched denoising forwards for all N) and the N solo chunks run one after the other (N x 5 forwards), the two
sides back to back, their order alternating per round. Ratio = batched seconds per session-chunk / solo seconds
per session-chunk, per round, median (min-max); below 1 batching pays. The two sides produce the same chunks
(max abs difference reported).

Predictions beside the measured ratio:

* **planner FLOPs** (``engine.plan.sessions.plan_session_tick``, its FLOPs checked against a counted pool tick
  in tests/engine/plan/test_plan_sessions.py): a tick of N sessions is exactly N x one chunk's FLOPs, so at an
  equal FLOP rate the ratio is 1.00; GFLOP/s achieved on each side shows which side runs the faster rate;
* **GEMM rate** (measured here): the model's linear layers (``wan_gemms``: their widths and counts) timed as
  plain ``torch.mm`` at M = chunk tokens and M = N x chunk tokens on this CPU; predicted batched time per
  session-chunk = solo time - the solo GEMM time + the batched GEMM time / N (everything else assumed to scale
  with N). It isolates what a bigger GEMM buys on this CPU; the rest of the gap is per-forward fixed cost
  (Python, op dispatch, small elementwise ops), which batching shares.

Swap: ``pool.suspend`` / ``pool.resume`` of one session (bytes moved = its ``SessionState``), median seconds.
Snapshot: ``engine.causal.snapshot``'s ``save_pool_session`` (one safetensors file with its checked JSON header
and the model's weights digest) and ``load_snapshot`` (every check of an untrusted file, then the tensors).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from _common import header, median, parse_args, parse_px, save, setup_threads, summary_row

from fewstep.engine import load_dit
from fewstep.engine.causal import CausalConfig, VideoSession
from fewstep.engine.causal.session_pool import SessionPool
from fewstep.engine.causal.snapshot import load_snapshot, save_pool_session
from fewstep.engine.plan import wan_tokens_per_frame
from fewstep.engine.plan.sessions import plan_session_tick, wan_gemms

STEPS = 4
QUICK = {
    "cases": "wan-tiny@128x128,wan-mid@112x64",
    "sessions": "1,2,4",
    "rounds": 1,
    "warmup": 0,
    "swaps": 3,
}
RATE_ROWS_480P = 3 * 1560  # one Wan 832x480 chunk: the GEMM rows of a single 480p session
MB = 1e6


def one_chunk(session: VideoSession):
    return next(iter(session.chunks(1)))


# -- GEMM rate -------------------------------------------------------------------------------------------------------
def gemm_seconds(p, rows: int, repeats: int) -> float:
    """Seconds of one forward's linear layers as plain matmuls of ``rows`` rows (best of ``repeats``)."""
    total = 0.0
    for g in wan_gemms(p):
        a, b = torch.randn(rows, g.inner), torch.randn(g.inner, g.out)
        torch.mm(a, b)  # warm-up
        best = min(timed_mm(a, b) for _ in range(repeats))
        total += g.count * best
    return total


def timed_mm(a, b) -> float:
    t0 = time.perf_counter()
    torch.mm(a, b)
    return time.perf_counter() - t0


# -- batched vs solo -------------------------------------------------------------------------------------------------
class Side:
    """N sessions run both ways: one pool (batched) and N solo sessions, same seeds and config."""

    def __init__(self, model, ctx, w, h, cfg, n):
        self.n = n
        self.pool = SessionPool(model, h, w, cfg, max_sessions=n)
        self.members = [self.pool.join(ctx, seed=i) for i in range(n)]
        self.solos = [VideoSession(model, ctx, h, w, cfg, seed=i) for i in range(n)]
        self.diff = 0.0

    def batched(self) -> tuple[float, list]:
        t0 = time.perf_counter()
        self.pool.tick()
        seconds = time.perf_counter() - t0
        return seconds, [m.take().latents for m in self.members]

    def solo(self) -> tuple[float, list]:
        t0 = time.perf_counter()
        latents = [one_chunk(s).latents for s in self.solos]
        return time.perf_counter() - t0, latents

    def compare(self, a: list, b: list) -> None:
        self.diff = max(self.diff, *((x - y).abs().max().item() for x, y in zip(a, b)))

    def close(self) -> None:
        self.pool.close()
        for s in self.solos:
            s.dispose()


def run_case(preset: str, size: str, args) -> dict:
    w, h = parse_px(size)
    torch.manual_seed(0)
    model = load_dit(f"dummy:{preset}")
    p = model.params
    tpf = wan_tokens_per_frame(p, h, w)
    cfg = CausalConfig(args.chunk, args.window, 0, steps=STEPS)
    ctx = torch.randn(1, args.txt, p.text_dim, generator=torch.Generator().manual_seed(0))
    counts = [int(n) for n in args.sessions.split(",")]
    tokens = args.chunk * tpf
    print(f"### {preset} at {size} px: {tpf} tokens a latent frame, {tokens} a chunk (dim {p.dim}, "
          f"{p.num_layers} layers)\n", flush=True)  # fmt: skip
    sides = {n: Side(model, ctx, w, h, cfg, n) for n in counts}
    for _ in range(1 + args.warmup):  # the first chunk (no commit) and warm-ups: the steady state after
        for side in sides.values():
            _, a = side.batched()
            _, b = side.solo()
            side.compare(a, b)
    times = {n: ([], []) for n in counts}
    for r in range(args.rounds):
        for n, side in sides.items():
            order = ("batched", "solo") if (r + n) % 2 == 0 else ("solo", "batched")
            out = {}
            for which in order:
                out[which] = getattr(side, which)()
            times[n][0].append(out["batched"][0])
            times[n][1].append(out["solo"][0])
            side.compare(out["batched"][1], out["solo"][1])
    solo_gemm = gemm_seconds(p, tokens, args.gemm_repeats)
    rows = []
    for n in counts:
        batched, solo = times[n]
        ratios = [(b / n) / (s / n) for b, s in zip(batched, solo)]
        tick = plan_session_tick(p, n, tpf, args.chunk, args.window, STEPS, buckets=None)
        flops = tick.flops.total
        batched_gemm = gemm_seconds(p, n * tokens, args.gemm_repeats) if n > 1 else solo_gemm
        solo_chunk = median(solo) / n
        predicted_chunk = solo_chunk - (STEPS + 1) * solo_gemm + (STEPS + 1) * batched_gemm / n
        rows.append({
            "sessions": n, "gemm_rows": n * tokens,
            "batched_tick_s": median(batched), "solo_n_chunks_s": median(solo),
            "batched_per_session_chunk_s": median(batched) / n, "solo_per_chunk_s": solo_chunk,
            "ratio": median(ratios), "ratio_min_max": [min(ratios), max(ratios)],
            "ratio_best_of": min(batched) / min(solo),
            "session_chunks_per_s_batched": n / median(batched), "session_chunks_per_s_solo": n / median(solo),
            "planner_tick_gflop": flops / 1e9, "planner_ratio": 1.0,
            "gflops_batched": flops / median(batched) / 1e9, "gflops_solo": flops / median(solo) / 1e9,
            "gemm_s_per_forward_solo_rows": solo_gemm, "gemm_s_per_forward_batched_rows": batched_gemm,
            "gemm_predicted_ratio": predicted_chunk / solo_chunk,
            "max_abs_diff": sides[n].diff,
            "batched_s_all": batched, "solo_s_all": solo,
        })  # fmt: skip
    rate_rows = sorted({n * tokens for n in counts} | {RATE_ROWS_480P})
    rates = [{"rows": m, "gflops": sum(g.flops(m) for g in wan_gemms(p)) / gemm_seconds(p, m, args.gemm_repeats)
              / 1e9} for m in rate_rows]  # fmt: skip
    swap = swap_and_snapshot(sides[max(counts)], args.swaps)
    for side in sides.values():
        side.close()
    return {"preset": preset, "size": size, "tokens_per_frame": tpf, "tokens_per_chunk": tokens, "rows": rows,
            "gemm_rate": rates, "swap": swap, "kv_bytes_per_session": swap["kv_bytes"]}  # fmt: skip


def swap_and_snapshot(side: Side, repeats: int) -> dict:
    """Suspend / resume one session of the pool ``repeats`` times; save / load a snapshot of it."""
    pool, session = side.pool, side.members[0]
    suspend_s, resume_s = [], []
    state = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = pool.suspend(session)
        t1 = time.perf_counter()
        pool.resume(session)
        t2 = time.perf_counter()
        suspend_s.append(t1 - t0)
        resume_s.append(t2 - t1)
    kv_bytes = sum(t.nbytes for k, t in state.tensors.items() if k.startswith("kv."))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "session.safetensors"
        save_s, load_s = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            save_pool_session(pool, session, path)
            t1 = time.perf_counter()
            loaded, _ = load_snapshot(path, pool.model)
            t2 = time.perf_counter()
            save_s.append(t1 - t0)
            load_s.append(t2 - t1)
        file_bytes = path.stat().st_size
    saved = pool.suspend(session)  # the state the snapshot holds (the session has not moved since)
    pool.resume(session)
    same = loaded.tensors.keys() == saved.tensors.keys() and all(
        torch.equal(loaded.tensors[k], t) for k, t in saved.tensors.items()
    )
    return {
        "state_bytes": state.nbytes,
        "kv_bytes": kv_bytes,
        "tensors": len(state.tensors),
        "suspend_s": median(suspend_s),
        "resume_s": median(resume_s),
        "suspend_gb_per_s": state.nbytes / median(suspend_s) / 1e9,
        "resume_gb_per_s": state.nbytes / median(resume_s) / 1e9,
        "snapshot_file_bytes": file_bytes,
        "snapshot_save_s": median(save_s),
        "snapshot_load_s": median(load_s),
        "snapshot_round_trip_equal": same,
        "snapshot_api": "engine.causal.snapshot save_pool_session / load_snapshot",
    }


# -- output ----------------------------------------------------------------------------------------------------------
def print_case(res: dict, rounds: int) -> None:
    print(f"Median over {rounds} interleaved rounds (min-max); ratio = batched / solo seconds per session-chunk "
          "(< 1: batching pays).\n")  # fmt: skip
    print(
        "| N | GEMM rows | batched tick s | N solo chunks s | ratio (min-max) | best-of | GEMM-rate prediction "
        "| planner FLOPs prediction | GFLOP/s batched / solo | session-chunks/s batched / solo | max abs diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        lo, hi = r["ratio_min_max"]
        print(f"| {r['sessions']} | {r['gemm_rows']} | {r['batched_tick_s']:.3f} | {r['solo_n_chunks_s']:.3f} "
              f"| **{r['ratio']:.2f}** ({lo:.2f}-{hi:.2f}) | {r['ratio_best_of']:.2f} "
              f"| {r['gemm_predicted_ratio']:.2f} | {r['planner_ratio']:.2f} "
              f"| {r['gflops_batched']:.1f} / {r['gflops_solo']:.1f} "
              f"| {r['session_chunks_per_s_batched']:.2f} / {r['session_chunks_per_s_solo']:.2f} "
              f"| {r['max_abs_diff']:.1e} |")  # fmt: skip
    print(
        "\nThe model's linear layers as plain matmuls (best of --gemm-repeats), GFLOP/s by GEMM rows "
        f"({RATE_ROWS_480P}: one 832x480 chunk):\n"
    )
    print("| rows | " + " | ".join(str(r["rows"]) for r in res["gemm_rate"]) + " |")
    print("|---|" + "---|" * len(res["gemm_rate"]))
    print("| GFLOP/s | " + " | ".join(f"{r['gflops']:.1f}" for r in res["gemm_rate"]) + " |")
    s = res["swap"]
    print(f"\nSwap and snapshot of one session: state {s['state_bytes'] / MB:.2f} MB ({s['tensors']} tensors, KV "
          f"{s['kv_bytes'] / MB:.2f} MB); suspend {s['suspend_s'] * 1e3:.2f} ms ({s['suspend_gb_per_s']:.2f} GB/s), "
          f"resume {s['resume_s'] * 1e3:.2f} ms ({s['resume_gb_per_s']:.2f} GB/s); snapshot file "
          f"{s['snapshot_file_bytes'] / MB:.2f} MB, save {s['snapshot_save_s'] * 1e3:.2f} ms, load "
          f"{s['snapshot_load_s'] * 1e3:.2f} ms, round trip equal: {s['snapshot_round_trip_equal']}\n")  # fmt: skip


def summary(cases: list[dict]) -> list[dict]:
    out = []
    for c in cases:
        label = f"{c['preset']} {c['size']} ({c['tokens_per_chunk']} tokens a chunk)"
        for r in c["rows"]:
            if r["sessions"] > 1:
                out.append(summary_row(f"session pool, {label}, N = {r['sessions']}: batched / solo time per "
                                       "session-chunk", f"{r['ratio']:.2f}x (GEMM-rate prediction "
                                       f"{r['gemm_predicted_ratio']:.2f}x)"))  # fmt: skip
        worst = max(r["max_abs_diff"] for r in c["rows"])
        out.append(summary_row(f"session pool, {label}: batched chunks vs solo, max abs diff", f"{worst:.1e}",
                               "<= 1e-5", worst <= 1e-5))  # fmt: skip
        s = c["swap"]
        out.append(summary_row(f"session pool, {label}: suspend / resume of one session "
                               f"({s['state_bytes'] / MB:.1f} MB)",
                               f"{s['suspend_s'] * 1e3:.1f} / {s['resume_s'] * 1e3:.1f} ms"))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="wan-tiny@128x128,wan-mid@208x112", help="preset@WxH, comma-separated")
    ap.add_argument("--sessions", default="1,2,4,8", help="session counts N, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (each: every N, both sides)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds after the first chunk")
    ap.add_argument("--chunk", type=int, default=3, help="latent frames per chunk")
    ap.add_argument("--window", type=int, default=6, help="latent frames of the KV window")
    ap.add_argument("--txt", type=int, default=32, help="prompt tokens (padded to 512 by the model)")
    ap.add_argument("--swaps", type=int, default=5, help="suspend / resume and snapshot repetitions")
    ap.add_argument("--gemm-repeats", type=int, default=5, help="timings per GEMM shape (best of)")
    args = parse_args(ap, QUICK)
    setup_threads(args.threads)
    env = header("Session pool: batched chunks vs solo chunks, swap, snapshot (CPU)")
    print(f"chunk {args.chunk} latent frames, window {args.window}, {STEPS} steps + the clean pass, fp32, "
          f"sessions {args.sessions}\n")  # fmt: skip
    cases = []
    for spec in args.cases.split(","):
        preset, size = spec.split("@")
        res = run_case(preset, size, args)
        print_case(res, args.rounds)
        cases.append(res)
    save("session_pool", {"env": env, "chunk_frames": args.chunk, "window_frames": args.window, "steps": STEPS,
                          "rounds": args.rounds, "cases": cases, "quick": args.quick,
                          "summary": summary(cases)})  # fmt: skip


if __name__ == "__main__":
    main()
