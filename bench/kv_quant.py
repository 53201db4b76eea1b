"""KV-cache quantization: bytes per window (int8 / int4 vs bf16), kernel times, and latent PSNR of a short stream.

    python bench/kv_quant.py            # Wan-1.3B / 14B memory at 480p, kernel references at Wan-1.3B widths, wan-mid stream
    python bench/kv_quant.py --quick    # the same with a wan-tiny stream and smaller kernel shapes (< 90 s)

Memory: the cache's own allocation (``KVCache(..., device="meta")``: real shapes and dtypes, no memory), for
Wan2.1-1.3B and 14B at 832x480 (1560 tokens per latent frame), window 21, chunk 3, no sinks, bf16 compute, and the
same formula checked byte for byte against real allocations of a small cache. Per token: quantized storage
(codes + float16 scale + zero point) against bf16; per window: the full-precision part (current chunk +
``keep_recent`` chunks) included.

Kernels: the PyTorch reference of every kernel timed on the CPU; on a CUDA device (with Triton) the Triton kernel
is timed beside it. Stream: the same seeded stream with ``kv_dtype`` bf16 (the compute dtype), int8 and int4; PSNR
of the latents against the unquantized stream, ``10 log10(range(ref)^2 / MSE)``.
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import header, median, save, setup_threads

from fewstep import kernels
from fewstep.engine import load_dit
from fewstep.engine.causal import CausalConfig, KVCache, VideoSession, WindowSpec
from fewstep.engine.causal.kv_cache import KVStorage, kv_cache_bytes
from fewstep.engine.models.wan import PRESETS
from fewstep.kernels import kv_quant, norms, rope

GOAL_SCALES = 0.07  # scales and zero points at most 7% on top of the codes
GB = 1e9


# -- memory ------------------------------------------------------------------------------------------------------------
def window_bytes(preset: str, tokens_per_frame: int, window: WindowSpec, kv_dtype: str, keep: int) -> dict:
    p = PRESETS[preset]
    storage = KVStorage(window, kv_dtype, keep_recent_chunks=keep)
    cache = KVCache(
        p.num_layers, 1, tokens_per_frame, p.num_heads, p.head_dim, storage, torch.bfloat16, "meta"
    )
    return {
        "preset": preset,
        "kv_dtype": kv_dtype,
        "keep_recent_chunks": keep,
        "bytes": cache.nbytes,
        "bytes_per_token_full": cache.bytes_per_token(),
        "bytes_per_token_quantized": cache.quantized_bytes_per_token(),
        "full_precision_frames": window.sink_frames + cache.slots.full_ring,
        "quantized_frames": cache.slots.quant_ring,
    }


def formula_matches_allocation() -> bool:
    """The meta-device numbers are what a real allocation takes: a small cache on the CPU, every storage."""
    ok = True
    for kv_dtype in ("bf16", "int8", "int4"):
        for device in ("meta", "cpu"):
            storage = KVStorage(WindowSpec(3, 12, 2), kv_dtype, keep_recent_chunks=1)
            cache = KVCache(2, 2, 6, 4, 128, storage, torch.bfloat16, device)
            # the KV cache's one formula (the planner's, the preflight's): the sinks' key copies included
            formula = kv_cache_bytes(2, 2, 6, 4, 128, storage.window, torch.bfloat16, kv_dtype, 1).window
            allocated = sum(b.nbytes for b in cache.buffers())
            ok &= cache.nbytes == formula == allocated
            if device == "cpu":
                ok &= allocated == sum(b.untyped_storage().nbytes() for b in cache.buffers())
    return ok


def memory_tables(tokens_per_frame: int) -> tuple[list[dict], list[dict]]:
    window = WindowSpec(3, 21, 0)
    per_token, per_window = [], []
    for preset in ("wan2.1-1.3b", "wan2.1-14b"):
        full = window_bytes(preset, tokens_per_frame, window, "bf16", 1)
        for kv_dtype, bits in (("int8", 8), ("int4", 4)):
            d = PRESETS[preset].head_dim
            codes, scales = kv_quant.packed_dim(d, bits), 4
            row = window_bytes(preset, tokens_per_frame, window, kv_dtype, 1)
            per_token.append(
                {
                    "preset": preset,
                    "kv_dtype": kv_dtype,
                    "bf16_bytes_per_token": full["bytes_per_token_full"],
                    "bytes_per_token": row["bytes_per_token_quantized"],
                    "ratio": row["bytes_per_token_quantized"] / full["bytes_per_token_full"],
                    "goal_ratio": (0.5 if bits == 8 else 0.25) * (1 + GOAL_SCALES),
                    "scale_overhead": scales / codes,
                }
            )
            for keep in (0, 1, 2):
                row = window_bytes(preset, tokens_per_frame, window, kv_dtype, keep)
                per_window.append({**row, "bf16_bytes": full["bytes"], "ratio": row["bytes"] / full["bytes"]})
    return per_token, per_window


# -- kernels ------------------------------------------------------------------------------------------------------------
def kernel_cases(tokens: int, key_tokens: int, dim: int, heads: int, device, dtype):
    d = dim // heads
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    x = rand(1, tokens, dim)
    q, kv = rand(1, tokens, heads, d), rand(1, key_tokens, heads, d)
    packed = {bits: kv_quant.quantize_kv(kv, bits) for bits in (8, 4)}
    angles = torch.randn(1, tokens, 1, d // 2, generator=g, dtype=torch.float64).to(device)
    half = key_tokens // 2
    kq = kv_quant.quantize_kv(kv[:, half:], 8)
    return {
        "rms_norm": ((x, rand(dim), 1e-6), norms.rms_norm, f"[1, {tokens}, {dim}]"),
        "adaln_modulate": (
            (x.float(), rand(1, 3, dim).float(), rand(1, 3, dim).float(), 1e-6),
            norms.adaln_modulate,
            f"[1, {tokens}, {dim}], 3 frames",
        ),
        "apply_rope": (
            (q, angles.cos(), angles.sin()),
            rope.apply_rope,
            f"[1, {tokens}, {heads}, {d}], float64 tables",
        ),
        "quantize_kv int8": ((kv, 8), kv_quant.quantize_kv, f"[1, {key_tokens}, {heads}, {d}]"),
        "dequantize_kv int8": (
            (*packed[8], 8, dtype),
            kv_quant.dequantize_kv,
            f"[1, {key_tokens}, {heads}, {d}]",
        ),
        "quantize_kv int4": ((kv, 4), kv_quant.quantize_kv, f"[1, {key_tokens}, {heads}, {d}]"),
        "dequantize_kv int4": (
            (*packed[4], 4, dtype),
            kv_quant.dequantize_kv,
            f"[1, {key_tokens}, {heads}, {d}]",
        ),
        "quantized_attention int8": (
            (kv_quant.QuantizedAttentionInputs(q, kv[:, :half], kv[:, :half], kq, kq, None, None, 8),),
            kv_quant.quantized_attention,
            f"q {tokens}, keys {half} full + {key_tokens - half} int8, {heads} heads x {d}",
        ),
    }


def time_fn(fn, args, device, rounds: int, min_time: float) -> float:
    """Median seconds per call (calls repeated to last ``min_time``)."""

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    fn(*args)
    sync()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < min_time / 4 or n == 0:
        fn(*args)
        n += 1
    sync()
    reps = max(1, int(n * min_time / max(time.perf_counter() - t0, 1e-9) / 4))
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(*args)
        sync()
        times.append((time.perf_counter() - t0) / reps)
    return median(times)


def kernel_times(tokens: int, key_tokens: int, rounds: int, min_time: float) -> tuple[list[dict], str]:
    p = PRESETS["wan2.1-1.3b"]
    cuda = torch.cuda.is_available() and kernels.triton_importable()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for name, (args, reference, shape) in kernel_cases(
        tokens, key_tokens, p.dim, p.num_heads, device, dtype
    ).items():
        row = {
            "kernel": name,
            "shape": shape,
            "device": device.type,
            "dtype": str(dtype).removeprefix("torch."),
        }
        row["reference_ms"] = 1e3 * time_fn(reference, args, device, rounds, min_time)
        if cuda:
            triton_fn = getattr(kernels.load_triton_kernels(), name.split()[0])
            row["triton_ms"] = 1e3 * time_fn(triton_fn, args, device, rounds, min_time)
            row["speedup"] = row["reference_ms"] / row["triton_ms"]
        rows.append(row)
    note = "" if cuda else "no CUDA device here: the Triton kernels need a GPU to be timed (references only)"
    return rows, note


# -- stream -------------------------------------------------------------------------------------------------------------
def psnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (10 * torch.log10((ref.max() - ref.min()) ** 2 / (x - ref).pow(2).mean())).item()


def stream_quality(
    preset: str, size: tuple[int, int], chunk: int, window: int, chunks: int, keep: int
) -> list[dict]:
    model = load_dit(f"dummy:{preset}", dtype=torch.float32, device="cpu", seed=0)
    ctx = torch.randn(1, 32, model.params.text_dim, generator=torch.Generator().manual_seed(0))
    w, h = size
    videos, rows = {}, []
    for kv_dtype in ("bf16", "int8", "int4"):
        config = CausalConfig(chunk, window, 0, kv_dtype=kv_dtype, keep_recent_chunks=keep)
        session = VideoSession(model, ctx, h, w, config, seed=0)
        t0 = time.perf_counter()
        results = session.run(chunks)
        seconds = time.perf_counter() - t0
        videos[kv_dtype] = torch.cat([r.latents for r in results], dim=2)
        rows.append(
            {
                "kv_dtype": kv_dtype,
                "kv_bytes": session.cache.nbytes,
                "kv_bytes_allocated": sum(b.nbytes for b in session.cache.buffers()),
                "frames_quantized": session.cache.frames_quantized,
                "seconds": seconds,
            }
        )
    for row in rows:
        row["psnr_db"] = psnr(videos[row["kv_dtype"]], videos["bf16"]) if row["kv_dtype"] != "bf16" else None
        row["max_abs_diff"] = (videos[row["kv_dtype"]] - videos["bf16"]).abs().max().item()
        row["bytes_ratio"] = row["kv_bytes"] / rows[0]["kv_bytes"]
    return rows


# -- output -------------------------------------------------------------------------------------------------------------
def print_memory(per_token: list[dict], per_window: list[dict], tpf: int, formula_ok: bool) -> None:
    print(
        f"### KV bytes, Wan2.1 at 832x480 ({tpf} tokens per latent frame), window 21, chunk 3, bf16 compute\n"
    )
    print(
        "Per token (K and V, all layers): quantized storage = codes + float16 scale and zero point per (token, head).\n"
    )
    print(
        "| model | storage | bytes/token | bf16 bytes/token | ratio | goal | scales+zeros on top of codes |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in per_token:
        print(
            f"| {r['preset']} | {r['kv_dtype']} | {r['bytes_per_token']:,} | {r['bf16_bytes_per_token']:,} "
            f"| **{r['ratio']:.4f}x** | <= {r['goal_ratio']:.4f}x | {r['scale_overhead']:.2%} (goal <= 7%) |"
        )
    print(
        "\nPer 21-frame window: the current chunk and `keep_recent` completed chunks stay bf16, the other frames are "
        "quantized.\n"
    )
    print("| model | storage | keep_recent | bf16 frames | quantized frames | GB | bf16 GB | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in per_window:
        print(
            f"| {r['preset']} | {r['kv_dtype']} | {r['keep_recent_chunks']} | {r['full_precision_frames']} "
            f"| {r['quantized_frames']} | {r['bytes'] / GB:.2f} | {r['bf16_bytes'] / GB:.2f} | {r['ratio']:.3f}x |"
        )
    print(
        f"\nMeta-device sizes = formula = sum of `nbytes` of a real allocation (small cache, every storage): "
        f"{'yes' if formula_ok else 'NO'}."
    )


def print_kernels(rows: list[dict], note: str) -> None:
    print("\n### Kernels (Wan2.1-1.3B widths: dim 1536, 12 heads x 128)\n")
    if note:
        print(f"{note}.\n")
    cuda = "triton_ms" in rows[0]
    print("| kernel | shape | device, dtype | reference ms |" + (" Triton ms | speed-up |" if cuda else ""))
    print("|---|---|---|---|" + ("---|---|" if cuda else ""))
    for r in rows:
        extra = f" {r['triton_ms']:.3f} | {r['speedup']:.2f}x |" if cuda else ""
        print(
            f"| {r['kernel']} | {r['shape']} | {r['device']}, {r['dtype']} | {r['reference_ms']:.3f} |{extra}"
        )


def print_stream(
    rows: list[dict], preset: str, size, chunk: int, window: int, chunks: int, keep: int
) -> None:
    print(
        f"\n### Latents of a {chunks}-chunk stream, `dummy:{preset}` fp32, {size[0]}x{size[1]} px, chunk {chunk}, "
        f"window {window}, keep_recent {keep}, against kv_dtype bf16 (= the compute dtype, fp32 here)\n"
    )
    print("| kv_dtype | KV bytes (allocated) | ratio | frames quantized | PSNR dB | max abs diff | seconds |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ps = "-" if r["psnr_db"] is None else f"**{r['psnr_db']:.1f}**"
        print(
            f"| {r['kv_dtype']} | {r['kv_bytes']:,} ({r['kv_bytes_allocated']:,}) | {r['bytes_ratio']:.3f}x "
            f"| {r['frames_quantized']} | {ps} | {r['max_abs_diff']:.2e} | {r['seconds']:.1f} |"
        )


def summary(per_token, per_window, formula_ok, stream, preset) -> list[dict]:
    rows = []
    for r in per_token:
        if r["preset"] != "wan2.1-1.3b":
            continue
        rows.append(
            {
                "metric": f"KV bytes/token {r['kv_dtype']} / bf16 (Wan2.1-1.3B)",
                "value": f"{r['ratio']:.4f}x",
                "goal": f"<= {r['goal_ratio']:.4f}x ({'0.5' if r['kv_dtype'] == 'int8' else '0.25'}x + 7% scales)",
                "met": r["ratio"] <= r["goal_ratio"],
            }
        )
        rows.append(
            {
                "metric": f"scales + zero points on top of {r['kv_dtype']} codes (head_dim 128)",
                "value": f"{r['scale_overhead']:.2%}",
                "goal": "<= 7%",
                "met": r["scale_overhead"] <= GOAL_SCALES,
            }
        )
    for r in per_window:
        if r["preset"] == "wan2.1-1.3b" and r["keep_recent_chunks"] == 1:
            rows.append(
                {
                    "metric": f"KV window {r['kv_dtype']} / bf16 (1.3B, 480p, 21 frames, keep_recent 1)",
                    "value": f"{r['ratio']:.3f}x ({r['bytes'] / GB:.2f} / {r['bf16_bytes'] / GB:.2f} GB)",
                    "goal": None,
                    "met": None,
                }
            )
    rows.append(
        {
            "metric": "KV accounting = allocated bytes (meta sizes, formula, real buffers)",
            "value": "equal" if formula_ok else "differ",
            "goal": "equal",
            "met": formula_ok,
        }
    )
    for r in stream:
        if r["psnr_db"] is not None:
            rows.append(
                {
                    "metric": f"latent PSNR {r['kv_dtype']} vs unquantized KV ({preset} stream)",
                    "value": f"{r['psnr_db']:.1f} dB",
                    "goal": None,
                    "met": None,
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="wan-tiny stream, smaller kernel shapes (< 90 s)")
    ap.add_argument("--preset", default=None, help="stream model (default wan-mid; wan-tiny with --quick)")
    ap.add_argument(
        "--size", default=None, help="stream frame size WxH px (default 192x192; 48x32 with --quick)"
    )
    ap.add_argument("--chunks", type=int, default=6, help="stream length in chunks")
    ap.add_argument("--chunk", type=int, default=3, help="latent frames per chunk (stream)")
    ap.add_argument("--window", type=int, default=9, help="window in latent frames (stream)")
    ap.add_argument("--keep-recent", type=int, default=0, help="completed chunks kept unquantized (stream)")
    ap.add_argument("--kernel-tokens", type=int, default=None, help="query tokens of the kernel shapes")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per kernel")
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds per timed round")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = ap.parse_args()

    setup_threads(args.threads)
    env = header("KV-cache quantization: memory, kernels, stream quality")
    tpf = (480 // 16) * (832 // 16)
    per_token, per_window = memory_tables(tpf)
    formula_ok = formula_matches_allocation()
    print_memory(per_token, per_window, tpf, formula_ok)

    tokens = args.kernel_tokens or (3 * (160 if args.quick else 240))  # a 3-frame chunk (240: 320x192 px)
    rows, note = kernel_times(tokens, 3 * tokens, args.rounds if not args.quick else 3, args.min_time)
    print_kernels(rows, note)

    preset = args.preset or ("wan-tiny" if args.quick else "wan-mid")
    w, h = (int(v) for v in (args.size or ("48x32" if args.quick else "192x192")).split("x"))
    stream = stream_quality(preset, (w, h), args.chunk, args.window, args.chunks, args.keep_recent)
    print_stream(stream, preset, (w, h), args.chunk, args.window, args.chunks, args.keep_recent)

    save(
        "kv_quant",
        {
            "env": env,
            "summary": summary(per_token, per_window, formula_ok, stream, preset),
            "tokens_per_frame_480p": tpf,
            "per_token": per_token,
            "per_window": per_window,
            "formula_matches_allocation": formula_ok,
            "kernels": rows,
            "kernels_note": note,
            "stream": {
                "preset": preset,
                "size": [w, h],
                "chunk": args.chunk,
                "window": args.window,
                "chunks": args.chunks,
                "keep_recent": args.keep_recent,
                "rows": stream,
            },  # fmt: skip
        },
    )


if __name__ == "__main__":
    main()
