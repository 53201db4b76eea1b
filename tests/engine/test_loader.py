"""Loading weights: layouts, prefixes, file formats, strictness, fp8 storage, dummy weights, bad files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from fewstep.engine import CheckpointError, InputError, load_dit
from fewstep.engine.models.flux import image_ids, pack_latent, text_ids
from fewstep.engine.ops import Linear, weight_bytes


@pytest.fixture(scope="module")
def official_sd():
    model = load_dit("dummy:flux-tiny-guidance", dtype=torch.float32, device="cpu", seed=7)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _forward(model):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 4, 6, generator=g)
    return model(
        pack_latent(x),
        image_ids(1, 4, 6),
        torch.randn(1, 3, 4096, generator=g),
        text_ids(1, 3),
        torch.tensor([0.5]),
        torch.randn(1, 768, generator=g),
        torch.tensor([3.5]),
    )


def _to_diffusers(sd: dict, hidden: int) -> dict:
    """Written from diffusers' FluxTransformer2DModel module names, to exercise the converter independently."""
    out = {}
    top = {
        "img_in": "x_embedder",
        "txt_in": "context_embedder",
        "final_layer.linear": "proj_out",
        "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
        "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
        "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
        "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
        "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
        "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    }
    for key, t in sd.items():
        name, end = key.rsplit(".", 1)
        parts = key.split(".")
        if parts[0] == "double_blocks":
            p, rest = f"transformer_blocks.{parts[1]}.", ".".join(parts[2:])
            if rest.startswith(("img_attn.qkv", "txt_attn.qkv")):
                names = (
                    ("to_q", "to_k", "to_v")
                    if rest.startswith("img")
                    else ("add_q_proj", "add_k_proj", "add_v_proj")
                )
                for n, chunk in zip(names, t.chunk(3, 0)):
                    out[f"{p}attn.{n}.{end}"] = chunk
                continue
            table = {
                "img_attn.proj": "attn.to_out.0",
                "txt_attn.proj": "attn.to_add_out",
                "img_mod.lin": "norm1.linear",
                "txt_mod.lin": "norm1_context.linear",
                "img_mlp.0": "ff.net.0.proj",
                "img_mlp.2": "ff.net.2",
                "txt_mlp.0": "ff_context.net.0.proj",
                "txt_mlp.2": "ff_context.net.2",
                "img_attn.norm.query_norm": "attn.norm_q",
                "img_attn.norm.key_norm": "attn.norm_k",
                "txt_attn.norm.query_norm": "attn.norm_added_q",
                "txt_attn.norm.key_norm": "attn.norm_added_k",
            }
            stem = rest.rsplit(".", 1)[0]
            out[f"{p}{table[stem]}.{'weight' if end == 'scale' else end}"] = t
        elif parts[0] == "single_blocks":
            p, rest = f"single_transformer_blocks.{parts[1]}.", ".".join(parts[2:])
            if rest.startswith("linear1"):
                q, k, v, mlp = t.split([hidden, hidden, hidden, t.shape[0] - 3 * hidden], 0)
                for n, chunk in zip(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), (q, k, v, mlp)):
                    out[f"{p}{n}.{end}"] = chunk
                continue
            table = {
                "linear2": "proj_out",
                "modulation.lin": "norm.linear",
                "norm.query_norm": "attn.norm_q",
                "norm.key_norm": "attn.norm_k",
            }
            stem = rest.rsplit(".", 1)[0]
            out[f"{p}{table[stem]}.{'weight' if end == 'scale' else end}"] = t
        elif name == "final_layer.adaLN_modulation.1":
            shift, scale = t.chunk(2, 0)
            out[f"norm_out.linear.{end}"] = torch.cat((scale, shift), 0)
        else:
            out[f"{top[name]}.{end}"] = t
    return out


def test_official_layout_loads_exactly(tmp_path, official_sd):
    path = tmp_path / "flux.safetensors"
    save_file(official_sd, str(path))
    model = load_dit(path, dtype=torch.float32, device="cpu")
    assert model.params.guidance_embed and model.params.depth == 2 and model.params.depth_single_blocks == 2
    for k, v in model.state_dict().items():
        assert torch.equal(v, official_sd[k]), k


