"""``python -m fewstep demo``: the pack's showcase on dummy weights, on the CPU, in about a minute.

Each section measures one thing the pack is about and adds rows to a report (``report.md`` and
``report.json`` in the output folder) next to the latents it produced. Later features add sections.
"""

from __future__ import annotations

import math
import os
import time

import torch

from ..engine.causal import CausalConfig, VideoSession
from ..engine.handle import open_model
from ..engine.loader import load_dit
from ..engine.ops import weight_bytes
from ..engine.text_to_image import sample_latent
from ..engine.vae import load_tiny_vae
from ..engine.vae.flux_ae import load_flux_ae
from .common import (
    default_schedule,
    default_tiny_vae,
    latent_shape,
    synthetic_condition,
    write_json,
)
from .files import save_tensors
from .images import save_png

HELP = "run the showcase on dummy weights (CPU, ~1 minute) and write outputs + report"


def add_arguments(p) -> None:
    p.add_argument(
        "--out", default="out/demo", help="output folder: report.md, report.json, latents, images and a video"
    )
    p.add_argument(
        "--model", default="flux-mid", help="dummy preset to showcase (flux-mid: FLUX blocks, 1024 wide)"
    )
    p.add_argument("--size", type=int, default=256, help="image side in pixels (multiple of 16)")


class Report:
    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.sections: list[tuple[str, list[tuple[str, str]]]] = []
        self.data: dict = {}

    def section(self, title: str, rows: list[tuple[str, str]], data: dict) -> None:
        self.sections.append((title, rows))
        self.data[title] = data
        print(f"\n## {title}")
        for k, v in rows:
            print(f"  {k}: {v}")

    def save_latent(self, name: str, latent: torch.Tensor) -> None:
        save_tensors({"latent": latent.contiguous()}, os.path.join(self.out_dir, f"{name}.safetensors"))

    def write(self) -> None:
        lines = ["# fewstep demo report", ""]
        for title, rows in self.sections:
            lines += [f"## {title}", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows] + [""]
        with open(os.path.join(self.out_dir, "report.md"), "w") as f:
            f.write("\n".join(lines))
        write_json(os.path.join(self.out_dir, "report.json"), self.data)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a - b) ** 2).mean())
    peak = float(b.abs().max()) or 1.0
    return math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)


def image_family_run(preset: str, size: int, out_dir: str) -> tuple[tuple[str, str], dict]:
    """One text-to-image run of a dummy preset with its family's schedule, latent geometry and tiny decode."""
    handle = open_model(f"dummy:{preset}", device="cpu")
    family, params = handle.family, handle.params
    cond = synthetic_condition(family, params, 64, seed=1, guidance=None)
    schedule = default_schedule(family, params)
    latent = torch.zeros(latent_shape(family, 1, size, size))
    out, rep = sample_latent(handle, [cond], latent, seed=0, schedule=schedule, steps=None)
    tiny = load_tiny_vae(default_tiny_vae(family), device="cpu")
    image = tiny.decode(tiny.raw_to_latent(out))
    save_png(image, out_dir, f"{preset}_tiny")
    row = (
        f"{preset} ({family.image.description})",
        f"{schedule}: {rep.model_calls} forwards, {rep.seconds_total:.2f} s; LATENT {list(out.shape)}, "
        f"{tiny.variant.name} decode",
    )
    return row, {"schedule": schedule, "forwards": rep.model_calls, "latent_shape": list(out.shape),
                 "seconds": rep.seconds_total}  # fmt: skip


