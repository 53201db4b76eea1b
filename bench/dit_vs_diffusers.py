"""Our FLUX.2 and Z-Image transformers against diffusers', same weights, same inputs, timed side by side.

    python bench/dit_vs_diffusers.py                  # flux2-mid and zimage-mid, 256x256 and 512x512 px, 5 rounds
    python bench/dit_vs_diffusers.py --cases flux2-mid@1024x1024 --rounds 3
    python bench/dit_vs_diffusers.py --quick          # 256x256 only, 3 rounds

Each case builds diffusers' transformer (``Flux2Transformer2DModel`` / ``ZImageTransformer2DModel``) with the
preset's configuration and diffusers' own seeded initialisation, and loads the same tensors into ours: FLUX.2
through ``flux2_checkpoint.diffusers_to_official`` (the loader's converter), Z-Image as they are (diffusers' layout
is the official one). Both run fp32 on the CPU under ``inference_mode`` on the same seeded inputs, in the calling
convention each expects (diffusers' Z-Image takes per-image lists). Per round one forward of each, the order
alternating; **ratio** = diffusers time / our time per round, median (min-max) and a best-of (min / min): above
1x ours is faster. The max abs difference of the two outputs, and the largest output magnitude, are printed
beside it: both sides compute the same function, so they differ by rounding only.
"""

from __future__ import annotations

import argparse

import torch
from _common import (
    describe_dit,
    dit_inputs,
    header,
    image_tokens,
    median,
    parse_args,
    parse_px,
    peer_rows,
    save,
    setup_threads,
)
from _common import timed as timed_call

from fewstep.engine.models import flux2_checkpoint, zimage_checkpoint
from fewstep.engine.models.flux2 import PRESETS as FLUX2_PRESETS
from fewstep.engine.models.flux2 import Flux2
from fewstep.engine.models.zimage import PRESETS as ZIMAGE_PRESETS
from fewstep.engine.models.zimage import ZImage

QUICK = {"cases": "flux2-mid@256x256,zimage-mid@256x256", "rounds": 3, "warmup": 1}
MAX_DIFF = 1e-3  # fp32, both sides the same function: anything larger is a real mismatch, not rounding


def flux2_pair(preset: str, seed: int):
    """(ours, diffusers', a call of diffusers' model on our inputs) for a FLUX.2 preset."""
    import diffusers

    p = FLUX2_PRESETS[preset]
    torch.manual_seed(seed)
    ref = diffusers.Flux2Transformer2DModel(**flux2_checkpoint.diffusers_config(p)).eval()
    ours = Flux2(p).eval()
    ours.load_state_dict(flux2_checkpoint.diffusers_to_official(ref.state_dict()), strict=True)

    def call_ref(inputs):
        return ref(**flux2_checkpoint.diffusers_forward_kwargs(inputs))[0]

    return ours, ref, call_ref


def zimage_pair(preset: str, seed: int):
    import diffusers

    p = ZIMAGE_PRESETS[preset]
    torch.manual_seed(seed)
    ref = diffusers.ZImageTransformer2DModel(**zimage_checkpoint.diffusers_config(p)).eval()
    with (
        torch.no_grad()
    ):  # diffusers starts the learnt pad tokens at zero: values that show if padding differs
        for name, t in ref.named_parameters():
            if name.endswith("pad_token"):
                t.normal_(0, 1)
    ours = ZImage(p).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)  # the official layout is diffusers'

    def call_ref(inputs):
        out = ref(list(inputs["x"].unsqueeze(2)), inputs["t"], list(inputs["cap_feats"]), return_dict=False)[
            0
        ]
        return torch.stack([o.squeeze(1) for o in out])

    return ours, ref, call_ref


PAIRS = {"flux2": (FLUX2_PRESETS, flux2_pair), "zimage": (ZIMAGE_PRESETS, zimage_pair)}


def family_of_preset(preset: str) -> str:
    for family, (presets, _) in PAIRS.items():
        if preset in presets:
            return family
    raise SystemExit(
        f"unknown preset {preset!r}: one of {', '.join(p for ps, _ in PAIRS.values() for p in ps)}"
    )


