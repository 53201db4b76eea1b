"""Our bidirectional Wan 2.1 DiT forward against diffusers' and ComfyUI's, same weights, same inputs, side by side.

    python bench/wan_vs_peers.py                              # wan-mid, one 832x480 px frame (1560 tokens), 1 and 2 threads
    python bench/wan_vs_peers.py --comfyui ~/ComfyUI          # ... with ComfyUI's WanModel as a third column
    python bench/wan_vs_peers.py --comfyui ~/ComfyUI-0.3.64,~/ComfyUI-0.8.0   # a column per ComfyUI version
    python bench/wan_vs_peers.py --cases wan-mid@832x480x2 --thread-counts 2 --rounds 3
    python bench/wan_vs_peers.py --quick                      # 1 thread, 3 rounds (< 60 s)
    python bench/wan_vs_peers.py --thread-counts 1 --clock cpu --profile   # CPU time; top ops of each side

Three implementations of the same function in one process: ours (``engine.models.wan.Wan``), diffusers'
``WanTransformer3DModel`` and, when ComfyUI is found (``--comfyui DIR`` or ``COMFYUI_DIR``; the column is skipped
with a line saying so otherwise), ComfyUI's ``comfy.ldm.wan.model.WanModel``. ComfyUI is imported from its
checkout at run time (the repository holds none of it); if its own dependencies (``psutil``...) are missing from
this Python, the site-packages of ``DIR/../venv`` (or ``--comfyui-site``) are appended to ``sys.path`` after this
environment's own, so torch and everything else still come from here. ComfyUI is set up the way ``--cpu
--use-pytorch-cross-attention`` would: its ``optimized_attention`` is ``attention_pytorch`` (PyTorch SDPA, the
same op as ours and diffusers'); without the flag ComfyUI on a CPU uses its sub-quadratic chunked attention.
Its layers are ``comfy.ops.disable_weight_init`` in float32 (what ComfyUI picks for an fp32 model on the CPU).

Weights: a seeded random ``Wan(PRESETS[preset])`` (RMS / LayerNorm weights and biases perturbed too, so a mixed
up norm would show); ComfyUI loads its state dict as it is (the official layout), diffusers through the inverse of
the LoRA loader's diffusers -> official module map (``engine.lora.names``). Inputs: a seeded latent ``[1, 16, F,
H/8, W/8]``, one timestep, ``--txt`` random umT5 tokens zero-padded to 512 (Wan's text length; all three attend to
the 512 tokens). fp32 on the CPU under ``inference_mode``.

Several ComfyUI checkouts (``--comfyui A,B``; one Python process can import only one ``comfy`` package): the first
runs in this process with diffusers, each further one in a child process of this script that times ours against it
alone, the same way; every ratio is taken against our forward in the same process, and each version gets its column.

Per round one forward of each side, the order rotating from round to round; **ratio** = peer time / our time per
round, median (min-max), and best-of (min peer / min ours): above 1x ours is faster. ``--clock cpu`` times
the process's CPU time instead of wall time (at 1 thread a busy machine distorts it less); ``--profile`` lists
each side's top ops by self CPU time (``torch.profiler``, one forward). The max abs difference of
each peer's output from ours is printed beside the largest output magnitude: same function, rounding only (ComfyUI
and diffusers compute the sinusoidal time embedding and the RoPE angles in float32, we in float64).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import header, median, parse_args, peer_rows, save, setup_threads

from fewstep.engine.lora.names import foreign_names
from fewstep.engine.models.wan import PRESETS, Wan, WanParams, tokens_per_frame

QUICK = {"cases": "wan-mid@832x480x1", "thread_counts": "1", "rounds": 3, "warmup": 1}
MAX_DIFF = 1e-3  # fp32, the same function on each side: anything larger is a real mismatch, not rounding


# -- weights ------------------------------------------------------------------------------------------------------
def official_to_diffusers(model: Wan, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official Wan state dict -> diffusers ``WanTransformer3DModel`` names: the inverse of the LoRA loader's module
    map (``engine.lora.names``; ``patch_embedding`` is the same in both). Entries the map names whole
    (``blocks.N.modulation`` -> ``scale_shift_table``) are parameters, the others modules."""
    inverse = {}
    for foreign, targets in foreign_names("wan", model).items():
        (target,) = targets
        assert target.rows is None and target.transform is None and target.take is None, (foreign, target)
        inverse[target.module] = foreign
    out = {}
    for key, t in sd.items():
        if key in inverse:
            out[inverse[key]] = t
            continue
        module, leaf = key.rsplit(".", 1)
        out[f"{inverse.get(module, module)}.{leaf}"] = t
    return out


