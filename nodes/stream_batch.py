"""Stream batch node: stylize a frame sequence with StreamDiffusion's design on a few-step image DiT (FLUX.1,
FLUX.2, Z-Image).

The frames go through ``fewstep.engine.stream_batch.StreamBatch.run``: each frame is encoded by the tiny AE, enters a
buffer of frames at different denoising steps, and leaves T forwards later, decoded; one batched forward per
frame. The output has one frame per input frame (the buffer is flushed at the end).
"""

from __future__ import annotations

import math
import time

from ..engine.run import RunOptions
from ..engine.sampling import SCHEDULES
from ..engine.stream_batch import (
    CFG_MODES,
    STREAM_SAMPLERS,
    StreamBatch,
    StreamConfig,
    check_frames,
    parse_t_index_list,
)
from .base import CATEGORY, model_input, reports_input_errors, seed_input, single_prompt
from .host import Progress, check_interrupt, in_comfyui, interrupt_check, preview_payload
from .model_management import load_for_run
from .vae import FEWSTEP_TINY_VAE, images_to_nchw, nchw_to_images

# Several entries would be averaged by ComfyUI's samplers; a stream batch has one prompt row for every frame.
_ONE_PROMPT_PER_STREAM = "the stream batch takes one prompt for every frame (encode a single prompt)"


