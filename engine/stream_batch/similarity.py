"""Stochastic similarity filter: skip input frames that are nearly the same as the last one processed.

For each input (after the first since a reset) the filter takes the cosine similarity ``c`` between it and the
last input it let through, on pixels mapped to [-1, 1] (StreamDiffusion compares its preprocessed [-1, 1]
tensors; on [0, 1] pixels any two images look alike). The skip probability rises linearly past the threshold:

    p = max(0, 1 - (1 - c) / (1 - threshold))      (0 at c = threshold, 1 at c = 1; 0 when threshold >= 1)

One uniform draw ``u`` per compared input, from a generator seeded once (input k after a reset uses the k-th
draw, whatever happened before); the input is skipped when ``u < p`` and fewer than ``max_skip`` inputs in a
row have been skipped. A processed input becomes the new reference and resets the run of skips. (StreamDiffusion
lets ``max_skip + 1`` skips through and never resets its counter on a processed frame; here the cap is exactly
the longest run of consecutive skips.)
"""

from __future__ import annotations

import torch


def cosine_similarity(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-6) -> float:
    """Cosine similarity of two [0, 1] images (any shape) after mapping them to [-1, 1]."""
    x = a.reshape(-1).double() * 2 - 1
    y = b.reshape(-1).double() * 2 - 1
    return float((x @ y) / (x.norm() * y.norm()).clamp_min(eps))


def skip_probability(similarity: float, threshold: float) -> float:
    if threshold >= 1.0:
        return 0.0
    return max(0.0, 1.0 - (1.0 - similarity) / (1.0 - threshold))


class SimilarityFilter:
    """Decides per input whether to skip it; holds the reference input, the run of skips and the generator."""

    def __init__(self, threshold: float = 1.0, max_skip: int = 10, seed: int = 0):
        self.threshold = float(threshold)
        self.max_skip = int(max_skip)
        self.seed = int(seed)
        self.reset()

    @property
    def enabled(self) -> bool:
        return self.threshold < 1.0 and self.max_skip > 0

    def reset(self) -> None:
        self.generator = torch.Generator(device="cpu").manual_seed(self.seed)
        self.reference: torch.Tensor | None = None
        self.consecutive = 0
        self.skipped = 0
        self.last_similarity: float | None = None
        self.last_probability = 0.0

    def __call__(self, frames: torch.Tensor) -> bool:
        """True when ``frames`` should be skipped (the caller then repeats its previous output)."""
        if not self.enabled:
            return False
        if self.reference is None:
            self.reference = frames.detach().clone()
            return False
        self.last_similarity = cosine_similarity(self.reference, frames)
        self.last_probability = skip_probability(self.last_similarity, self.threshold)
        draw = float(torch.rand((), generator=self.generator, dtype=torch.float64))
        if draw < self.last_probability and self.consecutive < self.max_skip:
            self.consecutive += 1
            self.skipped += 1
            return True
        self.consecutive = 0
        self.reference = frames.detach().clone()
        return False
