"""Wan 2.1's text encoder: umT5-XXL, as diffusers' ``WanPipeline`` (and Wan's own ``T5EncoderModel``) runs it: the
prompt cleaned (HTML entities, whitespace; ``ftfy`` when it is installed, as there), padded / truncated to 512
tokens with the attention mask, and every position past the prompt's real tokens set to zero."""

from __future__ import annotations

import html
import re

import torch

from .base import PromptEmbedding, TextEncoder
from .folders import checked_encoder, load_model, load_tokenizer

ENCODERS = ("umT5-XXL",)


def default_max_sequence_length(params) -> int:
    return params.text_len


def clean_prompt(text: str) -> str:
    """The prompt as Wan's pipelines clean it: ``ftfy.fix_text`` when installed, HTML entities unescaped twice,
    runs of whitespace made one space, stripped."""
    try:
        import ftfy
    except ImportError:
        ftfy = None
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


class WanTextEncoder(TextEncoder):
    def __init__(self, folder, model, tokenizer, max_sequence_length, **kw):
        super().__init__(folder, "wan", **kw)
        self.model, self.tokenizer, self.max_sequence_length = model, tokenizer, max_sequence_length

    @torch.no_grad()
    def encode(self, prompt: str) -> PromptEmbedding:
        n = self.max_sequence_length
        tokens = self.tokenizer(
            [clean_prompt(prompt)], padding="max_length", max_length=n, truncation=True, add_special_tokens=True,
            return_attention_mask=True, return_tensors="pt",
        )  # fmt: skip
        mask = tokens.attention_mask
        hidden = (
            self.model(tokens.input_ids.to(self.device), mask.to(self.device)).last_hidden_state.float().cpu()
        )
        real = int(mask.gt(0).sum())
        context = torch.zeros_like(hidden)
        context[:, :real] = hidden[:, :real]
        return PromptEmbedding(context, None, mask.gt(0))

    def close(self) -> None:
        self.model = None


def open(path, params, *, device, dtype, max_sequence_length, input_name) -> WanTextEncoder:
    needs = f"umT5-XXL (context {params.text_dim})"
    folder, width, weight_bytes = checked_encoder(path, ENCODERS[0], ("umt5",), params.text_dim, needs, dtype,
                                                  device, input_name)  # fmt: skip
    length = max_sequence_length or default_max_sequence_length(params)
    tokenizer = load_tokenizer(folder.tokenizer, input_name)
    model = load_model("UMT5EncoderModel", folder.text_encoder, dtype, device, input_name)
    return WanTextEncoder(
        folder, model, tokenizer, length,
        description=f"Wan 2.1: umT5-XXL (context {width}), {length} tokens, zeros past the prompt",
        context_dim=width, pooled_dim=None, device=device, dtype=dtype, weight_bytes=weight_bytes,
        settings={"max_sequence_length": length},
    )  # fmt: skip
