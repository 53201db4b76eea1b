"""The FLUX DiT: shapes, packing, and semantics checked against independent computations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fewstep.engine import load_dit
from fewstep.engine.backends import DEFAULT_BACKENDS
from fewstep.engine.models.flux import (
    PRESETS,
    default_axes_dim,
    image_ids,
    pack_latent,
    text_ids,
    unpack_latent,
)
from fewstep.engine.models.flux_layers import timestep_embedding
from fewstep.engine.rope import apply_rope, rope_freqs


@pytest.fixture(scope="module")
def tiny():
    return load_dit("dummy:flux-tiny", dtype=torch.float32, device="cpu")


def _inputs(model, batch=2, h=8, w=12, tokens=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 16, h, w, generator=g)
    return dict(
        img=pack_latent(x),
        img_ids=image_ids(batch, h, w),
        txt=torch.randn(batch, tokens, 4096, generator=g),
        txt_ids=text_ids(batch, tokens),
        timesteps=torch.rand(batch, generator=g),
        y=torch.randn(batch, 768, generator=g),
    )


def test_forward_shape(tiny):
    inp = _inputs(tiny)
    out = tiny(**inp)
    assert out.shape == (2, 4 * 6, 64)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_pack_unpack_roundtrip_and_patch_order():
    x = torch.arange(2 * 16 * 4 * 6, dtype=torch.float32).reshape(2, 16, 4, 6)
    tokens = pack_latent(x)
    assert tokens.shape == (2, 6, 64)
    # token 1 is the patch at latent rows 0-1, columns 2-3; features run (channel, row-in-patch, col-in-patch)
    assert tokens[0, 1, 0].item() == x[0, 0, 0, 2].item()
    assert tokens[0, 1, 1].item() == x[0, 0, 0, 3].item()
    assert tokens[0, 1, 2].item() == x[0, 0, 1, 2].item()
    assert tokens[0, 1, 4].item() == x[0, 1, 0, 2].item()
    assert torch.equal(unpack_latent(tokens, 4, 6), x)


def test_image_ids_rows_and_columns():
    ids = image_ids(1, 4, 6)
    assert ids.shape == (1, 6, 3)
    assert ids[0, :, 0].eq(0).all()
    assert ids[0, :, 1].tolist() == [0, 0, 0, 1, 1, 1]
    assert ids[0, :, 2].tolist() == [0, 1, 2, 0, 1, 2]


def test_axes_split_matches_flux():
    assert default_axes_dim(128) == (16, 56, 56)
    assert default_axes_dim(32) == (4, 14, 14)
    assert default_axes_dim(40) is None  # 5 + 17.5: no even split


def test_timestep_embedding_formula():
    t = torch.tensor([0.25, 1.0])
    emb = timestep_embedding(t, 8)
    freqs = torch.exp(-math.log(10000) * torch.arange(4) / 4)
    args = 1000 * t[:, None] * freqs[None]
    assert torch.allclose(emb, torch.cat([args.cos(), args.sin()], -1))


def test_rope_rotates_adjacent_pairs_by_axis_angles():
    ids = torch.tensor([[[0.0, 2.0, 3.0]]])  # one token: index 0, row 2, column 3
    axes = (4, 6, 6)
    freqs = rope_freqs(ids, axes, 10000)
    x = torch.randn(1, 1, 2, 16)
    out = apply_rope(x, freqs)
    # independent: angle of pair i within axis a is pos_a * theta^(-2i/d_a)
    angles = []
    for pos, d in zip((0.0, 2.0, 3.0), axes):
        angles += [pos * 10000 ** (-2 * i / d) for i in range(d // 2)]
    angles = torch.tensor(angles)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    ref = torch.stack(
        (angles.cos() * x0 - angles.sin() * x1, angles.sin() * x0 + angles.cos() * x1), -1
    ).flatten(-2)
    assert torch.allclose(out, ref, atol=1e-6)


def _reference_double_block(block, img, txt, vec, freqs):
    """The double-stream block written out with plain tensor ops (independent of the module code)."""
    H = block.num_heads

    def mod(m):
        return F.linear(F.silu(vec), m.lin.weight, m.lin.bias)[:, None].chunk(6, -1)

    def ln(x):
        return F.layer_norm(x, x.shape[-1:], eps=1e-6)

    def rms(x, scale):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale

    def qkv(attn, x):
        q, k, v = F.linear(x, attn.qkv.weight, attn.qkv.bias).unflatten(-1, (3, H, -1)).unbind(2)
        return rms(q, attn.norm.query_norm.scale), rms(k, attn.norm.key_norm.scale), v

    im, tm = mod(block.img_mod), mod(block.txt_mod)
    iq, ik, iv = qkv(block.img_attn, (1 + im[1]) * ln(img) + im[0])
    tq, tk, tv = qkv(block.txt_attn, (1 + tm[1]) * ln(txt) + tm[0])
    q, k, v = (torch.cat(p, 1) for p in ((tq, iq), (tk, ik), (tv, iv)))
    q, k = apply_rope(q, freqs), apply_rope(k, freqs)
    scores = torch.einsum("blhd,bmhd->bhlm", q, k) / math.sqrt(q.shape[-1])
    attn = torch.einsum("bhlm,bmhd->blhd", scores.softmax(-1), v).flatten(2)
    ta, ia = attn[:, : txt.shape[1]], attn[:, txt.shape[1] :]

    def mlp(seq, x):
        return F.linear(
            F.gelu(F.linear(x, seq[0].weight, seq[0].bias), approximate="tanh"), seq[2].weight, seq[2].bias
        )

    img = img + im[2] * F.linear(ia, block.img_attn.proj.weight, block.img_attn.proj.bias)
    img = img + im[5] * mlp(block.img_mlp, (1 + im[4]) * ln(img) + im[3])
    txt = txt + tm[2] * F.linear(ta, block.txt_attn.proj.weight, block.txt_attn.proj.bias)
    txt = txt + tm[5] * mlp(block.txt_mlp, (1 + tm[4]) * ln(txt) + tm[3])
    return img, txt


def test_double_block_matches_written_out_math(tiny):
    g = torch.Generator().manual_seed(1)
    img, txt = torch.randn(2, 12, 64, generator=g), torch.randn(2, 5, 64, generator=g)
    vec = torch.randn(2, 64, generator=g)
    ids = torch.cat((text_ids(2, 5), image_ids(2, 6, 8)), 1)
    freqs = rope_freqs(ids, tiny.params.axes_dim, tiny.params.theta)
    block = tiny.double_blocks[0]
    got = block(img, txt, vec, freqs, backends=DEFAULT_BACKENDS)
    ref = _reference_double_block(block, img, txt, vec, freqs)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_text_comes_first_in_joint_attention(tiny):
    """Image output must not change when image tokens are permuted together with their ids (RoPE is
    positional, attention is permutation-equivariant), but text tokens always precede image tokens."""
    inp = _inputs(tiny, batch=1)
    out = tiny(**inp)
    perm = torch.randperm(inp["img"].shape[1], generator=torch.Generator().manual_seed(0))
    out_p = tiny(**{**inp, "img": inp["img"][:, perm], "img_ids": inp["img_ids"][:, perm]})
    assert torch.allclose(out[:, perm], out_p, atol=1e-5)


def test_guidance_embedding_required_and_used():
    model = load_dit("dummy:flux-tiny-guidance", dtype=torch.float32, device="cpu")
    inp = _inputs(model)
    with pytest.raises(ValueError, match="guidance"):
        model(**inp)
    a = model(**inp, guidance=torch.tensor([1.0, 1.0]))
    b = model(**inp, guidance=torch.tensor([4.0, 4.0]))
    assert not torch.allclose(a, b)


def test_presets_match_official_configs():
    dev, schnell = PRESETS["flux.1-dev"], PRESETS["flux.1-schnell"]
    for p in (dev, schnell):
        assert (p.hidden_size, p.num_heads, p.depth, p.depth_single_blocks) == (3072, 24, 19, 38)
        assert (p.in_channels, p.vec_in_dim, p.context_in_dim, p.axes_dim) == (64, 768, 4096, (16, 56, 56))
        assert p.qkv_bias and p.mlp_ratio == 4.0 and p.theta == 10_000
    assert dev.guidance_embed and not schnell.guidance_embed


@pytest.mark.parametrize(
    ("preset", "count"), [("flux.1-dev", 11_901_408_320), ("flux.1-schnell", 11_891_178_560)]
)
def test_official_parameter_count_on_meta(preset, count):
    """Counts of the black-forest-labs reference model built with the same configs."""
    from fewstep.engine.models.flux import Flux

    with torch.device("meta"):
        model = Flux(PRESETS[preset])
    assert sum(p.numel() for p in model.parameters()) == count
