"""Stream batch: StreamDiffusion's realtime img2img pipeline on the engine's image DiTs with a tiny AE.

Any image family of the registry streams: FLUX.1 and Z-Image-Turbo with taef1 (16-channel latent at 1/8, 2x2
token patches), FLUX.2 with taef2 (the model's 128-channel latent at 1/16 is taef2's 32-channel latent,
2x2-patchified: encode and decode convert exactly, see :meth:`StreamBatch.encode_frames`). Frame sizes are
multiples of 16 for all three.

Each input frame is img2img-denoised at the T sigmas a ``t_index_list`` picks from a schedule (see
:mod:`.config`). Instead of running a frame's T steps one after another, the stream keeps a buffer of frames that
sit at different steps and advances all of them with one batched forward per input:

* **Buffer layout.** The forward's rows are grouped by step, step-major: rows ``k*fb .. (k+1)*fb - 1`` hold the
  ``fb = frame_buffer_size`` frames of the group currently at step k (noise level ``s_k``). A pushed group is
  encoded by the tiny AE, noised to ``s_0`` with the fixed noise of slot 0 and placed in the step-0 rows; the
  other rows come from the buffer. After the forward every group moves one step on (step k's rows are advanced
  to ``s_{k+1}`` and become step k+1's rows of the next forward), and the group at step T-1 leaves as x0 and is
  decoded. So each push costs one forward of ``T * fb`` rows (plus residual-CFG rows, see :mod:`.guidance`)
  and returns one finished group: throughput one group per forward, latency T forwards.
* **A frame's path.** Group g enters at push g and is at step k during push ``g + k`` (pushes the similarity
  filter skipped do not count); it leaves after the forward of push ``g + T - 1`` -- the same T steps (same
  sigmas, same noise, same prompt) a sequential img2img of that frame runs, so its result equals the sequential
  one (up to float rounding of a batched GEMM).
* **Warm-up.** The first ``T - 1`` pushes after a reset return ``None``: nothing has finished yet. Only occupied
  step slots are run (push p runs ``(p + 1) * fb`` rows), so warm-up wastes no compute on empty rows and no
  placeholder frames are ever returned. :meth:`StreamBatch.flush` drains the buffer with ``T - 1`` more forwards
  of ``(T - 1) * fb, ..., fb`` rows and returns the last ``T - 1`` groups; :meth:`StreamBatch.run` (a whole clip)
  pushes every frame, flushes, and returns exactly one output per input frame.
* **Precomputed once.** The prompt embeddings tiled to the batch (and their concatenation with the negative for
  CFG), the per-row sigmas, and the noise ``[T, fb, C, h, w]`` from ``torch.Generator("cpu").manual_seed(seed)``:
  slot (k, j) noises the j-th frame of every group at step k (``euler`` uses slot 0 only; ``renoise`` re-noises
  to ``s_{k+1}`` with slot k+1). Every frame gets the same noise, which keeps a video stable, as StreamDiffusion
  does.
* **Similarity filter** (:mod:`.similarity`): a skipped input runs nothing (no encode, no forward, no decode) and
  :meth:`StreamBatch.push` returns the previous output again (marked ``skipped``; ``None`` if there is none yet).
  In :meth:`StreamBatch.run` a skipped frame's output is the output of the last processed frame before it.

Differences from StreamDiffusion (``cumulo-autumn/StreamDiffusion``, ``pipeline.py`` / ``image_filter.py``), all
deliberate; with ``sampler="renoise"`` and frame buffer 1 every frame after its warm-up equals the official
``predict_x0_batch`` on the same model, noise and settings (tests/engine/stream_batch/test_stream_batch.py, optional cross-check):

* Flow matching instead of DDPM/LCM: ``a = 1 - s``, ``b = s``, sigmas from the engine's schedule presets, the
  model's velocity instead of eps, no LCM boundary scalings (see :mod:`.guidance` for RCFG and ``delta``).
* ``euler`` (the default) advances the buffer along the flow ODE (FLUX-schnell's own sampler); the official
  update is ``renoise`` (x0, then re-noise with the fixed noise of the next slot), kept as an option.
  StreamDiffusion's ``do_add_noise=False`` (re-scale x0 without noise) is not offered: it is not a valid step of
  a flow model.
* Warm-up: the official buffer starts as zeros and the first ``T - 1`` calls decode x0 of those zero latents
  (placeholders); here they return ``None`` and only occupied rows run, and :meth:`flush` drains the tail.
* ``frame_buffer_size > 1``: the official code returns only the last row, noises every entering frame with the
  first noise row and makes one unconditional row for ``initialize``; here each of the ``fb`` frames of a group
  has its own noise per step slot, all ``fb`` frames come out, and ``initialize`` adds ``fb`` rows (the
  ``(T + 1) fb`` rows of the official TensorRT batch size).
* CFG runs for ``guidance_scale != 1`` (the engine's convention), the official only for ``> 1``.
* The sequential baseline (:func:`.reference.denoise_sequential`) reuses the stream's fixed noise, so the two
  can be compared; the official ``use_denoising_batch=False`` path draws fresh noise at every step.
* A skipped input returns the previous output at once (the official one sleeps for its average frame time),
  and the skip cap counts consecutive skips exactly (see :mod:`.similarity`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..conditioning import TextCondition, for_family
from ..denoiser import concat_conditions
from ..errors import InputError
from ..handle import ModelHandle
from ..run import RunOptions, open_run
from ..text_to_image import ImageModelUse, check_condition, check_image_model
from ..vae.tiny import variants_for
from .config import StreamConfig
from .guidance import advance, guided_velocity, residual_velocity
from .similarity import SimilarityFilter


@dataclass
class StreamOutput:
    group: int  # which pushed group (0 = first push since the reset) this is the result of
    latents: torch.Tensor  # [fb, C, h, w] x0 in the model's latent space, float32, on the model's device
    images: torch.Tensor | None = None  # [fb, 3, H, W] in [0, 1], decoded by the tiny AE (push only)
    skipped: bool = False  # repeated for a skipped input: nothing ran for it


SKIPS_KEPT = 24  # skipped pushes listed by number in the summary (the counts are exact for any length)


@dataclass
class StreamStats:
    """Bounded for a stream of any length: counts, the first skipped pushes, and the rows of the forwards as runs
    (the row count changes only during warm-up and flush)."""

    groups_in: int = 0
    groups_skipped: int = 0
    skipped_groups: list[int] = field(default_factory=list)  # the first SKIPS_KEPT skipped pushes (0 = first)
    last_skipped_group: int | None = None
    groups_out: int = 0
    forwards: int = 0
    # [rows of a forward, how many forwards in a row had them]
    row_runs: list[list[int]] = field(default_factory=list)
    seconds_dit: float = 0.0  # forwards and the step arithmetic
    seconds_encode: float = 0.0
    seconds_decode: float = 0.0

    def add_forward(self, rows: int) -> None:
        self.forwards += 1
        if self.row_runs and self.row_runs[-1][0] == rows:
            self.row_runs[-1][1] += 1
        else:
            self.row_runs.append([rows, 1])

    def add_skip(self, group: int) -> None:
        self.groups_in += 1
        self.groups_skipped += 1
        self.last_skipped_group = group
        if len(self.skipped_groups) < SKIPS_KEPT:
            self.skipped_groups.append(group)

    @property
    def rows(self) -> list[int]:
        """Rows of each DiT forward, in order (expanded from the runs on demand)."""
        return [rows for rows, n in self.row_runs for _ in range(n)]


# The stream batch's words for the refusals of text_to_image.check_image_model.
STREAM_BATCH = ImageModelUse(
    video="the stream batch runs FLUX-family image DiTs and Z-Image (img2img per frame); {family} is a video "
    "model: use the causal video sampler",
    latent="the stream batch needs the {channels}-channel {latent} latent of {description}",
)


def _same_space(tiny_vae, fmt) -> bool:
    """Whether the tiny AE's own latent is the model's latent (taef1 for FLUX.1 / Z-Image); otherwise its ComfyUI
    LATENT is (taef2 for FLUX.2: the model's 128-channel latent is taef2's 32 channels, 2x2-patchified)."""
    return tiny_vae.variant.latent_format == fmt


def check_tiny_vae(tiny_vae, handle: ModelHandle, input_name: str = "tiny_vae") -> None:
    """The tiny AE must work in the model's own latent space, directly (taef1 for FLUX.1 and Z-Image) or through
    ComfyUI's LATENT layout (taef2 for FLUX.2), and have both halves."""
    fmt = handle.family.latent_format
    v = tiny_vae.variant
    if v.kind != "image" or (v.latent_format != fmt and v.comfy_format != fmt):
        fits = variants_for(fmt)
        use = " or ".join(f"{f.name} ({f.name}_encoder.pth and {f.name}_decoder.pth)" for f in fits)
        raise InputError(
            input_name,
            f"{v.name} ({v.models}) is a {v.channels}-channel {v.kind} autoencoder; this {handle.family.name} "
            f"model denoises {fmt.channels}-channel {fmt.name} latents: "
            + (f"use {use}" if fits else "no tiny AE of this pack decodes them"),
        )
    missing = [part for part in ("encoder", "decoder") if getattr(tiny_vae, part) is None]
    if missing:
        raise InputError(
            input_name,
            f"this {v.name} has no {missing[0]}; the stream encodes every frame and decodes every result, so it "
            f"needs both {v.name}_encoder.pth and {v.name}_decoder.pth",
        )


