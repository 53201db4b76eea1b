"""Head-major attention inputs (``engine.attention``): where q, k and v are made head-major in memory, and that
the layout changes no value (the same SDPA kernel on the same numbers)."""

from __future__ import annotations

import pytest
import torch

from fewstep.engine import attention
from fewstep.engine.attention import as_head_major, cat_tokens, gather_rows, local_attention, reads_head_major
from fewstep.engine.backends import Backends
from fewstep.engine.causal import CausalConfig, VideoSession
from fewstep.engine.loader import load_dit
from fewstep.kernels.rope import is_head_major


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def token_major_only(monkeypatch):
    """The layout before head-major inputs: nothing is made head-major, SDPA gets transposed views."""
    monkeypatch.setattr(attention, "SDPA_HEAD_MAJOR_DEVICES", frozenset())


def test_sdpa_on_the_cpu_reads_head_major_and_flash_attn_does_not():
    x = torch.empty(1, 4, 2, 8)
    assert reads_head_major("sdpa", x) and reads_head_major("auto", x)  # auto on the CPU is SDPA
    assert not reads_head_major("flash-attn", x)
    assert Backends().reads_head_major(x)
    assert not Backends(parallel=object()).reads_head_major(x)  # a parallel plan's exchange makes its own


def test_local_attention_is_the_same_for_every_input_layout():
    q, k, v = _rand(2, 7, 3, 16, seed=1), _rand(2, 11, 3, 16, seed=2), _rand(2, 11, 3, 16, seed=3)
    qkv_view = _rand(2, 11, 3, 3, 16, seed=4)[
        :, :, 2
    ]  # a projection's strided view, as FLUX's single blocks make
    mask = _rand(7, 11, seed=5) > -0.5
    ref = local_attention(q, k, v, mask=mask, backend="sdpa")
    out = local_attention(as_head_major(q), as_head_major(k), as_head_major(v), mask=mask, backend="sdpa")
    assert torch.equal(out, ref)
    strided = local_attention(q, k, qkv_view, backend="sdpa")
    assert torch.equal(strided, local_attention(q, k, qkv_view.contiguous(), backend="sdpa"))


def test_cat_tokens_writes_the_concatenation_head_major():
    parts = (_rand(1, 3, 2, 4, seed=6), _rand(1, 5, 2, 4, seed=7))
    out = cat_tokens(parts, head_major=True)
    assert is_head_major(out) and torch.equal(out, torch.cat(parts, dim=1))
    assert cat_tokens(parts, head_major=False).is_contiguous()


def test_as_head_major_keeps_shape_and_values():
    x = _rand(2, 5, 3, 4, seed=8)
    y = as_head_major(x)
    assert y.shape == x.shape and is_head_major(y) and torch.equal(x, y)
    assert as_head_major(y).data_ptr() == y.data_ptr()  # no copy when it already is


@pytest.mark.parametrize("preset", ["flux-tiny", "flux2-tiny", "zimage-tiny", "wan-tiny"])
def test_every_family_gives_the_same_output_in_both_layouts(preset, monkeypatch):
    from fewstep.engine.models import flux2, zimage
    from fewstep.engine.models.flux import random_inputs as flux_inputs

    model = load_dit(f"dummy:{preset}", torch.float32, "cpu")
    if preset == "wan-tiny":
        inputs = {"x": _rand(1, 16, 2, 8, 8, seed=9), "timestep": torch.tensor([500.0]),
                  "context": _rand(1, 12, model.params.text_dim, seed=10)}  # fmt: skip
    else:
        make = {
            "flux-tiny": flux_inputs,
            "flux2-tiny": flux2.random_inputs,
            "zimage-tiny": zimage.random_inputs,
        }
        inputs = make[preset](model.params, 64, 64, 8)
    with torch.inference_mode():
        new = model(**inputs)
        monkeypatch.setattr(attention, "SDPA_HEAD_MAJOR_DEVICES", frozenset())
        old = model(**inputs)
    assert torch.equal(new, old)


def _stream(model, ctx, chunks=4):
    cfg = CausalConfig(chunk_frames=2, window_frames=4)
    with torch.inference_mode():
        session = VideoSession(model, ctx, 32, 32, cfg, seed=0)
        out = [c.latents for c in session.chunks(chunks)]
        caches = session.cache
        session.dispose()
    return torch.cat(out, dim=2), caches


def test_the_causal_kv_cache_is_head_major_and_the_stream_unchanged(monkeypatch):
    model = load_dit("dummy:wan-tiny", torch.float32, "cpu")
    ctx = _rand(1, 12, model.params.text_dim, seed=11)
    new, cache = _stream(model, ctx)
    assert is_head_major(cache.k0) and is_head_major(cache.v0)  # every chunk reads the window contiguous
    monkeypatch.setattr(attention, "SDPA_HEAD_MAJOR_DEVICES", frozenset())
    old, old_cache = _stream(model, ctx)
    assert old_cache.k0.is_contiguous()
    assert torch.equal(new, old)


def test_gather_rows_writes_the_rows_head_major():
    x, index = _rand(4, 6, 2, 3, seed=12), torch.tensor([3, 1, 3])
    out = gather_rows(x, index, head_major=True)
    assert is_head_major(out) and torch.equal(out, x.index_select(0, index))
