"""Per-run holders: the state a gated sampling run keeps between its steps, and nothing anywhere else.

:meth:`CacheGate.start_run` creates one for each sampling run; ``finish`` returns the telemetry and empties it
(``reset``), so two runs never share anything. The model and the handle are never written to.

* :class:`BlockCacheRun` (the engine's FLUX.1, FLUX.2, Z-Image and Wan models): the denoiser calls
  :meth:`~BlockCacheRun.velocity` for each forward; it passes a ``block_runner`` to the family's velocity
  adapter, which runs the model's ``embed`` stage, hands the residual stream to the runner (probe, decide, then
  run the remaining blocks or add the kept residual) and finishes with the model's head.
* :class:`WholeModelRun` (ComfyUI's own models, through ModelPatcher wrappers): decides per diffusion-model
  call and reuses the model's last output.

Rows of one forward are labelled by prompt (``pos0``, ``neg0``...; ComfyUI: the conditioning's uuid); what is
kept is kept per label, so a batch that changes composition (CFG gating drops the negative rows) still finds its
own rows. The step's decision is taken on the first forward holding the primary rows (the first positive
prompt) and followed by the other forwards of the step.

CFG gating: from step ``cfg_skip_from`` on, the unconditional pass is not run; the denoiser uses
``v_neg = v_pos + delta`` with ``delta = v_neg - v_pos`` (velocities averaged over prompts) from the last step
that ran it, so the guided velocity is ``v_pos + (1 - cfg) * delta``. For ComfyUI's models (which return x0)
the node keeps ``(x0_uncond - x0_cond) / sigma``, the same model-output difference.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from functools import partial

import torch

from ..models.flux_layers import modulate, norm_modulate
from .calibration import MagCacheCalibration
from .methods import FirstBlockCache, InputChangeCache, MagCache, TeaCache, residual_magnitude_ratio
from .policy import GateDecision
from .telemetry import CacheTelemetry, StepRecord

log = logging.getLogger(__name__)

PRIMARY = "pos0"


def teacache_probe(model, h, rows: int) -> torch.Tensor:
    """TeaCache's probe on the primary rows, before block 0 (see :data:`TEACACHE_PROBES`)."""
    family = type(model).family
    if family not in TEACACHE_PROBES:
        raise ValueError(f"no TeaCache probe for {family} models")
    return TEACACHE_PROBES[family](model, h, rows)


def _flux_probe(model, h, rows: int) -> torch.Tensor:
    """FLUX.1: block 0's modulated image input ``(1 + scale) * LayerNorm(img) + shift``, its own modulation."""
    block = model.double_blocks[0]
    shift, scale = block.img_mod(h.vec[:rows])[:2]
    return modulate(block.img_norm1(h.img[:rows]), shift, scale)


def _flux2_probe(model, h, rows: int) -> torch.Tensor:
    """FLUX.2: the same input of block 0, whose (shift, scale) come from the shared image modulation
    (``Flux2Hidden.mod_img``: the attention triple, computed once per forward for every double block)."""
    shift, scale, _gate = h.mod_img[0]
    return norm_modulate(
        model.double_blocks[0].img_norm1, h.img[:rows], shift[:rows], scale[:rows], h.backends
    )


def _zimage_probe(model, h, rows: int) -> torch.Tensor:
    """Z-Image: the first layer's modulated attention input ``RMSNorm(x) * (1 + scale_msa)`` on the real image
    tokens, FLUX's probe transposed (Z-Image modulates with a scale, no shift). Not the time embedding (Wan's
    probe): Z-Image's reaches the layers only through the modulation, so it would measure the schedule alone and
    take the same decisions for every prompt and image; the image tokens carry the latent through the noise
    refiner. Not the caption tokens: the context refiner is unmodulated, so they are the same at every step and
    would only dilute the change."""
    layer = model.layers[0]
    scale_msa = layer.adaLN_modulation[0](h.vec[:rows]).unsqueeze(1).chunk(4, dim=2)[0]
    image = h.stream[:rows, : h.img_tokens]
    return layer.attention_norm1(image, h.backends) * (1.0 + scale_msa)


def _wan_probe(model, h, rows: int) -> torch.Tensor:
    """Wan: the time embedding ``e`` (the input of the 6-way modulation projection)."""
    return h.e[:rows]


# What TeaCache measures per family. FLUX.1 and Wan follow the published method (their polynomials were fitted on
# these probes); FLUX.2 and Z-Image have no published polynomial, so their probes serve explicit coefficients
# (``teacache_coefficients=(...)``, experiments) only.
TEACACHE_PROBES = {"flux": _flux_probe, "flux2": _flux2_probe, "zimage": _zimage_probe, "wan": _wan_probe}


