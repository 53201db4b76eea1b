"""A diffusion model plus its conditioning, seen by samplers as ``denoised = f(x, sigma)``.

Classifier-free guidance runs only when there is a negative prompt *and* ``cfg != 1``; then the positive and
negative rows go through the model as one batch when their token counts match (one forward per step either
way, twice the rows with CFG). With ``cfg == 1`` the negative is never evaluated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .conditioning import TextCondition


def _cat_conds(conds: Sequence[TextCondition]) -> TextCondition:
    pooled = None
    if conds[0].pooled is not None:
        pooled = torch.cat([c.pooled for c in conds], 0)
    return TextCondition(torch.cat([c.context for c in conds], 0), pooled, conds[0].guidance)


class FlowDenoiser:
    """k-diffusion-style denoiser over a flow-matching model: ``x0 = x - sigma * velocity``.

    ``positive`` (and ``negative``) are lists of prompts: several entries are averaged, as ComfyUI averages
    full-image conditionings. ``forward_hook``, when given, wraps each model call (used to count or time them).
    """

    def __init__(self, model, family, positive, negative=None, cfg: float = 1.0, dtype=None):
        self.model = model
        self.family = family
        self.positive = list(positive)
        self.negative = list(negative) if negative else []
        self.cfg = float(cfg)
        self.dtype = dtype
        self.model_calls = 0
        self.rows_evaluated = 0
        self._cache_key = None
        self._cache: list[TextCondition] = []

    @property
    def uses_cfg(self) -> bool:
        return bool(self.negative) and self.cfg != 1.0

    def _velocity(self, x, sigma, cond: TextCondition) -> torch.Tensor:
        self.model_calls += 1
        self.rows_evaluated += x.shape[0]
        return self.family.velocity(self.model, x, sigma, cond)

    def _mean_velocity(self, x, sigma, conds) -> list[torch.Tensor]:
        """Velocity per prompt; prompts whose token counts agree share one batched forward."""
        if len(conds) == 1:
            return [self._velocity(x, sigma, conds[0])]
        b = x.shape[0]
        groups: dict[tuple, list[int]] = {}
        for idx, c in enumerate(conds):
            groups.setdefault((c.context.shape[1], c.guidance), []).append(idx)
        out: list[torch.Tensor | None] = [None] * len(conds)
        for idxs in groups.values():
            batch = _cat_conds([conds[i] for i in idxs])
            v = self._velocity(x.repeat(len(idxs), 1, 1, 1), sigma.repeat(len(idxs)), batch)
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

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **_: object) -> torch.Tensor:
        dtype = self.dtype or x.dtype
        xin = x.to(dtype)
        sig = sigma.to(torch.float32)
        n_pos = len(self.positive)
        vs = self._mean_velocity(xin, sig, self._prepared(x.shape[0], x.device, dtype))
        v_pos = torch.stack(vs[:n_pos]).mean(0) if n_pos > 1 else vs[0]
        v = v_pos
        if self.uses_cfg:
            neg = vs[n_pos:]
            v_neg = torch.stack(neg).mean(0) if len(neg) > 1 else neg[0]
            v = v_neg + self.cfg * (v_pos - v_neg)
        s = sigma.to(x.dtype).view(-1, *([1] * (x.ndim - 1)))
        return x - s * v.to(x.dtype)
