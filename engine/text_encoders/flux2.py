"""FLUX.2's text encoders, as diffusers' pipelines (and BFL's ``flux2`` package) run them: three hidden-state
layers of a language model stacked along the width, every padded position kept (FLUX.2 attends to all of them).

- **klein** (``Flux2KleinPipeline``; a DiT without a guidance embedding): Qwen3 (4B for klein 4B: 3 x 2560 = 7680;
  8B for klein 9B: 3 x 4096 = 12288), the prompt in Qwen3's chat template (a user turn, the generation prompt,
  thinking disabled), layers 9, 18 and 27, 512 tokens.
- **dev** (``Flux2Pipeline``; a DiT with a guidance embedding): Mistral Small 3.1 (3 x 5120 = 15360) through its
  processor's chat template with BFL's system message, ``[IMG]`` removed from the prompt, layers 10, 20 and 30,
  512 tokens.
"""

from __future__ import annotations

import hashlib

import torch

from .base import PromptEmbedding, TextEncoder
from .folders import checked_encoder, load_model, load_tokenizer

ENCODERS = ("Qwen3 (klein) or Mistral Small 3.1 (dev)",)
KLEIN_LAYERS = (9, 18, 27)
DEV_LAYERS = (10, 20, 30)
# BFL's system message for FLUX.2 dev's text encoder (the line break after "object" is part of it, as in BFL's and
# diffusers' code): an input of the official encoding, so it is kept verbatim
DEV_SYSTEM_MESSAGE = (
    "You are an AI that reasons about image descriptions. You give structured responses focusing on object "
    "relationships, object\nattribution and actions without speculation."
)


def default_max_sequence_length(params) -> int:
    return 512


def stack_layers(hidden_states, layers) -> torch.Tensor:
    """``[B, L, len(layers) * D]``: the layers' hidden states side by side, per token."""
    out = torch.stack([hidden_states[k] for k in layers], dim=1)
    b, n, length, d = out.shape
    return out.permute(0, 2, 1, 3).reshape(b, length, n * d)


class Flux2TextEncoder(TextEncoder):
    def __init__(self, folder, model, tokenizer, max_sequence_length, dev: bool, **kw):
        super().__init__(folder, "flux2", **kw)
        self.model, self.tokenizer, self.max_sequence_length, self.dev = (
            model,
            tokenizer,
            max_sequence_length,
            dev,
        )

    @torch.no_grad()
    def encode(self, prompt: str) -> PromptEmbedding:
        n = self.max_sequence_length
        if self.dev:
            messages = [[
                {"role": "system", "content": [{"type": "text", "text": DEV_SYSTEM_MESSAGE}]},
                {"role": "user", "content": [{"type": "text", "text": prompt.replace("[IMG]", "")}]},
            ]]  # fmt: skip
            tokens = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=False, tokenize=True, return_dict=True, return_tensors="pt",
                padding="max_length", truncation=True, max_length=n,
            )  # fmt: skip
            layers = DEV_LAYERS
        else:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=False,
            )
            tokens = self.tokenizer(
                text, return_tensors="pt", padding="max_length", truncation=True, max_length=n
            )
            layers = KLEIN_LAYERS
        out = self.model(
            input_ids=tokens["input_ids"].to(self.device), attention_mask=tokens["attention_mask"].to(self.device),
            output_hidden_states=True, use_cache=False,
        )  # fmt: skip
        return PromptEmbedding(stack_layers(out.hidden_states, layers).float().cpu())

    def close(self) -> None:
        self.model = None


def open(path, params, *, device, dtype, max_sequence_length, input_name) -> Flux2TextEncoder:
    dev = bool(params.guidance_embed)
    layers = DEV_LAYERS if dev else KLEIN_LAYERS
    if dev:
        name, kinds = "Mistral Small 3.1", ("mistral3",)
        needs = (
            f"Mistral Small 3.1, three layers stacked (context {params.context_in_dim}): FLUX.2 dev's encoder"
        )
    else:
        name, kinds = "Qwen3", ("qwen3",)
        needs = (
            f"Qwen3, three layers stacked (context {params.context_in_dim}): Qwen3-4B for klein 4B (7680), "
            "Qwen3-8B for klein 9B (12288)"
        )
    folder, width, weight_bytes = checked_encoder(path, name, kinds, params.context_in_dim, needs, dtype, device,
                                                  input_name, layers=len(layers))  # fmt: skip
    length = max_sequence_length or default_max_sequence_length(params)
    tokenizer = load_tokenizer(folder.tokenizer, input_name, processor=dev)
    model = load_model("Mistral3ForConditionalGeneration" if dev else "AutoModel", folder.text_encoder, dtype,
                       device, input_name)  # fmt: skip
    settings = {"max_sequence_length": length, "layers": "-".join(map(str, layers))}
    if dev:
        settings["system_message"] = hashlib.sha256(DEV_SYSTEM_MESSAGE.encode()).hexdigest()[:12]
    variant = "dev: Mistral Small 3.1" if dev else "klein: Qwen3"
    return Flux2TextEncoder(
        folder, model, tokenizer, length, dev,
        description=f"FLUX.2 {variant}, layers {', '.join(map(str, layers))} stacked (context {width}), {length} "
        "tokens",
        context_dim=width, pooled_dim=None, device=device, dtype=dtype, weight_bytes=weight_bytes, settings=settings,
    )  # fmt: skip
