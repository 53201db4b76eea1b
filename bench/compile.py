"""Compiled and CUDA-graph DiT forwards (engine.compile) against eager: CPU always, a CUDA GPU when present.

    python bench/compile.py                       # CPU: flux-tiny 128x128, flux-mid 256x256 and 512x512;
                                                  # regional and full; then the GPU section if CUDA is present
    python bench/compile.py --quick               # CPU: flux-mid 256x256, regional only (< 90 s on 2 cores)
    python bench/compile.py --cases flux-mid@512x512 --modes regional --rounds 7 --threads 2
    python bench/compile.py --cases flux2-mid@256x256,zimage-mid@256x256 --modes regional  # FLUX.2, Z-Image
    python bench/compile.py --gpu-preset flux.2-klein-4b   # (GPU) klein-4B, or z-image-turbo, at 1024x1024
    python bench/compile.py --no-cpu              # (on a GPU machine) only the GPU section

CPU section, per case (dummy weights, fp32, 1 image, ``--txt`` prompt tokens), compile with the inductor
backend and dynamic shapes (what FewStepCompile ships):

* *compile*: the first compiled call, minus one eager forward, and dynamo's own figure (frames compiled, their
  compile seconds, graph breaks, recompiles; ``CompileWatch``). Inductor's on-disk cache makes a second run
  of the script compile faster than the first; the figure is whatever this run paid.
* *forward*: eager and compiled forwards timed A/B interleaved (the order alternating per round), ``--repeats``
  forwards per side per round; ratio = eager time / compiled time per round, median (min-max). Above 1x the
  compiled forward is faster. On a CPU most of a forward of this size is GEMMs that inductor hands to the same
  oneDNN / MKL kernels as eager, so the ratio is near 1x, and below it where the compiled code is slower: the
  number is reported as measured.
* *4-step sampling*: ``sample_latent`` (euler, 4 steps, flux.1-schnell schedule) of the eager handle and of the
  compiled handle (``attach_compile``), interleaved; also the max abs difference of the latents.

GPU section (only when ``torch.cuda.is_available()``): FLUX.1-schnell's architecture (12B, dummy weights,
bf16) at 1024x1024 px (4096 image tokens) with ``--gpu-txt`` (256: schnell's T5 length) prompt tokens:

* one forward: eager, regional compile (inductor, dynamic shapes), and regional compile replayed from a whole
  CUDA graph (the same compiled code: one compilation serves both), median of ``--gpu-repeats`` forwards after
  warm-up and capture; the forward's max abs difference to eager;
* the 4-step end-to-end DiT time: ``sample_latent`` with 4 euler steps of the eager handle and of the
  compile + CUDA-graph handle (noise, the 4 forwards, the sampler arithmetic; no text encoder, no VAE), median
  of ``--gpu-rounds`` runs after one warm-up run. Goal: <= 0.5 s on an H200.

Absolute times are in the summary only when a GPU is present (CPU seconds depend on the shared machine);
ratios always. The JSON keeps everything, CPU seconds included.
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import dit_inputs, header, image_tokens, median, parse_args, parse_px, save, setup_threads

from fewstep.engine import TextCondition, open_model, sample_latent
from fewstep.engine.compile import COMPILE_FEATURE, CompileWatch, attach_compile, compile_model

QUICK = {"cases": "flux-mid@256x256", "modes": "regional", "rounds": 5, "repeats": 1, "sample_rounds": 2}
GPU_GOAL_S = 0.5  # 4-step end-to-end DiT time, FLUX.1-schnell 1024x1024, H200
STEPS = 4
SCHEDULE = "flux.1-schnell"


# -- shared ----------------------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(fn, device: torch.device) -> tuple[float, object]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def to_device(inputs: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """Activations in the compute dtype; position ids, timesteps and guidance stay fp32 (as the sampler passes)."""
    return {
        k: v.to(device=device, dtype=dtype if k in ("img", "txt", "y") else v.dtype)
        for k, v in inputs.items()
    }


def condition(handle, txt: int, seed: int = 0) -> TextCondition:
    """Seeded conditioning of the handle's family (FLUX.1: T5 tokens and a pooled vector; FLUX.2, Z-Image: tokens)."""
    gen = torch.Generator().manual_seed(seed)
    spec, params = handle.family.image, handle.params
    pooled = spec.pooled_dim(params)
    return TextCondition(
        torch.randn(1, txt, spec.context_dim(params), generator=gen),
        None if pooled is None else torch.randn(1, pooled, generator=gen),
        3.5 if spec.guidance(params) else None,
    )


