"""LoRA files in the namings found in the wild, converted to each family's official weights.

Each case writes a seeded random LoRA file for a tiny model in one naming (ComfyUI / BFL, kohya, diffusers /
PEFT, OneTrainer, XLabs, lightx2v's full deltas, ComfyUI's Z-Image repack) and checks the merged weights against a
reference computed here by hand from the file's tensors: ``W[rows] += strength * alpha / rank * up @ down`` (or
``strength * diff``) on the official weight each entry names, with the fused slices, the swapped final-layer
halves and the split Z-Image qkv spelled out in the case tables below. Every case's reference is computed the same
way from the same random tensors, so equal to the reference means equal to the same LoRA in official names.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from safetensors.torch import save_file

from fewstep.engine.errors import InputError
from fewstep.engine.handle import open_model
from fewstep.engine.lora import apply_lora, read_lora

STRENGTH = 0.7
RANK = 4
ALPHA = 3.0

# naming -> (prefix, joins the module path with "_", down suffix, up suffix, writes an alpha)
STYLES = {
    "comfyui": ("diffusion_model.", False, ".lora_down.weight", ".lora_up.weight", True),
    "comfyui-dot": ("diffusion_model.", False, ".lora.down.weight", ".lora.up.weight", True),
    "bfl": ("", False, ".lora_A.weight", ".lora_B.weight", False),
    "kohya": ("lora_unet_", True, ".lora_down.weight", ".lora_up.weight", True),
    "diffusers": ("transformer.", False, ".lora_A.weight", ".lora_B.weight", False),
    "onetrainer": ("lora_transformer_", True, ".lora_down.weight", ".lora_up.weight", True),
    "xlabs": ("", False, ".down.weight", ".up.weight", False),
}

# One target of a file entry: (official parameter, rows of it or None, rows of the file's delta or None, swap).
FLUX_OFFICIAL = {
    "double_blocks.0.img_attn.qkv": [("double_blocks.0.img_attn.qkv.weight", None, None, False)],
    "double_blocks.1.txt_mlp.0": [("double_blocks.1.txt_mlp.0.weight", None, None, False)],
    "single_blocks.0.linear1": [("single_blocks.0.linear1.weight", None, None, False)],
    "single_blocks.1.linear1_qkv": [("single_blocks.1.linear1.weight", (0, 192), None, False)],
    "single_blocks.1.linear2": [("single_blocks.1.linear2.weight", None, None, False)],
    "final_layer.adaLN_modulation.1": [("final_layer.adaLN_modulation.1.weight", None, None, False)],
    "img_in": [("img_in.weight", None, None, False)],
}
FLUX_DIFFUSERS = {
    "transformer_blocks.0.attn.to_q": [("double_blocks.0.img_attn.qkv.weight", (0, 64), None, False)],
    "transformer_blocks.0.attn.to_v": [("double_blocks.0.img_attn.qkv.weight", (128, 64), None, False)],
    "transformer_blocks.1.attn.add_k_proj": [("double_blocks.1.txt_attn.qkv.weight", (64, 64), None, False)],
    "transformer_blocks.1.attn.to_add_out": [("double_blocks.1.txt_attn.proj.weight", None, None, False)],
    "transformer_blocks.1.ff_context.net.2": [("double_blocks.1.txt_mlp.2.weight", None, None, False)],
    "transformer_blocks.0.norm1.linear": [("double_blocks.0.img_mod.lin.weight", None, None, False)],
    "single_transformer_blocks.0.attn.to_k": [("single_blocks.0.linear1.weight", (64, 64), None, False)],
    "single_transformer_blocks.1.proj_mlp": [("single_blocks.1.linear1.weight", (192, 256), None, False)],
    "single_transformer_blocks.0.proj_out": [("single_blocks.0.linear2.weight", None, None, False)],
    "single_transformer_blocks.1.norm.linear": [("single_blocks.1.modulation.lin.weight", None, None, False)],
    "norm_out.linear": [("final_layer.adaLN_modulation.1.weight", None, None, True)],
    "x_embedder": [("img_in.weight", None, None, False)],
    "time_text_embed.text_embedder.linear_1": [("vector_in.in_layer.weight", None, None, False)],
}
FLUX_XLABS = {
    "double_blocks.0.processor.qkv_lora1": [("double_blocks.0.img_attn.qkv.weight", None, None, False)],
    "double_blocks.0.processor.proj_lora1": [("double_blocks.0.img_attn.proj.weight", None, None, False)],
    "double_blocks.1.processor.qkv_lora2": [("double_blocks.1.txt_attn.qkv.weight", None, None, False)],
    "double_blocks.1.processor.proj_lora2": [("double_blocks.1.txt_attn.proj.weight", None, None, False)],
    "single_blocks.0.processor.qkv_lora": [("single_blocks.0.linear1.weight", (0, 192), None, False)],
    "single_blocks.1.processor.proj_lora": [("single_blocks.1.linear2.weight", None, None, False)],
}
FLUX2_OFFICIAL = {
    "double_blocks.0.txt_attn.qkv": [("double_blocks.0.txt_attn.qkv.weight", None, None, False)],
    "single_blocks.0.linear1": [("single_blocks.0.linear1.weight", None, None, False)],
    "single_stream_modulation.lin": [("single_stream_modulation.lin.weight", None, None, False)],
}
FLUX2_DIFFUSERS = {
    "transformer_blocks.0.attn.to_k": [("double_blocks.0.img_attn.qkv.weight", (64, 64), None, False)],
    "transformer_blocks.1.attn.add_v_proj": [("double_blocks.1.txt_attn.qkv.weight", (128, 64), None, False)],
    "transformer_blocks.1.ff.linear_in": [("double_blocks.1.img_mlp.0.weight", None, None, False)],
    "single_transformer_blocks.0.attn.to_qkv_mlp_proj": [
        ("single_blocks.0.linear1.weight", None, None, False)
    ],
    "single_transformer_blocks.1.attn.to_out": [("single_blocks.1.linear2.weight", None, None, False)],
    "double_stream_modulation_img.linear": [("double_stream_modulation_img.lin.weight", None, None, False)],
    "norm_out.linear": [("final_layer.adaLN_modulation.1.weight", None, None, True)],
    "x_embedder": [("img_in.weight", None, None, False)],
}
WAN_OFFICIAL = {
    "blocks.0.self_attn.q": [("blocks.0.self_attn.q.weight", None, None, False)],
    "blocks.1.cross_attn.o": [("blocks.1.cross_attn.o.weight", None, None, False)],
    "blocks.0.ffn.0": [("blocks.0.ffn.0.weight", None, None, False)],
    "blocks.1.ffn.2": [("blocks.1.ffn.2.weight", None, None, False)],
    "head.head": [("head.head.weight", None, None, False)],
    "patch_embedding": [("patch_embedding.weight", None, None, False)],
    "time_projection.1": [("time_projection.1.weight", None, None, False)],
    "text_embedding.0": [("text_embedding.0.weight", None, None, False)],
}
WAN_DIFFUSERS = {
    "blocks.0.attn1.to_q": [("blocks.0.self_attn.q.weight", None, None, False)],
    "blocks.1.attn2.to_out.0": [("blocks.1.cross_attn.o.weight", None, None, False)],
    "blocks.1.attn2.to_k": [("blocks.1.cross_attn.k.weight", None, None, False)],
    "blocks.0.ffn.net.0.proj": [("blocks.0.ffn.0.weight", None, None, False)],
    "blocks.1.ffn.net.2": [("blocks.1.ffn.2.weight", None, None, False)],
    "proj_out": [("head.head.weight", None, None, False)],
    "condition_embedder.time_proj": [("time_projection.1.weight", None, None, False)],
    "condition_embedder.text_embedder.linear_1": [("text_embedding.0.weight", None, None, False)],
    "condition_embedder.time_embedder.linear_2": [("time_embedding.2.weight", None, None, False)],
}
# full deltas: (file entry without prefix, official parameter)
WAN_DIFFS = {
    "blocks.0.norm3.diff": "blocks.0.norm3.weight",
    "blocks.0.norm3.diff_b": "blocks.0.norm3.bias",
    "blocks.0.self_attn.q.diff_b": "blocks.0.self_attn.q.bias",
    "blocks.1.cross_attn.norm_k.diff": "blocks.1.cross_attn.norm_k.weight",
    "blocks.1.modulation.diff": "blocks.1.modulation",
    "blocks.0.diff_m": "blocks.0.modulation",  # lightx2v's spelling of the same
    "head.modulation.diff": "head.modulation",
    "head.head.diff_b": "head.head.bias",
}
WAN_DIFFUSERS_DIFFS = {
    "blocks.0.norm2.diff": "blocks.0.norm3.weight",  # diffusers' norm2 is the official norm3
    "blocks.1.attn1.to_v.diff_b": "blocks.1.self_attn.v.bias",
    "blocks.1.scale_shift_table.diff": "blocks.1.modulation",
    "scale_shift_table.diff": "head.modulation",
}
ZIMAGE_OFFICIAL = {
    "layers.0.attention.to_q": [("layers.0.attention.to_q.weight", None, None, False)],
    "layers.1.feed_forward.w2": [("layers.1.feed_forward.w2.weight", None, None, False)],
    "noise_refiner.0.adaLN_modulation.0": [("noise_refiner.0.adaLN_modulation.0.weight", None, None, False)],
}
ZIMAGE_COMFY = {
    "layers.0.attention.qkv": [
        ("layers.0.attention.to_q.weight", None, (0, 64), False),
        ("layers.0.attention.to_k.weight", None, (64, 64), False),
        ("layers.0.attention.to_v.weight", None, (128, 64), False),
    ],
    "layers.1.attention.out": [("layers.1.attention.to_out.0.weight", None, None, False)],
    "context_refiner.0.feed_forward.w1": [("context_refiner.0.feed_forward.w1.weight", None, None, False)],
    "x_embedder": [("all_x_embedder.2-1.weight", None, None, False)],
    "final_layer.linear": [("all_final_layer.2-1.linear.weight", None, None, False)],
}

_MODELS: dict = {}


def tiny(name: str):
    if name not in _MODELS:
        _MODELS[name] = open_model(f"dummy:{name}").model.float()
    return _MODELS[name]


def write_lora(path, model, style: str, table: dict, seed: int, diffs: dict | None = None):
    """A random LoRA for ``table``'s entries in ``style``'s naming; the file's tensors and the reference."""
    prefix, underscored, down_suffix, up_suffix, with_alpha = STYLES[style]
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(seed)
    sd, expected = {}, {k: v.detach().clone().float() for k, v in params.items()}
    for n, (module, targets) in enumerate(table.items()):
        first = params[targets[0][0]]
        if targets[0][2]:  # one fused entry split over several weights: the rows of all of them
            rows = sum(take[1] for _, _, take, _ in targets)
        else:
            rows = targets[0][1][1] if targets[0][1] else first.shape[0]
        up = torch.randn(rows, RANK, generator=gen)
        down = torch.randn(RANK, *first.shape[1:], generator=gen)
        name = prefix + (module.replace(".", "_") if underscored else module)
        sd[name + up_suffix], sd[name + down_suffix] = up, down
        alpha = ALPHA + n if with_alpha else None
        if alpha is not None:
            sd[name + ".alpha"] = torch.tensor(alpha)
        scale = STRENGTH * (alpha / RANK if alpha is not None else 1.0)
        for key, span, take, swap in targets:
            u = torch.cat(up.chunk(2)[::-1]) if swap else up
            u = u[take[0] : take[0] + take[1]] if take else u
            delta = scale * (u @ down.flatten(1)).reshape(-1, *first.shape[1:])
            if span:
                expected[key][span[0] : span[0] + span[1]] += delta
            else:
                expected[key] += delta
    for entry, key in (diffs or {}).items():
        diff = torch.randn(params[key].shape, generator=gen)
        sd[prefix + entry] = diff
        expected[key] += STRENGTH * diff
    save_file(sd, str(path))
    return sd, expected


