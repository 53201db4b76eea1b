"""VAE decode speed on CPU: the tiny FLUX.1 decoder (TAEF1) against the full FLUX.1 autoencoder, same run.

    python bench/vae_decode.py                                  # 512x512 and 1024x1024, 3 rounds each
    python bench/vae_decode.py --sizes 512x512 --rounds 5 --no-video
    python bench/vae_decode.py --quick                          # 512x512, 2 rounds, no video part (< 90 s)

Both decoders get dummy weights (``dummy:taef1`` and ``dummy:flux1-ae``) and decode the same random raw
FLUX.1 latent ``[1, 16, H/8, W/8]`` (TAEF1 after the FLUX.1 latent normalisation, since it works in the
diffusion model's space), fp32. Each round times one full-AE decode and, right before it, the tiny decode
(repeated to last at least ``--min-time`` seconds); speed-up = full time / tiny time per round, median over
rounds. Goal: tiny >= 20x faster.

FLUX.2 (``--no-flux2`` skips it): the tiny FLUX.2 decoder (TAEF2) on a FLUX.2 LATENT ``[1, 128, H/16, W/16]``
(un-patchified to its 32 channels at 1/8 first, as the node does) against the FLUX.2 autoencoder's decoder
architecture (the FLUX.1 decoder with 32 latent channels behind a 1x1 post-quant conv, as the planner counts it;
random weights, no batch-norm undo timed: it is elementwise), and the cost of the un-patchify itself (the
128-channel path against decoding the 32-channel latent directly).

Video (when ``fewstep.engine.vae`` has TAEHV): frames per second of the tiny Wan 2.1 decoder (``taew2_1``)
on a 480p chunk, latent ``[1, 16, 3, 60, 104]`` (832x480 px): one ``decode`` of the chunk alone (9 frames:
the first latent stands for one frame) and a streaming ``push`` of a chunk that follows another (12 frames).
"""

from __future__ import annotations

import argparse
import copy
import math

import torch
from _common import header, median, parse_args, parse_px, save, setup_threads, timed
from torch.utils.flop_counter import FlopCounterMode

from fewstep.engine.latent_formats import FLUX1
from fewstep.engine.vae.flux_ae import load_flux_ae

TARGET_SPEEDUP = 20.0
VIDEO_LATENT = (1, 16, 3, 60, 104)  # [N, C, T, h, w]: 3 latent frames of 832x480 px
# --quick defaults: the TAEHV part is left out (a 480p chunk takes tens of seconds on 2 cores, and frames per
# second are absolute numbers, which the suite table does not show for a CPU)
QUICK = {"sizes": "512x512", "rounds": 2, "min_time": 0.3, "no_video": True, "no_flux2": True}


def load_tiny(variant: str):
    """``load_tiny_vae("dummy:<variant>")``, or None with the reason when the engine does not have it yet."""
    try:
        from fewstep.engine.vae import load_tiny_vae
    except ImportError as exc:
        return None, f"fewstep.engine.vae.load_tiny_vae is not available ({exc})"
    return load_tiny_vae(f"dummy:{variant}", device="cpu", dtype=torch.float32), None


def repeated(fn, min_s: float):
    """``fn`` repeated so that one timing lasts at least ``min_s``; returns (callable, repeats)."""
    inner = max(1, math.ceil(min_s / timed(fn)))
    return (lambda: [fn() for _ in range(inner)]), inner


def decode_gflop(decoder: torch.nn.Module, latent_shape) -> float:
    """FLOPs of one decoder call (convolutions and attention matmuls), counted on the meta device: no compute."""
    meta = copy.deepcopy(decoder).to("meta")
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        meta(torch.empty(latent_shape, device="meta"))
    return counter.get_total_flops() / 1e9