@pytest.mark.parametrize("prefix", ["model.diffusion_model.", "diffusion_model.", "model."])
def test_prefixes_are_stripped(tmp_path, official_sd, prefix):
    sd = {prefix + k: v for k, v in official_sd.items()}
    if prefix == "model.diffusion_model.":  # a full checkpoint also holds the VAE and text encoders
        sd["first_stage_model.decoder.conv_in.weight"] = torch.zeros(1)
        sd["text_encoders.t5xxl.x"] = torch.zeros(1)
    path = tmp_path / "prefixed.safetensors"
    save_file(sd, str(path))
    model = load_dit(path, dtype=torch.float32, device="cpu")
    assert torch.equal(model.state_dict()["img_in.weight"], official_sd["img_in.weight"])


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".ckpt"])
@pytest.mark.parametrize("container", [None, "state_dict", "model"])
def test_torch_files_with_containers(tmp_path, official_sd, suffix, container):
    obj = official_sd if container is None else {container: official_sd, "epoch": 3}
    path = tmp_path / f"flux{suffix}"
    torch.save(obj, path)
    model = load_dit(path, dtype=torch.float32, device="cpu")
    assert torch.equal(model.state_dict()["txt_in.weight"], official_sd["txt_in.weight"])


def test_diffusers_layout_converts_to_the_same_model(tmp_path, official_sd):
    ref = load_dit("dummy:flux-tiny-guidance", dtype=torch.float32, device="cpu", seed=7)
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    save_file(_to_diffusers(official_sd, hidden=64), str(path))
    model = load_dit(path, dtype=torch.float32, device="cpu")
    for k, v in model.state_dict().items():
        assert torch.equal(v, official_sd[k]), k
    assert torch.allclose(
        _forward(model), _forward(ref), atol=1e-5, rtol=0
    )  # equal weights; BLAS blocking may differ