class FewStepStreamBatch:
    DESCRIPTION = (
        "Realtime-style img2img over a frame sequence (StreamDiffusion's stream batch on a few-step image DiT: "
        "FLUX.1, FLUX.2 or Z-Image): each frame is encoded by the tiny VAE, denoised at the steps t_index_list picks from the schedule "
        "while frames at different steps share one batched forward, and decoded. Residual CFG (self / initialize "
        "/ full), a seeded similarity filter that skips near-identical frames, and a report with frames per "
        "second and frames skipped."
    )
    CATEGORY = f"{CATEGORY}/video"
    RETURN_TYPES = ("IMAGE", "STRING")
    RETURN_NAMES = ("frames", "report")
    FUNCTION = "stylize"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": model_input("an image model: FLUX.1-schnell, FLUX.2 klein, Z-Image-Turbo"),
                "tiny_vae": (
                    FEWSTEP_TINY_VAE,
                    {
                        "tooltip": "From FewStepTinyVAELoader, encoder and decoder (both files next to each other): taef1 "
                        "for FLUX.1 and Z-Image, taef2 for FLUX.2."
                    },
                ),
                "frames": (
                    "IMAGE",
                    {
                        "tooltip": "The frame sequence (a batch of images, one size, width and height divisible by 16)."
                    },
                ),
                "positive": (
                    "CONDITIONING",
                    {
                        "tooltip": "Style prompt for every frame (CLIPTextEncodeFlux for FLUX.1; CLIPTextEncode with the "
                        "model's text encoder for FLUX.2 / Z-Image)."
                    },
                ),
                "t_index_list": (
                    "STRING",
                    {
                        "default": "16,32",
                        "tooltip": "Indices into the schedule's sigmas, strictly increasing (= sigmas decreasing). "
                        "One DiT step per index; the first sets the strength: flux.1-schnell x50 gives sigma "
                        "1 - i/50, so '16,32' runs at 0.68 and 0.36.",
                    },
                ),
                "schedule": (
                    list(SCHEDULES),
                    {
                        "default": "flux.1-schnell",
                        "tooltip": "Sigma schedule the indices point into (each model's own: flux.1-schnell, "
                        "flux.2-klein, z-image-turbo; the last two are resolution-shifted).",
                    },
                ),
                "schedule_steps": (
                    "INT",
                    {
                        "default": 50,
                        "min": 1,
                        "max": 1000,
                        "tooltip": "Steps of the schedule the indices point into (indices 0 .. steps-1).",
                    },
                ),
                "sampler": (
                    list(STREAM_SAMPLERS),
                    {
                        "default": "euler",
                        "tooltip": "euler: flow ODE step (FLUX-schnell's sampler). renoise: x0 then re-noise with "
                        "fixed noise (StreamDiffusion's LCM update).",
                    },
                ),
                "frame_buffer_size": (
                    "INT",
                    {
                        "default": 1,
                        "min": 1,
                        "max": 64,
                        "tooltip": "Frames pushed per forward; the forward has len(t_index_list) x this rows.",
                    },
                ),
                "cfg_mode": (
                    list(CFG_MODES),
                    {
                        "default": "none",
                        "tooltip": "Residual CFG. none: no guidance. self: guide away from the input frame (no "
                        "extra rows). initialize: one negative-prompt row per new frame. full: negative every "
                        "step (2x rows). self/initialize/full need guidance_scale != 1.",
                    },
                ),
                "guidance_scale": (
                    "FLOAT",
                    {
                        "default": 1.2,
                        "min": 0.0,
                        "max": 30.0,
                        "step": 0.05,
                        "round": 0.01,
                        "tooltip": "CFG scale for cfg_mode self / initialize / full (1 = no guidance).",
                    },
                ),
                "similarity_threshold": (
                    "FLOAT",
                    {
                        "default": 1.0,
                        "min": 0.0,
                        "max": 1.0,
                        "step": 0.005,
                        "round": 0.001,
                        "tooltip": "Skip frames whose cosine similarity to the last processed frame is above "
                        "this (probability rising to 1 at identical); 1 turns the filter off, 0.98 is typical.",
                    },
                ),
                "max_skip_frames": (
                    "INT",
                    {
                        "default": 10,
                        "min": 0,
                        "max": 10000,
                        "tooltip": "Most frames skipped in a row by the similarity filter (0: never skip).",
                    },
                ),
                "seed": seed_input("Seed of the fixed per-step noise and of the similarity filter's draws."),
            },
            "optional": {
                "negative": (
                    "CONDITIONING",
                    {"tooltip": "Negative prompt: needed by cfg_mode initialize and full, unused otherwise."},
                ),
            },
        }

    @reports_input_errors("FewStepStreamBatch", {"images": "frames"})
    def stylize(
        self,
        model,
        tiny_vae,
        frames,
        positive,
        t_index_list,
        schedule,
        schedule_steps,
        sampler,
        frame_buffer_size,
        cfg_mode,
        guidance_scale,
        similarity_threshold,
        max_skip_frames,
        seed,
        negative=None,
    ):
        pos = single_prompt(positive, "positive", _ONE_PROMPT_PER_STREAM)
        neg = single_prompt(negative, "negative", _ONE_PROMPT_PER_STREAM) if negative is not None else None
        config = StreamConfig(
            t_index_list=parse_t_index_list(t_index_list),
            schedule=schedule,
            schedule_steps=schedule_steps,
            sampler=sampler,
            frame_buffer_size=frame_buffer_size,
            cfg_mode=cfg_mode,
            guidance_scale=guidance_scale,
            similarity_threshold=similarity_threshold,
            max_skip_frames=max_skip_frames,
        )
        pixels = check_frames(images_to_nchw(frames, "frames"))
        load_for_run(model)
        stream = StreamBatch(
            model, tiny_vae, pos, height=pixels.shape[-2], width=pixels.shape[-1], config=config,
            negative=neg, seed=seed,
            # as the stream's default run, plus ComfyUI's Cancel checked between the blocks of every forward
            options=RunOptions(step_cache=False, interrupt_check=interrupt_check()),
        )  # fmt: skip
        total = math.ceil(pixels.shape[0] / frame_buffer_size) + config.steps - 1
        progress = Progress(total, desc="FewStepStreamBatch")
        previews = in_comfyui()

        def on_forward(done, total, out):
            check_interrupt()
            image = None
            if previews and out is not None and out.images is not None:
                image = preview_payload(out.images[0].permute(1, 2, 0))
            progress.total = total
            progress.update(done, image)

        t0 = time.perf_counter()
        try:
            out = stream.run(pixels, callback=on_forward)
        finally:
            progress.close()
        seconds = time.perf_counter() - t0
        report = stream.summary(seconds, frames=pixels.shape[0])

        if neg is not None and not config.needs_negative:
            report += f"\nnegative unused (cfg_mode {cfg_mode}, guidance_scale {guidance_scale:g})"
        return (nchw_to_images(out), report)