@dataclass(frozen=True)
class FrameGeometry:
    """What a frame size must be a multiple of, and why: the model's latent downscale times its token patch
    (FLUX.1 / Z-Image: 8 x 2x2 patches; FLUX.2: 16, one token a latent pixel), and the tiny AE's own downscale."""

    multiple: int
    why: str


# before the model is known (the node checks the frames first): 16 holds for every image family of the registry
ANY_MODEL_FRAMES = FrameGeometry(
    16, "8x tiny-AE downscale, then FLUX.1 / Z-Image's 2x2 patches; FLUX.2's latent is 16x smaller"
)


def frame_geometry(handle: ModelHandle, tiny_vae=None) -> FrameGeometry:
    fam = handle.family
    fmt, patch = fam.latent_format, fam.image.token_patch
    model = fmt.downscale * patch
    ae = tiny_vae.variant.raw_downscale if tiny_vae is not None else 1
    multiple = math.lcm(model, ae)
    name = fam.image.description.split(" (")[0]  # "FLUX.2 (BFL MMDiT, shared modulation)" -> "FLUX.2"
    if patch > 1:
        why = f"{fmt.downscale}x latent downscale, then {name}'s {patch}x{patch} patches"
    else:
        why = f"{name}'s {fmt.downscale}x latent downscale, one token a latent pixel"
    if multiple != model:
        why += f"; {tiny_vae.variant.name} needs {ae}"
    return FrameGeometry(multiple, why)


