"""KV-cache quantization: error bounds of the int8/int4 layout, which frames the cache quantizes when, memory
accounting, generation quality against the unquantized cache, and bad input.

Error bound per element (``kernels/kv_quant.py``): ``|x - x_hat| <= scale / 2 + 2**-11 * (|min| + range)`` for
each (token, head) row, plus float32 slack. Generation quality, dummy:wan-tiny, 6 chunks, against the same stream
with an unquantized cache (PSNR = 10 log10(range(ref)^2 / MSE) of the latents): int8 >= 75 dB and int4 >= 50 dB
(measured 86-93 dB and 61-69 dB for the configurations below).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from fewstep.engine import InputError, load_dit
from fewstep.engine.backends import DEFAULT_BACKENDS
from fewstep.engine.causal import CausalConfig, KVCache, VideoSession, WindowSpec
from fewstep.engine.causal.kv_cache import KVStorage, check_kv_storage
from fewstep.engine.causal.reference import recompute_video
from fewstep.engine.rope import RopeFreqs
from fewstep.kernels import kv_quant

H, W = 32, 48  # px: 2x3 tokens per latent frame
PSNR_INT8, PSNR_INT4 = 75.0, 50.0


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The documented error bound of each element of ``x [..., D]`` given its row's float16 scale."""
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    return 0.5 * scale.float()[..., None] + 2**-11 * (lo.abs() + hi - lo) + 1e-6 * x.abs().amax()


def _roundtrip(x, bits):
    data, scale, zero = kv_quant.quantize_kv(x, bits)
    return kv_quant.dequantize_kv(data, scale, zero, bits, x.dtype), scale


# -- the layout and its error bounds ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,rms_limit", [(8, 0.008), (4, 0.12)])
def test_error_bound_on_random_data(bits, rms_limit):
    x = _rand(2, 64, 4, 128, seed=1)
    x_hat, scale = _roundtrip(x, bits)
    assert ((x - x_hat).abs() <= _bound(x, scale)).all()
    # N(0, 1) rows of 128 span ~5 sigma: int8 steps of ~0.02, int4 of ~0.33 (RMS error step / sqrt(12))
    assert (x - x_hat).pow(2).mean().sqrt() <= rms_limit


@pytest.mark.parametrize("bits", (8, 4))
def test_error_bound_on_structured_data(bits):
    x = _rand(1, 16, 4, 64, seed=2)
    x = x * torch.tensor([1e-3, 1.0, 30.0, 1e3]).view(1, 1, 4, 1)  # heads on very different scales
    x[0, 3, 1, 7] = 200.0  # an outlier: it widens its own row's range only
    x[0, 5, 2] = 0.0  # zero row
    x[0, 6, 0] = -3.25  # constant rows
    x[0, 7, 3] = 1234.5
    x[0, 8, 1] += 50.0  # a row far from zero: the zero point's float16 rounding shows
    x_hat, scale = _roundtrip(x, bits)
    assert ((x - x_hat).abs() <= _bound(x, scale)).all()
    relative = (x - x_hat).abs().amax(-1) / x.abs().amax(-1).clamp_min(1e-30)
    others = torch.ones_like(relative, dtype=torch.bool)
    others[0, 3, 1] = others[0, 8, 1] = False
    assert relative[others].max() <= (2 / 255 if bits == 8 else 2 / 15)  # each head at its own scale
    assert torch.equal(x_hat[0, 5, 2], torch.zeros(64))
    assert (x_hat[0, 6, 0] - -3.25).abs().max() == 0  # -3.25 is a float16
    assert (x_hat[0, 7, 3] - 1234.5).abs().max() <= 2**-11 * 1234.5
    assert (x_hat[0, 3, 1, 7] - 200.0).abs() <= 2**-10 * 200  # a row's max lands on the top code


