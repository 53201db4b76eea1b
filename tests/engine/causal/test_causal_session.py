"""Causal chunk-by-chunk video: the KV cache against a no-cache reference, memory, sessions, bad input.

Causal video hardening (issue 15): bounded session memory, Cancel within one forward, one caller per
session, non-finite outputs and conditioning, memory preflight, sessions freed with a compiled model, tolerant
FEWSTEP_* settings, and stream-batch statistics that do not grow with the stream."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import types
import weakref
from collections import deque

import pytest
import torch
from conftest import ROOT, fake_comfy_memory_manager, make_cond
from test_nodes import _run

from fewstep.engine import InputError, load_dit, load_tiny_vae
from fewstep.engine.causal import CausalConfig, KVCache, SessionStore, VideoSession, WindowSpec
from fewstep.engine.causal.kv_cache import KVStorage, kv_cache_bytes
from fewstep.engine.causal.reference import recompute_video

H, W = 32, 48  # px: a 4x6 latent, 2x3 tokens per frame


@pytest.fixture(scope="module")
def wan():
    return load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=2)


def _ctx(seed=1, tokens=9):
    return torch.randn(1, tokens, 4096, generator=torch.Generator().manual_seed(seed))


def _video(model, config, chunks, seed=3, context=None):
    session = VideoSession(model, _ctx() if context is None else context, H, W, config, seed)
    return torch.cat([c.latents for c in session.run(chunks)], dim=2), session


@pytest.mark.parametrize(
    "config",
    [
        CausalConfig(chunk_frames=2, window_frames=8),  # the window covers the whole video
        CausalConfig(chunk_frames=2, window_frames=8, rope="absolute"),
        CausalConfig(chunk_frames=3, window_frames=12, steps=2),
        CausalConfig(chunk_frames=2, window_frames=5, sink_frames=1, rope="absolute"),  # sinks + eviction
        CausalConfig(chunk_frames=2, window_frames=6, sink_frames=2, rope="absolute"),
        CausalConfig(chunk_frames=2, window_frames=4),  # eviction without sinks: relative positions are exact
        CausalConfig(chunk_frames=1, window_frames=3, sink_frames=1, rope="absolute"),
        # cache-relative RoPE with sinks: the reference rotates every key anew per chunk at its cache position
        CausalConfig(chunk_frames=2, window_frames=5, sink_frames=1),
        CausalConfig(chunk_frames=2, window_frames=6, sink_frames=2),
        CausalConfig(chunk_frames=1, window_frames=3, sink_frames=1),
        CausalConfig(chunk_frames=3, window_frames=7, sink_frames=4, steps=2),  # sinks span two chunks
    ],
)
def test_cached_generation_equals_the_no_cache_reference(wan, config):
    chunks = 8 // config.chunk_frames if config.chunk_frames != 3 else 3
    cached, _ = _video(wan, config, chunks)
    reference = recompute_video(wan, _ctx(), H, W, chunks, config, seed=3)
    assert cached.shape == reference.shape
    assert (cached - reference).abs().max() <= 1e-4


def test_cache_positions_stay_bounded_with_sinks(wan):
    """Relative RoPE with sinks: identical to absolute positions until the first eviction, bounded afterwards."""
    rel = CausalConfig(chunk_frames=2, window_frames=5, sink_frames=1, rope="cache")
    ab = CausalConfig(chunk_frames=2, window_frames=5, sink_frames=1, rope="absolute")
    a, session = _video(wan, rel, 6)
    b, _ = _video(wan, ab, 6)
    assert torch.allclose(a[:, :, :4], b[:, :, :4], atol=1e-5)  # frames 0-3: nothing evicted yet
    assert not torch.allclose(a[:, :, 6:], b[:, :, 6:], atol=1e-3)  # the sink's distance is kept short
    cache = session.cache
    start = cache.frames_committed
    positions = [rel.window.cache_position(f, start) for f in range(start - 2, start + 2)]
    assert max(positions) < rel.window_frames


def _kv_pointers(cache: KVCache) -> list[int]:
    views = [cache.layer(i) for i in range(cache.layers)]
    return [t.data_ptr() for view in views for t in (view.keys, view.values)]


def test_kv_memory_is_preallocated_flat_and_accounted(wan):
    config = CausalConfig(chunk_frames=2, window_frames=6, sink_frames=2)
    session = VideoSession(wan, _ctx(), H, W, config, seed=0)
    pointers = _kv_pointers(session.cache)
    p, tokens = wan.params, 6  # 2x3 tokens per latent frame
    per_token = 2 * p.dim * p.num_layers * 4  # K and V, every layer, fp32, no GQA
    assert session.cache.bytes_per_token() == per_token
    used = []
    # rope="cache" with sinks: the window's K/V plus an unrotated copy of the sinks' keys (half a K/V token each)
    total = (config.window_frames * per_token + config.sink_frames * per_token // 2) * tokens
    for chunk in session.chunks(8):
        assert chunk.kv_bytes == session.cache.nbytes == total
        used.append(chunk.kv_bytes_used)
    # the sinks' copies are taken when the chunk after them begins
    assert used == [2 * tokens * per_token, 5 * tokens * per_token] + [7 * tokens * per_token] * 6
    assert pointers == _kv_pointers(session.cache)  # written in place


def test_continued_session_equals_one_long_generation(wan):
    config = CausalConfig(chunk_frames=2, window_frames=4, sink_frames=1)
    whole, _ = _video(wan, config, 5)
    session = VideoSession(wan, _ctx(), H, W, config, seed=3)
    parts = (
        [c.latents for c in session.run(2)]
        + [c.latents for c in session.run(1)]
        + [c.latents for c in session.run(2)]
    )
    assert torch.allclose(torch.cat(parts, dim=2), whole, atol=1e-6)


def test_prompt_switch_changes_only_what_follows(wan):
    config = CausalConfig(chunk_frames=2, window_frames=8)
    same, _ = _video(wan, config, 4)
    session = VideoSession(wan, _ctx(), H, W, config, seed=3)
    first = [c.latents for c in session.run(2)]
    session.set_prompt(_ctx(seed=99, tokens=5))
    after = [c.latents for c in session.run(2)]
    switched = torch.cat(first + after, dim=2)
    assert torch.allclose(switched[:, :, :4], same[:, :, :4], atol=1e-6)
    assert not torch.allclose(switched[:, :, 4:], same[:, :, 4:], atol=1e-3)


def test_bidirectional_single_chunk_equals_causal_chunk(wan):
    x = torch.randn(1, 16, 3, 4, 6, generator=torch.Generator().manual_seed(4))
    ctx = _ctx()
    t = torch.full((1, 3), 750.0)
    bidirectional = wan(x, t, ctx)
    cache = KVCache(
        wan.params.num_layers,
        1,
        6,
        wan.params.num_heads,
        wan.params.head_dim,
        KVStorage(WindowSpec(3, 6)),
        torch.float32,
        "cpu",
    )
    cache.begin(0, 3, (2, 3), wan.frame_rope)
    causal = wan(x, t, ctx, kv=cache)
    assert torch.allclose(bidirectional, causal, atol=1e-5)


def test_streamed_frames_equal_decoding_the_whole_video(wan):
    vae = load_tiny_vae("dummy:taew2_1", device="cpu", dtype=torch.float32)
    session = VideoSession(
        wan, _ctx(), H, W, CausalConfig(chunk_frames=2, window_frames=6), seed=0, tiny_vae=vae
    )
    results = session.run(3)
    streamed = torch.cat([r.frames for r in results], dim=1)
    raw = torch.cat([r.raw for r in results], dim=2)
    whole = vae.decode(vae.raw_to_latent(raw))
    assert streamed.shape == whole.shape == (1, 4 * 6 - 3, 3, H, W)
    assert (streamed - whole).abs().max() <= 1e-5
    assert session.stats.first_chunk_seconds == results[0].seconds > 0


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (
            dict(chunk_frames=3, window_frames=2),
            r"input 'window_frames': the window \(2 latent frames\) is smaller than a chunk \(3\)",
        ),
        (
            dict(chunk_frames=2, window_frames=4, sink_frames=4),
            r"input 'sink_frames': 4 sink frames do not fit a window of 4",
        ),
        (
            dict(chunk_frames=3, window_frames=4, sink_frames=2),
            r"input 'window_frames': the window \(4\) must hold the 2 sink frames and a chunk of 3",
        ),
    ],
)
def test_bad_windows(wan, kwargs, pattern):
    with pytest.raises(InputError, match=pattern):
        VideoSession(wan, _ctx(), H, W, CausalConfig(**kwargs), where="test")


def test_bad_sizes_conditioning_and_vae(wan):
    with pytest.raises(InputError, match=r"input 'height': 40 px is not a positive multiple of 16"):
        VideoSession(wan, _ctx(), 40, W)
    with pytest.raises(
        InputError, match=r"input 'context': conditioning is \[1, 9, 768\]; Wan expects umT5 tokens"
    ):
        VideoSession(wan, torch.zeros(1, 9, 768), H, W)
    with pytest.raises(
        InputError,
        match=r"input 'tiny_vae': taef1 \(FLUX.1, Z-Image, HiDream\) decodes 16-channel image latents",
    ):
        VideoSession(wan, _ctx(), H, W, tiny_vae=load_tiny_vae("dummy:taef1"))
    # taehv has 16 channels too, but HunyuanVideo's latent space: refused, not decoded into wrong colours
    with pytest.raises(InputError, match=r"input 'tiny_vae': taehv \(HunyuanVideo\) decodes 16-channel video "
                       r"latents; this Wan 2.1 model makes 16-channel Wan 2.1 video latents \(use taew2_1 or "
                       r"lighttaew2_1\)"):  # fmt: skip
        VideoSession(wan, _ctx(), H, W, tiny_vae=load_tiny_vae("dummy:taehv"))
    VideoSession(wan, _ctx(), H, W, tiny_vae=load_tiny_vae("dummy:lighttaew2_1")).dispose()


def test_disposed_and_evicted_sessions(wan):
    store = SessionStore(max_sessions=2)
    keys = [
        store.add(VideoSession(wan, _ctx(), H, W, CausalConfig(chunk_frames=2, window_frames=4)))
        for _ in range(3)
    ]
    with pytest.raises(InputError, match=f"input 'session': {keys[0]} is no longer available: .*evicted"):
        store.get(keys[0], "FewStepCausalContinue")
    live = store.get(keys[1])
    store.dispose(keys[1])
    assert live.disposed
    with pytest.raises(InputError, match="disposed"):
        list(live.chunks(1))
    one_session_bytes = store.get(keys[2]).nbytes
    small = SessionStore(max_sessions=10, max_bytes=int(1.5 * one_session_bytes))
    a = small.add(VideoSession(wan, _ctx(), H, W, CausalConfig(chunk_frames=2, window_frames=4)))
    small.add(VideoSession(wan, _ctx(), H, W, CausalConfig(chunk_frames=2, window_frames=4)))
    assert len(small) == 1 and pytest.raises(InputError, small.get, a)


CONFIG = CausalConfig(chunk_frames=2, window_frames=4, sink_frames=1)


def _held(root) -> tuple[int, int]:
    """(tensor bytes, container bytes) reachable from ``root`` through containers and dataclasses."""
    seen, stack, tensor_bytes, other_bytes = set(), [root], 0, 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensor_bytes += obj.nbytes
            continue
        if isinstance(obj, (list, tuple, deque, set, dict)):
            other_bytes += sys.getsizeof(obj)  # what grows with a stream: its containers
        if isinstance(obj, (list, tuple, deque, set, dict)) or hasattr(obj, "__dataclass_fields__"):
            stack.extend(gc.get_referents(obj))
    return tensor_bytes, other_bytes


def _count_forwards(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls, handle


# -- 1. memory stays flat ----------------------------------------------------------------------------------------
def test_session_statistics_hold_no_tensors_and_do_not_grow(wan):
    vae = load_tiny_vae("dummy:taew2_1", device="cpu", dtype=torch.float32)
    session = VideoSession(wan, _ctx(), 16, 16, CausalConfig(chunk_frames=1, window_frames=2), tiny_vae=vae)
    for _ in session.chunks(3):
        pass
    early = _held(session.stats)
    for _ in session.chunks(80):
        pass
    late = _held(session.stats)
    assert late[0] == early[0] == 0  # no latents, no frames
    assert late[1] <= 16 * 2**10  # bounded timings of the last chunks
    assert session.stats.chunks_generated == 83 and session.stats.first_chunk_seconds > 0


# -- 5. Cancel within one forward --------------------------------------------------------------------------------
def test_a_hook_that_raises_stops_within_one_forward_and_the_session_continues_unchanged(wan):
    class StopError(Exception):
        pass

    seen = []

    def stop_at_sixth(chunk, step):
        seen.append((chunk, step))
        if len(seen) == 6:
            raise StopError

    calls, handle = _count_forwards(wan)
    try:
        session = VideoSession(wan, _ctx(), H, W, CONFIG, seed=3)
        with pytest.raises(StopError):
            for _ in session.chunks(3, before_forward=stop_at_sixth):
                pass
        assert len(calls) == 5  # four steps of chunk 0, then chunk 1's clean-context pass for chunk 0
    finally:
        handle.remove()
    assert seen == [(0, 0), (0, 1), (0, 2), (0, 3), (1, None), (1, 0)]
    # the interrupted chunk left the session consistent: continuing gives the uninterrupted video
    rest = [c.latents for c in session.chunks(2)]
    whole = VideoSession(wan, _ctx(), H, W, CONFIG, seed=3)
    expected = [c.latents for c in whole.chunks(3)]
    assert torch.allclose(torch.cat(rest, dim=2), torch.cat(expected[1:], dim=2), atol=1e-6)


def test_the_video_node_checks_cancel_before_every_forward(pack, wan, monkeypatch):
    class InterruptError(Exception):  # stands for ComfyUI's InterruptProcessingException
        pass

    checks = []

    def throw():
        checks.append(1)
        if len(checks) == 2:
            raise InterruptError

    m = pack.NODE_CLASS_MAPPINGS
    (handle,) = _run(m["FewStepDiTLoader"], model_name="dummy:wan-tiny")
    (cond,) = _run(m["FewStepSyntheticConditioning"], pooled_width=0)
    mm = types.SimpleNamespace(throw_exception_if_processing_interrupted=throw)
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    calls, hook = _count_forwards(handle.model)
    try:
        with pytest.raises(InterruptError):
            _run(m["FewStepCausalVideoSampler"], model=handle, positive=cond, width=48, height=32, num_chunks=3,
                 chunk_frames=2, window_frames=4)  # fmt: skip
    finally:
        hook.remove()
    assert len(calls) == 1  # Cancel before the second forward: one forward ran


# -- 6. one caller at a time -------------------------------------------------------------------------------------
def test_a_second_thread_gets_a_clear_error_and_the_first_one_is_not_corrupted(wan):
    inside, release = threading.Event(), threading.Event()
    results, errors = {}, []

    def hold(chunk, step):
        if chunk == 1 and step == 0:
            inside.set()
            release.wait(30)

    session = VideoSession(wan, _ctx(), H, W, CONFIG, seed=3)

    def first():
        results["first"] = [c.latents for c in session.chunks(2, before_forward=hold)]

    def second():
        try:
            list(session.chunks(1))
        except InputError as err:
            errors.append(str(err))

    a = threading.Thread(target=first)
    a.start()
    assert inside.wait(30)
    b = threading.Thread(target=second)
    b.start()
    b.join(30)
    with pytest.raises(InputError, match="input 'session': .* used by one caller at a time"):
        session.set_prompt(_ctx(seed=7))
    release.set()
    a.join(30)
    assert len(errors) == 1 and "used by one caller at a time" in errors[0]
    expected = [c.latents for c in VideoSession(wan, _ctx(), H, W, CONFIG, seed=3).chunks(2)]
    assert torch.equal(torch.cat(results["first"], dim=2), torch.cat(expected, dim=2))
    assert len(list(session.chunks(1))) == 1  # free again once the first caller is done


def test_disposing_a_session_while_it_generates_frees_it_when_the_chunk_ends(wan):
    session = VideoSession(wan, _ctx(), H, W, CONFIG, seed=3)

    def dispose_midway(chunk, step):
        if chunk == 0 and step == 2:
            session.dispose()

    with pytest.raises(InputError, match="input 'session': this session was disposed"):
        list(session.chunks(2, before_forward=dispose_midway))
    assert session.disposed and session.cache is None and session.nbytes == 0


# -- 7. non-finite values ----------------------------------------------------------------------------------------
def test_nan_conditioning_is_refused(wan):
    bad = _ctx()
    bad[0, 3, 5] = float("nan")
    with pytest.raises(InputError, match=r"^test: input 'context': .*NaN or infinite"):
        VideoSession(wan, bad, H, W, CONFIG, where="test")
    session = VideoSession(wan, _ctx(), H, W, CONFIG)
    with pytest.raises(InputError, match=r"input 'context': .*NaN or infinite"):
        session.set_prompt(torch.full((1, 4, 4096), float("inf")))


def test_non_finite_latents_and_frames_name_the_chunk_and_step():
    broken = load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=2)
    session = VideoSession(broken, _ctx(), H, W, CONFIG, seed=3, where="test")
    list(session.chunks(1))
    with torch.no_grad():
        broken.head.head.weight.fill_(float("nan"))
    with pytest.raises(
        InputError,
        match=r"^test: input 'model': chunk 1 \(latent frames 2-3\): the denoised latents hold NaN or infinite "
        r"values, first after denoising step 1 of 4",
    ):
        list(session.chunks(1))
    wan = load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=2)
    vae = load_tiny_vae("dummy:taew2_1", device="cpu", dtype=torch.float32)
    with torch.no_grad():
        next(vae.decoder.parameters()).fill_(float("inf"))
    session = VideoSession(wan, _ctx(), H, W, CONFIG, seed=3, tiny_vae=vae, where="test")
    with pytest.raises(
        InputError,
        match=r"^test: input 'tiny_vae': chunk 0 \(latent frames 0-1\): the decoded frames hold NaN",
    ):
        list(session.chunks(1))


# -- 8. preflight ------------------------------------------------------------------------------------------------
def test_a_window_that_cannot_fit_is_refused_before_allocating(wan, monkeypatch):
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", "0.001")
    with pytest.raises(
        InputError,
        match=r"^test: input 'window_frames': this needs about .* \(KV window .*\) but only .* of available host "
        r"memory can be used on cpu; refused before allocating",
    ):
        VideoSession(wan, _ctx(), H, W, CausalConfig(chunk_frames=2, window_frames=2000), where="test")


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4"])
def test_the_kv_estimate_is_what_the_cache_allocates(wan, kv_dtype):
    window = WindowSpec(2, 9, 1)
    args = dict(layers=2, batch=2, tokens_per_frame=6, heads=2, head_dim=32, window=window, dtype=torch.float32,
                kv_dtype=kv_dtype, keep_recent_chunks=1)  # fmt: skip
    cache = KVCache(2, 2, 6, 2, 32, KVStorage(window, kv_dtype, 1), torch.float32, "cpu")
    assert kv_cache_bytes(**args).window == cache.nbytes


def test_the_node_refuses_outputs_that_cannot_fit(pack, monkeypatch):
    def stop():  # the old code generated chunk after chunk: stop it at the first one
        raise RuntimeError("ran without a preflight")

    m = pack.NODE_CLASS_MAPPINGS
    (handle,) = _run(m["FewStepDiTLoader"], model_name="dummy:wan-tiny")
    (cond,) = _run(m["FewStepSyntheticConditioning"], pooled_width=0)
    (tiny,) = _run(m["FewStepTinyVAELoader"], vae_name="dummy:taew2_1")
    monkeypatch.setitem(
        sys.modules,
        "comfy.model_management",
        types.SimpleNamespace(throw_exception_if_processing_interrupted=stop),
    )
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", "0.05")
    with pytest.raises(
        ValueError,
        match=r"^FewStepCausalVideoSampler: input 'num_chunks': this needs about .*outputs of 10000 chunks .*"
        r"refused before allocating",
    ):
        _run(m["FewStepCausalVideoSampler"], model=handle, positive=cond, width=64, height=64, num_chunks=10000,
             chunk_frames=2, window_frames=4, tiny_vae=tiny)  # fmt: skip


# -- 1. prompt history -------------------------------------------------------------------------------------------
def test_prompt_history_is_bounded_and_a_rebuild_past_it_says_why(pack):
    video = sys.modules[f"{pack.__name__}.nodes.video"]
    m = pack.NODE_CLASS_MAPPINGS
    (handle,) = _run(m["FewStepDiTLoader"], model_name="dummy:wan-tiny")
    (cond,) = _run(m["FewStepSyntheticConditioning"], pooled_width=0, tokens=64)
    out = _run(m["FewStepCausalVideoSampler"], model=handle, positive=cond, width=48, height=32, num_chunks=1,
               chunk_frames=1, window_frames=2, steps=1)  # fmt: skip
    prompt_bytes = cond[0][0].nbytes
    refs = [out[2]]
    for i in range(30):
        (new,) = _run(m["FewStepSyntheticConditioning"], pooled_width=0, tokens=64, seed=100 + i)
        refs.append(_run(m["FewStepCausalContinue"], session=refs[-1], num_chunks=1, positive=new)[2])
    held, _ = _held(refs[-1].recipe)
    assert held <= video.MAX_PROMPTS * prompt_bytes
    # an alternating pair of prompts is kept once each: rebuilds stay possible
    (other,) = _run(m["FewStepSyntheticConditioning"], pooled_width=0, tokens=64, seed=5)
    ref = out[2]
    for i in range(2 * video.MAX_PROMPTS):
        prompt = other if i % 2 else cond
        ref = _run(m["FewStepCausalContinue"], session=ref, num_chunks=1, positive=prompt)[2]
    assert _held(ref.recipe)[0] <= 2 * prompt_bytes
    _run(m["FewStepCausalContinue"], session=ref, num_chunks=1)
    _run(m["FewStepCausalContinue"], session=ref, num_chunks=1)  # stale: rebuilt
    # past the bound a stale reference cannot be rebuilt, and says so
    _run(m["FewStepCausalContinue"], session=refs[-1], num_chunks=1)
    with pytest.raises(
        ValueError,
        match=r"^FewStepCausalContinue: input 'session': .* cannot be rebuilt: .*FEWSTEP_MAX_PROMPTS",
    ):
        _run(m["FewStepCausalContinue"], session=refs[-1], num_chunks=1)


# -- 2. compiled model's sessions freed on unload ----------------------------------------------------------------
def test_sessions_of_a_compiled_model_are_freed_when_comfyui_unloads_it(pack, monkeypatch):
    callbacks = fake_comfy_memory_manager(monkeypatch)
    m = pack.NODE_CLASS_MAPPINGS
    (handle,) = _run(m["FewStepDiTLoader"], model_name="dummy:wan-tiny")
    (cond,) = _run(m["FewStepSyntheticConditioning"], pooled_width=0)
    (compiled,) = _run(
        m["FewStepCompile"], model=handle, compile="off", cuda_graph="whole", allow_fallback=True
    )
    out = _run(m["FewStepCausalVideoSampler"], model=compiled, positive=cond, width=48, height=32, num_chunks=1,
               chunk_frames=2, window_frames=4)  # fmt: skip
    store = sys.modules[f"{pack.__name__}.nodes.video"].SESSIONS
    assert store.alive(out[2].key)
    (on_detach,) = callbacks[("on_detach_after", "fewstep-sessions")]
    on_detach(handle.host, True)  # free memory
    assert not store.alive(out[2].key)


# -- 3. default byte bound ---------------------------------------------------------------------------------------
def test_the_session_store_has_a_default_byte_bound_from_device_memory(wan, monkeypatch):
    from fewstep.engine.causal.store import DEFAULT_SESSION_FRACTION

    def started():
        session = VideoSession(wan, _ctx(), H, W, CONFIG)
        list(session.chunks(1))  # the cross-attention cache is filled by the first forward
        return session

    # both made before the limit is set: a session's own preflight counts more than its caches (the prompt's
    # padding, a chunk's activations) and, under the limit, what the pack already holds
    one, two = started(), started()
    # a budget of 3 sessions' bytes: the default bound (a fraction of it) holds one session, not two
    limit = 3 * one.nbytes
    assert DEFAULT_SESSION_FRACTION * limit < 2 * one.nbytes
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", str(limit / 2**30))
    store = SessionStore(max_sessions=10)
    first = store.add(one)
    store.add(two)
    assert len(store) == 1 and not store.alive(first)
    assert store.max_bytes == int(DEFAULT_SESSION_FRACTION * limit)


# -- 4. tolerant settings ----------------------------------------------------------------------------------------
def test_bad_settings_do_not_stop_the_pack_from_importing():
    env = {"FEWSTEP_MAX_SESSIONS": "abc", "FEWSTEP_SESSION_GB": "x", "FEWSTEP_KERNELS": "bogus", "PATH": ""}
    code = (
        "import fewstep.nodes.video as v; from fewstep.engine.run import environment_kernel_mode; "
        "print(v.SESSIONS.max_sessions, v.SESSIONS.explicit_max_bytes, environment_kernel_mode())"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["4", "None", "auto"]
    for line in ("FEWSTEP_MAX_SESSIONS='abc'", "FEWSTEP_SESSION_GB='x'", "FEWSTEP_KERNELS='bogus'"):
        assert line in r.stderr


# -- 1. the stream CLI drops each chunk once written ----------------------------------------------------------------
@pytest.mark.slow
def test_the_stream_cli_keeps_no_chunk_after_handling_it(tmp_path, monkeypatch):
    from fewstep.cli import stream as stream_cli

    alive_at_yield = []
    original = VideoSession.chunks

    def watched(self, n, **kwargs):
        refs = []
        for chunk in original(self, n, **kwargs):
            gc.collect()
            alive_at_yield.append(sum(r() is not None for r in refs))
            refs += [weakref.ref(chunk.latents), weakref.ref(chunk.frames)]
            yield chunk

    monkeypatch.setattr(VideoSession, "chunks", watched)
    parser = __import__("argparse").ArgumentParser()
    stream_cli.add_arguments(parser)
    for out in (None, str(tmp_path)):
        alive_at_yield.clear()
        args = parser.parse_args(["--height", "32", "--width", "48", "--chunks", "5", "--chunk-frames", "2",
                                  "--window-frames", "4", "--tiny-vae", "dummy:taew2_1", "--json"]
                                 + (["--out", out] if out else []))  # fmt: skip
        assert stream_cli.run(args) == 0
        assert alive_at_yield == [0] * 5


def test_the_stream_cli_writes_the_same_file_chunk_by_chunk(tmp_path, wan):
    from safetensors.torch import load_file

    from fewstep.cli import stream as stream_cli

    parser = __import__("argparse").ArgumentParser()
    stream_cli.add_arguments(parser)
    args = parser.parse_args(["--height", "32", "--width", "48", "--chunks", "3", "--chunk-frames", "2",
                              "--window-frames", "4", "--tiny-vae", "dummy:taew2_1", "--json", "--out",
                              str(tmp_path)])  # fmt: skip
    assert stream_cli.run(args) == 0
    saved = load_file(str(tmp_path / "latents.safetensors"))
    model = load_dit("dummy:wan-tiny", device="cpu", dtype=torch.float32)
    vae = load_tiny_vae("dummy:taew2_1", device="cpu")
    context = torch.randn(1, 64, 4096, generator=torch.Generator().manual_seed(1))
    session = VideoSession(model, context, 32, 48, CausalConfig(chunk_frames=2, window_frames=4), 0, vae)
    chunks = session.run(3)
    assert torch.equal(saved["latent"], torch.cat([c.raw for c in chunks], dim=2))
    assert torch.equal(saved["frames"], torch.cat([c.frames for c in chunks], dim=1))


# -- 10. stream batch statistics -----------------------------------------------------------------------------------
def test_stream_batch_statistics_do_not_grow_with_the_stream(tiny_handle):
    from fewstep.engine.stream_batch import StreamBatch, StreamConfig

    taef1 = load_tiny_vae("dummy:taef1", device="cpu", dtype=torch.float32)
    config = StreamConfig(t_index_list=(20,), similarity_threshold=0.5, max_skip_frames=3)
    stream = StreamBatch(
        tiny_handle, taef1, make_cond(tiny_handle.params), height=16, width=16, config=config
    )
    frame = torch.full((3, 16, 16), 0.3)
    sizes = []
    for n in (40, 120):  # pushes: each processed one is followed by 3 skipped ones
        while stream.stats.groups_in < n:
            stream.push(frame)
        sizes.append(_held(stream.stats)[1])
    assert stream.stats.groups_skipped == 90 and stream.stats.forwards == 30
    assert sizes[1] == sizes[0]
    assert "90 of 120 frames skipped" in stream.summary()
