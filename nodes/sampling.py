"""Sampler and schedule nodes: FewStepSampler for the engine's models, FewStepSchedule and
FewStepSamplerSelect for ComfyUI's own MODEL objects (SamplerCustomAdvanced), and a synthetic
conditioning source for running workflows without a text encoder."""

from __future__ import annotations

import functools

import torch

from ..engine.conditioning import TextCondition
from ..engine.errors import InputError
from ..engine.sampling import FLOW, SAMPLERS, SCHEDULES, VE
from ..engine.text_to_image import build_sigmas, sample_latent
from .base import CATEGORY, FEWSTEP_MODEL, reports_input_errors, seed_input
from .conditioning import from_comfy, to_comfy
from .host import Progress, check_interrupt, comfy_module, preview_payload
from .memory import load_for_run
from .parallel import FEWSTEP_PARALLEL, run_parallel_sample

SCHEDULE_CHOICES = list(SCHEDULES) + ["custom"]


class FewStepSampler:
    DESCRIPTION = (
        "Samples a FEWSTEP_MODEL with a few-step schedule. CFG runs only when a negative is connected and cfg != 1 "
        "(otherwise exactly one DiT forward per step). Latents are in ComfyUI's raw VAE space in and out, so "
        "ComfyUI's VAEDecode decodes the result. The report lists sigmas, forwards and per-step times, and with a "
        "FewStepCacheGate attached what the step cache decided and did (steps computed / skipped, change per step)."
    )
    CATEGORY = f"{CATEGORY}/sampling"
    RETURN_TYPES = ("LATENT", "STRING")
    RETURN_NAMES = ("latent", "report")
    FUNCTION = "sample"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (FEWSTEP_MODEL, {"tooltip": "A model from FewStepDiTLoader."}),
                "positive": ("CONDITIONING", {"tooltip": "Prompt encoding (CLIPTextEncodeFlux for FLUX)."}),
                "latent_image": (
                    "LATENT",
                    {
                        "tooltip": "Start latent: EmptySD3LatentImage for text-to-image, an "
                        "encoded image with denoise < 1 for image-to-image."
                    },
                ),
                "seed": seed_input("Noise seed; the same seed gives ComfyUI KSampler's initial noise."),
                "steps": (
                    "INT",
                    {
                        "default": 4,
                        "min": 1,
                        "max": 200,
                        "tooltip": "Denoising steps (model forwards without CFG).",
                    },
                ),
                "schedule": (
                    SCHEDULE_CHOICES,
                    {
                        "default": "flux.1-schnell",
                        "tooltip": "Sigma schedule preset of the model family; 'custom' uses custom_sigmas.",
                    },
                ),
                "sampler": (
                    list(SAMPLERS),
                    {
                        "default": "euler",
                        "tooltip": "euler: ODE step (schnell, dev). dmd: "
                        "x0 then fresh re-noise (DMD/CausVid students). lcm: consistency multistep. tcd: TCD "
                        "with gamma 0.3.",
                    },
                ),
                "cfg": (
                    "FLOAT",
                    {
                        "default": 1.0,
                        "min": 0.0,
                        "max": 30.0,
                        "step": 0.1,
                        "round": 0.01,
                        "tooltip": "Classifier-free guidance scale; used only with a negative and "
                        "cfg != 1. FLUX-dev's distilled guidance goes in the conditioning instead.",
                    },
                ),
                "denoise": (
                    "FLOAT",
                    {
                        "default": 1.0,
                        "min": 0.01,
                        "max": 1.0,
                        "step": 0.01,
                        "tooltip": "Fraction of the schedule to run (image-to-image below 1).",
                    },
                ),
            },
            "optional": {
                "negative": ("CONDITIONING", {"tooltip": "Negative prompt; enables CFG when cfg != 1."}),
                "custom_sigmas": (
                    "STRING",
                    {
                        "default": "",
                        "tooltip": "With schedule 'custom': decreasing sigmas "
                        "in [0, 1], comma separated; a final 0 is added if missing.",
                    },
                ),
                "preview_vae": (
                    "FEWSTEP_TINY_VAE",
                    {"tooltip": "Tiny VAE for per-step previews (taef1 for FLUX)."},
                ),
                "preview": (
                    "BOOLEAN",
                    {
                        "default": False,
                        "tooltip": "Send a tiny-VAE preview of each step's x0 to the progress bar "
                        "(needs preview_vae).",
                    },
                ),
                "parallel": (
                    FEWSTEP_PARALLEL,
                    {
                        "tooltip": "A worker pool from FewStepParallelLauncher: sample on it (sequence or data "
                        "parallel) instead of in this process. No per-step previews then."
                    },
                ),
            },
        }

    @reports_input_errors("FewStepSampler", {"latent": "latent_image"})
    def sample(
        self,
        model,
        positive,
        latent_image,
        seed,
        steps,
        schedule,
        sampler,
        cfg,
        denoise,
        negative=None,
        custom_sigmas="",
        preview_vae=None,
        preview=False,
        parallel=None,
    ):
        pos = from_comfy(positive, "positive")
        neg = from_comfy(negative, "negative") if negative is not None else None
        latent = latent_image["samples"]
        if latent_image.get("noise_mask") is not None:
            raise InputError(
                "latent_image",
                "carries a noise mask (inpainting); FewStepSampler does not apply "
                "masks: use ComfyUI's samplers with FewStepSchedule / FewStepSamplerSelect",
            )
        previewer = step_previewer(model, preview_vae) if preview and parallel is None else None
        if parallel is None:  # with a pool the workers hold the model; this process does not run it
            load_for_run(model)
        sigmas = build_sigmas(schedule, steps, latent, denoise, custom_sigmas)
        progress = Progress(len(sigmas) - 1, desc="FewStepSampler")

        def on_step(info):
            check_interrupt()
            progress.update(info["i"] + 1, previewer(info["denoised"]) if previewer else None)

        run = sample_latent if parallel is None else functools.partial(run_parallel_sample, parallel)
        try:
            out, report = run(
                model,
                pos,
                latent,
                negative=neg,
                seed=seed,
                sampler=sampler,
                cfg=cfg,
                sigmas=sigmas,
                callback=on_step,
                batch_index=latent_image.get("batch_index"),
            )
        finally:
            progress.close()
        result = {**latent_image, "samples": out}
        return (result, report.summary())


