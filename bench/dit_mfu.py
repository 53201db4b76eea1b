"""DiT forward MFU on CPU: the forward's FLOP/s over torch's own GEMM FLOP/s on the same shapes, same run.

    python bench/dit_mfu.py                       # flux-mid, flux2-mid, zimage-mid; 256x256 and 512x512 px
    python bench/dit_mfu.py --presets flux2-mid --sizes 1024x1024 --txt 256 --rounds 5
    python bench/dit_mfu.py --quick               # 256x256 only, 3 rounds (about a minute on 2 cores)

FLOPs: every GEMM the forward executes (aten mm/addmm/bmm/baddbmm, in-place too, after decomposing ops such as
``linear``, recorded with a TorchDispatchMode) counts 2*M*K*N; every attention call counts 4*Nq*Nk*d*heads
(QK^T and PV; softmax and scaling not counted). The baseline replays exactly those GEMM calls (same inputs,
same weight tensors and strides) and each attention as two ``torch.bmm`` (QK^T, PV) of the same sizes.
MFU = (model FLOPs / forward time) / (same FLOPs / baseline time) = baseline time / forward time, taken per
round with forward and baseline timed back to back, median over rounds.

Attention is also reported separately: the forward's own SDPA calls are replayed too, giving the attention
kernel's own FLOP/s and a GEMM-only MFU = GEMM replay time / (forward time - SDPA replay time).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch
from _common import (
    describe_dit,
    dit_inputs,
    header,
    image_tokens,
    median,
    parse_px,
    save,
    setup_threads,
    timed,
)
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from fewstep.engine import load_dit

aten = torch.ops.aten
GEMMS = {aten.mm, aten.addmm, aten.addmm_, aten.bmm, aten.baddbmm, aten.baddbmm_}  # overload packets
ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
}
GEMM_NAMES = {f"aten::{op.__name__}" for op in GEMMS}
TARGET_MFU = 0.85
QUICK = {"sizes": "256x256", "rounds": 3, "warmup": 1}  # --quick defaults (explicit flags win)


def gemm_flops(func, args) -> int:
    """2*M*K*N per matrix product; the addmm/baddbmm family has (input, mat1, mat2), mm/bmm (mat1, mat2)."""
    a, b = (
        args[1:3]
        if func.overloadpacket in (aten.addmm, aten.addmm_, aten.baddbmm, aten.baddbmm_)
        else args[:2]
    )
    batch = a.shape[0] if a.ndim == 3 else 1
    return 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


class RecordGemms(TorchDispatchMode):
    """Decompose composite ops (as FlopCounterMode does) and keep every GEMM call and attention shape."""

    def __init__(self):
        super().__init__()
        self.gemms: list[tuple] = []  # (func, args, kwargs, flops)
        self.attention: list[tuple[int, int, int, int, int]] = []  # (B, H, Nq, Nk, D)
        self.attention_calls: list[tuple] = []  # (func, args, kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in GEMMS:
            self.gemms.append((func, args, kwargs, gemm_flops(func, args)))
        elif func.overloadpacket in ATTENTION:
            (b, h, nq, d), nk = args[0].shape, args[1].shape[2]
            self.attention.append((b, h, nq, nk, d))
            self.attention_calls.append((func, args, kwargs))
        else:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


def attention_flops(b, h, nq, nk, d) -> int:
    return 4 * b * h * nq * nk * d


def attention_as_bmm(shapes):
    """Two bmm per attention call (scores = Q K^T, out = P V) on fresh contiguous operands of the same sizes."""
    ops = []
    for b, h, nq, nk, d in shapes:
        q, k, v = torch.randn(b * h, nq, d), torch.randn(b * h, nk, d), torch.randn(b * h, nk, d)
        ops.append((q, k.transpose(1, 2), v))
    return lambda: [torch.bmm(torch.bmm(q, kt), v) for q, kt, v in ops]


def non_gemm_breakdown(model, inputs, forwards: int, top: int) -> tuple[list, float, float]:
    """Self CPU time per op (ms per forward) from torch.profiler, labelled with the top-level aten op."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = sum(timed(lambda: model(**inputs)) for _ in range(forwards)) / forwards
    per_op: dict[str, float] = defaultdict(float)
    gemm = 0.0
    for ev in prof.events():
        root = ev
        while root.cpu_parent is not None:
            root = root.cpu_parent
        if ev.name in GEMM_NAMES:
            gemm += ev.self_cpu_time_total
            continue
        label = ev.name if root is ev else f"{ev.name} (in {root.name})"
        per_op[label] += ev.self_cpu_time_total
    total_ops = gemm + sum(per_op.values())
    per_op["(outside aten ops: Python, module calls)"] = wall * 1e6 * forwards - total_ops
    rows = sorted(((k, v / forwards / 1e3) for k, v in per_op.items()), key=lambda kv: -kv[1])
    return rows[:top], gemm / forwards / 1e3, wall * 1e3


