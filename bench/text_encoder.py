#!/usr/bin/env python3
"""Encoding a prompt vs a prompt-cache hit, per family: the fixed cost the prompt-embedding cache removes.

    python bench/text_encoder.py                          # tiny random encoders of each family (tests' builders)
    python bench/text_encoder.py --model flux.1-schnell --text-encoder ~/models/FLUX.1-schnell   # a real download

For each family: the encoder's load time, one prompt's encoding (median of --rounds distinct prompts, after a
warm-up), a cache hit (``PromptEmbeddingCache.embed`` of a prompt already encoded: a dictionary lookup returning
the kept CPU tensors), and their ratio; beside them one DiT forward of the family's tiny preset at 256x256 (what a
few-step image costs per step), so the encoding's share of a 4-step image can be read. The tiny encoders keep the
official widths but 2-3 layers (28 for klein, whose stacked layers go to 27): their encoding cost is not a real
encoder's; run with --text-encoder for that. No timing is asserted anywhere: the ratios are measured here, side by
side, in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import dit_inputs, header, median, parse_args, save, setup_threads, summary_row

from fewstep.engine import load_dit
from fewstep.engine.prompt_embeddings import PromptEmbeddingCache
from fewstep.engine.text_encoders import open_text_encoder

QUICK = {"rounds": 3}
TINY = {"flux": "flux-tiny", "flux2": "flux2-tiny", "zimage": "zimage-tiny", "wan": "wan-tiny"}
PROMPTS = [
    "a red fox running through snow at dawn",
    "portrait of an old man sitting on a bench , city street at night",
    "golden hour photo of a quiet lake with mountains in the background",
    "oil painting of a cat in autumn leaves",
    "neon lights and rain reflections on a city street",
    "watercolor sketch of a forest path",
]


def tiny_folders(root: str) -> dict[str, str]:
    """The tests' tiny random encoders (tests/tiny_text_encoders.py), written once into ``root``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import tiny_text_encoders as tiny

    presets = tiny.presets()
    return {
        "flux": tiny.write_flux1_folder(os.path.join(root, "flux"), presets["flux-tiny"][1]),
        "flux2": tiny.write_klein_folder(os.path.join(root, "flux2"), presets["flux2-tiny"][1]),
        "zimage": tiny.write_zimage_folder(os.path.join(root, "zimage"), presets["zimage-tiny"][1]),
        "wan": tiny.write_wan_folder(os.path.join(root, "wan"), presets["wan-tiny"][1]),
    }


def dit_forward_seconds(preset: str, rounds: int) -> float | None:
    """One forward of an image preset at 256x256 with 64 text tokens (None for Wan, a video model)."""
    if preset.startswith("wan"):
        return None
    model = load_dit(f"dummy:{preset}", dtype=torch.float32)
    inputs = dit_inputs(model, 256, 256, 64)
    with torch.no_grad():
        model(**inputs)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            model(**inputs)
            times.append(time.perf_counter() - t0)
    return median(times)


def measure(name: str, folder: str, preset: str, rounds: int) -> dict:
    from fewstep.engine.models.registry import all_presets

    family, params = all_presets()[preset]
    t0 = time.perf_counter()
    encoder = open_text_encoder(folder, family, params, device="cpu", dtype=torch.float32)
    load_s = time.perf_counter() - t0
    cache = PromptEmbeddingCache()
    cache.embed(encoder, "warm-up prompt")
    misses, hits = [], []
    for i in range(rounds):
        prompt = PROMPTS[i % len(PROMPTS)] + f" ({i})"  # distinct: each one a miss
        t0 = time.perf_counter()
        cache.embed(encoder, prompt)
        misses.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        cache.embed(encoder, prompt)
        hits.append(time.perf_counter() - t0)
    encoder.close()
    miss, hit = median(misses), median(hits)
    return {"family": name, "encoder": encoder.description, "weight_bytes": encoder.weight_bytes, "load_s": load_s,
            "encode_s": miss, "cache_hit_s": hit, "encode_over_hit": miss / hit,
            "stats": cache.stats()}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7, help="prompts encoded per family (medians)")
    ap.add_argument("--model", default=None, help="with --text-encoder: the preset whose encoder it is")
    ap.add_argument("--text-encoder", default=None, help="a real encoder folder (default: the tiny encoders)")
    ap.add_argument("--out", default=None, help="JSON report path (default: bench/results/text_encoder.json)")
    args = parse_args(ap, QUICK)
    setup_threads(args.threads)
    env = header("Text encoder: encoding a prompt vs a prompt-cache hit")
    rows = []
    with tempfile.TemporaryDirectory() as root:
        if args.text_encoder:
            from fewstep.engine.models.registry import all_presets

            cases = {all_presets()[args.model][0].name: (args.text_encoder, args.model)}
        else:
            cases = {name: (folder, TINY[name]) for name, folder in tiny_folders(root).items()}
        for name, (folder, preset) in cases.items():
            row = measure(name, folder, preset, args.rounds)
            row["dit_forward_s"] = dit_forward_seconds(TINY.get(name, preset), args.rounds)
            rows.append(row)
    print(
        "| family | encoder | weights | load | encode (miss) | cache hit | encode / hit | one DiT forward (tiny "
        "preset, 256 px) | encode / (4 forwards + encode) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    summary = []
    for r in rows:
        dit = r["dit_forward_s"]
        share = "-" if dit is None else f"{100 * r['encode_s'] / (4 * dit + r['encode_s']):.0f}%"
        print(f"| {r['family']} | {r['encoder']} | {r['weight_bytes'] / 2**20:.1f} MiB | {r['load_s']:.2f} s | "
              f"{1e3 * r['encode_s']:.2f} ms | {1e6 * r['cache_hit_s']:.1f} us | {r['encode_over_hit']:.0f}x | "
              f"{'-' if dit is None else f'{1e3 * dit:.2f} ms'} | {share} |")  # fmt: skip
        summary.append(summary_row(f"{r['family']}: encode / cache hit", f"{r['encode_over_hit']:.0f}x "
                                   f"({1e3 * r['encode_s']:.2f} ms vs {1e6 * r['cache_hit_s']:.1f} us)"))  # fmt: skip
    payload = {"environment": env, "rounds": args.rounds, "rows": rows, "summary": summary}
    if args.out:
        Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    else:
        save("text_encoder", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
