"""The device checks, in the order they run: the cheap correctness checks first, then the schnell group (one
12B model in bf16, 24 GB), then the Wan group (1.3B), so a spent budget drops speed figures, not correctness.

Each check takes the run's :class:`~.runner.Context` and returns its results (a ``"summary"`` list of
``{"metric", "value", "goal", "met"}`` rows among them); it raises :class:`~.runner.Skip` when it cannot run here,
:class:`~.runner.Failed` when a comparison is outside its tolerance. The engine features are used the way the
nodes use them: ``attach_compile`` (FewStepCompile) on a handle, ``open_session`` (the session's run) for a video session.
"""

from __future__ import annotations

import importlib.util
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load as load_safetensors

from .runner import Context, Failed, Setup, Skip, clock, free_memory, sync

NO_GPU = "need a CUDA GPU (smoke mode runs on the CPU)"
SCHNELL_GOAL_S = 0.5  # 4 steps of the FLUX.1-schnell DiT at 1024x1024, H200
WAN_GOAL_FPS = 20.0  # video frames per second after the window fills, 832x480, H200
STEPS = 4


@dataclass(frozen=True)
class Check:
    name: str
    title: str
    run: Callable[[Context], dict]
    gpu_only: str | None = None  # the reason it is skipped without a GPU
    last_of_group: bool = False  # free the shared model afterwards


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (the measure tests/kernels/test_kernels.py uses)."""
    ref64 = ref.double()
    return float((out.double() - ref64).abs().max() / ref64.abs().max().clamp_min(1e-30))


def row(metric: str, value: str, goal: str | None = None, met: bool | None = None) -> dict:
    return {"metric": metric, "value": value, "goal": goal, "met": met}


def median_seconds(ctx: Context, fn, n: int | None = None) -> tuple[float, list[float]]:
    """Median of up to ``n`` synchronised timings of ``fn`` (fewer once the budget is spent; at least one)."""
    times = []
    for _ in ctx.repeats(n):
        times.append(clock(ctx.setup, fn)[0])
        if ctx.time_left() <= 0:
            break
    return statistics.median(times), times


# -- device rate -----------------------------------------------------------------------------------------------------
def measure_matmul_rate(setup: Setup, n: int, batch: int = 10) -> float:
    """FLOP/s of the best of 5 timings of ``batch`` back-to-back ``n x n`` matmuls in the setup's dtype."""
    gen = torch.Generator(device=setup.device).manual_seed(0)
    a = torch.randn(n, n, device=setup.device, dtype=setup.dtype, generator=gen)
    b = torch.randn(n, n, device=setup.device, dtype=setup.dtype, generator=gen)
    for _ in range(3):  # warm-up: cuBLAS handle and heuristics, clocks up
        a @ b
    best = min(clock(setup, lambda: [a @ b for _ in range(batch)])[0] for _ in range(5))
    return 2 * n**3 * batch / best


def matmul_rate(ctx: Context) -> dict:
    s = ctx.setup
    rate = measure_matmul_rate(s, s.matmul_size)
    ctx.shared["matmul_flops_per_s"] = rate
    dtype = str(s.dtype).removeprefix("torch.")
    shown = f"{rate / 1e12:.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"
    return {
        "size": s.matmul_size,
        "dtype": dtype,
        "tflops": rate / 1e12,
        "summary": [row(f"{dtype} matmul rate ({s.matmul_size}^3, best of 5)", shown)],
    }


# -- Triton kernels --------------------------------------------------------------------------------------------------
# max |triton - reference| / max |reference| per kernel and dtype: the bounds of tests/kernels/test_kernels.py, where the
# interpreter truncates to bfloat16; a GPU rounds to nearest, so they hold with margin here
KERNEL_TOL = {
    "dequantize_kv": {torch.float32: 0.0, torch.bfloat16: 2**-5},
    "apply_rope": {torch.float32: 0.0, torch.bfloat16: 2**-5},
    "rms_norm": {torch.float32: 1e-6, torch.bfloat16: 2**-5},
    "adaln_modulate": {torch.float32: 1e-6, torch.bfloat16: 2**-5},
    "quantized_attention": {torch.float32: 4e-6, torch.bfloat16: 5e-2},
}


# sizes of the real models: Wan-1.3B at 832x480 (12 heads of 128, 1560 tokens a frame, 3-frame chunks over a
# 21-frame window: 4680 query tokens, 9360 older keys quantized), FLUX.1 at 1024x1024 (24 heads of 128, 4352
# tokens, width 3072)
KERNEL_SHAPES = {
    "kv": (1, 4680, 12, 128),
    "kv_old": 9360,
    "heads": (1, 4352, 24, 128),
    "hidden": (1, 4096, 3072),
}