def replay(calls):
    def run():
        for func, args, kwargs, *_ in calls:
            func(*args, **kwargs)

    return run


def run_size(model, size: str, txt: int, batch: int, rounds: int, warmup: int, top: int) -> dict:
    w, h = parse_px(size)
    inputs = dit_inputs(model, w, h, txt, batch)
    with torch.inference_mode():
        rec = RecordGemms()
        with rec:
            model(**inputs)
        with FlopCounterMode(display=False) as fc:  # cross-check of the GEMM FLOPs recorded above
            model(**inputs)
        gemm_flop = sum(g[3] for g in rec.gemms)
        attn_flop = sum(attention_flops(*s) for s in rec.attention)
        timers = {
            "forward": lambda: model(**inputs),
            "gemm": replay(rec.gemms),  # the forward's own GEMM calls, same tensors
            "attn_bmm": attention_as_bmm(rec.attention),  # baseline for attention FLOPs
            "sdpa": replay(rec.attention_calls),  # the forward's own attention calls, same q, k, v
        }
        for _ in range(warmup):
            for fn in timers.values():
                fn()
        t = {k: [] for k in timers}
        for _ in range(rounds):  # A/B interleaved: load on the machine hits both sides alike
            for k, fn in timers.items():
                t[k].append(timed(fn))
        breakdown = non_gemm_breakdown(model, inputs, max(2, rounds // 3), top)
    f, g, a, s = (t[k] for k in timers)
    mfu_rounds = [(gi + ai) / fi for fi, gi, ai in zip(f, g, a)]
    total = gemm_flop + attn_flop
    fwd, gemm, attn, sdpa = (median(x) for x in (f, g, a, s))
    return {
        "size": size,
        "image_tokens": image_tokens(w, h),
        "text_tokens": txt,
        "batch": batch,
        "rounds": rounds,
        "gflop": total / 1e9,
        "gemm_gflop": gemm_flop / 1e9,
        "attention_gflop": attn_flop / 1e9,
        "flop_counter_gemm_gflop": fc.get_total_flops() / 1e9,
        "gemm_calls": len(rec.gemms),
        "attention_calls": len(rec.attention),
        "forward_ms": fwd * 1e3,
        "forward_min_ms": min(f) * 1e3,
        "achieved_gflops": total / fwd / 1e9,
        "baseline_ms": (gemm + attn) * 1e3,
        "baseline_gemm_ms": gemm * 1e3,
        "baseline_attention_bmm_ms": attn * 1e3,
        "baseline_gflops": total / (gemm + attn) / 1e9,
        "mfu": median(mfu_rounds),
        "mfu_min_max": [min(mfu_rounds), max(mfu_rounds)],
        "mfu_best_of": (min(g) + min(a)) / min(f),
        "sdpa_ms": sdpa * 1e3,
        "mfu_gemm_only": median([gi / (fi - si) for fi, gi, si in zip(f, g, s)]),
        "rest_ms": median([fi - gi - si for fi, gi, si in zip(f, g, s)]) * 1e3,
        "profile": {
            "forward_ms": breakdown[2],
            "gemm_self_ms": breakdown[1],
            "top_non_gemm_ms": dict(breakdown[0]),
        },
    }


def print_results(preset: str, rows: list[dict], always_profile: bool) -> None:
    print(f"`dummy:{preset}`, fp32. Times: median over rounds; MFU: median of per-round ratios.\n")
    print("MFU = (GEMM + attention FLOPs / forward time) / (same FLOPs / baseline time), baseline = the")
    print(
        "forward's own GEMM calls replayed + each attention as 2 bmm (QK^T, PV); best-of = min/min times.\n"
    )
    print(
        "| image | tokens img+txt | forward ms | GFLOP (GEMM + attn) | achieved GFLOP/s "
        "| baseline ms (GEMM + attn bmm) | baseline GFLOP/s | MFU (min-max) | MFU best-of |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["mfu_min_max"]
        print(
            f"| {r['size']} | {r['image_tokens']}+{r['text_tokens']} | {r['forward_ms']:.1f} "
            f"| {r['gflop']:.2f} ({r['gemm_gflop']:.2f} + {r['attention_gflop']:.2f}) "
            f"| {r['achieved_gflops']:.1f} | {r['baseline_ms']:.1f} ({r['baseline_gemm_ms']:.1f} + "
            f"{r['baseline_attention_bmm_ms']:.1f}) | {r['baseline_gflops']:.1f} "
            f"| **{r['mfu']:.3f}** ({lo:.2f}-{hi:.2f}) | {r['mfu_best_of']:.3f} |"
        )
    print("\nAttention separately: SDPA = the forward's own attention calls replayed; GEMM-only MFU =")
    print("GEMM replay time / (forward time - SDPA time); rest = forward - GEMM replay - SDPA.\n")
    print(
        "| image | GEMM GFLOP/s (replay) | attn GFLOP/s: SDPA / 2 bmm | SDPA ms | rest ms | GEMM-only MFU |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        gemm_rate = r["gemm_gflop"] / r["baseline_gemm_ms"] * 1e3
        sdpa_rate = r["attention_gflop"] / r["sdpa_ms"] * 1e3
        bmm_rate = r["attention_gflop"] / r["baseline_attention_bmm_ms"] * 1e3
        print(
            f"| {r['size']} | {gemm_rate:.1f} | {sdpa_rate:.1f} / {bmm_rate:.1f} | {r['sdpa_ms']:.1f} "
            f"| {r['rest_ms']:.1f} | {r['mfu_gemm_only']:.3f} |"
        )
    for r in rows:
        same = abs(r["flop_counter_gemm_gflop"] - r["gemm_gflop"]) < 1e-6
        print(
            f"\n{r['size']}: {r['gemm_calls']} GEMM calls, {r['attention_calls']} attention calls; "
            f"FlopCounterMode GEMM GFLOP {r['flop_counter_gemm_gflop']:.2f} ({'agrees' if same else 'DIFFERS'})"
        )
        if min(r["mfu"], r["mfu_gemm_only"]) >= TARGET_MFU and not always_profile:
            continue
        p = r["profile"]
        print(
            f"\nMFU {r['mfu']:.3f}, GEMM-only {r['mfu_gemm_only']:.3f} (target {TARGET_MFU}): torch.profiler, "
            f"{p['forward_ms']:.1f} ms per profiled forward, "
            f"GEMM self time {p['gemm_self_ms']:.1f} ms. Top non-GEMM self time:\n"
        )
        print("| op (self time; in top-level op) | ms / forward | % of forward |")
        print("|---|---|---|")
        for name, ms in p["top_non_gemm_ms"].items():
            print(f"| {name} | {ms:.2f} | {100 * ms / p['forward_ms']:.1f} |")


def summary(preset: str, rows: list[dict]) -> list[dict]:
    """Rows for the suite table (bench/run_all): ratios only, the CPU's absolute speed means nothing there."""
    out = []
    for r in rows:
        out.append(
            {
                "metric": f"DiT forward MFU (forward vs its own GEMMs + 2-bmm attention), {preset} {r['size']}",
                "value": f"{r['mfu']:.2f} (best-of {r['mfu_best_of']:.2f})",
                "goal": f">= {TARGET_MFU}",
                "met": r["mfu"] >= TARGET_MFU,
            }
        )
        out.append(
            {
                "metric": f"DiT GEMM-only MFU (attention time taken out), {preset} {r['size']}",
                "value": f"{r['mfu_gemm_only']:.2f}",
                "goal": None,
                "met": None,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--presets",
        "--preset",
        default="flux-mid,flux2-mid,zimage-mid",
        help="dummy presets, comma-separated: FLUX.1, FLUX.2 and Z-Image mid-size by default (head size 128 each)",
    )
    ap.add_argument("--sizes", default="256x256,512x512", help="image sizes in px, WxH, comma-separated")
    ap.add_argument("--txt", type=int, default=128, help="text tokens")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=10, help="timed forward/baseline pairs")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--top", type=int, default=12, help="rows of the non-GEMM breakdown")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--profile", action="store_true", help="print the non-GEMM breakdown even if MFU >= 0.85")
    ap.add_argument("--quick", action="store_true", help=f"short run for bench/run_all: defaults {QUICK}")
    if "--quick" in sys.argv[1:]:
        ap.set_defaults(**QUICK)
    args = ap.parse_args()

    setup_threads(args.threads)
    env = header("DiT forward MFU (CPU)")
    results, rows_of_summary = {}, []
    for preset in args.presets.split(","):
        model = load_dit(f"dummy:{preset}")
        print(f"### {preset}\n\n{describe_dit(model.params)}; batch {args.batch}, {args.rounds} rounds\n")
        rows = [
            run_size(model, s, args.txt, args.batch, args.rounds, args.warmup, args.top)
            for s in args.sizes.split(",")
        ]
        print_results(preset, rows, args.profile)
        print()
        results[preset] = rows
        rows_of_summary += summary(preset, rows)
        del model
    save(
        "dit_mfu",
        {
            "env": env,
            "quick": args.quick,
            "presets": list(results),
            "target_mfu": TARGET_MFU,
            "results": results,
            "summary": rows_of_summary,
        },
    )


if __name__ == "__main__":
    main()