class _Run:
    def __init__(
        self,
        decision: GateDecision,
        holder,
        sigmas: Sequence[float],
        telemetry: CacheTelemetry,
        calibrate_to: str | None = None,
        identity: dict | None = None,
        sampler: str = "",
    ):
        self.decision = decision
        self.holder = holder
        self.sigmas = [float(s) for s in sigmas]
        self.telemetry = telemetry
        self.calibrate_to = calibrate_to
        self.identity = identity or {}
        self.sampler = sampler
        self.window = frozenset(decision.cache_steps)
        self.kept: dict[object, torch.Tensor] = {}
        self.cfg_delta: torch.Tensor | None = None
        self.record: StepRecord | None = None
        self.last_call_full = True
        self._decided = False
        self._skip = False
        self._off_schedule = True  # until the first step begins
        self._calibration: list[tuple[float, float]] = []
        self._previous_primary: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return self.decision.enabled

    @property
    def calibrating(self) -> bool:
        return self.calibrate_to is not None

    @property
    def cfg_gating(self) -> bool:
        return self.active and self.decision.cfg_skip_from is not None

    # -- steps -----------------------------------------------------------------------------------------------------
    def _step_of(self, sigma: float) -> int | None:
        first = 0 if self.record is None else self.record.index
        for i in range(first, len(self.sigmas) - 1):
            if abs(self.sigmas[i] - sigma) <= 1e-5 * max(1.0, abs(sigma)):
                return i
        return None

    def begin_step(self, sigma) -> None:
        """Called once per sampler step (denoiser call). A sigma off the schedule, or a repeat of the current
        step (samplers that evaluate twice per step), is computed without caching."""
        value = float(sigma.reshape(-1)[0]) if isinstance(sigma, torch.Tensor) else float(sigma)
        index = self._step_of(value)
        self._decided, self._skip = False, False
        if index is None or (self.record is not None and index == self.record.index):
            self._decided = True  # nothing to decide: compute
            self._off_schedule = True
            return
        self._off_schedule = False
        self.record = StepRecord(index, value)
        self.telemetry.records.append(self.record)

    def _decide(self, indicator) -> None:
        i = self.record.index
        cacheable = i in self.window and not self.calibrating
        if isinstance(self.holder, MagCache):
            skip, change, score = (
                (False, None, None) if self.calibrating else self.holder.decide(i, cacheable)
            )
        else:
            skip, change, score = self.holder.decide(indicator, cacheable)
        self.record.change, self.record.score = change, score
        self.record.computed = not skip
        self._skip, self._decided = skip, True

    def _served(self, labels) -> bool:
        return self._skip and all(label in self.kept for label in labels)

    def _after_compute(self) -> None:
        if self._skip and self.record is not None:  # a skip this forward could not serve
            self.record.computed = True

    def _measure_primary(self, primary: torch.Tensor, dim: int) -> None:
        """MagCache: the residual magnitude ratio of the primary rows against the previous computed step's."""
        if not isinstance(self.holder, MagCache) or self._off_schedule:
            return
        prev = self._previous_primary
        if self.calibrating:
            if prev is None:
                ratio, std = 1.0, 0.0
            else:
                per_token = primary.float().norm(dim=dim) / prev.float().norm(dim=dim)
                ratio, std = float(per_token.mean()), float(per_token.std())
            self.record.change = ratio
            self._calibration.append((ratio, std))
        elif prev is not None:
            ratio = residual_magnitude_ratio(primary, prev, dim)
            if not math.isfinite(ratio) or ratio == 0.0:
                self.telemetry.warnings.append(
                    f"step {self.record.index}: the residual magnitude ratio is {ratio} (NaN or zero residual)"
                )
        self._previous_primary = primary

    # -- CFG gating ------------------------------------------------------------------------------------------------
    def skip_uncond(self) -> bool:
        return (
            self.cfg_gating
            and self.record is not None
            and not self._off_schedule
            and self.record.index >= self.decision.cfg_skip_from
            and self.cfg_delta is not None
        )

    def store_cfg_delta(self, delta: torch.Tensor) -> None:
        if self.cfg_gating:
            self.cfg_delta = delta

    def note_uncond_skipped(self, work: int) -> None:
        self.telemetry.uncond_skipped += 1
        self.telemetry.work_uncached += work
        if self.record is not None:
            self.record.uncond_skipped = True

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.kept.clear()
        self.cfg_delta = None
        self.record = None
        self._previous_primary = None
        self._calibration = []
        self.holder.reset()

    def finish(self) -> CacheTelemetry:
        """The run's telemetry (warnings checked, a calibration saved when one was recorded); then reset."""
        t = self.telemetry
        if self.active:
            t.check_measurements()
            if self.calibrating:
                self._save_calibration()
        level = logging.WARNING if t.warnings or self.decision.forced else logging.INFO
        log.log(level, "%s", t.summary())
        self.reset()
        return t

    def _save_calibration(self) -> None:
        steps = len(self.sigmas) - 1
        if len(self._calibration) != steps:
            self.telemetry.warnings.append(
                f"MagCache calibration not written: {len(self._calibration)} of {steps} steps were measured"
            )
            return
        calibration = MagCacheCalibration(
            model=self.identity, steps=steps, ratios=tuple(r for r, _ in self._calibration),
            sampler=self.sampler, sigmas=tuple(self.sigmas), ratio_std=tuple(s for _, s in self._calibration),
        )  # fmt: skip
        self.telemetry.calibration_written = str(calibration.save(self.calibrate_to))
        self.telemetry.calibration_ratios = list(calibration.ratios)