CASES = [
    ("flux-tiny", "comfyui", FLUX_OFFICIAL, None),
    ("flux-tiny", "comfyui-dot", FLUX_OFFICIAL, None),
    ("flux-tiny", "bfl", FLUX_OFFICIAL, None),
    ("flux-tiny", "kohya", FLUX_OFFICIAL, None),
    ("flux-tiny", "diffusers", FLUX_DIFFUSERS, None),
    ("flux-tiny", "onetrainer", FLUX_DIFFUSERS, None),
    ("flux-tiny", "kohya", FLUX_DIFFUSERS, None),  # lora_unet_ with diffusers module names
    ("flux-tiny", "xlabs", FLUX_XLABS, None),
    ("flux2-tiny", "comfyui", FLUX2_OFFICIAL, None),
    ("flux2-tiny", "diffusers", FLUX2_DIFFUSERS, None),
    ("wan-tiny", "comfyui", WAN_OFFICIAL, WAN_DIFFS),
    ("wan-tiny", "kohya", WAN_OFFICIAL, None),
    ("wan-tiny", "diffusers", WAN_DIFFUSERS, WAN_DIFFUSERS_DIFFS),
    ("zimage-tiny", "diffusers", ZIMAGE_OFFICIAL, None),
    ("zimage-tiny", "comfyui", ZIMAGE_COMFY, None),
]
FORMATS = {
    "comfyui": "ComfyUI / BFL",
    "comfyui-dot": "ComfyUI / BFL",
    "bfl": "bare module names",
    "kohya": "kohya",
    "diffusers": "diffusers / PEFT",
    "onetrainer": "OneTrainer",
    "xlabs": "XLabs",
}


