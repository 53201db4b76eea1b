"""Wan RoPE: the float64 stack/flatten rotation it replaced against the float32 one, and a Wan forward with each.

    python bench/rope.py                 # rotation at 1 and 2 threads, wan-mid forward on one 832x480 latent frame
    python bench/rope.py --quick         # fewer repeats, wan-tiny forward (< 30 s)
    python bench/rope.py --preset wan2.1-1.3b --layers 2   # Wan-1.3B's width (12 heads x 128), 2 of its blocks

Rotation: ``kernels.rope.apply_rope`` on Wan-1.3B's per-layer keys ``[1, L, 12, 128]`` float32 (L = 2304 and 1560,
one 832x480 latent frame), "before" = float64 tables and the unflatten -> stack -> flatten formulation (what the
engine ran until this change, kept here as the baseline), "after" = float32 tables and the current reference
(one complex multiply, ``kernels/rope.py``). Tables are built outside the timed region, as the engine builds them
once per forward / chunk. Medians of ``--repeats`` runs each, interleaved, in one process.

Forward: a Wan preset (random weights) on one latent frame, once with the old tables + rotation patched in, once
as it is now; medians, interleaved, and the max abs difference of the two outputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from _common import header, median, save, setup_threads

from fewstep.engine.models import wan as wan_module
from fewstep.engine.models.wan import PRESETS, Wan
from fewstep.engine.rope import rope_freqs
from fewstep.kernels import rope

current_apply_rope = rope.apply_rope


def before_apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation as it was: in the tables' dtype, two halves stacked and flattened back."""
    xf = x.to(cos.dtype).unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    return torch.stack((cos * x0 - sin * x1, sin * x0 + cos * x1), dim=-1).flatten(-2).to(x.dtype)


def before_rope_freqs(ids, axes_dim, theta, dtype=torch.float32, angle_dtype=None):
    """The tables as they were for Wan: float64 angles and float64 tables."""
    return rope_freqs(ids, axes_dim, theta, dtype=torch.float64)


def interleaved_medians(fns: dict, repeats: int) -> dict:
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: median(ts) for name, ts in times.items()}


def bench_rotation(threads: int, tokens: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, 12, 128, generator=g)
    angles = 100 * torch.rand(1, tokens, 1, 64, generator=g, dtype=torch.float64)
    cos64, sin64 = angles.cos(), angles.sin()
    cos32, sin32 = cos64.float(), sin64.float()
    t = interleaved_medians(
        {
            "before_ms": lambda: before_apply_rope(x, cos64, sin64),
            "after_ms": lambda: current_apply_rope(x, cos32, sin32),
        },
        repeats,
    )
    row = {k: v * 1e3 for k, v in t.items()}
    row.update(threads=threads, shape=[1, tokens, 12, 128], speedup=row["before_ms"] / row["after_ms"])
    print(
        f"| {threads} | [1, {tokens}, 12, 128] | {row['before_ms']:.2f} | {row['after_ms']:.2f} | "
        f"{row['speedup']:.1f}x |"
    )
    return row


def bench_forward(
    preset: str, layers: int | None, threads: int, repeats: int, latent_hw: tuple[int, int]
) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    params = PRESETS[preset] if layers is None else dataclasses.replace(PRESETS[preset], num_layers=layers)
    model = Wan(params).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 1, *latent_hw, generator=g)
    ctx = torch.randn(1, 32, 4096, generator=g)
    t = torch.tensor([500.0])

    def run(before: bool):
        saved = wan_module.rope_freqs, rope.apply_rope
        if before:
            wan_module.rope_freqs, rope.apply_rope = before_rope_freqs, before_apply_rope
        try:
            with torch.inference_mode():
                return model(x, t, ctx)
        finally:
            wan_module.rope_freqs, rope.apply_rope = saved

    diff = (run(True) - run(False)).abs().max().item()
    times = interleaved_medians({"before_s": lambda: run(True), "after_s": lambda: run(False)}, repeats)
    tokens = latent_hw[0] * latent_hw[1] // 4
    row = dict(
        times, preset=preset, layers=params.num_layers, threads=threads, tokens=tokens, max_abs_diff=diff
    )
    row["speedup"] = row["before_s"] / row["after_s"]
    print(
        f"| {preset} | {params.num_layers} | {threads} | {tokens} | {row['before_s'] * 1e3:.0f} | {row['after_s'] * 1e3:.0f} | "
        f"{row['speedup']:.3f}x | {diff:.1e} |"
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--forward-repeats", type=int, default=7)
    ap.add_argument("--preset", default="wan-mid", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="blocks of the forward (default: the preset's)")
    ap.add_argument("--latent", default="60x104", help="latent height x width of the one frame (832x480 px)")
    ap.add_argument("--threads", type=int, default=None, help="threads of the forward (default: all cores)")
    ap.add_argument("--quick", action="store_true", help="5 / 3 repeats and wan-tiny")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.forward_repeats, args.preset = 5, 3, "wan-tiny"
    threads = setup_threads(args.threads)
    env = header("Wan RoPE: float64 stack/flatten rotation (before) vs float32 complex rotation (after)")
    print("| threads | keys | before ms | after ms | speedup |\n|---|---|---|---|---|")
    rotation = [bench_rotation(n, tokens, args.repeats) for n in (1, 2) for tokens in (2304, 1560)]
    print(
        "\n| preset | layers | threads | tokens | before ms | after ms | speedup | max abs diff |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    latent_hw = tuple(int(v) for v in args.latent.lower().split("x"))
    forward = bench_forward(args.preset, args.layers, threads, args.forward_repeats, latent_hw)
    save("rope", {"env": env, "rotation": rotation, "forward": forward})


if __name__ == "__main__":
    main()
