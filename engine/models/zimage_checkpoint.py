"""Recognising Z-Image checkpoints: the official (Tongyi-MAI) layout, ComfyUI's repack, and config inference.

The official layout is the model's own (``all_x_embedder.2-1.weight``, ``noise_refiner.N.attention.to_q.weight``,
``context_refiner.N.*``, ``layers.N.*``, ``cap_embedder.1.weight``, ``x_pad_token``...): the state dict of
Tongyi-MAI/Z-Image ``ZImageTransformer2DModel``, as the Z-Image-Turbo ``transformer/*.safetensors`` store it.
diffusers' ``ZImageTransformer2DModel`` uses the same names, so its files are this layout too.

ComfyUI's repack (Comfy-Org ``z_image_turbo_bf16.safetensors``, ComfyUI's Lumina-2 ``NextDiT`` names) fuses
``attention.to_q/to_k/to_v`` into ``attention.qkv`` and renames ``x_embedder``, ``final_layer``, ``attention.out``,
``attention.q_norm/k_norm``; :func:`comfy_to_official` undoes that (the same mapping as diffusers'
``convert_z_image_transformer_checkpoint_to_diffusers``). Key prefixes (``model.diffusion_model.``) are stripped
by the loader before either matcher runs.
"""

from __future__ import annotations

import re

import torch

from ..errors import CheckpointError
from .checkpoint_keys import block_indices
from .zimage import PRESETS, ZImageParams
from .zimage_layers import ffn_hidden_dim

StateDict = dict[str, torch.Tensor]

_EMBEDDER = re.compile(r"all_x_embedder\.(\d+)-(\d+)\.weight$")


def is_official(keys) -> bool:
    """Tongyi-MAI layout: the patch embedder ModuleDict, the caption embedder and the noise refiner. FLUX.1
    (``img_in``, ``double_blocks``), FLUX.2 and Wan (``blocks.``, ``patch_embedding``) have none of these."""
    keys = set(keys)
    return (
        "cap_embedder.1.weight" in keys
        and any(_EMBEDDER.match(k) for k in keys)
        and any(k.startswith("noise_refiner.") for k in keys)
    )


def is_comfy(keys) -> bool:
    """ComfyUI's repack: ``x_embedder`` and fused ``attention.qkv`` next to Z-Image's caption embedder, noise
    refiner and pad tokens (FLUX.1's diffusers layout also has ``x_embedder`` but none of the others)."""
    keys = set(keys)
    return (
        "x_embedder.weight" in keys
        and "cap_embedder.1.weight" in keys
        and "x_pad_token" in keys
        and any(k.startswith("noise_refiner.") and k.endswith(".attention.qkv.weight") for k in keys)
    )


_COMFY_RENAMES = (
    (".attention.out.", ".attention.to_out.0."),
    (".attention.q_norm.", ".attention.norm_q."),
    (".attention.k_norm.", ".attention.norm_k."),
)


def comfy_to_official(sd: StateDict, patch_key: str = "2-1") -> StateDict:
    """Convert ComfyUI's repack to the official layout (``patch_key``: the one patch config, ``2-1``).

    Unknown keys pass through unchanged so that the strict key check reports them; the stray top-level
    ``norm_final.weight`` some repacks carry (the final LayerNorm has no affine weight) is dropped, as diffusers
    drops it."""
    try:
        dim = sd["x_embedder.weight"].shape[0]
    except KeyError as exc:
        raise CheckpointError("weights", "ComfyUI Z-Image layout without 'x_embedder.weight'") from exc
    out: StateDict = {}
    for key, value in sd.items():
        if key == "norm_final.weight":
            continue
        if key.startswith("x_embedder."):
            key = f"all_x_embedder.{patch_key}." + key[len("x_embedder.") :]
        elif key.startswith("final_layer."):
            key = f"all_final_layer.{patch_key}." + key[len("final_layer.") :]
        if key.endswith(".attention.qkv.weight"):
            kv = (value.shape[0] - dim) // 2
            if kv <= 0 or dim + 2 * kv != value.shape[0]:
                raise CheckpointError(
                    "weights", f"{key}: {value.shape[0]} rows do not split into q ({dim}) and equal k, v"
                )
            base = key[: -len("qkv.weight")]
            q, k, v = torch.split(value, [dim, kv, kv], dim=0)
            out[base + "to_q.weight"], out[base + "to_k.weight"], out[base + "to_v.weight"] = q, k, v
            continue
        for a, b in _COMFY_RENAMES:
            key = key.replace(a, b)
        out[key] = value
    return out