def diffusers_config(p: WanParams) -> dict:
    return {
        "patch_size": p.patch_size,
        "num_attention_heads": p.num_heads,
        "attention_head_dim": p.head_dim,
        "in_channels": p.in_dim,
        "out_channels": p.out_dim,
        "text_dim": p.text_dim,
        "freq_dim": p.freq_dim,
        "ffn_dim": p.ffn_dim,
        "num_layers": p.num_layers,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": p.eps,
    }


def ours_model(preset: str, seed: int) -> Wan:
    torch.manual_seed(seed)
    model = Wan(PRESETS[preset]).eval()
    with torch.no_grad():  # norms start at ones / zeros: values that would not show a misplaced norm weight
        for name, t in model.named_parameters():
            if ".norm" in name:
                t.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(t))
    return model


def diffusers_side(ours: Wan):
    import diffusers

    ref = diffusers.WanTransformer3DModel(**diffusers_config(ours.params)).eval()
    ref.load_state_dict(official_to_diffusers(ours, ours.state_dict()), strict=True)

    def call(inputs):
        return ref(inputs["x"], inputs["timestep"], inputs["context"], return_dict=False)[0]

    return ref, call


# -- ComfyUI ------------------------------------------------------------------------------------------------------
def find_comfyui(arg: str | None) -> list[Path]:
    """The ComfyUI checkouts named by ``--comfyui`` (comma-separated) or ``COMFYUI_DIR``; [] if none."""
    value = arg or os.environ.get("COMFYUI_DIR")
    dirs = [Path(d).expanduser() for d in value.split(",") if d] if value else []
    for d in dirs:
        if not (d / "comfy" / "ldm" / "wan" / "model.py").is_file():
            raise SystemExit(f"{d} is not a ComfyUI checkout (no comfy/ldm/wan/model.py)")
    return dirs


def comfyui_in_child(comfy_dir: Path, args) -> list[dict]:
    """This script run in a child process against one more ComfyUI checkout (ours and that ComfyUI only): its
    rows, whose ``comfyui`` peer becomes this run's ``comfyui <version>`` column."""
    with tempfile.TemporaryDirectory(prefix="fewstep-wan-peers-") as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, __file__, *_child_args(args), "--comfyui", str(comfy_dir), "--no-diffusers",
               "--rows-json", str(out)]  # fmt: skip
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def _child_args(args) -> list[str]:
    """The options of this run that a child repeats (every measurement option, not the ComfyUI ones)."""
    out = ["--cases", args.cases, "--txt", str(args.txt), "--rounds", str(args.rounds), "--warmup",
           str(args.warmup), "--seed", str(args.seed), "--clock", args.clock]  # fmt: skip
    out += ["--threads", str(args.threads)] if args.threads else ["--thread-counts", args.thread_counts]
    if args.comfyui_site:
        out += ["--comfyui-site", args.comfyui_site]
    return out