def test_against_diffusers_if_installed(tmp_path):
    diffusers = pytest.importorskip("diffusers", reason="diffusers not installed (optional cross-check)")
    torch.manual_seed(0)
    ref = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=32,
        num_attention_heads=2,
        joint_attention_dim=4096,
        pooled_projection_dim=768,
        guidance_embeds=True,
        axes_dims_rope=(4, 14, 14),
    ).eval()
    for p in ref.parameters():
        p.normal_(0, 0.05)
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "d.safetensors"))
    ours = load_dit(tmp_path / "d.safetensors", dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(1)
    x, txt, y = (
        torch.randn(1, 16, 4, 6, generator=g),
        torch.randn(1, 5, 4096, generator=g),
        torch.randn(1, 768, generator=g),
    )
    ids, tids = image_ids(1, 4, 6), text_ids(1, 5)
    expected = ref(
        hidden_states=pack_latent(x),
        encoder_hidden_states=txt,
        pooled_projections=y,
        timestep=torch.tensor([0.7]),
        img_ids=ids[0],
        txt_ids=tids[0],
        guidance=torch.tensor([3.5]),
        return_dict=False,
    )[0]
    got = ours(pack_latent(x), ids, txt, tids, torch.tensor([0.7]), y, torch.tensor([3.5]))
    assert (got - expected).abs().max() < 1e-5


def test_missing_and_unexpected_keys_are_listed(tmp_path, official_sd):
    sd = dict(official_sd)
    del sd["double_blocks.1.txt_mlp.2.bias"]
    sd["double_blocks.0.lora_down.weight"] = torch.zeros(2, 2)
    save_file(sd, str(tmp_path / "broken.safetensors"))
    with pytest.raises(CheckpointError) as exc:
        load_dit(tmp_path / "broken.safetensors", device="cpu")
    msg = str(exc.value)
    assert "1 missing keys: double_blocks.1.txt_mlp.2.bias" in msg
    assert "1 unexpected keys: double_blocks.0.lora_down.weight" in msg


def test_unknown_layout_lists_top_level_keys_and_known_layouts(tmp_path):
    save_file(
        {
            "encoder.conv_in.weight": torch.zeros(1),
            "decoder.up.0.weight": torch.zeros(1),
            "decoder.up.1.weight": torch.zeros(1),
        },
        str(tmp_path / "vae.safetensors"),
    )
    with pytest.raises(CheckpointError) as exc:
        load_dit(tmp_path / "vae.safetensors", device="cpu")
    msg = str(exc.value)
    assert "top-level keys found: decoder (2), encoder (1)" in msg
    assert "flux (official)" in msg and "flux (diffusers)" in msg


def test_missing_file_and_bad_files(tmp_path):
    with pytest.raises(InputError, match="weights file not found: .*nope.safetensors"):
        load_dit(tmp_path / "nope.safetensors")
    torch.save([1, 2, 3], tmp_path / "list.pth")
    with pytest.raises(CheckpointError, match="does not hold a state dict of tensors"):
        load_dit(tmp_path / "list.pth")
    (tmp_path / "garbage.safetensors").write_bytes(b"not really")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_dit(tmp_path / "garbage.safetensors")
    (tmp_path / "weights.onnx").write_bytes(b"x")
    with pytest.raises(InputError, match="unsupported weights file type '.onnx'"):
        load_dit(tmp_path / "weights.onnx")


def test_pickled_code_never_runs(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"img_in.weight": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="weights_only"):
        load_dit(tmp_path / "evil.pt")


def test_fp8_storage_halves_weight_bytes_and_stays_close():
    bf16 = load_dit("dummy:flux-tiny", dtype=torch.float32, device="cpu", weight_dtype=torch.bfloat16)
    fp8 = load_dit("dummy:flux-tiny", dtype=torch.float32, device="cpu", weight_dtype=torch.float8_e4m3fn)
    linear_bytes = {}
    for name, model in (("bf16", bf16), ("fp8", fp8)):
        linear_bytes[name] = sum(
            m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, Linear)
        )
    assert linear_bytes["fp8"] * 2 == linear_bytes["bf16"]
    assert fp8.double_blocks[0].img_attn.qkv.weight.dtype == torch.float8_e4m3fn
    assert (
        fp8.double_blocks[0].img_attn.qkv.bias.dtype == torch.float32
    )  # biases and norms keep compute dtype
    assert weight_bytes(fp8) < weight_bytes(bf16)
    a, b = _forward_tiny(bf16), _forward_tiny(fp8)
    assert (a - b).abs().max() / a.abs().max() < 0.15  # e4m3 has a 3-bit mantissa


def _forward_tiny(model):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 4, 6, generator=g)
    return model(
        pack_latent(x),
        image_ids(1, 4, 6),
        torch.randn(1, 3, 4096, generator=g),
        text_ids(1, 3),
        torch.tensor([0.5]),
        torch.randn(1, 768, generator=g),
    )


def test_fp8_file_stays_fp8_by_default(tmp_path, official_sd):
    sd = {
        k: (v.to(torch.float8_e4m3fn) if k.endswith(".weight") and v.ndim == 2 else v.to(torch.bfloat16))
        for k, v in official_sd.items()
    }
    save_file(sd, str(tmp_path / "flux-fp8.safetensors"))
    model = load_dit(tmp_path / "flux-fp8.safetensors", dtype=torch.float32, device="cpu")
    assert model.single_blocks[0].linear1.weight.dtype == torch.float8_e4m3fn
    assert model.single_blocks[0].norm.query_norm.scale.dtype == torch.float32
    up = load_dit(
        tmp_path / "flux-fp8.safetensors", dtype=torch.float32, device="cpu", weight_dtype=torch.float32
    )
    assert torch.equal(up.single_blocks[0].linear1.weight, sd["single_blocks.0.linear1.weight"].float())
    assert torch.allclose(_forward(model), _forward(up), atol=1e-5)