def image_decode(full, tiny, size: str, rounds: int, warmup: int, min_s: float) -> dict:
    w, h = parse_px(size)
    full_gflop = decode_gflop(full.decoder, (1, 16, h // 8, w // 8))
    tiny_gflop = decode_gflop(tiny.decoder, (1, 16, h // 8, w // 8))
    raw = torch.randn(1, 16, h // 8, w // 8, generator=torch.Generator().manual_seed(0))
    tiny_latent = FLUX1.process_in(raw)

    def full_decode():
        return full.decode(raw)

    def tiny_decode():
        return tiny.decode(tiny_latent)

    shapes_match = full_decode().shape == tiny_decode().shape  # also the first warm-up
    for _ in range(warmup - 1):
        full_decode(), tiny_decode()
    tiny_timed, inner = repeated(tiny_decode, min_s)
    t_tiny, t_full = [], []
    for _ in range(rounds):  # interleaved: load on the machine hits both sides alike
        t_tiny.append(timed(tiny_timed) / inner)
        t_full.append(timed(full_decode))
    ratios = [f / t for f, t in zip(t_full, t_tiny)]
    return {
        "size": size,
        "latent": [1, 16, h // 8, w // 8],
        "same_output_shape": shapes_match,
        "rounds": rounds,
        "tiny_repeats_per_timing": inner,
        "tiny_ms": median(t_tiny) * 1e3,
        "tiny_ms_min_max": [min(t_tiny) * 1e3, max(t_tiny) * 1e3],
        "full_ms": median(t_full) * 1e3,
        "full_ms_min_max": [min(t_full) * 1e3, max(t_full) * 1e3],
        "speedup": median(ratios),
        "speedup_min_max": [min(ratios), max(ratios)],
        "speedup_best_of": min(t_full) / min(t_tiny),
        "tiny_gflop": tiny_gflop,
        "full_gflop": full_gflop,
        "flop_ratio": full_gflop / tiny_gflop,
        "tiny_gflops": tiny_gflop / median(t_tiny),
        "full_gflops": full_gflop / median(t_full),
    }


def flux2_full_decoder() -> torch.nn.Module:
    """The FLUX.2 autoencoder's decoder shape (diffusers ``AutoencoderKLFlux2``): the FLUX.1 decoder with 32
    latent channels, behind a 1x1 post-quant conv; seeded random weights."""
    import dataclasses

    from fewstep.engine.vae.flux_ae import AE_PRESETS, Decoder
    from fewstep.engine.weights import dummy_init_

    decoder = torch.nn.Sequential(
        torch.nn.Conv2d(32, 32, 1), Decoder(dataclasses.replace(AE_PRESETS["flux1-ae"], z_channels=32))
    )
    dummy_init_(decoder, 0)
    return decoder.eval().requires_grad_(False)


def flux2_decode(full2, tiny2, size: str, rounds: int, warmup: int, min_s: float) -> dict:
    w, h = parse_px(size)
    raw = torch.randn(1, 128, h // 16, w // 16, generator=torch.Generator().manual_seed(0))
    z = tiny2.raw_to_latent(raw)  # [1, 32, H/8, W/8]

    def tiny_raw():
        return tiny2.decode_raw(raw)

    def tiny_direct():
        return tiny2.decode(z)

    @torch.inference_mode()
    def full_decode():
        return full2(z)

    exact = bool(torch.equal(tiny_raw(), tiny_direct()))  # also the first warm-up
    shapes_match = full_decode().shape == tiny_raw().shape
    for _ in range(warmup - 1):
        full_decode(), tiny_raw(), tiny_direct()
    raw_timed, inner = repeated(tiny_raw, min_s)
    direct_timed, _ = repeated(tiny_direct, min_s)
    t_raw, t_direct, t_full = [], [], []
    for _ in range(rounds):
        t_raw.append(timed(raw_timed) / inner)
        t_direct.append(timed(direct_timed) / inner)
        t_full.append(timed(full_decode))
    tiny_gflop = decode_gflop(tiny2.decoder, tuple(z.shape))
    full_gflop = decode_gflop(full2, tuple(z.shape))
    ratios = [f / t for f, t in zip(t_full, t_raw)]
    return {
        "size": size,
        "latent": list(raw.shape),
        "taef2_latent": list(z.shape),
        "same_output_shape": shapes_match,
        "raw_path_equals_direct": exact,
        "rounds": rounds,
        "tiny_ms": median(t_raw) * 1e3,
        "tiny_direct_ms": median(t_direct) * 1e3,
        "full_ms": median(t_full) * 1e3,
        "speedup": median(ratios),
        "speedup_min_max": [min(ratios), max(ratios)],
        "tiny_gflop": tiny_gflop,
        "full_gflop": full_gflop,
        "flop_ratio": full_gflop / tiny_gflop,
    }


def print_flux2(rows: list[dict]) -> None:
    print(
        "\nFLUX.2: TAEF2 on the 128-channel LATENT (un-patchify + decode) vs the FLUX.2 AE decoder, fp32:\n"
    )
    print("| image | LATENT | TAEF2 ms | TAEF2 on the 32-ch latent ms | FLUX.2 AE ms | speed-up (min-max) "
          "| FLOP ratio | 128-ch path == 32-ch path |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["speedup_min_max"]
        print(
            f"| {r['size']} | {'x'.join(map(str, r['latent'][1:]))} | {r['tiny_ms']:.1f} | {r['tiny_direct_ms']:.1f} "
            f"| {r['full_ms']:.0f} | **{r['speedup']:.1f}x** ({lo:.1f}-{hi:.1f}) | {r['flop_ratio']:.1f}x "
            f"| {r['raw_path_equals_direct']} |"
        )


def video_decode(rounds: int, min_s: float) -> dict:
    try:
        from fewstep.engine.vae import taehv  # noqa: F401 - only its presence is checked here
    except ImportError as exc:
        return {"skipped": f"fewstep.engine.vae.taehv is not available ({exc})"}
    vae, why = load_tiny("taew2_1")
    if vae is None:
        return {"skipped": why}
    gen = torch.Generator().manual_seed(0)
    first, following = (torch.randn(VIDEO_LATENT, generator=gen) for _ in range(2))

    def whole_chunk():
        return vae.decode(first)

    def stream_push():
        stream = vae.stream_decoder()
        stream.push(first)
        return stream

    # The push of the following chunk is what a realtime stream pays per chunk; time it alone.
    def timed_following_push():
        stream = stream_push()
        return timed(lambda: stream.push(following)), stream.frames_decoded

    frames_whole = whole_chunk().shape[1]  # frames [N, T, 3, H, W]; also the warm-up
    whole_fn, inner = repeated(whole_chunk, min_s)
    t_whole, t_push, pushed_frames = [], [], 0
    for _ in range(rounds):
        t_whole.append(timed(whole_fn) / inner)
        t, total = timed_following_push()
        t_push.append(t)
        pushed_frames = total - frames_whole
    return {
        "variant": "taew2_1",
        "latent_ncthw": list(VIDEO_LATENT),
        "pixels": f"{VIDEO_LATENT[4] * 8}x{VIDEO_LATENT[3] * 8}",
        "rounds": rounds,
        "chunk_frames": frames_whole,
        "chunk_ms": median(t_whole) * 1e3,
        "chunk_fps": frames_whole / median(t_whole),
        "chunk_fps_best_of": frames_whole / min(t_whole),
        "push_frames": pushed_frames,
        "push_ms": median(t_push) * 1e3,
        "push_fps": pushed_frames / median(t_push),
        "push_fps_best_of": pushed_frames / min(t_push),
    }


def print_results(rows: list[dict], video: dict | None) -> None:
    print("fp32, dummy weights. Times: median over rounds (min-max); speed-up: median of per-round ratios")
    print(f"full / tiny, best-of = min full / min tiny. Goal: tiny >= {TARGET_SPEEDUP:.0f}x faster.\n")
    print("| image | latent | TAEF1 decode ms | FLUX.1 AE decode ms | speed-up (min-max) | best-of | goal |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["speedup_min_max"]
        t0, t1 = r["tiny_ms_min_max"]
        f0, f1 = r["full_ms_min_max"]
        ok = "met" if r["speedup"] >= TARGET_SPEEDUP else "NOT met"
        print(
            f"| {r['size']} | {'x'.join(map(str, r['latent'][1:]))} | {r['tiny_ms']:.1f} ({t0:.1f}-{t1:.1f}) "
            f"| {r['full_ms']:.0f} ({f0:.0f}-{f1:.0f}) | **{r['speedup']:.1f}x** ({lo:.1f}-{hi:.1f}) "
            f"| {r['speedup_best_of']:.1f}x | {ok} |"
        )
    print("\nFLOPs per decode (convolutions + attention matmuls, FlopCounterMode on the meta device); the")
    print(
        "speed-up can only pass the FLOP ratio if the tiny decoder runs at more GFLOP/s than the full one.\n"
    )
    print("| image | TAEF1 GFLOP | FLUX.1 AE GFLOP | FLOP ratio | TAEF1 GFLOP/s | FLUX.1 AE GFLOP/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['size']} | {r['tiny_gflop']:.0f} | {r['full_gflop']:.0f} | {r['flop_ratio']:.1f}x "
            f"| {r['tiny_gflops']:.0f} | {r['full_gflops']:.0f} |"
        )
    if video is None:
        return
    print()
    if "skipped" in video:
        print(f"TAEHV video decode skipped: {video['skipped']}")
        return
    print(
        f"TAEHV `{video['variant']}` video decode, latent [N, C, T, h, w] = {video['latent_ncthw']} "
        f"({video['pixels']} px), median over {video['rounds']} rounds:\n"
    )
    print("| call | frames out | ms | frames/s | frames/s best-of |")
    print("|---|---|---|---|---|")
    print(
        f"| `decode` (chunk alone) | {video['chunk_frames']} | {video['chunk_ms']:.0f} "
        f"| {video['chunk_fps']:.1f} | {video['chunk_fps_best_of']:.1f} |"
    )
    print(
        f"| stream `push` (a following chunk) | {video['push_frames']} | {video['push_ms']:.0f} "
        f"| {video['push_fps']:.1f} | {video['push_fps_best_of']:.1f} |"
    )


def summary(rows: list[dict], video: dict | None) -> list[dict]:
    """Rows for the suite table (bench/run_all): speed-ups measured side by side; frames per second are
    absolute numbers of this CPU, so they stay out of it."""
    out = [
        {
            "metric": f"tiny (TAEF1) vs full FLUX.1 AE decode speed-up, {r['size']}",
            "value": f"{r['speedup']:.1f}x (best-of {r['speedup_best_of']:.1f}x, FLOP ratio {r['flop_ratio']:.0f}x)",
            "goal": f">= {TARGET_SPEEDUP:.0f}x",
            "met": r["speedup"] >= TARGET_SPEEDUP,
        }
        for r in rows
    ]
    if video and "skipped" not in video:
        per_frame = (video["chunk_ms"] / video["chunk_frames"]) / (video["push_ms"] / video["push_frames"])
        out.append(
            {
                "metric": "TAEHV (taew2_1) 480p: time per frame of a whole-chunk decode / of a stream push",
                "value": f"{per_frame:.2f}x",
                "goal": None,
                "met": None,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="512x512,1024x1024", help="image sizes in px, WxH, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="timed tiny/full pairs per size")
    ap.add_argument("--warmup", type=int, default=1, help="untimed decodes per side before timing (>= 1)")
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds per tiny timing (inner repeats)")
    ap.add_argument("--video-rounds", type=int, default=3)
    ap.add_argument("--no-video", action="store_true", help="skip the TAEHV frames-per-second part")
    ap.add_argument("--no-flux2", action="store_true", help="skip the TAEF2 / FLUX.2 AE part")
    args = parse_args(ap, QUICK)

    setup_threads(args.threads)
    env = header("VAE decode: TAEF1 vs full FLUX.1 AE (CPU)")
    full = load_flux_ae("dummy:flux1-ae", dtype=torch.float32, device="cpu")
    tiny, why = load_tiny("taef1")
    rows = []
    if tiny is None:
        print(f"image decode skipped: {why}")
    else:
        rows = [
            image_decode(full, tiny, s, args.rounds, max(1, args.warmup), args.min_time)
            for s in args.sizes.split(",")
        ]
    flux2 = []
    if not args.no_flux2:
        tiny2, why = load_tiny("taef2")
        if tiny2 is None:
            print(f"FLUX.2 decode skipped: {why}")
        else:
            full2 = flux2_full_decoder()
            flux2 = [
                flux2_decode(full2, tiny2, s, args.rounds, max(1, args.warmup), args.min_time)
                for s in args.sizes.split(",")
            ]
    video = None if args.no_video else video_decode(args.video_rounds, args.min_time)
    print_results(rows, video)
    if flux2:
        print_flux2(flux2)
    save(
        "vae_decode",
        {
            "env": env,
            "quick": args.quick,
            "target_speedup": TARGET_SPEEDUP,
            "image": rows,
            "flux2": flux2,
            "video": video,
            "summary": summary(rows, video),
        },
    )


if __name__ == "__main__":
    main()