def default_axes_dims(head_dim: int) -> tuple[int, ...] | None:
    """Z-Image's split of a head between (index, row, column): 1/4, 3/8, 3/8; 128 -> (32, 48, 48)."""
    if head_dim % 8:
        return None
    first, rest = head_dim // 4, 3 * head_dim // 8
    axes = (first, rest, rest)
    return axes if all(a % 2 == 0 for a in axes) else None


def diffusers_config(params: ZImageParams) -> dict:
    """The ``ZImageTransformer2DModel`` keyword arguments of ``params`` (the official layout is diffusers'), for
    building diffusers' model beside ours in cross-checks and benchmarks."""
    return {
        "in_channels": params.in_channels,
        "dim": params.dim,
        "n_layers": params.n_layers,
        "n_refiner_layers": params.n_refiner_layers,
        "n_heads": params.n_heads,
        "n_kv_heads": params.n_kv_heads,
        "cap_feat_dim": params.cap_feat_dim,
        "axes_dims": list(params.axes_dims),
        "axes_lens": list(params.axes_lens),
    }


def params_from_state_dict(sd: StateDict, source: str = "checkpoint") -> ZImageParams:
    """Infer the configuration from tensor names and shapes (official layout).

    Not stored in the weights and taken from the official config: RoPE theta (256), the norms' eps (1e-5),
    ``t_scale`` (1000) and the RoPE split of the head (Z-Image-Turbo's 32/48/48 for its 128-wide heads)."""
    embedders = [(m, k) for k in sd if (m := _EMBEDDER.match(k))]
    if len(embedders) != 1:
        found = sorted(k for _, k in embedders) or "none"
        raise CheckpointError(
            "weights",
            f"{source}: Z-Image layout needs exactly one all_x_embedder.<p>-<f>.weight, found {found}",
        )
    match, key = embedders[0]
    patch_size, f_patch_size = int(match.group(1)), int(match.group(2))
    try:
        dim, patch_channels = sd[key].shape
        cap_feat_dim = sd["cap_embedder.1.weight"].shape[1]
        to_k = sd["layers.0.attention.to_k.weight"]
        ffn = sd["layers.0.feed_forward.w1.weight"].shape[0]
    except KeyError as exc:
        raise CheckpointError("weights", f"{source}: Z-Image layout without {exc.args[0]!r}") from exc
    adaln = sd.get("layers.0.adaLN_modulation.0.weight")
    if adaln is None or adaln.shape[1] != min(dim, 256):
        width = "missing" if adaln is None else adaln.shape[1]
        raise CheckpointError(
            "weights",
            f"{source}: layers.0.adaLN_modulation.0.weight input width {width}, Z-Image's is min(dim, 256) = "
            f"{min(dim, 256)} (a Lumina-2 style model with this layout is not Z-Image)",
        )
    qk_norm = "layers.0.attention.norm_q.weight" in sd
    head_dim = sd["layers.0.attention.norm_q.weight"].shape[0] if qk_norm else 128
    axes = default_axes_dims(head_dim)
    if axes is None or dim % head_dim:
        raise CheckpointError(
            "weights",
            f"{source}: head size {head_dim} has no known RoPE axis split (Z-Image uses 128 = 32+48+48)",
        )
    if ffn != ffn_hidden_dim(dim):
        raise CheckpointError(
            "weights",
            f"{source}: feed-forward width {ffn} is not Z-Image's int(dim / 3 * 8) = {ffn_hidden_dim(dim)} "
            f"for dim {dim}",
        )
    if to_k.shape[0] != dim:
        raise CheckpointError(
            "weights",
            f"{source}: layers.0.attention.to_k.weight has {to_k.shape[0]} rows for dim {dim}: fewer key/value "
            "heads than query heads is not supported (no published Z-Image has them)",
        )
    in_channels = patch_channels // (patch_size * patch_size * f_patch_size)
    return ZImageParams(
        in_channels=in_channels,
        patch_size=patch_size,
        f_patch_size=f_patch_size,
        dim=dim,
        n_layers=len(block_indices(sd, "layers.")),
        n_refiner_layers=len(block_indices(sd, "noise_refiner.")),
        n_heads=dim // head_dim,
        n_kv_heads=dim // head_dim,
        qk_norm=qk_norm,
        cap_feat_dim=cap_feat_dim,
        axes_dims=axes,
    )


def preset_name(params: ZImageParams) -> str | None:
    return next((name for name, p in PRESETS.items() if p == params), None)
