"""Per-family maps from foreign module names (diffusers, XLabs...) to official modules (``formats.Target``).

Official names need no map: every module of the model matches itself. A family's map is built from the model
(block counts and widths come from its params), so a LoRA for another size fails on shapes, not silently.
"""

from __future__ import annotations

from torch import nn

from .formats import Target


def foreign_names(family: str, model: nn.Module) -> dict[str, list[Target]]:
    build = _BUILDERS.get(family)
    return {} if build is None else build(model)


_BUILDERS: dict = {}
