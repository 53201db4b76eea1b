"""Wan's RoPE in float32 against the official float64 rotation.

The official Wan code rotates in complex128: per axis a table ``torch.polar(1, position * theta ** (-2i / d))``
in float64, the keys viewed as complex128 pairs and multiplied by it. The engine computes the same angles and
their cos / sin in float64, rounds the tables to float32 once, and rotates in float32. Its error is one float32
rounding of the table and of the products: about ``2 ** -24`` relative, independent of the position, because the
float64 angles are reduced before anything is rounded (float32 angles would lose ``10_000 * 2 ** -24`` radians
at frame 10,000 on their own).
"""

from __future__ import annotations

import torch

from fewstep.engine.models.wan import PRESETS, Wan
from fewstep.engine.rope import apply_rope
from fewstep.kernels import rope as rope_kernels

# Measured on the positions below (frames up to 10,000, rows / columns up to 64) with unit-normal keys, seeds
# 0-4: 3.3e-7 to 4.6e-7 (x86 CPU). For scale: rounding the float64 rotation's output to float32 (what the old
# float64 path returned) is 2.4e-7 away; float32 angles would be 1.0e-3 away. The bound is ~2x the measured.
MAX_ABS_DIFF_VS_FLOAT64 = 1e-6


def official_rotation(x: torch.Tensor, frames, rows, cols, axes_dim, theta) -> torch.Tensor:
    """The reference's float64 / complex128 rotation of ``x [1, F*H*W, heads, D]`` over a frame x row x column
    grid with the given positions (written from its formulas: complex tables per axis, gathered per token)."""
    tables = []
    for positions, d in zip((frames, rows, cols), axes_dim, strict=True):
        inv = 1.0 / torch.pow(theta, torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = torch.outer(positions.to(torch.float64), inv)
        tables.append(torch.polar(torch.ones_like(angles), angles))
    f, h, w = len(frames), len(rows), len(cols)
    per_token = torch.cat(
        (
            tables[0].view(f, 1, 1, -1).expand(f, h, w, -1),
            tables[1].view(1, h, 1, -1).expand(f, h, w, -1),
            tables[2].view(1, 1, w, -1).expand(f, h, w, -1),
        ),
        dim=-1,
    ).reshape(1, f * h * w, 1, -1)
    pairs = torch.view_as_complex(x.to(torch.float64).unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * per_token).flatten(-2)


def test_float32_wan_rope_is_within_float32_rounding_of_the_float64_rotation():
    p = PRESETS["wan2.1-1.3b"]
    model = Wan.__new__(Wan)  # frame_rope reads only the params: no 1.3B weights to build
    model.params = p
    frames = torch.tensor([0, 1, 2, 997, 4_095, 9_998, 9_999, 10_000])
    rows = cols = torch.tensor([0, 1, 7, 31, 32, 63, 64])
    # frame_rope's rows / columns are 0..h-1: build the grid up to 64 and pick the sampled positions from it
    full = model.frame_rope(frames, (65, 65))
    grid = (torch.arange(len(frames))[:, None, None] * 65 + rows[None, :, None]) * 65 + cols[None, None, :]
    cos, sin = full.cos[:, grid.flatten()], full.sin[:, grid.flatten()]
    assert cos.dtype == torch.float32 and cos.shape == (1, len(frames) * 49, 1, p.head_dim // 2)
    x = torch.randn(1, cos.shape[1], p.num_heads, p.head_dim, generator=torch.Generator().manual_seed(0))
    ours = rope_kernels.apply_rope(x, cos, sin)
    official = official_rotation(x, frames, rows, cols, p.axes_dim, p.theta)
    diff = (ours.double() - official).abs().max().item()
    assert ours.dtype == torch.float32
    assert diff <= MAX_ABS_DIFF_VS_FLOAT64, diff


def test_rotation_equals_the_real_halves_formulation_bit_for_bit_at_wan_shapes():
    """The complex-multiply rotation (kernels.rope) against cos/sin products on the two halves, float32."""
    gen = torch.Generator().manual_seed(1)
    for tokens in (2304, 1560):
        x = torch.randn(1, tokens, 12, 128, generator=gen)
        angles = 100 * torch.rand(1, tokens, 1, 64, generator=gen, dtype=torch.float64)
        cos, sin = angles.cos().float(), angles.sin().float()
        x0, x1 = x[..., 0::2], x[..., 1::2]
        expected = torch.stack((cos * x0 - sin * x1, sin * x0 + cos * x1), dim=-1).flatten(-2)
        assert torch.equal(rope_kernels.apply_rope(x, cos, sin), expected)
        bf16 = x.bfloat16()
        expected_bf16 = torch.stack(
            (cos * bf16[..., 0::2] - sin * bf16[..., 1::2], sin * bf16[..., 0::2] + cos * bf16[..., 1::2]), -1
        )
        assert torch.equal(rope_kernels.apply_rope(bf16, cos, sin), expected_bf16.flatten(-2).bfloat16())


def test_wan_tables_are_float32_and_shared_by_heads():
    model = Wan(PRESETS["wan-tiny"])
    freqs = model.rope((2, 3, 4), start_frame=5_000)
    assert freqs.cos.dtype == freqs.sin.dtype == torch.float32
    assert freqs.cos.shape == (1, 24, 1, PRESETS["wan-tiny"].head_dim // 2)
    x = torch.randn(1, 24, 2, PRESETS["wan-tiny"].head_dim, dtype=torch.bfloat16)
    assert apply_rope(x, freqs).dtype == torch.bfloat16
