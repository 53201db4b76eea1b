"""Text encoders outside ComfyUI: each family's official encoder loaded from a local folder with ``transformers``,
run as the family's diffusers pipeline runs it (``encode_prompt``), so ``generate --prompt`` / ``stream --prompt``
condition the DiT as the official pipeline would.

    encoder = open_text_encoder("models/FLUX.1-schnell", handle.family, handle.params)
    embedding = encoder.encode("a red fox in the snow")          # PromptEmbedding, float32 on the CPU
    condition = embedding.condition()                            # the sampler's TextCondition

One module per family: ``flux1`` (CLIP-L pooled + T5-XXL), ``flux2`` (klein: Qwen3, dev: Mistral Small 3.1; three
hidden-state layers stacked), ``zimage`` (Qwen3 with its chat template, padding dropped), ``wan`` (umT5-XXL,
padded with zeros to 512 as Wan does). ``folders`` finds, sizes and loads them; the prompt cache that keeps a
prompt from being encoded twice is ``engine.prompt_embeddings.PromptEmbeddingCache``.
"""

from __future__ import annotations

import os

import torch

from ..errors import InputError
from ..loader import default_compute_dtype, resolve_device
from . import flux1, flux2, wan, zimage
from .base import EncoderFolder, PromptEmbedding, TextEncoder

__all__ = [
    "EncoderFolder",
    "PromptEmbedding",
    "TextEncoder",
    "open_text_encoder",
    "FAMILY_MODULES",
    "MAX_SEQUENCE_LENGTH",
    "check_max_sequence_length",
]


# The longest prompt, in tokens: what every family's official pipeline pads to at most (FLUX.1's refuses more, the
# others default to it) and what their DiTs were trained on; a longer prompt is truncated, as there. It also keeps
# a typo (--max-sequence-length 100000000) from padding a prompt to gigabytes.
MAX_SEQUENCE_LENGTH = 512


def check_max_sequence_length(n, input_name: str = "max_sequence_length") -> int:
    """An integer token count in [1, :data:`MAX_SEQUENCE_LENGTH`], else an InputError naming ``input_name``."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SEQUENCE_LENGTH:
        raise InputError(
            input_name,
            f"expected an integer from 1 to {MAX_SEQUENCE_LENGTH} (the longest prompt the official pipelines "
            f"encode), got {n!r}",
        )
    return n


FAMILY_MODULES = {"flux": flux1, "flux2": flux2, "zimage": zimage, "wan": wan}


def open_text_encoder(
    path: str | os.PathLike,
    family,
    params,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    max_sequence_length: int | None = None,
    input_name: str = "--text-encoder",
) -> TextEncoder:
    """The text encoder in ``path`` for a DiT of ``family`` (a registry ``Family`` or its name) and ``params``:
    the folder is checked (encoder and tokenizer present, the right family, the width the model reads) and the
    weights are sized against the device's free memory before anything is loaded.

    ``dtype``: default bf16 on CUDA, float32 on the CPU. ``max_sequence_length``: the tokens the prompt is padded
    or truncated to (default: the family's official value)."""
    name = family if isinstance(family, str) else family.name
    dev = resolve_device(device, input_name)
    dtype = dtype or default_compute_dtype(dev)
    if max_sequence_length is not None:
        check_max_sequence_length(max_sequence_length)
    module = FAMILY_MODULES.get(name)
    if module is None:
        raise InputError(
            input_name, f"no text encoder for the {name!r} family; known: {', '.join(FAMILY_MODULES)}"
        )
    return module.open(os.fspath(path), params, device=dev, dtype=dtype,
                       max_sequence_length=max_sequence_length, input_name=input_name)  # fmt: skip
