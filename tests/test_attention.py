"""The attention entry point: SDPA equals written-out softmax attention; backend selection and errors."""

from __future__ import annotations

import math

import pytest
import torch

from fewstep.engine import InputError, attention, use_attention_backend
from fewstep.engine.attention import current_backend


def _reference(q, k, v, mask=None):
    scores = torch.einsum("blhd,bmhd->bhlm", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhlm,bmhd->blhd", scores.softmax(-1), v)


def test_sdpa_matches_reference_and_layout():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 3, 16, generator=g) for n in (5, 7, 7))
    out = attention(q, k, v)
    assert out.shape == (2, 5, 3, 16)
    assert torch.allclose(out, _reference(q, k, v), atol=1e-6)


def test_boolean_mask_means_may_attend():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 2, 8, generator=g) for _ in range(3))
    mask = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    assert torch.allclose(attention(q, k, v, mask=mask), _reference(q, k, v, mask), atol=1e-6)


def test_backend_is_a_scoped_setting():
    assert current_backend() == "auto"
    with use_attention_backend("sdpa"):
        assert current_backend() == "sdpa"
    assert current_backend() == "auto"
    with (
        pytest.raises(InputError, match="unknown attention backend 'xformers'"),
        use_attention_backend("xformers"),
    ):
        pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error path")
def test_flash_attn_on_cpu_is_a_clear_error():
    with (
        pytest.raises(InputError, match="flash-attn was requested but is not usable here"),
        use_attention_backend("flash-attn"),
    ):
        pass
