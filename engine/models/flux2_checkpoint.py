"""Recognising FLUX.2 checkpoints: the official (BFL) layout, the diffusers layout, and config inference.

The official layout is the model's own (``double_blocks.N.img_attn.qkv.weight``, ``single_blocks.N.linear1``,
``double_stream_modulation_img.lin.weight``...). What tells it from FLUX.1, whose official keys share the
block names, is the shared modulation: ``single_stream_modulation.lin.weight`` exists only in FLUX.2 and
``vector_in`` / per-block ``img_mod`` / ``modulation`` only in FLUX.1.

The diffusers ``Flux2Transformer2DModel`` layout splits the double blocks' fused qkv (``to_q/to_k/to_v``,
``add_*_proj``), renames everything else one to one, and stores the final layer's (shift, scale) halves as
(scale, shift); :func:`diffusers_to_official` fuses and swaps them back.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError
from .checkpoint_keys import block_indices, fuse_rows, move_renamed, swap_halves
from .flux2 import PRESETS, Flux2Params, default_axes_dim

StateDict = dict[str, torch.Tensor]

_SHARED_MODULATION = "single_stream_modulation.lin.weight"


def is_official(keys) -> bool:
    keys = set(keys)
    return (
        "img_in.weight" in keys
        and _SHARED_MODULATION in keys
        and "vector_in.in_layer.weight" not in keys  # FLUX.1's pooled-CLIP embedder
        and any(k.startswith("single_blocks.") for k in keys)
    )


def is_diffusers(keys) -> bool:
    keys = set(keys)
    return "x_embedder.weight" in keys and "single_stream_modulation.linear.weight" in keys


# diffusers module -> official module (also what engine/lora/names.py maps LoRA modules by)
DIFFUSERS_TOP_MODULES = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "proj_out": "final_layer.linear",
}
_DOUBLE_RENAMES = {
    "attn.to_out.0.weight": "img_attn.proj.weight",
    "attn.to_add_out.weight": "txt_attn.proj.weight",
    "attn.norm_q.weight": "img_attn.norm.query_norm.scale",
    "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
    "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
    "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
    "ff.linear_in.weight": "img_mlp.0.weight",
    "ff.linear_out.weight": "img_mlp.2.weight",
    "ff_context.linear_in.weight": "txt_mlp.0.weight",
    "ff_context.linear_out.weight": "txt_mlp.2.weight",
}
_SINGLE_RENAMES = {
    "attn.to_qkv_mlp_proj.weight": "linear1.weight",
    "attn.to_out.weight": "linear2.weight",
    "attn.norm_q.weight": "norm.query_norm.scale",
    "attn.norm_k.weight": "norm.key_norm.scale",
}


def diffusers_to_official(sd: StateDict) -> StateDict:
    """Convert a diffusers ``Flux2Transformer2DModel`` state dict to the official layout.

    Every input key is consumed at most once; keys this table does not know pass through unchanged, so the
    strict key check afterwards reports them as unexpected instead of dropping them silently."""
    src = dict(sd)
    out: StateDict = {}

    def fuse(dst: str, parts: list[str]) -> None:
        fuse_rows(src, out, dst, parts, "diffusers FLUX.2 layout")

    for i in block_indices(sd, "transformer_blocks."):
        p, q = f"transformer_blocks.{i}.attn.", f"double_blocks.{i}."
        fuse(q + "img_attn.qkv.weight", [f"{p}to_{n}.weight" for n in "qkv"])
        fuse(q + "txt_attn.qkv.weight", [f"{p}add_{n}_proj.weight" for n in "qkv"])
        move_renamed(src, out, _DOUBLE_RENAMES, f"transformer_blocks.{i}.", q)
    for i in block_indices(sd, "single_transformer_blocks."):
        p, q = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        move_renamed(src, out, _SINGLE_RENAMES, p, q)
    move_renamed(src, out, DIFFUSERS_TOP_MODULES, ends=(".weight",))  # FLUX.2 has no biases
    if "norm_out.linear.weight" in src:
        # diffusers' AdaLayerNormContinuous emits (scale, shift); the official final layer (shift, scale).
        out["final_layer.adaLN_modulation.1.weight"] = swap_halves(src.pop("norm_out.linear.weight"))
    out.update(src)
    return out


def diffusers_config(params: Flux2Params) -> dict:
    """The ``Flux2Transformer2DModel`` keyword arguments of ``params`` (diffusers' names for the same
    architecture), for building diffusers' model beside ours in cross-checks and benchmarks."""
    return {
        "in_channels": params.in_channels,
        "num_layers": params.depth,
        "num_single_layers": params.depth_single_blocks,
        "attention_head_dim": params.head_dim,
        "num_attention_heads": params.num_heads,
        "joint_attention_dim": params.context_in_dim,
        "mlp_ratio": params.mlp_ratio,
        "axes_dims_rope": params.axes_dim,
        "rope_theta": params.theta,
        "guidance_embeds": params.guidance_embed,
    }


def diffusers_forward_kwargs(inputs: dict) -> dict:
    """``Flux2.forward``'s keyword inputs under the names ``Flux2Transformer2DModel.forward`` takes (the same
    tensors; ``return_dict=False``), for calling diffusers' model beside ours in cross-checks and benchmarks."""
    return {
        "hidden_states": inputs["x"],
        "encoder_hidden_states": inputs["ctx"],
        "timestep": inputs["timesteps"],
        "img_ids": inputs["x_ids"],
        "txt_ids": inputs["ctx_ids"],
        "guidance": inputs.get("guidance"),
        "return_dict": False,
    }


def params_from_state_dict(sd: StateDict, source: str = "checkpoint") -> Flux2Params:
    """Infer the configuration from tensor names and shapes (official layout)."""
    try:
        hidden, in_channels = sd["img_in.weight"].shape
        sd["final_layer.linear.weight"]  # noqa: B018 - required; its shape is checked against the model's
        sd[_SHARED_MODULATION]  # noqa: B018 - required (what makes it FLUX.2)
        head_dim = sd["single_blocks.0.norm.query_norm.scale"].shape[0]
        # linear2 reads [attention (hidden), gated MLP (mlp_hidden)]
        mlp_hidden = sd["single_blocks.0.linear2.weight"].shape[1] - hidden
        context_in_dim = sd["txt_in.weight"].shape[1]
    except KeyError as exc:
        raise CheckpointError("weights", f"{source}: FLUX.2 layout without {exc.args[0]!r}") from exc
    axes = default_axes_dim(head_dim)
    if axes is None or hidden % head_dim:
        raise CheckpointError(
            "weights",
            f"{source}: head size {head_dim} (hidden {hidden}) has no known RoPE axis split "
            "(FLUX.2 uses 128 = 4 x 32)",
        )
    return Flux2Params(
        in_channels=in_channels,
        context_in_dim=context_in_dim,
        hidden_size=hidden,
        num_heads=hidden // head_dim,
        depth=len(block_indices(sd, "double_blocks.")),
        depth_single_blocks=len(block_indices(sd, "single_blocks.")),
        axes_dim=axes,
        mlp_ratio=mlp_hidden / hidden,
        guidance_embed="guidance_in.in_layer.weight" in sd,
    )


def preset_name(params: Flux2Params) -> str | None:
    return next((name for name, p in PRESETS.items() if p == params), None)
