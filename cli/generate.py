"""``python -m fewstep generate``: one sample, written as a raw latent with per-stage timings."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace

import torch

from ..engine.checks import check_finite_number, check_seed
from ..engine.errors import InputError
from ..engine.handle import open_model
from ..engine.models.registry import all_presets
from ..engine.ops import COMPUTE_DTYPES, WEIGHT_DTYPES
from ..engine.sampling import SCHEDULES
from ..engine.text_to_image import SampleRequest, check_image_model, sample
from ..engine.vae import load_tiny_vae
from ..engine.vae.tiny import variants_for
from .common import (
    add_attention_argument,
    add_compile_arguments,
    add_lora_argument,
    add_model_arguments,
    add_sampling_arguments,
    check_at_least,
    check_lora_files,
    check_size,
    compile_config,
    compile_report,
    default_schedule,
    default_tiny_vae,
    family_of_preset,
    latent_shape,
    load_condition,
    prepare_out,
    progress_bar,
    source_of,
    synthetic_condition,
    with_compile,
    with_loras,
    write_json,
)
from .files import save_tensors
from .images import decode_raw, save_png
from .text_prompts import add_text_encoder_arguments, check_text_flags, encode_texts, text_encoder_line

HELP = "sample one latent (ComfyUI raw VAE space) and write it with per-stage timings"


def add_arguments(p) -> None:
    presets = all_presets()
    add_model_arguments(
        p,
        [name for name, (family, _) in presets.items() if family.is_image],
        default="flux.1-schnell",
        model_help="image model preset: the architecture built for dummy weights, and the default schedule",
        elsewhere={
            name: f"{name} is a {family.name} video model, which `python -m fewstep stream --model {name}` runs"
            for name, (family, _) in presets.items()
            if not family.is_image
        },
    )
    add_attention_argument(p)
    add_lora_argument(p)
    add_sampling_arguments(p)
    add_text_encoder_arguments(
        p, "with --text-encoder: the prompt, encoded as the family's official pipeline encodes it (default: "
        "--cond, else seeded synthetic embeddings)", negative=True,
    )  # fmt: skip
    add_compile_arguments(p)
    p.add_argument(
        "--out",
        default="out/generate",
        help="output folder: latent.safetensors, timings.json and, with --decode, image.png",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the report (timings.json, with the compile telemetry) as JSON instead of the summary",
    )
    p.add_argument(
        "--decode",
        default="none",
        choices=["none", "tiny", "full"],
        help="also write image.png: none, tiny (TAEF1; TAEF2 for FLUX.2) or full (the FLUX.1 autoencoder, "
        "which FLUX.1 and Z-Image share)",
    )
    p.add_argument(
        "--tiny-vae",
        default=None,
        help="with --decode tiny: taef1_decoder.pth / taef2_decoder.pth or dummy:<variant> "
        "(default: dummy:taef1, dummy:taef2 for FLUX.2)",
    )
    p.add_argument(
        "--ae",
        default="dummy:flux1-ae",
        help="with --decode full: the autoencoder, ae.safetensors or dummy:flux1-ae",
    )


def run(args) -> int:
    dummy = args.weights == "dummy"
    # with dummy weights --model is the architecture, so its geometry is checked before anything is built (a
    # video preset is refused after loading, by the image-model check, with the sampler to use instead)
    preset_family = family_of_preset(args.model) if dummy else None
    image_preset = preset_family is not None and preset_family.is_image
    check_size(args.height, args.width, preset_family if image_preset else None)
    check_at_least(args, batch=1, text_tokens=1, steps=1)
    check_seed(args.seed)
    if args.negative_seed is not None:
        check_seed(args.negative_seed, "--negative-seed")
    if args.guidance is not None:
        check_finite_number(args.guidance, "--guidance")
    check_finite_number(args.cfg, "--cfg")
    encoding = check_text_flags(args)
    if encoding and args.prompt is None:
        raise InputError("--text-encoder", "encodes --prompt (and --negative-prompt): give --prompt TEXT")
    check_cfg_has_negative(args.cfg, args.negative_seed is not None or args.negative_prompt is not None)
    if image_preset:  # the preset is the architecture: an unknown default schedule fails before loading
        check_schedule(args.schedule or default_schedule(*all_presets()[args.model]))
    compiling = compile_config(args)  # a bad --compile / --cuda-graph fails before loading, too
    check_lora_files(args.lora)
    prepare_out(args.out)  # before loading anything: a bad --out fails at once
    timings = {}
    texts, text_report = {}, None
    if encoding:  # every prompt encoded and the encoder freed before the model loads
        prompts = [args.prompt] + ([args.negative_prompt] if args.negative_prompt is not None else [])
        texts, text_report = encode_texts(args, prompts, "--model" if dummy else "--weights")
        timings["text_encoder_s"] = text_report["load_s"] + text_report["encode_s"]
    t = time.perf_counter()
    handle = open_model(
        source_of(args),
        weight_dtype=WEIGHT_DTYPES[args.weight_dtype],
        dtype=COMPUTE_DTYPES[args.dtype],
        device=args.device,
        attention_backend=args.attention,
        # with dummy weights --model decides the size
        input_name="--model" if dummy else "--weights",
        memory_hint=(
            f"Try --model {tiny_preset_of(args.model)} (the same architecture at test size), --dtype bf16 "
            "or a GPU"
            if dummy
            else "Try --dtype bf16, --weight-dtype fp8 or a GPU"
        ),
    )
    check_image_model(handle, "--model" if dummy else "--weights")
    handle = with_loras(handle, args.lora)  # read and checked against the model: part of loading
    timings["load_s"] = time.perf_counter() - t
    handle = with_compile(handle, compiling)
    family, params = handle.family, handle.params
    check_size(args.height, args.width, family)
    check_decode(args, family)

    t = time.perf_counter()
    if encoding:
        positive = texts[args.prompt].condition(args.guidance)
    elif args.cond:
        positive = load_condition(args.cond, args.guidance)
    else:
        positive = synthetic_condition(family, params, args.text_tokens, args.seed + 1, args.guidance)
    negative = None
    if args.negative_prompt is not None:
        negative = [texts[args.negative_prompt].condition(args.guidance)]
    elif args.negative_seed is not None:
        negative = [synthetic_condition(family, params, args.text_tokens, args.negative_seed, args.guidance)]
    schedule = check_schedule(args.schedule or default_schedule(family, params))
    sampler = args.sampler or (SCHEDULES[schedule].sampler if schedule in SCHEDULES else "euler")
    latent = torch.zeros(latent_shape(family, args.batch, args.height, args.width))
    timings["prepare_s"] = time.perf_counter() - t

    request = SampleRequest(
        [positive], latent, negative=negative, seed=args.seed, steps=args.steps, schedule=schedule,
        sampler=sampler, cfg=args.cfg, custom_sigmas=args.sigmas,
    )  # fmt: skip
    request.check(handle)  # the bar's length is the schedule's; bad inputs are still said first
    with progress_bar("steps", len(request.schedule_for(handle)) - 1) as steps_bar:
        out, report = sample(handle, replace(request, callback=lambda info: steps_bar.update()))
    timings["sampling_s"] = report.seconds_total
    timings["per_step_s"] = report.seconds_per_step

    t = time.perf_counter()
    save_tensors({"latent": out.contiguous()}, os.path.join(args.out, "latent.safetensors"))
    timings["save_s"] = time.perf_counter() - t
    images = []
    if args.decode != "none":
        t = time.perf_counter()
        pixels = decode(out, args, family, handle.device)
        timings["decode_s"] = time.perf_counter() - t
        images = save_png(pixels, args.out, "image")
    info = {
        "model": handle.describe(),
        "schedule": schedule,
        "sampler": sampler,
        "sigmas": report.sigmas,
        "dit_forwards": report.model_calls,
        "latent_shape": list(out.shape),
        "timings": timings,
        "images": images,
        "compile": compile_report(report.compile),
    }
    if text_report is not None:
        info["text_encoder"] = text_report
    write_json(os.path.join(args.out, "timings.json"), info)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    if text_report is not None:
        print(text_encoder_line(text_report))
    print(handle.describe())
    print(report.summary())
    print(
        f"wrote {os.path.join(args.out, 'latent.safetensors')} {list(out.shape)}; "
        f"load {timings['load_s']:.2f} s, sampling {timings['sampling_s']:.2f} s"
    )
    for path in images:
        print(f"wrote {path} ({args.width}x{args.height} px, {args.decode} decode)")
    print(f"wrote {os.path.join(args.out, 'timings.json')}")
    return 0


# The test-size preset of each family, for the memory refusal's suggestion.
TINY_PRESETS = {"flux": "flux-tiny", "flux2": "flux2-tiny", "zimage": "zimage-tiny", "wan": "wan-tiny"}


def tiny_preset_of(preset: str) -> str:
    return TINY_PRESETS.get(family_of_preset(preset).name, "flux-tiny")


def check_cfg_has_negative(cfg: float, has_negative: bool) -> None:
    """CFG mixes a positive and a negative prediction; without a negative there is nothing to guide against, and
    running at cfg 1 instead would hand back an image the user did not ask for."""
    if cfg != 1 and not has_negative:
        raise InputError(
            "--cfg",
            f"CFG {cfg:g} needs a negative prompt: add --negative-prompt TEXT (with --text-encoder), or "
            "--negative-seed N (seeded synthetic negative embeddings), or leave --cfg at 1 (the few-step models are "
            "distilled to run without CFG; the distilled guidance of FLUX.1-dev / FLUX.2-dev is --guidance)",
        )


def check_schedule(name: str) -> str:
    if name != "custom" and name not in SCHEDULES:
        raise InputError("--schedule", f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    return name


def check_decode(args, family) -> None:
    """--decode full needs the family's full autoencoder in the engine: FLUX.1's AE, which Z-Image shares."""
    fmt = family.latent_format
    if args.decode == "full" and fmt.name != "flux1":
        raise InputError(
            "--decode",
            f"the engine's full autoencoder is FLUX.1's (Z-Image shares it); this {family.name} model's "
            f"{fmt.channels}-channel {fmt.name} LATENT decodes here with --decode tiny "
            f"({variants_for(fmt)[0].name}), or from latent.safetensors with ComfyUI's VAEDecode and the "
            "family's VAE (flux2-vae.safetensors for FLUX.2)",
        )


def decode(raw: torch.Tensor, args, family, device) -> torch.Tensor:
    if args.decode == "full":
        return decode_raw(raw, "full", "", args.ae, device=device)
    vae = load_tiny_vae(args.tiny_vae or default_tiny_vae(family), device=device, input_name="--tiny-vae")
    # a tiny AE of another latent space (taef1 on a FLUX.2 LATENT) is named before anything runs
    vae.check_raw_latents(raw, "--tiny-vae")
    return vae.decode(vae.raw_to_latent(raw)).float().cpu()