class BlockCacheRun(_Run):
    """Step cache over the engine's models' block stack (see the module docstring)."""

    def velocity(
        self, model, family, x, sigma, cond, labels: Sequence[str], backends, wrap=None
    ) -> torch.Tensor:
        """The family adapter's velocity for ``x`` (rows: ``len(labels)`` groups of equal size) through the cache;
        ``wrap(runner)``: the run's block runner around the cache's (a worker's sharding), if any."""
        runner = self.block_runner(labels, x.shape[0] // len(labels))
        runner = runner if wrap is None else wrap(runner)
        return family.velocity(model, x, sigma, cond, block_runner=runner, backends=backends)

    def block_runner(self, labels: Sequence[str] = (PRIMARY,), rows: int | None = None):
        """The ``block_runner`` hook for one forward (``model(..., block_runner=...)``) whose batch holds the row
        groups ``labels`` of ``rows`` rows each (default: the whole batch is one group); call
        :meth:`begin_step` once per sampler step before the step's forwards."""
        return partial(self._run_blocks, labels=tuple(labels), rows=rows)

    def _run_blocks(self, model, h, labels: tuple[str, ...], rows: int | None):
        n = model.num_blocks
        probe = self.holder.probe_blocks
        total = h.stream.shape[0]
        rows = total // len(labels) if rows is None else rows
        t = self.telemetry
        t.work_uncached += n * total
        before = h.stream
        if probe:
            h = model.run_blocks(h, 0, probe)
        if not self._decided and labels[0] == PRIMARY and self.record is not None:
            if isinstance(self.holder, FirstBlockCache):
                self._decide((h.stream - before)[:rows])
            elif isinstance(self.holder, TeaCache):
                self._decide(teacache_probe(model, h, rows))
            else:
                self._decide(None)
        if self._served(labels):
            kept = [self.kept[label] for label in labels]
            residual = kept[0] if len(kept) == 1 else torch.cat(kept)
            if residual.shape == h.stream.shape:
                self.last_call_full = False
                t.probe_forwards += 1
                t.work_done += probe * total
                return h.with_stream(h.stream + residual)
        self._after_compute()
        base = h.stream
        out = model.run_blocks(h, probe)
        residual = out.stream - base
        for j, label in enumerate(labels):
            self.kept[label] = residual[j * rows : (j + 1) * rows]
        if labels[0] == PRIMARY:
            self._measure_primary(residual[:rows], dim=-1)
        self.last_call_full = True
        t.full_forwards += 1
        t.work_done += n * total
        return out


class WholeModelRun(_Run):
    """Step cache over whole diffusion-model calls (ComfyUI's own models): a skipped call returns the last
    computed output of each row group. Flow models predict a velocity that changes slowly along the
    trajectory, so reusing it amounts to a longer Euler step with the previous slope."""

    primary_key: object = None

    def model_call(
        self,
        x: torch.Tensor,
        keys: Sequence[object],
        compute: Callable[[], torch.Tensor],
        positive: Sequence[bool] | None = None,
    ):
        """``keys``: one per row group of ``x`` (ComfyUI: the conditionings' uuids); ``positive``: which groups
        are the conditional (positive) pass. The primary rows are the first positive group ever seen, so they
        stay the same when CFG gating drops the unconditional rows (ComfyUI batches them first)."""
        keys = list(keys)
        rows = x.shape[0] // max(len(keys), 1)
        t = self.telemetry
        t.work_uncached += x.shape[0]
        if self.primary_key is None:
            flags = list(positive) if positive is not None else [True] * len(keys)
            self.primary_key = next((k for k, f in zip(keys, flags) if f), None)
        holds_primary = self.primary_key in keys
        p = keys.index(self.primary_key) if holds_primary else 0
        x_primary = x[p * rows : (p + 1) * rows]
        if not self._decided and holds_primary and self.record is not None:
            self._decide(x_primary)
        if self._served(keys):
            kept = [self.kept[k] for k in keys]
            out = kept[0].clone() if len(kept) == 1 else torch.cat(kept)
            if out.shape[0] == x.shape[0]:
                self.last_call_full = False
                t.probe_forwards += 1
                return out
        self._after_compute()
        out = compute()
        if not self._off_schedule:
            for j, key in enumerate(keys):
                self.kept[key] = out[j * rows : (j + 1) * rows].clone()
            if holds_primary:
                y_primary = out[p * rows : (p + 1) * rows]
                if isinstance(self.holder, InputChangeCache):
                    self.holder.computed(x_primary.clone(), y_primary.clone())
                self._measure_primary(y_primary, dim=1)
        self.last_call_full = True
        t.full_forwards += 1
        t.work_done += x.shape[0]
        return out


__all__ = ["BlockCacheRun", "PRIMARY", "TEACACHE_PROBES", "WholeModelRun", "teacache_probe"]