def test_codes_and_packing_layout():
    grid = torch.arange(16.0).repeat(4).view(1, 1, 2, 32)  # min 0, max 15: int4 scale 1, codes = values
    data, scale, zero = kv_quant.quantize_kv(grid, 4)
    assert data.shape == (1, 1, 2, 16) and data.dtype == torch.uint8
    assert scale.dtype == zero.dtype == torch.float16 and scale.shape == (1, 1, 2)
    assert torch.equal(scale, torch.ones(1, 1, 2, dtype=torch.float16)) and torch.equal(
        zero.float(), torch.zeros(1, 1, 2)
    )
    even, odd = grid[..., 0::2].to(torch.uint8), grid[..., 1::2].to(torch.uint8)
    assert torch.equal(data, even | (odd << 4))  # element 2j in the low nibble, 2j+1 in the high one
    assert torch.equal(kv_quant.dequantize_kv(data, scale, zero, 4, torch.float32), grid)
    ramp = torch.arange(256.0).view(1, 1, 1, 256) - 100  # int8: scale 1, zero -100
    data, scale, zero = kv_quant.quantize_kv(ramp, 8)
    assert torch.equal(data.flatten(), torch.arange(256, dtype=torch.uint8)) and zero.item() == -100
    assert torch.equal(kv_quant.dequantize_kv(data, scale, zero, 8, torch.float32), ramp)
    assert kv_quant.group_bytes(128, 8) == 132 and kv_quant.group_bytes(128, 4) == 68
    with pytest.raises(ValueError, match="head_dim 7 is odd"):
        kv_quant.quantize_kv(torch.zeros(3, 7), 4)
    with pytest.raises(ValueError, match="8 or 4 bits"):
        kv_quant.quantize_kv(torch.zeros(3, 8), 2)


# -- the cache: which frames are quantized, and when -----------------------------------------------------------------
def _identity_rope(frames: torch.Tensor, grid_hw):
    shape = (1, frames.shape[0] * grid_hw[0] * grid_hw[1], 1, 4)
    return RopeFreqs(torch.ones(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64))


def _frame_kv(frame: int, tokens: int):
    """Distinct keys and values for each frame, ``[1, tokens, 2 heads, 8]``."""
    return _rand(1, tokens, 2, 8, seed=100 + frame) * (1 + frame), _rand(1, tokens, 2, 8, seed=500 + frame)


@pytest.mark.parametrize(
    "chunk,window,sinks,keep,bits",
    [(2, 8, 0, 1, 8), (2, 8, 0, 0, 4), (3, 12, 2, 1, 8), (1, 5, 1, 2, 4), (2, 7, 1, 1, 8), (2, 6, 2, 1, 4)],
)
def test_cache_reads_recent_frames_exactly_and_older_ones_dequantized(chunk, window, sinks, keep, bits):
    """Chunk by chunk: the chunk reads exactly the frames of its window; sinks, the chunk itself and the newest
    ``keep`` completed chunks as written, older frames as ``dequantize(quantize(x))``, each quantized once."""
    t = 2  # tokens per frame
    spec = WindowSpec(chunk, window, sinks)
    storage = KVStorage(spec, f"int{bits}", keep_recent_chunks=keep)
    cache = KVCache(1, 1, t, 2, 8, storage, torch.float32, "cpu", rope="absolute")
    quantized = []
    for start in range(0, 10 * chunk, chunk):
        cache.begin(start, chunk, (1, t), _identity_rope)
        kv = [_frame_kv(f, t) for f in range(start, start + chunk)]
        k, v = (torch.cat(parts, dim=1) for parts in zip(*kv))
        cache.layer(0).attend(torch.zeros(1, chunk * t, 2, 8), k, v, DEFAULT_BACKENDS)
        frames = cache.slots.read_frames()
        assert sorted(frames) == [f for f in range(start + chunk) if spec.visible(start, f)]
        keys, values = cache.layer(0).read()
        assert keys.shape == values.shape == (1, len(frames) * t, 2, 8)
        for i, f in enumerate(frames):
            k_f, v_f = _frame_kv(f, t)
            aged = f >= sinks and f < start - keep * chunk
            if aged:
                k_f, v_f = _roundtrip(k_f, bits)[0], _roundtrip(v_f, bits)[0]
            assert torch.equal(keys[:, i * t : (i + 1) * t], k_f), (start, f, aged)
            assert torch.equal(values[:, i * t : (i + 1) * t], v_f), (start, f, aged)
        cache.commit()
        quantized.append(cache.frames_quantized)
    # every non-sink frame that left the newest chunks while still in the window was quantized, once
    visible_aged = {
        f
        for start in range(0, 10 * chunk, chunk)
        for f in range(sinks, start - keep * chunk)
        if spec.visible(start, f)
    }
    assert quantized[-1] == len(visible_aged)


