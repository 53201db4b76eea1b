"""The Wan 2.1 DiT: shapes, official conventions, checkpoint layouts in the wild."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from fewstep.engine import CheckpointError, load_dit
from fewstep.engine.models.wan import PRESETS, Wan, sinusoidal_embedding


@pytest.fixture(scope="module")
def wan():
    return load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=1)


def _inputs(batch=1, frames=3, h=4, w=6, tokens=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 16, frames, h, w, generator=g), torch.randn(batch, tokens, 4096, generator=g)


def test_forward_shape_and_dtype(wan):
    x, ctx = _inputs(batch=2)
    out = wan(x, torch.tensor([900.0, 100.0]), ctx)
    assert out.shape == x.shape and out.dtype == torch.float32 and torch.isfinite(out).all()


def test_official_configs():
    small, big = PRESETS["wan2.1-1.3b"], PRESETS["wan2.1-14b"]
    assert (small.dim, small.ffn_dim, small.num_heads, small.num_layers) == (1536, 8960, 12, 30)
    assert (big.dim, big.ffn_dim, big.num_heads, big.num_layers) == (5120, 13824, 40, 40)
    assert small.axes_dim == (44, 42, 42)  # head 128: d - 4 * (d // 6) for frames, 2 * (d // 6) each for h, w
    # parameter counts of the official WanModel built with these configs
    for params, count in ((small, 1_418_996_800), (big, 14_288_491_584)):
        with torch.device("meta"):
            model = Wan(params)
        assert sum(p.numel() for p in model.parameters()) == count


def test_sinusoidal_embedding_formula():
    emb = sinusoidal_embedding(8, torch.tensor([250.0]))
    args = 250.0 * torch.pow(10000, -torch.arange(4, dtype=torch.float64) / 4)
    assert torch.allclose(emb, torch.cat([args.cos(), args.sin()])[None])


def test_text_is_zero_padded_to_512_tokens(wan):
    """The reference pads every prompt to text_len with zeros, so explicit zero padding changes nothing."""
    x, ctx = _inputs(tokens=7)
    padded = torch.cat([ctx, torch.zeros(1, 20, 4096)], dim=1)
    t = torch.tensor([500.0])
    assert torch.allclose(wan(x, t, ctx), wan(x, t, padded), atol=1e-6)
    with pytest.raises(ValueError, match="at most 512"):
        wan(x, t, torch.zeros(1, 513, 4096))


def test_scalar_timestep_equals_per_frame_constant(wan):
    x, ctx = _inputs()
    a = wan(x, torch.tensor([625.0]), ctx)
    b = wan(x, torch.full((1, 3), 625.0), ctx)
    assert torch.equal(a, b)
    c = wan(x, torch.tensor([[625.0, 625.0, 0.0]]), ctx)
    assert not torch.allclose(a[:, :, 2], c[:, :, 2])


@pytest.mark.parametrize(
    "wrap",
    [
        lambda sd: sd,
        lambda sd: {f"model.diffusion_model.{k}": v for k, v in sd.items()},  # ComfyUI repack
        lambda sd: {
            "generator_ema": {f"model.{k}": v for k, v in sd.items()},
            "generator": {},
        },  # Self-Forcing
        lambda sd: {"generator": {f"model.{k}": v for k, v in sd.items()}},  # CausVid
    ],
)
def test_checkpoint_layouts_in_the_wild(tmp_path, wan, wrap):
    sd = {k: v.clone() for k, v in wan.state_dict().items()}
    obj = wrap(sd)
    path = tmp_path / ("wan.pt" if "generator" in obj or "generator_ema" in obj else "wan.safetensors")
    if path.suffix == ".pt":
        torch.save(obj, path)
    else:
        save_file(obj, str(path))
    model = load_dit(path, dtype=torch.float32, device="cpu")
    assert isinstance(model, Wan) and model.params == wan.params
    x, ctx = _inputs()
    assert torch.allclose(model(x, torch.tensor([300.0]), ctx), wan(x, torch.tensor([300.0]), ctx), atol=1e-6)


def test_image_to_video_checkpoints_are_refused(tmp_path, wan):
    sd = dict(wan.state_dict())
    sd["blocks.0.cross_attn.k_img.weight"] = torch.zeros(64, 64)
    save_file(sd, str(tmp_path / "i2v.safetensors"))
    with pytest.raises(CheckpointError, match="image-to-video"):
        load_dit(tmp_path / "i2v.safetensors")


def test_unpatchify_inverts_the_patch_order(wan):
    grid = (2, 3, 4)
    tokens = torch.arange(math.prod(grid) * 64, dtype=torch.float32).view(1, math.prod(grid), 64)
    video = wan.unpatchify(tokens, grid)
    assert video.shape == (1, 16, 2, 6, 8)
    # token (f=1, h=2, w=3) holds channel c at patch offset (q, r) as feature (q * 2 + r) * 16 + c
    token = (1 * 3 + 2) * 4 + 3
    assert video[0, 5, 1, 2 * 2 + 1, 3 * 2 + 0].item() == tokens[0, token, (1 * 2 + 0) * 16 + 5].item()


def test_residual_stream_is_token_major(wan):
    """The patch embedding's [B, C, F*T] output is stored as [B, F*T, C] contiguous, not as a transposed view: a
    view's channel-major layout would carry through every residual add of the stack (strided, several times
    slower on the CPU; bench/wan_vs_peers.py)."""
    x, ctx = _inputs()
    h = wan.embed(x, torch.tensor([500.0]), ctx)
    assert h.tokens.shape == (1, 3 * 2 * 3, 64) and h.tokens.is_contiguous()
    assert wan.run_blocks(h).tokens.is_contiguous()
