"""Our causal stream against Self-Forcing's ``CausalInferencePipeline``: same weights, prompt, noise and timesteps.

    python bench/causal_vs_self_forcing.py --self-forcing /tmp/self-forcing --threads 2   # wan-mid, 192x192, 4 rounds
    FEWSTEP_SELF_FORCING_DIR=/tmp/self-forcing python bench/causal_vs_self_forcing.py --quick   # 2 rounds, 5 chunks
    python bench/causal_vs_self_forcing.py --self-forcing DIR --preset wan-tiny --size 64x64 --window 6

``--self-forcing DIR`` (default ``$FEWSTEP_SELF_FORCING_DIR``) is an extracted guandeh17/Self-Forcing checkout
(``git archive HEAD | tar -x -C DIR``); its code is imported from there at run time, never copied here. Without it
the script says so and exits cleanly. ``tests/self_forcing_harness.py`` (shared with
``tests/engine/causal/test_self_forcing_reference.py``) builds their side; what runs is their code: the per-chunk loop of
``CausalInferencePipeline.inference`` (denoising steps from ``denoising_step_list`` [1000, 750, 500, 250] warped
through the shift-5 scheduler, re-noising, the clean-context pass at ``context_noise`` 0), ``WanDiffusionWrapper``'s
forward and ``CausalWanModel`` with its rolling KV cache (absolute RoPE, ``local_attn_size`` = our window, no
sinks). Around it, at run time only: their package ``__init__`` files bypassed (they import all of Wan), the
text encoder, tokenizer and VAE replaced by stubs (our prompt features in, latents out), the KV-cache allocation
sized for our model (theirs hard-codes Wan-1.3B's 12 heads x 128), and their attention called in the model's
dtype (on the CPU their fallback casts to bf16, their cross-attention asserts CUDA): see the harness docstring.
Our dummy weights load into their model unchanged (``strict=True``): both use the official Wan key names.

Three streams per round, the order rotating: ours ``rope="cache"`` (default) and ``rope="absolute"``
(``VideoSession``), theirs. All three start from the same noise: their ``noise`` argument and re-noising draws
replay our session's generator. Per-chunk seconds: ours ``ChunkResult.seconds``; theirs from hooks on their
wrapper module that record each forward's end, a chunk running from the end of the previous chunk's last denoising
forward to the end of its own (the previous chunk's clean pass + this chunk's denoising, as ours, which defers the
clean pass to the next chunk's start). Steady = chunks >= ``--steady-from`` (default: the first whose denoising
reads a full window, ``ceil(window / chunk)``): per stream the median over those chunks, then the median over
rounds; ratio = theirs / ours per round (above 1x ours is faster), median (min-max). The same spans are also
timed in process CPU seconds (``time.process_time``, all threads; ours stamped as each chunk is yielded): on a
shared machine wall time inflates with other processes' load, CPU time much less. Max abs diff: over every
round, of our latents against theirs. KV bytes: the self-attention caches as allocated (both preallocate
``window x tokens`` slots per block for k and v); cross-attention caches beside them.

Differences in work, not in the video: their model re-embeds the 512-token prompt (``text_embedding``, two
linears on ``512 x 4096``) in every forward, ours once per prompt; their RoPE and x0 conversion run in float64.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from _common import header, median, parse_args, parse_px, save, setup_threads

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import self_forcing_harness as sfh  # noqa: E402

from fewstep.engine import load_dit  # noqa: E402
from fewstep.engine.causal import CausalConfig, VideoSession  # noqa: E402
from fewstep.engine.sampling import schedule_sigmas  # noqa: E402

STEPS = 4  # wan-dmd-4step: Self-Forcing's four denoising steps
MAX_DIFF = 1e-5  # fp32, the same function on both sides: larger is a real mismatch, not rounding
MB = 2**20
QUICK = {"rounds": 2, "chunks": 5, "warmup": 0}
SIDES = ("ours rope=cache", "ours rope=absolute", "Self-Forcing")


def our_stream(model, ctx, w, h, cfg: CausalConfig, n: int, seed: int) -> dict:
    session = VideoSession(model, ctx, h, w, cfg, seed=seed)
    chunks, cpu = [], [time.process_time()]
    for chunk in session.chunks(n):  # a chunk is yielded as soon as it is denoised
        cpu.append(time.process_time())
        chunks.append(chunk)
    return {
        "latents": torch.cat([c.latents for c in chunks], dim=2),
        "seconds": [c.seconds for c in chunks],
        "cpu_seconds": [b - a for a, b in zip(cpu, cpu[1:])],
        "kv_bytes": chunks[-1].kv_bytes,
        "cross_bytes": session.cross.nbytes,
    }


def their_stream(sf, pipe, noise) -> dict:
    run = sfh.run_reference(sf, pipe, noise, STEPS)
    return {"latents": run.latents, "seconds": run.chunk_seconds, "cpu_seconds": run.chunk_cpu_seconds,
            "kv_bytes": run.kv_bytes, "cross_bytes": run.cross_bytes, "timesteps": run.timesteps}  # fmt: skip


def steady(seconds: list[float], first: int) -> float:
    return median(seconds[first:])


def run(args, root: Path) -> dict:
    sf = sfh.load(root)
    model = load_dit(f"dummy:{args.preset}", dtype=torch.float32, device="cpu")
    p = model.params
    w, h = parse_px(args.size)
    tpf = (h // 8 // p.patch_size[1]) * (w // 8 // p.patch_size[2])
    n = args.chunks or 2 * args.window // args.chunk
    first = args.steady_from if args.steady_from is not None else math.ceil(args.window / args.chunk)
    if first >= n:
        raise SystemExit(f"--chunks {n} leaves no steady chunk (chunks >= {first}); use more chunks")
    ctx = torch.randn(1, args.txt, p.text_dim, generator=torch.Generator().manual_seed(0))
    noise = sfh.session_noise(args.seed, (1, p.in_dim, args.chunk, h // 8, w // 8), n, STEPS)
    pipe = sfh.reference_pipeline(sf, model, ctx, args.chunk, args.window, tpf)
    print(
        f"`dummy:{args.preset}` (dim {p.dim}, {p.num_heads} heads x {p.head_dim}, {p.num_layers} layers), fp32, "
        f"{args.size} px = {tpf} tokens per latent frame; chunk {args.chunk}, window {args.window} latent frames, "
        f"no sinks, {n} chunks, {STEPS} steps; Self-Forcing from {root}\n"
    )
    sides = {
        SIDES[0]: lambda: our_stream(
            model, ctx, w, h, CausalConfig(args.chunk, args.window, 0), n, args.seed
        ),
        SIDES[1]: lambda: our_stream(
            model, ctx, w, h, CausalConfig(args.chunk, args.window, 0, rope="absolute"), n, args.seed
        ),
        SIDES[2]: lambda: their_stream(sf, pipe, noise),
    }
    for _ in range(args.warmup):
        for fn in sides.values():
            fn()
    streams = {k: [] for k in SIDES}
    diffs = {k: 0.0 for k in SIDES[:2]}
    for r in range(args.rounds):  # the order rotates: a drift in machine load hits every side alike
        order = SIDES[r % 3 :] + SIDES[: r % 3]
        got = {k: sides[k]() for k in order}
        for k in SIDES:
            streams[k].append(got[k])
        for k in SIDES[:2]:
            diffs[k] = max(diffs[k], (got[k]["latents"] - got[SIDES[2]]["latents"]).abs().max().item())
    theirs = streams[SIDES[2]]
    sides_out = {}
    for k in SIDES:
        row = {
            "per_chunk_seconds": [median(c) for c in zip(*(s["seconds"] for s in streams[k]))],
            "per_chunk_cpu_seconds": [median(c) for c in zip(*(s["cpu_seconds"] for s in streams[k]))],
            "kv_bytes": streams[k][0]["kv_bytes"],
            "cross_bytes": streams[k][0]["cross_bytes"],
        }
        for clock in ("seconds", "cpu_seconds"):
            st = [steady(s[clock], first) for s in streams[k]]
            row |= {f"steady_{clock}": median(st), f"steady_{clock}_min_max": [min(st), max(st)]}
            if k != SIDES[2]:
                ratios = [steady(t[clock], first) / s for t, s in zip(theirs, st)]
                row |= {f"theirs_over_ours_{clock}": median(ratios),
                        f"theirs_over_ours_{clock}_min_max": [min(ratios), max(ratios)]}  # fmt: skip
        if k != SIDES[2]:
            row["max_abs_diff_vs_theirs"] = diffs[k]
        sides_out[k] = row
    want = (schedule_sigmas("wan-dmd-4step")[:-1] * 1000).tolist()
    return {
        "preset": args.preset, "size": args.size, "tokens_per_frame": tpf, "chunk_frames": args.chunk,
        "window_frames": args.window, "chunks": n, "steady_from": first, "rounds": args.rounds,
        "their_timesteps": theirs[0]["timesteps"], "our_timesteps": want,
        "max_abs_latent": theirs[0]["latents"].abs().max().item(), "sides": sides_out,
    }  # fmt: skip


def print_results(res: dict) -> None:
    sides, n, first = res["sides"], res["chunks"], res["steady_from"]
    print(
        f"Timesteps: theirs {[round(t, 2) for t in res['their_timesteps']]}, ours "
        f"{[round(t, 2) for t in res['our_timesteps']]}.\n"
    )
    print(f"### Per-chunk seconds, wall / process CPU, median over {res['rounds']} streams each\n")
    print("| chunk | latent frames | " + " | ".join(SIDES) + " |")
    print("|---|---|" + "---|" * len(SIDES))
    c = res["chunk_frames"]
    for k in range(n):
        cells = " | ".join(
            f"{sides[s]['per_chunk_seconds'][k]:.3f} / {sides[s]['per_chunk_cpu_seconds'][k]:.3f}"
            for s in SIDES
        )
        print(f"| {k} | {k * c}-{k * c + c - 1} | {cells} |")
    print(
        f"\n### Steady per-chunk seconds (chunks >= {first}), KV memory, latents\n\n"
        "Wall and process CPU seconds (all threads). Per stream the median over the steady chunks, then the "
        "median over\nstreams (min-max); theirs / ours per round, median (min-max): above 1x ours is faster. Max "
        f"abs diff over every round\n(latents up to {res['max_abs_latent']:.2f}).\n"
    )
    print(
        "| side | steady wall s (min-max) | theirs / ours, wall | steady CPU s | theirs / ours, CPU "
        "| self-attn KV MB | cross-attn KV MB | max abs diff vs theirs |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for s in SIDES:
        r = res["sides"][s]
        cells = []
        for clock in ("seconds", "cpu_seconds"):
            lo, hi = r[f"steady_{clock}_min_max"]
            cells.append(f"{r[f'steady_{clock}']:.3f} ({lo:.3f}-{hi:.3f})")
            if f"theirs_over_ours_{clock}" in r:
                rl, rh = r[f"theirs_over_ours_{clock}_min_max"]
                cells.append(f"**{r[f'theirs_over_ours_{clock}']:.2f}x** ({rl:.2f}-{rh:.2f})")
            else:
                cells.append("-")
        diff = f"{r['max_abs_diff_vs_theirs']:.1e}" if "max_abs_diff_vs_theirs" in r else "-"
        print(
            f"| {s} | {' | '.join(cells)} | {r['kv_bytes'] / MB:.2f} | {r['cross_bytes'] / MB:.2f} | {diff} |"
        )


def summary(res: dict) -> list[dict]:
    out = []
    tag = f"{res['preset']} {res['size']}, chunk {res['chunk_frames']}, window {res['window_frames']}"
    theirs = res["sides"][SIDES[2]]
    for s in SIDES[:2]:
        r = res["sides"][s]
        out.append({"metric": f"causal stream, Self-Forcing / {s} steady per-chunk time (wall; CPU), {tag}",
                    "value": f"{r['theirs_over_ours_seconds']:.2f}x; {r['theirs_over_ours_cpu_seconds']:.2f}x",
                    "goal": None, "met": None})  # fmt: skip
        out.append({"metric": f"causal stream, {s} latents vs Self-Forcing's pipeline, max abs diff, {tag}",
                    "value": f"{r['max_abs_diff_vs_theirs']:.1e}", "goal": f"<= {MAX_DIFF:g}",
                    "met": r["max_abs_diff_vs_theirs"] <= MAX_DIFF})  # fmt: skip
        out.append({"metric": f"causal stream, {s} self-attention KV bytes / Self-Forcing's, {tag}",
                    "value": f"{r['kv_bytes'] / theirs['kv_bytes']:.3f}", "goal": None, "met": None})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--self-forcing", default=None, help=f"extracted Self-Forcing checkout (default ${sfh.ENV})"
    )
    ap.add_argument("--preset", default="wan-mid")
    ap.add_argument("--size", default="192x192", help="frame size in px, WxH (multiples of 16)")
    ap.add_argument("--txt", type=int, default=32, help="prompt tokens (padded to 512 by both models)")
    ap.add_argument(
        "--chunk", type=int, default=3, help="latent frames per chunk (their num_frame_per_block)"
    )
    ap.add_argument(
        "--window", type=int, default=9, help="latent frames a chunk sees (their local_attn_size)"
    )
    ap.add_argument("--chunks", type=int, default=None, help="stream length (default: 2 x window / chunk)")
    ap.add_argument(
        "--steady-from", type=int, default=None, help="first steady chunk (default: first full window)"
    )
    ap.add_argument("--rounds", type=int, default=4, help="streams per side, interleaved")
    ap.add_argument("--warmup", type=int, default=1, help="untimed streams per side first")
    ap.add_argument("--seed", type=int, default=0)
    args = parse_args(ap, QUICK)

    setup_threads(args.threads)
    env = header("Causal stream: ours vs Self-Forcing's CausalInferencePipeline (CPU)")
    root = sfh.reference_dir(args.self_forcing)
    why = None
    if root is None:
        why = f"no Self-Forcing checkout: pass --self-forcing DIR or set {sfh.ENV}"
    elif missing := sfh.missing_files(root):
        why = f"{root} is not an extracted Self-Forcing checkout (missing {', '.join(missing)})"
    if why:
        print(f"Skipped: {why}.")
        row = {"metric": "causal stream vs Self-Forcing's pipeline", "value": f"skipped ({why})", "goal": None,
               "met": None}  # fmt: skip
        save("causal_vs_self_forcing", {"env": env, "skipped": why, "quick": args.quick, "summary": [row]})
        return
    res = run(args, root)
    print_results(res)
    save("causal_vs_self_forcing", {"env": env, "quick": args.quick, **res, "summary": summary(res)})


if __name__ == "__main__":
    main()
