"""TAEHV decode with the frames contiguous (before) and channels-last like the weights (after), side by side.

    python bench/taehv_layout.py            # taew2_1 (real size, random weights): 3 latents at 832x480 -> 9 frames
    python bench/taehv_layout.py --quick    # 2 latents at 416x240, 3 repeats

Both run the weights channels-last, as ``engine/vae/tiny.py _finish`` loads them. "before" is the frame loop as it
was (``run_frames`` with contiguous frames and ``cat`` / ``reshape`` regrouping, kept here as the baseline),
"after" is ``engine/vae/taehv.py`` now. Medians of interleaved runs in one process; the max abs difference of the
two outputs is printed with them.
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import header, median, save, setup_threads

from fewstep.engine.vae import taehv
from fewstep.engine.vae.taehv import TAEHV, TAEHV_CONFIGS, MemBlock, TGrow, TPool


def before_run_frames(blocks, x, memory):
    batch = x.shape[0]
    h = x.flatten(0, 1)
    new_memory = []
    for block in blocks:
        if isinstance(block, MemBlock):
            frames = h.unflatten(0, (batch, -1))
            before = torch.zeros_like(frames[:, 0]) if memory is None else memory[len(new_memory)]
            previous = torch.cat((before.unsqueeze(1), frames[:, :-1]), 1).flatten(0, 1)
            new_memory.append(frames[:, -1].clone())
            h = block(h, previous)
        elif isinstance(block, TPool):
            _, channels, height, width = h.shape
            h = block.conv(h.reshape(-1, block.stride * channels, height, width))
        elif isinstance(block, TGrow):
            _, channels, height, width = h.shape
            h = block.conv(h).reshape(-1, channels, height, width)
        else:
            h = block(h)
    return h.unflatten(0, (batch, -1)), new_memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="taew2_1", choices=sorted(TAEHV_CONFIGS))
    ap.add_argument("--latents", type=int, default=3, help="latent frames (4n - 3 video frames)")
    ap.add_argument("--latent", default="60x104", help="latent height x width (832x480 px)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.latents, args.latent, args.repeats = 2, "30x52", 3
    threads = setup_threads(args.threads)
    env = header(f"TAEHV {args.variant} decode: contiguous frames (before) vs channels-last frames (after)")
    torch.manual_seed(0)
    model = TAEHV(TAEHV_CONFIGS[args.variant]).eval().to(memory_format=torch.channels_last)
    h, w = (int(v) for v in args.latent.lower().split("x"))
    latents = torch.randn(
        1, args.latents, model.latent_channels, h, w, generator=torch.Generator().manual_seed(1)
    )
    current = taehv.run_frames

    def decode(before: bool):
        taehv.run_frames = before_run_frames if before else current
        try:
            with torch.inference_mode():
                return model.decode_video(latents)
        finally:
            taehv.run_frames = current

    diff = (decode(True) - decode(False)).abs().max().item()
    times = {"before_s": [], "after_s": []}
    for _ in range(args.repeats):
        for name, before in (("before_s", True), ("after_s", False)):
            t0 = time.perf_counter()
            decode(before)
            times[name].append(time.perf_counter() - t0)
    row = {k: median(v) for k, v in times.items()}
    row.update(speedup=row["before_s"] / row["after_s"], max_abs_diff=diff, threads=threads,
               latents=list(latents.shape))  # fmt: skip
    print("| latents | before s | after s | speedup | max abs diff |\n|---|---|---|---|---|")
    print(f"| {list(latents.shape)} | {row['before_s']:.3f} | {row['after_s']:.3f} | {row['speedup']:.2f}x | "
          f"{diff:.1e} |")  # fmt: skip
    save("taehv_layout", {"env": env, "decode": row})


if __name__ == "__main__":
    main()
