"""What every family's text encoder is to the rest of the engine: a :class:`TextEncoder` that turns one prompt into
a :class:`PromptEmbedding`, exactly as the family's official pipeline (diffusers' ``encode_prompt``) would.

The encoders live in ``transformers`` (an optional extra, ``pip install comfyui-fewstep[text]``): it is imported
inside the functions that load a model, never by the pack's ComfyUI path, which takes CONDITIONING from core's
text encoders instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..conditioning import TextCondition


@dataclass(frozen=True)
class PromptEmbedding:
    """One prompt, encoded: ``context [1, L, D]`` (the tokens the DiT cross-attends to), ``pooled [1, P]`` (FLUX.1's
    CLIP-L vector; None for the other families) and ``mask [1, L]`` (bool, True a real token; None when the
    family's pipeline keeps every token it returns). Float32 on the CPU, whatever device encoded it: a cached
    embedding holds no device memory."""

    context: torch.Tensor
    pooled: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.context, self.pooled, self.mask) if t is not None
        )

    def condition(self, guidance: float | None = None) -> TextCondition:
        """The engine's conditioning (what ``--cond`` files and ComfyUI's CONDITIONING become)."""
        return TextCondition(self.context, self.pooled, guidance, self.mask)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The ``--cond`` file's tensors: ``context`` and, where the family has it, ``pooled`` (and ``mask``)."""
        out = {"context": self.context}
        if self.pooled is not None:
            out["pooled"] = self.pooled
        if self.mask is not None:
            out["mask"] = self.mask
        return out


@dataclass(frozen=True)
class EncoderFolder:
    """Where one family's text encoder(s) and tokenizer(s) are on disk (``folders.find_encoder_folder``).

    ``text_encoder`` / ``tokenizer``: the first (FLUX.1: CLIP-L; every other family: its only encoder);
    ``text_encoder_2`` / ``tokenizer_2``: FLUX.1's T5-XXL, None elsewhere. Each is a folder in the Hugging Face
    layout (``config.json`` and ``*.safetensors``; ``tokenizer.json`` / ``tokenizer_config.json`` ...), as a
    diffusers pipeline's ``text_encoder*/`` and ``tokenizer*/`` hold them."""

    root: str
    text_encoder: str
    tokenizer: str
    text_encoder_2: str | None = None
    tokenizer_2: str | None = None


class TextEncoder(ABC):
    """A family's prompt encoder, loaded on one device in one dtype.

    ``key`` identifies what an embedding depends on (the folders, the dtype, the settings): the prompt cache keys
    its entries by it. ``settings`` are the pipeline's knobs this encoder runs with (``max_sequence_length``...),
    reported and written into ``encode``'s files. ``weight_bytes`` is what its weights take on the device (the
    preflight's figure). :meth:`close` frees the models (the CLI encodes every prompt of a run first, closes the
    encoder, then loads the DiT: the two never need to fit the device together)."""

    def __init__(
        self,
        folder: EncoderFolder,
        family: str,
        description: str,
        context_dim: int,
        pooled_dim: int | None,
        device: torch.device,
        dtype: torch.dtype,
        weight_bytes: int,
        settings: dict,
    ):
        self.folder = folder
        self.family = family  # the DiT family it conditions: "flux", "flux2", "zimage", "wan"
        self.description = description  # e.g. "FLUX.1: CLIP-L (pooled 768) + T5-XXL (4096), 256 tokens"
        self.context_dim = context_dim
        self.pooled_dim = pooled_dim
        self.device = torch.device(device)
        self.dtype = dtype
        self.weight_bytes = weight_bytes
        self.settings = dict(settings)

    @property
    def key(self) -> str:
        knobs = ",".join(f"{k}={self.settings[k]}" for k in sorted(self.settings))
        return f"{self.family}|{self.folder.root}|{str(self.dtype).removeprefix('torch.')}|{knobs}"

    @abstractmethod
    def encode(self, prompt: str) -> PromptEmbedding:
        """One prompt as the family's official pipeline encodes it (float32, CPU)."""

    @abstractmethod
    def close(self) -> None:
        """Free the models' memory (the encoder cannot encode after this)."""

    def __enter__(self) -> TextEncoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