def import_comfy(comfy_dir: Path, site: str | None):
    """Import ComfyUI's Wan model code from ``comfy_dir`` with PyTorch SDPA attention: (``comfy.ldm.wan.model``,
    ``comfy.ops``, ComfyUI's version)."""
    sys.path.insert(0, str(comfy_dir))
    extra = None
    try:
        import psutil  # noqa: F401 - ComfyUI's model_management needs it
    except ImportError:
        extra = (
            Path(site)
            if site
            else next(iter(sorted((comfy_dir.parent / "venv").glob("lib/python3*/site-packages"))), None)
        )
        if extra is None or not extra.is_dir():
            raise SystemExit(
                "ComfyUI needs psutil, which this Python lacks: install it or name ComfyUI's site-packages "
                "with --comfyui-site"
            ) from None
        # after our own (torch and the rest still come from this environment), and only while ComfyUI's
        # modules load: packages found there would look installed to diffusers / transformers' optional imports
        sys.path.append(str(extra))
    try:
        import comfy.cli_args

        comfy.cli_args.args.cpu = True  # read when model_management loads
        comfy.cli_args.args.use_pytorch_cross_attention = True
        import comfy.ldm.modules.attention as attention
        import comfy.ldm.wan.model as wan_model
        import comfy.ops
    finally:
        if extra is not None:
            sys.path.remove(str(extra))

    if wan_model.optimized_attention is not attention.attention_pytorch:
        raise SystemExit(f"ComfyUI's Wan attention is {wan_model.optimized_attention.__name__}, not SDPA")
    try:
        from comfyui_version import __version__ as version
    except ImportError:
        version = "(unknown version)"
    return wan_model, comfy.ops, version


def comfyui_side(ours: Wan, wan_model, ops, _version=None):
    p = ours.params
    ref = wan_model.WanModel(
        model_type="t2v", patch_size=p.patch_size, text_len=p.text_len, in_dim=p.in_dim, dim=p.dim,
        ffn_dim=p.ffn_dim, freq_dim=p.freq_dim, text_dim=p.text_dim, out_dim=p.out_dim, num_heads=p.num_heads,
        num_layers=p.num_layers, qk_norm=True, cross_attn_norm=True, eps=p.eps, device=torch.device("cpu"),
        dtype=torch.float32, operations=ops.disable_weight_init,
    ).eval()  # fmt: skip
    ref.load_state_dict(ours.state_dict(), strict=True)  # ComfyUI's names are the official ones

    def call(inputs):
        return ref(inputs["x"], inputs["timestep"], inputs["context"])

    return ref, call


# -- one case -----------------------------------------------------------------------------------------------------
def parse_case(case: str) -> tuple[str, int, int, int]:
    """``preset@WxH[xF]`` (pixels, latent frames, default 1) -> (preset, width, height, frames)."""
    preset, size = case.split("@")
    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}: one of {', '.join(PRESETS)}")
    dims = [int(v) for v in size.lower().split("x")]
    w, h, f = (*dims, 1) if len(dims) == 2 else dims
    if w % 16 or h % 16:
        raise SystemExit(f"{size}: width and height must be multiples of 16 px")
    return preset, w, h, f


