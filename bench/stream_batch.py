"""Stream batch (StreamDiffusion's design) against sequential per-frame denoising, frames per second on CPU.

    python bench/stream_batch.py                       # flux-tiny 64, 128, 256 px; flux-mid 128 px (square)
    python bench/stream_batch.py --cases flux-mid@256x256 --rounds 2 --threads 1
    python bench/stream_batch.py --quick               # flux-tiny 64, 128 px; flux-mid 128 px; 6 frames (< 90 s)
    python bench/stream_batch.py --device cuda --cases flux.1-schnell@512x512   # on a GPU: bf16, schnell width
    python bench/stream_batch.py --cases zimage-tiny@128x128,flux2-tiny@128x128  # Z-Image (taef1), FLUX.2 (taef2)

Both sides use one ``StreamBatch`` (dummy weights, fp32, T = 4: t_index_list 10,20,30,40 of flux.1-schnell x50,
frame buffer 1, CFG none, similarity filter off) and the same frames, noise and prompt:

* **stream**: every frame pushed (one forward of up to T rows per push: the frames at the T steps), then the
  buffer flushed: ``N + T - 1`` forwards for N frames;
* **sequential**: each frame's T steps run back to back (``denoise_sequential``): ``N x T`` forwards of 1 row.

Three levels, each timed A/B interleaved (the order alternating per round):

* *denoise, steady state* -- the realtime rate: the pushes of frames T-1 .. N-1, when the buffer is full (one
  T-row forward per frame), against the sequential denoising of the same frames. The 2x goal is on this level.
* *denoise, whole clip* -- all N frames, the stream's warm-up (1, 2, .., T-1 rows) and flush included.
* *end to end, whole clip* -- ``StreamBatch.run`` against ``run_sequential``: the tiny-AE encode and decode of
  every frame included (the same work on both sides; on a CPU it is most of the time).

The latents are encoded once beforehand for the two denoise levels. Frames per second = frames / time; ratio =
sequential time / stream time per round, median (min-max) and best-of (min / min). The outputs of the two sides
are compared (max abs difference, fp32: ~1e-6).

Why the ratio is what it is: the stream evaluates the same rows as the sequential run (N x T) in T times fewer,
T times larger forwards. Write one forward as ``t(n) = f + r n`` (f: the cost that does not grow with the rows --
op launches, Python, reading the weights once; r: the FLOPs of one row). The steady-state ratio is
``T (f + r) / (f + T r)``: close to T when f dominates (a GPU at small batch, where a batch of 4 is nearly free),
close to 1 when r dominates (a CPU is busy with the FLOPs of a single row as soon as there are a few hundred
tokens), and 2x at T = 4 exactly when f = 2 r. The table measures t(1) and t(T), the f and r they imply and the
ratio they predict (one forward of each size per pair, interleaved), next to the measured one. flux-tiny has FLUX's real interface widths (T5 4096 -> 64) around a
64-wide trunk, so at 128 px and up its per-row FLOPs already outweigh its fixed cost on a CPU; flux-mid reads
~440 MB of fp32 weights per forward, so at few tokens its forward is bound by memory traffic, which a batch
shares. Latency goes the other way: a frame leaves the stream after T forwards of T rows, against T forwards of
1 row when run alone.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from _common import header, median, parse_px, save, setup_threads

from fewstep.engine import TextCondition, load_tiny_vae, open_model
from fewstep.engine.stream_batch import StreamBatch, StreamConfig, denoise_sequential, run_sequential
from fewstep.engine.vae.tiny import variants_for

T_INDEX = (10, 20, 30, 40)
TARGET_RATIO = 2.0
GOAL_PRESET = "flux-tiny"
QUICK = {
    "cases": "flux-tiny@64x64,flux-tiny@128x128,flux-mid@128x128",
    "frames": 6,
    "rounds": 3,
    "forward_repeats": 5,
}


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def sync(device: str) -> None:
    """Wait for queued GPU work, so that the host clock measures it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_stream(preset: str, width: int, height: int, txt: int, cfg_mode: str, seed: int = 0, device="cpu",
                dtype=torch.float32):  # fmt: skip
    """A stream of any image family: its tiny AE (taef1 for FLUX.1 / Z-Image, taef2 for FLUX.2) and prompts of
    its conditioning widths (a pooled vector only where the family has one)."""
    handle = open_model(f"dummy:{preset}", device=device, dtype=dtype)
    (variant,) = variants_for(handle.family.latent_format)
    vae = load_tiny_vae(f"dummy:{variant.name}", device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    spec, p = handle.family.image, handle.params
    width_ctx, width_pooled = spec.context_dim(p), spec.pooled_dim(p)

    def prompt():
        context = torch.randn(1, txt, width_ctx, generator=gen)
        return TextCondition(
            context, None if width_pooled is None else torch.randn(1, width_pooled, generator=gen)
        )

    pos, neg = prompt(), prompt()
    config = StreamConfig(t_index_list=T_INDEX, cfg_mode=cfg_mode, guidance_scale=1.5)
    return StreamBatch(handle, vae, pos, negative=neg, height=height, width=width, config=config, seed=seed)


def clip_frames(n: int, width: int, height: int, seed: int = 1) -> torch.Tensor:
    """A moving gradient plus noise: consecutive frames differ (the filter is off anyway)."""
    gen = torch.Generator().manual_seed(seed)
    ys = torch.linspace(0, 1, height)[:, None]
    xs = torch.linspace(0, 1, width)[None, :]
    frames = []
    for i in range(n):
        base = torch.stack(
            [(xs + i / n) % 1 * torch.ones_like(ys), ys * torch.ones_like(xs), 0.5 * (xs + ys)]
        )
        frames.append((0.8 * base + 0.2 * torch.rand(3, height, width, generator=gen)).clamp(0, 1))
    return torch.stack(frames)


def stream_denoise(stream: StreamBatch, latents: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """Every frame through the stream. Times: ``steady`` = the pushes of frames T-1 .. N-1 (the buffer is full:
    one T-row forward per frame, the realtime rate), ``clip`` = everything, warm-up and flush included."""
    steps, n, dev = stream.config.steps, latents.shape[0], str(stream.device)
    stream.reset()
    sync(dev)
    t0 = time.perf_counter()
    outs = [stream.push_latents(latents[i : i + 1]) for i in range(steps - 1)]
    sync(dev)
    t1 = time.perf_counter()
    outs += [stream.push_latents(latents[i : i + 1]) for i in range(steps - 1, n)]
    sync(dev)
    t2 = time.perf_counter()
    outs += stream.flush()
    sync(dev)
    t3 = time.perf_counter()
    return {"steady": t2 - t1, "clip": t3 - t0}, torch.cat([o.latents for o in outs if o is not None])


def sequential_denoise(stream: StreamBatch, latents: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """Each frame's T steps back to back; ``steady`` times the same frames as the stream's steady part."""
    steps, n, dev = stream.config.steps, latents.shape[0], str(stream.device)
    sync(dev)
    t0 = time.perf_counter()
    outs = [denoise_sequential(stream, latents[i : i + 1]) for i in range(steps - 1)]
    sync(dev)
    t1 = time.perf_counter()
    outs += [denoise_sequential(stream, latents[i : i + 1]) for i in range(steps - 1, n)]
    sync(dev)
    t2 = time.perf_counter()
    return {"steady": t2 - t1, "clip": t2 - t0}, torch.cat(outs)


def timed_clip(fn, device: str = "cpu") -> tuple[dict, torch.Tensor]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return {"clip": time.perf_counter() - t0}, out


def forward_cost(stream: StreamBatch, repeats: int) -> dict:
    """One forward at 1 row and at T rows, timed in interleaved pairs (medians), and the straight line through
    them: ``t(n) = fixed + per_row x n``. Steady-state prediction: ``T t(1) / t(T) = T (f + r) / (f + T r)``
    (median of the per-pair values), which reaches 2x at T = 4 only when f >= 2 r."""
    steps, dev = stream.config.steps, str(stream.device)
    x = torch.randn(steps, *stream.latent_shape).to(stream.device)
    sigma = stream.sigmas[:steps].view(-1, 1, 1, 1).to(stream.device)
    one, many = [], []
    with torch.inference_mode():
        stream.model_velocities(x[:1], sigma[:1])  # warm-up
        stream.model_velocities(x, sigma)
        for _ in range(repeats):
            sync(dev)
            t0 = time.perf_counter()
            stream.model_velocities(x[:1], sigma[:1])
            sync(dev)
            t1 = time.perf_counter()
            stream.model_velocities(x, sigma)
            sync(dev)
            one.append(t1 - t0)
            many.append(time.perf_counter() - t1)
    t1_row, t_rows = median(one), median(many)
    per_row = (t_rows - t1_row) / (steps - 1) if steps > 1 else 0.0
    return {
        "forward_ms_1_row": t1_row * 1e3,
        "forward_ms_T_rows": t_rows * 1e3,
        "fixed_ms": (t1_row - per_row) * 1e3,
        "per_row_ms": per_row * 1e3,
        "predicted_ratio": median([steps * a / b for a, b in zip(one, many, strict=True)]),
    }


def ab(fn_a, fn_b, rounds: int) -> tuple[dict, dict, object, object]:
    """Interleaved runs of two callables returning ``(times dict, output)``, the order alternating per round;
    returns the lists of times per key and the last outputs."""
    ta, tb, out_a, out_b = {}, {}, None, None
    for r in range(rounds):
        for which in (0, 1) if r % 2 == 0 else (1, 0):
            if which == 0:
                times, out_a = fn_a()
                target = ta
            else:
                times, out_b = fn_b()
                target = tb
            for key, value in times.items():
                target.setdefault(key, []).append(value)
    return ta, tb, out_a, out_b


def compare(frames: int, t_stream: list[float], t_seq: list[float]) -> dict:
    ratios = [b / a for a, b in zip(t_stream, t_seq, strict=True)]
    return {
        "frames": frames,
        "stream_fps": frames / median(t_stream),
        "sequential_fps": frames / median(t_seq),
        "stream_s": median(t_stream),
        "sequential_s": median(t_seq),
        "ratio": median(ratios),
        "ratio_min_max": [min(ratios), max(ratios)],
        "ratio_best_of": min(t_seq) / min(t_stream),
    }


def run_case(preset: str, size: str, args) -> dict:
    width, height = parse_px(size)
    dtype = DTYPES[args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")]
    stream = make_stream(preset, width, height, args.txt, args.cfg_mode, device=args.device, dtype=dtype)
    steps = stream.config.steps
    frames = clip_frames(args.frames, width, height)
    n = frames.shape[0]
    if n < steps:
        raise SystemExit(f"--frames {n} is shorter than the stream (T = {steps}): no steady state")
    latents = stream.encode_frames(frames)
    # one untimed pass of each side (allocator, oneDNN primitive caches)
    stream_denoise(stream, latents[: steps + 1])
    sequential_denoise(stream, latents[: steps + 1])
    ta, tb, xa, xb = ab(lambda: stream_denoise(stream, latents), lambda: sequential_denoise(stream, latents),
                        args.rounds)  # fmt: skip
    diff = float((xa - xb).abs().max())
    steady = compare(n - steps + 1, ta["steady"], tb["steady"]) | {"max_abs_diff": diff}
    clip = compare(n, ta["clip"], tb["clip"]) | {"max_abs_diff": diff}
    stream_denoise(stream, latents)
    rows = list(stream.stats.rows)
    ta, tb, ia, ib = ab(lambda: timed_clip(lambda: stream.run(frames), args.device),
                        lambda: timed_clip(lambda: run_sequential(stream, frames), args.device), args.rounds)  # fmt: skip
    e2e = compare(n, ta["clip"], tb["clip"]) | {"max_abs_diff": float((ia - ib).abs().max())}
    return {
        "preset": preset,
        "size": size,
        "device": args.device,
        "dtype": str(dtype).removeprefix("torch."),
        "image_tokens": stream.family.image.image_tokens(*stream.latent_shape[1:]),
        "tiny_vae": stream.vae.variant.name,
        "text_tokens": args.txt,
        "frames": n,
        "steps": steps,
        "t_index_list": list(T_INDEX),
        "sigmas": [round(float(s), 4) for s in stream.sigmas],
        "cfg_mode": args.cfg_mode,
        "stream_rows_per_forward": rows,
        "sequential_forwards": n * steps * (2 if stream.config.cfg_mode == "full" else 1),
        "rounds": args.rounds,
        "denoise_steady": steady,
        "denoise_clip": clip,
        "end_to_end": e2e,
        **forward_cost(stream, args.forward_repeats),
    }


LEVELS = {
    "denoise_steady": "denoise, steady state (full buffer)",
    "denoise_clip": "denoise, whole clip (warm-up + flush)",
    "end_to_end": "end to end, whole clip (tiny-AE encode/decode)",
}


def print_results(results: list[dict]) -> None:
    print(
        "| preset | size | level | stream fps | sequential fps | ratio (min-max) | best-of | max abs diff |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        for level, label in LEVELS.items():
            d = r[level]
            print(
                f"| {r['preset']} | {r['size']} | {label} | {d['stream_fps']:.1f} | "
                f"{d['sequential_fps']:.1f} | {d['ratio']:.2f}x ({d['ratio_min_max'][0]:.2f}-"
                f"{d['ratio_min_max'][1]:.2f}) | {d['ratio_best_of']:.2f}x | {d['max_abs_diff']:.1e} |"
            )
    print("\n| preset | size | tokens (img + txt) | forward ms, 1 row | forward ms, T rows | fixed ms + ms per row "
          "| predicted ratio T t(1)/t(T) | stream rows per forward |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['preset']} | {r['size']} | {r['image_tokens']} + {r['text_tokens']} | {r['forward_ms_1_row']:.2f} | "
            f"{r['forward_ms_T_rows']:.2f} | {r['fixed_ms']:.2f} + {r['per_row_ms']:.2f} | "
            f"{r['predicted_ratio']:.2f}x | {_runs(r['stream_rows_per_forward'])} |"
        )


def _runs(values: list[int]) -> str:
    out, i = [], 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        out.append(str(values[i]) if j - i == 1 else f"{values[i]} x{j - i}")
        i = j
    return ", ".join(out)


def fps(d: dict) -> str:
    """Absolute rates only from a GPU run (CPU rates say nothing about a user's machine; ratios do)."""
    if not torch.cuda.is_available():
        return ""
    return f"{d['stream_fps']:.1f} vs {d['sequential_fps']:.1f} fps; "


def summary(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        goal = r["preset"] == GOAL_PRESET
        d = r["denoise_steady"]
        rows.append(
            {
                "metric": f"stream batch vs sequential denoising fps, steady state, {r['preset']} {r['size']}, "
                f"T={r['steps']}",
                "value": f"{d['ratio']:.3f}x ({fps(d)}predicted {r['predicted_ratio']:.2f}x from the time of a "
                "forward of 1 and of T rows)",
                "goal": f">= {TARGET_RATIO:.0f}x" if goal else None,
                "met": d["ratio"] >= TARGET_RATIO if goal else None,
            }
        )
        for level in ("denoise_clip", "end_to_end"):
            d = r[level]
            rows.append(
                {
                    "metric": f"stream batch vs sequential, {LEVELS[level]}, {r['preset']} {r['size']}, "
                    f"{r['frames']} frames",
                    "value": f"{d['ratio']:.2f}x" + (f" ({fps(d)[:-2]})" if fps(d) else ""),
                    "goal": None,
                    "met": None,
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="flux-tiny@64x64,flux-tiny@128x128,flux-tiny@256x256,flux-mid@128x128",
                    help="preset@WxH, comma-separated")  # fmt: skip
    ap.add_argument("--frames", type=int, default=16, help="frames per clip")
    ap.add_argument("--txt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--cfg-mode", default="none", choices=["none", "self", "initialize", "full"])
    ap.add_argument("--rounds", type=int, default=5, help="timed A/B pairs per level")
    ap.add_argument("--forward-repeats", type=int, default=10, help="timed forwards per row count")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (a GPU: bf16 unless --dtype)")
    ap.add_argument(
        "--dtype", default=None, choices=sorted(DTYPES), help="compute dtype (default fp32 on cpu)"
    )
    ap.add_argument("--quick", action="store_true", help=f"short run for bench/run_all: defaults {QUICK}")
    if "--quick" in sys.argv[1:]:
        ap.set_defaults(**QUICK)
    args = ap.parse_args()
    setup_threads(args.threads)
    env = header(f"Stream batch vs sequential per-frame denoising (T = 4, {args.device})")
    results = []
    for case in args.cases.split(","):
        preset, size = case.split("@")
        results.append(run_case(preset, size, args))
    print_results(results)
    rows = summary(results)
    print("\n| metric | value | goal | met |\n|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['metric']} | {row['value']} | {row['goal'] or '-'} | {row['met'] if row['met'] is not None else '-'} |"
        )
    save("stream_batch", {"env": env, "quick": args.quick, "target_ratio": TARGET_RATIO, "results": results,
                          "summary": rows})  # fmt: skip


if __name__ == "__main__":
    main()
