"""Issue 17 before / after: causal Wan chunk time (bf16 and int8 KV) and FLUX.1 step time on the CPU, one JSON line.

    python bench/before_after/static_engine.py                  # the defaults below, about 35 s on one core
    python bench/before_after/static_engine.py --rounds 3 --threads 4   # a machine of your own
    PYTHONPATH=/tmp/old-path python bench/before_after/static_engine.py   # another checkout: /tmp/old-path/fewstep -> it

Written against the entry points that exist both before the static-engine redesign (1931ae9) and after it:
``load_dit("dummy:<preset>")``, ``CausalConfig`` / ``VideoSession(...).chunks(n)`` and its ``ChunkResult.seconds``,
``open_model`` / ``sample_latent`` and its ``SampleReport.seconds_per_step``, so one file measures both trees; the
``fewstep`` it imported is printed in the line (``fewstep_file``, ``fewstep_commit`` when it is a git checkout).

Causal stream: ``wan-mid`` dummy weights, 128x128 px (16x16 latent, 64 tokens a frame), 3-frame chunks, a 9-frame
window, no sinks, the 4-step schedule; ``--chunks`` chunks a stream, ``--rounds`` streams per KV storage, the
storages alternating (bf16 int8 int8 bf16 ...). A chunk's ``seconds`` is its denoising forwards plus the previous
chunk's deferred clean-context pass. Chunk 0 (no commit, text embedding) is ``first``; chunks 1 .. ceil(window/chunk)
- 1 are ``filling`` (the window is not yet full for all their forwards); later chunks are ``full`` (the window is full
and every new chunk evicts the oldest one). Figures: median over rounds and chunks, in ms.

FLUX.1: ``flux-mid`` dummy weights (1024 wide, 2 double + 4 single blocks), 256x256 px, 64 text tokens, euler, 4 steps
of the flux.1-schnell schedule; ``step_ms`` is the median of ``SampleReport.seconds_per_step`` over ``--rounds``
samples (4 steps each), ``sample_ms`` the median wall time of one 4-step ``sample_latent``.

Everything is timed after a warm-up of each case in the same process (a stream of ceil(window/chunk) + 1 chunks
per KV storage, one 4-step sample).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import time

import torch


def median(xs):
    return statistics.median(xs) if xs else None


def ms(x):
    return None if x is None else round(x * 1e3, 2)


def git_commit(path: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        return out.stdout.strip() or None
    except OSError:
        return None


def stream(model, ctx, args, kv_dtype: str, n: int):
    from fewstep.engine.causal import CausalConfig, VideoSession

    cfg = CausalConfig(chunk_frames=args.chunk, window_frames=args.window, sink_frames=0, kv_dtype=kv_dtype)
    session = VideoSession(model, ctx, args.px, args.px, cfg, seed=0)
    return [r.seconds for r in session.chunks(n)]


def causal_case(args) -> dict:
    from fewstep.engine import load_dit

    model = load_dit(f"dummy:{args.wan}", dtype=torch.float32, device="cpu", seed=0)
    p = model.params
    ctx = torch.randn(1, 16, p.text_dim, generator=torch.Generator().manual_seed(1))
    kvs = args.kv.split(",")
    full_from = math.ceil(args.window / args.chunk)
    out = {"preset": args.wan, "px": args.px, "chunk_frames": args.chunk, "window_frames": args.window,
           "chunks": args.chunks, "full_from_chunk": full_from}  # fmt: skip
    runs = {kv: [] for kv in kvs}
    with torch.inference_mode():
        for kv in kvs:  # warm-up: one stream per storage, up to the first chunk that evicts
            stream(model, ctx, args, kv, min(args.chunks, full_from + 1))
        for r in range(args.rounds):
            for kv in kvs if r % 2 == 0 else kvs[::-1]:
                runs[kv].append(stream(model, ctx, args, kv, args.chunks))
    for kv, rs in runs.items():
        first = [s[0] for s in rs]
        filling = [x for s in rs for x in s[1:full_from]]
        full = [x for s in rs for x in s[full_from:]]
        out[kv] = {
            "first_ms": ms(median(first)),
            "filling_ms": ms(median(filling)),
            "full_ms": ms(median(full)),
            "full_min_max_ms": [ms(min(full)), ms(max(full))] if full else None,
            "per_chunk_ms": [ms(median([s[k] for s in rs])) for k in range(args.chunks)],
        }
    return out


def flux_case(args) -> dict:
    from fewstep.engine import TextCondition, open_model, sample_latent

    handle = open_model(f"dummy:{args.flux}", device="cpu", dtype=torch.float32)
    p = handle.model.params
    gen = torch.Generator().manual_seed(0)
    context_dim = getattr(p, "context_in_dim", 4096)
    pooled_dim = getattr(p, "vec_in_dim", 768)
    cond = TextCondition(
        torch.randn(1, args.txt, context_dim, generator=gen),
        torch.randn(1, pooled_dim, generator=gen),
        3.5 if getattr(p, "guidance_embed", False) else None,
    )
    latent = torch.zeros(1, 16, args.flux_px // 8, args.flux_px // 8)
    kwargs = {"steps": args.steps, "schedule": "flux.1-schnell", "seed": 0}
    steps, walls = [], []
    with torch.inference_mode():
        sample_latent(handle, [cond], latent, **kwargs)  # warm-up
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            _, report = sample_latent(handle, [cond], latent, **kwargs)
            walls.append(time.perf_counter() - t0)
            steps.extend(report.seconds_per_step)
    return {
        "preset": args.flux, "px": args.flux_px, "txt": args.txt, "steps": args.steps,
        "step_ms": ms(median(steps)), "step_min_max_ms": [ms(min(steps)), ms(max(steps))],
        "sample_ms": ms(median(walls)),
    }  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Causal Wan chunk time (per KV storage: first / while the window fills / once it is full) and "
        "FLUX.1 4-step sampling time per step on the CPU, after warm-up, printed as one JSON line. Uses only "
        "entry points present before and after the issue-17 redesign, so it runs against either checkout "
        "(the repository root is the package: put a folder whose `fewstep` links to the checkout first on PYTHONPATH).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument(
        "--threads", type=int, default=1,
        help="torch.set_num_threads; 1 by default: on a shared machine more threads than free cores make "
        "every barrier wait on a descheduled thread (5-20x slower chunks, seen on 2 shared cores)",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=2, help="streams per KV storage, and FLUX samples")
    ap.add_argument("--wan", default="wan-mid", help="Wan dummy preset")
    ap.add_argument("--px", type=int, default=128, help="video height = width in pixels")
    ap.add_argument("--chunk", type=int, default=3, help="latent frames a chunk")
    ap.add_argument("--window", type=int, default=9, help="latent frames of the attention window")
    ap.add_argument("--chunks", type=int, default=7, help="chunks a stream")
    ap.add_argument("--kv", default="bf16,int8", help="KV storages (CausalConfig.kv_dtype), comma-separated")
    ap.add_argument("--flux", default="flux-mid", help="FLUX.1 dummy preset")
    ap.add_argument("--flux-px", type=int, default=256, help="FLUX image height = width in pixels")
    ap.add_argument("--txt", type=int, default=64, help="FLUX text tokens")
    ap.add_argument("--steps", type=int, default=4, help="FLUX sampling steps")
    ap.add_argument("--only", choices=["causal", "flux"], help="run one case only")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    import fewstep

    root = os.path.dirname(os.path.realpath(fewstep.__file__))
    out = {"fewstep_file": os.path.realpath(fewstep.__file__), "fewstep_commit": git_commit(root),
           "threads": args.threads, "rounds": args.rounds}  # fmt: skip
    t0 = time.perf_counter()
    if args.only != "flux":
        out["causal"] = causal_case(args)
    if args.only != "causal":
        out["flux"] = flux_case(args)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
