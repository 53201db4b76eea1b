"""FLUX.2 family core: shapes, staged forward, published parameter counts, official layout, reference equality.

The reference check imports black-forest-labs/flux2 ``src/flux2/model.py`` from a checkout outside the
repository, named by ``FEWSTEP_FLUX2_DIR`` (the repository root or its ``src``); it skips without one. The
diffusers check runs when ``diffusers`` (with ``Flux2Transformer2DModel``) is importable.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest
import torch

from fewstep.engine.conditioning import TextCondition
from fewstep.engine.models import flux2_checkpoint
from fewstep.engine.models import flux_checkpoint as flux1_checkpoint
from fewstep.engine.models.flux import PRESETS as FLUX1_PRESETS
from fewstep.engine.models.flux import Flux
from fewstep.engine.models.flux2 import (
    PRESETS,
    Flux2,
    Flux2Params,
    flux2_velocity,
    image_ids,
    pack_latent,
    random_inputs,
    text_ids,
    unpack_latent,
)


def _tiny(name: str = "flux2-tiny", seed: int = 0) -> Flux2:
    torch.manual_seed(seed)
    model = Flux2(PRESETS[name]).eval()
    with torch.no_grad():  # weights large enough that a wrong rotation or gate shows far above 1e-4
        for p in model.parameters():
            p.normal_(0, 0.1) if p.ndim > 1 else p.normal_(1, 0.2)  # matrices; RMSNorm scales around 1
    return model


@pytest.mark.parametrize("name", ["flux2-tiny", "flux2-tiny-dev"])
def test_forward_shapes_and_staged_forward(name):
    model = _tiny(name)
    inputs = random_inputs(model.params, width=64, height=48, txt_tokens=5, batch=2)
    with torch.no_grad():
        out = model(**inputs)
        h = model.embed(**inputs)
        h = model.run_blocks(model.run_blocks(h, 0, 3), 3)
        staged = model.finish(h)
    assert out.shape == (2, 4 * 3, 128)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(staged, out, atol=0, rtol=0)


def test_guidance_is_required_only_with_an_embedding():
    dev = _tiny("flux2-tiny-dev")
    inputs = random_inputs(dev.params, 32, 32, 3)
    inputs.pop("guidance")
    with pytest.raises(ValueError, match="guidance"):
        dev(**inputs)
    klein = _tiny("flux2-tiny")
    assert not hasattr(klein.guidance_in, "in_layer")
    assert "guidance_in.in_layer.weight" not in klein.state_dict()


def test_position_ids_follow_the_reference():
    ids = image_ids(1, 2, 3)
    assert ids.shape == (1, 6, 4)
    assert ids[0, 4].tolist() == [0, 1, 1, 0]  # (time, row, column, 0), row-major
    t = text_ids(2, 4)
    assert t.shape == (2, 4, 4) and t[1, 3].tolist() == [0, 0, 0, 3]
    x = torch.randn(2, 128, 3, 5)
    tokens = pack_latent(x)
    assert tokens.shape == (2, 15, 128)
    assert torch.equal(tokens[:, 5 + 2], x[:, :, 1, 2])
    assert torch.equal(unpack_latent(tokens, 3, 5), x)


def test_velocity_on_a_latent():
    model = _tiny("flux2-tiny-dev")
    x = torch.randn(1, 128, 2, 3)
    cond = TextCondition(context=torch.randn(1, 4, 15360), guidance=2.5)
    with torch.no_grad():
        v = flux2_velocity(model, x, torch.tensor([0.7]), cond)
        direct = model(
            x=pack_latent(x),
            x_ids=image_ids(1, 2, 3),
            timesteps=torch.tensor([0.7]),
            ctx=cond.context,
            ctx_ids=text_ids(1, 4),
            guidance=torch.tensor([2.5]),
        )
    assert v.shape == x.shape
    torch.testing.assert_close(v, unpack_latent(direct, 2, 3), atol=0, rtol=0)
    with pytest.raises(ValueError, match="15360"):
        flux2_velocity(model, x, torch.tensor([0.7]), TextCondition(context=torch.randn(1, 4, 7680)))


# Published sizes: FLUX.2 [dev] "a 32 billion parameter rectified flow transformer" (model card,
# black-forest-labs/FLUX.2-dev); FLUX.2 [klein] 4B and 9B (black-forest-labs/FLUX.2-klein-4B / -9B).
@pytest.mark.parametrize(
    ("preset", "published", "count"),
    [
        ("flux.2-dev", 32e9, 32_223_281_152),
        ("flux.2-klein-4b", 4e9, 3_875_544_576),
        ("flux.2-klein-9b", 9e9, 9_078_581_248),
    ],
)
def test_published_parameter_counts(preset, published, count):
    with torch.device("meta"):
        model = Flux2(PRESETS[preset])
    n = sum(p.numel() for p in model.parameters())
    assert n == count
    assert abs(n - published) / published < 0.04


def test_official_layout_round_trip():
    model = _tiny("flux2-tiny-dev")
    sd = model.state_dict()
    assert flux2_checkpoint.is_official(set(sd))
    params = flux2_checkpoint.params_from_state_dict(sd)
    assert params == PRESETS["flux2-tiny-dev"]
    assert flux2_checkpoint.preset_name(params) == "flux2-tiny-dev"
    again = Flux2(params)
    again.load_state_dict(sd, strict=True)
    inputs = random_inputs(params, 32, 32, 3)
    with torch.no_grad():
        torch.testing.assert_close(again(**inputs), model(**inputs), atol=0, rtol=0)
    # the key names are those of the official checkpoints
    for key in (
        "img_in.weight",
        "txt_in.weight",
        "time_in.in_layer.weight",
        "guidance_in.out_layer.weight",
        "double_stream_modulation_img.lin.weight",
        "double_stream_modulation_txt.lin.weight",
        "single_stream_modulation.lin.weight",
        "double_blocks.0.img_attn.qkv.weight",
        "double_blocks.0.txt_attn.norm.key_norm.scale",
        "double_blocks.1.img_mlp.0.weight",
        "double_blocks.1.txt_mlp.2.weight",
        "single_blocks.1.linear1.weight",
        "single_blocks.1.linear2.weight",
        "single_blocks.0.norm.query_norm.scale",
        "final_layer.linear.weight",
        "final_layer.adaLN_modulation.1.weight",
    ):
        assert key in sd, key
    assert not any(k.endswith(".bias") for k in sd)


@pytest.mark.parametrize("preset", ["flux.2-dev", "flux.2-klein-4b", "flux.2-klein-9b"])
def test_params_inferred_for_the_published_presets(preset):
    with torch.device("meta"):
        sd = Flux2(PRESETS[preset]).state_dict()
    assert flux2_checkpoint.params_from_state_dict(sd) == PRESETS[preset]


def test_a_flux1_file_is_never_flux2():
    with torch.device("meta"):
        flux1 = set(Flux(FLUX1_PRESETS["flux-tiny-guidance"]).state_dict())
        flux1_dev = set(Flux(FLUX1_PRESETS["flux.1-dev"]).state_dict())
    assert not flux2_checkpoint.is_official(flux1)
    assert not flux2_checkpoint.is_official(flux1_dev)
    assert flux1_checkpoint.is_official(flux1)


def test_a_flux2_file_is_never_flux1():
    """The block names are shared; FLUX.1's matchers exclude FLUX.2's shared modulation (either layout)."""
    sd = Flux2(PRESETS["flux2-tiny"]).state_dict()
    assert not flux1_checkpoint.is_official(set(sd))
    assert not flux1_checkpoint.is_diffusers(set(_to_diffusers(sd)))
    assert flux2_checkpoint.is_diffusers(set(_to_diffusers(sd)))


def test_missing_key_is_named():
    sd = dict(_tiny().state_dict())
    del sd["single_blocks.0.linear2.weight"]
    with pytest.raises(Exception, match="single_blocks.0.linear2.weight"):
        flux2_checkpoint.params_from_state_dict(sd, source="x.safetensors")


def test_bad_head_split_is_refused():
    with pytest.raises(ValueError, match="axes_dim"):
        Flux2(Flux2Params(hidden_size=64, num_heads=2, depth=1, depth_single_blocks=1))


# ---- reference equality: black-forest-labs/flux2 Flux2 on random weights of a tiny config -------------------


def _bfl_model_module():
    root = os.environ.get("FEWSTEP_FLUX2_DIR")
    if not root:
        pytest.skip("FEWSTEP_FLUX2_DIR not set (a black-forest-labs/flux2 checkout; optional cross-check)")
    root = pathlib.Path(root)
    path = next(
        (p for p in (root / "src" / "flux2" / "model.py", root / "flux2" / "model.py") if p.is_file()), None
    )
    if path is None:
        pytest.skip(f"no flux2/model.py under {root}")
    pytest.importorskip("einops", reason="the BFL reference needs einops")
    spec = importlib.util.spec_from_file_location("_bfl_flux2_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["flux2-tiny", "flux2-tiny-dev"])
def test_against_bfl_flux2_reference(name):
    bfl = _bfl_model_module()
    ours = _tiny(name, seed=3)
    p = ours.params
    fields = {f for f in bfl.Flux2Params.__dataclass_fields__}
    kwargs = dict(
        in_channels=p.in_channels,
        context_in_dim=p.context_in_dim,
        hidden_size=p.hidden_size,
        num_heads=p.num_heads,
        depth=p.depth,
        depth_single_blocks=p.depth_single_blocks,
        axes_dim=list(p.axes_dim),
        theta=p.theta,
        mlp_ratio=p.mlp_ratio,
    )
    if "use_guidance_embed" in fields:  # newer reference: klein has no guidance embedding
        kwargs["use_guidance_embed"] = p.guidance_embed
    ref = bfl.Flux2(bfl.Flux2Params(**kwargs)).eval()
    sd = dict(ours.state_dict())
    ref_keys = set(ref.state_dict())
    if not p.guidance_embed and "guidance_in.in_layer.weight" in ref_keys:
        # the older reference always adds a guidance embedding: a zero output layer makes it add nothing
        sd["guidance_in.in_layer.weight"] = torch.randn(p.hidden_size, 256)
        sd["guidance_in.out_layer.weight"] = torch.zeros(p.hidden_size, p.hidden_size)
    ref.load_state_dict(sd, strict=True)

    inputs = random_inputs(p, width=80, height=48, txt_tokens=7, batch=2, seed=5)
    inputs["timesteps"] = torch.tensor([0.3, 0.9])
    guidance = inputs.get("guidance", torch.ones(2))
    with torch.no_grad():
        got = ours(**inputs)
        want = ref(
            x=inputs["x"],
            x_ids=inputs["x_ids"],
            timesteps=inputs["timesteps"],
            ctx=inputs["ctx"],
            ctx_ids=inputs["ctx_ids"],
            guidance=guidance,
        )
    diff = (got - want).abs().max().item()
    print(f"{name}: max abs diff vs BFL flux2 = {diff:.3e}")
    assert diff <= 1e-4


# ---- the diffusers layout ---------------------------------------------------------------------------------


def _to_diffusers(sd: dict) -> dict:
    """Written from diffusers' Flux2Transformer2DModel module names, to exercise the converter independently."""
    top = {
        "img_in": "x_embedder",
        "txt_in": "context_embedder",
        "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
        "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
        "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
        "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
        "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
        "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
        "single_stream_modulation.lin": "single_stream_modulation.linear",
        "final_layer.linear": "proj_out",
    }
    double = {
        "img_attn.proj.weight": "attn.to_out.0.weight",
        "txt_attn.proj.weight": "attn.to_add_out.weight",
        "img_attn.norm.query_norm.scale": "attn.norm_q.weight",
        "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
        "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
        "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight",
        "img_mlp.0.weight": "ff.linear_in.weight",
        "img_mlp.2.weight": "ff.linear_out.weight",
        "txt_mlp.0.weight": "ff_context.linear_in.weight",
        "txt_mlp.2.weight": "ff_context.linear_out.weight",
    }
    single = {
        "linear1.weight": "attn.to_qkv_mlp_proj.weight",
        "linear2.weight": "attn.to_out.weight",
        "norm.query_norm.scale": "attn.norm_q.weight",
        "norm.key_norm.scale": "attn.norm_k.weight",
    }
    out = {}
    for key, t in sd.items():
        parts = key.split(".")
        rest = ".".join(parts[2:])
        if parts[0] == "double_blocks":
            p = f"transformer_blocks.{parts[1]}."
            if rest in ("img_attn.qkv.weight", "txt_attn.qkv.weight"):
                names = (
                    ("to_q", "to_k", "to_v") if rest[0] == "i" else ("add_q_proj", "add_k_proj", "add_v_proj")
                )
                for n, chunk in zip(names, t.chunk(3, 0)):
                    out[f"{p}attn.{n}.weight"] = chunk
            else:
                out[p + double[rest]] = t
        elif parts[0] == "single_blocks":
            out[f"single_transformer_blocks.{parts[1]}.{single[rest]}"] = t
        elif key == "final_layer.adaLN_modulation.1.weight":
            shift, scale = t.chunk(2, 0)
            out["norm_out.linear.weight"] = torch.cat((scale, shift), 0)
        else:
            out[top[key.rsplit(".", 1)[0]] + ".weight"] = t
    return out


