"""``LoraPatch``: one LoRA file read for one model architecture, at one strength.

A patch is immutable and holds its deltas on the CPU, in the dtype of the file. Building it validates every
delta against the model (key and shape); applying it is :mod:`.merge`'s job, so a handle can carry any number of
patches without touching the shared model until a run uses them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch

from .delta import WeightDelta


@dataclass(frozen=True, eq=False)
class LoraPatch:
    name: str  # the file name, for messages and describe()
    path: str  # where it was read from (worker pools read the same file)
    strength: float
    format: str  # the naming the file used ("diffusers", "kohya", "comfyui", "xlabs", ...)
    family: str  # the model family it was converted for
    deltas: tuple[WeightDelta, ...] = field(repr=False)
    digest: float = 0.0  # a checksum of the deltas (merge signatures; pools check they read the same)
    text_encoder_keys: int = 0  # entries for the text encoder, reported and not applied

    @functools.cached_property
    def by_key(self) -> dict[str, tuple[WeightDelta, ...]]:
        """The deltas of each parameter, in file order (a merge visits each parameter once)."""
        grouped: dict[str, list[WeightDelta]] = {}
        for d in self.deltas:
            grouped.setdefault(d.key, []).append(d)
        return {k: tuple(v) for k, v in grouped.items()}

    @property
    def keys(self) -> set[str]:
        return set(self.by_key)

    @property
    def signature(self) -> tuple:
        """What decides the merged weights: equal signatures merge to equal weights."""
        return (self.path, self.digest, float(self.strength))

    def with_strength(self, strength: float) -> LoraPatch:
        return dataclasses.replace(self, strength=float(strength))

    def nbytes(self) -> int:
        return sum(d.nbytes() for d in self.deltas)

    def describe(self) -> str:
        low = sum(d.is_low_rank for d in self.deltas)
        ranks = sorted({d.rank for d in self.deltas if d.is_low_rank})
        rank = (
            f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}" if ranks else "no rank"
        )
        return (
            f"{self.name} ({self.format} format, {low} low-rank and {len(self.deltas) - low} full deltas on "
            f"{len(self.keys)} weights, {rank}) at strength {self.strength:g}"
        )


def deltas_digest(deltas) -> float:
    """A checksum of every element (a sum and an absolute sum per tensor, float64) plus the first elements
    weighted by position, order-independent over the deltas. It names the patch in merge signatures and pool
    checks, so a file rewritten at the same path must change it even where only its last elements changed;
    reading every element once costs far less than reading the file did."""
    total = 0.0
    for i, d in enumerate(sorted(deltas, key=lambda d: (d.key, d.source, d.rows or (0, 0)))):
        weight = 1.0 + 0.01 * (i % 97)
        for j, t in enumerate((d.up, d.down, d.diff)):
            if t is not None:
                flat = t.detach().flatten().to(torch.float64)
                head = flat[:32] * torch.arange(1, min(32, flat.numel()) + 1, dtype=torch.float64)
                total += weight * (
                    float(head.sum()) + float(flat.sum()) * (2.0 + j) + float(flat.abs().sum()) * 0.5
                )
        total += 1e-3 * len(d.key) + (d.alpha or 0.0) * 1e-6
    return total if math.isfinite(total) else 0.0
