"""Sampler and schedule nodes: FewStepSampler for the engine's models, FewStepSchedule and
FewStepSamplerSelect for ComfyUI's own MODEL objects (SamplerCustomAdvanced), and a synthetic
conditioning source for running workflows without a text encoder."""

from __future__ import annotations

import torch

from ..engine.conditioning import TextCondition, for_family
from ..engine.errors import InputError
from ..engine.sampling import FLOW, SAMPLERS, SCHEDULES, VE
from ..engine.text_to_image import SampleRequest, build_sigmas, check_image_model, sample
from ..engine.vae.tiny import variants_for
from .base import (
    CATEGORY,
    FEWSTEP_MODEL,
    model_input,
    reports_input_errors,
    schedule_fraction_input,
    seed_input,
)
from .conditioning import from_comfy, to_comfy
from .host import Progress, check_interrupt, comfy_module, preview_payload
from .model_management import load_for_run
from .parallel import FEWSTEP_PARALLEL, run_options

SCHEDULE_CHOICES = list(SCHEDULES) + ["custom"]
# FewStepSampler knows its model, so it can also follow the model: "auto" (its default).
AUTO = "auto"
SAMPLER_SCHEDULE_CHOICES = [AUTO, *SCHEDULE_CHOICES]


# FewStepSampler and FewStepSchedule both turn these two into sigmas with build_sigmas: one declaration each.
def denoise_input() -> tuple:
    return schedule_fraction_input(
        1.0, "Fraction of the schedule to run (image-to-image below 1).", minimum=0.01
    )


def custom_sigmas_input() -> tuple:
    tooltip = (
        "With schedule 'custom': decreasing sigmas in [0, 1], comma separated; a final 0 is added if missing."
    )
    return ("STRING", {"default": "", "tooltip": tooltip})


def auto_schedule(model) -> str:
    """What schedule "auto" means for a FEWSTEP_MODEL: schnell / klein / Z-Image-Turbo's preset, or the dev
    preset of a model with a distilled-guidance embedding (FLUX.1-dev, FLUX.2-dev)."""
    check_image_model(model)  # a video model is refused here, before a schedule is looked up for it
    return model.family.image.schedule_for(model.params)