@pytest.mark.parametrize(
    "model_name,style,table,diffs", CASES, ids=[f"{c[0]}-{c[1]}-{len(c[2])}" for c in CASES]
)
def test_each_naming_merges_to_the_hand_computed_weights(tmp_path, model_name, style, table, diffs):
    model = tiny(model_name)
    path = tmp_path / f"{style}.safetensors"
    sd, expected = write_lora(path, model, style, table, seed=len(table) + len(style), diffs=diffs)
    patch = read_lora(path, model, STRENGTH)
    assert patch.format == FORMATS[style] + (" with full deltas (diff / diff_b)" if diffs else "")
    merged = dict(apply_lora(model, patch, STRENGTH).named_parameters())
    changed = {k for k, v in merged.items() if not torch.equal(v, model.get_parameter(k))}
    assert changed == {k for k, v in expected.items() if not torch.equal(v, model.get_parameter(k))}
    for key in changed:
        assert (merged[key] - expected[key]).abs().max().item() <= 1e-6, key
    assert changed, "the case changes no weight"


def test_fused_slice_and_swapped_halves_by_hand(tmp_path):
    """Two keys spelled out: diffusers' to_k lands on rows 64..128 of FLUX's fused qkv only, and diffusers'
    norm_out (scale, shift) lands swapped on the official final layer (shift, scale)."""
    model = tiny("flux-tiny")
    up_k, down_k = torch.full((64, 1), 0.5), torch.full((1, 64), 2.0)
    up_n = torch.cat([torch.full((64, 1), 1.0), torch.full((64, 1), 3.0)])  # scale rows 1, shift rows 3
    down_n = torch.ones(1, 64)
    path = tmp_path / "two.safetensors"
    save_file(
        {
            "transformer.transformer_blocks.0.attn.to_k.lora_A.weight": down_k,
            "transformer.transformer_blocks.0.attn.to_k.lora_B.weight": up_k,
            "transformer.norm_out.linear.lora_A.weight": down_n,
            "transformer.norm_out.linear.lora_B.weight": up_n,
        },
        str(path),
    )
    merged = apply_lora(model, path, 2.0)
    qkv = merged.double_blocks[0].img_attn.qkv.weight - model.double_blocks[0].img_attn.qkv.weight
    # 2.0 * 0.5 * 2.0 (no alpha: scale 1); the difference of two float32 weights, so up to rounding
    assert torch.allclose(qkv[64:128], torch.full((64, 64), 2.0), atol=1e-6, rtol=0)
    assert torch.equal(qkv[:64], torch.zeros(64, 64)) and torch.equal(qkv[128:], torch.zeros(64, 64))
    final = merged.final_layer.adaLN_modulation[1].weight - model.final_layer.adaLN_modulation[1].weight
    assert torch.allclose(final[:64], torch.full((64, 64), 6.0), atol=1e-6, rtol=0)  # official: shift first
    assert torch.allclose(final[64:], torch.full((64, 64), 2.0), atol=1e-6, rtol=0)


