"""Text conditioning as the engine sees it (converted from ComfyUI's CONDITIONING by the nodes).

Padding tokens. A text encoder may pad a prompt and say so with an attention mask. What a DiT does with the
padded tokens is part of the model, and the families differ:

- Z-Image uses only the real caption tokens: Tongyi-MAI/Z-Image's pipeline and diffusers' ``ZImagePipeline``
  both pass ``prompt_embeds[i][mask[i]]``, and the DiT pads that to a multiple of 32 with its own learnt pad
  token. So masked tokens are dropped (:func:`real_tokens_only`). ComfyUI's Z-Image text encoder does not pad
  a prompt (its tokenizer has ``pad_to_max_length=False``), so its mask is all ones and nothing changes.
- FLUX.1 / FLUX.2 attend to every token, padding included: BFL's FLUX.2 pipeline pads the Qwen3 / Mistral
  states to 512 tokens and feeds all 512 unmasked, and ComfyUI's klein encoder pads to 512 the same way; its
  attention mask is not used by the DiT. The mask is dropped, the tokens are kept.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .errors import InputError


@dataclass(frozen=True)
class TextCondition:
    """One prompt's encoding.

    ``context [B, L, D]`` text-encoder tokens (T5 for FLUX), ``pooled [B, P]`` the pooled vector (CLIP-L for
    FLUX, absent for models without one), ``guidance`` the distilled-guidance strength for models with a
    guidance embedding (FLUX.1-dev, FLUX.2-dev), ignored by models without one. ``mask [B, L]`` (bool, True
    a real token) marks padding tokens, None when every token is real; see the module docstring for what each
    family does with it (:func:`for_family`).
    """

    context: torch.Tensor
    pooled: torch.Tensor | None = None
    guidance: float | None = None
    mask: torch.Tensor | None = None

    def to(self, device, dtype) -> TextCondition:
        pooled = None if self.pooled is None else self.pooled.to(device, dtype)
        mask = None if self.mask is None else self.mask.to(device)
        return TextCondition(self.context.to(device, dtype), pooled, self.guidance, mask)

    def repeat_to(self, batch: int) -> TextCondition:
        """Tile the prompts over ``batch`` latents as ComfyUI does (``[c0, c1, c0, c1]`` for 2 -> 4)."""
        n = self.context.shape[0]
        if n == batch:
            return self
        if batch % n:
            raise ValueError(f"conditioning batch {n} does not divide latent batch {batch}")
        reps = batch // n
        pooled = None if self.pooled is None else self.pooled.repeat(reps, 1)
        mask = None if self.mask is None else self.mask.repeat(reps, 1)
        return TextCondition(self.context.repeat(reps, 1, 1), pooled, self.guidance, mask)


def drops_masked_tokens(family) -> bool:
    """Whether ``family``'s reference pipeline feeds only the unmasked text tokens (registry ``ImageSpec``)."""
    return family.image is not None and family.image.drops_masked_tokens


def real_tokens_only(cond: TextCondition, input_name: str) -> TextCondition:
    """``cond`` without its masked tokens (each row keeps its real tokens, in order), and without a mask.

    The rows of one conditioning share one tensor, so they must keep the same number of tokens; prompts of
    different lengths are separate conditionings in ComfyUI anyway (one CLIPTextEncode each)."""
    if cond.mask is None:
        return cond
    check_mask(cond, input_name)
    counts = [int(n) for n in cond.mask.sum(dim=1).tolist()]
    if min(counts) == 0:
        raise InputError(
            input_name,
            f"the attention_mask of prompt {counts.index(0)} marks no token as real; "
            "expected at least 1 (an encoded prompt)",
        )
    if len(set(counts)) > 1:
        raise InputError(
            input_name,
            f"the prompts of this conditioning have {counts} real (unmasked) tokens; this model uses only the "
            "real tokens of each prompt (as its reference pipelines do), so one conditioning's prompts must have "
            "the same count: encode them as separate conditionings",
        )
    b, _, d = cond.context.shape
    context = cond.context[cond.mask].view(b, counts[0], d)
    return replace(cond, context=context, mask=None)


def check_mask(cond: TextCondition, input_name: str) -> None:
    mask, tokens = cond.mask, cond.context
    if mask.dtype != torch.bool or mask.shape != tokens.shape[:2]:
        raise InputError(
            input_name,
            f"the attention_mask is {list(mask.shape)} {str(mask.dtype).replace('torch.', '')}; expected a bool "
            f"mask [batch, tokens] = {list(tokens.shape[:2])} of the conditioning tokens",
        )


def for_family(cond: TextCondition, family, input_name: str) -> TextCondition:
    """The condition as ``family``'s DiT takes it: masked tokens dropped (Z-Image) or kept (FLUX), no mask."""
    if cond.mask is None:
        return cond
    if drops_masked_tokens(family):
        return real_tokens_only(cond, input_name)
    check_mask(cond, input_name)
    return replace(cond, mask=None)