@pytest.mark.parametrize("name", ["flux2-tiny", "flux2-tiny-dev"])
def test_diffusers_layout_converts_back(name):
    sd = _tiny(name).state_dict()
    d = _to_diffusers(sd)
    assert flux2_checkpoint.is_diffusers(set(d)) and not flux2_checkpoint.is_official(set(d))
    assert not flux2_checkpoint.is_diffusers(set(sd))
    back = flux2_checkpoint.diffusers_to_official(d)
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


def test_diffusers_layout_half_fused_is_an_error():
    d = _to_diffusers(_tiny().state_dict())
    del d["transformer_blocks.0.attn.to_k.weight"]
    with pytest.raises(Exception, match="to_k"):
        flux2_checkpoint.diffusers_to_official(d)


@pytest.mark.parametrize("name", ["flux2-tiny", "flux2-tiny-dev"])
def test_against_diffusers_flux2_if_installed(name):
    diffusers = pytest.importorskip("diffusers", reason="diffusers not installed (optional cross-check)")
    if not hasattr(diffusers, "Flux2Transformer2DModel"):
        pytest.skip("this diffusers has no Flux2Transformer2DModel")
    p = PRESETS[name]
    torch.manual_seed(4)
    ref = diffusers.Flux2Transformer2DModel(**flux2_checkpoint.diffusers_config(p)).eval()
    with torch.no_grad():
        for t in ref.parameters():
            t.normal_(0, 0.1) if t.ndim > 1 else t.normal_(1, 0.2)
    d = ref.state_dict()
    assert flux2_checkpoint.is_diffusers(set(d))
    official = flux2_checkpoint.diffusers_to_official(d)
    assert flux2_checkpoint.params_from_state_dict(official) == p
    ours = Flux2(p).eval()
    ours.load_state_dict(official, strict=True)
    inputs = random_inputs(p, width=80, height=48, txt_tokens=7, batch=1, seed=6)
    inputs["timesteps"] = torch.tensor([0.6])
    with torch.no_grad():
        got = ours(**inputs)
        want = ref(**flux2_checkpoint.diffusers_forward_kwargs(inputs))[0]
    diff = (got - want).abs().max().item()
    print(f"{name}: max abs diff vs diffusers Flux2Transformer2DModel = {diff:.3e}")
    assert diff <= 1e-4