# -- memory ---------------------------------------------------------------------------------------------------------
def test_accounting_equals_allocation_and_memory_is_flat():
    spec = WindowSpec(3, 21, 0)
    sizes = {}
    for kv_dtype in ("bf16", "int8", "int4"):
        cache = KVCache(
            3, 2, 10, 4, 128, KVStorage(spec, kv_dtype, keep_recent_chunks=1), torch.bfloat16, "meta"
        )
        per_token = cache.bytes_per_token(), cache.quantized_bytes_per_token()
        full = (spec.sink_frames + cache.slots.full_ring) * 10 * 2  # tokens x batch
        quant = cache.slots.quant_ring * 10 * 2
        assert (
            cache.nbytes
            == sum(b.nbytes for b in cache.buffers())
            == full * per_token[0] + quant * per_token[1]
        )
        sizes[kv_dtype] = cache.nbytes
    assert (
        cache.bytes_per_token() == 2 * 4 * 128 * 3 * 2 and cache.quantized_bytes_per_token() == 2 * 4 * 68 * 3
    )
    # 6 of the 21 frames in bf16 (the chunk and one recent chunk), 15 quantized
    assert sizes["int8"] / sizes["bf16"] == pytest.approx((6 + 15 * 132 / 256) / 21)
    assert sizes["int4"] / sizes["bf16"] == pytest.approx((6 + 15 * 68 / 256) / 21)


@pytest.fixture(scope="module")
def wan():
    return load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=2)


def _ctx(seed=1):
    return _rand(1, 9, 4096, seed=seed)


def _video(model, config, chunks, seed=3):
    session = VideoSession(model, _ctx(), H, W, config, seed)
    results = session.run(chunks)
    return torch.cat([c.latents for c in results], dim=2), session, results


@pytest.mark.slow
def test_quantized_stream_memory_is_preallocated_flat_and_accounted(wan):
    config = CausalConfig(
        chunk_frames=2, window_frames=6, sink_frames=1, kv_dtype="int4", keep_recent_chunks=1
    )
    session = VideoSession(wan, _ctx(), H, W, config, seed=0)
    cache = session.cache
    pointers = [b.data_ptr() for b in cache.buffers()]
    full, quant = cache.bytes_per_token() * 6, cache.quantized_bytes_per_token() * 6  # per frame: 6 tokens
    assert cache.slots.full_ring == 4 and cache.slots.quant_ring == 1
    used = []
    for chunk in session.chunks(6):
        sink_copy = full // 2  # rope="cache": the sink's keys, unrotated (taken when chunk 1 begins)
        assert (
            chunk.kv_bytes
            == cache.nbytes
            == sum(b.nbytes for b in cache.buffers())
            == 5 * full + quant + sink_copy
        )
        used.append(chunk.kv_bytes_used)
    # frames 0 (sink) and 1..4 fill the full-precision slots; from chunk 2 on one aged frame is quantized
    assert used == [
        2 * full,
        4 * full + sink_copy,
        5 * full + quant + sink_copy,
        5 * full + quant + sink_copy,
        5 * full + quant + sink_copy,
        5 * full + quant + sink_copy,
    ]
    assert pointers == [b.data_ptr() for b in cache.buffers()]  # written in place


# -- generation -----------------------------------------------------------------------------------------------------
def _psnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    mse = (x - ref).pow(2).mean()
    return (10 * torch.log10((ref.max() - ref.min()) ** 2 / mse)).item()


@pytest.mark.parametrize(
    "window",
    [
        dict(chunk_frames=2, window_frames=8),
        dict(chunk_frames=2, window_frames=6, sink_frames=1),
        dict(chunk_frames=1, window_frames=6, sink_frames=1, rope="absolute"),
    ],
)
@pytest.mark.slow
def test_quantized_generation_stays_close_to_the_unquantized_one(wan, window):
    reference, full_session, _ = _video(wan, CausalConfig(**window), 6)
    psnr = {}
    for kv_dtype in ("int8", "int4"):
        video, session, _ = _video(wan, CausalConfig(**window, kv_dtype=kv_dtype, keep_recent_chunks=0), 6)
        assert session.cache.frames_quantized >= 3
        assert session.cache.nbytes < 0.7 * full_session.cache.nbytes
        psnr[kv_dtype] = _psnr(video, reference)
    assert psnr["int8"] >= PSNR_INT8 and psnr["int4"] >= PSNR_INT4, psnr
    assert psnr["int8"] >= psnr["int4"] + 10, psnr


@pytest.mark.parametrize("kv_dtype", ("int8", "int4"))
@pytest.mark.slow
def test_quantized_cache_is_exact_until_a_frame_ages_out(wan, kv_dtype):
    """With room for every chunk in full precision nothing is quantized: the no-cache reference still holds."""
    config = CausalConfig(chunk_frames=2, window_frames=8, kv_dtype=kv_dtype, keep_recent_chunks=3)
    video, session, _ = _video(wan, config, 4)
    assert session.cache.frames_quantized == 0
    assert torch.equal(video, _video(wan, CausalConfig(chunk_frames=2, window_frames=8), 4)[0])
    assert (video - recompute_video(wan, _ctx(), H, W, 4, config, seed=3)).abs().max() <= 1e-4