def step_previewer(model, preview_vae):
    """x0 in the model's latent space -> a progress-bar preview of the first image of the batch."""
    if preview_vae is None:
        raise InputError("preview_vae", "preview is on but no tiny VAE is connected (FewStepTinyVAELoader)")
    fmt = model.family.latent_format
    if preview_vae.variant.kind != "image" or preview_vae.variant.channels != fmt.channels:
        raise InputError(
            "preview_vae",
            f"{preview_vae.variant.name} decodes {preview_vae.variant.channels}-channel "
            f"{preview_vae.variant.kind} latents; this {model.family.name} model makes "
            f"{fmt.channels}-channel latents ({fmt.name}: use taef1)",
        )

    def preview(denoised):
        latent = preview_vae.raw_to_latent(fmt.process_out(denoised[:1].float()))
        return preview_payload(preview_vae.decode(latent)[0].permute(1, 2, 0))

    return preview


class FewStepSchedule:
    DESCRIPTION = (
        "Few-step sigma presets as SIGMAS for ComfyUI's SamplerCustomAdvanced with a native MODEL "
        "(flow models: FLUX, SD3, Wan, Z-Image)."
    )
    CATEGORY = f"{CATEGORY}/sampling"
    RETURN_TYPES = ("SIGMAS",)
    RETURN_NAMES = ("sigmas",)
    FUNCTION = "schedule"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "schedule": (SCHEDULE_CHOICES, {"default": "flux.1-schnell", "tooltip": "Schedule preset."}),
                "steps": ("INT", {"default": 4, "min": 1, "max": 200, "tooltip": "Number of steps."}),
                "denoise": (
                    "FLOAT",
                    {
                        "default": 1.0,
                        "min": 0.01,
                        "max": 1.0,
                        "step": 0.01,
                        "tooltip": "Fraction of the schedule to run.",
                    },
                ),
                "width": (
                    "INT",
                    {
                        "default": 1024,
                        "min": 16,
                        "max": 16384,
                        "step": 16,
                        "tooltip": "Image width in pixels (flux.1-dev's shift depends on resolution).",
                    },
                ),
                "height": (
                    "INT",
                    {
                        "default": 1024,
                        "min": 16,
                        "max": 16384,
                        "step": 16,
                        "tooltip": "Image height in pixels.",
                    },
                ),
            },
            "optional": {
                "custom_sigmas": (
                    "STRING",
                    {
                        "default": "",
                        "tooltip": "With schedule 'custom': comma separated decreasing sigmas in [0, 1].",
                    },
                ),
            },
        }

    @reports_input_errors("FewStepSchedule")
    def schedule(self, schedule, steps, denoise, width, height, custom_sigmas=""):
        if width % 16 or height % 16:
            raise InputError("width" if width % 16 else "height", f"{width}x{height} is not a multiple of 16")
        shape_latent = torch.empty(1, 1, height // 8, width // 8)
        return (build_sigmas(schedule, steps, shape_latent, denoise, custom_sigmas),)


def sigma_space_of(model_k) -> object:
    """FLOW for ComfyUI's rectified-flow models (model_sampling CONST), VE for eps / v models."""
    ms_mod = comfy_module("comfy.model_sampling")
    try:
        ms = model_k.inner_model.inner_model.model_sampling
    except AttributeError:
        return FLOW
    if ms_mod is not None and isinstance(ms, ms_mod.CONST):
        return FLOW
    return VE if ms_mod is not None else FLOW


def native_sampler_function(name: str, options: dict):
    fn = SAMPLERS[name]

    def run(model, x, sigmas, extra_args=None, callback=None, disable=None, **kwargs):
        opts = {**options, **kwargs}
        if name != "euler":
            opts.setdefault("sigma_space", sigma_space_of(model))
        return fn(model, x, sigmas, extra_args=extra_args, callback=callback, disable=disable, **opts)

    run.__name__ = f"fewstep_{name}"
    return run


class NativeSamplerSpec:
    """Outside ComfyUI: what comfy.samplers.KSAMPLER would hold (the function and its options)."""

    def __init__(self, sampler_function, extra_options):
        self.sampler_function = sampler_function
        self.extra_options = extra_options


class FewStepSamplerSelect:
    DESCRIPTION = (
        "The FewStep samplers (dmd re-noise, lcm, tcd, euler) as a SAMPLER for ComfyUI's "
        "SamplerCustomAdvanced; they adapt to flow (FLUX, SD3, Wan) and eps/v models."
    )
    CATEGORY = f"{CATEGORY}/sampling"
    RETURN_TYPES = ("SAMPLER",)
    RETURN_NAMES = ("sampler",)
    FUNCTION = "select"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "sampler": (list(SAMPLERS), {"default": "dmd", "tooltip": "Sampler function."}),
                "gamma": (
                    "FLOAT",
                    {
                        "default": 0.3,
                        "min": 0.0,
                        "max": 1.0,
                        "step": 0.05,
                        "tooltip": "TCD only: 0 is deterministic, 1 re-noises fully.",
                    },
                ),
            }
        }

    @reports_input_errors("FewStepSamplerSelect")
    def select(self, sampler, gamma=0.3):
        options = {"gamma": gamma} if sampler == "tcd" else {}
        fn = native_sampler_function(sampler, options)
        samplers = comfy_module("comfy.samplers")
        if samplers is not None:
            return (samplers.KSAMPLER(fn),)
        return (NativeSamplerSpec(fn, {}),)


