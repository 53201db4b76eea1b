"""The Z-Image DiT: shapes, token layout, checkpoint layout and the reference implementations (optional)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from fewstep.engine.conditioning import TextCondition
from fewstep.engine.models import flux, wan, zimage_checkpoint
from fewstep.engine.models.zimage import (
    PRESETS,
    ZImage,
    caption_ids,
    image_ids,
    patchify,
    unpatchify,
    zimage_velocity,
)
from fewstep.engine.weights import dummy_init_

TINY = PRESETS["zimage-tiny"]


def _model(name: str = "zimage-tiny", seed: int = 0) -> ZImage:
    model = ZImage(PRESETS[name]).eval()
    dummy_init_(model, seed)
    return model


@pytest.fixture(scope="module")
def tiny() -> ZImage:
    return _model()


def _inputs(batch=2, h=10, w=12, tokens=7, seed=0):
    """10x12 latent = 30 patches and a 7-token caption: both padded (to 32) as the reference pads them."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, 16, h, w, generator=g),
        torch.rand(batch, generator=g),
        torch.randn(batch, tokens, 2560, generator=g),
    )


def test_forward_shape(tiny):
    x, t, cap = _inputs()
    out = tiny(x, t, cap)
    assert out.shape == x.shape and out.dtype == torch.float32 and torch.isfinite(out).all()


def test_fewer_kv_heads_refused(tiny):
    from fewstep.engine.errors import CheckpointError
    from fewstep.engine.models.zimage import ZImageParams

    with pytest.raises(ValueError, match="key/value heads"):
        ZImage(
            ZImageParams(dim=64, n_heads=4, n_kv_heads=2, n_layers=1, n_refiner_layers=1, axes_dims=(4, 6, 6))
        )
    sd = dict(tiny.state_dict())
    sd["layers.0.attention.to_k.weight"] = sd["layers.0.attention.to_k.weight"][:32]
    with pytest.raises(CheckpointError, match="key/value heads"):
        zimage_checkpoint.params_from_state_dict(sd)


def test_turbo_parameter_count_matches_published_size():
    # Z-Image-Turbo is published as a 6B-parameter model; the official config gives 6,154,908,736.
    with torch.device("meta"):
        model = ZImage(PRESETS["z-image-turbo"])
    n = sum(p.numel() for p in model.parameters())
    assert n == 6_154_908_736
    assert 6.0e9 < n < 6.3e9
    assert len(model.layers) == 30 and len(model.noise_refiner) == 2 and len(model.context_refiner) == 2


def test_patchify_order_is_channels_last():
    x = torch.arange(1 * 16 * 4 * 6, dtype=torch.float32).reshape(1, 16, 4, 6)
    tokens = patchify(x, 2)
    assert tokens.shape == (1, 6, 64)
    # token 1 is the patch at rows 0-1, columns 2-3; features run (row-in-patch, col-in-patch, channel)
    assert tokens[0, 1, 0].item() == x[0, 0, 0, 2].item()
    assert tokens[0, 1, 1].item() == x[0, 1, 0, 2].item()
    assert tokens[0, 1, 16].item() == x[0, 0, 0, 3].item()
    assert tokens[0, 1, 32].item() == x[0, 0, 1, 2].item()
    assert torch.equal(unpatchify(tokens, 4, 6, 2), x)


def test_positions():
    cap = caption_ids(1, 32)
    assert cap[0, :3].tolist() == [[1, 0, 0], [2, 0, 0], [3, 0, 0]]
    img = image_ids(1, 2, 3, frame=33, padded=8)
    assert img[0].tolist() == [
        [33, 0, 0], [33, 0, 1], [33, 0, 2], [33, 1, 0], [33, 1, 1], [33, 1, 2], [0, 0, 0], [0, 0, 0],
    ]  # fmt: skip


def test_padding_tokens_take_part(tiny):
    """The learnt pad tokens are in the attention, as in the reference: changing one changes the output."""
    x, t, cap = _inputs(batch=1)
    before = tiny(x, t, cap)
    other = _model()
    other.cap_pad_token.data += 1.0
    assert not torch.allclose(other(x, t, cap), before)


def test_stages_compose(tiny):
    x, t, cap = _inputs()
    h = tiny.embed(x, t, cap)
    assert h.txt_tokens == 32 and h.img_tokens == 30 and h.stream.shape[1] == 32
    split = tiny.finish(tiny.run_blocks(tiny.run_blocks(h, 0, 1), 1))
    torch.testing.assert_close(split, tiny(x, t, cap), rtol=0, atol=0)
    assert torch.equal(h.with_stream(h.stream).joint, h.joint)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no float8")
def test_bf16_compute_with_fp8_storage(tiny):
    """fp8 weight storage as for FLUX.1: Linear weights stay fp8, each layer upcasts to the bf16 activations."""
    from fewstep.engine.ops import store_linear_weights

    model = _model().to(torch.bfloat16)
    store_linear_weights(model, torch.float8_e4m3fn)
    assert model.layers[0].attention.to_q.weight.dtype == torch.float8_e4m3fn
    x, t, cap = _inputs(batch=1)
    out = model(x.bfloat16(), t, cap.bfloat16())
    ref = tiny(x, t, cap)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert (out.float() - ref).abs().mean() < 0.1 * ref.abs().mean()