def test_alpha_scales_by_alpha_over_rank_and_strength_multiplies(tmp_path):
    model = tiny("wan-tiny")
    path = tmp_path / "alpha.safetensors"
    save_file(
        {
            "diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.ones(8, 64),
            "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.ones(64, 8),
            "diffusion_model.blocks.0.self_attn.q.alpha": torch.tensor(2.0),
        },
        str(path),
    )
    merged = apply_lora(model, path, 0.5)
    delta = merged.blocks[0].self_attn.q.weight - model.blocks[0].self_attn.q.weight
    assert torch.allclose(delta, torch.full((64, 64), 0.5 * 2.0 / 8 * 8), atol=1e-6, rtol=0)


# ---- bad input: exact messages ----


def _save(tmp_path, sd, name="bad.safetensors"):
    path = tmp_path / name
    save_file(sd, str(path))
    return path


def _error(path, model_name, strength=1.0) -> str:
    with pytest.raises(InputError) as err:
        read_lora(path, tiny(model_name), strength)
    return str(err.value)


def test_flux_lora_on_wan_names_the_other_family(tmp_path):
    path = _save(
        tmp_path,
        {
            "diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight": torch.zeros(4, 64),
            "diffusion_model.double_blocks.0.img_attn.qkv.lora_up.weight": torch.zeros(192, 4),
        },
    )
    assert _error(path, "wan-tiny") == (
        "input 'lora': bad.safetensors: 2 of 2 entries match no weight of this wan model; nothing was applied.\n"
        "  unmatched: diffusion_model.double_blocks.*.img_attn.qkv.lora_down.weight (1), "
        "diffusion_model.double_blocks.*.img_attn.qkv.lora_up.weight (1)\n"
        "  these names belong to a flux model: a LoRA for another model family"
    )


