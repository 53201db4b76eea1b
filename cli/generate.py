"""``python -m fewstep generate``: one sample, written as a raw latent with per-stage timings."""

from __future__ import annotations

import os
import time

import torch
from safetensors.torch import save_file

from ..engine.checks import check_finite_number, check_seed
from ..engine.handle import open_model
from ..engine.ops import COMPUTE_DTYPES, WEIGHT_DTYPES
from ..engine.sampling import SCHEDULES
from ..engine.text_to_image import check_image_model, sample_latent
from .common import (
    DEFAULT_SCHEDULE,
    add_model_arguments,
    add_sampling_arguments,
    check_at_least,
    check_size,
    load_condition,
    prepare_out,
    source_of,
    synthetic_condition,
    write_json,
)
from .images import decode_raw, save_png

HELP = "sample one latent (ComfyUI raw VAE space) and write it with per-stage timings"


def add_arguments(p) -> None:
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.add_argument("--out", default="out/generate", help="output folder")
    p.add_argument(
        "--decode",
        default="none",
        choices=["none", "tiny", "full"],
        help="also write image.png: tiny (TAEF1) or full (FLUX.1 autoencoder)",
    )
    p.add_argument(
        "--tiny-vae", default="dummy:taef1", help="with --decode tiny: taef1_decoder.pth or dummy:taef1"
    )
    p.add_argument(
        "--ae", default="dummy:flux1-ae", help="with --decode full: ae.safetensors or dummy:flux1-ae"
    )


def run(args) -> int:
    check_size(args.height, args.width)
    check_at_least(args, batch=1, tokens=1, steps=1)
    check_seed(args.seed)
    if args.negative_seed is not None:
        check_seed(args.negative_seed, "--negative-seed")
    check_finite_number(args.guidance, "--guidance")
    check_finite_number(args.cfg, "--cfg")
    prepare_out(args.out)  # before loading anything: a bad --out fails at once
    timings = {}
    t = time.perf_counter()
    dummy = args.weights == "dummy"
    handle = open_model(
        source_of(args),
        weight_dtype=WEIGHT_DTYPES[args.weight_dtype],
        dtype=COMPUTE_DTYPES[args.dtype],
        device=args.device,
        attention_backend=args.attention,
        # with dummy weights --model decides the size
        input_name="--model" if dummy else "--weights",
        memory_hint=(
            "Try --model flux-tiny (the FLUX architecture at test size), --dtype bf16 or a GPU"
            if dummy
            else "Try --dtype bf16, --weight-dtype fp8 or a GPU"
        ),
    )
    timings["load_s"] = time.perf_counter() - t
    check_image_model(handle)

    t = time.perf_counter()
    params = handle.params
    if args.cond:
        positive = load_condition(args.cond, args.guidance)
    else:
        positive = synthetic_condition(params, args.tokens, args.seed + 1, args.guidance)
    negative = None
    if args.negative_seed is not None:
        negative = [synthetic_condition(params, args.tokens, args.negative_seed, args.guidance)]
    schedule = args.schedule or DEFAULT_SCHEDULE.get(args.model, "flux.1-schnell")
    sampler = args.sampler or (SCHEDULES[schedule].sampler if schedule in SCHEDULES else "euler")
    latent = torch.zeros(args.batch, handle.family.latent_format.channels, args.height // 8, args.width // 8)
    timings["prepare_s"] = time.perf_counter() - t

    out, report = sample_latent(
        handle,
        [positive],
        latent,
        negative=negative,
        seed=args.seed,
        steps=args.steps,
        schedule=schedule,
        sampler=sampler,
        cfg=args.cfg,
        custom_sigmas=args.sigmas,
    )
    timings["sampling_s"] = report.seconds_total
    timings["per_step_s"] = report.seconds_per_step

    t = time.perf_counter()
    save_file({"latent": out.contiguous()}, os.path.join(args.out, "latent.safetensors"))
    timings["save_s"] = time.perf_counter() - t
    images = []
    if args.decode != "none":
        t = time.perf_counter()
        pixels = decode_raw(out, args.decode, args.tiny_vae, args.ae, device=handle.device)
        timings["decode_s"] = time.perf_counter() - t
        images = save_png(pixels, args.out, "image")
    write_json(
        os.path.join(args.out, "timings.json"),
        {
            "model": handle.describe(),
            "schedule": schedule,
            "sampler": sampler,
            "sigmas": report.sigmas,
            "dit_forwards": report.model_calls,
            "latent_shape": list(out.shape),
            "timings": timings,
            "images": images,
        },
    )
    print(handle.describe())
    print(report.summary())
    print(
        f"wrote {os.path.join(args.out, 'latent.safetensors')} {list(out.shape)}; "
        f"load {timings['load_s']:.2f} s, sampling {timings['sampling_s']:.2f} s"
    )
    return 0
