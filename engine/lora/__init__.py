"""LoRA for the pack's models: read a file in any common naming, merge it into shared weights in place, undo it.

``file.read_lora`` (a file to a :class:`LoraPatch` of official-name deltas, via ``formats`` / ``names``),
``merge`` (the per-model :class:`MergedWeights` that runs call before a forward), ``apply.apply_lora`` (the API).
"""

from .apply import apply_lora
from .delta import WeightDelta
from .file import read_lora
from .merge import MergedWeights, base_state_dict, ensure_patches, merged_weights
from .patch import LoraPatch

__all__ = [
    "LoraPatch",
    "MergedWeights",
    "WeightDelta",
    "apply_lora",
    "base_state_dict",
    "ensure_patches",
    "merged_weights",
    "read_lora",
]