def make_inputs(p: WanParams, width: int, height: int, frames: int, txt: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed + 1)
    context = torch.zeros(1, p.text_len, p.text_dim)
    context[:, :txt] = torch.randn(1, txt, p.text_dim, generator=g)
    return {
        "x": torch.randn(1, p.in_dim, frames, height // 8, width // 8, generator=g),
        "timestep": torch.tensor([500.0]),
        "context": context,
    }


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def time_sides(sides: dict, rounds: int, warmup: int, clock: str = "wall") -> dict[str, list[float]]:
    """Seconds per call of each side, ``rounds`` each. ``clock="cpu"``: the process's CPU time (every thread's,
    OpenMP spin-waits included), which a busy machine inflates less than wall time when one thread runs."""
    now = CLOCKS[clock]
    for _ in range(warmup):
        for fn in sides.values():
            fn()
    names = list(sides)
    t = {k: [] for k in names}
    for r in range(rounds):  # the order rotates: a drift in machine load hits every side alike
        for k in names[r % len(names) :] + names[: r % len(names)]:
            t0 = now()
            sides[k]()
            t[k].append(now() - t0)
    return t


def profile_side(fn, top: int) -> list[tuple[str, float, int]]:
    """(op, self CPU ms per forward, calls per forward) of the ``top`` ops by self CPU time, one profiled forward."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in ops[:top]]


def print_profiles(case: str, threads: int, profiles: dict) -> None:
    print(f"\ntorch.profiler, {case}, {threads} thread(s): self CPU ms per forward (calls)\n")
    names = list(profiles)
    print("| rank | " + " | ".join(names) + " |")
    print("|---" * (1 + len(names)) + "|")
    for i in range(max(len(v) for v in profiles.values())):
        cells = [
            f"{profiles[k][i][0]} {profiles[k][i][1]:.1f} ({profiles[k][i][2]})"
            if i < len(profiles[k])
            else ""
            for k in names
        ]
        print(f"| {i + 1} | " + " | ".join(cells) + " |")
    print(
        "| total | "
        + " | ".join(f"{sum(ms for _, ms, _ in v):.1f} (top {len(v)})" for v in profiles.values())
    )


def run_case(case: str, threads: int, models: dict, args) -> dict:
    preset, w, h, f = parse_case(case)
    ours = models["ours"]
    p = ours.params
    inputs = make_inputs(p, w, h, f, args.txt, args.seed)
    setup_threads(threads)
    with torch.inference_mode():
        want = ours(inputs["x"], inputs["timestep"], inputs["context"])
        outs = {k: call(inputs) for k, (_, call) in models["peers"].items()}
        sides = {"ours": lambda: ours(inputs["x"], inputs["timestep"], inputs["context"])}
        sides |= {k: (lambda call=call: call(inputs)) for k, (_, call) in models["peers"].items()}
        t = time_sides(sides, args.rounds, args.warmup, args.clock)
        if args.profile:
            print_profiles(case, threads, {k: profile_side(fn, args.top) for k, fn in sides.items()})
    row = {
        "case": case,
        "preset": preset,
        "threads": threads,
        "tokens": f * tokens_per_frame(p, h // 8, w // 8),
        "text_tokens": args.txt,
        "rounds": args.rounds,
        "clock": args.clock,
        "ours_ms": median(t["ours"]) * 1e3,
        "max_abs_output": want.abs().max().item(),
        "peers": {},
    }
    for k, out in outs.items():
        ratios = [pt / o for o, pt in zip(t["ours"], t[k])]
        row["peers"][k] = {
            "ms": median(t[k]) * 1e3,
            "ratio": median(ratios),
            "ratio_min_max": [min(ratios), max(ratios)],
            "ratio_best_of": min(t[k]) / min(t["ours"]),
            "max_abs_diff": (out.float() - want).abs().max().item(),
        }
    return row


def describe(p: WanParams) -> str:
    return f"dim {p.dim}, {p.num_heads} heads x {p.head_dim}, ffn {p.ffn_dim}, {p.num_layers} blocks"


def print_results(rows: list[dict], peers: list[str]) -> None:
    print(
        f"fp32, CPU, {rows[0]['clock']} clock. Ratio = peer time / our time per round (above 1x ours is faster), median (min-max);"
    )
    print(
        "best-of = min peer / min ours. Same weights, same inputs; diff = max abs difference from our output.\n"
    )
    cols = "".join(f" {k} ms | {k} ratio (min-max) | best-of | diff |" for k in peers)
    print(f"| case | threads | tokens | ours ms |{cols}")
    print("|---" * (4 + 4 * len(peers)) + "|")
    for r in rows:
        cells = ""
        for k in peers:
            c = r["peers"][k]
            lo, hi = c["ratio_min_max"]
            cells += (
                f" {c['ms']:.0f} | **{c['ratio']:.2f}x** ({lo:.2f}-{hi:.2f}) | {c['ratio_best_of']:.2f}x "
                f"| {c['max_abs_diff']:.1e} |"
            )
        print(f"| {r['case']} | {r['threads']} | {r['tokens']} | {r['ours_ms']:.0f} |{cells}")
    print(f"\nlargest output magnitude {max(r['max_abs_output'] for r in rows):.2f}")
    for preset in dict.fromkeys(r["preset"] for r in rows):
        print(f"{preset}: {describe(PRESETS[preset])}")


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        for k, c in r["peers"].items():
            name = f"{r['case']}, {r['tokens']} tokens, {r['threads']} thr"
            out += peer_rows(
                f"Wan forward, {k} time / ours, {name}",
                f"Wan forward, max abs diff ours vs {k} (same weights), {name}",
                c, MAX_DIFF, f" (outputs up to {r['max_abs_output']:.2g})",
            )  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cases", default="wan-mid@832x480x1", help="preset@WxH[xF] (px, latent frames), comma-sep."
    )
    ap.add_argument(
        "--thread-counts", default="1,2", help="torch thread counts, comma-separated (--threads wins)"
    )
    ap.add_argument("--txt", type=int, default=64, help="umT5 tokens (zero-padded to 512 on every side)")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (one forward of each side) per case")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall (perf_counter) or cpu (process CPU time: steadier on a busy machine, at 1 thread)",
    )
    ap.add_argument(
        "--profile", action="store_true", help="torch.profiler: top ops by self CPU time, each side"
    )
    ap.add_argument("--top", type=int, default=12, help="ops listed per side with --profile")
    ap.add_argument("--comfyui", default=None, help="a ComfyUI checkout (default: $COMFYUI_DIR)")
    ap.add_argument(
        "--comfyui-site", default=None, help="site-packages with ComfyUI's deps (default DIR/../venv)"
    )
    ap.add_argument("--no-diffusers", action="store_true", help="leave diffusers' column out")
    ap.add_argument("--rows-json", default=None, help=argparse.SUPPRESS)  # a child run's rows, for its parent
    args = parse_args(ap, QUICK)
    diffusers = None
    if not args.no_diffusers:
        try:
            import diffusers
            from diffusers import WanTransformer3DModel  # noqa: F401 - resolved (lazily imported) before ComfyUI's
        except ImportError:
            raise SystemExit("needs diffusers (the test extra: pip install -e .[test])") from None
    thread_counts = [args.threads] if args.threads else [int(v) for v in args.thread_counts.split(",")]
    comfy_dirs = find_comfyui(args.comfyui)
    comfy = import_comfy(comfy_dirs[0], args.comfyui_site) if comfy_dirs else None

    setup_threads(thread_counts[0])
    env = header("Wan 2.1 DiT forward, ours vs diffusers and ComfyUI (CPU)")
    versions = {}
    if diffusers is not None:
        versions["diffusers"] = diffusers.__version__
        print(f"diffusers {diffusers.__version__}")
    if comfy is None:
        print("ComfyUI: not found (set COMFYUI_DIR or --comfyui DIR): its column is skipped")
    else:
        versions["comfyui"] = comfy[2]
        print(f"ComfyUI {comfy[2]} at {comfy_dirs[0]}: WanModel, attention_pytorch (SDPA), fp32 CPU")
    print(f"thread counts {thread_counts}; {args.txt} text tokens padded to 512; {args.clock} clock\n")

    rows = []
    for case in args.cases.split(","):
        preset = parse_case(case)[0]
        ours = ours_model(preset, args.seed)
        peers = {} if diffusers is None else {"diffusers": diffusers_side(ours)}
        if comfy is not None:
            peers[f"comfyui {comfy[2]}"] = comfyui_side(ours, *comfy)
        models = {"ours": ours, "peers": peers}
        for threads in thread_counts:
            rows.append(run_case(case, threads, models, args))
    if args.rows_json:
        Path(args.rows_json).write_text(json.dumps(rows))
        return
    for comfy_dir in comfy_dirs[1:]:  # one process per further ComfyUI version
        for row, child in zip(rows, comfyui_in_child(comfy_dir, args)):
            row["peers"] |= child["peers"]
            row.setdefault("ours_ms_by_peer", {}).update({k: child["ours_ms"] for k in child["peers"]})
        versions["comfyui_checkouts"] = [str(d) for d in comfy_dirs]
    print_results(rows, list(rows[0]["peers"]))
    save(
        "wan_vs_peers",
        {"env": env | versions, "quick": args.quick, "results": rows, "summary": summary(rows)},
    )


if __name__ == "__main__":
    main()
