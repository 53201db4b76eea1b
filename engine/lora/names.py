"""Per-family maps from foreign module names (diffusers, XLabs...) to official modules (:class:`Target`).

Official names need no map: every module of the model matches itself. A family's map is built from the model
(block counts and widths come from its params), so a LoRA for another size fails on shapes, not silently.

The maps are the inverse of what the full-checkpoint converters (``models/*_checkpoint.py``) do to weights,
applied to modules: where diffusers splits one official weight (FLUX's fused ``qkv``, ``linear1``), its LoRA
lands on a row slice of that weight (``Target.rows``); where ComfyUI's repack fuses weights the official layout
keeps apart (Z-Image's ``attention.qkv``), a row slice of the file's delta lands on each (``Target.take``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from ..models import flux2_checkpoint, flux_checkpoint


@dataclass(frozen=True)
class Target:
    """Where a (possibly foreign) module lands: an official module, or rows of one."""

    module: str
    rows: tuple[int, int] | None = None
    # row permutation of the delta (diffusers' norm_out stores scale, shift; BFL shift, scale): "swap_halves"
    transform: str | None = None
    # (start, length): only these rows of the file's delta, which spans several official weights (ComfyUI's
    # fused Z-Image attention.qkv onto the official to_q / to_k / to_v)
    take: tuple[int, int] | None = None


def foreign_names(family: str, model: nn.Module) -> dict[str, list[Target]]:
    build = _BUILDERS.get(family)
    return {} if build is None else build(model)


def _indices(names: frozenset[str], prefix: str) -> list[int]:
    pattern = re.compile(re.escape(prefix) + r"\.(\d+)$")
    return sorted({int(m.group(1)) for name in names if (m := pattern.match(name))})


def _module_names(model: nn.Module) -> frozenset[str]:
    return frozenset(name for name, _ in model.named_modules())


def _flux_double_single(names: frozenset[str], hidden: int, mlp_hidden: int, out: dict) -> None:
    """The diffusers (and XLabs) names FLUX.1 and FLUX.2 share: the split qkv projections of both block kinds."""
    for i in _indices(names, "double_blocks"):
        p, q = f"transformer_blocks.{i}.attn.", f"double_blocks.{i}."
        for n, name in enumerate("qkv"):
            out[f"{p}to_{name}"] = [Target(q + "img_attn.qkv", rows=(n * hidden, hidden))]
            out[f"{p}add_{name}_proj"] = [Target(q + "txt_attn.qkv", rows=(n * hidden, hidden))]
        out[f"{p}to_out.0"] = [Target(q + "img_attn.proj")]
        out[f"{p}to_add_out"] = [Target(q + "txt_attn.proj")]
        # XLabs: processor.qkv_lora1 / proj_lora1 act on the image stream's projections, *2 on the text stream's
        # (x-flux DoubleStreamBlockLoraProcessor adds them to the same inputs' outputs, so merging is exact).
        xl = f"double_blocks.{i}.processor."
        out[xl + "qkv_lora1"] = [Target(q + "img_attn.qkv")]
        out[xl + "qkv_lora2"] = [Target(q + "txt_attn.qkv")]
        out[xl + "proj_lora1"] = [Target(q + "img_attn.proj")]
        out[xl + "proj_lora2"] = [Target(q + "txt_attn.proj")]
    for i in _indices(names, "single_blocks"):
        q = f"single_blocks.{i}."
        # ComfyUI's name for the attention part of linear1 (model_lora_keys_unet: linear1_qkv)
        out[q + "linear1_qkv"] = [Target(q + "linear1", rows=(0, 3 * hidden))]
        # XLabs: qkv_lora adds to the first 3 * hidden outputs of linear1, proj_lora (in: hidden + mlp) to linear2
        out[q + "processor.qkv_lora"] = [Target(q + "linear1", rows=(0, 3 * hidden))]
        out[q + "processor.proj_lora"] = [Target(q + "linear2")]
        if mlp_hidden:
            p = f"single_transformer_blocks.{i}."
            for n, name in enumerate("qkv"):
                out[f"{p}attn.to_{name}"] = [Target(q + "linear1", rows=(n * hidden, hidden))]
            out[p + "proj_mlp"] = [Target(q + "linear1", rows=(3 * hidden, mlp_hidden))]


def _flux(model: nn.Module) -> dict[str, list[Target]]:
    names = _module_names(model)
    params = model.params
    hidden = params.hidden_size
    mlp_hidden = int(hidden * params.mlp_ratio)
    out: dict[str, list[Target]] = {}
    _flux_double_single(names, hidden, mlp_hidden, out)
    for i in _indices(names, "double_blocks"):
        p, q = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        out.update({p + a: [Target(q + b)] for a, b in flux_checkpoint.DIFFUSERS_DOUBLE_MODULES.items()})
    for i in _indices(names, "single_blocks"):
        p, q = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        out.update({p + a: [Target(q + b)] for a, b in flux_checkpoint.DIFFUSERS_SINGLE_MODULES.items()})
    top = flux_checkpoint.DIFFUSERS_TOP_MODULES
    out.update({a: [Target(b)] for a, b in top.items() if b in names})
    # diffusers' AdaLayerNormContinuous emits (scale, shift); the official final layer (shift, scale)
    out["norm_out.linear"] = [Target("final_layer.adaLN_modulation.1", transform="swap_halves")]
    return out


def _flux2(model: nn.Module) -> dict[str, list[Target]]:
    names = _module_names(model)
    params = model.params
    hidden = params.hidden_size
    out: dict[str, list[Target]] = {}
    # FLUX.2's diffusers single block keeps linear1 fused (to_qkv_mlp_proj): no proj_mlp slice
    _flux_double_single(names, hidden, 0, out)
    for i in _indices(names, "double_blocks"):
        p, q = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for a, b in (
            ("ff.linear_in", "img_mlp.0"),
            ("ff.linear_out", "img_mlp.2"),
            ("ff_context.linear_in", "txt_mlp.0"),
            ("ff_context.linear_out", "txt_mlp.2"),
        ):
            out[p + a] = [Target(q + b)]
    for i in _indices(names, "single_blocks"):
        p, q = f"single_transformer_blocks.{i}.attn.", f"single_blocks.{i}."
        out[p + "to_qkv_mlp_proj"] = [Target(q + "linear1")]
        out[p + "to_out"] = [Target(q + "linear2")]
    top = flux2_checkpoint.DIFFUSERS_TOP_MODULES
    out.update({a: [Target(b)] for a, b in top.items() if b in names})
    out["norm_out.linear"] = [Target("final_layer.adaLN_modulation.1", transform="swap_halves")]
    return out


def _wan(model: nn.Module) -> dict[str, list[Target]]:
    names = _module_names(model)
    out: dict[str, list[Target]] = {}
    for i in _indices(names, "blocks"):
        p, q = f"blocks.{i}.", f"blocks.{i}."
        for attn, official in (("attn1", "self_attn"), ("attn2", "cross_attn")):
            for a, b in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "o")):
                out[f"{p}{attn}.{a}"] = [Target(f"{q}{official}.{b}")]
            out[f"{p}{attn}.norm_q"] = [Target(f"{q}{official}.norm_q")]
            out[f"{p}{attn}.norm_k"] = [Target(f"{q}{official}.norm_k")]
        if q + "cross_attn.k_img" in names:  # image-to-video cross attention
            out[p + "attn2.add_k_proj"] = [Target(q + "cross_attn.k_img")]
            out[p + "attn2.add_v_proj"] = [Target(q + "cross_attn.v_img")]
            out[p + "attn2.norm_added_k"] = [Target(q + "cross_attn.norm_k_img")]
        out[p + "ffn.net.0.proj"] = [Target(q + "ffn.0")]
        out[p + "ffn.net.2"] = [Target(q + "ffn.2")]
        # diffusers' norm2 is the affine cross-attention norm, the official norm3 (its norm3 has no weights)
        out[p + "norm2"] = [Target(q + "norm3")]
        out[p + "scale_shift_table"] = [Target(q + "modulation")]
    out.update(
        {
            "proj_out": [Target("head.head")],
            "scale_shift_table": [Target("head.modulation")],
            "condition_embedder.time_embedder.linear_1": [Target("time_embedding.0")],
            "condition_embedder.time_embedder.linear_2": [Target("time_embedding.2")],
            "condition_embedder.text_embedder.linear_1": [Target("text_embedding.0")],
            "condition_embedder.text_embedder.linear_2": [Target("text_embedding.2")],
            "condition_embedder.time_proj": [Target("time_projection.1")],
        }
    )
    return out


def _zimage(model: nn.Module) -> dict[str, list[Target]]:
    """diffusers' names are the official ones; ComfyUI's repack (Lumina-2 NextDiT names) fuses q, k, v."""
    names = _module_names(model)
    params = model.params
    dim = params.dim
    kv = params.n_kv_heads * (params.dim // params.n_heads)
    out: dict[str, list[Target]] = {}
    for stack in ("noise_refiner", "context_refiner", "layers"):
        for i in _indices(names, stack):
            a = f"{stack}.{i}.attention."
            out[a + "qkv"] = [
                Target(a + "to_q", take=(0, dim)),
                Target(a + "to_k", take=(dim, kv)),
                Target(a + "to_v", take=(dim + kv, kv)),
            ]
            out[a + "out"] = [Target(a + "to_out.0")]
            out[a + "q_norm"] = [Target(a + "norm_q")]
            out[a + "k_norm"] = [Target(a + "norm_k")]
    # ComfyUI's repack keeps one patch configuration (2-1) and drops the all_*.2-1 wrapping
    for name in names:
        if name == "all_x_embedder.2-1":
            out["x_embedder"] = [Target(name)]
        elif name.startswith("all_final_layer.2-1."):
            out["final_layer." + name[len("all_final_layer.2-1.") :]] = [Target(name)]
    return out


_BUILDERS: dict = {"flux": _flux, "flux2": _flux2, "wan": _wan, "zimage": _zimage}