# ---- through load_dit, with the family registered as the lead will register it ----------------------------


@pytest.fixture
def flux2_registered(monkeypatch):
    """The Family entry proposed for engine/models/registry.py, put in front of FLUX.1 for this test only."""
    from fewstep.engine.latent_formats import LatentFormat
    from fewstep.engine.models import flux2, registry

    if "flux2" in registry.FAMILIES:
        return registry.FAMILIES["flux2"]
    family = registry.Family(
        name="flux2",
        model_class=flux2.Flux2,
        presets=flux2.PRESETS,
        layouts=(
            registry.Layout(
                "flux2 (official)",
                "BFL flux2-*.safetensors / ComfyUI repacks: double_blocks.*, single_blocks.*, "
                "single_stream_modulation.*",
                flux2_checkpoint.is_official,
            ),
            registry.Layout(
                "flux2 (diffusers)",
                "diffusers Flux2Transformer2DModel: transformer_blocks.*, single_transformer_blocks.*, "
                "single_stream_modulation.linear.*",
                flux2_checkpoint.is_diffusers,
                flux2_checkpoint.diffusers_to_official,
            ),
        ),
        params_from_state_dict=flux2_checkpoint.params_from_state_dict,
        latent_format=LatentFormat("flux2", channels=128),
        velocity=flux2.flux2_velocity,
    )
    monkeypatch.setattr(
        registry, "FAMILIES", {**registry.FAMILIES, "flux2": family}
    )  # after FLUX.1: no overlap
    return family


