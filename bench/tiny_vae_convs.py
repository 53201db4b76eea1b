"""Tiny-VAE convolutions: where the tiny decoders' time goes, and GFLOP/s beside the full FLUX.1 autoencoder's.

    python bench/tiny_vae_convs.py                          # 512 and 1024 px, 3 rounds, the threads of this machine
    python bench/tiny_vae_convs.py --sizes 1024x1024 --threads 1 --rounds 5

Per size, on the same random latent (fp32, dummy weights): TAEF1 and TAEF2 decodes as they run now
(``engine.vae.fused_conv``: each ReLU in place, each residual add inside its convolution as a oneDNN post-op)
against the same decoders running the code before (a new tensor for every convolution, ReLU and add),
interleaved, and one FLUX.1 AE decode per round. **ratio** = before / now per round, median (min-max); *diff* = max abs difference
of the two outputs (bit for bit: 0). GFLOP/s = the decoder's FLOPs (convolutions and attention matmuls,
``FlopCounterMode`` on the meta device) / its median time. Then one profiled decode of each side: the share of
self CPU time in convolutions against the elementwise passes (ReLU, add, upsample), which is what the fusion removes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import header, parse_args, parse_px, save, setup_threads, summary_row, timed  # noqa: E402
from vae_decode import decode_gflop  # noqa: E402

from fewstep.engine.latent_formats import FLUX1  # noqa: E402
from fewstep.engine.vae import fused_conv, load_tiny_vae, taesd  # noqa: E402
from fewstep.engine.vae.flux_ae import load_flux_ae  # noqa: E402

QUICK = {"sizes": "256x256", "rounds": 1}
CONV_OPS = ("convolution_pointwise", "mkldnn_convolution")
ELEMENTWISE_OPS = ("clamp_min", "clamp_min_", "relu", "relu_", "add", "add_", "upsample_nearest2d")


def _before_relu(conv, x):
    return torch.relu(conv(x))


def _before_add_relu(conv, x, residual):
    return torch.relu(conv(x) + residual)


@contextmanager
def fusion(on: bool):
    """``on``: the blocks as they run now; off: the code before (a new tensor for the convolution, for the ReLU and
    for the add: ``nn.ReLU()`` and ``self.fuse(self.conv(x) + self.skip(x))``)."""
    saved = taesd.conv_relu, taesd.conv_add_relu
    if not on:
        taesd.conv_relu, taesd.conv_add_relu = _before_relu, _before_add_relu
    try:
        yield
    finally:
        taesd.conv_relu, taesd.conv_add_relu = saved


def timed_decode(vae, latent: torch.Tensor, fused: bool) -> tuple[float, torch.Tensor]:
    out = []
    with fusion(fused):
        return timed(lambda: out.append(vae.decode(latent))), out[0]


def profile_split(vae, latent: torch.Tensor) -> dict:
    """Self CPU seconds of one decode in convolutions, in elementwise passes, and in all."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        vae.decode(latent)
    conv = elementwise = total = 0.0
    for event in prof.key_averages():
        s = event.self_cpu_time_total / 1e6
        total += s
        if any(name in event.key for name in CONV_OPS):
            conv += s
        elif any(event.key.endswith(name) for name in ELEMENTWISE_OPS):
            elementwise += s
    return {"conv_s": conv, "elementwise_s": elementwise, "total_s": total}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="512x512,1024x1024")
    ap.add_argument("--rounds", type=int, default=3)
    args = parse_args(ap, QUICK)
    setup_threads(args.threads)
    env = header(
        "tiny-VAE convolutions: now (in-place ReLU, fused add) vs before, GFLOP/s beside the FLUX.1 AE"
    )
    if not fused_conv.fused_available():
        print("the fused oneDNN convolution is not available in this PyTorch: nothing to compare")
        return 0
    ae = load_flux_ae("dummy:flux1-ae", dtype=torch.float32, device="cpu")
    tiny = {v: load_tiny_vae(f"dummy:{v}", device="cpu", dtype=torch.float32) for v in ("taef1", "taef2")}
    rows, splits = [], []
    for size in args.sizes.split(","):
        w, h = parse_px(size)
        gen = torch.Generator().manual_seed(0)
        raw = torch.randn(1, 16, h // 8, w // 8, generator=gen)
        latents = {"taef1": FLUX1.process_in(raw), "taef2": torch.randn(1, 32, h // 8, w // 8, generator=gen)}
        gflop = {v: decode_gflop(tiny[v].decoder, tuple(latents[v].shape)) for v in tiny}
        gflop["ae"] = decode_gflop(ae.decoder, tuple(raw.shape))
        times = {(v, on): [] for v in tiny for on in (True, False)}
        times["ae"] = []
        diff = dict.fromkeys(tiny, 0.0)
        for v in tiny:  # warm-up: oneDNN primitives
            for on in (True, False):
                with fusion(on):
                    tiny[v].decode(latents[v])
        ae.decode(raw)
        for r in range(args.rounds):
            for v in tiny:
                outs = {}
                for on in (True, False) if r % 2 == 0 else (False, True):
                    seconds, outs[on] = timed_decode(tiny[v], latents[v], on)
                    times[(v, on)].append(seconds)
                diff[v] = max(diff[v], (outs[True] - outs[False]).abs().max().item())
            times["ae"].append(timed_decode(ae, raw, True)[0])
        ae_s = statistics.median(times["ae"])
        for v in tiny:
            fused_s, plain_s = statistics.median(times[(v, True)]), statistics.median(times[(v, False)])
            ratios = [p / f for p, f in zip(times[(v, False)], times[(v, True)])]
            rows.append({"size": size, "variant": v, "fused_s": fused_s, "plain_s": plain_s,
                         "ratio": statistics.median(ratios), "ratio_min_max": [min(ratios), max(ratios)],
                         "max_abs_diff": diff[v], "gflop": gflop[v], "fused_gflops": gflop[v] / fused_s,
                         "plain_gflops": gflop[v] / plain_s, "ae_s": ae_s, "ae_gflop": gflop["ae"],
                         "ae_gflops": gflop["ae"] / ae_s})  # fmt: skip
            for on in (True, False):
                with fusion(on):
                    split = profile_split(tiny[v], latents[v])
                splits.append({"size": size, "variant": v, "fused": on, **split})
    print("| image | decoder | now s | before s | before / now (min-max) | diff | GFLOP | GFLOP/s now | "
          "GFLOP/s before | FLUX.1 AE GFLOP/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["ratio_min_max"]
        print(
            f"| {r['size']} | {r['variant']} | {r['fused_s']:.3f} | {r['plain_s']:.3f} | **{r['ratio']:.2f}x** "
            f"({lo:.2f}-{hi:.2f}) | {r['max_abs_diff']:.1e} | {r['gflop']:.0f} | {r['fused_gflops']:.0f} | "
            f"{r['plain_gflops']:.0f} | {r['ae_gflops']:.0f} |"
        )
    print("\nOne profiled decode, self CPU time:\n")
    print("| image | decoder | code | convolutions s | elementwise s (ReLU, add, upsample) | all ops s |")
    print("|---|---|---|---|---|---|")
    for s in splits:
        print(
            f"| {s['size']} | {s['variant']} | {'now' if s['fused'] else 'before'} | {s['conv_s']:.3f} | "
            f"{s['elementwise_s']:.3f} | {s['total_s']:.3f} |"
        )
    summary = [
        summary_row(
            f"tiny VAE {r['variant']} {r['size']}: before / now decode time (GFLOP/s now {r['fused_gflops']:.0f}, "
            f"FLUX.1 AE {r['ae_gflops']:.0f})",
            f"{r['ratio']:.2f}x",
        )
        for r in rows
    ] + [
        summary_row(
            "tiny VAE convolutions: max abs diff, now against before",
            f"{max(r['max_abs_diff'] for r in rows):.1e}",
            "0",
            all(r["max_abs_diff"] == 0 for r in rows),
        )
    ]
    save("tiny_vae_convs", {"environment": env, "rows": rows, "profile": splits, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