def test_velocity_convention(tiny):
    """``dx/dsigma = -model(x, t = 1 - sigma)`` (the reference pipeline's timestep and sign)."""
    x, _, cap = _inputs()
    sigma = torch.tensor([0.9, 0.3])
    v = zimage_velocity(tiny, x, sigma, TextCondition(cap))
    torch.testing.assert_close(v, -tiny(x, 1 - sigma, cap), rtol=0, atol=0)


def test_bad_caption_width(tiny):
    x, t, _ = _inputs(batch=1)
    with pytest.raises(ValueError, match="2560"):
        tiny(x, t, torch.randn(1, 5, 4096))


@pytest.mark.parametrize("name", ["zimage-tiny", "zimage-mid"])
def test_official_layout_round_trip(name):
    with torch.device("meta"):
        model = ZImage(PRESETS[name])
    sd = model.state_dict()
    assert zimage_checkpoint.is_official(sd.keys())
    params = zimage_checkpoint.params_from_state_dict(sd)
    assert params == PRESETS[name] and zimage_checkpoint.preset_name(params) == name


def test_turbo_params_from_official_keys():
    with torch.device("meta"):
        sd = ZImage(PRESETS["z-image-turbo"]).state_dict()
    assert "all_x_embedder.2-1.weight" in sd and "layers.29.adaLN_modulation.0.weight" in sd
    assert "context_refiner.0.adaLN_modulation.0.weight" not in sd  # the context refiner is unmodulated
    assert zimage_checkpoint.params_from_state_dict(sd) == PRESETS["z-image-turbo"]


def test_weights_load_strictly(tiny):
    other = ZImage(TINY).eval()
    other.load_state_dict(tiny.state_dict(), strict=True)
    x, t, cap = _inputs(batch=1)
    assert torch.equal(other(x, t, cap), tiny(x, t, cap))


def test_never_matches_other_families():
    with torch.device("meta"):
        flux_keys = set(flux.Flux(flux.PRESETS["flux-tiny"]).state_dict())
        wan_keys = set(wan.Wan(wan.PRESETS["wan-tiny"]).state_dict())
        z_keys = set(ZImage(TINY).state_dict())
    assert not zimage_checkpoint.is_official(flux_keys)
    assert not zimage_checkpoint.is_official(wan_keys)
    assert not zimage_checkpoint.is_comfy(flux_keys) and not zimage_checkpoint.is_comfy(wan_keys)
    from fewstep.engine.models.flux_checkpoint import diffusers_to_official  # noqa: F401 - FLUX diffusers keys:

    flux_diffusers = {"x_embedder.weight", "transformer_blocks.0.attn.to_q.weight", "context_embedder.weight"}
    assert not zimage_checkpoint.is_comfy(flux_diffusers) and not zimage_checkpoint.is_official(
        flux_diffusers
    )
    from fewstep.engine.models import flux_checkpoint, wan_checkpoint

    assert not flux_checkpoint.is_official(z_keys) and not flux_checkpoint.is_diffusers(z_keys)
    assert not wan_checkpoint.is_official(z_keys)


def _to_comfy(sd):
    """The official state dict in ComfyUI's repack names (fused qkv), built independently of the converter."""
    out = {}
    for key, value in sd.items():
        if key.endswith(".attention.to_k.weight") or key.endswith(".attention.to_v.weight"):
            continue
        if key.endswith(".attention.to_q.weight"):
            base = key[: -len("to_q.weight")]
            parts = [sd[base + n + ".weight"] for n in ("to_q", "to_k", "to_v")]
            out[base + "qkv.weight"] = torch.cat(parts, dim=0)
            continue
        key = key.replace("all_x_embedder.2-1.", "x_embedder.").replace(
            "all_final_layer.2-1.", "final_layer."
        )
        key = key.replace(".attention.to_out.0.", ".attention.out.")
        key = key.replace(".attention.norm_q.", ".attention.q_norm.").replace(
            ".attention.norm_k.", ".attention.k_norm."
        )
        out[key] = value
    return out


def test_comfy_layout_converts_to_official():
    name = "zimage-tiny"
    model = _model(name)
    sd = model.state_dict()
    comfy = _to_comfy(sd)
    comfy["norm_final.weight"] = torch.ones(model.params.dim)
    assert zimage_checkpoint.is_comfy(comfy.keys()) and not zimage_checkpoint.is_official(comfy.keys())
    assert not zimage_checkpoint.is_comfy(sd.keys())
    converted = zimage_checkpoint.comfy_to_official(comfy)
    assert converted.keys() == sd.keys()
    assert all(torch.equal(converted[k], sd[k]) for k in sd)
    assert zimage_checkpoint.params_from_state_dict(converted) == PRESETS[name]