def test_dummy_weights_are_seeded_and_independent_of_other_parameters():
    a = load_dit("dummy:flux-tiny", device="cpu", seed=0).state_dict()
    b = load_dit("dummy:flux-tiny", device="cpu", seed=0).state_dict()
    c = load_dit("dummy:flux-tiny", device="cpu", seed=1).state_dict()
    g = load_dit("dummy:flux-tiny-guidance", device="cpu", seed=0).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["img_in.weight"], c["img_in.weight"])
    # the guidance variant has extra parameters; the shared ones get the same values
    assert all(torch.equal(a[k], g[k]) for k in a)


def test_unknown_dummy_preset():
    with pytest.raises(InputError, match="unknown preset 'dummy:flux-huge'; known presets: .*flux-tiny"):
        load_dit("dummy:flux-huge")


# ---- every family, every layout: a file is always read as the family it is ----------------------------------


def _flux1_diffusers(sd):
    return _to_diffusers(sd, hidden=64)


def _flux2_diffusers(sd):
    from test_flux2_model import _to_diffusers as flux2_to_diffusers  # the independent key table of that test

    return flux2_to_diffusers(sd)


def _zimage_comfy(sd):
    from test_zimage_model import _to_comfy

    return {**_to_comfy(sd), "norm_final.weight": torch.ones(64)}  # as the Comfy-Org repack carries it


def _same(sd):
    return sd


# (preset, layout the loader must report, converter from the official state dict, key prefix of the file)
FAMILY_LAYOUTS = [
    ("flux-tiny-guidance", "flux (official)", _same, ""),
    ("flux-tiny-guidance", "flux (diffusers)", _flux1_diffusers, ""),
    ("flux2-tiny", "flux2 (official)", _same, ""),
    ("flux2-tiny-dev", "flux2 (official)", _same, "model.diffusion_model."),  # a ComfyUI full checkpoint
    ("flux2-tiny", "flux2 (diffusers)", _flux2_diffusers, ""),
    ("zimage-tiny", "zimage (official)", _same, ""),
    ("zimage-tiny", "zimage (ComfyUI)", _zimage_comfy, ""),
    ("zimage-tiny", "zimage (ComfyUI)", _zimage_comfy, "model.diffusion_model."),
    ("wan-tiny", "wan (official)", _same, ""),
    ("wan-tiny", "wan (official)", _same, "diffusion_model."),
]


@pytest.fixture(scope="module")
def family_state_dicts():
    return {
        name: load_dit(f"dummy:{name}", dtype=torch.float32, device="cpu", seed=11)
        for name in {preset for preset, *_ in FAMILY_LAYOUTS}
    }


@pytest.mark.parametrize(
    ("preset", "layout", "convert", "prefix"), FAMILY_LAYOUTS, ids=lambda v: getattr(v, "__name__", v) or "-"
)
def test_each_family_in_each_layout_loads_as_itself(
    tmp_path, family_state_dicts, preset, layout, convert, prefix
):
    from fewstep.engine.models.registry import family_of

    ref = family_state_dicts[preset]
    official = {k: v.contiguous() for k, v in ref.state_dict().items()}
    save_file({prefix + k: v for k, v in convert(official).items()}, str(tmp_path / "model.safetensors"))
    model = load_dit(tmp_path / "model.safetensors", dtype=torch.float32, device="cpu")
    assert family_of(model) is family_of(ref) and type(model) is type(ref)
    assert model.checkpoint_layout == layout
    assert model.params == ref.params  # inferred from the shapes alone
    loaded = model.state_dict()
    assert loaded.keys() == official.keys()
    assert all(torch.equal(loaded[k], v) for k, v in official.items())


def test_the_handle_names_family_preset_and_layout(tmp_path, family_state_dicts):
    from fewstep.engine.handle import open_model

    sd = {k: v.contiguous() for k, v in family_state_dicts["zimage-tiny"].state_dict().items()}
    save_file(_zimage_comfy(sd), str(tmp_path / "z_image_tiny.safetensors"))
    handle = open_model(str(tmp_path / "z_image_tiny.safetensors"), dtype=torch.float32, device="cpu")
    assert handle.describe().startswith(
        f"zimage [zimage-tiny] from {tmp_path / 'z_image_tiny.safetensors'} (zimage (ComfyUI) layout): hidden 64, "
        "heads 2, "
    )


