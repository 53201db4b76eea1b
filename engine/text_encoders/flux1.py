"""FLUX.1's text encoders: CLIP-L's pooled vector and T5-XXL's tokens, as diffusers' ``FluxPipeline.encode_prompt``
runs them (and BFL's ``flux`` package): CLIP tokens padded / truncated to the tokenizer's 77, ``pooler_output``;
T5 tokens padded / truncated to ``max_sequence_length`` and encoded without an attention mask, every position kept
(FLUX attends to the padding too). ``max_sequence_length`` defaults to BFL's: 256 for schnell (no guidance
embedding), 512 for dev."""

from __future__ import annotations

import torch

from .base import PromptEmbedding, TextEncoder
from .folders import (
    check_kind,
    check_width,
    config_width,
    find_encoder_folder,
    load_model,
    load_tokenizer,
    preflight,
    read_config,
)

ENCODERS = ("CLIP-L", "T5-XXL")


def default_max_sequence_length(params) -> int:
    return 512 if params.guidance_embed else 256


class Flux1TextEncoder(TextEncoder):
    def __init__(self, folder, clip, clip_tokenizer, t5, t5_tokenizer, max_sequence_length, **kw):
        super().__init__(folder, "flux", **kw)
        self.clip, self.clip_tokenizer, self.t5, self.t5_tokenizer = clip, clip_tokenizer, t5, t5_tokenizer
        self.max_sequence_length = max_sequence_length

    @torch.no_grad()
    def encode(self, prompt: str) -> PromptEmbedding:
        clip_ids = self.clip_tokenizer(
            [prompt], padding="max_length", max_length=self.clip_tokenizer.model_max_length, truncation=True,
            return_tensors="pt",
        ).input_ids  # fmt: skip
        pooled = self.clip(clip_ids.to(self.device), output_hidden_states=False).pooler_output
        t5_ids = self.t5_tokenizer(
            [prompt],
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        context = self.t5(t5_ids.to(self.device), output_hidden_states=False)[0]
        return PromptEmbedding(context.float().cpu(), pooled.float().cpu())

    def close(self) -> None:
        self.clip = self.t5 = None


def open(path, params, *, device, dtype, max_sequence_length, input_name) -> Flux1TextEncoder:
    folder = find_encoder_folder(path, ENCODERS, input_name)
    clip_config, t5_config = (
        read_config(folder.text_encoder, input_name),
        read_config(folder.text_encoder_2, input_name),
    )
    needs = f"CLIP-L (pooled {params.vec_in_dim}) in text_encoder/ and T5-XXL (context {params.context_in_dim}) in text_encoder_2/"
    check_kind(folder.text_encoder, clip_config, ("clip_text_model", "clip"), needs, input_name)
    check_kind(folder.text_encoder_2, t5_config, ("t5",), needs, input_name)
    clip_width = config_width(clip_config, input_name)
    check_width(
        folder.text_encoder, "CLIP", clip_width, params.vec_in_dim, needs, input_name, "pooled vectors"
    )
    t5_width = config_width(t5_config, input_name)
    check_width(folder.text_encoder_2, "T5", t5_width, params.context_in_dim, needs, input_name)
    weight_bytes = preflight(folder, dtype, device, input_name)
    length = max_sequence_length or default_max_sequence_length(params)
    clip_tokenizer = load_tokenizer(folder.tokenizer, input_name)
    t5_tokenizer = load_tokenizer(folder.tokenizer_2, input_name)
    clip = load_model("CLIPTextModel", folder.text_encoder, dtype, device, input_name)
    t5 = load_model("T5EncoderModel", folder.text_encoder_2, dtype, device, input_name)
    return Flux1TextEncoder(
        folder, clip, clip_tokenizer, t5, t5_tokenizer, length,
        description=f"FLUX.1: CLIP-L (pooled {clip_width}) + T5-XXL (context {t5_width}), {length} tokens",
        context_dim=t5_width, pooled_dim=clip_width, device=device, dtype=dtype, weight_bytes=weight_bytes,
        settings={"max_sequence_length": length},
    )  # fmt: skip
