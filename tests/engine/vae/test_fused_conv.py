"""The tiny VAEs' fused convolutions (``engine.vae.fused_conv``): bit for bit the plain modules, and used only
where they apply."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fewstep.engine.vae import fused_conv, load_tiny_vae
from fewstep.engine.vae.taehv import MemBlock
from fewstep.engine.vae.taesd import Block


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def plain(monkeypatch):
    """Switch the fusion off: the plain modules (conv, then ReLU, then the add), as before it."""

    def off():
        monkeypatch.setattr(fused_conv, "_fusable", lambda conv, x: False)

    return off


def _conv(n_in, n_out, seed, **kwargs):
    torch.manual_seed(seed)
    return (
        nn.Conv2d(n_in, n_out, 3, padding=1, **kwargs)
        .to(memory_format=torch.channels_last)
        .requires_grad_(False)
    )


def test_the_fused_op_is_available_and_checked_on_this_cpu():
    assert fused_conv.fused_available()


@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format])
@pytest.mark.parametrize("stride,bias", [(1, True), (2, False)])
@pytest.mark.parametrize("shape", [(2, 64, 13, 10), (1, 64, 24, 20), (1, 64, 16, 16)])
def test_conv_relu_and_conv_add_relu_equal_the_plain_modules(layout, stride, bias, shape):
    """Bit for bit, at sizes where PyTorch's convolution is oneDNN (batch > 1, or more than 20480 elements) and
    where it is not (64 x 16 x 16: the plain modules run)."""
    conv = _conv(64, 64, 1, stride=stride, bias=bias)
    x = _rand(*shape, seed=2).contiguous(memory_format=layout)
    with torch.no_grad():
        ref = torch.relu(conv(x))
        out = fused_conv.conv_relu(conv, x)
        assert out.shape == ref.shape and torch.equal(out, ref)
        residual = _rand(*ref.shape, seed=3)
        assert torch.equal(fused_conv.conv_add_relu(conv, x, residual), torch.relu(conv(x) + residual))


def test_the_fused_add_runs_where_it_applies_and_not_elsewhere(monkeypatch):
    assert fused_conv.fused_available()  # its one-time check done before counting calls
    calls = []
    real = fused_conv._pointwise

    def spy():
        calls.append(1)
        return real()

    monkeypatch.setattr(fused_conv, "_pointwise", spy)
    conv, x = _conv(4, 4, 4), _rand(1, 4, 80, 80, seed=5)
    residual = _rand(1, 4, 80, 80, seed=6)
    with torch.no_grad():
        fused_conv.conv_add_relu(conv, x, residual)
        assert calls == [1]
        small = x[:, :, :8, :8]  # small: PyTorch's own kernel, so the plain modules
        fused_conv.conv_add_relu(conv, small, residual[:, :, :8, :8])
        fused_conv.conv_add_relu(
            conv.to(torch.bfloat16), x.bfloat16(), residual.bfloat16()
        )  # not checked: plain
        with FlopCounterMode(display=False) as flops:  # a dispatch mode sees the plain ops, and counts them
            fused_conv.conv_add_relu(conv.float(), x, residual)
    assert calls == [1] and flops.get_total_flops() == 2 * 4 * 4 * 9 * 80 * 80
    trainable = _conv(4, 4, 6).requires_grad_(True)
    with torch.enable_grad():  # (the test session runs under no_grad)
        out = fused_conv.conv_add_relu(
            trainable, x, residual
        )  # autograd: the plain modules, which have a backward
        out.sum().backward()
    assert calls == [1] and trainable.weight.grad is not None


def test_nan_and_infinity_propagate_as_in_the_plain_modules():
    """oneDNN's ReLU post-op would map NaN to 0 (a broken latent decoded into a plausible image); the ReLU stays
    PyTorch's, so a NaN reaches the output, where the callers refuse it."""
    conv = _conv(64, 64, 7)
    x = _rand(1, 64, 24, 24, seed=8)
    x[0, 3, 5, 5] = float("nan")
    x[0, 9, 7, 7] = float("inf")
    residual = _rand(1, 64, 24, 24, seed=9)
    with torch.no_grad():
        for out, ref in (
            (fused_conv.conv_relu(conv, x), torch.relu(conv(x))),
            (fused_conv.conv_add_relu(conv, x, residual), torch.relu(conv(x) + residual)),
        ):
            assert torch.equal(out.isnan(), ref.isnan()) and out.isnan().any()
            assert torch.equal(out.nan_to_num(), ref.nan_to_num())


@pytest.mark.parametrize("pooled", [False, True])
def test_a_tiny_vae_block_is_unchanged(pooled, plain):
    block = Block(8, 8, pooled).to(memory_format=torch.channels_last).requires_grad_(False)
    x = _rand(1, 8, 64, 48, seed=7).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        fused = block(x)
        plain()
        assert torch.equal(fused, block(x))


def test_a_taehv_memory_block_is_unchanged(plain):
    block = MemBlock(8).to(memory_format=torch.channels_last).requires_grad_(False)
    x, previous = _rand(2, 8, 16, 16, seed=8), _rand(2, 8, 16, 16, seed=9)
    with torch.no_grad():
        fused = block(x, previous)
        plain()
        assert torch.equal(fused, block(x, previous))


@pytest.mark.parametrize("variant,channels", [("taef1", 16), ("taef2", 32)])
def test_whole_tiny_decodes_are_unchanged(variant, channels, plain):
    vae = load_tiny_vae(f"dummy:{variant}", device="cpu", dtype=torch.float32)
    z = _rand(1, channels, 12, 16, seed=10)
    fused = vae.decode(z)
    plain()
    assert torch.equal(fused, vae.decode(z))