# One key of the last block of each family, as a file missing part of its tensors leaves it out.
TRUNCATED = {
    "flux-tiny-guidance": "single_blocks.1.linear2.weight",
    "flux2-tiny": "single_blocks.1.linear2.weight",
    "zimage-tiny": "layers.1.feed_forward.w2.weight",
    "wan-tiny": "blocks.1.ffn.2.weight",
}


@pytest.mark.parametrize("preset", sorted(TRUNCATED))
def test_a_file_missing_tensors_lists_them(tmp_path, family_state_dicts, preset):
    sd = {k: v.contiguous() for k, v in family_state_dicts[preset].state_dict().items()}
    missing = TRUNCATED[preset]
    del sd[missing]
    save_file(sd, str(tmp_path / "part.safetensors"))
    with pytest.raises(CheckpointError) as exc:
        load_dit(tmp_path / "part.safetensors", device="cpu")
    model_class = type(family_state_dicts[preset]).__name__
    assert str(exc.value).splitlines()[1:] == [f"  1 missing keys: {missing}"]
    assert f"does not match the {model_class} architecture inferred from it" in str(exc.value)


def test_a_file_cut_short_is_unreadable(tmp_path, family_state_dicts):
    sd = {k: v.contiguous() for k, v in family_state_dicts["flux2-tiny"].state_dict().items()}
    save_file(sd, str(tmp_path / "full.safetensors"))
    data = (tmp_path / "full.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])  # an interrupted download
    with pytest.raises(CheckpointError, match=r"cut.safetensors is not a readable safetensors file"):
        load_dit(tmp_path / "cut.safetensors", device="cpu")


def test_unknown_layout_lists_every_family(tmp_path):
    save_file({"encoder.conv_in.weight": torch.zeros(1)}, str(tmp_path / "vae.safetensors"))
    with pytest.raises(CheckpointError) as exc:
        load_dit(tmp_path / "vae.safetensors", device="cpu")
    for layout in (
        "flux2 (official)",
        "flux2 (diffusers)",
        "zimage (official)",
        "zimage (ComfyUI)",
        "wan (official)",
    ):
        assert layout in str(exc.value)


def _shard(sd: dict, folder, parts: int) -> list:
    """The state dict as diffusers saves a large model: ``<stem>-0000i-of-0000n.safetensors`` + an index."""
    keys = sorted(sd)
    names = [f"diffusion_pytorch_model-{i + 1:05d}-of-{parts:05d}.safetensors" for i in range(parts)]
    weight_map = {}
    for i, name in enumerate(names):
        chunk = keys[i::parts]
        save_file({k: sd[k] for k in chunk}, str(folder / name))
        weight_map.update(dict.fromkeys(chunk, name))
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return [folder / n for n in names]


def test_a_sharded_checkpoint_loads_from_any_shard_or_its_index(tmp_path, family_state_dicts):
    """Tongyi-MAI/Z-Image-Turbo's transformer/ folder: three shards of the official layout."""
    ref = family_state_dicts["zimage-tiny"]
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    shards = _shard(sd, tmp_path, 3)
    for source in (shards[0], shards[2], tmp_path / "diffusion_pytorch_model.safetensors.index.json"):
        model = load_dit(source, dtype=torch.float32, device="cpu")
        assert model.params == ref.params and model.checkpoint_layout == "zimage (official)"
        assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())
    shards[1].unlink()
    with pytest.raises(InputError) as exc:
        load_dit(shards[0], device="cpu")
    assert exc.value.input_name == "weights"
    assert str(exc.value).endswith(
        "diffusion_pytorch_model-00001-of-00003.safetensors is one part of a sharded checkpoint of 3 files; "
        "missing next to it: diffusion_pytorch_model-00002-of-00003.safetensors (download every shard into the "
        "same folder)"
    )


