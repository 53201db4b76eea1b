"""Recognising FLUX checkpoints: the official (BFL) layout, the diffusers layout, and config inference.

The official layout is the model's own (``double_blocks.N.img_attn.qkv.weight``...). The diffusers
``FluxTransformer2DModel`` layout splits fused projections (``to_q/to_k/to_v``, ``proj_mlp``) and swaps the
final layer's (shift, scale) halves; :func:`diffusers_to_official` fuses and swaps them back.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError
from .checkpoint_keys import MODULE_ENDS, block_indices, fuse_rows, move_renamed, swap_halves
from .flux import PRESETS, FluxParams, default_axes_dim

StateDict = dict[str, torch.Tensor]


def is_official(keys) -> bool:
    keys = set(keys)
    return (
        "img_in.weight" in keys
        and any(k.startswith("double_blocks.") for k in keys)
        and "single_stream_modulation.lin.weight" not in keys  # FLUX.2 shares its blocks' names
    )


def is_diffusers(keys) -> bool:
    keys = set(keys)
    return (
        "x_embedder.weight" in keys
        and any(k.startswith("transformer_blocks.") for k in keys)
        and "single_stream_modulation.linear.weight" not in keys  # diffusers' FLUX.2
    )


# diffusers module -> official module (also what engine/lora/names.py maps LoRA modules by)
DIFFUSERS_DOUBLE_MODULES = {
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
    "norm1.linear": "img_mod.lin",
    "norm1_context.linear": "txt_mod.lin",
    "ff.net.0.proj": "img_mlp.0",
    "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0",
    "ff_context.net.2": "txt_mlp.2",
}
_DOUBLE_NORMS = {
    "attn.norm_q.weight": "img_attn.norm.query_norm.scale",
    "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
    "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
    "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
}
DIFFUSERS_SINGLE_MODULES = {"norm.linear": "modulation.lin", "proj_out": "linear2"}
_SINGLE_NORMS = {"attn.norm_q.weight": "norm.query_norm.scale", "attn.norm_k.weight": "norm.key_norm.scale"}
DIFFUSERS_TOP_MODULES = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "proj_out": "final_layer.linear",
}


def diffusers_to_official(sd: StateDict) -> StateDict:
    """Convert a diffusers ``FluxTransformer2DModel`` state dict to the official layout.

    Every input key is consumed exactly once; keys this table does not know are passed through unchanged so
    that the strict key check afterwards reports them as unexpected instead of dropping them silently.
    """
    src = dict(sd)
    out: StateDict = {}

    def fuse(dst: str, parts: list[str]) -> None:
        for end in ("weight", "bias"):
            fuse_rows(src, out, f"{dst}.{end}", [f"{p}.{end}" for p in parts], "diffusers FLUX layout")

    for i in block_indices(sd, "transformer_blocks."):
        p, q = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        fuse(q + "img_attn.qkv", [p + "attn.to_q", p + "attn.to_k", p + "attn.to_v"])
        fuse(q + "txt_attn.qkv", [p + "attn.add_q_proj", p + "attn.add_k_proj", p + "attn.add_v_proj"])
        move_renamed(src, out, DIFFUSERS_DOUBLE_MODULES, p, q, MODULE_ENDS)
        move_renamed(src, out, _DOUBLE_NORMS, p, q)
    for i in block_indices(sd, "single_transformer_blocks."):
        p, q = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        fuse(q + "linear1", [p + "attn.to_q", p + "attn.to_k", p + "attn.to_v", p + "proj_mlp"])
        move_renamed(src, out, DIFFUSERS_SINGLE_MODULES, p, q, MODULE_ENDS)
        move_renamed(src, out, _SINGLE_NORMS, p, q)
    move_renamed(src, out, DIFFUSERS_TOP_MODULES, ends=MODULE_ENDS)
    for end in ("weight", "bias"):
        # diffusers' AdaLayerNormContinuous emits (scale, shift); the official final layer (shift, scale).
        if f"norm_out.linear.{end}" in src:
            out[f"final_layer.adaLN_modulation.1.{end}"] = swap_halves(src.pop(f"norm_out.linear.{end}"))
    out.update(src)
    return out


def params_from_state_dict(sd: StateDict, source: str = "checkpoint") -> FluxParams:
    """Infer the configuration from tensor names and shapes (official layout)."""
    try:
        hidden, in_channels = sd["img_in.weight"].shape
        sd["final_layer.linear.weight"]  # noqa: B018 - required; its shape is checked against the model's
        head_dim = sd["double_blocks.0.img_attn.norm.query_norm.scale"].shape[0]
        mlp_hidden = sd["double_blocks.0.img_mlp.0.weight"].shape[0]
        vec_in_dim = sd["vector_in.in_layer.weight"].shape[1]
        context_in_dim = sd["txt_in.weight"].shape[1]
    except KeyError as exc:
        raise CheckpointError("weights", f"{source}: FLUX layout without {exc.args[0]!r}") from exc
    axes = default_axes_dim(head_dim)
    if axes is None:
        raise CheckpointError(
            "weights",
            f"{source}: head size {head_dim} has no known RoPE axis split (FLUX uses 128 = 16+56+56)",
        )
    return FluxParams(
        in_channels=in_channels,
        # Every FLUX.1 variant (dev, schnell, Fill, Kontext, Depth) predicts the 2x2 patches of the 16-channel
        # latent: 64. Not read from the final layer, so a wrong final layer is reported by its own key's shape
        # instead of making the model expect a different (correct) bias.
        out_channels=FluxParams.out_channels,
        vec_in_dim=vec_in_dim,
        context_in_dim=context_in_dim,
        hidden_size=hidden,
        mlp_ratio=mlp_hidden / hidden,
        num_heads=hidden // head_dim,
        depth=len(block_indices(sd, "double_blocks.")),
        depth_single_blocks=len(block_indices(sd, "single_blocks.")),
        axes_dim=axes,
        qkv_bias="double_blocks.0.img_attn.qkv.bias" in sd,
        guidance_embed="guidance_in.in_layer.weight" in sd,
    )


def preset_name(params: FluxParams) -> str | None:
    return next((name for name, p in PRESETS.items() if p == params), None)
