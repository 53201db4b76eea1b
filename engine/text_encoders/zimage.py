"""Z-Image's text encoder: Qwen3-4B, as diffusers' ``ZImagePipeline._encode_prompt`` (and Tongyi's code) runs it:
the prompt wrapped in Qwen3's chat template (a user turn, the generation prompt, thinking enabled), padded /
truncated to 512 tokens, the second-to-last hidden states taken, and the padding tokens dropped: the context holds
only the prompt's real tokens."""

from __future__ import annotations

import torch

from .base import PromptEmbedding, TextEncoder
from .folders import checked_encoder, load_model, load_tokenizer

ENCODERS = ("Qwen3",)


def default_max_sequence_length(params) -> int:
    return 512


class ZImageTextEncoder(TextEncoder):
    def __init__(self, folder, model, tokenizer, max_sequence_length, **kw):
        super().__init__(folder, "zimage", **kw)
        self.model, self.tokenizer, self.max_sequence_length = model, tokenizer, max_sequence_length

    @torch.no_grad()
    def encode(self, prompt: str) -> PromptEmbedding:
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=True,
        )
        tokens = self.tokenizer(
            [text],
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            return_tensors="pt",
        )
        mask = tokens.attention_mask.bool()
        hidden = self.model(
            input_ids=tokens.input_ids.to(self.device),
            attention_mask=mask.to(self.device),
            output_hidden_states=True,
        ).hidden_states[-2]
        return PromptEmbedding(hidden[0][mask[0].to(hidden.device)].unsqueeze(0).float().cpu())

    def close(self) -> None:
        self.model = None


def open(path, params, *, device, dtype, max_sequence_length, input_name) -> ZImageTextEncoder:
    needs = f"Qwen3-4B (context {params.cap_feat_dim})"
    folder, width, weight_bytes = checked_encoder(path, ENCODERS[0], ("qwen3",), params.cap_feat_dim, needs, dtype,
                                                  device, input_name)  # fmt: skip
    length = max_sequence_length or default_max_sequence_length(params)
    tokenizer = load_tokenizer(folder.tokenizer, input_name)
    model = load_model("AutoModel", folder.text_encoder, dtype, device, input_name)
    return ZImageTextEncoder(
        folder, model, tokenizer, length,
        description=f"Z-Image: Qwen3 (context {width}, second-to-last layer), up to {length} tokens, padding dropped",
        context_dim=width, pooled_dim=None, device=device, dtype=dtype, weight_bytes=weight_bytes,
        settings={"max_sequence_length": length},
    )  # fmt: skip