@pytest.mark.parametrize("preset", ["flux2-tiny", "zimage-tiny"])
def test_fp8_files_of_the_new_families_stay_fp8(tmp_path, family_state_dicts, preset):
    from fewstep.engine.models.registry import family_of

    ref = family_state_dicts[preset]
    sd = {
        k: (v.to(torch.float8_e4m3fn) if k.endswith(".weight") and v.ndim == 2 else v.to(torch.bfloat16))
        for k, v in ref.state_dict().items()
    }
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "fp8.safetensors"))
    fp8 = load_dit(tmp_path / "fp8.safetensors", dtype=torch.float32, device="cpu")
    up = load_dit(tmp_path / "fp8.safetensors", dtype=torch.float32, device="cpu", weight_dtype=torch.float32)
    linears = [m for m in fp8.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
    assert all(
        p.dtype == torch.float32 for n, p in fp8.named_parameters() if not n.endswith(".weight") or p.ndim < 2
    )
    assert weight_bytes(fp8) < weight_bytes(up)
    # fp8 storage computes with the upcast weights: the same numbers as the file upcast once at load
    family = family_of(fp8)
    p = fp8.params
    latent = torch.randn(1, family.latent_format.channels, 4, 6, generator=torch.Generator().manual_seed(0))
    cond = _condition(family, p)
    a = family.velocity(fp8, latent, torch.tensor([0.6]), cond)
    b = family.velocity(up, latent, torch.tensor([0.6]), cond)
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def _condition(family, params):
    from fewstep.engine.conditioning import TextCondition

    g = torch.Generator().manual_seed(1)
    return TextCondition(torch.randn(1, 5, family.image.context_dim(params), generator=g), None, None)


@pytest.mark.parametrize(
    "shard", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors", ".hidden.safetensors"]
)
def test_a_shard_index_cannot_point_outside_its_folder(tmp_path, shard):
    """A hostile index.json (from a download or a shared folder) names a path instead of a shard beside it."""
    outside = tmp_path.parent / "outside.safetensors"
    save_file({"x": torch.zeros(1)}, str(outside))
    index = tmp_path / "diffusion_pytorch_model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"x": shard}}))
    with pytest.raises(InputError) as exc:
        load_dit(index, device="cpu")
    assert exc.value.input_name == "weights"
    assert "names shards that are not plain .safetensors file names in its folder" in str(exc.value)
    assert repr(shard) in str(exc.value)


def test_the_dit_loader_node_lists_and_loads_a_wan_safetensors_as_the_self_forcing_pt(
    tmp_path, monkeypatch, pack
):
    """A safetensors file of the Self-Forcing .pt's generator_ema tensors (their own ``model.`` names) is listed by
    FewStepDiTLoader and loads the same model as the .pt."""
    import sys

    from fake_folder_paths import make_folder_paths

    monkeypatch.setitem(sys.modules, "folder_paths", make_folder_paths(tmp_path))
    folder = tmp_path / "models" / "diffusion_models"
    folder.mkdir(parents=True)
    wan = load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=3)
    generator = {f"model.{k}": v.clone().contiguous() for k, v in wan.state_dict().items()}
    torch.save({"generator_ema": generator, "generator": {}}, folder / "self_forcing_dmd.pt")
    save_file(generator, str(folder / "self_forcing_dmd.safetensors"))
    loader = pack.NODE_CLASS_MAPPINGS["FewStepDiTLoader"]
    listed = loader.INPUT_TYPES()["required"]["model_name"][0]
    assert {"self_forcing_dmd.pt", "self_forcing_dmd.safetensors"} <= set(listed)
    (pt,) = loader().load("self_forcing_dmd.pt", compute_dtype="fp32")
    (st,) = loader().load("self_forcing_dmd.safetensors", compute_dtype="fp32")
    a, b = pt.model.state_dict(), st.model.state_dict()
    assert a.keys() == b.keys() == wan.state_dict().keys()
    assert all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)