def compare_kernels(tk, device: torch.device, shapes: dict = KERNEL_SHAPES) -> tuple[dict, list[str]]:
    """Each kernel of module ``tk`` against its reference in fp32 and bf16: (results by case, failures)."""
    from fewstep.kernels import kv_quant, norms, rope

    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device=device, generator=gen) * scale

    results, bad = {}, []

    def compare(case: str, kernel: str, dtype, out, ref):
        tol = KERNEL_TOL[kernel][dtype]
        err = rel_err(out, ref)
        results[case] = {"rel_err": err, "tol": tol}
        if out.shape != ref.shape or out.dtype != ref.dtype:
            bad.append(
                f"{case}: {tuple(out.shape)} {out.dtype}, the reference {tuple(ref.shape)} {ref.dtype}"
            )
        elif not err <= tol:  # NaN fails too
            bad.append(f"{case}: relative error {err:.2e} > {tol:.0e}")

    b, n, h, d = shapes["kv"]
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for bits in (8, 4):
            x = (rand(b, n, h, d, scale=2.0) + rand(b, n, h, 1)).to(dtype)
            ref = kv_quant.quantize_kv(x, bits)
            out = tk.quantize_kv(x, bits)
            identical = all(torch.equal(o, r) for o, r in zip(out, ref))
            # a code one level off (a rounding tie decided the other way) moves a value by one step of its
            # group's range, at most 2 / (levels - 1) of the largest value
            step = 2 / (2**bits - 1)
            err = rel_err(*(kv_quant.dequantize_kv(*t, bits, torch.float32) for t in (out, ref)))
            results[f"quantize_kv int{bits} {name}"] = {"identical": identical, "rel_err_dequantized": err,
                                                        "tol": step}  # fmt: skip
            if not identical and not err <= step:
                bad.append(f"quantize_kv int{bits} {name}: dequantized relative error {err:.2e} > {step:.2e}")
            compare(f"dequantize_kv int{bits} {name}", "dequantize_kv", dtype,
                    tk.dequantize_kv(*ref, bits, dtype), kv_quant.dequantize_kv(*ref, bits, dtype))  # fmt: skip
            q, k, v = (rand(b, n, h, d).to(dtype) for _ in range(3))
            old = (b, shapes["kv_old"], h, d)
            k_quant, v_quant = kv_quant.quantize_kv(rand(*old), bits), kv_quant.quantize_kv(rand(*old), bits)
            angles = 3 * rand(shapes["kv_old"], d // 2).double()
            args = (
                kv_quant.QuantizedAttentionInputs(
                    q, k, v, k_quant, v_quant, angles.cos(), angles.sin(), bits
                ),
            )
            compare(f"quantized_attention int{bits} {name}", "quantized_attention", dtype,
                    tk.quantized_attention(*args), kv_quant.quantized_attention(*args))  # fmt: skip
        x = rand(*shapes["heads"], scale=3.0).to(dtype)
        weight = 1 + 0.1 * rand(shapes["heads"][-1])
        compare(
            f"rms_norm {name}",
            "rms_norm",
            dtype,
            tk.rms_norm(x, weight, 1e-6),
            norms.rms_norm(x, weight, 1e-6),
        )
        hidden = rand(*shapes["hidden"], scale=2.0).to(dtype)
        width = shapes["hidden"][-1]
        shift, scale = rand(1, 1, width).to(dtype), (0.3 * rand(1, 1, width)).to(dtype)
        compare(f"adaln_modulate {name}", "adaln_modulate", dtype, tk.adaln_modulate(hidden, shift, scale, 1e-6),
                norms.adaln_modulate(hidden, shift, scale, 1e-6))  # fmt: skip
        angles = 3 * rand(1, x.shape[1], 1, x.shape[-1] // 2)
        cos, sin = angles.cos(), angles.sin()
        compare(
            f"apply_rope {name}",
            "apply_rope",
            dtype,
            tk.apply_rope(x, cos, sin),
            rope.apply_rope(x, cos, sin),
        )
    return results, bad


def triton_kernels(ctx: Context) -> dict:
    if importlib.util.find_spec("triton") is None:
        raise Skip("triton is not installed (the engine runs the PyTorch references)")
    from fewstep.kernels import triton_kernels as tk

    if type(tk._rms_norm_kernel).__name__ == "InterpretedFunction":
        raise RuntimeError(
            "TRITON_INTERPRET is set: the kernels would run interpreted; unset it for this check"
        )
    results, bad = compare_kernels(tk, ctx.setup.device)
    sync(ctx.setup)
    if bad:
        raise Failed("; ".join(bad), {"kernels": results})
    summary = row(
        "Triton kernels equal their references (GPU, compiled)", f"{len(results)} cases", "all", True
    )
    return {"kernels": results, "summary": [summary]}


# -- FLUX.1-schnell group -------------------------------------------------------------------------------------------
def flux_inputs(handle, setup: Setup) -> dict:
    """One schnell forward's keyword arguments at the setup's size: activations in the compute dtype, position ids
    and timesteps in float32 (as the sampler passes them)."""
    from fewstep.engine.models.flux import random_inputs

    inputs = random_inputs(handle.params, setup.image_px, setup.image_px, setup.text_tokens)
    return {
        k: v.to(device=setup.device, dtype=setup.dtype if k in ("img", "txt", "y") else v.dtype)
        for k, v in inputs.items()
    }


def sample_four_steps(handle, setup: Setup):
    """``sample_latent``: 4 euler steps of the schnell schedule from seeded synthetic conditioning (no text
    encoder, no VAE: the DiT's end-to-end time)."""
    from fewstep.cli.common import latent_shape, synthetic_condition
    from fewstep.engine import sample_latent

    cond = synthetic_condition(handle.family, handle.params, setup.text_tokens, 1, None)
    latent = torch.zeros(latent_shape(handle.family, 1, setup.image_px, setup.image_px))
    return sample_latent(
        handle, [cond], latent, seed=0, steps=STEPS, schedule="flux.1-schnell", sampler="euler"
    )


def flash_attn_vs_sdpa(ctx: Context) -> dict:
    if importlib.util.find_spec("flash_attn") is None:
        raise Skip("flash-attn is not importable here (pip install flash-attn); the engine runs SDPA")
    from flash_attn import flash_attn_func

    s = ctx.setup
    gen = torch.Generator(device=s.device).manual_seed(0)
    q, k, v = (torch.randn(1, 4352, 24, 128, device=s.device, dtype=s.dtype, generator=gen) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(
        1, 2
    )
    kernel_err = rel_err(flash_attn_func(q, k, v), ref)
    # the whole model through the engine's backend setting: 4 schnell steps each way
    handle = ctx.models.get(s.flux_preset)
    with torch.inference_mode():
        sdpa, _ = sample_four_steps(handle.replace(attention_backend="sdpa"), s)
        flash, _ = sample_four_steps(handle.replace(attention_backend="flash-attn"), s)
    model_err = rel_err(flash, sdpa)
    # bf16 attention: another summation order moves outputs by a few bf16 ulps, 4 steps of 57 blocks compound it
    results = {"attention_rel_err": kernel_err, "attention_tol": 2**-6, "four_steps_rel_err": model_err,
               "four_steps_tol": 5e-2, "shape": [1, 4352, 24, 128]}  # fmt: skip
    if kernel_err > 2**-6 or model_err > 5e-2:
        raise Failed(
            f"flash-attn differs from SDPA: attention {kernel_err:.2e}, 4 steps {model_err:.2e}", results
        )
    results["summary"] = [
        row(
            "flash-attn equals SDPA (attention; 4 schnell steps)",
            f"{kernel_err:.1e}; {model_err:.1e}",
            "<= 1.6e-2; <= 5e-2",
            True,
        )
    ]
    return results


ATTENTION_LAYOUT_SHAPES = {  # (q [B, Lq, H, D], kv tokens)
    "FLUX.1 1024 px joint attention": ((1, 4352, 24, 128), 4352),
    "Wan-1.3B causal chunk over a 21-frame window": ((1, 4680, 12, 128), 32760),
}


def attention_layout(ctx: Context) -> dict:
    """SDPA on this device with head-major q/k/v against transposed ``[B, L, H, D]`` views (what
    ``engine.attention.SDPA_HEAD_MAJOR_DEVICES`` chooses by), and the Triton RoPE kernel writing head-major."""
    s = ctx.setup
    gen = torch.Generator(device=s.device).manual_seed(0)
    results, rows_out = {}, []
    for name, ((b, lq, h, d), lk) in ATTENTION_LAYOUT_SHAPES.items():
        if s.smoke:
            lq, lk, h = min(lq, 256), min(lk, 512), 2
        q = torch.randn(b, lq, h, d, device=s.device, dtype=s.dtype, generator=gen)
        k, v = (torch.randn(b, lk, h, d, device=s.device, dtype=s.dtype, generator=gen) for _ in range(2))
        views = [t.transpose(1, 2) for t in (q, k, v)]
        head_major = [t.contiguous() for t in views]
        token_s, _ = median_seconds(ctx, lambda a=views: F.scaled_dot_product_attention(*a))
        head_s, _ = median_seconds(ctx, lambda a=head_major: F.scaled_dot_product_attention(*a))
        diff = float(
            (F.scaled_dot_product_attention(*views) - F.scaled_dot_product_attention(*head_major)).abs().max()
        )
        results[name] = {"token_major_views_s": token_s, "head_major_s": head_s, "ratio": token_s / head_s,
                         "max_abs_diff": diff, "q": [b, lq, h, d], "kv_tokens": lk}  # fmt: skip
        rows_out.append(row(f"SDPA views / head-major, {name}", f"{token_s / head_s:.3f}x (diff {diff:.1e})"))
    if s.device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        from fewstep.kernels import rope as rope_ref
        from fewstep.kernels import triton_kernels as tk

        x = torch.randn(1, 4096, 24, 128, device=s.device, dtype=s.dtype, generator=gen)
        angles = torch.randn(1, 4096, 1, 64, device=s.device, generator=gen)
        out = tk.apply_rope(x, angles.cos(), angles.sin(), True)
        err = rel_err(out, rope_ref.apply_rope(x, angles.cos(), angles.sin()))
        results["triton_rope_head_major"] = {"rel_err": err, "head_major": rope_ref.is_head_major(out)}
        rows_out.append(row("Triton RoPE written head-major equals the reference", f"{err:.1e}", "<= 3.1e-2",
                            err <= 2**-5 and rope_ref.is_head_major(out)))  # fmt: skip
    results["summary"] = rows_out
    return results


def schnell_graph_equals_eager(ctx: Context) -> dict:
    from fewstep.engine.compile import COMPILE_FEATURE, attach_compile

    s = ctx.setup
    handle = ctx.models.get(s.flux_preset)
    feature = attach_compile(handle, "off", "whole").feature(COMPILE_FEATURE)
    graphs = feature.graphs
    inputs = flux_inputs(handle, s)
    try:
        with torch.inference_mode():
            ref = handle.model(**inputs)
            graphs(**inputs)  # warm-up sighting (eager, on the capture stream)
            graphs(**inputs)  # capture
            out = graphs(**inputs)  # replay
            sync(s)
        stats = vars(graphs.stats.copy())
    finally:
        feature.dispose()
    err = rel_err(out, ref)
    results = {
        "bitwise_equal": bool(torch.equal(out, ref)),
        "rel_err": err,
        "tol": 1e-2,
        "graph_stats": stats,
    }
    if stats["hits"] < 1:
        raise Failed(f"no graph replay (refused: {stats['refused'] or 'none recorded'})", results)
    # the same kernels replayed: identical is expected; the bound covers cuBLAS choosing another algorithm in capture
    if err > 1e-2:
        raise Failed(f"replay differs from eager: relative error {err:.2e}", results)
    results["summary"] = [
        row(
            "CUDA-graph replay equals eager (schnell step)",
            f"{err:.1e} ({'bitwise' if results['bitwise_equal'] else 'not bitwise'})",
            "<= 1e-2",
            True,
        )
    ]
    return results


def schnell_speed(ctx: Context) -> dict:
    """4 steps of the DiT: eager, regional compile (static shapes), and compile + whole CUDA graph (one
    compilation serves both: the graphs replay the compiled forward); then ``sample_latent`` end to end."""
    from fewstep.engine.compile import COMPILE_FEATURE, CompileWatch, attach_compile

    s = ctx.setup
    handle = ctx.models.get(s.flux_preset)
    graph_mode = "whole" if s.on_gpu else "off"
    fast = attach_compile(handle, "regional", graph_mode, dynamic=False, backend=s.compile_backend)
    feature = fast.feature(COMPILE_FEATURE)
    inputs = flux_inputs(handle, s)
    model, compiled = handle.model, feature.compiled
    px = f"{s.image_px}x{s.image_px}"
    results: dict = {
        "preset": s.flux_preset,
        "size": px,
        "text_tokens": s.text_tokens,
        "backend": s.compile_backend,
    }

    def four(fn):
        return lambda: [fn(**inputs) for _ in range(STEPS)]

    try:
        with torch.inference_mode():
            clock(s, lambda: model(**inputs))  # warm-up: cuBLAS, allocator
            eager_s, eager_all = median_seconds(ctx, four(model))
            watch = CompileWatch().start()
            first_s, _ = clock(s, lambda: compiled(**inputs))
            watch.stop()
            compiled_s, compiled_all = median_seconds(ctx, four(compiled))
            results["eager_s"], results["compiled_s"] = eager_s, compiled_s
            results["timings_s"] = {"eager": eager_all, "compiled": compiled_all}
            results["compile"] = {"first_call_s": first_s, "frames": len(watch.frames),
                                  "seconds": sum(f.seconds for f in watch.frames),
                                  "recompiles": sum(f.recompile_reason is not None for f in watch.frames),
                                  "graph_breaks": sum(watch.graph_breaks.values())}  # fmt: skip
            forward_s = {"eager": eager_s / STEPS, "compiled": compiled_s / STEPS}
            if s.on_gpu:
                graphs = feature.graphs
                graphs(**inputs)  # warm-up sighting, then the capture
                graphs(**inputs)
                graph_s, graph_all = median_seconds(ctx, four(graphs))
                results["compiled_graph_s"], results["timings_s"]["compiled + CUDA graph"] = (
                    graph_s,
                    graph_all,
                )
                results["graph_stats"] = vars(graphs.stats.copy())
                forward_s["compiled + CUDA graph"] = graph_s / STEPS
            else:
                results["compiled_graph_s"] = None
                results["compiled_graph_skipped"] = "CUDA graphs " + NO_GPU
            # end to end through the sampler, the path a workflow runs (noise, 4 forwards, euler arithmetic)
            sample_four_steps(fast, s)  # warm-up: the sampler's shapes (and their graph) first
            e2e_s, _ = median_seconds(ctx, lambda: sample_four_steps(fast, s), max(2, s.repeats // 2))
            results["sample_latent_s"] = e2e_s
    finally:
        feature.dispose()
    ctx.shared["schnell_forward_s"] = forward_s
    best = results["compiled_graph_s"] or compiled_s
    on_h200 = s.on_gpu
    label = f"{s.flux_preset} {px}, {STEPS} steps"
    results["summary"] = [
        row(f"{label}: eager", f"{eager_s:.3f} s"),
        row(f"{label}: compiled ({s.compile_backend}), speed-up", f"{compiled_s:.3f} s, {eager_s / compiled_s:.2f}x"),
        row(f"{label}: compiled + CUDA graph, speed-up",
            f"{best:.3f} s, {eager_s / best:.2f}x" if s.on_gpu else "skipped (no GPU)",
            f"<= {SCHNELL_GOAL_S} s (H200)", best <= SCHNELL_GOAL_S if on_h200 else None),
        row(f"{label}: sample_latent end to end (compiled{' + graph' if s.on_gpu else ''})", f"{e2e_s:.3f} s",
            f"<= {SCHNELL_GOAL_S} s (H200)", e2e_s <= SCHNELL_GOAL_S if on_h200 else None),
    ]  # fmt: skip
    return results


def schnell_mfu(ctx: Context) -> dict:
    """FLOPs of one forward (engine.plan's count) / its time / the measured matmul rate of this device."""
    from fewstep.engine.plan.flops import flux_forward_flops

    s = ctx.setup
    handle = ctx.models.get(s.flux_preset)
    tokens = (s.image_px // 16) ** 2
    flops = flux_forward_flops(handle.params, tokens, s.text_tokens).total
    rate = ctx.shared.get("matmul_flops_per_s") or measure_matmul_rate(s, s.matmul_size)
    forward_s = dict(ctx.shared.get("schnell_forward_s") or {})
    if not forward_s:  # the speed check did not run (or failed): time the eager forward here
        inputs = flux_inputs(handle, s)
        with torch.inference_mode():
            clock(s, lambda: handle.model(**inputs))
            forward_s["eager"] = median_seconds(ctx, lambda: handle.model(**inputs))[0]
    mfu = {name: flops / t / rate for name, t in forward_s.items()}
    best = max(mfu, key=mfu.get)
    return {
        "forward_tflop": flops / 1e12,
        "matmul_tflops": rate / 1e12,
        "forward_s": forward_s,
        "mfu": mfu,
        "summary": [row(f"{s.flux_preset} forward MFU vs measured matmul rate ({best})", f"{mfu[best]:.1%}")],
    }


# -- Wan causal group ------------------------------------------------------------------------------------------------
def wan_context(handle, setup: Setup) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(1, 64, handle.params.text_dim, generator=gen)  # a 64-token synthetic umT5 prompt


def stream(handle, setup: Setup, config, chunks: int) -> tuple[list[torch.Tensor], list[float], object]:
    """Latents and synchronised seconds of ``chunks`` chunks of a video session of ``handle`` (with its compile
    feature, as the nodes run it), and the compile run's telemetry (None without the feature)."""
    from fewstep.engine.causal.recipe import open_session

    session, run = open_session(
        handle, wan_context(handle, setup), *setup.video_hw, config, 0, None, "device_check"
    )
    latents, seconds = [], []
    try:
        chunk_iter = session.chunks(chunks)
        for _ in range(chunks):
            t, chunk = clock(setup, lambda: next(chunk_iter))
            latents.append(chunk.latents)
            seconds.append(t)
    finally:
        telemetry = run.finish() if run is not None else None
        session.dispose()
    return latents, seconds, telemetry


def wan_graph_equals_eager(ctx: Context) -> dict:
    from fewstep.engine.causal import CausalConfig
    from fewstep.engine.compile import attach_compile

    s = ctx.setup
    handle = ctx.models.get(s.wan_preset)
    # a 3-chunk window and 5 chunks: the graphs replay before and after the cache rolls
    config = CausalConfig(chunk_frames=s.chunk_frames, window_frames=3 * s.chunk_frames, steps=STEPS)
    eager, _, _ = stream(handle, s, config, 5)
    graph_handle = attach_compile(handle, "off", "whole")
    try:
        graphed, _, telemetry = stream(graph_handle, s, config, 5)
    finally:
        graph_handle.feature(
            "compile"
        ).dispose()  # the graphs' memory pools, before wan_fps allocates its own
    errs = [rel_err(g, e) for g, e in zip(graphed, eager)]
    stats = vars(telemetry.graphs) if telemetry is not None and telemetry.graphs is not None else {}
    results = {
        "chunk_rel_err": errs,
        "tol": 1e-2,
        "graph_stats": stats,
        "notes": telemetry.notes if telemetry else [],
    }
    if stats.get("hits", 0) < 1:
        raise Failed(
            f"no graph replay in the causal chunk steps (refused: {stats.get('refused') or 'none recorded'})",
            results,
        )
    if max(errs) > 1e-2:
        raise Failed(
            f"replay differs from eager: chunk relative errors {', '.join(f'{e:.1e}' for e in errs)}", results
        )
    results["summary"] = [
        row(
            "CUDA-graph replay equals eager (Wan causal chunk steps, 5 chunks)",
            f"{max(errs):.1e}",
            "<= 1e-2",
            True,
        )
    ]
    return results


def wan_fps(ctx: Context) -> dict:
    """Chunks after the window fills (every chunk then reads a full window), eager and compiled (+ whole CUDA
    graph on a GPU), bf16 and int8 KV. Frames are video frames: each latent frame decodes to 4."""
    from fewstep.engine.causal import CausalConfig
    from fewstep.engine.compile import attach_compile

    s = ctx.setup
    handle = ctx.models.get(s.wan_preset)
    fill = s.window_frames // s.chunk_frames
    chunks = fill + (3 if s.smoke else 4)
    graph = "whole" if s.on_gpu else "off"
    fast = attach_compile(handle, "regional", graph, dynamic=False, backend=s.compile_backend)
    variants = {"eager": handle, "compiled + graph" if s.on_gpu else "compiled": fast}
    h, w = s.video_hw
    results: dict = {"preset": s.wan_preset, "size": f"{w}x{h}", "window_frames": s.window_frames,
                     "chunk_frames": s.chunk_frames, "chunks": chunks, "runs": {}}  # fmt: skip
    summary = []
    for kv in ("bf16", "int8"):
        config = CausalConfig(
            chunk_frames=s.chunk_frames, window_frames=s.window_frames, steps=STEPS, kv_dtype=kv
        )
        for name, variant in variants.items():
            if ctx.time_left() <= 0:
                results["runs"][f"{kv} {name}"] = {"not run": "the time budget is spent"}
                continue
            _, seconds, telemetry = stream(variant, s, config, chunks)
            after = seconds[fill:]
            chunk_s = statistics.median(after)
            fps = 4 * s.chunk_frames / chunk_s
            results["runs"][f"{kv} {name}"] = {
                "chunk_seconds": seconds, "after_fill_median_s": chunk_s, "video_fps": fps,
                "latent_fps": s.chunk_frames / chunk_s,
                "compile": None if telemetry is None else telemetry.as_dict(),
            }  # fmt: skip
            goal = f">= {WAN_GOAL_FPS:.0f} fps (H200)"
            summary.append(row(f"{s.wan_preset} {w}x{h} video fps after the window fills, {kv} KV, {name}",
                               f"{fps:.1f}", goal, fps >= WAN_GOAL_FPS if s.on_gpu else None))  # fmt: skip
    for variant in variants.values():
        feature = variant.feature("compile")
        if feature is not None:
            feature.dispose()
    results["summary"] = summary
    return results


INTERACTIVE_ROUNDS = {"device": 3, "smoke": 2}


def interactive(ctx: Context) -> dict:
    """Issue 32's session inputs on the device: a prefill, a prompt switch's re-cache and video-to-video chunks,
    each timed against a text-to-video chunk of the same session (the window full), and two exactness checks
    that need no reference checkout: a prefill of a session's own generated frames continues exactly as that
    session does (same generator state: the prefill's forwards at timestep 0 write the K/V its clean-context
    passes wrote), and a first V2V chunk at strength 1.0 equals the first T2V chunk (the input is fully noised;
    the two differ only in the clean pass, which a first chunk does not carry)."""
    from fewstep.engine.causal import CausalConfig
    from fewstep.engine.causal.recipe import open_session

    s = ctx.setup
    handle = ctx.models.get(s.wan_preset)
    h, w = s.video_hw
    c, window = s.chunk_frames, s.window_frames
    config = CausalConfig(chunk_frames=c, window_frames=window, steps=STEPS)
    prompts = [
        wan_context(handle, s),
        wan_context(handle, s).flip(1),
    ]  # the same tokens reversed: another prompt
    rounds = INTERACTIVE_ROUNDS["smoke" if s.smoke else "device"]
    tol = SESSION_TOL[s.dtype]
    k = window // c  # chunks that fill the window

    def new():
        return open_session(handle, prompts[0], h, w, config, 0, None, "device_check")[0]

    def chunk(session):
        return session.run(1)[0]

    def prefill_seconds(frames: torch.Tensor) -> float:
        fresh = new()
        try:
            return clock(s, lambda: fresh.prefill(frames))[0]
        finally:
            fresh.dispose()

    results: dict = {"preset": s.wan_preset, "size": f"{w}x{h}", "window_frames": window, "chunk_frames": c,
                     "rounds": rounds}  # fmt: skip
    a = new()
    sessions = [a]
    try:
        generated = [chunk(a) for _ in range(k)]
        state = a.generator.get_state()
        t, after = clock(s, lambda: chunk(a))  # the chunk after a full window (carries the last commit)
        # exactness 1: a new session prefilled with a's frames, a's generator state: a's next chunk
        b = new()
        sessions.append(b)
        latents = torch.cat([g.latents for g in generated], dim=2)
        prefill_s, started = clock(s, lambda: b.prefill(latents))
        b.generator.set_state(state)
        prefill_err = rel_err(chunk(b).latents, after.latents)
        b.dispose()
        # timings: T2V chunks, re-cache switches, prefills of the window and of one frame
        t2v_s, recache_s, recache_frames, prefill_frame_s, image_s = (
            [],
            [],
            set(),
            [prefill_s / started.frames],
            [],
        )
        for r in range(rounds):
            t2v_s.append(clock(s, lambda: chunk(a))[0])
            t, report = clock(s, lambda r=r: a.set_prompt(prompts[(r + 1) % 2], recache=True))
            recache_s.append(t)
            recache_frames.add(report.frames)
            if r:  # the first window prefill is the exactness run's
                prefill_frame_s.append(prefill_seconds(latents) / latents.shape[2])
            image_s.append(prefill_seconds(latents[:, :, :1]))
        # exactness 2 and V2V timings: a session restyling random input chunks
        v = new()
        sessions.append(v)
        v.set_strength(1.0)
        inputs = torch.randn(
            1, handle.params.in_dim, c, h // 8, w // 8, generator=torch.Generator().manual_seed(2)
        )
        v.feed(inputs)
        v2v_first_err = rel_err(chunk(v).latents, generated[0].latents)
        for _ in range(k):  # the window full, as the T2V timings had it
            v.feed(inputs)
            chunk(v)
        v2v_s: dict[str, list[float]] = {"0.5": [], "1": []}
        for _ in range(rounds):
            for strength in (0.5, 1.0):
                v.set_strength(strength)
                v.feed(inputs)
                v2v_s[f"{strength:g}"].append(clock(s, lambda: chunk(v))[0])
    finally:
        for x in sessions:
            x.dispose()
    t2v = statistics.median(t2v_s)
    prefill_frame = statistics.median(prefill_frame_s)
    recache = statistics.median(recache_s)
    v2v = {k2: statistics.median(xs) for k2, xs in v2v_s.items()}
    results.update({
        "t2v_chunk_s": t2v_s, "prefill_s_per_frame": prefill_frame_s, "prefill_one_frame_s": image_s,
        "recache_s": recache_s, "recache_frames": sorted(recache_frames), "v2v_chunk_s": v2v_s,
        "prefill_vs_chunk_per_frame": prefill_frame / (t2v / c), "recache_vs_chunk": recache / t2v,
        "v2v_vs_t2v": {k2: x / t2v for k2, x in v2v.items()},
        "prefill_continues_rel_err": prefill_err, "v2v_first_chunk_rel_err": v2v_first_err, "tol": tol,
    })  # fmt: skip
    label = f"{s.wan_preset} {w}x{h}, window {window}"
    judged = s.on_gpu or None
    results["summary"] = [
        row(f"{label}: prefill / T2V chunk, seconds per frame ({started.frames} frames, {len(started.blocks)} "
            "forwards)", f"{results['prefill_vs_chunk_per_frame']:.2f}x ({prefill_frame * 1e3:.1f} ms a frame)"),
        row(f"{label}: re-cache of {', '.join(map(str, sorted(recache_frames)))} frames / T2V chunk seconds",
            f"{results['recache_vs_chunk']:.2f}x ({recache:.3f} s vs {t2v:.3f} s)"),
        row(f"{label}: V2V / T2V chunk seconds, strength 0.5 / 1.0",
            f"{v2v['0.5'] / t2v:.2f}x / {v2v['1'] / t2v:.2f}x"),
        row(f"{label}: prefill of generated frames continues as the session (relative)", f"{prefill_err:.1e}",
            f"<= {tol:.0e}", prefill_err <= tol if judged else None),
        row(f"{label}: first V2V chunk at strength 1.0 vs the first T2V chunk (relative)", f"{v2v_first_err:.1e}",
            f"<= {tol:.0e}", v2v_first_err <= tol if judged else None),
    ]  # fmt: skip
    bad = [f"{name} differs by {err:.2e} relative (> {tol:.0e})" for name, err in
           (("a prefill's continuation", prefill_err), ("the first V2V chunk at strength 1.0", v2v_first_err))
           if not err <= tol]  # fmt: skip
    if recache_frames != {window}:
        bad.append(
            f"a re-cache past the window recomputed {sorted(recache_frames)} frames, not the {window} held"
        )
    if bad:
        raise Failed("; ".join(bad), results)
    return results


SESSION_COUNTS = {"device": (1, 2, 4, 8), "smoke": (1, 2, 4)}
SESSION_CHUNKS = 3  # timed chunks per session after the first (the first has no clean pass to carry)
# batched rows against solo chunks: fp32 on the CPU differs only by the GEMMs' summation order (the pool tests hold
# 1.5e-6); bf16 on a GPU rounds every layer's output, and cuBLAS may pick another kernel for a larger M. A row that
# read another session's window or prompt would differ by O(1) relative to the latents
SESSION_TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2}


def wan_sessions(ctx: Context) -> dict:
    """N sessions batched in one pool (one forward per step for all) against the same N sessions run solo, one
    chunk each after the other: per-tick seconds, session-chunks per second, the planner's predicted gain, and
    the batched rows' latents against the solo ones (same seeds and prompt)."""
    from fewstep.engine.causal import CausalConfig
    from fewstep.engine.causal.recipe import open_session, open_session_pool
    from fewstep.engine.plan import wan_tokens_per_frame
    from fewstep.engine.plan.sessions import plan_session_tick

    s = ctx.setup
    handle = ctx.models.get(s.wan_preset)
    h, w = s.video_hw
    config = CausalConfig(chunk_frames=s.chunk_frames, window_frames=s.window_frames, steps=STEPS)
    prompt = wan_context(handle, s)
    tpf = wan_tokens_per_frame(handle.params, h, w)
    results: dict = {"preset": s.wan_preset, "size": f"{w}x{h}", "window_frames": s.window_frames,
                     "chunk_frames": s.chunk_frames, "timed_chunks": SESSION_CHUNKS, "runs": {}}  # fmt: skip
    summary, bad = [], []
    tol = SESSION_TOL[s.dtype]
    for n in SESSION_COUNTS["smoke" if s.smoke else "device"]:
        if ctx.time_left() <= 0:
            results["runs"][str(n)] = {"not run": "the time budget is spent"}
            continue
        try:
            solo_latents, solo_s = [], []  # solo: the N sessions one after the other, a chunk each per round
            sessions = [
                open_session(handle, prompt, h, w, config, i, None, "device_check")[0] for i in range(n)
            ]
            try:
                iters = [x.chunks(1 + SESSION_CHUNKS) for x in sessions]
                for _ in range(1 + SESSION_CHUNKS):
                    t, chunks = clock(s, lambda iters=iters: [next(it) for it in iters])
                    solo_latents.append([c.latents for c in chunks])
                    solo_s.append(t)
            finally:
                for x in sessions:
                    x.dispose()
            pool, _ = open_session_pool(handle, h, w, config, max_sessions=n, where="device_check")
            pooled_latents, tick_s, batches = [], [], []
            try:
                if pool.slots < n:
                    raise MemoryError(f"the memory budget holds {pool.slots} slots")
                members = [pool.join(prompt, seed=i) for i in range(n)]
                for _ in range(1 + SESSION_CHUNKS):
                    t, report = clock(s, pool.tick)
                    pooled_latents.append([m.take().latents for m in members])
                    tick_s.append(t)
                    batches.append(list(report.batches))
            finally:
                pool.close()
        except (torch.cuda.OutOfMemoryError, MemoryError) as err:  # 8 sessions may not fit a smaller GPU
            why = f"out of memory: {(str(err).splitlines() or [''])[0]}"
            results["runs"][str(n)] = {"not run": why}
            summary.append(row(f"{s.wan_preset} {w}x{h}, {n} sessions batched vs solo", f"not run ({why})"))
            free_memory(s)
            continue
        errs = [rel_err(a, b) for pa, sa in zip(pooled_latents, solo_latents) for a, b in zip(pa, sa)]
        diff = max((a.float() - b.float()).abs().max().item()
                   for pa, sa in zip(pooled_latents, solo_latents) for a, b in zip(pa, sa))  # fmt: skip
        tick = statistics.median(tick_s[1:])
        solo = statistics.median(solo_s[1:])
        predicted = plan_session_tick(handle.params, n, tpf, s.chunk_frames, s.window_frames, STEPS, "h200")
        results["runs"][str(n)] = {
            "tick_s": tick_s, "solo_n_chunks_s": solo_s, "batches": batches,
            "tick_median_s": tick, "solo_n_chunks_median_s": solo,
            "session_chunks_per_s_batched": n / tick, "session_chunks_per_s_solo": n / solo,
            "batched_over_solo": tick / solo, "planner_gain_h200": predicted.gain,
            "max_abs_diff": diff, "max_rel_err": max(errs), "tol": tol,
        }  # fmt: skip
        if not max(errs) <= tol:
            bad.append(
                f"{n} sessions: batched rows differ from solo by {max(errs):.2e} relative (> {tol:.0e})"
            )
        summary.append(row(
            f"{s.wan_preset} {w}x{h}, {n} session{'s' if n > 1 else ''} batched vs solo: per-tick s, "
            "session-chunks/s batched / solo (planner gain, H200)",
            f"{tick:.3f} s vs {solo:.3f} s; {n / tick:.2f} / {n / solo:.2f} ({predicted.gain:.3f}x)"))  # fmt: skip
        summary.append(row(f"{s.wan_preset} {w}x{h}, {n} sessions: batched rows vs solo, max abs diff "
                           "(max relative)", f"{diff:.1e} ({max(errs):.1e})", f"<= {tol:.0e} relative",
                           max(errs) <= tol if s.on_gpu else None))  # fmt: skip
    results["summary"] = summary
    if bad:
        raise Failed("; ".join(bad), results)
    return results


# -- live sessions (issue 33) ------------------------------------------------------------------------------------
LIVE_COUNTS = (1, 2, 4)
LIVE_CHUNKS = {"device": 6, "smoke": 3}  # chunks per session (the session closes after them)
LIVE_WAIT_S = {
    "device": 240.0,
    "smoke": 120.0,
}  # one run's ceiling: a service that never closes fails, not hangs


class InProcessTransport:
    """The live service's host for the device check (and a test): every client is connected, and each session's
    events are read the moment they are queued (the outbox's listener drains it on the putting thread), so no
    chunk is dropped for a slow reader: what is measured is the service and the pool, not a network."""

    def __init__(self):
        self.events: dict[str, list[tuple[float, str, dict]]] = {}  # session id -> (arrival, event, data)
        self.closed: set[str] = set()
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)

    def connected(self, client_id: str) -> bool:
        return True

    def attach(self, session_id: str, client_id: str, outbox) -> None:
        def drain():
            with self._lock:
                while (item := outbox.pop()) is not None:
                    event, data = item
                    self.events.setdefault(session_id, []).append((time.perf_counter(), event, data))
                    if event == "fewstep.session" and data.get("state") == "closed":
                        self.closed.add(session_id)
                self.changed.notify_all()

        outbox.set_listener(drain)
        drain()

    def detach(self, session_id: str) -> None:
        pass

    def wait_closed(self, ids: list[str], timeout: float) -> bool:
        with self._lock:
            return self.changed.wait_for(lambda: self.closed >= set(ids), timeout)


def live_run(handle, setup: Setup, sessions: int, chunks: int, tiny_vae, wait_s: float) -> dict:
    """``sessions`` clients open a session each on an engine LiveService (synthetic text embeddings, as the live
    node without a CLIP), all at once, ``chunks`` chunks each; the service serves them on a thread. Returns every
    session's closing metrics (the ``fewstep.metrics`` event sent at close) and its chunk events."""
    from fewstep.engine.causal import CausalConfig
    from fewstep.engine.causal.recipe import open_session_pool
    from fewstep.engine.live import LiveLimits, LiveService
    from fewstep.engine.prompt_embeddings import synthetic_text_embedding

    h, w = setup.video_hw
    p = handle.params
    config = CausalConfig(chunk_frames=setup.chunk_frames, window_frames=setup.window_frames, steps=STEPS)
    pool, _ = open_session_pool(handle, h, w, config, max_sessions=sessions, tiny_vae=tiny_vae,
                                where="device_check")  # fmt: skip
    if pool.slots < sessions:
        pool.close()
        raise MemoryError(f"the memory budget holds {pool.slots} slots")
    transport = InProcessTransport()
    limits = LiveLimits(max_sessions_per_client=1, idle_seconds=None, metrics_seconds=3600.0)
    service = LiveService(pool, transport, lambda text: synthetic_text_embedding(text, p.text_len, p.text_dim),
                          limits, tiny_vae=tiny_vae, tags={"node": "device_check", "prompt_id": "device_check"},
                          where="device_check")  # fmt: skip
    outcome: dict = {}

    def serve():
        try:
            outcome["report"] = service.serve()
        except BaseException as err:  # noqa: BLE001 - handed to the measuring thread
            outcome["error"] = err
            with transport.changed:
                transport.changed.notify_all()

    thread = threading.Thread(target=serve, name="live-serve", daemon=True)
    t0 = time.perf_counter()
    thread.start()
    try:
        opened = [service.open({"client_id": f"client{i}", "prompt": live_prompt(i), "seed": i, "chunks": chunks})
                  for i in range(sessions)]  # fmt: skip
        ids = [o["session"] for o in opened]
        done = transport.wait_closed(ids, wait_s)
    finally:
        service.stop("the device check is done")
        thread.join(timeout=60)
        if not pool.closed:
            pool.close()
    wall = time.perf_counter() - t0
    if "error" in outcome:
        raise outcome["error"]
    if not done:
        raise Failed(f"{sessions} live sessions of {chunks} chunks did not all close within {wait_s:.0f} s",
                     {"closed": len(transport.closed)})  # fmt: skip
    per_session = []
    for sid in ids:
        events = transport.events.get(sid, [])
        metrics = [d for _, e, d in events if e == "fewstep.metrics"]
        made = [d for _, e, d in events if e == "fewstep.chunk"]
        per_session.append({
            "metrics": metrics[-1] if metrics else None,
            "chunks": len(made),
            "deadline_missed_events": sum(e == "fewstep.deadline_missed" for _, e, _ in events),
            "stall_events": sum(e == "fewstep.stall" for _, e, _ in events),
            "events": sorted({e for _, e, _ in events}),
        })  # fmt: skip
    latents = [[load_safetensors(service.payload(o["session"], o["secret"], k, "safetensors")[0])["latent"]
                for k in range(chunks)] for o in opened]  # fmt: skip
    report = outcome.get("report")
    return {"sessions": per_session, "wall_s": wall,
            "why_stopped": getattr(report, "why_stopped", None)}, latents  # fmt: skip


def live_prompt(i: int) -> str:
    return f"a live stream, client {i}"


def solo_latents(handle, setup: Setup, sessions: int, chunks: int) -> list[list[torch.Tensor]]:
    """The live sessions' reference: each one's prompt (the same synthetic embedding) and seed in a solo
    ``VideoSession`` of the same config, its latents in the raw Wan 2.1 layout the live payloads hold."""
    from fewstep.engine.causal import CausalConfig
    from fewstep.engine.causal.recipe import open_session
    from fewstep.engine.latent_formats import WAN21
    from fewstep.engine.prompt_embeddings import synthetic_text_embedding

    p = handle.params
    config = CausalConfig(chunk_frames=setup.chunk_frames, window_frames=setup.window_frames, steps=STEPS)
    out = []
    for i in range(sessions):
        prompt = synthetic_text_embedding(live_prompt(i), p.text_len, p.text_dim)
        session = open_session(handle, prompt, *setup.video_hw, config, i, None, "device_check")[0]
        try:
            # in the payload's layout: the raw Wan 2.1 latents (engine.live.media.latents_to_safetensors)
            out.append([WAN21.process_out(c.latents.float().cpu()) for c in session.chunks(chunks)])
        finally:
            session.dispose()
    return out


def live_summary(run: dict, chunk_video_s: float) -> dict:
    """One row of the live table from the per-session closing metrics: medians over sessions, the worst p99,
    the least deadline attainment, stalls summed, batch sizes merged."""
    ms = [s["metrics"] for s in run["sessions"]]
    batches: dict[str, int] = {}
    for m in ms:
        for k, v in m["batch_sizes"].items():
            batches[k] = batches.get(k, 0) + v
    p50 = statistics.median(m["inter_chunk_p50_s"] for m in ms)
    return {
        "ttfc_s": statistics.median(m["time_to_first_chunk_s"] for m in ms),
        "ttfc_max_s": max(m["time_to_first_chunk_s"] for m in ms),
        "inter_chunk_p50_s": p50,
        "inter_chunk_p99_s": max(m["inter_chunk_p99_s"] for m in ms),
        "realtime_factor": statistics.median(m["realtime_factor"] for m in ms),
        "steady_realtime_factor": chunk_video_s / p50,
        "deadline_attainment": min(m["deadline_attainment"] for m in ms),
        "viewer_stalls": sum(m["viewer_stalls"] for m in ms),
        "stall_events": sum(s["stall_events"] for s in run["sessions"]),
        "batch_sizes": dict(sorted(batches.items(), key=lambda kv: int(kv[0]))),
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def live(ctx: Context) -> dict:
    """Issue 33's live sessions through the engine's LiveService (in-process transport, every event read at
    once): 1, 2 and 4 clients opening a session each at once, on the Wan model of the setup (Wan2.1-1.3B at
    832x480 on a GPU; wan-tiny in smoke mode), and on a GPU wan-tiny too (the service's own overhead at the same
    size). Per client count: time to first chunk, inter-chunk p50 / p99, realtime factor, deadline attainment,
    viewer stalls, batch sizes; beside them the planner's prediction for this model and size on an H200. With 4
    clients every session's latents (its payload) against its solo session: a batched live row that read another
    session's window or prompt would be off by O(1)."""
    from fewstep.engine import open_model
    from fewstep.engine.plan.live import plan_live
    from fewstep.engine.vae.tiny import load_tiny_vae

    s = ctx.setup
    mode = "smoke" if s.smoke else "device"
    h, w = s.video_hw
    chunks = LIVE_CHUNKS[mode]
    chunk_video_s = 4 * s.chunk_frames / 16
    tiny_vae = load_tiny_vae("dummy:taew2_1", device=s.device, dtype=s.dtype)
    presets = [s.wan_preset] if s.smoke else [s.wan_preset, "wan-tiny"]
    results: dict = {"size": f"{w}x{h}", "chunk_frames": s.chunk_frames, "window_frames": s.window_frames,
                     "chunks_per_session": chunks, "tiny_vae": "dummy:taew2_1", "runs": {}}  # fmt: skip
    summary, bad = [], []
    for preset in presets:
        handle = ctx.models.get(preset) if preset == s.wan_preset else open_model(
            f"dummy:{preset}", device=s.device, dtype=s.dtype)  # fmt: skip
        planned = plan_live(handle.params, h, w, LIVE_COUNTS, s.chunk_frames, s.window_frames, STEPS, "h200")
        predicted = {r["sessions"]: r for r in planned["predictions"]}
        runs = results["runs"].setdefault(preset, {})
        for n in LIVE_COUNTS:
            if ctx.time_left() <= 0:
                runs[str(n)] = {"not run": "the time budget is spent"}
                continue
            try:
                run, latents = live_run(handle, s, n, chunks, tiny_vae, LIVE_WAIT_S[mode])
                if n == max(LIVE_COUNTS):  # the most batched: every session's chunks against its solo run
                    solo = solo_latents(handle, s, n, chunks)
                    errs = [rel_err(a, b) for la, sa in zip(latents, solo) for a, b in zip(la, sa)]
                    run["max_rel_err_vs_solo"], run["tol"] = max(errs), SESSION_TOL[s.dtype]
            except (torch.cuda.OutOfMemoryError, MemoryError) as err:
                why = f"out of memory: {(str(err).splitlines() or [''])[0]}"
                runs[str(n)] = {"not run": why}
                summary.append(row(f"live {preset} {w}x{h}, {n} clients", f"not run ({why})"))
                free_memory(s)
                continue
            if "max_rel_err_vs_solo" in run:
                err, tol = run["max_rel_err_vs_solo"], run["tol"]
                summary.append(row(f"live {preset} {w}x{h}, {n} clients: every session's latents vs its solo "
                                   "session (max relative)", f"{err:.1e}", f"<= {tol:.0e}",
                                   err <= tol if s.on_gpu else None))  # fmt: skip
                if not err <= tol:
                    bad.append(
                        f"{preset}, {n} clients: live latents differ from solo by {err:.2e} (> {tol:.0e})"
                    )
            got = live_summary(run, chunk_video_s)
            pred = predicted[n]
            runs[str(n)] = {**run, "summary": got, "planner_h200": {
                k: pred[k] for k in ("first_chunk_seconds", "interval_seconds", "realtime_factor", "deadline_met",
                                     "batches")}}  # fmt: skip
            summary.append(row(
                f"live {preset} {w}x{h}, {n} client{'s' if n > 1 else ''}: TTFC, inter-chunk p50 / p99, RTF "
                "(steady), deadline attainment, stalls, batches (planner H200: TTFC, interval, RTF)",
                f"{got['ttfc_s']:.3f} s, {got['inter_chunk_p50_s']:.3f} / {got['inter_chunk_p99_s']:.3f} s, "
                f"{got['realtime_factor']:.2f}x ({got['steady_realtime_factor']:.2f}x), "
                f"{got['deadline_attainment']:.0%}, {got['viewer_stalls']}, {got['batch_sizes']} "
                f"({_ms(pred['first_chunk_seconds'])}, {_ms(pred['interval_seconds'])}, "
                f"{pred['realtime_factor']:.3g}x)"))  # fmt: skip
        if preset != s.wan_preset:
            del handle
            free_memory(s)
    results["summary"] = summary
    if bad:
        raise Failed("; ".join(bad), results)
    return results


CHECKS = [
    Check("matmul_rate", "bf16 matmul rate of the device (the MFU denominator)", matmul_rate),
    Check("triton_kernels", "each Triton kernel equals its reference, compiled for the GPU", triton_kernels,
          gpu_only="the Triton kernels are checked compiled for a GPU; on a CPU tests/kernels/test_kernels.py checks "
          "them through Triton's interpreter"),
    Check("flash_attn_vs_sdpa", "flash-attn backend equals SDPA", flash_attn_vs_sdpa,
          gpu_only="flash-attn runs only on a CUDA GPU (smoke mode runs on the CPU)"),
    Check("attention_layout", "SDPA: head-major q/k/v against transposed [B, L, H, D] views; Triton RoPE "
          "written head-major", attention_layout),
    Check("schnell_graph_equals_eager", "CUDA-graph replay equals eager: a FLUX.1-schnell step",
          schnell_graph_equals_eager, gpu_only="CUDA graphs " + NO_GPU),
    Check("schnell_speed", "FLUX.1-schnell 4 steps: eager / compiled / compiled + CUDA graph", schnell_speed),
    Check("schnell_mfu", "MFU of the schnell forward against the measured matmul rate", schnell_mfu,
          last_of_group=True),
    Check("wan_graph_equals_eager", "CUDA-graph replay equals eager: Wan causal chunk steps",
          wan_graph_equals_eager, gpu_only="CUDA graphs " + NO_GPU),
    Check("wan_fps", "Wan causal frames per second after the window fills, bf16 and int8 KV", wan_fps),
    Check("interactive", "Wan session inputs: prefill, prompt switch with re-cache, video to video, against a "
          "T2V chunk; exactness of a prefill's continuation and a strength-1.0 V2V chunk", interactive),
    Check("wan_sessions", "Wan sessions batched in one pool vs solo: per-tick seconds, session-chunks/s, "
          "exactness", wan_sessions),
    Check("live", "live sessions through the engine's LiveService, 1 / 2 / 4 clients: TTFC, inter-chunk p50 / "
          "p99, realtime factor, deadline attainment, stalls, batch sizes, beside the planner's prediction", live,
          last_of_group=True),
]  # fmt: skip
NAMES = [c.name for c in CHECKS]