def empty_latent(handle, width: int, height: int) -> torch.Tensor:
    fmt = handle.family.latent_format
    return torch.zeros(1, fmt.channels, height // fmt.downscale, width // fmt.downscale)


def ab(fn_a, fn_b, rounds: int, device: torch.device) -> tuple[list[float], list[float], object, object]:
    """Interleaved timings of two callables, the order alternating per round; the last outputs."""
    ta, tb, out_a, out_b = [], [], None, None
    for r in range(rounds):
        for which in (0, 1) if r % 2 == 0 else (1, 0):
            if which == 0:
                t, out_a = clock(fn_a, device)
                ta.append(t)
            else:
                t, out_b = clock(fn_b, device)
                tb.append(t)
    return ta, tb, out_a, out_b


def ratio_stats(eager: list[float], other: list[float]) -> dict:
    ratios = [e / o for e, o in zip(eager, other, strict=True)]
    return {
        "eager_s": median(eager),
        "compiled_s": median(other),
        "ratio": median(ratios),
        "ratio_min_max": [min(ratios), max(ratios)],
    }


def watch_summary(watch: CompileWatch) -> dict:
    frames = watch.frames
    return {
        "frames_compiled": len(frames),
        "dynamo_compile_s": sum(f.seconds for f in frames),
        "recompiles": sum(f.recompile_reason is not None for f in frames),
        "graph_breaks": sum(watch.graph_breaks.values()),
        "graph_break_reasons": watch.graph_breaks,
        "frame_names": [f"{f.name} ({f.file}:{f.line})" for f in frames],
    }


# -- CPU -------------------------------------------------------------------------------------------------------------
def run_cpu_case(preset: str, size: str, mode: str, args) -> dict:
    width, height = parse_px(size)
    device = torch.device("cpu")
    handle = open_model(f"dummy:{preset}", device="cpu", dtype=torch.float32)
    model = handle.model
    inputs = dit_inputs(model, width, height, args.txt)  # FLUX.1, FLUX.2 or Z-Image forward arguments
    torch._dynamo.reset()  # every case compiles from scratch (dynamo's in-memory caches)
    compiled = compile_model(model, mode, dynamic=True, backend=args.backend)
    with torch.inference_mode():
        eager_first, ref = clock(lambda: model(**inputs), device)
        watch = CompileWatch().start()
        first, out = clock(lambda: compiled(**inputs), device)
        watch.stop()
        te, tc, _, _ = ab(
            lambda: [model(**inputs) for _ in range(args.repeats)][-1],
            lambda: [compiled(**inputs) for _ in range(args.repeats)][-1],
            args.rounds, device,
        )  # fmt: skip
    forward = ratio_stats([t / args.repeats for t in te], [t / args.repeats for t in tc])
    forward["max_abs_diff"] = float((out - ref).abs().max())

    # 4 sampling steps through the handle feature (the sampler applies it); the compiled code is reused
    cond = condition(handle, args.txt)
    latent = empty_latent(handle, width, height)
    compiled_handle = attach_compile(handle, mode, "off", backend=args.backend)
    compiled_handle.feature(COMPILE_FEATURE).compiled = compiled  # the same compiled code as above
    kwargs = {"steps": STEPS, "schedule": SCHEDULE, "seed": 0}
    _, warm = sample_latent(compiled_handle, [cond], latent, **kwargs)
    te, tc, (xe, _), (xc, report) = ab(
        lambda: sample_latent(handle, [cond], latent, **kwargs),
        lambda: sample_latent(compiled_handle, [cond], latent, **kwargs),
        args.sample_rounds, device,
    )  # fmt: skip
    sample = ratio_stats(te, tc) | {
        "max_abs_diff": float((xc - xe).abs().max()),
        "frames_compiled_in_timed_runs": report.compile.frames_compiled,
        "warm_run_report": warm.summary(),
    }
    return {
        "preset": preset,
        "size": size,
        "mode": mode,
        "backend": args.backend,
        "image_tokens": image_tokens(width, height),
        "text_tokens": args.txt,
        "first_compiled_call_s": first,
        "eager_first_call_s": eager_first,
        "compile_s": max(first - forward["eager_s"], 0.0),
        **watch_summary(watch),
        "forward": forward,
        "sample_4_steps": sample,
        "rounds": args.rounds,
        "repeats": args.repeats,
    }


# -- GPU -------------------------------------------------------------------------------------------------------------
def gpu_section(preset: str, size: str, txt: int, repeats: int, rounds: int, backend: str,
                device: torch.device) -> dict:  # fmt: skip
    """Eager vs regional compile vs compile + whole CUDA graph (one forward), and the 4-step DiT time.

    ``device`` is a CUDA device in the bench; on a CPU (a dry run of this code) graphs fall back to eager."""
    width, height = parse_px(size)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    on_gpu = device.type == "cuda"
    handle = open_model(f"dummy:{preset}", device=device, dtype=dtype)
    model = handle.model
    inputs = to_device(dit_inputs(model, width, height, txt), device, dtype)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30

    torch._dynamo.reset()
    graphed_handle = attach_compile(handle, "regional", "whole", backend=backend, allow_fallback=not on_gpu)
    feature = graphed_handle.feature(COMPILE_FEATURE)
    compiled, graphs = feature.compiled, feature.graphs  # graphs replay the compiled forward

    results: dict = {"preset": preset, "size": size, "dtype": str(dtype), "image_tokens": image_tokens(width, height),
                     "text_tokens": txt, "weights_gib": weights_gib, "backend": backend}  # fmt: skip
    with torch.inference_mode():
        t, ref = clock(lambda: model(**inputs), device)  # warm-up (cuBLAS handles, allocator)
        watch = CompileWatch().start()
        t_first, out_c = clock(lambda: compiled(**inputs), device)
        watch.stop()
        results["compile"] = {"first_compiled_call_s": t_first, **watch_summary(watch)}
        # graphs: the warm-up sighting (eager on the capture stream), then the capture
        t_warm, _ = clock(lambda: graphs(**inputs), device)
        t_capture, out_g = clock(lambda: graphs(**inputs), device)
        results["graph_warmup_s"], results["graph_capture_s"] = t_warm, t_capture

        def series(fn) -> list[float]:
            return [clock(fn, device)[0] for _ in range(repeats)]

        forward = {}
        for _ in range(2):  # two interleaved passes over the three variants
            for name, fn in (("eager", lambda: model(**inputs)), ("regional compile", lambda: compiled(**inputs)),
                             ("compile + CUDA graph", lambda: graphs(**inputs))):  # fmt: skip
                forward.setdefault(name, []).extend(series(fn))
        out_g = graphs(**inputs)
        results["forward_s"] = {name: median(ts) for name, ts in forward.items()}
        results["forward_s_min"] = {name: min(ts) for name, ts in forward.items()}
        results["forward_max_abs_diff"] = {
            "regional compile": float((out_c.float() - ref.float()).abs().max()),
            "compile + CUDA graph": float((out_g.float() - ref.float()).abs().max()),
            "reference max abs": float(ref.float().abs().max()),
        }
        results["graph_stats"] = vars(graphs.stats.copy())

    cond = condition(handle, txt)
    latent = empty_latent(handle, width, height)
    kwargs = {"steps": STEPS, "schedule": SCHEDULE, "seed": 0}
    sample_latent(graphed_handle, [cond], latent, **kwargs)  # warm-up: every step's key captured already
    sample_latent(handle, [cond], latent, **kwargs)
    te, tg, (xe, _), (xg, report) = ab(
        lambda: sample_latent(handle, [cond], latent, **kwargs),
        lambda: sample_latent(graphed_handle, [cond], latent, **kwargs),
        rounds, device,
    )  # fmt: skip
    results["sample_4_steps_s"] = {"eager": median(te), "compile + CUDA graph": median(tg)}
    results["sample_4_steps_s_min"] = {"eager": min(te), "compile + CUDA graph": min(tg)}
    results["sample_max_abs_diff"] = float((xg - xe).abs().max())
    results["sample_report"] = report.summary()
    if on_gpu:
        results["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        results["gpu"] = torch.cuda.get_device_name(device)
    return results


# -- output ----------------------------------------------------------------------------------------------------------
def print_cpu(results: list[dict]) -> None:
    print("| preset | size | tokens (img + txt) | mode | compile s (dynamo) | frames / breaks / recompiles "
          "| forward eager ms | forward compiled ms | ratio eager/compiled (min-max) | 4-step ratio | max diff |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        f, s = r["forward"], r["sample_4_steps"]
        print(
            f"| {r['preset']} | {r['size']} | {r['image_tokens']} + {r['text_tokens']} | {r['mode']} | "
            f"{r['compile_s']:.1f} ({r['dynamo_compile_s']:.1f}) | {r['frames_compiled']} / {r['graph_breaks']} / "
            f"{r['recompiles']} | {f['eager_s'] * 1e3:.1f} | {f['compiled_s'] * 1e3:.1f} | {f['ratio']:.2f}x "
            f"({f['ratio_min_max'][0]:.2f}-{f['ratio_min_max'][1]:.2f}) | {s['ratio']:.2f}x | "
            f"{max(f['max_abs_diff'], s['max_abs_diff']):.1e} |"
        )


def print_gpu(g: dict) -> None:
    print(f"\n### GPU: {g.get('gpu', 'no CUDA device (dry run)')}, {g['preset']} {g['size']} ({g['dtype']}, "
          f"{g['image_tokens']} + {g['text_tokens']} tokens, {g['weights_gib']:.1f} GiB weights)\n")  # fmt: skip
    c = g["compile"]
    print(f"compile: first compiled call {c['first_compiled_call_s']:.1f} s ({c['frames_compiled']} frames, "
          f"{c['graph_breaks']} graph breaks, {c['recompiles']} recompiles); graph warm-up "
          f"{g['graph_warmup_s']:.2f} s, capture {g['graph_capture_s']:.2f} s\n")  # fmt: skip
    print("| variant | forward ms (median) | forward ms (min) | vs eager | max abs diff to eager |")
    print("|---|---|---|---|---|")
    eager = g["forward_s"]["eager"]
    for name, t in g["forward_s"].items():
        diff = g["forward_max_abs_diff"].get(name)
        print(f"| {name} | {t * 1e3:.1f} | {g['forward_s_min'][name] * 1e3:.1f} | {eager / t:.2f}x | "
              f"{'-' if diff is None else f'{diff:.2e}'} |")  # fmt: skip
    print("\n| 4-step DiT (euler, schnell schedule) | s (median) | s (min) |\n|---|---|---|")
    for name, t in g["sample_4_steps_s"].items():
        print(f"| {name} | {t:.3f} | {g['sample_4_steps_s_min'][name]:.3f} |")
    print("\n" + g["sample_report"])


def summary(cpu: list[dict], gpu: dict | None) -> list[dict]:
    rows = []
    for r in cpu:
        f, s = r["forward"], r["sample_4_steps"]
        where = f"{r['preset']} {r['size']}, {r['mode']} ({r['backend']}), CPU"
        rows.append({"metric": f"compiled vs eager DiT forward, {where}",
                     "value": f"{f['ratio']:.2f}x (eager / compiled time; min-max {f['ratio_min_max'][0]:.2f}-"
                              f"{f['ratio_min_max'][1]:.2f}; max abs diff {f['max_abs_diff']:.1e})",
                     "goal": None, "met": None})  # fmt: skip
        rows.append({"metric": f"compiled vs eager 4-step sampling, {where}", "value": f"{s['ratio']:.2f}x",
                     "goal": None, "met": None})  # fmt: skip
        rows.append({"metric": f"compile of {where}",
                     "value": f"{r['frames_compiled']} frames, {r['graph_breaks']} graph breaks, "
                              f"{r['recompiles']} recompiles",
                     "goal": None, "met": None})  # fmt: skip
    if gpu is not None and "gpu" in gpu:
        where = f"{gpu['preset']} {gpu['size']} {gpu['dtype'].replace('torch.', '')}, {gpu['gpu']}"
        fw = gpu["forward_s"]
        for name, t in fw.items():
            rows.append({"metric": f"DiT forward, {name}, {where}",
                         "value": f"{t * 1e3:.1f} ms ({fw['eager'] / t:.2f}x vs eager)",
                         "goal": None, "met": None})  # fmt: skip
        t = gpu["sample_4_steps_s"]["compile + CUDA graph"]
        rows.append({"metric": f"4-step end-to-end DiT time, compile + CUDA graph, {where}",
                     "value": f"{t:.3f} s (eager {gpu['sample_4_steps_s']['eager']:.3f} s)",
                     "goal": f"<= {GPU_GOAL_S} s (H200)", "met": t <= GPU_GOAL_S})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="flux-tiny@128x128,flux-mid@256x256,flux-mid@512x512",
                    help="CPU cases, preset@WxH, comma-separated")  # fmt: skip
    ap.add_argument("--modes", default="regional,full", help="compile modes on the CPU: regional, full")
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    ap.add_argument("--txt", type=int, default=64, help="prompt tokens (CPU)")
    ap.add_argument("--rounds", type=int, default=7, help="timed A/B rounds of forwards (CPU)")
    ap.add_argument("--repeats", type=int, default=3, help="forwards per side per round (CPU)")
    ap.add_argument("--sample-rounds", type=int, default=3, help="timed A/B rounds of 4-step sampling (CPU)")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU section")
    ap.add_argument("--no-gpu", action="store_true", help="skip the GPU section even when CUDA is present")
    ap.add_argument("--gpu-preset", default="flux.1-schnell")
    ap.add_argument("--gpu-size", default="1024x1024")
    ap.add_argument("--gpu-txt", type=int, default=256, help="prompt tokens on the GPU (schnell's T5 length)")
    ap.add_argument("--gpu-repeats", type=int, default=10, help="timed forwards per variant and pass")
    ap.add_argument("--gpu-rounds", type=int, default=5, help="timed A/B rounds of 4-step sampling (GPU)")
    args = parse_args(ap, QUICK)
    setup_threads(args.threads)
    env = header("Compiled and CUDA-graph DiT forwards vs eager")
    cpu = []
    if not args.no_cpu:
        for case in args.cases.split(","):
            preset, size = case.split("@")
            for mode in args.modes.split(","):
                cpu.append(run_cpu_case(preset, size, mode.strip(), args))
        print_cpu(cpu)
    gpu = None
    if torch.cuda.is_available() and not args.no_gpu:
        env["gpu"] = torch.cuda.get_device_name(0)
        gpu = gpu_section(args.gpu_preset, args.gpu_size, args.gpu_txt, args.gpu_repeats, args.gpu_rounds,
                          "inductor", torch.device("cuda", 0))  # fmt: skip
        print_gpu(gpu)
    else:
        print("\nGPU section skipped: " + ("--no-gpu" if args.no_gpu else "no CUDA device in this process"))
    rows = summary(cpu, gpu)
    print("\n| metric | value | goal | met |\n|---|---|---|---|")
    for row in rows:
        met = row["met"] if row["met"] is not None else "-"
        print(f"| {row['metric']} | {row['value']} | {row['goal'] or '-'} | {met} |")
    save("compile", {"env": env, "quick": args.quick, "gpu_goal_s": GPU_GOAL_S, "cpu": cpu, "gpu": gpu,
                     "summary": rows})  # fmt: skip


if __name__ == "__main__":
    main()
