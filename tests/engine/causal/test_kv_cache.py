"""The causal KV cache's static shapes: the tensors a chunk step reads are the same objects and shapes for every
chunk, a step reads nothing back to the host, ``.to()`` converts every view of the storage, and one denoising
step compiles as one graph that no chunk past the window recompiles."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fewstep.engine import load_dit
from fewstep.engine.backends import DEFAULT_BACKENDS
from fewstep.engine.causal import CausalConfig, CrossAttentionCache, KVCache, VideoSession, WindowSpec
from fewstep.engine.causal.kv_cache import KVStorage
from fewstep.engine.compile import CompileWatch, compile_model
from fewstep.engine.errors import InputError
from fewstep.engine.rope import RopeFreqs, apply_rope, rope_freqs

H, W = 32, 48  # px: 2x3 tokens per frame


def _identity_rope(positions, grid_hw):
    shape = (1, positions.shape[0] * grid_hw[0] * grid_hw[1], 1, 4)
    return RopeFreqs(torch.ones(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64))


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _layouts(cache: KVCache) -> list[tuple]:
    """(data_ptr, shape) of every tensor a chunk step reads or writes."""
    q_rope = cache.query_rope()
    view = cache.layer(0)
    tensors = [view.keys, view.values, cache.write_index, cache.key_visible, q_rope.cos, q_rope.sin]
    tensors += list(view.quant[0].parts()) if view.quant is not None else []
    return [(t.data_ptr(), tuple(t.shape)) for t in tensors]


@pytest.mark.parametrize("rope", ["cache", "absolute"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_every_chunk_reads_the_same_tensors_before_and_after_the_window_fills(rope, kv_dtype):
    spec = WindowSpec(2, 7, 1)
    t = 6
    cache = KVCache(1, 1, t, 2, 8, KVStorage(spec, kv_dtype), torch.float32, "cpu", rope=rope)
    layouts, reads, masked = [], [], []
    for start in range(0, 20, 2):
        cache.begin(start, 2, (2, 3), _identity_rope)
        view = cache.layer(0)
        view.attend(_rand(1, 2 * t, 2, 8, seed=start), _rand(1, 2 * t, 2, 8, seed=start + 1),
                    _rand(1, 2 * t, 2, 8, seed=start + 2), DEFAULT_BACKENDS)  # fmt: skip
        layouts.append(_layouts(cache))
        reads.append(tuple(view.read_window()[0].shape))
        masked.append(cache.key_mask() is not None)
        cache.commit()
    assert all(layout == layouts[0] for layout in layouts)
    assert set(reads) == {(1, 7 * t, 2, 8)}  # the whole window, every chunk
    # empty slots are hidden until the window fills (frames 0-6), then nothing is: no mask at all
    assert masked == [True, True, True] + [False] * 7


class _HostSyncs(TorchDispatchMode):
    """Records the operators that copy a device value to the host (.item(), .tolist(), bool(tensor))."""

    def __init__(self):
        super().__init__()
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            self.syncs.append(func)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def wan():
    return load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=2)


def _session(wan, config):
    ctx = torch.randn(1, 9, 4096, generator=torch.Generator().manual_seed(1))
    return VideoSession(wan, ctx, H, W, config, seed=3)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_a_chunk_step_reads_nothing_back_to_the_host(wan, kv_dtype):
    config = CausalConfig(chunk_frames=2, window_frames=6, sink_frames=1, kv_dtype=kv_dtype)
    session = _session(wan, config)
    session.run(4)  # past the window
    cache = session.cache
    x = torch.randn(1, 16, 2, 4, 6)
    with torch.inference_mode():
        session._velocity(x, 500.0, cache.frames_committed)  # begin: host bookkeeping, then copies to tensors
        with _HostSyncs() as mode:
            session._velocity(x, 250.0, cache.frames_committed)  # a second step of the chunk
    assert mode.syncs == []
    assert isinstance(cache.write_index, torch.Tensor) and isinstance(cache.key_visible, torch.Tensor)


def test_to_converts_the_storage_every_view_reads():
    """``cache.to(torch.float64)`` used to convert the registered buffers but not the lists aliasing them."""
    cache = KVCache(2, 1, 6, 2, 8, KVStorage(WindowSpec(2, 6, 0), "int8"), torch.float32, "cpu")
    cache.to(torch.float64)
    views = [cache.layer(i) for i in range(2)]
    assert [t.dtype for view in views for t in (view.keys, view.values)] == [torch.float64] * 4
    assert views[1].keys is cache.k1 and views[0].values is cache.v0
    assert views[0].quant[0].data is cache.kq0 and views[0].quant[0].data.dtype == torch.uint8
    cache.begin(0, 2, (2, 3), _identity_rope)
    k = _rand(1, 12, 2, 8, seed=4).double()
    cache.layer(1).attend(torch.zeros(1, 12, 2, 8, dtype=torch.float64), k, k, DEFAULT_BACKENDS)
    assert torch.equal(cache.layer(1).read()[0], k)  # written into, and read from, the converted buffer
    assert cache.write_index.dtype == torch.long  # bookkeeping keeps its integer dtype


def test_one_denoising_step_compiles_whole_and_never_recompiles_past_the_window(wan):
    """12 chunks through a 6-frame window (full from the third chunk on), the step compiled whole with fullgraph=True (a
    graph break raises): the masked step and the unmasked one are two entry points, compiled once each, counted
    from dynamo; no recompile, and once the window is full no chunk compiles anything."""
    torch._dynamo.reset()
    config = CausalConfig(chunk_frames=2, window_frames=6, sink_frames=1)
    session = _session(wan, config)
    step = compile_model(wan, "full", backend="eager", fullgraph=True)
    by_chunk, breaks = [], {}
    with torch.inference_mode():
        for chunk in range(12):
            start = chunk * 2
            cache = session.cache
            cache.begin(start, 2, session.grid_hw, wan.frame_rope)
            x = torch.randn(1, 16, 2, 4, 6, generator=torch.Generator().manual_seed(chunk))
            t = torch.full((1, 2), 500.0)
            kwargs = dict(context_embedded=session._context, kv=cache, cross_kv=session.cross)
            watch = CompileWatch().start()
            out = step(x, t, **kwargs)
            watch.stop()
            expected = wan(x, t, **kwargs)  # eager, same cache state (the step rewrites the same slots)
            assert (out - expected).abs().max() <= 1e-5
            by_chunk.append([(f.name, f.recompile_reason) for f in watch.frames])
            breaks.update(watch.graph_breaks)
            cache.commit()
    # chunk 0 compiles the masked step, chunk 2 (frames 4-5: the window full) the unmasked one; nothing else
    assert by_chunk == [[("causal_step_filling", None)], [], [("causal_step_full", None)]] + [[]] * 9
    assert breaks == {}


def test_the_cross_attention_cache_is_filled_with_the_prompt_never_in_a_step(wan):
    config = CausalConfig(chunk_frames=2, window_frames=6, sink_frames=1)
    session = _session(wan, config)
    cross = session.cross
    first = cross.capture_state()
    assert len(first) == len(wan.blocks) and cross.nbytes > 0  # filled when the session set its prompt
    session.run(1)
    assert cross.capture_state() == first  # a step only reads it
    before = [k.clone() for k, _ in (cross.layer(i) for i in range(len(wan.blocks)))]
    session.set_prompt(torch.randn(1, 5, 4096, generator=torch.Generator().manual_seed(7)))
    # a new prompt is copied into the same tensors (a captured step replays it), which now hold its keys
    assert cross.capture_state() == first
    assert all(not torch.equal(old, cross.layer(i)[0]) for i, old in enumerate(before))
    empty = CrossAttentionCache()
    assert empty.nbytes == 0 and empty.capture_state() == ()
    with pytest.raises(InputError, match=r"input 'cross_kv': .* fill\(\) it with the prompt before a step"):
        empty.layer(0)
    cross.reset()
    assert cross.nbytes == 0


def _frame_rope(positions, grid_hw):
    """A one-axis RoPE over the frame index (every token of a frame rotated alike), float64 angles."""
    ids = positions.repeat_interleave(grid_hw[0] * grid_hw[1]).view(1, -1, 1)
    return rope_freqs(ids, (8,), 10.0, angle_dtype=torch.float64)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_keys_are_rotated_once_when_written_and_the_sinks_follow_the_window(kv_dtype):
    """rope="cache": the window is read as stored (the buffer itself, no copy, no rotation). Non-sink keys stay
    rotated at their absolute frame index; sink keys sit at ``s + o`` for the chunk's offset ``o``, rewritten from
    the unrotated copies, so a sink's key is the same rotation of the same numbers however long the stream."""
    spec, t = WindowSpec(2, 7, 1), 6
    cache = KVCache(1, 1, t, 2, 8, KVStorage(spec, kv_dtype), torch.float32, "cpu", rope="cache")
    written: dict[int, torch.Tensor] = {}
    checked = {"full": 0, "quantized": 0}
    for start in range(0, 20, 2):
        cache.begin(start, 2, (2, 3), _frame_rope)
        view = cache.layer(0)
        k = _rand(1, 2 * t, 2, 8, seed=start + 1)
        view.attend(
            _rand(1, 2 * t, 2, 8, seed=start), k, _rand(1, 2 * t, 2, 8, seed=start + 2), DEFAULT_BACKENDS
        )
        written.update({start: k[:, :t], start + 1: k[:, t:]})
        stored = view.read_window()[0]
        if kv_dtype == "bf16":
            assert stored.data_ptr() == view.keys.data_ptr()
        offset = spec.cache_offset(start)
        slots = cache.slots
        for frame in slots.read_frames():
            at = frame + offset if frame < spec.sink_frames else frame
            expected = apply_rope(written[frame], _frame_rope(torch.tensor([at]), (2, 3)))
            if frame in slots.full:  # full precision: the rotation of the written key
                slot = slots.slot_of(frame)
                got = view.keys[:, slot * t : (slot + 1) * t]
                torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
                checked["full"] += 1
            else:  # aged out: quantized after it was rotated, read back within the int8 step
                slot = spec.sink_frames + slots.full_ring + slots.quant_slot_of(frame)
                assert (stored[:, slot * t : (slot + 1) * t] - expected).abs().max() < 0.05
                checked["quantized"] += 1
        cache.commit()
    assert checked["full"] > 0 and (checked["quantized"] > 0) == (kv_dtype == "int8")
    assert cache.sinks.offset == spec.cache_offset(18) > 0