class FewStepSampler:
    DESCRIPTION = (
        "Samples a FEWSTEP_MODEL with a few-step schedule. CFG runs only when a negative is connected and cfg != 1 "
        "(otherwise exactly one DiT forward per step). Latents are in ComfyUI's raw VAE space in and out, so "
        "ComfyUI's VAEDecode decodes the result. The report lists sigmas, forwards and per-step times, and with a "
        "FewStepCacheGate attached what the step cache decided and did (steps computed / skipped, the score compared with the threshold per step)."
    )
    CATEGORY = f"{CATEGORY}/sampling"
    RETURN_TYPES = ("LATENT", "STRING")
    RETURN_NAMES = ("latent", "report")
    FUNCTION = "sample"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": model_input(),
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
                    SAMPLER_SCHEDULE_CHOICES,
                    {
                        "default": AUTO,
                        "tooltip": "Sigma schedule preset. auto: the model's own (flux.1-schnell, flux.2-klein, "
                        "z-image-turbo; flux.1-dev / flux.2-dev for a guidance-distilled dev model) at the "
                        "steps given (published: schnell 4, klein 4, Z-Image-Turbo 8, FLUX.1-dev 28, FLUX.2-dev "
                        "50). 'custom' uses custom_sigmas.",
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
                "denoise": denoise_input(),
            },
            "optional": {
                "negative": ("CONDITIONING", {"tooltip": "Negative prompt; enables CFG when cfg != 1."}),
                "custom_sigmas": custom_sigmas_input(),
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
        # in the model's form here, not only in the engine: a worker pool gets the conditions without their mask
        pos = [for_family(c, model.family, "positive") for c in from_comfy(positive, "positive")]
        neg = None
        if negative is not None:
            neg = [for_family(c, model.family, "negative") for c in from_comfy(negative, "negative")]
        latent = latent_image["samples"]
        if latent_image.get("noise_mask") is not None:
            raise InputError(
                "latent_image",
                "carries a noise mask (inpainting); FewStepSampler does not apply "
                "masks: use ComfyUI's samplers with FewStepSchedule / FewStepSamplerSelect",
            )
        # in this process, or on the connected pool (the engine hands the run to it: engine.run.placement)
        options = run_options(parallel, "FewStepSampler")
        previewer = step_previewer(model, preview_vae) if preview and options.in_process else None
        if options.in_process:  # with a pool the workers hold the model; this process does not run it
            load_for_run(model)
        if schedule == AUTO:
            schedule = auto_schedule(model)
        patch = model.family.image.token_patch if model.family.is_image else 2
        # resolution-shifted schedules count the model's image tokens (FLUX.2: one per LATENT pixel)
        sigmas = build_sigmas(schedule, steps, latent, denoise, custom_sigmas, token_patch=patch)
        progress = Progress(len(sigmas) - 1, desc="FewStepSampler")

        def on_step(info):
            check_interrupt()
            progress.update(info["i"] + 1, previewer(info["denoised"]) if previewer else None)

        request = SampleRequest(
            pos, latent, negative=neg, seed=seed, sampler=sampler, cfg=cfg, sigmas=sigmas, callback=on_step,
            batch_index=latent_image.get("batch_index"), options=options,
            callback_bytes=preview_decode_bytes(preview_vae, latent) if previewer else None,
        )  # fmt: skip
        try:
            out, report = sample(model, request)
        finally:
            progress.close()
        result = {**latent_image, "samples": out}
        return (result, report.summary())


def preview_decode_bytes(preview_vae, latent) -> dict[str, int]:
    """What a step's preview decode of the first image allocates (the tiny VAE's own decode estimate)."""
    v = preview_vae.variant
    height, width = latent.shape[-2] * v.raw_downscale, latent.shape[-1] * v.raw_downscale
    return {"preview decode": sum(preview_vae.decode_bytes(1, 1, height, width).values())}


def step_previewer(model, preview_vae):
    """x0 in the model's latent space -> a progress-bar preview of the first image of the batch."""
    if preview_vae is None:
        raise InputError("preview_vae", "preview is on but no tiny VAE is connected (FewStepTinyVAELoader)")
    fmt = model.family.latent_format
    v = preview_vae.variant
    if v.kind != "image" or v.comfy_format != fmt:
        via = "" if v.comfy_format == v.latent_format else f" (ComfyUI's {v.comfy_format.name} LATENT)"
        fits = [t.name for t in variants_for(fmt)]
        raise InputError(
            "preview_vae",
            f"{v.name} decodes {v.channels}-channel {v.kind} latents{via}; this {model.family.name} model makes "
            f"{fmt.channels}-channel latents ({fmt.name}: use {' or '.join(fits) or 'a tiny VAE of that space'})",
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
                "denoise": denoise_input(),
                "width": (
                    "INT",
                    {
                        "default": 1024,
                        "min": 16,
                        "max": 16384,
                        "step": 16,
                        "tooltip": "Image width in pixels (the flux.1-dev and FLUX.2 shifts depend on "
                        "resolution: one image token per 16x16 px in every family).",
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
                "custom_sigmas": custom_sigmas_input(),
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
        "Seeded random prompt embeddings in ComfyUI's CONDITIONING format, for running workflows with dummy "
        "weights and no text encoder; not a prompt. Connect a model to get the widths it takes (FLUX.1: T5 4096 + "
        "pooled CLIP-L 768; FLUX.2: its stacked text-encoder width, 15360 dev / 7680 klein 4B / 12288 klein 9B, no "
        "pooled vector; Z-Image: Qwen3 2560, no pooled vector; Wan: umT5 4096); without one, width and "
        "pooled_width say."
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
                    {
                        "default": 4096,
                        "min": 1,
                        "max": 16384,
                        "tooltip": "Token width (4096 = T5-XXL); unused when a model is connected.",
                    },
                ),
                "pooled_width": (
                    "INT",
                    {
                        "default": 768,
                        "min": 0,
                        "max": 8192,
                        "tooltip": "Pooled vector width (768 = CLIP-L); 0 for none; unused when a model is "
                        "connected.",
                    },
                ),
                "guidance": (
                    "FLOAT",
                    {
                        "default": 3.5,
                        "min": 0.0,
                        "max": 100.0,
                        "step": 0.1,
                        "tooltip": "Distilled guidance stored in the conditioning (FLUX.1-dev, FLUX.2-dev).",
                    },
                ),
                "seed": seed_input("Seed of the embeddings."),
            },
            "optional": {
                "model": model_input(
                    "when connected, the conditioning has the text and pooled widths it takes"
                ),
            },
        }

    @reports_input_errors("FewStepSyntheticConditioning")
    def make(self, tokens, width, pooled_width, guidance, seed, model=None):
        if model is not None:
            width, pooled_width = conditioning_widths(model)
        gen = torch.Generator().manual_seed(seed)
        # context first, then the pooled vector: the draws of a FLUX.1 conditioning do not depend on the path
        context = torch.randn(1, tokens, width, generator=gen)
        pooled = torch.randn(1, pooled_width, generator=gen) if pooled_width else None
        return (to_comfy(TextCondition(context, pooled, guidance)),)


def conditioning_widths(model) -> tuple[int, int]:
    """(token width, pooled width or 0) of the conditioning a FEWSTEP_MODEL takes."""
    spec = model.family.image
    if spec is None:  # a video family (Wan): umT5 tokens, no pooled vector
        return int(model.params.text_dim), 0
    return int(spec.context_dim(model.params)), int(spec.pooled_dim(model.params) or 0)


__all__ = [
    "FewStepSampler",
    "FewStepSchedule",
    "FewStepSamplerSelect",
    "FewStepSyntheticConditioning",
    "FEWSTEP_MODEL",
    "TextCondition",
]