# -- bad input ------------------------------------------------------------------------------------------------------
def test_bad_kv_storage_settings(wan):
    def session(**kwargs):
        return VideoSession(
            wan, _ctx(), H, W, CausalConfig(chunk_frames=2, window_frames=6, **kwargs), where="test"
        )

    # checked once, when the config is built (the node or command that builds it locates the error)
    with pytest.raises(InputError, match=r"^input 'kv_dtype': unsupported KV storage 'fp8'; expected bf16"):
        session(kv_dtype="fp8")
    with pytest.raises(
        InputError,
        match=r"^input 'keep_recent_chunks': 3 recent chunks: the current chunk and the recent ones \(2 latent "
        r"frames each\) must fit the 5 frames of the window outside the sinks \(window 6 - sinks 1\), so 0 to 1",
    ):
        session(kv_dtype="int8", sink_frames=1, keep_recent_chunks=3)
    with pytest.raises(InputError, match=r"input 'keep_recent_chunks': -1 recent chunks"):
        session(kv_dtype="int4", keep_recent_chunks=-1)
    session(kv_dtype="bf16", keep_recent_chunks=3)  # unquantized: keep_recent_chunks is not used
    with pytest.raises(
        InputError,
        match=r"input 'kv_dtype': int4 packs two values per byte .* head_dim 7 is odd \(use int8 or bf16\)",
    ):
        check_kv_storage("int4", 0, WindowSpec(1, 3), head_dim=7)
    assert check_kv_storage("int8", 0, WindowSpec(1, 3), head_dim=7) == 8


# -- node and CLI ---------------------------------------------------------------------------------------------------
def _node(cls, **inputs):
    """Run a node with its declared defaults for the required inputs not given."""
    args = {}
    for name, entry in cls.INPUT_TYPES()["required"].items():
        kind, opts = entry[0], (entry[1] if len(entry) > 1 else {})
        args[name] = opts.get("default", kind[0] if isinstance(kind, list) else None)
    return getattr(cls(), cls.FUNCTION)(**{**args, **inputs})


def test_video_node_takes_the_kv_storage_inputs(pack):
    m = pack.NODE_CLASS_MAPPINGS
    sampler = m["FewStepCausalVideoSampler"]
    optional = sampler.INPUT_TYPES()["optional"]
    assert (
        optional["kv_dtype"][0] == ["bf16", "int8", "int4"]
        and optional["keep_recent_chunks"][1]["default"] == 1
    )
    assert all("tooltip" in optional[name][1] for name in ("kv_dtype", "keep_recent_chunks"))
    (wan,) = _node(m["FewStepDiTLoader"], model_name="dummy:wan-tiny")
    (cond,) = _node(m["FewStepSyntheticConditioning"], pooled_width=0)
    args = dict(model=wan, positive=cond, width=48, height=32, num_chunks=4, chunk_frames=1, window_frames=4,
                steps=2)  # fmt: skip
    latent, _, ref, report = _node(sampler, **args, kv_dtype="int8", keep_recent_chunks=0)
    assert latent["samples"].shape == (1, 16, 4, 4, 6) and "KV cache" in report
    live = sys.modules[f"{pack.__name__}.nodes.video"].SESSIONS.get(ref.key)
    assert live.cache.storage.kv_dtype == "int8" and live.cache.frames_quantized == 3
    with pytest.raises(
        ValueError, match=r"^FewStepCausalVideoSampler: input 'keep_recent_chunks': 4 recent chunks"
    ):
        _node(sampler, **args, kv_dtype="int4", keep_recent_chunks=4)


def test_stream_cli_reports_quantized_kv(capsys):
    from fewstep.cli import main

    common = ["stream", "--model", "wan-tiny", "--height", "32", "--width", "48", "--chunks", "4", "--chunk-frames",
              "1", "--window-frames", "4", "--steps", "1", "--json"]  # fmt: skip
    assert main([*common, "--kv-dtype", "int8", "--keep-recent-chunks", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (
        report["kv_dtype"] == "int8"
        and report["keep_recent_chunks"] == 0
        and report["kv_frames_quantized"] == 3
    )
    assert (
        report["kv_quantized_bytes_per_token"] == 2 * 2 * (32 + 4) * 2
    )  # K+V, 2 heads, codes + scales, 2 layers
    assert main(common) == 0
    full = json.loads(capsys.readouterr().out)
    assert report["kv_bytes_window"] < 0.6 * full["kv_bytes_window"]
    assert main([*common, "--kv-dtype", "int4", "--keep-recent-chunks", "4"]) == 2
    assert "fewstep stream: input '--keep-recent-chunks': 4 recent chunks" in capsys.readouterr().err