def test_params_from_state_dict_reports_missing_keys(tiny):
    from fewstep.engine.errors import CheckpointError

    sd = dict(tiny.state_dict())
    del sd["cap_embedder.1.weight"]
    with pytest.raises(CheckpointError, match="cap_embedder.1.weight"):
        zimage_checkpoint.params_from_state_dict(sd)


# -- reference implementations on random weights (optional: they run when importable) -------------------------


@contextlib.contextmanager
def _tongyi_reference():
    """Tongyi-MAI/Z-Image ``src/zimage/transformer.py`` from a checkout named by ``FEWSTEP_ZIMAGE_DIR``.

    It imports the top-level packages ``config`` and (in its forward) ``utils.attention``; ``utils/__init__``
    also imports the checkpoint loader (transformers), so ``utils`` is registered as a bare package over the same
    folder. The modules it adds are removed afterwards."""
    root = os.environ.get("FEWSTEP_ZIMAGE_DIR")
    if not root:
        pytest.skip("FEWSTEP_ZIMAGE_DIR not set (a Tongyi-MAI/Z-Image checkout; optional cross-check)")
    src = Path(root) / "src" if (Path(root) / "src" / "zimage").is_dir() else Path(root)
    path = src / "zimage" / "transformer.py"
    if not path.is_file():
        pytest.skip(f"no zimage/transformer.py under {root}")
    before = set(sys.modules)
    sys.path.insert(0, str(src))
    utils = types.ModuleType("utils")
    utils.__path__ = [str(src / "utils")]
    sys.modules["utils"] = utils
    try:
        spec = importlib.util.spec_from_file_location("fewstep_test_zimage_reference", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(src))
        for name in set(sys.modules) - before:
            del sys.modules[name]


def _reference_inputs():
    x, t, cap = _inputs(batch=2, h=10, w=12, tokens=7, seed=3)
    return x, t, cap


def _max_diff(ours: torch.Tensor, ref_list) -> float:
    ref = torch.stack([r.squeeze(1) for r in ref_list])
    assert ref.shape == ours.shape
    return (ours - ref).abs().max().item()


def test_against_tongyi_reference(tiny):
    with _tongyi_reference() as ref_mod:
        ref = ref_mod.ZImageTransformer2DModel(
            in_channels=16, dim=64, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
            cap_feat_dim=2560, axes_dims=[8, 12, 12], axes_lens=[1536, 512, 512],
        ).eval()  # fmt: skip
        ref.load_state_dict(tiny.state_dict(), strict=True)
        x, t, cap = _reference_inputs()
        expected, _ = ref(list(x.unsqueeze(2)), t, list(cap))
        diff = _max_diff(tiny(x, t, cap), expected)
    print(f"max abs diff vs Tongyi ZImageTransformer2DModel: {diff:.3g}")
    assert diff <= 1e-4


def test_against_diffusers_if_installed(tiny):
    diffusers = pytest.importorskip("diffusers", reason="diffusers not installed (optional cross-check)")
    if not hasattr(diffusers, "ZImageTransformer2DModel"):
        pytest.skip(f"diffusers {diffusers.__version__} has no ZImageTransformer2DModel")
    ref = diffusers.ZImageTransformer2DModel(**zimage_checkpoint.diffusers_config(tiny.params)).eval()
    ref.load_state_dict(tiny.state_dict(), strict=True)  # the diffusers layout is the official one
    x, t, cap = _reference_inputs()
    expected = ref(list(x.unsqueeze(2)), t, list(cap), return_dict=False)[0]
    diff = _max_diff(tiny(x, t, cap), expected)
    print(f"max abs diff vs diffusers ZImageTransformer2DModel: {diff:.3g}")
    assert diff <= 1e-4


def test_sampling_matches_diffusers_pipeline_if_installed(tiny):
    """A whole 4-step run: diffusers' ZImagePipeline denoising loop (latents in, latents out; no text encoder or
    VAE) against Euler steps of :func:`zimage_velocity` on the pipeline's own sigmas, same random transformer."""
    from test_zimage_sampling import zimage_pipeline

    pipe = zimage_pipeline(tiny)
    g = torch.Generator().manual_seed(5)
    noise = torch.randn(1, 16, 10, 12, generator=g)
    cap = torch.randn(1, 7, 2560, generator=g)
    expected = pipe(
        prompt_embeds=[cap[0]],
        height=80,
        width=96,
        num_inference_steps=4,
        guidance_scale=0.0,
        latents=noise.clone(),
        output_type="latent",
        return_dict=False,
    )[0]
    sigmas = pipe.scheduler.sigmas.float()
    x = noise.clone()
    cond = TextCondition(cap)
    for s, s_next in zip(sigmas[:-1], sigmas[1:], strict=True):
        x = x + (s_next - s) * zimage_velocity(tiny, x, s.expand(1), cond)
    diff = (x - expected).abs().max().item()
    print(f"max abs diff vs diffusers ZImagePipeline (4 steps): {diff:.3g}; sigmas {sigmas.tolist()}")
    assert diff <= 1e-4
