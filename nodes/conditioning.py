"""ComfyUI CONDITIONING <-> the engine's TextCondition.

ComfyUI's CONDITIONING is a list of ``[tokens [B, L, D], {"pooled_output": [B, P], "guidance": g, ...}]``.
Entries the engine cannot honour (regional areas, masks, ControlNets, GLIGEN, timestep ranges, hooks) are
rejected with an error rather than silently ignored.

``attention_mask [B, L]`` (set by ComfyUI's Qwen3 text encoders: Z-Image / Lumina 2, FLUX.2 klein) becomes
``TextCondition.mask``, None when it marks every token real (ComfyUI's Lumina2 model drops such a mask too).
What a model does with masked tokens is the engine's business (``engine.conditioning``: Z-Image uses only the
real tokens as Tongyi's and diffusers' pipelines do; FLUX.2 keeps all of its 512, as BFL does).
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
        extra = sorted(set(opts) - IGNORED_KEYS - set(UNSUPPORTED_KEYS) - {"attention_mask"})
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
        mask = _token_mask(opts.get("attention_mask"), tokens, input_name, i)
        out.append(TextCondition(tokens, pooled, guidance, mask))
    return out


def _token_mask(mask, tokens: torch.Tensor, input_name: str, entry: int) -> torch.Tensor | None:
    """ComfyUI's ``attention_mask`` (1 = a real token, 0 = padding) as a bool ``[B, L]``; None if all real."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise InputError(
            input_name, f"entry {entry}: attention_mask is a {type(mask).__name__}, not a tensor"
        )
    if tokens.ndim == 3 and mask.ndim == 2 and mask.shape[0] == 1 and tokens.shape[0] > 1:
        mask = mask.expand(tokens.shape[0], -1)  # one mask for a batch of equally padded prompts
    if tokens.ndim != 3 or tuple(mask.shape) != tuple(tokens.shape[:2]):
        raise InputError(
            input_name,
            f"entry {entry}: attention_mask is {list(mask.shape)} but the tokens are {list(tokens.shape)}; "
            "expected one mask value per token, [batch, tokens]",
        )
    real = mask != 0
    if bool(real.all()):
        return None
    return real


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
    if cond.mask is not None:
        opts["attention_mask"] = cond.mask.long()
    return [[cond.context, opts]]