def test_lora_for_another_size_names_key_and_shapes(tmp_path):
    path = _save(
        tmp_path,
        {
            "lora_unet_double_blocks_0_img_attn_proj.lora_down.weight": torch.zeros(4, 3072),
            "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight": torch.zeros(3072, 4),
        },
    )
    assert _error(path, "flux-tiny") == (
        "input 'lora': bad.safetensors does not fit this flux model (1 of 1 deltas have the wrong shape: a LoRA "
        "for another size or variant): lora_unet_double_blocks_0_img_attn_proj -> "
        "double_blocks.0.img_attn.proj.weight: delta (3072, 3072), weight (64, 64)"
    )


def test_up_and_down_disagreeing_on_the_rank(tmp_path):
    path = _save(
        tmp_path,
        {
            "transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 64),
            "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(64, 8),
        },
    )
    assert _error(path, "wan-tiny") == (
        "input 'lora': bad.safetensors: transformer.blocks.0.attn1.to_q: up (64, 8) and down (4, 64) disagree on "
        "the rank (8 vs 4): a corrupt or mis-converted LoRA"
    )


def test_unknown_format_lists_the_key_patterns(tmp_path):
    path = _save(
        tmp_path,
        {f"model.layers.{i}.mystery_{n}": torch.zeros(2) for i in range(3) for n in ("a", "b")},
    )
    assert _error(path, "flux-tiny") == (
        "input 'lora': bad.safetensors is not a LoRA in any naming this pack reads (no entry ends in lora_up / "
        "lora_down, lora_A / lora_B, alpha, diff or diff_b); key patterns found: model.layers.*.mystery_a (3), "
        "model.layers.*.mystery_b (3)"
    )


