"""Text-to-image (and image-to-image with ``denoise < 1``) sampling of a few-step DiT.

Everything a sampler node or the CLI needs between a ComfyUI-style raw latent and the sampler loop: input
validation, the schedule, seeded noise (identical to ComfyUI's KSampler noise for the same seed), the latent
format in and out, CFG, per-step callback and timing. A step-cache gate carried by the handle (feature
``step_cache``, see ``engine.cache``) is applied here: one holder per run, its telemetry in the report. So is a
compiled / CUDA-graph forward (feature ``compile``, see ``engine.compile``): the denoiser gets the run's stand-in
for the model, and the report shows compile time, recompiles and graph hits / misses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .attention import use_attention_backend
from .cache import STEP_CACHE_FEATURE, CacheTelemetry
from .compile.feature import start_compile_run
from .compile.telemetry import CompileTelemetry
from .conditioning import TextCondition
from .denoiser import FlowDenoiser
from .errors import InputError
from .handle import ModelHandle
from .sampling import SAMPLERS, explicit_sigmas, schedule_sigmas
from .sampling.schedules import trim_for_denoise


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


def check_latent(handle: ModelHandle, latent: torch.Tensor, input_name: str = "latent") -> None:
    if handle.family.name != "flux":
        raise InputError(
            "model",
            f"this sampler runs FLUX-family image models; {handle.family.name} is a video "
            "model: use the causal video sampler (FewStepCausalVideoSampler, `python -m fewstep stream`)",
        )
    fmt = handle.family.latent_format
    if latent.ndim != 4 or latent.shape[1] != fmt.channels:
        raise InputError(
            input_name,
            f"expected an image latent [batch, {fmt.channels}, height/8, width/8] for {handle.family.name} "
            f"({fmt.name} VAE space); got shape {list(latent.shape)}",
        )
    h, w = latent.shape[-2:]
    if h % 2 or w % 2:
        raise InputError(
            input_name,
            f"image size {w * 8}x{h * 8} px is not a multiple of 16 (FLUX packs 2x2 latent patches); "
            "use a width and height divisible by 16",
        )
    p = handle.params
    if p.in_channels != 4 * fmt.channels:
        raise InputError(
            "model",
            f"this checkpoint takes {p.in_channels} input channels per token (an inpainting/control variant); "
            f"text-to-image sampling needs {4 * fmt.channels}",
        )


def check_condition(handle: ModelHandle, cond: TextCondition, input_name: str) -> None:
    p = handle.params
    if cond.context.ndim != 3 or cond.context.shape[-1] != p.context_in_dim:
        raise InputError(
            input_name,
            f"conditioning tokens are {list(cond.context.shape)}; this {handle.family.name} model expects "
            f"[batch, tokens, {p.context_in_dim}] (T5-XXL tokens, e.g. from CLIPTextEncodeFlux / DualCLIPLoader "
            "type flux)",
        )
    if cond.pooled is None:
        raise InputError(
            input_name,
            f"conditioning has no pooled_output; this model needs a [batch, {p.vec_in_dim}] "
            "pooled CLIP-L vector (CLIPTextEncodeFlux provides it)",
        )
    if cond.pooled.ndim != 2 or cond.pooled.shape[-1] != p.vec_in_dim:
        raise InputError(
            input_name,
            f"pooled_output is {list(cond.pooled.shape)}; this model expects [batch, {p.vec_in_dim}]",
        )


def build_sigmas(
    schedule: str, steps: int, latent: torch.Tensor, denoise: float, custom_sigmas: str = ""
) -> torch.Tensor:
    image_seq_len = (latent.shape[-2] // 2) * (latent.shape[-1] // 2)
    if schedule == "custom":
        return trim_for_denoise(explicit_sigmas(custom_sigmas, "custom_sigmas"), denoise)
    return schedule_sigmas(schedule, steps, image_seq_len=image_seq_len, denoise=denoise)


def check_sample_inputs(handle: ModelHandle, positive, negative, latent: torch.Tensor, sampler: str) -> None:
    """What ``sample_latent`` (and the worker pool's version of it) refuses before any work starts."""
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


def sample_latent(
    handle: ModelHandle,
    positive: Sequence[TextCondition],
    latent: torch.Tensor,
    *,
    negative: Sequence[TextCondition] | None = None,
    seed: int = 0,
    steps: int = 4,
    schedule: str = "flux.1-schnell",
    sampler: str = "euler",
    cfg: float = 1.0,
    denoise: float = 1.0,
    sigmas: torch.Tensor | None = None,
    custom_sigmas: str = "",
    batch_index: Sequence[int] | None = None,
    callback: Callable[[dict], None] | None = None,
    sampler_options: dict | None = None,
) -> tuple[torch.Tensor, SampleReport]:
    """Sample from ``latent`` (ComfyUI raw VAE space, zeros for text-to-image) and return the raw latent."""
    check_sample_inputs(handle, positive, negative, latent, sampler)
    if sigmas is None:
        sigmas = build_sigmas(schedule, steps, latent, denoise, custom_sigmas)
    sigmas = sigmas.to(torch.float32)

    device, dtype = handle.device, handle.dtype
    fmt = handle.family.latent_format
    x0_in = fmt.process_in(latent.to(torch.float32)).to(device)
    noise = noise_for(latent, seed, batch_index).to(device)
    sig_dev = sigmas.to(device)
    x = sig_dev[0] * noise + (1.0 - sig_dev[0]) * x0_in

    gate = handle.feature(STEP_CACHE_FEATURE)
    run = None
    if gate is not None:
        run = gate.start_run(handle.model, sigmas, sampler, uses_cfg=bool(negative) and cfg != 1.0)
    step_cache = run if run is not None and run.active else None
    compiled = start_compile_run(handle, step_cache_active=step_cache is not None)
    denoiser = FlowDenoiser(
        handle.model if compiled is None else compiled.model, handle.family, positive, negative, cfg,
        dtype=dtype, step_cache=step_cache,
    )  # fmt: skip
    notes = []
    if cfg != 1.0 and not negative:
        notes.append(f"cfg {cfg} ignored: no negative conditioning given (one forward per step)")

    step_times: list[float] = []
    t_last = [time.perf_counter()]

    def on_step(info: dict) -> None:
        now = time.perf_counter()
        step_times.append(now - t_last[0])
        t_last[0] = now
        if callback is not None:
            callback(info)

    t0 = time.perf_counter()
    try:
        with torch.inference_mode(), use_attention_backend(handle.attention_backend):
            out = SAMPLERS[sampler](
                denoiser,
                x,
                sig_dev,
                extra_args={"seed": int(seed)},
                callback=on_step,
                disable=True,
                **(sampler_options or {}),
            )
    except BaseException:
        if run is not None:
            run.reset()
        if compiled is not None:
            compiled.finish()
        raise
    seconds = time.perf_counter() - t0
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
        cache=run.finish() if run is not None else None,
        compile=compiled.finish() if compiled is not None else None,
    )
    return fmt.process_out(out.float()).cpu(), report