class FewStepSyntheticConditioning:
    DESCRIPTION = (
        "Seeded random prompt embeddings of a chosen shape, in ComfyUI's CONDITIONING format. For "
        "running workflows with dummy weights and no text encoder; not a prompt."
    )
    CATEGORY = f"{CATEGORY}/testing"
    RETURN_TYPES = ("CONDITIONING",)
    RETURN_NAMES = ("conditioning",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "tokens": (
                    "INT",
                    {"default": 16, "min": 1, "max": 4096, "tooltip": "Number of text tokens."},
                ),
                "width": (
                    "INT",
                    {"default": 4096, "min": 1, "max": 8192, "tooltip": "Token width (4096 = T5-XXL)."},
                ),
                "pooled_width": (
                    "INT",
                    {
                        "default": 768,
                        "min": 0,
                        "max": 8192,
                        "tooltip": "Pooled vector width (768 = CLIP-L); 0 for none.",
                    },
                ),
                "guidance": (
                    "FLOAT",
                    {
                        "default": 3.5,
                        "min": 0.0,
                        "max": 100.0,
                        "step": 0.1,
                        "tooltip": "Distilled guidance stored in the conditioning (FLUX-dev).",
                    },
                ),
                "seed": seed_input("Seed of the embeddings."),
            }
        }

    @reports_input_errors("FewStepSyntheticConditioning")
    def make(self, tokens, width, pooled_width, guidance, seed):
        gen = torch.Generator().manual_seed(seed)
        context = torch.randn(1, tokens, width, generator=gen)
        pooled = torch.randn(1, pooled_width, generator=gen) if pooled_width else None
        return (to_comfy(TextCondition(context, pooled, guidance)),)


__all__ = [
    "FewStepSampler",
    "FewStepSchedule",
    "FewStepSamplerSelect",
    "FewStepSyntheticConditioning",
    "FEWSTEP_MODEL",
    "TextCondition",
]