def run_case(case: str, txt: int, rounds: int, warmup: int, seed: int) -> dict:
    preset, size = case.split("@")
    w, h = parse_px(size)
    ours, ref, call_ref = PAIRS[family_of_preset(preset)][1](preset, seed)
    inputs = dit_inputs(ours, w, h, txt)
    with torch.inference_mode():
        got, want = ours(**inputs), call_ref(inputs)
        sides = {"ours": lambda: ours(**inputs), "diffusers": lambda: call_ref(inputs)}
        for _ in range(warmup):
            for fn in sides.values():
                fn()
        t = {k: [] for k in sides}
        for r in range(rounds):  # A/B, the order alternating: a drift in machine load hits both alike
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for k in order:
                t[k].append(timed_call(sides[k]))
    ratios = [d / o for o, d in zip(t["ours"], t["diffusers"])]
    return {
        "case": case,
        "preset": preset,
        "size": size,
        "config": describe_dit(ours.params),
        "image_tokens": image_tokens(w, h),
        "text_tokens": txt,
        "rounds": rounds,
        "ours_ms": median(t["ours"]) * 1e3,
        "diffusers_ms": median(t["diffusers"]) * 1e3,
        "ratio": median(ratios),
        "ratio_min_max": [min(ratios), max(ratios)],
        "ratio_best_of": min(t["diffusers"]) / min(t["ours"]),
        "max_abs_diff": (got - want).abs().max().item(),
        "max_abs_output": want.abs().max().item(),
    }


def print_results(rows: list[dict]) -> None:
    print(
        "fp32, CPU. Ratio = diffusers time / our time per round (above 1x ours is faster), median (min-max);"
    )
    print("best-of = min diffusers / min ours. Same weights, same inputs.\n")
    print(
        "| case | tokens img+txt | ours ms | diffusers ms | ratio (min-max) | best-of | max abs diff | max abs out |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["ratio_min_max"]
        print(
            f"| {r['case']} | {r['image_tokens']}+{r['text_tokens']} | {r['ours_ms']:.1f} | {r['diffusers_ms']:.1f} "
            f"| **{r['ratio']:.2f}x** ({lo:.2f}-{hi:.2f}) | {r['ratio_best_of']:.2f}x | {r['max_abs_diff']:.2e} "
            f"| {r['max_abs_output']:.2f} |"
        )
    for preset in dict.fromkeys(r["preset"] for r in rows):
        print(f"\n{preset}: {next(r['config'] for r in rows if r['preset'] == preset)}")


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        out += peer_rows(
            f"DiT forward, diffusers time / ours, {r['case']}",
            f"DiT forward, max abs diff ours vs diffusers (same weights), {r['case']}",
            r, MAX_DIFF, f" (outputs up to {r['max_abs_output']:.2g})",
        )  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cases",
        default="flux2-mid@256x256,flux2-mid@512x512,zimage-mid@256x256,zimage-mid@512x512",
        help="preset@WxH, comma-separated (FLUX.2 and Z-Image presets)",
    )
    ap.add_argument(
        "--txt", type=int, default=128, help="text tokens (a multiple of 32: no Z-Image caption padding)"
    )
    ap.add_argument("--rounds", type=int, default=5, help="timed forward pairs per case")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = parse_args(ap, QUICK)
    try:
        import diffusers
    except ImportError:
        raise SystemExit("needs diffusers (the test extra: pip install -e .[test])") from None

    setup_threads(args.threads)
    env = header("DiT forward, ours vs diffusers (CPU)")
    print(f"diffusers {diffusers.__version__}\n")
    rows = [run_case(c, args.txt, args.rounds, args.warmup, args.seed) for c in args.cases.split(",")]
    print_results(rows)
    save(
        "dit_vs_diffusers",
        {
            "env": env | {"diffusers": diffusers.__version__},
            "quick": args.quick,
            "results": rows,
            "summary": summary(rows),
        },
    )


if __name__ == "__main__":
    main()
