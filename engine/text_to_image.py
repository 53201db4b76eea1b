"""Text-to-image (and image-to-image with ``denoise < 1``) sampling of a few-step DiT.

Everything a sampler node or the CLI needs between a ComfyUI-style raw latent and the sampler loop: input
validation, the schedule, seeded noise (identical to ComfyUI's KSampler noise for the same seed), the latent
format in and out, CFG, per-step callback and timing. A step-cache gate carried by the handle (feature
``step_cache``, see ``engine.step_cache``) is applied here: one holder per run, its telemetry in the report. So is a
compiled / CUDA-graph forward (feature ``compile``, see ``engine.compile``): the denoiser gets the run's stand-in
for the model, and the report shows compile time, recompiles and graph hits / misses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .checks import check_finite, check_finite_number, check_seed
from .compile.telemetry import CompileTelemetry
from .conditioning import TextCondition
from .denoiser import FlowDenoiser
from .errors import InputError
from .handle import ModelHandle
from .models.sizes import image_activation_bytes
from .preflight.budget import check_fits
from .run import RunOptions, open_run, placement
from .sampling import SAMPLERS, explicit_sigmas, schedule_sigmas
from .sampling.schedules import trim_for_denoise
from .step_cache import CacheTelemetry


@dataclass
class SampleReport:
    sigmas: list[float]
    sampler: str
    steps: int
    model_calls: int
    rows_evaluated: int
    cfg_used: bool
    seconds_total: float
    seconds_per_step: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cache_probes: int = 0  # forwards a step cache served from kept residuals (block 0 and the head at most)
    cache: CacheTelemetry | None = None
    # the compile feature (engine.compile): compile time, recompiles and their reasons, graph hits / misses
    compile: CompileTelemetry | None = None

    def summary(self) -> str:
        per = ", ".join(f"{s * 1000:.0f}" for s in self.seconds_per_step)
        probes = f" + {self.cache_probes} served by the step cache" if self.cache_probes else ""
        lines = [
            f"{self.sampler}, {self.steps} steps, sigmas {[round(s, 4) for s in self.sigmas]}",
            f"{self.model_calls} DiT forwards ({self.rows_evaluated} rows){probes}, "
            f"CFG {'on' if self.cfg_used else 'off'}",
            f"sampling {self.seconds_total:.3f} s; per step ms: {per}",
        ]
        cache = self.cache.summary_lines() if self.cache is not None else []
        compiled = self.compile.summary_lines() if self.compile is not None else []
        return "\n".join(lines + cache + compiled + self.notes)


def noise_for(latent: torch.Tensor, seed: int, batch_index: Sequence[int] | None = None) -> torch.Tensor:
    """ComfyUI's ``prepare_noise``: float32 Gaussian on the CPU from ``seed``, without touching global RNG.

    With ``batch_index`` (a latent batch picked out of a larger one), each row gets the noise it would have had
    at that position of the full batch, as ComfyUI does.
    """
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    if batch_index is None:
        return torch.randn(latent.shape, dtype=torch.float32, generator=gen, device="cpu")
    row_shape = [1, *latent.shape[1:]]
    rows = [torch.randn(row_shape, dtype=torch.float32, generator=gen) for _ in range(max(batch_index) + 1)]
    return torch.cat([rows[i] for i in batch_index], dim=0)


@dataclass(frozen=True)
class ImageModelUse:
    """What runs an image model, in the words of :func:`check_image_model`'s two refusals.

    ``video``: why a video model is refused and what to use instead (``{model}``: the preset, or "this
    checkpoint"; ``{family}``: its family). ``latent``: what the model's latent must be, after "this checkpoint
    takes N input channels per token (an inpainting/control variant); " (``{description}``: the family in a few
    words, ``{channels}`` and ``{latent}``: its latent's channels and format)."""

    video: str
    latent: str


TEXT_TO_IMAGE = ImageModelUse(
    video="this sampler runs image DiTs (FLUX.1, FLUX.2, Z-Image); {model} is a {family} video model: use the "
    "causal video sampler (FewStepCausalVideoSampler, `python -m fewstep stream`)",
    latent="text-to-image sampling of {description} needs the {channels}-channel {latent} latent",
)


def check_image_model(
    handle: ModelHandle, input_name: str = "model", use: ImageModelUse = TEXT_TO_IMAGE
) -> None:
    """Refuse a model an image pipeline cannot run (a video model, an inpainting / control variant); ``use``
    words the refusal for that pipeline (this sampler by default, the stream batch's ``STREAM_BATCH``)."""
    fam = handle.family
    if not fam.is_image:
        raise InputError(
            input_name, use.video.format(model=handle.preset or "this checkpoint", family=fam.name)
        )
    fmt = fam.latent_format
    if handle.params.latent_channels != fmt.channels:
        needs = use.latent.format(description=fam.image.description, channels=fmt.channels, latent=fmt.name)
        raise InputError(
            input_name,
            f"this checkpoint takes {handle.params.in_channels} input channels per token (an inpainting/control "
            f"variant); {needs}",
        )


def image_tokens_of(handle: ModelHandle, latent_shape: Sequence[int]) -> int:
    """Image tokens of one forward over a ``[B, C, H, W]`` LATENT (before any padding the model adds)."""
    return handle.family.image.image_tokens(int(latent_shape[-2]), int(latent_shape[-1]))


def check_latent(handle: ModelHandle, latent: torch.Tensor, input_name: str = "latent") -> None:
    check_image_model(handle)
    fam = handle.family
    fmt, patch = fam.latent_format, fam.image.token_patch
    if latent.ndim != 4 or latent.shape[1] != fmt.channels:
        raise InputError(
            input_name,
            f"expected an image latent [batch, {fmt.channels}, height/{fmt.downscale}, width/{fmt.downscale}] "
            f"for {fam.image.description} ({fmt.name} VAE space); got shape {list(latent.shape)}",
        )
    if latent.shape[0] == 0:
        raise InputError(input_name, "the latent batch is empty (0 images): nothing to sample")
    h, w = latent.shape[-2:]
    px = fmt.downscale
    if h == 0 or w == 0:
        raise InputError(input_name, f"image size {w * px}x{h * px} px: nothing to sample")
    if h % patch or w % patch:
        raise InputError(
            input_name,
            f"image size {w * px}x{h * px} px is not a multiple of {px * patch} ({fam.image.description} packs "
            f"{patch}x{patch} latent patches); use a width and height divisible by {px * patch}",
        )
    check_finite(latent, input_name, "the latent")


def check_condition(handle: ModelHandle, cond: TextCondition, input_name: str) -> None:
    p, spec = handle.params, handle.family.image
    width, pooled_width = spec.context_dim(p), spec.pooled_dim(p)
    if cond.context.ndim != 3 or cond.context.shape[-1] != width:
        raise InputError(
            input_name,
            f"conditioning tokens are {list(cond.context.shape)}; this {spec.description} model "
            f"({handle.preset or 'checkpoint'}) expects [batch, tokens, {width}]: {spec.text_encoder(p)}",
        )
    if cond.context.shape[0] == 0:
        raise InputError(input_name, "the conditioning batch is empty (0 prompts)")
    if cond.context.shape[1] == 0:
        raise InputError(
            input_name, "the conditioning has 0 text tokens; expected at least 1 (an encoded prompt)"
        )
    check_finite(cond.context, input_name, "the conditioning tokens (context)")
    if cond.guidance is not None:
        check_finite_number(cond.guidance, input_name)
    if pooled_width is None:
        return  # the family has no pooled vector; one that comes along (ComfyUI sets it for some encoders) is unused
    if cond.pooled is None:
        raise InputError(
            input_name,
            f"conditioning has no pooled_output; this model needs a [batch, {pooled_width}] "
            "pooled CLIP-L vector (CLIPTextEncodeFlux provides it)",
        )
    if cond.pooled.ndim != 2 or cond.pooled.shape[-1] != pooled_width:
        raise InputError(
            input_name,
            f"pooled_output is {list(cond.pooled.shape)}; this model expects [batch, {pooled_width}]",
        )
    if cond.pooled.shape[0] != cond.context.shape[0]:
        raise InputError(
            input_name,
            f"the conditioning has {cond.context.shape[0]} token rows but {cond.pooled.shape[0]} pooled "
            "rows; each prompt needs both (one row of each per prompt)",
        )
    check_finite(cond.pooled, input_name, "the pooled conditioning vector (pooled_output)")


def check_sigmas(sigmas: torch.Tensor, input_name: str = "sigmas") -> None:
    """An explicit schedule: finite, strictly decreasing, at least one step."""
    if sigmas.ndim != 1 or sigmas.numel() < 2:
        raise InputError(
            input_name, f"expected a 1-D schedule of at least 2 sigmas, got shape {list(sigmas.shape)}"
        )
    check_finite(sigmas, input_name, "the sigmas")
    if bool((sigmas[1:] >= sigmas[:-1]).any()):
        raise InputError(input_name, f"sigmas must be strictly decreasing, got {sigmas.tolist()}")


def estimate_sample_bytes(
    params, latent_shape: Sequence[int], text_tokens: int, rows: int, dtype: torch.dtype, token_patch: int = 2
) -> dict[str, int]:
    """Bytes one sampling run allocates beyond the loaded weights, by part (the memory preflight's input).

    ``rows`` = latent batch x prompts evaluated per forward (both CFG halves when CFG runs). The latent-sized
    float32 tensors (noise, the sample, x0, the update, the output) are counted as 8 copies; activations are
    :func:`~fewstep.engine.models.sizes.image_activation_bytes` (an estimate: see there). ``token_patch``: LATENT
    pixels per token side (the family's ``ImageSpec.token_patch``).
    """
    b, c, h, w = latent_shape
    image_tokens = (h // token_patch) * (w // token_patch)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    context_width = getattr(params, "context_in_dim", None) or params.cap_feat_dim
    return {
        "latents": 8 * b * c * h * w * 4,
        "activations": image_activation_bytes(params, image_tokens, text_tokens, rows, dtype_bytes),
        "model inputs": rows * (c * h * w + text_tokens * context_width) * dtype_bytes,
    }


def build_sigmas(
    schedule: str,
    steps: int,
    latent: torch.Tensor,
    denoise: float,
    custom_sigmas: str = "",
    token_patch: int = 2,
) -> torch.Tensor:
    """``token_patch``: LATENT pixels per image token side; resolution-shifted schedules read the token count."""
    image_seq_len = (latent.shape[-2] // token_patch) * (latent.shape[-1] // token_patch)
    if schedule == "custom":
        return trim_for_denoise(explicit_sigmas(custom_sigmas, "custom_sigmas"), denoise)
    return schedule_sigmas(schedule, steps, image_seq_len=image_seq_len, denoise=denoise)


def check_sample_inputs(
    handle: ModelHandle,
    positive,
    negative,
    latent: torch.Tensor,
    sampler: str,
    seed: int = 0,
    cfg: float = 1.0,
) -> None:
    """What ``sample_latent`` (and the worker pool's version of it) refuses before any work starts."""
    check_seed(seed)
    check_finite_number(cfg, "cfg")
    if sampler not in SAMPLERS:
        raise InputError("sampler", f"unknown sampler {sampler!r}; known: {', '.join(SAMPLERS)}")
    if not positive:
        raise InputError("positive", "no conditioning given")
    check_latent(handle, latent)
    for name, conds in (("positive", positive), ("negative", negative or [])):
        for c in conds:
            check_condition(handle, c, name)
            if latent.shape[0] % c.context.shape[0]:
                raise InputError(
                    name,
                    f"conditioning batch {c.context.shape[0]} does not divide the latent batch {latent.shape[0]}",
                )


@dataclass(frozen=True)
class SampleRequest:
    """One sampling run's inputs: what :func:`sample` takes, and what the worker pool sends its workers."""

    positive: Sequence[TextCondition]
    latent: torch.Tensor  # ComfyUI raw VAE space, zeros for text-to-image
    negative: Sequence[TextCondition] | None = None
    seed: int = 0
    steps: int = 4
    schedule: str = "flux.1-schnell"
    sampler: str = "euler"
    cfg: float = 1.0
    denoise: float = 1.0
    # an explicit schedule; steps, schedule, denoise and custom_sigmas are then unused
    sigmas: torch.Tensor | None = None
    custom_sigmas: str = ""
    # the rows' positions in a larger batch: each row gets the noise it has there
    batch_index: Sequence[int] | None = None
    callback: Callable[[dict], None] | None = None
    sampler_options: dict | None = None
    # the run's own choices (attention backend, kernel mode, compile and step cache on/off, where it computes:
    # engine.run)
    options: RunOptions | None = None
    # bytes ``callback`` allocates while the run's tensors are alive (a host's per-step preview decode), by part:
    # added to the memory preflight's estimate so the run is refused before it starts, not at its first step
    callback_bytes: dict[str, int] | None = None

    def check(self, handle: ModelHandle) -> None:
        """What a run refuses before any work starts."""
        check_sample_inputs(
            handle, self.positive, self.negative, self.latent, self.sampler, self.seed, self.cfg
        )

    def schedule_for(self, handle: ModelHandle) -> torch.Tensor:
        """The run's sigmas: the explicit ones (checked), or built from the schedule for this latent."""
        if self.sigmas is None:
            token_patch = handle.family.image.token_patch
            return build_sigmas(
                self.schedule,
                self.steps,
                self.latent,
                self.denoise,
                self.custom_sigmas,
                token_patch=token_patch,
            )
        check_sigmas(self.sigmas)
        return self.sigmas


def sample_latent(
    handle: ModelHandle, positive: Sequence[TextCondition], latent: torch.Tensor, **fields
) -> tuple[torch.Tensor, SampleReport]:
    """:func:`sample` with the request's fields as keywords (``negative=``, ``seed=``, ``steps=``...)."""
    return sample(handle, SampleRequest(positive, latent, **fields))


def sample(handle: ModelHandle, request: SampleRequest) -> tuple[torch.Tensor, SampleReport]:
    """Sample from ``request.latent`` and return the raw latent and the report.

    Refused before any allocation: bad or non-finite inputs, and a job whose estimated memory
    (:func:`estimate_sample_bytes`) does not fit the device. A non-finite result is an error naming the step
    whose prediction first went non-finite. Options that place the run on a worker pool (``RunOptions.pool``)
    hand the whole request to it (``engine.run.placement``), which returns the same result.
    """
    elsewhere = placement(request.options)
    if elsewhere is not None:
        return elsewhere.sample(handle, request)
    request.check(handle)
    positive, negative, latent, seed = request.positive, request.negative, request.latent, request.seed
    sampler, cfg, callback = request.sampler, request.cfg, request.callback
    sigmas = request.schedule_for(handle).to(torch.float32)
    uses_cfg = bool(negative) and cfg != 1.0
    prompts = len(positive) + (len(negative) if uses_cfg else 0)
    text_tokens = max(c.context.shape[1] for c in [*positive, *(negative or [])])
    parts = estimate_sample_bytes(
        handle.params,
        latent.shape,
        text_tokens,
        latent.shape[0] * prompts,
        handle.dtype,
        token_patch=handle.family.image.token_patch,
    )
    check_fits(
        {**parts, **(request.callback_bytes or {})},
        handle.device,
        "latent",
        hint="Use a smaller image or batch"
        + (", or run without the per-step preview" if request.callback_bytes else ""),
    )

    device, dtype = handle.device, handle.dtype
    fmt = handle.family.latent_format
    x0_in = fmt.process_in(latent.to(torch.float32)).to(device)
    noise = noise_for(latent, seed, request.batch_index).to(device)
    sig_dev = sigmas.to(device)
    x = sig_dev[0] * noise + (1.0 - sig_dev[0]) * x0_in

    run = open_run(handle, request.options, sigmas=sigmas, sampler=sampler, uses_cfg=uses_cfg)
    denoiser = FlowDenoiser(
        run.model, handle.family, positive, negative, cfg, dtype=dtype, step_cache=run.step_cache,
        backends=run.backends, blocks=run.blocks,
    )  # fmt: skip
    notes = []
    if cfg != 1.0 and not negative:
        notes.append(f"cfg {cfg} ignored: no negative conditioning given (one forward per step)")

    step_times: list[float] = []
    t_last = [time.perf_counter()]
    # The first step whose x0 was non-finite, tracked on the device (one reduction per step, never read back
    # during the run: no per-step sync); read once, only when the output turns out non-finite.
    first_bad_step = torch.full((), -1, dtype=torch.int64, device=device)

    def on_step(info: dict) -> None:
        nonlocal first_bad_step
        now = time.perf_counter()
        step_times.append(now - t_last[0])
        t_last[0] = now
        went_bad = (first_bad_step < 0) & ~torch.isfinite(info["denoised"]).all()
        first_bad_step = torch.where(went_bad, info["i"], first_bad_step)
        if callback is not None:
            callback(info)

    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            out = SAMPLERS[sampler](
                denoiser,
                x,
                sig_dev,
                extra_args={"seed": int(seed)},
                callback=on_step,
                disable=True,
                **(request.sampler_options or {}),
            )
    except BaseException:
        run.abort()
        raise
    seconds = time.perf_counter() - t0
    if not bool(torch.isfinite(out).all()):
        run.abort()
        raise _non_finite_output(out, int(first_bad_step), sigmas, handle.dtype, cfg if uses_cfg else None)
    cache_telemetry, compile_telemetry = run.finish()
    report = SampleReport(
        sigmas=sigmas.tolist(),
        sampler=sampler,
        steps=len(sigmas) - 1,
        model_calls=denoiser.model_calls,
        rows_evaluated=denoiser.rows_evaluated,
        cfg_used=denoiser.uses_cfg,
        seconds_total=seconds,
        seconds_per_step=step_times,
        notes=notes,
        cache_probes=denoiser.cache_probes,
        cache=cache_telemetry,
        compile=compile_telemetry,
    )
    return fmt.process_out(out.float()).cpu(), report


def _non_finite_output(
    out: torch.Tensor, step: int, sigmas: torch.Tensor, dtype, cfg: float | None
) -> InputError:
    """The error for a non-finite result of finite inputs: the model (its weights or its dtype) produced it."""
    bad = int((~torch.isfinite(out)).sum())
    steps = len(sigmas) - 1
    where = (
        f"the model's prediction (x0) first went non-finite at step {step + 1} of {steps} "
        f"(sigma {float(sigmas[step]):.4g})"
        if step >= 0
        else "every prediction (x0) was finite, the sampler's update was not"
    )
    cause = f"the weights hold NaN/Inf, or the compute dtype {str(dtype).replace('torch.', '')} overflowed"
    if cfg is not None:
        cause += f" (CFG scale {cfg})"
    return InputError(
        "model",
        f"the sampled latent is not finite ({bad} of {out.numel()} values NaN or infinite): {where}, although "
        f"the latent, the conditioning and the sigmas are finite; {cause}",
    )