def test_entries_matching_nothing_are_listed_not_dropped(tmp_path):
    path = _save(
        tmp_path,
        {
            "diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight": torch.zeros(4, 64),
            "diffusion_model.double_blocks.0.img_attn.qkv.lora_up.weight": torch.zeros(192, 4),
            "diffusion_model.double_blocks.7.img_attn.qkv.lora_down.weight": torch.zeros(4, 64),
            "diffusion_model.double_blocks.7.img_attn.qkv.lora_up.weight": torch.zeros(192, 4),
            "diffusion_model.controlnet_blocks.0.lora_up.weight": torch.zeros(64, 4),
        },
    )
    assert _error(path, "flux-tiny") == (
        "input 'lora': bad.safetensors: 3 of 5 entries match no weight of this flux model; nothing was applied.\n"
        "  unmatched: diffusion_model.controlnet_blocks.*.lora_up.weight (1), "
        "diffusion_model.double_blocks.*.img_attn.qkv.lora_down.weight (1), "
        "diffusion_model.double_blocks.*.img_attn.qkv.lora_up.weight (1)\n"
        "  a LoRA for another size or variant of this family, or a naming this pack does not know (it reads "
        "ComfyUI / BFL, diffusers / PEFT, kohya, OneTrainer, LyCORIS and XLabs names)"
    )


@pytest.mark.parametrize(
    "suffix,kind",
    [(".hada_w1_a", "LoHa (hada_*) files"), (".dora_scale", "DoRA (dora_scale) LoRAs")],
)
def test_loha_and_dora_are_refused(tmp_path, suffix, kind):
    path = _save(
        tmp_path,
        {
            "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(4, 64),
            "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(192, 4),
            "lora_unet_double_blocks_0_img_attn_qkv" + suffix: torch.zeros(4, 4),
        },
    )
    assert _error(path, "flux-tiny") == (
        f"input 'lora': bad.safetensors holds {kind}, which this pack does not apply (plain LoRA and full "
        f"deltas only); entries: lora_unet_double_blocks_*_img_attn_qkv{suffix} (1)"
    )


def test_missing_file(tmp_path):
    path = tmp_path / "absent.safetensors"
    with pytest.raises(InputError) as err:
        read_lora(path, tiny("flux-tiny"))
    assert str(err.value) == f"input 'lora': weights file not found: {os.fspath(path)}"


def test_empty_file(tmp_path):
    path = _save(tmp_path, {})
    assert _error(path, "flux-tiny") == "input 'lora': bad.safetensors holds no diffusion-model LoRA entries"


def test_non_finite_tensor(tmp_path):
    path = _save(
        tmp_path,
        {
            "diffusion_model.img_in.lora_down.weight": torch.tensor([[float("nan")] * 64] * 4),
            "diffusion_model.img_in.lora_up.weight": torch.zeros(64, 4),
        },
    )
    assert _error(path, "flux-tiny") == (
        "input 'lora': bad.safetensors: diffusion_model.img_in.lora_down.weight holds NaN or infinite values; "
        "the file is corrupt or was saved after a diverged training step"
    )


def test_text_encoder_entries_reported_not_applied(tmp_path, caplog):
    path = _save(
        tmp_path,
        {
            "lora_unet_img_in.lora_down.weight": torch.ones(4, 64),
            "lora_unet_img_in.lora_up.weight": torch.ones(64, 4),
            "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.ones(4, 768),
            "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.ones(3072, 4),
        },
    )
    with caplog.at_level(logging.WARNING, logger="fewstep.engine.lora.file"):
        patch = read_lora(path, tiny("flux-tiny"))
    assert patch.text_encoder_keys == 2 and patch.keys == {"img_in.weight"}
    assert (
        "bad.safetensors: 2 text-encoder entries not applied (this node patches the diffusion model; apply the file "
        "to the text encoder with ComfyUI's LoraLoader): lora_te1_text_model_encoder_layers_*_mlp_fc1.lora_down."
        "weight (1), lora_te1_text_model_encoder_layers_*_mlp_fc1.lora_up.weight (1)" in caplog.text
    )
