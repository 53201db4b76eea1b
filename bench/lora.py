"""LoRA cost: merging a rank-16 LoRA on every linear of a dummy preset, backup memory, fp8 error, step cost.

    python bench/lora.py                          # dummy:flux-mid, 256x256 px, 5 rounds
    python bench/lora.py --preset flux-tiny --rounds 3
    python bench/lora.py --quick                  # flux-mid, 128x128 px, 3 rounds (about 1 min on 2 cores)

A LoRA file in ComfyUI's official naming (``diffusion_model.<module>.lora_up.weight`` / ``lora_down.weight`` /
``alpha``), rank ``--rank`` on every linear layer, is written to a temporary directory and applied with
``apply_lora``. Timed (median of ``--rounds``): the first merge (``MergedWeights.ensure``: backups copied to the
CPU, every patched weight recomputed in float32 and written in place), a re-merge after a strength change (what
switching between two handles of one model costs per switch), and the restore (base weights back, backups
released). Host memory: the bytes of the backups against the model's weight bytes. fp8: the preset loaded with
``weight_dtype=float8_e4m3fn``, the same LoRA merged (float32, then stochastic rounding back to fp8) against the
float32 model with it: the mean / max abs error of the patched weights and of a 4-step sample, next to fp8's own
error without a LoRA. Per step: ``sample_latent`` on a copy of the model holding the merged LoRA against the
base copy (two copies, so no run re-merges), timed in 2 x ``--rounds`` pairs, A/B then B/A; the median ratio
should be 1.00: merged weights cost nothing per step.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from _common import header, median, parse_args, save, setup_threads, timed
from safetensors.torch import save_file

from fewstep.engine import TextCondition, open_model, sample_latent
from fewstep.engine.lora import apply_lora, merged_weights
from fewstep.engine.ops import Linear, weight_bytes

QUICK = {"rounds": 3, "size": 128}
STEPS = 4
RATIO_GOAL = 1.05  # a sampler run with a merged LoRA against one without: no per-step cost beyond noise


def write_lora(path: Path, model, rank: int, seed: int = 0) -> int:
    """A rank-``rank`` LoRA on every linear of ``model`` (alpha = rank: scale 1) at ``path``; returns its entries."""
    g = torch.Generator().manual_seed(seed)
    entries = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.weight.ndim != 2:
            continue
        out_dim, in_dim = module.weight.shape
        size = float(module.weight.detach().float().abs().mean()) * 0.05  # a delta of ~5% of the weight
        entries[f"diffusion_model.{name}.lora_up.weight"] = (
            torch.randn(out_dim, rank, generator=g) * size**0.5
        )
        down = torch.randn(rank, in_dim, generator=g) * size**0.5 / rank**0.5
        entries[f"diffusion_model.{name}.lora_down.weight"] = down
        entries[f"diffusion_model.{name}.alpha"] = torch.tensor(float(rank))
    save_file(entries, str(path))
    return len(entries)


def cond_for(handle):
    g = torch.Generator().manual_seed(1)
    if handle.family.name == "flux":
        p = handle.params
        return TextCondition(
            torch.randn(1, 16, p.context_in_dim, generator=g), torch.randn(1, p.vec_in_dim, generator=g), 3.5
        )
    width = handle.family.image.context_dim(handle.params)
    return TextCondition(torch.randn(1, 16, width, generator=g), None, 4.0)


def latent_for(handle, px: int) -> torch.Tensor:
    if handle.family.name == "flux2":
        return torch.zeros(1, 128, px // 16, px // 16)
    return torch.zeros(1, 16, px // 8, px // 8)


def sample(handle, cond, latent):
    return sample_latent(handle, [cond], latent, steps=STEPS, seed=3)[0]


def measure_merge(handle, path: Path, rounds: int) -> dict:
    model = handle.model
    state = merged_weights(model)
    first, again, restore = [], [], []
    for i in range(rounds):
        lora = apply_lora(handle, path, 1.0)
        first.append(timed(lambda lora=lora: state.ensure(model, lora.loras)))
        other = apply_lora(handle, lora.loras[0], 0.5 + 0.1 * i)
        again.append(timed(lambda other=other: state.ensure(model, other.loras)))
        backups = state.backup_bytes()
        restore.append(timed(lambda: state.restore(model)))
    return {
        "weight_bytes": weight_bytes(model),
        "backup_bytes": backups,
        "patched_weights": len(lora.loras[0].keys),
        "lora_bytes": lora.loras[0].nbytes(),
        "first_merge_s": median(first),
        "re_merge_s": median(again),
        "restore_s": median(restore),
        "released": state.backup_bytes() == 0,
    }


def measure_fp8(preset: str, path: Path, px: int) -> dict:
    fp32 = open_model(f"dummy:{preset}", dtype=torch.float32)
    fp8 = open_model(f"dummy:{preset}", dtype=torch.float32, weight_dtype=torch.float8_e4m3fn)
    cond, latent = cond_for(fp32), latent_for(fp32, px)
    l32, l8 = apply_lora(fp32, path, 1.0), apply_lora(fp8, path, 1.0)
    keys = sorted(l32.loras[0].keys)

    def get(h):
        return {k: h.model.get_parameter(k).detach().float().clone() for k in keys}

    w32, w8, out32, out8 = get(fp32), get(fp8), sample(fp32, cond, latent), sample(fp8, cond, latent)
    lout32, lout8 = sample(l32, cond, latent), sample(l8, cond, latent)
    lw32, lw8 = get(fp32), get(fp8)

    def err(a, b):
        d = torch.cat([(a[k] - b[k]).flatten() for k in keys]).abs()
        return float(d.mean()), float(d.max())

    delta = {k: lw32[k] - w32[k] for k in keys}
    return {
        "weights_fp8_vs_fp32": err(w8, w32),
        "weights_rounding_added": err(lw8, {k: w8[k] + delta[k] for k in keys}),
        "weights_fp8_lora_vs_fp32_lora": err(lw8, lw32),
        "delta": err(delta, {k: torch.zeros_like(v) for k, v in delta.items()}),
        "out_fp8_vs_fp32": (float((out8 - out32).abs().mean()), float((out8 - out32).abs().max())),
        "out_fp8_lora_vs_fp32_lora": (
            float((lout8 - lout32).abs().mean()),
            float((lout8 - lout32).abs().max()),
        ),
        "out_scale": float(out32.abs().mean()),
    }


def measure_steps(preset: str, path: Path, px: int, rounds: int) -> dict:
    base = open_model(f"dummy:{preset}", dtype=torch.float32)
    lora = apply_lora(open_model(f"dummy:{preset}", dtype=torch.float32), path, 1.0)  # its own copy
    cond, latent = cond_for(base), latent_for(base, px)
    sample(base, cond, latent), sample(lora, cond, latent)  # warm-up; the LoRA copy merges here, once
    merges = merged_weights(lora.model).merges
    ratios, base_t, lora_t = [], [], []
    for i in range(2 * rounds):  # A/B then B/A: neither side always runs first
        pair = [lambda: sample(base, cond, latent), lambda: sample(lora, cond, latent)]
        if i % 2:
            a, b = timed(pair[1]), timed(pair[0])
        else:
            b, a = timed(pair[0]), timed(pair[1])
        base_t.append(b), lora_t.append(a), ratios.append(a / b)
    assert merged_weights(lora.model).merges == merges  # no run re-merged
    return {"ratio": median(ratios), "ratio_min_max": [min(ratios), max(ratios)],
            "base_s": median(base_t), "lora_s": median(lora_t)}  # fmt: skip


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="flux-mid", help="a dummy preset (flux-*, flux2-*, zimage-*)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--size", type=int, default=256, help="image size in px (square) of the sampler runs")
    ap.add_argument("--rounds", type=int, default=5)
    args = parse_args(ap, QUICK)
    setup_threads(args.threads)
    env = header(f"LoRA merge cost, rank {args.rank} on every linear of dummy:{args.preset}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lora.safetensors"
        handle = open_model(f"dummy:{args.preset}", dtype=torch.float32)
        entries = write_lora(path, handle.model, args.rank)
        merge = measure_merge(handle, path, args.rounds)
        del handle
        fp8 = measure_fp8(args.preset, path, args.size)
        steps = measure_steps(args.preset, path, args.size, args.rounds)
    print(
        f"{entries} file entries, {merge['patched_weights']} weights patched, deltas {mib(merge['lora_bytes'])}\n"
    )
    print("| what | value |\n|---|---|")
    print(
        f"| first merge (backups + float32 merge + write in place) | {merge['first_merge_s'] * 1e3:.1f} ms |"
    )
    print(
        f"| re-merge after a strength change (a switch between handles) | {merge['re_merge_s'] * 1e3:.1f} ms |"
    )
    print(f"| restore (base weights back, backups released) | {merge['restore_s'] * 1e3:.1f} ms |")
    share = merge["backup_bytes"] / merge["weight_bytes"]
    print(
        f"| host memory of the backups | {mib(merge['backup_bytes'])} ({share:.0%} of the weights' {mib(merge['weight_bytes'])}) |"
    )
    lo, hi = steps["ratio_min_max"]
    print(
        f"| {STEPS}-step sample, merged LoRA / base | **{steps['ratio']:.3f}** ({lo:.3f}..{hi:.3f}; {steps['base_s'] * 1e3:.0f} ms base) |"
    )
    print(
        "\nfp8 (e4m3) storage, the LoRA merged in float32 then rounded stochastically: mean / max abs error\n"
    )
    print("| compared | mean | max | mean / fp8's own |\n|---|---|---|---|")
    own_w, own_o = fp8["weights_fp8_vs_fp32"][0], fp8["out_fp8_vs_fp32"][0]
    rows = [
        ("weights: fp8 vs fp32 (no LoRA: fp8's own error)", fp8["weights_fp8_vs_fp32"], own_w),
        ("weights: the merge's rounding (vs fp8 base + exact delta)", fp8["weights_rounding_added"], own_w),
        ("weights: fp8 + LoRA vs fp32 + LoRA", fp8["weights_fp8_lora_vs_fp32_lora"], own_w),
        ("weights: the LoRA delta itself", fp8["delta"], own_w),
        (f"{STEPS}-step sample: fp8 vs fp32", fp8["out_fp8_vs_fp32"], own_o),
        (f"{STEPS}-step sample: fp8 + LoRA vs fp32 + LoRA", fp8["out_fp8_lora_vs_fp32_lora"], own_o),
    ]
    for what, (mean, mx), own in rows:
        print(f"| {what} | {mean:.3g} | {mx:.3g} | {mean / own:.2f} |")
    total = fp8["weights_fp8_lora_vs_fp32_lora"][0] / own_w
    out_total = fp8["out_fp8_lora_vs_fp32_lora"][0] / own_o
    summary = [
        {"metric": f"{STEPS}-step sample with a merged rank-{args.rank} LoRA / without ({args.preset})",
         "value": f"{steps['ratio']:.3f}", "goal": f"<= {RATIO_GOAL}", "met": steps["ratio"] <= RATIO_GOAL},
        {"metric": f"LoRA merge / re-merge / restore ({args.preset}, every linear)",
         "value": f"{merge['first_merge_s'] * 1e3:.0f} / {merge['re_merge_s'] * 1e3:.0f} / {merge['restore_s'] * 1e3:.0f} ms",
         "goal": None, "met": None},
        {"metric": "fp8 + LoRA error / fp8's own error (mean; weights, sample)",
         "value": f"{total:.2f}, {out_total:.2f}", "goal": "<= 2.0", "met": total <= 2.0 and out_total <= 2.0},
    ]  # fmt: skip
    save(
        "lora",
        {"env": env, "args": vars(args), "merge": merge, "fp8": fp8, "steps": steps, "summary": summary},
    )


if __name__ == "__main__":
    main()