@pytest.mark.parametrize("layout", ["official", "comfyui", "diffusers"])
def test_load_dit_finds_each_layout(tmp_path, flux2_registered, layout):
    from safetensors.torch import save_file

    from fewstep.engine.loader import load_dit

    ref = load_dit("dummy:flux2-tiny-dev", dtype=torch.float32, device="cpu", seed=7)
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    if layout == "comfyui":
        sd = {f"model.diffusion_model.{k}": v for k, v in sd.items()}
    elif layout == "diffusers":
        sd = _to_diffusers(sd)
    path = tmp_path / f"{layout}.safetensors"
    save_file(sd, str(path))
    model = load_dit(path, dtype=torch.float32, device="cpu")
    assert isinstance(model, Flux2) and model.params == PRESETS["flux2-tiny-dev"]
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_fp8_storage_runs():
    from fewstep.engine.ops import FP8_DTYPES, store_linear_weights

    if not FP8_DTYPES:
        pytest.skip("this torch has no fp8 dtypes")
    model = _tiny("flux2-tiny")
    inputs = random_inputs(model.params, 32, 32, 3)
    with torch.no_grad():
        full = model(**inputs)
        store_linear_weights(model, FP8_DTYPES[0])
        assert model.single_blocks[0].linear1.weight.dtype == FP8_DTYPES[0]
        low = model(**inputs)
    assert torch.isfinite(low).all()
    assert (low - full).abs().max() < 0.25 * full.abs().max()
