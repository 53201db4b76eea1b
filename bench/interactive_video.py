"""Interactive video on CPU: a prefill per frame, a prompt switch's re-cache and a video-to-video chunk, each
against a text-to-video chunk of the same session settings, side by side in one run.

    python bench/interactive_video.py --threads 1    # wan-tiny 128x128 and wan-mid 208x112, windows 6, 12, 21
    python bench/interactive_video.py --quick        # wan-tiny 128x128, windows 6 and 12, 2 rounds (< 1 min)
    python bench/interactive_video.py --cases wan-mid@416x240 --windows 21 --rounds 1

Per case (``preset@WxH``: dummy weights, fp32; chunk 3 latent frames, 4 steps of ``wan-dmd-4step``, no sinks) and
per window, four sessions of the same settings are brought to a full window (so every chunk reads the whole
window: the steady state), then each round times, in an order that rotates per round:

* **T2V chunk**: one text-to-video chunk (4 denoising forwards + the previous chunk's clean-context pass);
* **V2V chunk** at strength 0.5 and 1.0: one input chunk restyled (``feed`` + ``set_strength``): the schedule's
  sigmas below the strength (1 step at 0.5, 4 at 1.0 on ``wan-dmd-4step``), no clean-context pass;
* **re-cache**: ``set_prompt(..., recache=True)`` on the T2V session, alternating two prompts: one forward over
  the window's frames (past the window's first fill: all of them, no sinks here), ``RecacheReport.seconds``;
* **prefill**: a new session's ``prefill`` of the window's frames (whole chunks, one forward each at timestep 0)
  and of one frame (an image), ``PrefillResult.seconds`` per frame.

Ratios per round, median (min-max): prefill seconds per frame / a T2V chunk's seconds per frame; re-cache seconds /
a T2V chunk's seconds; V2V / T2V seconds per chunk. The forward-count prediction stands beside each (a prefill
block is 1 forward of a chunk's frames against a chunk's 5; V2V is n steps against 5 forwards; a re-cache is one
forward over the window's frames, window / chunk times a chunk forward's queries against the same keys, so
(window / chunk) / 5 of a chunk).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from _common import RESULTS, header, median, parse_args, parse_px, save, setup_threads, summary_row

from fewstep.engine import load_dit
from fewstep.engine.causal import CausalConfig, VideoSession
from fewstep.engine.causal.video_to_video import v2v_sigmas

STEPS = 4
STRENGTHS = (0.5, 1.0)
QUICK = {"cases": "wan-tiny@128x128", "windows": "6,12", "rounds": 2}


def one_chunk(session: VideoSession):
    return next(iter(session.chunks(1)))


class Case:
    """The sessions of one (model, size, window): T2V, V2V at each strength, and the prompts and inputs."""

    def __init__(self, model, w: int, h: int, chunk: int, window: int, txt: int):
        p = model.params
        gen = torch.Generator().manual_seed(0)
        self.prompts = [torch.randn(1, txt, p.text_dim, generator=gen) for _ in range(2)]
        self.model, self.w, self.h, self.chunk, self.window = model, w, h, chunk, window
        self.config = CausalConfig(chunk, window, 0, steps=STEPS)
        self.shape = (1, p.in_dim, chunk, h // 8, w // 8)
        self.inputs = torch.randn(*self.shape, generator=gen)
        self.t2v = self.open()
        # its own session: a re-cache commits the pending chunk first, which would leave the next T2V chunk of a
        # shared session without its clean-context pass (a cheaper chunk, a biased baseline)
        self.switcher = self.open()
        self.v2v = {s: self.open() for s in STRENGTHS}
        fill = -(-window // chunk) + 1  # the window full and one chunk past it (its commit carried)
        for _ in range(fill):
            one_chunk(self.t2v)
            one_chunk(self.switcher)
        for s, session in self.v2v.items():
            for _ in range(fill - 1):
                one_chunk(session)  # text to video until the window is full, then its input chunks
            session.set_strength(s)
            self.v2v_chunk(session)  # the last text-to-video chunk's commit is carried by this one
        self.switches = 0

    def open(self) -> VideoSession:
        return VideoSession(self.model, self.prompts[0], self.h, self.w, self.config, seed=0)

    def t2v_chunk(self) -> float:
        return one_chunk(self.t2v).seconds

    def v2v_chunk(self, session: VideoSession) -> float:
        session.feed(self.inputs)
        return one_chunk(session).seconds

    def recache(self) -> tuple[float, int]:
        self.switches += 1
        report = self.switcher.set_prompt(self.prompts[self.switches % 2], recache=True)
        return report.seconds, report.frames

    def prefill(self, frames: int) -> float:
        session = self.open()
        try:
            latents = torch.randn(
                1, self.shape[1], frames, *self.shape[3:], generator=torch.Generator().manual_seed(1)
            )
            return session.prefill(latents).seconds_per_frame
        finally:
            session.dispose()

    def close(self) -> None:
        for session in (self.t2v, self.switcher, *self.v2v.values()):
            session.dispose()


def measure(case: Case, rounds: int) -> dict:
    window = case.window
    whole = window - window % case.chunk  # the window's whole chunks (a video extension of them)
    parts = ["t2v", *(f"v2v {s:g}" for s in STRENGTHS), "recache", "prefill", "prefill 1"]
    times: dict[str, list[float]] = {k: [] for k in parts}
    recached = set()
    for r in range(rounds):
        order = parts[r % len(parts) :] + parts[: r % len(parts)]
        for part in order:
            if part == "t2v":
                times[part].append(case.t2v_chunk())
            elif part.startswith("v2v"):
                times[part].append(case.v2v_chunk(case.v2v[float(part.split()[1])]))
            elif part == "recache":
                seconds, frames = case.recache()
                times[part].append(seconds)
                recached.add(frames)
            elif part == "prefill":
                times[part].append(case.prefill(whole))
            else:
                times[part].append(case.prefill(1))
    t2v = times["t2v"]
    per_frame = [t / case.chunk for t in t2v]
    forwards = STEPS + 1  # a steady T2V chunk: its denoising steps and the previous chunk's clean pass

    def ratios(xs, ys):
        values = [x / y for x, y in zip(xs, ys)]
        return {"median": median(values), "min": min(values), "max": max(values)}

    out = {
        "window_frames": window,
        "t2v_chunk_s": median(t2v),
        "t2v_chunk_s_all": t2v,
        "prefill_frames": whole,
        "prefill_s_per_frame": median(times["prefill"]),
        "prefill_one_frame_s": median(times["prefill 1"]),
        "prefill_vs_chunk_per_frame": ratios(times["prefill"], per_frame),
        "prefill_one_frame_vs_chunk_per_frame": ratios(times["prefill 1"], per_frame),
        "prefill_predicted": 1 / forwards,
        "recache_frames": sorted(recached),
        "recache_s": median(times["recache"]),
        "recache_vs_chunk": ratios(times["recache"], t2v),
        "recache_predicted": (window / case.chunk) / forwards,
        "v2v": {},
    }
    for s in STRENGTHS:
        key = f"v2v {s:g}"
        steps = len(v2v_sigmas(case.t2v.sigmas, s)) - 1
        out["v2v"][f"{s:g}"] = {
            "steps": steps,
            "chunk_s": median(times[key]),
            "chunk_s_all": times[key],
            "vs_t2v": ratios(times[key], t2v),
            "predicted": steps / forwards,
        }
    return out


def run_case(preset: str, size: str, args) -> dict:
    w, h = parse_px(size)
    torch.manual_seed(0)
    model = load_dit(f"dummy:{preset}")
    p = model.params
    print(f"### {preset} at {size} px (dim {p.dim}, {p.num_layers} layers), chunk {args.chunk} latent frames\n",
          flush=True)  # fmt: skip
    rows = []
    for window in (int(x) for x in args.windows.split(",")):
        case = Case(model, w, h, args.chunk, window, args.txt)
        try:
            rows.append(measure(case, args.rounds))
        finally:
            case.close()
    return {"preset": preset, "size": size, "rows": rows}


def fmt(r: dict) -> str:
    return f"**{r['median']:.2f}** ({r['min']:.2f}-{r['max']:.2f})"


def print_case(res: dict, rounds: int) -> None:
    print(f"Median over {rounds} rounds (min-max); forward-count prediction in brackets.\n")
    print("| window | T2V chunk s | prefill s/frame / chunk s/frame (whole chunks) | prefill of 1 frame / chunk "
          "s/frame | re-cache s / chunk s (frames) | V2V 0.5 / T2V chunk | V2V 1.0 / T2V chunk |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        v = r["v2v"]
        print(f"| {r['window_frames']} | {r['t2v_chunk_s']:.4f} | {fmt(r['prefill_vs_chunk_per_frame'])} "
              f"[{r['prefill_predicted']:.2f}] | {fmt(r['prefill_one_frame_vs_chunk_per_frame'])} "
              f"| {fmt(r['recache_vs_chunk'])} ({', '.join(map(str, r['recache_frames']))}) "
              f"[{r['recache_predicted']:.2f}] | {fmt(v['0.5']['vs_t2v'])} [{v['0.5']['predicted']:.2f}] "
              f"| {fmt(v['1']['vs_t2v'])} [{v['1']['predicted']:.2f}] |")  # fmt: skip
    print()


def summary(cases: list[dict]) -> list[dict]:
    out = []
    for c in cases:
        for r in c["rows"]:
            label = f"interactive video, {c['preset']} {c['size']}, window {r['window_frames']}"
            v = r["v2v"]
            out.append(summary_row(f"{label}: prefill / T2V chunk, seconds per frame",
                                   f"{r['prefill_vs_chunk_per_frame']['median']:.2f}x"))  # fmt: skip
            out.append(summary_row(f"{label}: re-cache / T2V chunk seconds",
                                   f"{r['recache_vs_chunk']['median']:.2f}x"))  # fmt: skip
            out.append(summary_row(f"{label}: V2V / T2V chunk seconds, strength 0.5 / 1.0",
                                   f"{v['0.5']['vs_t2v']['median']:.2f}x / {v['1']['vs_t2v']['median']:.2f}x"))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="wan-tiny@128x128,wan-mid@208x112", help="preset@WxH, comma-separated")
    ap.add_argument("--windows", default="6,12,21", help="KV windows in latent frames, comma-separated")
    ap.add_argument(
        "--rounds", type=int, default=5, help="timed rounds (each: every part once, order rotating)"
    )
    ap.add_argument("--chunk", type=int, default=3, help="latent frames per chunk")
    ap.add_argument("--txt", type=int, default=32, help="prompt tokens (padded to 512 by the model)")
    ap.add_argument(
        "--out", default=None, help=f"JSON results file (default: {RESULTS}/interactive_video.json)"
    )
    args = parse_args(ap, QUICK)
    setup_threads(args.threads)
    env = header(
        "Interactive video: prefill, re-cache and video to video against a text-to-video chunk (CPU)"
    )
    print(f"chunk {args.chunk} latent frames, {STEPS} steps (wan-dmd-4step), fp32, windows {args.windows}, "
          f"{args.rounds} rounds\n")  # fmt: skip
    cases = []
    started = time.perf_counter()
    for spec in args.cases.split(","):
        preset, size = spec.split("@")
        res = run_case(preset, size, args)
        print_case(res, args.rounds)
        cases.append(res)
    payload = {"env": env, "chunk_frames": args.chunk, "steps": STEPS, "rounds": args.rounds, "cases": cases,
               "quick": args.quick, "wall_s": time.perf_counter() - started, "summary": summary(cases)}  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nresults: {args.out}")
    else:
        save("interactive_video", payload)


if __name__ == "__main__":
    main()