def check_frame_size(
    height: int, width: int, input_name: str = "frames", geometry: FrameGeometry = ANY_MODEL_FRAMES
) -> None:
    m = geometry.multiple
    if height < m or width < m or height % m or width % m:
        raise InputError(
            input_name,
            f"frame size {width}x{height} px is not a multiple of {m} ({geometry.why}); resize or crop the frames "
            f"to a width and height divisible by {m}",
        )


def check_frames(
    frames: torch.Tensor | Sequence[torch.Tensor],
    input_name: str = "frames",
    geometry: FrameGeometry = ANY_MODEL_FRAMES,
) -> torch.Tensor:
    """Frames ``[N, 3, H, W]`` in [0, 1] (a tensor, or a sequence of ``[3, H, W]`` / ``[n, 3, H, W]``), one size,
    a multiple of ``geometry.multiple`` (:func:`frame_geometry` of the model and tiny AE; 16 for every family of
    the registry with its tiny AE)."""
    if isinstance(frames, torch.Tensor):
        parts = [frames]
    else:
        parts = [f.unsqueeze(0) if f.ndim == 3 else f for f in frames]
        if not parts:
            raise InputError(input_name, "no frames given")
    first = None
    for i, f in enumerate(parts):
        if f.ndim != 4 or f.shape[1] != 3:
            hint = " (channels last? ComfyUI's IMAGE is [N, H, W, 3])" if f.shape[-1] == 3 else ""
            raise InputError(input_name, f"expected RGB frames [N, 3, H, W]; got {list(f.shape)}{hint}")
        if first is None:
            first = f.shape[-2:]
        elif f.shape[-2:] != first:
            raise InputError(
                input_name,
                f"frame {i} is {f.shape[-1]}x{f.shape[-2]} px but frame 0 is {first[1]}x{first[0]} px; all frames "
                "of a stream must have one size",
            )
    out = torch.cat(parts) if len(parts) > 1 else parts[0]
    if out.shape[0] == 0:
        raise InputError(input_name, "no frames given")
    if not out.is_floating_point():
        raise InputError(input_name, f"expected float frames in [0, 1]; got {out.dtype}")
    lo, hi = torch.stack(torch.aminmax(out)).tolist()  # one read back per push: min and max propagate NaN
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise InputError(input_name, "frames contain NaN or infinite values")
    if lo < -1e-3 or hi > 1 + 1e-3:
        raise InputError(input_name, f"frame values must be in [0, 1]; got [{lo:.3f}, {hi:.3f}]")
    check_frame_size(out.shape[-2], out.shape[-1], input_name, geometry)
    return out


