"""A diffusion model plus its conditioning, seen by samplers as ``denoised = f(x, sigma)``.

Classifier-free guidance runs only when there is a negative prompt *and* ``cfg != 1``; then the positive and
negative rows go through the model as one batch when their token counts match (one forward per step either
way, twice the rows with CFG). With ``cfg == 1`` the negative is never evaluated.

With a step cache (``step_cache``: a per-run holder from ``engine.step_cache``) each forward goes through the holder,
which may reuse kept residuals instead of running the whole block stack, and from its CFG cut-off on the
unconditional pass is replaced by ``v_neg = v_pos + delta`` (``delta = v_neg - v_pos`` of the last step that ran
it). ``model_calls`` counts forwards that ran every block; ``cache_probes`` those served from the cache.

Conditions with a padding mask are put in the family's form once, up front (:func:`~.conditioning.for_family`:
Z-Image drops the masked tokens, FLUX keeps every token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .backends import DEFAULT_BACKENDS, Backends
from .conditioning import TextCondition, for_family


def concat_conditions(conds: Sequence[TextCondition]) -> TextCondition:
    """Several prompts' rows as one batch, for one forward over them (CFG's positive and negative rows).

    They must share a token count; the guidance strength is the first one's (one scalar per forward).
    """
    pooled = None
    if conds[0].pooled is not None:
        pooled = torch.cat([c.pooled for c in conds], 0)
    return TextCondition(torch.cat([c.context for c in conds], 0), pooled, conds[0].guidance)


class FlowDenoiser:
    """k-diffusion-style denoiser over a flow-matching model: ``x0 = x - sigma * velocity``.

    ``positive`` (and ``negative``) are lists of prompts: several entries are averaged, as ComfyUI averages
    full-image conditionings.
    """

    def __init__(
        self, model, family, positive, negative=None, cfg: float = 1.0, dtype=None, step_cache=None,
        backends: Backends = DEFAULT_BACKENDS, blocks=None,
    ):  # fmt: skip
        """``backends``: how the run computes (``engine.backends``); ``blocks(inner) -> block_runner``: the run's
        block runner around a step cache's (``Run.blocks``: a worker's sharding), or None."""
        self.model = model
        self.backends = backends
        self.blocks = blocks or (lambda inner: inner)
        self.family = family
        self.positive = [for_family(c, family, "positive") for c in positive]
        self.negative = [for_family(c, family, "negative") for c in negative or []]
        self.cfg = float(cfg)
        self.dtype = dtype
        self.step_cache = step_cache
        self.model_calls = 0
        self.rows_evaluated = 0
        self.cache_probes = 0
        self._cache_key = None
        self._cache: list[TextCondition] = []

    @property
    def uses_cfg(self) -> bool:
        return bool(self.negative) and self.cfg != 1.0

    def _velocity(self, x, sigma, cond: TextCondition, labels: tuple[str, ...]) -> torch.Tensor:
        run = self.step_cache
        if run is None:
            runner = self.blocks(None)
            v = self.family.velocity(self.model, x, sigma, cond, block_runner=runner, backends=self.backends)
        else:
            v = run.velocity(self.model, self.family, x, sigma, cond, labels, self.backends, self.blocks)
            if not run.last_call_full:
                self.cache_probes += 1
                return v
        self.model_calls += 1
        self.rows_evaluated += x.shape[0]
        return v

    def _mean_velocity(self, x, sigma, conds, labels) -> list[torch.Tensor]:
        """Velocity per prompt; prompts whose token counts agree share one batched forward."""
        if len(conds) == 1:
            return [self._velocity(x, sigma, conds[0], (labels[0],))]
        b = x.shape[0]
        groups: dict[tuple, list[int]] = {}
        for idx, c in enumerate(conds):
            groups.setdefault((c.context.shape[1], c.guidance), []).append(idx)
        out: list[torch.Tensor | None] = [None] * len(conds)
        for idxs in groups.values():
            batch = concat_conditions([conds[i] for i in idxs])
            xs = x.repeat(len(idxs), *([1] * (x.ndim - 1)))
            v = self._velocity(xs, sigma.repeat(len(idxs)), batch, tuple(labels[i] for i in idxs))
            for j, i in enumerate(idxs):
                out[i] = v[j * b : (j + 1) * b]
        return out

    def _prepared(self, batch: int, device, dtype) -> list[TextCondition]:
        """Conditions tiled to the batch and moved once per run, not once per step."""
        key = (batch, device, dtype)
        if self._cache_key != key:
            conds = self.positive + (self.negative if self.uses_cfg else [])
            self._cache = [c.repeat_to(batch).to(device, dtype) for c in conds]
            self._cache_key = key
        return self._cache

    @property
    def labels(self) -> list[str]:
        """Row-group names the step cache keeps its tensors under: pos0, pos1..., then neg0..."""
        pos = [f"pos{i}" for i in range(len(self.positive))]
        return pos + ([f"neg{i}" for i in range(len(self.negative))] if self.uses_cfg else [])

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **_: object) -> torch.Tensor:
        dtype = self.dtype or x.dtype
        xin = x.to(dtype)
        sig = sigma.to(torch.float32)
        n_pos = len(self.positive)
        run = self.step_cache
        if run is not None:
            run.begin_step(sigma)
        skip_uncond = self.uses_cfg and run is not None and run.skip_uncond()
        conds, labels = self._prepared(x.shape[0], x.device, dtype), self.labels
        if skip_uncond:
            conds, labels = conds[:n_pos], labels[:n_pos]
        vs = self._mean_velocity(xin, sig, conds, labels)
        v_pos = torch.stack(vs[:n_pos]).mean(0) if n_pos > 1 else vs[0]
        v = v_pos
        if self.uses_cfg:
            if skip_uncond:
                v_neg = v_pos + run.cfg_delta
                run.note_uncond_skipped(self.model.num_blocks * x.shape[0] * len(self.negative))
            else:
                neg = vs[n_pos:]
                v_neg = torch.stack(neg).mean(0) if len(neg) > 1 else neg[0]
                if run is not None:
                    run.store_cfg_delta(v_neg - v_pos)
            v = v_neg + self.cfg * (v_pos - v_neg)
        s = sigma.to(x.dtype).view(-1, *([1] * (x.ndim - 1)))
        return x - s * v.to(x.dtype)
