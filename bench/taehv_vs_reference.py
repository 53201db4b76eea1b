"""Our TAEHV decode against madebyollin's taehv.py, same weights, same latents, timed side by side.

    python bench/taehv_vs_reference.py --reference DIR        # taew2_1, 3 latents 60x104 (832x480 px), 3 rounds
    python bench/taehv_vs_reference.py --quick                # 2 latents 30x52 (416x240 px), 3 rounds
    FEWSTEP_TAEHV_REF_DIR=DIR python bench/taehv_vs_reference.py --threads 1 --modes video

DIR (``--reference``, default the environment variable ``FEWSTEP_TAEHV_REF_DIR``) is a folder holding
madebyollin's ``taehv.py`` (https://github.com/madebyollin/taehv; the file alone, no weights: both sides get the
same seeded random weights). It is imported from there at run time; without it the script prints why and
skips.

Their ``TAEHV`` is built with ``checkpoint_path=None`` and the constructor arguments its ``__init__`` picks for
the variant's file name: for ``taew2_1.pth`` none of its name rules applies, so the defaults (16 latent channels,
patch 1, encoder time downscale (True, True, False), decoder time upscale (False, True, True)); ``taew2_2`` gets
patch 2 and 48 channels. Ours gets ``dummy_init_`` weights and is laid out channels-last as the pack loads it
(``tiny._finish``); theirs loads the same state dict strictly, no key renamed (our modules keep their layout:
``encoder.N.*``, ``decoder.N.conv.K.*``; their MemBlock's ``skip`` is an ``nn.Identity`` with no weights), and
stays as their code builds it (contiguous weights; ``--reference-channels-last`` converts them too).

Modes (``--modes``, comma-separated), each a pair of calls that return the same ``4T - 3`` frames (both drop the
first 3 decoder frames, the startup frames of the first latent, so frame ``i`` of one is frame ``i`` of the other):

* ``video``: our ``TAEHV.decode_video`` vs their ``decode_video(x, parallel=True)``, their default and what their
  README suggests for whole videos when memory allows (all frames through each block at once).
* ``sequential``: our ``TAEHVStreamDecoder``, one latent a push, vs their ``decode_video(x, parallel=False)``
  (one frame at a time through the whole stack, O(1) memory; their choice for large videos).
* ``streaming``: the same ours vs their ``StreamingTAEHV``, fed one latent at a time and drained frame by frame
  (their wrapper for live / world-model use). We have no frame-at-a-time decoder: one latent per push is our
  finest grain (``--chunk`` latents per push).

All fp32 on the CPU under ``inference_mode``. Per round one call of each side, the order alternating;
**ratio** = their time / our time per round, median (min-max) and best-of (min / min): above 1x ours is faster.
The max abs difference of the two outputs is printed beside it (same function: rounding only).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import torch
from _common import header, median, parse_args, peer_rows, save, setup_threads
from _common import timed as timed_call

from fewstep.engine.vae.taehv import TAEHV, TAEHV_CONFIGS, TAEHVStreamDecoder
from fewstep.engine.weights import dummy_init_

QUICK = {"latents": 2, "latent": "30x52", "rounds": 3}
ENV = "FEWSTEP_TAEHV_REF_DIR"
MODES = ("video", "sequential", "streaming")
MAX_DIFF = 1e-4  # fp32, the same function on both sides: anything larger is a real mismatch, not rounding
# their TAEHV.__init__ keyword arguments per variant, as its checkpoint-name rules set them
REFERENCE_KWARGS = {"taew2_1": {}, "taehv": {}, "taew2_2": {"patch_size": 2, "latent_channels": 48}}


def load_reference(folder: str | None):
    """madebyollin's taehv module from ``folder``, or (None, why)."""
    if not folder:
        return None, f"no reference folder: pass --reference DIR or set {ENV} to a folder holding taehv.py"
    path = Path(folder) / "taehv.py"
    if not path.is_file():
        return None, f"{path} does not exist (--reference / {ENV} must name a folder holding taehv.py)"
    spec = importlib.util.spec_from_file_location("taehv_reference", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:  # their file imports tqdm
        return None, f"{path} does not import: {exc}"
    return module, ""


def build_pair(ref_module, variant: str, seed: int, ref_channels_last: bool):
    ours = TAEHV(TAEHV_CONFIGS[variant]).eval()
    dummy_init_(ours, seed=seed)
    ours.to(memory_format=torch.channels_last).requires_grad_(False)
    ref = ref_module.TAEHV(checkpoint_path=None, **REFERENCE_KWARGS[variant]).eval().requires_grad_(False)
    ref.load_state_dict(ours.state_dict(), strict=True)
    if ref_channels_last:
        ref.to(memory_format=torch.channels_last)
    return ours, ref


def side_calls(mode: str, ours: TAEHV, ref, ref_module, latents: torch.Tensor, chunk: int):
    """(our call, their call), each returning the decoded frames [N, 4T - 3, 3, H, W]."""

    def ours_stream():
        stream = TAEHVStreamDecoder(ours)
        return torch.cat([stream.push(part) for part in latents.split(chunk, 1)], 1)

    def ref_streaming():
        streaming = ref_module.StreamingTAEHV(ref)
        frames = []
        for latent in latents.split(1, 1):
            frame = streaming.decode(latent)
            while frame is not None:
                frames.append(frame)
                frame = streaming.decode()
        return torch.cat(frames, 1)

    if mode == "video":
        return (lambda: ours.decode_video(latents)), (
            lambda: ref.decode_video(latents, parallel=True, show_progress_bar=False)
        )
    if mode == "sequential":
        return ours_stream, lambda: ref.decode_video(latents, parallel=False, show_progress_bar=False)
    return ours_stream, ref_streaming


def run_mode(mode: str, ours, ref, ref_module, latents, chunk: int, rounds: int) -> dict:
    call_ours, call_ref = side_calls(mode, ours, ref, ref_module, latents, chunk)
    with torch.inference_mode():
        got, want = call_ours(), call_ref()  # also the warm-up
        if got.shape != want.shape:
            raise SystemExit(f"{mode}: ours gives {list(got.shape)}, theirs {list(want.shape)}")
        diff = (got - want).abs().max().item()
        del got, want
        sides = {"ours": call_ours, "reference": call_ref}
        t = {k: [] for k in sides}
        for r in range(rounds):  # A/B, the order alternating: a drift in machine load hits both alike
            for k in list(sides) if r % 2 == 0 else reversed(list(sides)):
                t[k].append(timed_call(sides[k]))
    ratios = [theirs / mine for mine, theirs in zip(t["ours"], t["reference"])]
    return {
        "mode": mode,
        "ours_s": median(t["ours"]),
        "reference_s": median(t["reference"]),
        "ratio": median(ratios),
        "ratio_min_max": [min(ratios), max(ratios)],
        "ratio_best_of": min(t["reference"]) / min(t["ours"]),
        "max_abs_diff": diff,
        "rounds": rounds,
    }


OURS_CALL = {"video": "decode_video", "sequential": "stream push", "streaming": "stream push"}
REF_CALL = {
    "video": "decode_video(parallel=True)",
    "sequential": "decode_video(parallel=False)",
    "streaming": "StreamingTAEHV",
}


def print_results(rows: list[dict], chunk: int) -> None:
    print("fp32, CPU. Ratio = their time / our time per round (above 1x ours is faster), median (min-max);")
    print(
        f"best-of = min theirs / min ours. Same weights, same latents; stream push = {chunk} latent(s) a push.\n"
    )
    print("| mode | ours | theirs | ours s | theirs s | ratio (min-max) | best-of | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["ratio_min_max"]
        print(
            f"| {r['mode']} | {OURS_CALL[r['mode']]} | {REF_CALL[r['mode']]} | {r['ours_s']:.2f} "
            f"| {r['reference_s']:.2f} | **{r['ratio']:.2f}x** ({lo:.2f}-{hi:.2f}) | {r['ratio_best_of']:.2f}x "
            f"| {r['max_abs_diff']:.1e} |"
        )


def summary(rows: list[dict], what: str) -> list[dict]:
    out = []
    for r in rows:
        out += peer_rows(
            f"TAEHV decode, madebyollin's {REF_CALL[r['mode']]} time / ours, {what}",
            f"TAEHV decode ({r['mode']}), max abs diff ours vs madebyollin's (same weights), {what}",
            r, MAX_DIFF,
        )  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--reference", default=os.environ.get(ENV), help=f"folder holding taehv.py (default ${ENV})"
    )
    ap.add_argument("--variant", default="taew2_1", choices=sorted(REFERENCE_KWARGS))
    ap.add_argument("--latents", type=int, default=3, help="latent frames T (4T - 3 video frames)")
    ap.add_argument(
        "--latent", default="60x104", help="latent height x width (60x104 = 832x480 px for taew2_1)"
    )
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--chunk", type=int, default=1, help="latent frames per push of our stream decoder")
    ap.add_argument("--rounds", type=int, default=3, help="timed pairs per mode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reference-channels-last", action="store_true", help="their weights channels-last too")
    args = parse_args(ap, QUICK)
    modes = args.modes.split(",")
    if unknown := sorted(set(modes) - set(MODES)):
        raise SystemExit(f"unknown mode(s) {', '.join(unknown)}: of {', '.join(MODES)}")

    threads = setup_threads(args.threads)
    env = header("TAEHV decode, ours vs madebyollin's taehv.py (CPU)")
    ref_module, why = load_reference(args.reference)
    if ref_module is None:
        print(f"skipped: {why}")
        metric = "TAEHV decode vs madebyollin's taehv.py"
        save(
            "taehv_vs_reference",
            {"env": env, "skipped": why, "summary": [{"metric": metric, "value": f"skipped: {why}",
                                                     "goal": None, "met": None}]},
        )  # fmt: skip
        return
    print(f"reference: {Path(args.reference) / 'taehv.py'}\n")
    ours, ref = build_pair(ref_module, args.variant, args.seed, args.reference_channels_last)
    h, w = (int(v) for v in args.latent.lower().split("x"))
    gen = torch.Generator().manual_seed(args.seed + 1)
    latents = torch.randn(args.batch, args.latents, ours.latent_channels, h, w, generator=gen)
    scale = ours.spatial_scale
    what = f"{args.variant} {args.latents} latents {w * scale}x{h * scale} px, {threads} threads"
    print(
        f"{args.variant}: latents {list(latents.shape)} -> {4 * args.latents - 3} frames of {w * scale}x{h * scale}"
        f" px; our weights channels-last, theirs {'channels-last' if args.reference_channels_last else 'contiguous'}"
        f"; {args.rounds} rounds\n"
    )
    rows = []
    for mode in modes:
        rows.append(run_mode(mode, ours, ref, ref_module, latents, args.chunk, args.rounds))
        print(f"  {mode}: done", file=sys.stderr)
    print_results(rows, args.chunk)
    save(
        "taehv_vs_reference",
        {
            "env": env,
            "quick": args.quick,
            "variant": args.variant,
            "latents": list(latents.shape),
            "chunk": args.chunk,
            "reference_channels_last": args.reference_channels_last,
            "results": rows,
            "summary": summary(rows, what),
        },
    )


if __name__ == "__main__":
    main()
