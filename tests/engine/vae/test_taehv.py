"""TAEHV (temporal tiny autoencoder): layout, frame counts, streaming decode, detection.

Dummy weights, tiny latents (4x6), CPU fp32. Set FEWSTEP_TAEHV_DIR to a folder holding taew2_1.pth,
taew2_2.pth and/or taehv.pth to also check the published weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fewstep.engine.errors import InputError
from fewstep.engine.vae.taehv import (
    TAEHV,
    TAEHV_CONFIGS,
    MemBlock,
    TAEHVConfig,
    TAEHVStreamDecoder,
    TGrow,
    TPool,
    detect_taehv,
)
from fewstep.engine.weights import dummy_init_, read_state_dict

LATENT_H, LATENT_W = 4, 6


@pytest.fixture(scope="module", params=["taew2_1", "taew2_2"])
def model(request) -> TAEHV:
    taehv = TAEHV(TAEHV_CONFIGS[request.param]).eval()
    dummy_init_(taehv, seed=3)
    return taehv


def random_latents(taehv: TAEHV, frames: int, batch: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, frames, taehv.latent_channels, LATENT_H, LATENT_W, generator=g)


def random_frames(taehv: TAEHV, frames: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    s = taehv.spatial_scale
    g = torch.Generator().manual_seed(seed)
    return torch.rand(batch, frames, 3, LATENT_H * s, LATENT_W * s, generator=g)


# -- an independent reference: one frame at a time through the blocks, as the original's sequential mode ----------


def _run_one_frame(blocks, x, start, memory, pooled, emit):
    for i in range(start, len(blocks)):
        block = blocks[i]
        if isinstance(block, MemBlock):
            previous = memory.get(i, torch.zeros_like(x))
            memory[i] = x
            x = block(x, previous)
        elif isinstance(block, TPool):
            pooled.setdefault(i, []).append(x)
            if len(pooled[i]) < block.stride:
                return
            x = block.conv(torch.cat(pooled.pop(i), 1))
        elif isinstance(block, TGrow):
            for part in block.conv(x).chunk(block.stride, 1):
                _run_one_frame(blocks, part, i + 1, memory, pooled, emit)
            return
        else:
            x = block(x)
    emit(x)


def reference_apply(blocks, x: torch.Tensor) -> torch.Tensor:
    memory, pooled, out = {}, {}, []
    for frame in x.unbind(1):
        _run_one_frame(blocks, frame, 0, memory, pooled, out.append)
    return torch.stack(out, 1)


def reference_decode(taehv: TAEHV, latents: torch.Tensor) -> torch.Tensor:
    frames = reference_apply(taehv.decoder, latents)
    if taehv.patch_size > 1:
        frames = F.pixel_shuffle(frames, taehv.patch_size)
    return frames.clamp(0, 1)[:, taehv.frames_to_trim :]


def reference_encode(taehv: TAEHV, frames: torch.Tensor) -> torch.Tensor:
    if taehv.patch_size > 1:
        frames = F.pixel_unshuffle(frames, taehv.patch_size)
    pad = -frames.shape[1] % 4
    frames = torch.cat([frames] + [frames[:, -1:]] * pad, 1)
    return reference_apply(taehv.encoder, frames)


# -- layout ---------------------------------------------------------------------------------------------------------

# Keys and shapes of the published files (madebyollin/taehv), as data.
COMMON_LAYOUT = {
    "encoder.2.conv.weight": (64, 128, 1, 1),  # TPool, stride 2
    "encoder.3.weight": (64, 64, 3, 3),
    "encoder.4.conv.0.weight": (64, 128, 3, 3),
    "encoder.12.conv.weight": (64, 64, 1, 1),  # TPool, stride 1
    "encoder.16.conv.4.bias": (64,),
    "decoder.3.conv.0.weight": (256, 512, 3, 3),
    "decoder.5.conv.4.weight": (256, 256, 3, 3),
    "decoder.7.conv.weight": (256, 256, 1, 1),  # TGrow, stride 1
    "decoder.8.weight": (128, 256, 3, 3),
    "decoder.9.conv.0.weight": (128, 256, 3, 3),
    "decoder.13.conv.weight": (256, 128, 1, 1),  # TGrow, stride 2
    "decoder.14.weight": (64, 128, 3, 3),
    "decoder.19.conv.weight": (128, 64, 1, 1),
    "decoder.20.weight": (64, 64, 3, 3),
}
VARIANT_LAYOUT = {
    "taew2_1": {
        "encoder.0.weight": (64, 3, 3, 3),
        "encoder.17.weight": (16, 64, 3, 3),
        "decoder.1.weight": (256, 16, 3, 3),
        "decoder.22.weight": (3, 64, 3, 3),
        "decoder.22.bias": (3,),
    },
    "taew2_2": {
        "encoder.0.weight": (64, 12, 3, 3),
        "encoder.17.weight": (48, 64, 3, 3),
        "decoder.1.weight": (256, 48, 3, 3),
        "decoder.22.weight": (12, 64, 3, 3),
        "decoder.22.bias": (12,),
    },
}
VARIANT_LAYOUT["taehv"] = VARIANT_LAYOUT["lighttaew2_1"] = VARIANT_LAYOUT["taew2_1"]
BIASLESS = [
    "encoder.3.bias",
    "encoder.8.bias",
    "encoder.13.bias",
    "decoder.8.bias",
    "decoder.14.bias",
    "decoder.20.bias",
]


@pytest.mark.parametrize("name", list(TAEHV_CONFIGS))
def test_layout_matches_published_files(name):
    sd = TAEHV(TAEHV_CONFIGS[name]).state_dict()
    assert len(sd) == 128
    for key, shape in {**COMMON_LAYOUT, **VARIANT_LAYOUT[name]}.items():
        assert tuple(sd[key].shape) == shape, key
    assert not any(key in sd for key in BIASLESS)
    assert all(k.startswith(("encoder.", "decoder.")) for k in sd)


def test_scales():
    for name, config in TAEHV_CONFIGS.items():
        taehv = TAEHV(config)
        assert (taehv.t_downscale, taehv.t_upscale, taehv.frames_to_trim) == (4, 4, 3), name
        assert taehv.spatial_scale == (16 if name == "taew2_2" else 8)


# -- decode / encode ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("frames", [1, 2, 5])
def test_decode_frame_count_and_range(model, frames):
    latents = random_latents(model, frames)
    out = model.decode_video(latents)
    s = model.spatial_scale
    assert out.shape == (2, 4 * frames - 3, 3, LATENT_H * s, LATENT_W * s)
    assert out.min() >= 0 and out.max() <= 1
    assert out.std() > 0.01  # dummy weights still give a non-trivial picture


def test_decode_matches_frame_by_frame_reference(model):
    latents = random_latents(model, 4)
    torch.testing.assert_close(
        model.decode_video(latents), reference_decode(model, latents), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize(("frames", "latent_frames"), [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_encode_shape(model, frames, latent_frames):
    latents = model.encode_video(random_frames(model, frames))
    assert latents.shape == (1, latent_frames, model.latent_channels, LATENT_H, LATENT_W)


def test_encode_pads_by_repeating_last_frame(model):
    frames = random_frames(model, 6)
    padded = torch.cat([frames, frames[:, -1:], frames[:, -1:]], 1)
    torch.testing.assert_close(model.encode_video(frames), model.encode_video(padded), atol=0, rtol=0)


def test_encode_matches_frame_by_frame_reference_and_is_causal(model):
    frames = random_frames(model, 7, batch=2)
    latents = model.encode_video(frames)
    torch.testing.assert_close(latents, reference_encode(model, frames), atol=1e-5, rtol=0)
    torch.testing.assert_close(model.encode_video(frames[:, :4]), latents[:, :1], atol=1e-5, rtol=0)


def test_bad_inputs_name_the_input(model):
    with pytest.raises(InputError, match="input 'latents'.*channel"):
        model.decode_video(torch.zeros(1, 2, model.latent_channels + 1, 4, 4))
    with pytest.raises(InputError, match="input 'latents'"):
        model.decode_video(torch.zeros(1, model.latent_channels, 4, 4))
    with pytest.raises(InputError, match="input 'latents'.*at least one frame"):
        model.decode_video(torch.zeros(1, 0, model.latent_channels, 4, 4))
    with pytest.raises(InputError, match="input 'frames'.*divisible by"):
        model.encode_video(torch.zeros(1, 1, 3, model.spatial_scale + 4, model.spatial_scale))
    with pytest.raises(InputError, match="input 'frames'.*RGB"):
        model.encode_video(torch.zeros(1, 1, 4, 32, 32))


# -- streaming ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [[1] * 6, [2, 2, 2], [3, 3], [3, 1, 2], [1, 5], [6]])
def test_stream_equals_whole_video(model, chunks):
    latents = random_latents(model, sum(chunks))
    whole = model.decode_video(latents)
    stream = TAEHVStreamDecoder(model)
    pieces = []
    for i, chunk in enumerate(latents.split(chunks, 1)):
        piece = stream.push(chunk)
        assert piece.shape[1] == 4 * chunk.shape[1] - (3 if i == 0 else 0)
        pieces.append(piece)
    assert stream.frames_decoded == whole.shape[1] == 4 * sum(chunks) - 3
    assert (torch.cat(pieces, 1) - whole).abs().max() <= 1e-5


def test_stream_reset_and_independence(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    a, b = random_latents(model, 3, seed=1), random_latents(model, 3, seed=2)
    stream_a, stream_b = TAEHVStreamDecoder(model), TAEHVStreamDecoder(model)
    out_a, out_b = [], []
    for chunk_a, chunk_b in zip(a.unbind(1), b.unbind(1)):  # interleaved: no state may live on the model
        out_a.append(stream_a.push(chunk_a.unsqueeze(1)))
        out_b.append(stream_b.push(chunk_b.unsqueeze(1)))
    torch.testing.assert_close(torch.cat(out_a, 1), model.decode_video(a), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(out_b, 1), model.decode_video(b), atol=1e-5, rtol=0)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key

    stream_a.reset()
    assert stream_a.frames_decoded == 0 and stream_a.memory is None
    torch.testing.assert_close(stream_a.push(b), model.decode_video(b), atol=1e-5, rtol=0)


def test_stream_memory_is_one_frame_per_memblock(model):
    stream = TAEHVStreamDecoder(model)
    stream.push(random_latents(model, 2))
    memblocks = [m for m in model.decoder if isinstance(m, MemBlock)]
    assert len(stream.memory) == len(memblocks) == 9
    assert all(t.ndim == 4 and t.shape[0] == 2 for t in stream.memory)


def test_stream_empty_chunk_and_mismatch(model):
    stream = TAEHVStreamDecoder(model)
    empty = stream.push(random_latents(model, 0))
    s = model.spatial_scale
    assert empty.shape == (2, 0, 3, LATENT_H * s, LATENT_W * s) and stream.memory is None
    stream.push(random_latents(model, 1))
    with pytest.raises(InputError, match="input 'latents'.*reset"):
        stream.push(random_latents(model, 1, batch=1))


# -- detection ----------------------------------------------------------------------------------------------------


def test_detect_each_variant():
    wan21_layout = ["taew2_1", "lighttaew2_1", "taehv"]  # the same tensors: the file name breaks the tie
    expected = {
        "taew2_1": wan21_layout,
        "lighttaew2_1": wan21_layout,
        "taew2_2": ["taew2_2"],
        "taehv": wan21_layout,
    }
    for name, config in TAEHV_CONFIGS.items():
        with torch.device("meta"):
            sd = TAEHV(config).state_dict()
        assert detect_taehv(sd) == expected[name], name


def test_detect_rejects_other_state_dicts():
    with torch.device("meta"):
        sd = TAEHV(TAEHV_CONFIGS["taew2_1"]).state_dict()
    assert detect_taehv({"0.weight": torch.zeros(64, 3, 3, 3), "1.weight": torch.zeros(64, 64, 3, 3)}) == []
    assert detect_taehv({}) == []
    assert detect_taehv({k: v for k, v in sd.items() if k != "decoder.22.bias"}) == []
    with torch.device("meta"):  # a TAEHV for another latent space (HunyuanVideo 1.5's: 32 channels, patch 2)
        other = TAEHV(TAEHVConfig("other", latent_channels=32, patch_size=2)).state_dict()
    assert detect_taehv(other) == []


# -- the published weights (optional) -----------------------------------------------------------------------------

WEIGHTS_DIR = os.environ.get("FEWSTEP_TAEHV_DIR")


@pytest.mark.parametrize("name", list(TAEHV_CONFIGS))
def test_published_weights(name):
    if not WEIGHTS_DIR:
        pytest.skip("set FEWSTEP_TAEHV_DIR to a folder with taew2_1.pth / taew2_2.pth / taehv.pth to run")
    path = Path(WEIGHTS_DIR) / f"{name}.pth"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    sd = read_state_dict(path)
    assert name in detect_taehv(sd)
    taehv = TAEHV(TAEHV_CONFIGS[name]).eval()
    taehv.load_state_dict(sd, strict=True)

    latents = random_latents(taehv, 3, batch=1)
    torch.testing.assert_close(
        taehv.decode_video(latents), reference_decode(taehv, latents), atol=1e-5, rtol=0
    )

    # A still, smooth picture survives the round trip (alignment-free: every frame shows the same picture).
    s = taehv.spatial_scale
    ys = torch.linspace(0, 1, LATENT_H * s * 2).view(-1, 1)
    xs = torch.linspace(0, 1, LATENT_W * s * 2).view(1, -1)
    picture = torch.stack([ys.expand(-1, xs.shape[1]), xs.expand(ys.shape[0], -1), (ys + xs) / 2])
    video = picture.expand(1, 8, -1, -1, -1)
    decoded = taehv.decode_video(taehv.encode_video(video))
    assert decoded.shape == (1, 5, *picture.shape)
    assert (decoded - picture).abs().mean() < 0.1


def test_the_safetensors_copy_loads_as_the_pth(tmp_path):
    """Kijai/WanVideo_comfy's taew2_1.safetensors holds taew2_1.pth's tensors under the same names."""
    from safetensors.torch import save_file

    from fewstep.engine import load_tiny_vae

    sd = TAEHV(TAEHV_CONFIGS["taew2_1"]).state_dict()
    generator = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(v.shape, generator=generator) for k, v in sd.items()}
    torch.save(sd, tmp_path / "taew2_1.pth")
    save_file(sd, str(tmp_path / "taew2_1.safetensors"))
    pth = load_tiny_vae(tmp_path / "taew2_1.pth", device="cpu", dtype=torch.float32)
    st = load_tiny_vae(tmp_path / "taew2_1.safetensors", device="cpu", dtype=torch.float32)
    assert pth.variant.name == st.variant.name == "taew2_1"
    a, b = pth.video.state_dict(), st.video.state_dict()
    assert a.keys() == b.keys() == sd.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["taew2_1", "taew2_2"])
def test_channels_last_weights_as_loaded_match_the_reference(name):
    """``tiny._finish`` stores the weights channels-last, as the frames run: decode / encode still equal the
    frame-by-frame reference run on contiguous weights, and the outputs come back contiguous."""
    contiguous = TAEHV(TAEHV_CONFIGS[name]).eval()
    dummy_init_(contiguous, seed=3)
    loaded = TAEHV(TAEHV_CONFIGS[name]).eval()
    loaded.load_state_dict(contiguous.state_dict())
    loaded.to(memory_format=torch.channels_last)
    assert loaded.decoder[1].weight.is_contiguous(memory_format=torch.channels_last)
    latents = random_latents(contiguous, frames=3)
    decoded = loaded.decode_video(latents)
    assert loaded.decode_frames(latents, None)[0].is_contiguous()  # decode_video trims frames from it
    torch.testing.assert_close(decoded, reference_decode(contiguous, latents), atol=1e-5, rtol=0)
    frames = random_frames(contiguous, frames=8)
    encoded = loaded.encode_video(frames)
    assert encoded.is_contiguous()
    torch.testing.assert_close(encoded, reference_encode(contiguous, frames), atol=1e-5, rtol=0)
