"""Recognising Wan 2.1 checkpoints and reading their configuration from tensor shapes.

The official layout is the model's own (``blocks.N.self_attn.q.weight``, ``patch_embedding.weight``...).
Self-Forcing / CausVid files wrap it as ``{"generator_ema" | "generator": {"model.blocks...": ...}}`` and
ComfyUI repacks put it under ``model.diffusion_model.``; ``engine.weights`` unwraps and strips both.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError
from .checkpoint_keys import block_indices
from .wan import PRESETS, WanParams

StateDict = dict[str, torch.Tensor]


def is_official(keys) -> bool:
    keys = set(keys)
    return "patch_embedding.weight" in keys and "blocks.0.self_attn.q.weight" in keys


def params_from_state_dict(sd: StateDict, source: str = "checkpoint") -> WanParams:
    try:
        dim, in_dim, *patch = sd["patch_embedding.weight"].shape
        ffn_dim = sd["blocks.0.ffn.0.weight"].shape[0]
        text_dim = sd["text_embedding.0.weight"].shape[1]
        freq_dim = sd["time_embedding.0.weight"].shape[1]
        sd["head.head.weight"]  # noqa: B018 - required; its shape is checked against the model's
    except KeyError as exc:
        raise CheckpointError("weights", f"{source}: Wan layout without {exc.args[0]!r}") from exc
    if "blocks.0.cross_attn.k_img.weight" in sd:
        raise CheckpointError(
            "weights",
            f"{source} is a Wan image-to-video model (cross_attn.k_img); "
            "only text-to-video Wan models are supported",
        )
    layers = len(block_indices(sd, "blocks."))
    patch = tuple(patch)
    heads = _heads_for(dim)
    return WanParams(
        dim=dim, ffn_dim=ffn_dim, num_heads=heads, num_layers=layers, in_dim=in_dim,
        # Wan 2.1 text-to-video predicts the 16-channel latent. Not read from the head, so a wrong head is reported
        # by its own key's shape instead of making the model expect a different (correct) bias.
        out_dim=WanParams.out_dim, text_dim=text_dim, freq_dim=freq_dim,
        patch_size=patch,
    )  # fmt: skip


def _heads_for(dim: int) -> int:
    """Wan's checkpoints do not record the head count (q/k norms span the whole width); every released Wan
    model uses 128-wide heads, and the tiny presets are recognised by their width."""
    for p in PRESETS.values():
        if p.dim == dim:
            return p.num_heads
    if dim % 128:
        raise CheckpointError(
            "weights", f"Wan width {dim} is not a multiple of the 128-wide heads Wan models use"
        )
    return dim // 128
