"""``python -m fewstep demo``: the pack's showcase on dummy weights, on the CPU, in a few minutes.

Each section measures one thing the pack is about and adds rows to a report (``report.md`` and
``report.json`` in the output folder) next to the latents, images and the video it produced. Every timing is the
median of ``--repeats`` runs with its range; a figure shown in two sections is one measurement, quoted twice. The
machine section says what the timings ran beside: torch's thread count and the load average before and after,
and it flags a busy machine (load above the core count), whose timings are not to be compared.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass

import torch

from ..engine.causal import CausalConfig, VideoSession
from ..engine.handle import open_model
from ..engine.loader import load_dit
from ..engine.ops import weight_bytes
from ..engine.text_to_image import sample_latent
from ..engine.units import format_bytes
from ..engine.vae import load_tiny_vae
from ..engine.vae.flux_ae import load_flux_ae
from .common import (
    check_at_least,
    default_schedule,
    default_tiny_vae,
    latent_shape,
    synthetic_condition,
    write_json,
)
from .files import save_tensors
from .images import save_png
from .video import VIDEO_FPS, open_video

HELP = "run the showcase on dummy weights (CPU, a few minutes) and write outputs + report"


def add_arguments(p) -> None:
    p.add_argument(
        "--out", default="out/demo", help="output folder: report.md, report.json, latents, images and a video"
    )
    p.add_argument(
        "--model", default="flux-mid", help="dummy preset to showcase (flux-mid: FLUX blocks, 1024 wide)"
    )
    p.add_argument("--size", type=int, default=256, help="image side in pixels (multiple of 16)")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of every timed figure; the report gives their median and range",
    )


@dataclass
class Timing:
    """Seconds of repeated runs of one thing: shown as the median with the range."""

    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def text(self, scale: float = 1.0, unit: str = "s", digits: int = 2) -> str:
        lo, hi = min(self.samples) * scale, max(self.samples) * scale
        runs = len(self.samples)
        spread = f" ({lo:.{digits}f}-{hi:.{digits}f}, {runs} runs)" if runs > 1 else " (1 run)"
        return f"{self.median * scale:.{digits}f} {unit}" + spread

    def as_dict(self) -> dict:
        return {"median_s": self.median, "min_s": min(self.samples), "max_s": max(self.samples),
                "runs_s": list(self.samples)}  # fmt: skip


def timed(repeats: int, fn):
    """``fn()`` ``repeats`` times: (its last result, Timing of the runs)."""
    samples, result = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        samples.append(time.perf_counter() - t)
    return result, Timing(samples)


def machine_state() -> dict:
    """What the timings run beside: cores, torch's threads, the 1/5/15-minute load averages."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3
    return {"cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "load_average": list(load)}


class Report:
    """Sections of rows (label, value). The same rows go to the terminal, report.md and report.json: a value is
    a string, or a Timing (the median and range in the text, every run in the JSON). A section's ``data`` adds
    JSON-only detail (sigmas, shapes) beside its rows."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.sections: list[tuple[str, list[tuple[str, object]]]] = []
        self.data: dict = {}
        self.written: list[str] = []  # every file the demo wrote, in order, for the outputs rows

    def wrote(self, *paths: str) -> list[str]:
        self.written += paths
        return list(paths)

    def written_names(self, suffix: str) -> str:
        return ", ".join(os.path.basename(p) for p in self.written if p.endswith(suffix))

    def section(self, title: str, rows: list[tuple[str, object]], data: dict | None = None) -> None:
        self.sections.append((title, rows))
        assert "rows" not in (data or {}), "a section's detail must not hide its rows"
        self.data[title] = {
            "rows": {label: value.as_dict() if isinstance(value, Timing) else value for label, value in rows},
            **(data or {}),
        }
        print(f"\n## {title}")
        for label, value in rows:
            print(f"  {label}: {self.text(value)}")

    @staticmethod
    def text(value) -> str:
        return value.text() if isinstance(value, Timing) else str(value)

    def save_latent(self, name: str, latent: torch.Tensor) -> None:
        path = os.path.join(self.out_dir, f"{name}.safetensors")
        save_tensors({"latent": latent.contiguous()}, path)
        self.wrote(path)

    def write(self) -> None:
        lines = ["# fewstep demo report", ""]
        for title, rows in self.sections:
            lines += [f"## {title}", "", "| | |", "|---|---|"]
            lines += [f"| {label} | {self.text(value)} |" for label, value in rows] + [""]
        with open(os.path.join(self.out_dir, "report.md"), "w") as f:
            f.write("\n".join(lines))
        write_json(os.path.join(self.out_dir, "report.json"), self.data)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a - b) ** 2).mean())
    peak = float(b.abs().max()) or 1.0
    return math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)


def image_family_run(preset: str, size: int, report: Report, repeats: int) -> tuple[tuple[str, str], dict]:
    """Text-to-image runs of a dummy preset with its family's schedule, latent geometry and tiny decode."""
    handle = open_model(f"dummy:{preset}", device="cpu")
    family, params = handle.family, handle.params
    cond = synthetic_condition(family, params, 64, seed=1, guidance=None)
    schedule = default_schedule(family, params)
    latent = torch.zeros(latent_shape(family, 1, size, size))
    (out, rep), seconds = timed(
        repeats, lambda: sample_latent(handle, [cond], latent, seed=0, schedule=schedule, steps=None)
    )
    tiny = load_tiny_vae(default_tiny_vae(family), device="cpu")
    image = tiny.decode(tiny.raw_to_latent(out))
    images = report.wrote(*save_png(image, report.out_dir, f"{preset}_tiny"))
    row = (
        f"{preset} ({family.image.description})",
        f"{schedule}: {rep.model_calls} forwards, {seconds.text()}; LATENT {list(out.shape)}, "
        f"{tiny.variant.name} decode to {', '.join(os.path.basename(p) for p in images)}",
    )
    return row, {"schedule": schedule, "forwards": rep.model_calls, "latent_shape": list(out.shape),
                 "seconds": seconds.as_dict()}  # fmt: skip


def run(args) -> int:
    check_at_least(args, repeats=1)
    os.makedirs(args.out, exist_ok=True)
    torch.set_grad_enabled(False)
    repeats = args.repeats
    report = Report(args.out)
    before = machine_state()
    t0 = time.perf_counter()
    handle, load_s = timed(1, lambda: open_model(f"dummy:{args.model}", device="cpu"))
    cond = synthetic_condition(handle.family, handle.params, 64, seed=1, guidance=3.5)
    negative = synthetic_condition(handle.family, handle.params, 64, seed=2, guidance=3.5)
    latent = torch.zeros(1, 16, args.size // 8, args.size // 8)
    report.section(
        "model",
        [("model", handle.describe()), ("load (dummy init)", load_s), ("repeats per timing", str(repeats))],
    )

    def run_sampler(**kw):
        return timed(repeats, lambda: sample_latent(handle, [cond], latent, seed=0, **kw))

    # first-call setup (allocator, kernels' first dispatch) is not sampling time: one untimed step first
    sample_latent(handle, [cond], latent, seed=0, steps=1, schedule="flux.1-schnell")

    # 1. Step count is the biggest multiplier. The 4-step euler run is measured once, here, and quoted by the
    # sampler, CFG and decode sections (it is the same work).
    (few, r4), t4 = run_sampler(steps=4, schedule="flux.1-schnell", sampler="euler")
    (many, r28), t28 = run_sampler(steps=28, schedule="flux.1-dev", sampler="euler")
    report.save_latent("schnell_4step", few)
    report.save_latent("dev_28step", many)
    report.section(
        "few-step vs many-step",
        [
            (f"flux.1-schnell schedule, 4 steps ({r4.model_calls} forwards)", t4),
            (f"flux.1-dev schedule, 28 steps ({r28.model_calls} forwards)", t28),
            ("ratio of the medians", f"{t28.median / t4.median:.1f}x"),
        ],
        {"forwards": [r4.model_calls, r28.model_calls], "sigmas_4": r4.sigmas},
    )

    # 2. The few-step samplers on the same schedule and seed.
    rows, data = [], {}
    for name in ("euler", "dmd", "lcm", "tcd"):
        if name == "euler":
            out, seconds = few, t4
        else:
            (out, _), seconds = run_sampler(steps=4, schedule="flux.1-schnell", sampler=name)
        report.save_latent(f"sampler_{name}", out)
        rows += [(f"{name} seconds", seconds), (f"{name} latent std", f"{float(out.std()):.3f}")]
        data[name] = {"std": float(out.std())}
    report.section("samplers (4 steps)", rows, data)

    # 3. CFG costs a second row per forward only when it is actually used: the rows say it, the seconds of a
    # busy machine may not (see the machine section).
    (_, cfg1), t_cfg1 = timed(
        repeats, lambda: sample_latent(handle, [cond], latent, negative=[negative], seed=0, steps=4, cfg=1.0)
    )
    (_, cfg35), t_cfg35 = timed(
        repeats, lambda: sample_latent(handle, [cond], latent, negative=[negative], seed=0, steps=4, cfg=3.5)
    )
    counts = [(r4.model_calls, r4.rows_evaluated), (cfg1.model_calls, cfg1.rows_evaluated),
              (cfg35.model_calls, cfg35.rows_evaluated)]  # fmt: skip
    report.section(
        "CFG",
        [
            ("no negative: forwards, rows", f"{counts[0][0]}, {counts[0][1]}"),
            ("no negative seconds", t4),
            ("negative, cfg 1: forwards, rows", f"{counts[1][0]}, {counts[1][1]} (negative skipped)"),
            ("negative, cfg 1 seconds", t_cfg1),
            ("negative, cfg 3.5: forwards, rows", f"{counts[2][0]}, {counts[2][1]}"),
            ("negative, cfg 3.5 seconds", t_cfg35),
            (
                "cfg 3.5 / no negative, medians",
                f"{t_cfg35.median / t4.median:.2f}x (rows: {counts[2][1] / counts[0][1]:.0f}x)",
            ),
        ],
        {"rows_evaluated": [c[1] for c in counts], "forwards": [c[0] for c in counts]},
    )

    # 4. fp8 weight storage: half of bf16's bytes, upcast per layer.
    fp8 = open_model(f"dummy:{args.model}", device="cpu", weight_dtype=torch.float8_e4m3fn)
    bf16 = open_model(f"dummy:{args.model}", device="cpu", weight_dtype=torch.bfloat16)
    (out8, _), t8 = timed(repeats, lambda: sample_latent(fp8, [cond], latent, seed=0, steps=4))
    b32, b16, b8 = weight_bytes(handle.model), weight_bytes(bf16.model), weight_bytes(fp8.model)
    report.save_latent("schnell_4step_fp8", out8)
    report.section(
        "weight storage",
        [
            ("fp32 / bf16 / fp8 weights", f"{b32 / 2**20:.1f} / {b16 / 2**20:.1f} / {b8 / 2**20:.1f} MiB"),
            ("fp8 / bf16 bytes", f"{b8 / b16:.3f}"),
            ("fp8 vs fp32 latent PSNR", f"{psnr(out8, few):.1f} dB (same seed, 4 steps)"),
            ("fp8 sampling seconds (upcast per layer on the CPU)", t8),
            ("fp32 sampling seconds", t4),
        ],
        {"bytes": [b32, b16, b8]},
    )

    # 5. The VAE is a large share of a 4-step run: tiny vs full decode of the same latent.
    tiny = load_tiny_vae("dummy:taef1", device="cpu")
    full = load_flux_ae("dummy:flux1-ae", device="cpu")
    with torch.inference_mode():  # first-call kernel setup is not decode time
        tiny.decode(torch.zeros(1, 16, 2, 2))
        full.decode(torch.zeros(1, 16, 2, 2))
        tiny_img, tiny_s = timed(repeats, lambda: tiny.decode(tiny.raw_to_latent(few)))
        full_img, full_s = timed(repeats, lambda: full.decode(few))
    written = report.wrote(
        *save_png(tiny_img, args.out, "decode_tiny"), *save_png(full_img, args.out, "decode_full")
    )
    report.section(
        "decode: tiny vs full autoencoder",
        [
            ("TAEF1 decode", tiny_s),
            ("FLUX.1 autoencoder decode", full_s),
            ("full / tiny, medians", f"{full_s.median / tiny_s.median:.0f}x"),
            ("4-step sampling seconds (the run above)", t4),
            ("images", ", ".join(os.path.basename(p) for p in written) + " (dummy weights: noise)"),
        ],
    )

    # 6. The other image families through the same sampler, each on its own default schedule, latent geometry
    # and tiny AE. Test-size presets: this section shows the paths (forwards, shapes), not speed.
    rows, data = [], {}
    for preset in ("flux2-tiny", "zimage-tiny"):
        row, data[preset] = image_family_run(preset, args.size, report, repeats)
        rows.append(row)
    report.section("FLUX.2 and Z-Image", rows, data)

    # 7. Causal video: chunk by chunk, a rolling KV window, each chunk decoded by the tiny VAE as it lands and
    # encoded into the video at once (the writer stream --out uses). One stream: its later chunks are the
    # repeats of the same work (the window is full), the first chunk's latency is one run.
    wan = load_dit("dummy:wan-mid" if args.model != "flux-tiny" else "dummy:wan-tiny", device="cpu")
    context = torch.randn(1, 32, wan.params.text_dim, generator=torch.Generator().manual_seed(3))
    config = CausalConfig(chunk_frames=3, window_frames=9, sink_frames=3)
    height, width = 64, 96
    session = VideoSession(
        wan, context, height, width, config, seed=0, tiny_vae=load_tiny_vae("dummy:taew2_1")
    )
    video = open_video(os.path.join(args.out, "stream"), width, height)
    chunks = []
    try:
        for chunk in session.chunks(5):
            video.append(chunk.frames[0])
            chunks.append(chunk)
        video.close()
    finally:
        video.abandon()
    report.wrote(video.path)
    save_tensors(
        {"latent": torch.cat([c.raw for c in chunks], dim=2).contiguous(),
         "frames": torch.cat([c.frames for c in chunks], dim=1).contiguous()},
        report.wrote(os.path.join(args.out, "stream.safetensors"))[0],
    )  # fmt: skip
    later = Timing([c.seconds for c in chunks[1:]])
    report.section(
        "causal video stream",
        [
            (
                "model",
                f"dummy Wan ({wan.params.dim} wide, {wan.params.num_layers} layers), {height}x{width} px, "
                f"chunks of 3 latent frames, window 9, 3 sink frames",
            ),  # fmt: skip
            ("seconds per chunk", ", ".join(f"{c.seconds:.2f}" for c in chunks)),
            ("first chunk latency", Timing([session.stats.first_chunk_seconds])),
            ("later chunks", later),
            (
                "KV cache",
                f"{format_bytes(chunks[-1].kv_bytes)} allocated (flat), used per chunk: "
                + ", ".join(format_bytes(c.kv_bytes_used) for c in chunks),
            ),  # fmt: skip
            (
                "video",
                f"{os.path.basename(video.path)}: {video.frames} frames at {VIDEO_FPS} fps, decoded and encoded "
                "as they were generated (latents and frames also in stream.safetensors)",
            ),
        ],
        {"seconds": [c.seconds for c in chunks], "kv_bytes_used": [c.kv_bytes_used for c in chunks],
         "video": video.path, "video_frames": video.frames},
    )  # fmt: skip
    session.dispose()

    after = machine_state()
    loads = before["load_average"][:1] + after["load_average"][:1]
    busy = any(load > after["cores"] for load in loads)
    report.section(
        "machine",
        [
            ("cores / torch threads", f"{after['cores']} / {after['torch_threads']}"),
            ("load average before (1, 5, 15 min)", ", ".join(f"{x:.2f}" for x in before["load_average"])),
            ("load average after (1, 5, 15 min)", ", ".join(f"{x:.2f}" for x in after["load_average"])),
            (
                "busy machine",
                f"yes: the load ({max(loads):.2f}) is above the {after['cores']} cores; the timings above ran beside "
                "other work, compare their rows and forwards, not their seconds"
                if busy
                else "no",
            ),
        ],
        {"before": before, "after": after, "busy": busy},
    )
    report.wrote(os.path.join(args.out, "report.md"), os.path.join(args.out, "report.json"))
    outputs = [
        ("images", report.written_names(".png")),
        ("video", report.written_names(os.path.splitext(video.path)[1])),
        ("latents", report.written_names(".safetensors")),
        ("report", report.written_names("report.md") + ", " + report.written_names("report.json")),
    ]
    report.section(
        "total",
        [("demo wall time", Timing([time.perf_counter() - t0])), ("outputs", args.out), *outputs],
    )
    report.write()
    if busy:
        print(f"\nwarning: busy machine (load {max(loads):.2f} on {after['cores']} cores): the timings are not "
              "comparable")  # fmt: skip
    print(f"\nwrote {len(report.written)} files to {args.out}: the outputs rows above")
    return 0
