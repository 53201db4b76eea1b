"""ComfyUI CONDITIONING <-> the engine's TextCondition.

ComfyUI's CONDITIONING is a list of ``[tokens [B, L, D], {"pooled_output": [B, P], "guidance": g, ...}]``.
Entries the engine cannot honour (regional areas, masks, ControlNets, GLIGEN, timestep ranges, hooks) are
rejected with an error rather than silently ignored.
"""

from __future__ import annotations

import logging

import torch

from ..engine.conditioning import TextCondition
from ..engine.errors import InputError

log = logging.getLogger(__name__)

UNSUPPORTED_KEYS = {
    "area": "regional area (ConditioningSetArea)",
    "mask": "mask (ConditioningSetMask)",
    "control": "ControlNet",
    "gligen": "GLIGEN",
    "hooks": "hooks",
    "concat_latent_image": "concat latent (inpaint / edit conditioning)",
    "reference_latents": "reference latents (Kontext-style editing)",
}
IGNORED_KEYS = {
    "pooled_output",
    "guidance",
    "attention_mask",
    "strength",
    "start_percent",
    "end_percent",
    "uuid",
    "set_area_to_bounds",
    "mask_strength",
    "timestep_start",
    "timestep_end",
}


def from_comfy(conditioning, input_name: str) -> list[TextCondition]:
    if not isinstance(conditioning, list) or not conditioning:
        raise InputError(input_name, "expected a CONDITIONING list of [tokens, {options}] entries")
    out = []
    for i, entry in enumerate(conditioning):
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], dict)):
            raise InputError(input_name, f"entry {i} is not a [tokens, options] pair")
        tokens, opts = entry
        if not isinstance(tokens, torch.Tensor):
            raise InputError(input_name, f"entry {i}: the tokens are a {type(tokens).__name__}, not a tensor")
        for key, what in UNSUPPORTED_KEYS.items():
            if opts.get(key) is not None:
                raise InputError(
                    input_name,
                    f"entry {i} carries a {what}, which this sampler does not apply; "
                    "use ComfyUI's own samplers with FewStepSchedule / FewStepSamplerSelect for it",
                )
        if _number(opts.get("strength", 1.0), input_name, i, "strength") != 1.0:
            raise InputError(input_name, f"entry {i} has strength {opts['strength']}; only 1.0 is supported")
        if (opts.get("start_percent", 0.0), opts.get("end_percent", 1.0)) != (0.0, 1.0):
            raise InputError(input_name, f"entry {i} is limited to a timestep range, which is not supported")
        extra = sorted(set(opts) - IGNORED_KEYS - set(UNSUPPORTED_KEYS))
        if extra:
            log.warning("%s: conditioning entry %d options %s are not used by fewstep", input_name, i, extra)
        guidance = opts.get("guidance")
        if guidance is not None:
            guidance = _number(guidance, input_name, i, "guidance")
        pooled = opts.get("pooled_output")
        if pooled is not None and not isinstance(pooled, torch.Tensor):
            raise InputError(
                input_name, f"entry {i}: pooled_output is a {type(pooled).__name__}, not a tensor"
            )
        out.append(TextCondition(tokens, pooled, guidance))
    return out


def _number(value, input_name: str, entry: int, key: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InputError(input_name, f"entry {entry}: {key} is {value!r}, not a number") from None


def to_comfy(cond: TextCondition) -> list:
    opts = {}
    if cond.pooled is not None:
        opts["pooled_output"] = cond.pooled
    if cond.guidance is not None:
        opts["guidance"] = cond.guidance
    return [[cond.context, opts]]