def _first_rows(cond: TextCondition, n: int) -> TextCondition:
    pooled = None if cond.pooled is None else cond.pooled[:n]
    return TextCondition(cond.context[:n], pooled, cond.guidance)


class StreamBatch:
    """A live stream: push frames (or latents), get each one back T forwards later. See the module docstring.

    ``positive`` / ``negative``: one prompt each (batch 1), used for every frame. ``tiny_vae`` (taef1; taef2 for FLUX.2) may be
    None when only :meth:`push_latents` is used.
    """

    def __init__(
        self,
        handle: ModelHandle,
        tiny_vae,
        positive: TextCondition,
        *,
        height: int,
        width: int,
        config: StreamConfig | None = None,
        negative: TextCondition | None = None,
        seed: int = 0,
        options: RunOptions | None = None,
    ):
        config = config or StreamConfig()
        config.check()
        check_image_model(handle, use=STREAM_BATCH)
        if tiny_vae is not None:
            check_tiny_vae(tiny_vae, handle)
        self.geometry = frame_geometry(handle, tiny_vae)
        check_frame_size(height, width, geometry=self.geometry)
        self.handle, self.vae, self.config, self.seed = handle, tiny_vae, config, int(seed)
        # the stream's run (engine.run): its backends, and the handle's compile feature used as the sampler uses
        # it (its telemetry joins the summary); a step cache has nothing to reuse across the stream's rows
        run = open_run(handle, options or RunOptions(step_cache=False))
        self.compile_run = run.compiled
        self._compile_telemetry = None
        self.model, self.backends = run.model, run.backends
        self.blocks = run.blocks  # the cancel check between blocks, when the options carry one
        # the handle's LoRA, merged again if another handle ran between
        self._ensure_weights = run.weights_keeper
        self.family = handle.family
        self.device, self.dtype = handle.device, handle.dtype
        self.size = (height, width)
        fmt = self.family.latent_format
        latent_h, latent_w = height // fmt.downscale, width // fmt.downscale
        self.latent_shape = (fmt.channels, latent_h, latent_w)
        # taef1's latent is the FLUX.1 / Z-Image model's (no conversion: the FLUX.1 path stays bit-identical);
        # taef2's is converted to and from FLUX.2's 128-channel latent (a 2x2 patchify, exact)
        self._vae_same_space = tiny_vae is None or _same_space(tiny_vae, fmt)
        steps, fb = config.steps, config.frame_buffer_size
        self.sigmas = config.step_sigmas(image_seq_len=self.family.image.image_tokens(latent_h, latent_w))
        sig = self.sigmas.to(self.device)
        self._row_sigma = sig[:steps].repeat_interleave(fb).view(-1, 1, 1, 1)
        self._row_sigma_next = sig[1:].repeat_interleave(fb).view(-1, 1, 1, 1)
        gen = torch.Generator(device="cpu").manual_seed(self.seed)
        self.noise = torch.randn((steps, fb, *self.latent_shape), generator=gen).to(self.device)
        rows = self.noise.reshape(steps * fb, *self.latent_shape)
        # row of step k re-noises with the slot of step k + 1; the last step lands on sigma 0 (no noise)
        self._next_noise = torch.cat([rows[fb:], torch.zeros_like(rows[:fb])])
        self.filter = SimilarityFilter(config.similarity_threshold, config.max_skip_frames, self.seed)
        self.set_prompt(positive, negative)
        self.reset()

    # -- prompts ---------------------------------------------------------------------------------------------------
    def set_prompt(self, positive: TextCondition, negative: TextCondition | None = None) -> None:
        """Use these prompts from the next forward on (frames already in the buffer keep their progress)."""
        for name, cond in (("positive", positive), ("negative", negative)):
            if cond is None:
                continue
            check_condition(self.handle, cond, name)
            if cond.context.shape[0] != 1:
                raise InputError(
                    name,
                    f"expected one prompt (batch 1) for every frame; got a batch of {cond.context.shape[0]}",
                )
        if negative is None and self.config.needs_negative:
            raise InputError(
                "negative",
                f"cfg_mode '{self.config.cfg_mode}' runs the unconditional branch with a negative prompt; connect "
                "one (e.g. an empty prompt) or use cfg_mode 'self', which needs none",
            )
        # padding tokens as the family's DiT takes them (Z-Image drops masked tokens, FLUX keeps them)
        positive = for_family(positive, self.family, "positive")
        negative = None if negative is None else for_family(negative, self.family, "negative")
        rows = self.config.steps * self.config.frame_buffer_size
        self._pos = positive.repeat_to(rows).to(self.device, self.dtype)
        self._neg = None if negative is None else negative.repeat_to(rows).to(self.device, self.dtype)
        self._cond_cache: dict[tuple[int, int], list[TextCondition]] = {}

    def _conds(self, n: int, n_uncond: int) -> list[TextCondition]:
        """Conditions for ``n`` positive rows then ``n_uncond`` negative rows: one batch when they can share a
        forward (same token count, and same distilled guidance for models that embed it), else two."""
        key = (n, n_uncond)
        if key not in self._cond_cache:
            pos = _first_rows(self._pos, n)
            if not n_uncond:
                conds = [pos]
            else:
                neg = _first_rows(self._neg, n_uncond)
                same = pos.context.shape[1] == neg.context.shape[1] and (
                    pos.guidance == neg.guidance or not self.family.image.guidance(self.handle.params)
                )
                conds = [concat_conditions([pos, neg])] if same else [pos, neg]
            self._cond_cache[key] = conds
        return self._cond_cache[key]

    # -- state -----------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """An empty buffer, the filter re-seeded, statistics cleared (noise and prompts are kept)."""
        steps, fb = self.config.steps, self.config.frame_buffer_size
        pending = ((steps - 1) * fb, *self.latent_shape)
        self._pending_x = torch.zeros(pending, device=self.device)
        self._pending_ref = torch.zeros(pending, device=self.device)
        # entry k: the group that will be at step k + 1 in the next forward (None: an empty slot)
        self._pending_groups: list[int | None] = [None] * (steps - 1)
        self._next_group = 0
        self._last: StreamOutput | None = None
        self._decode_outputs = False  # push() decodes what finishes; push_latents() hands out latents
        self.last_push_skipped = False
        self.filter.reset()
        self.stats = StreamStats()

    @property
    def frames_in_flight(self) -> int:
        return sum(g is not None for g in self._pending_groups) * self.config.frame_buffer_size

    # -- the model -------------------------------------------------------------------------------------------------
    def _velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: TextCondition) -> torch.Tensor:
        self.stats.add_forward(x.shape[0])
        v = self.family.velocity(
            self.model,
            x.to(self.dtype),
            sigma.reshape(-1).float(),
            cond,
            block_runner=self.blocks(None),
            backends=self.backends,
        )
        return v.float()

    def model_velocities(
        self, x: torch.Tensor, sigma: torch.Tensor, n_uncond: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Conditional velocity of every row of ``x`` and unconditional velocity of its first ``n_uncond`` rows,
        in one forward when the prompts allow it."""
        self._ensure_weights()
        n = x.shape[0]
        conds = self._conds(n, n_uncond)
        if not n_uncond:
            return self._velocity(x, sigma, conds[0]), None
        if len(conds) == 1:
            v = self._velocity(torch.cat([x, x[:n_uncond]]), torch.cat([sigma, sigma[:n_uncond]]), conds[0])
            return v[:n], v[n:]
        return self._velocity(x, sigma, conds[0]), self._velocity(x[:n_uncond], sigma[:n_uncond], conds[1])

    def uncond_rows(self, rows: int, new_group: bool) -> int:
        """How many unconditional rows a forward over ``rows`` rows adds (see :mod:`.guidance`)."""
        c = self.config
        if not c.cfg_active:
            return 0
        if c.cfg_mode == "full":
            return rows
        if c.cfg_mode == "initialize" and new_group:
            return c.frame_buffer_size
        return 0

    def guided(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        ref: torch.Tensor,
        v_cond: torch.Tensor,
        v_uncond: torch.Tensor | None,
        new_group: bool,
    ) -> torch.Tensor:
        """The velocity a step uses. Writes the initialize-mode reference (x0 of the unconditional forward)
        into ``ref`` for a new group."""
        c = self.config
        if not c.cfg_active:
            return v_cond
        if c.cfg_mode == "full":
            return guided_velocity(v_cond, v_uncond, c.guidance_scale)
        fb = c.frame_buffer_size
        if c.cfg_mode == "initialize" and new_group:
            ref[:fb] = x[:fb] - sigma[:fb] * v_uncond
        v_u = residual_velocity(x, sigma, ref, c.delta)
        if c.cfg_mode == "initialize" and new_group and c.delta == 1.0:
            v_u[:fb] = (
                v_uncond  # the real unconditional prediction (what the residual gives, without rounding)
            )
        return guided_velocity(v_cond, v_u, c.guidance_scale)

    # -- the stream ------------------------------------------------------------------------------------------------
    def _advance(self, latents: torch.Tensor | None) -> StreamOutput | None:
        """One forward over every occupied step slot; a new group (``latents``) enters at step 0."""
        steps, fb = self.config.steps, self.config.frame_buffer_size
        new = latents is not None
        groups = [self._take_group() if new else None, *self._pending_groups]
        occupied = [k for k, g in enumerate(groups) if g is not None]
        if not occupied:
            return None
        lo, hi = occupied[0], occupied[-1] + 1
        assert occupied == list(range(lo, hi)), groups  # groups enter at step 0 and leave at T - 1, in order
        t0 = time.perf_counter()
        with torch.inference_mode():
            s0 = self._row_sigma[:fb]
            if not new:  # flushing: the step-0 rows are empty and stay outside the forward
                latents = torch.zeros_like(self._pending_x[:fb])
            entering = (1 - s0) * latents + s0 * self.noise[0]
            x = torch.cat([entering, self._pending_x])
            ref = torch.cat([latents, self._pending_ref])
            rows = slice(lo * fb, hi * fb)
            xs, sigma, refs = x[rows], self._row_sigma[rows], ref[rows]
            v_c, v_u = self.model_velocities(xs, sigma, self.uncond_rows(xs.shape[0], new))
            v = self.guided(xs, sigma, refs, v_c, v_u, new)
            x0, x_next = advance(
                self.config.sampler, xs, sigma, self._row_sigma_next[rows], v, self._next_noise[rows]
            )
            x[rows] = x_next
            self._pending_x = x[: (steps - 1) * fb]
            self._pending_ref = ref[: (steps - 1) * fb]
            self._pending_groups = groups[: steps - 1]
            done = x0[-fb:].clone() if hi == steps else None
        self.stats.seconds_dit += time.perf_counter() - t0
        if done is None:
            return None
        if not bool(
            torch.isfinite(done).all()
        ):  # one reduction per finished group (read back with it anyway)
            raise InputError(
                "model",
                f"the denoised latents of input group {groups[-1]} hold NaN or infinite values although its frames "
                "and the conditioning are finite; the weights hold NaN/Inf, or the compute dtype overflowed",
            )
        self.stats.groups_out += 1
        return StreamOutput(group=groups[-1], latents=done)

    def _take_group(self) -> int:
        self._next_group += 1
        return self._next_group - 1

    def push_latents(self, latents: torch.Tensor) -> StreamOutput | None:
        """Push a group ``[fb, C, h, w]`` already in the model's latent space; returns the group that finished
        (``images`` None), or None during warm-up. No similarity filter here: it looks at pixels. A later
        :meth:`flush` returns latents only, as this does."""
        self._decode_outputs = False
        return self._push_latents(latents)

    def _push_latents(self, latents: torch.Tensor) -> StreamOutput | None:
        fb = self.config.frame_buffer_size
        if latents.shape != (fb, *self.latent_shape):
            raise InputError(
                "latents",
                f"expected a group of latents {[fb, *self.latent_shape]}; got {list(latents.shape)}",
            )
        self.stats.groups_in += 1
        return self._advance(latents.to(self.device, torch.float32))

    def push(self, frames: torch.Tensor) -> StreamOutput | None:
        """Push ``frame_buffer_size`` frames ``[fb, 3, H, W]`` in [0, 1] (``[3, H, W]`` when fb is 1).

        Returns the group pushed ``T - 1`` processed pushes earlier, decoded; ``None`` during warm-up; the
        previous output again (``skipped=True``) when the similarity filter skips this input.
        """
        self._check_push(frames)
        frames = frames.unsqueeze(0) if frames.ndim == 3 else frames
        self.last_push_skipped = self.filter(frames)
        if self.last_push_skipped:
            self.stats.add_skip(self._take_group())
            return None if self._last is None else dataclasses.replace(self._last, skipped=True)
        t0 = time.perf_counter()
        latents = self.encode_frames(frames)
        self.stats.seconds_encode += time.perf_counter() - t0
        self._decode_outputs = True
        out = self._push_latents(latents)
        if out is not None:
            self._decode(out)
            self._last = out
        return out

    def flush(self) -> list[StreamOutput]:
        """Run the groups still in the buffer to the end (``T - 1`` forwards at most) and return them, decoded
        when they were pushed as frames (:meth:`push`)."""
        outs = []
        while any(g is not None for g in self._pending_groups):
            out = self._advance(None)
            if out is not None:
                if self._decode_outputs:
                    self._decode(out)
                    self._last = out
                outs.append(out)
        return outs

    def _decode(self, out: StreamOutput) -> None:
        t0 = time.perf_counter()
        out.images = self.decode_latents(out.latents)
        self.stats.seconds_decode += time.perf_counter() - t0

    # -- the tiny AE -------------------------------------------------------------------------------------------------
    def encode_frames(self, frames: torch.Tensor) -> torch.Tensor:
        """Frames ``[n, 3, H, W]`` -> latents ``[n, *latent_shape]`` in the model's space, float32."""
        z = self.vae.encode(frames).float()
        if self._vae_same_space:
            return z
        return self.family.latent_format.process_in(self.vae.latent_to_raw(z))

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents in the model's space -> RGB ``[n, 3, H, W]`` in [0, 1]."""
        if not self._vae_same_space:
            latents = self.vae.raw_to_latent(self.family.latent_format.process_out(latents))
        return self.vae.decode(latents)

    def _check_push(self, frames: torch.Tensor) -> None:
        if self.vae is None:
            use = " or ".join(v.name for v in variants_for(self.family.latent_format))
            raise InputError("tiny_vae", f"push() encodes frames: create the stream with a tiny VAE ({use})")
        fb = self.config.frame_buffer_size
        shape = list(frames.shape)
        if frames.ndim == 3 and fb == 1:
            shape = [1, *shape]
        if len(shape) != 4 or shape[1] != 3 or shape[0] != fb:
            raise InputError(
                "frames",
                f"push takes a group of frame_buffer_size={fb} RGB frames [{fb}, 3, H, W]; got {list(frames.shape)}",
            )
        if tuple(shape[-2:]) != self.size:
            raise InputError(
                "frames",
                f"frames are {shape[-1]}x{shape[-2]} px; this stream was prepared for {self.size[1]}x{self.size[0]} "
                "px (all frames of a stream must have one size)",
            )
        check_frames(frames.unsqueeze(0) if frames.ndim == 3 else frames, geometry=self.geometry)

    # -- a whole clip ----------------------------------------------------------------------------------------------
    def run(
        self,
        frames: torch.Tensor | Sequence[torch.Tensor],
        callback: Callable[[int, int, StreamOutput | None], None] | None = None,
    ) -> torch.Tensor:
        """Stylize a clip ``[N, 3, H, W]`` from a fresh state: push every group, flush, and return ``[N, 3, H, W]``
        (float32, CPU) aligned with the input. A skipped frame repeats the output of the last processed frame
        before it. The last group is padded with copies of the last frame when N is not a multiple of fb.
        ``callback(done, total, output)`` runs after every forward (total = groups + T - 1)."""
        frames = check_frames(frames, geometry=self.geometry)
        if tuple(frames.shape[-2:]) != self.size:
            raise InputError(
                "frames",
                f"frames are {frames.shape[-1]}x{frames.shape[-2]} px; this stream was prepared for "
                f"{self.size[1]}x{self.size[0]} px",
            )
        fb = self.config.frame_buffer_size
        n = frames.shape[0]
        groups = math.ceil(n / fb)
        if groups * fb > n:
            frames = torch.cat([frames, frames[-1:].expand(groups * fb - n, -1, -1, -1)])
        self.reset()
        total = groups + self.config.steps - 1
        results: dict[int, torch.Tensor] = {}
        source: list[int] = []
        done = 0

        def collect(out: StreamOutput | None) -> None:
            nonlocal done
            done += 1
            if out is not None and not out.skipped:
                results[out.group] = out.images.float().cpu()
            if callback is not None:
                callback(min(done, total), total, out)

        for g in range(groups):
            out = self.push(frames[g * fb : (g + 1) * fb])
            source.append(source[-1] if self.last_push_skipped else g)
            collect(out)
        for out in self.flush():
            collect(out)
        if callback is not None and done < total:
            callback(total, total, None)
        return torch.cat([results[source[g]] for g in range(groups)])[:n]

    def summary(self, seconds: float | None = None, frames: int | None = None) -> str:
        """The report the node shows: settings, forwards and rows, skips, frames per second."""
        c, s = self.config, self.stats
        fb = c.frame_buffer_size
        frames = s.groups_in * fb if frames is None else frames
        lines = [f"stream batch: {c.describe(self.sigmas)}"]
        steady = c.rows_per_forward()
        lines.append(
            f"{s.forwards} DiT forwards for {s.groups_in - s.groups_skipped} processed groups of {fb} frame(s) "
            f"(steady state {steady} rows per forward; rows per forward: {_runs(s.row_runs)})"
        )
        lines.append(
            f"latency: T = {c.steps} forwards (a frame pushed at push p comes out of push p + {c.steps - 1}); "
            f"the first {c.steps - 1} pushes return nothing (warm-up), the flush drains the last {c.steps - 1}"
        )
        filt = self.filter
        if filt.enabled:
            listed = [g * fb + j for g in s.skipped_groups for j in range(fb) if g * fb + j < frames]
            listed = listed[:SKIPS_KEPT]
            # only the last group can hold padding frames past ``frames`` (a clip not a multiple of fb)
            last = s.last_skipped_group
            padding = 0 if last is None else max(0, min(fb, (last + 1) * fb - frames))
            skipped = s.groups_skipped * fb - padding
            which = ", ".join(map(str, listed)) + (", ..." if skipped > len(listed) else "")
            lines.append(
                f"similarity filter: {skipped} of {frames} frames skipped (threshold "
                f"{filt.threshold:g}, at most {filt.max_skip} in a row, seed {filt.seed})"
                + (f": frames {which} (0-based) repeat the last processed frame" if skipped else "")
            )
        else:
            lines.append("similarity filter: off (0 frames skipped)")
        if seconds:
            other = seconds - s.seconds_dit - s.seconds_encode - s.seconds_decode
            lines.append(
                f"{frames / seconds:.2f} frames/s ({frames} frames in {seconds:.2f} s: DiT {s.seconds_dit:.2f} s, "
                f"tiny AE encode {s.seconds_encode:.2f} s, decode {s.seconds_decode:.2f} s, other {other:.2f} s)"
            )
        if self.compile_run is not None:
            if self._compile_telemetry is None:
                self._compile_telemetry = self.compile_run.finish()
            lines += self._compile_telemetry.summary_lines()
        return "\n".join(lines)


def _runs(runs: list[list[int]]) -> str:
    """``[[1, 1], [2, 1], [3, 3], [2, 1], [1, 1]]`` -> ``1, 2, 3 x3, 2, 1``."""
    return ", ".join(f"{rows}" if n == 1 else f"{rows} x{n}" for rows, n in runs) or "none"
