"""``WeightDelta``: one change a LoRA file makes to one parameter of the model, in the model's official names.

A delta is either low rank (``up @ down``, scaled by ``alpha / rank`` when the file gives an alpha, by 1 when it
does not) or a full tensor (``diff``: the ``.diff`` / ``.diff_b`` entries of Wan step-distillation files). ``rows``
places it on a slice of the parameter's first dimension: a diffusers LoRA on ``to_q`` patches the first third of
FLUX's fused ``qkv``. The arithmetic is ComfyUI's: the weight is taken to float32, each delta is added in float32
as ``strength * scale * (up @ down)`` (or ``strength * diff``) in file order, and the sum is cast back once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class WeightDelta:
    key: str  # the model parameter it changes (official name, e.g. "double_blocks.0.img_attn.qkv.weight")
    source: str  # the file entry it came from (its prefix, for messages)
    up: torch.Tensor | None = None  # [rows, rank]
    down: torch.Tensor | None = None  # [rank, fan_in...]
    alpha: float | None = None
    diff: torch.Tensor | None = None
    rows: tuple[int, int] | None = None  # (start, length) on dim 0; None: the whole parameter

    @property
    def is_low_rank(self) -> bool:
        return self.diff is None

    @property
    def rank(self) -> int:
        return 0 if self.down is None else int(self.down.shape[0])

    @property
    def scale(self) -> float:
        """ComfyUI's LoRA scale: ``alpha / rank`` where the file stores an alpha, else 1."""
        if self.diff is not None or self.alpha is None:
            return 1.0
        return float(self.alpha) / self.rank

    def shape_on(self, param_shape: torch.Size) -> tuple[int, ...]:
        """The shape this delta must have to be added to a parameter of ``param_shape``."""
        shape = tuple(param_shape)
        if self.rows is not None:
            shape = (self.rows[1], *shape[1:])
        return shape

    def delta_shape(self) -> tuple[int, ...]:
        if self.diff is not None:
            return tuple(self.diff.shape)
        return (int(self.up.shape[0]), *tuple(self.down.shape[1:]))

    def add_to(self, weight: torch.Tensor, strength: float) -> None:
        """``weight`` (float32, the parameter's full shape) += this delta at ``strength``, in place."""
        target = weight if self.rows is None else weight.narrow(0, self.rows[0], self.rows[1])
        if self.diff is not None:
            if strength != 0.0:
                target += strength * self.diff.to(device=weight.device, dtype=torch.float32)
            return
        up = self.up.to(device=weight.device, dtype=torch.float32)
        down = self.down.to(device=weight.device, dtype=torch.float32)
        lora = torch.mm(up.flatten(start_dim=1), down.flatten(start_dim=1)).reshape(target.shape)
        target += (strength * self.scale) * lora

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.up, self.down, self.diff) if t is not None)