def run(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    torch.set_grad_enabled(False)
    report = Report(args.out)
    t0 = time.perf_counter()
    handle = open_model(f"dummy:{args.model}", device="cpu")
    load_s = time.perf_counter() - t0
    cond = synthetic_condition(handle.family, handle.params, 64, seed=1, guidance=3.5)
    negative = synthetic_condition(handle.family, handle.params, 64, seed=2, guidance=3.5)
    latent = torch.zeros(1, 16, args.size // 8, args.size // 8)
    report.section(
        "model",
        [("model", handle.describe()), ("load (dummy init)", f"{load_s:.2f} s")],
        {"describe": handle.describe(), "load_s": load_s},
    )

    def run_sampler(**kw):
        return sample_latent(handle, [cond], latent, seed=0, **kw)

    # 1. Step count is the biggest multiplier.
    few, r4 = run_sampler(steps=4, schedule="flux.1-schnell", sampler="euler")
    many, r28 = run_sampler(steps=28, schedule="flux.1-dev", sampler="euler")
    report.save_latent("schnell_4step", few)
    report.save_latent("dev_28step", many)
    report.section(
        "few-step vs many-step",
        [
            ("flux.1-schnell schedule, 4 steps", f"{r4.seconds_total:.2f} s, {r4.model_calls} forwards"),
            ("flux.1-dev schedule, 28 steps", f"{r28.seconds_total:.2f} s, {r28.model_calls} forwards"),
            ("ratio", f"{r28.seconds_total / r4.seconds_total:.1f}x"),
        ],
        {"seconds_4": r4.seconds_total, "seconds_28": r28.seconds_total, "sigmas_4": r4.sigmas},
    )

    # 2. The few-step samplers on the same schedule and seed.
    rows, data = [], {}
    for name in ("euler", "dmd", "lcm", "tcd"):
        out, rep = run_sampler(steps=4, schedule="flux.1-schnell", sampler=name)
        report.save_latent(f"sampler_{name}", out)
        rows.append((name, f"{rep.seconds_total:.2f} s, latent std {float(out.std()):.3f}"))
        data[name] = {"seconds": rep.seconds_total, "std": float(out.std())}
    report.section("samplers (4 steps)", rows, data)

    # 3. CFG costs a second row per forward only when it is actually used.
    _, no_cfg = run_sampler(steps=4, schedule="flux.1-schnell", sampler="euler", cfg=1.0)
    _, cfg1 = sample_latent(handle, [cond], latent, negative=[negative], seed=0, steps=4, cfg=1.0)
    _, cfg35 = sample_latent(handle, [cond], latent, negative=[negative], seed=0, steps=4, cfg=3.5)
    report.section(
        "CFG",
        [
            (
                "no negative",
                f"{no_cfg.model_calls} forwards, {no_cfg.rows_evaluated} rows, {no_cfg.seconds_total:.2f} s",
            ),
            (
                "negative, cfg 1",
                f"{cfg1.model_calls} forwards, {cfg1.rows_evaluated} rows (negative skipped)",
            ),
            (
                "negative, cfg 3.5",
                f"{cfg35.model_calls} forwards, {cfg35.rows_evaluated} rows, {cfg35.seconds_total:.2f} s",
            ),
        ],
        {"rows": [no_cfg.rows_evaluated, cfg1.rows_evaluated, cfg35.rows_evaluated]},
    )

    # 4. fp8 weight storage: half of bf16's bytes, upcast per layer.
    fp8 = open_model(f"dummy:{args.model}", device="cpu", weight_dtype=torch.float8_e4m3fn)
    bf16 = open_model(f"dummy:{args.model}", device="cpu", weight_dtype=torch.bfloat16)
    out8, rep8 = sample_latent(fp8, [cond], latent, seed=0, steps=4)
    b32, b16, b8 = weight_bytes(handle.model), weight_bytes(bf16.model), weight_bytes(fp8.model)
    report.save_latent("schnell_4step_fp8", out8)
    report.section(
        "weight storage",
        [
            ("fp32 / bf16 / fp8 weights", f"{b32 / 2**20:.1f} / {b16 / 2**20:.1f} / {b8 / 2**20:.1f} MiB"),
            ("fp8 / bf16 bytes", f"{b8 / b16:.3f}"),
            ("fp8 vs fp32 latent PSNR", f"{psnr(out8, few):.1f} dB (same seed, 4 steps)"),
            ("fp8 sampling time", f"{rep8.seconds_total:.2f} s (upcast per layer on the CPU)"),
        ],
        {"bytes": [b32, b16, b8]},
    )

    # 5. The VAE is a large share of a 4-step run: tiny vs full decode of the same latent.
    tiny = load_tiny_vae("dummy:taef1", device="cpu")
    full = load_flux_ae("dummy:flux1-ae", device="cpu")
    with torch.inference_mode():  # first-call kernel setup is not decode time
        tiny.decode(torch.zeros(1, 16, 2, 2))
        full.decode(torch.zeros(1, 16, 2, 2))
    t = time.perf_counter()
    tiny_img = tiny.decode(tiny.raw_to_latent(few))
    tiny_s = time.perf_counter() - t
    t = time.perf_counter()
    with torch.inference_mode():
        full_img = full.decode(few)
    full_s = time.perf_counter() - t
    written = save_png(tiny_img, args.out, "decode_tiny") + save_png(full_img, args.out, "decode_full")
    report.section(
        "decode: tiny vs full autoencoder",
        [
            ("TAEF1 decode", f"{tiny_s * 1000:.0f} ms"),
            ("FLUX.1 autoencoder decode", f"{full_s * 1000:.0f} ms"),
            ("full / tiny", f"{full_s / tiny_s:.0f}x"),
            ("4-step sampling vs full decode", f"{r4.seconds_total:.2f} s vs {full_s:.2f} s"),
            ("images", ", ".join(os.path.basename(p) for p in written) + " (dummy weights: noise)"),
        ],
        {"tiny_s": tiny_s, "full_s": full_s},
    )

    # 6. The other image families through the same sampler, each on its own default schedule, latent geometry
    # and tiny AE. Test-size presets: this section shows the paths (forwards, shapes), not speed.
    rows, data = [], {}
    for preset in ("flux2-tiny", "zimage-tiny"):
        row, data[preset] = image_family_run(preset, args.size, args.out)
        rows.append(row)
    report.section("FLUX.2 and Z-Image", rows, data)

    # 7. Causal video: chunk by chunk, a rolling KV window, each chunk decoded by the tiny VAE as it lands.
    wan = load_dit("dummy:wan-mid" if args.model != "flux-tiny" else "dummy:wan-tiny", device="cpu")
    context = torch.randn(1, 32, wan.params.text_dim, generator=torch.Generator().manual_seed(3))
    config = CausalConfig(chunk_frames=3, window_frames=9, sink_frames=3)
    session = VideoSession(wan, context, 64, 96, config, seed=0, tiny_vae=load_tiny_vae("dummy:taew2_1"))
    chunks = session.run(5)
    save_tensors(
        {"latent": torch.cat([c.raw for c in chunks], dim=2).contiguous(),
         "frames": torch.cat([c.frames for c in chunks], dim=1).contiguous()},
        os.path.join(args.out, "stream.safetensors"),
    )  # fmt: skip
    report.section(
        "causal video stream",
        [
            (
                "model",
                f"dummy Wan ({wan.params.dim} wide, {wan.params.num_layers} layers), 64x96 px, "
                f"chunks of 3 latent frames, window 9, 3 sink frames",
            ),  # fmt: skip
            ("seconds per chunk", ", ".join(f"{c.seconds:.2f}" for c in chunks)),
            ("first chunk latency", f"{session.stats.first_chunk_seconds:.2f} s"),
            (
                "KV cache",
                f"{chunks[-1].kv_bytes} B allocated (flat), used per chunk: "
                + ", ".join(str(c.kv_bytes_used) for c in chunks),
            ),  # fmt: skip
            (
                "frames",
                f"{sum(c.frames.shape[1] for c in chunks)} decoded as they were generated (stream.safetensors)",
            ),
        ],
        {"seconds": [c.seconds for c in chunks], "kv_bytes_used": [c.kv_bytes_used for c in chunks]},
    )
    session.dispose()

    report.section(
        "total",
        [("demo wall time", f"{time.perf_counter() - t0:.1f} s"), ("outputs", args.out)],
        {"seconds": time.perf_counter() - t0},
    )
    report.write()
    return 0
