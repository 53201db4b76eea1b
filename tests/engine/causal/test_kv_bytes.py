"""One KV-bytes formula (``engine.causal.kv_cache.kv_cache_bytes``), owned by the KV cache: what the planner, the
session's memory preflight and a pool session's size count is what a ``KVCache`` allocates (the sum of its
tensors' bytes), for every storage, sinks, keep-recent and RoPE setting."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fewstep.engine import open_model
from fewstep.engine.causal import CausalConfig, KVCache, WindowSpec
from fewstep.engine.causal.kv_cache import KVStorage, kv_cache_bytes
from fewstep.engine.causal.session import session_bytes
from fewstep.engine.parallel.client import RemoteVideoSession
from fewstep.engine.plan import plan_cost
from fewstep.engine.plan.flops import wan_tokens_per_frame
from fewstep.engine.rope import RopeFreqs

STORAGES = [
    ("bf16", torch.bfloat16),
    ("bf16", torch.float32),
    ("int8", torch.bfloat16),
    ("int4", torch.bfloat16),
]
LAYERS, BATCH, TOKENS, HEADS, HEAD_DIM = 2, 2, 6, 3, 8


def _allocated(cache: KVCache) -> int:
    return sum(t.nbytes for t in cache.buffers())


def _identity_rope(positions, grid_hw):
    shape = (1, positions.shape[0] * grid_hw[0] * grid_hw[1], 1, HEAD_DIM // 2)
    return RopeFreqs(torch.ones(shape), torch.zeros(shape))


@pytest.mark.parametrize("rope", ["cache", "absolute"])
@pytest.mark.parametrize("keep_recent", [0, 1, 2])
@pytest.mark.parametrize("sinks", [0, 1])
@pytest.mark.parametrize(
    ("kv_dtype", "dtype"), STORAGES, ids=[f"{k}-{d}".replace("torch.", "") for k, d in STORAGES]
)
def test_the_formula_equals_the_allocation_empty_and_full(kv_dtype, dtype, sinks, keep_recent, rope):
    spec = WindowSpec(2, 9, sinks)
    args = dict(
        layers=LAYERS, batch=BATCH, tokens_per_frame=TOKENS, heads=HEADS, head_dim=HEAD_DIM, window=spec,
        dtype=dtype, kv_dtype=kv_dtype, keep_recent_chunks=keep_recent, rope=rope,
    )  # fmt: skip
    planned = kv_cache_bytes(**args)
    storage = KVStorage(spec, kv_dtype, keep_recent)
    cache = KVCache(LAYERS, BATCH, TOKENS, HEADS, HEAD_DIM, storage, dtype, "cpu", rope=rope)
    assert planned.window == cache.nbytes == _allocated(cache)
    assert planned.per_token == BATCH * (cache.quantized_bytes_per_token() or cache.bytes_per_token())
    assert (
        planned.full_frames == spec.sink_frames + cache.slots.full_ring
        and planned.quantized_frames == cache.slots.quant_ring
    )
    # the fill counts with the same formula: once the window is full, every allocated byte is used
    used = []
    for start in range(0, 16, 2):
        cache.begin(start, 2, (2, 3), _identity_rope)
        used.append(cache.bytes_used())
        cache.commit()
    assert used == sorted(used) and used[0] > 0 and used[-1] == cache.nbytes


@pytest.mark.parametrize(("kv_dtype", "keep_recent"), [("bf16", 1), ("int8", 0), ("int8", 2), ("int4", 1)])
@pytest.mark.parametrize("sinks", [0, 1])
def test_the_planner_and_the_preflight_count_what_the_cache_allocates(kv_dtype, keep_recent, sinks):
    """plan_cost (bf16 compute, as on a GPU) and a session's preflight (its compute dtype) against the cache
    the session would build (wan-tiny, 32 x 48 px)."""
    handle = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32)
    p = handle.params
    tpf = wan_tokens_per_frame(p, 32, 48)
    config = CausalConfig(chunk_frames=2, window_frames=9, sink_frames=sinks, kv_dtype=kv_dtype,
                          keep_recent_chunks=keep_recent)  # fmt: skip
    plan = plan_cost(p, height=32, width=48, latent_frames=4, chunk_frames=2, window_frames=9, sink_frames=sinks,
                     batch=BATCH, kv_dtype=kv_dtype, keep_recent_chunks=keep_recent, vae=False)  # fmt: skip
    for dtype in (torch.bfloat16, torch.float32):
        cache = KVCache(p.num_layers, BATCH, tpf, p.num_heads, p.head_dim, config.storage, dtype, "meta")
        if dtype == torch.bfloat16:
            assert plan["kv_bytes_window"] == cache.nbytes == _allocated(cache)
        parts = session_bytes(p, BATCH, 32, 48, config, dtype, tpf, p.num_heads)
        assert parts["KV window"] == cache.nbytes == _allocated(cache)


def _stand_in_pool(degrees: tuple[int, int]):
    """What a RemoteVideoSession reads of its pool before any job (no worker is started)."""
    u, r = degrees
    return SimpleNamespace(
        config=SimpleNamespace(mode="sp", degrees=degrees), world=u * r, id="test", closed=False
    )


@pytest.mark.parametrize("degrees", [(1, 1), (2, 1)], ids=["one-rank", "ulysses-2"])
def test_a_pool_session_counts_what_its_ranks_allocate(degrees):
    """int8 + a sink (the old count read every frame as bf16 and missed the sinks' key copies): each rank's cache
    is its Ulysses part of the heads (and ring part of the tokens), and the session counts all ranks."""
    handle = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32)
    p = handle.params
    config = CausalConfig(
        chunk_frames=2, window_frames=9, sink_frames=1, kv_dtype="int8", keep_recent_chunks=1
    )
    context = torch.zeros(BATCH, 4, p.text_dim)
    session = RemoteVideoSession(_stand_in_pool(degrees), handle, context, 32, 48, config, degrees=degrees)
    u, r = degrees
    tpf = wan_tokens_per_frame(p, 32, 48)
    rank_cache = KVCache(p.num_layers, BATCH, tpf // r, p.num_heads // u, p.head_dim, config.storage, torch.float32,
                         "meta")  # fmt: skip
    whole = kv_cache_bytes(
        p.num_layers, BATCH, tpf, p.num_heads, p.head_dim, config.window, torch.float32, "int8", 1
    )
    assert session.nbytes == u * r * _allocated(rank_cache) == whole.window
    assert session.cache.bytes_per_token() == rank_cache.bytes_per_token()
