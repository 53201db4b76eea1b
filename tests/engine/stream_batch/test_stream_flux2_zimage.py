"""Stream batch on the new image families (issue 16): Z-Image-Turbo with taef1 (16-channel latent at 1/8, 2x2
token patches, 2560-wide caption features, no pooled vector) and FLUX.2 with taef2 (the 128-channel latent at 1/16
through taef2's 2x2 patchify, one token a latent pixel). Each finished frame equals its own denoising written out
from the formulas, and the engine's own img2img sampler (``sample_latent``); frames go through the tiny AE
exactly; wrong tiny AE / frame size / conditioning are errors naming the input."""

from __future__ import annotations

import importlib

import pytest
import torch
from conftest import COMFY_MODULE_NAME
from einops import rearrange
from test_stream_batch import reference_x0

from fewstep.engine import TextCondition, load_tiny_vae, open_model
from fewstep.engine.errors import InputError
from fewstep.engine.stream_batch import StreamBatch, StreamConfig, denoise_sequential, run_sequential
from fewstep.engine.text_to_image import sample_latent

H = W = 32  # px: Z-Image a 16x4x4 latent (4 tokens, padded to 32), FLUX.2 a 128x2x2 latent (4 tokens)
SEED = 5
FAMILIES = {"zimage": ("zimage-tiny", "taef1"), "flux2": ("flux2-tiny", "taef2")}


@pytest.fixture(scope="module", params=list(FAMILIES))
def setup(request):
    """(handle, tiny AE, positive, negative) of one family."""
    preset, vae = FAMILIES[request.param]
    handle = open_model(f"dummy:{preset}", device="cpu", dtype=torch.float32)
    width = handle.family.image.context_dim(handle.params)
    g = torch.Generator().manual_seed(0)
    pos = TextCondition(torch.randn(1, 6, width, generator=g))
    neg = TextCondition(torch.randn(1, 6, width, generator=g))
    return handle, load_tiny_vae(f"dummy:{vae}", device="cpu", dtype=torch.float32), pos, neg


def _stream(handle, vae, pos, neg=None, **config):
    return StreamBatch(
        handle, vae, pos, negative=neg, height=H, width=W, config=StreamConfig(**config), seed=SEED
    )


def _latents(handle, n, seed=0):
    fmt = handle.family.latent_format
    shape = (n, fmt.channels, H // fmt.downscale, W // fmt.downscale)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("mode", "sampler", "fb"), [("none", "euler", 1), ("self", "renoise", 1), ("initialize", "euler", 2),
                                ("full", "renoise", 2)],
)  # fmt: skip
def test_every_frame_equals_its_own_denoising(setup, mode, sampler, fb):
    handle, _, pos, neg = setup
    stream = _stream(handle, None, pos, neg, t_index_list=(10, 30), cfg_mode=mode, guidance_scale=1.6,
                     sampler=sampler, frame_buffer_size=fb)  # fmt: skip
    groups = 3
    lat = _latents(handle, groups * fb)
    outs = [stream.push_latents(lat[g * fb : (g + 1) * fb]) for g in range(groups)] + stream.flush()
    finished = [o for o in outs if o is not None]
    assert [o.group for o in finished] == list(range(groups))
    assert stream.stats.rows[:2] == [stream.config.rows_per_forward(1), stream.config.rows_per_forward(2)]
    for o in finished:
        group = lat[o.group * fb : (o.group + 1) * fb]
        assert o.latents.shape == group.shape
        expected = reference_x0(handle, pos, neg, group, stream.noise, [0.8, 0.4, 0.0], mode, 1.6, sampler)
        assert (o.latents - expected).abs().max() <= 1e-4, (o.group, mode)
        assert (denoise_sequential(stream, group) - expected).abs().max() <= 1e-4


def test_a_frame_equals_the_image_samplers_img2img(setup):
    """fb 1, euler, no CFG: the stream's noise slot 0 is ComfyUI's noise for the seed (the same generator draws),
    so a frame's result is ``sample_latent`` at the stream's sigmas from its latent."""
    handle, _, pos, _ = setup
    fmt = handle.family.latent_format
    stream = _stream(handle, None, pos, t_index_list=(15, 30, 40))
    lat = _latents(handle, 3, seed=2)
    outs = [stream.push_latents(lat[g : g + 1]) for g in range(3)] + stream.flush()
    for o in (o for o in outs if o is not None):
        raw, _ = sample_latent(handle, [pos], fmt.process_out(lat[o.group : o.group + 1]), sigmas=stream.sigmas,
                               seed=SEED)  # fmt: skip
        assert (o.latents - fmt.process_in(raw)).abs().max() <= 1e-4


def test_frames_go_through_the_tiny_ae_exactly(setup):
    handle, vae, pos, _ = setup
    stream = _stream(handle, vae, pos, t_index_list=(20, 35))
    frames = torch.rand(3, 3, H, W, generator=torch.Generator().manual_seed(1))
    latents = stream.encode_frames(frames[:1])
    if handle.family.name == "flux2":  # the model's latent is taef2's, 2x2-patchified (FLUX.2's order)
        assert latents.shape == (1, 128, H // 16, W // 16)
        assert torch.equal(
            latents, rearrange(vae.encode(frames[:1]), "b c (h i) (w j) -> b (c i j) h w", i=2, j=2)
        )
    else:  # taef1's latent is the model's
        assert latents.shape == (1, 16, H // 8, W // 8)
        assert torch.equal(latents, vae.encode(frames[:1]))
    outs = [stream.push(frames[i]) for i in range(3)] + stream.flush()
    assert outs[0] is None
    for o in (o for o in outs if o is not None):
        assert o.images.shape == (1, 3, H, W) and o.latents.shape == latents.shape
        assert torch.allclose(o.latents, denoise_sequential(stream, stream.encode_frames(frames[o.group : o.group + 1])),
                              atol=1e-4)  # fmt: skip
        z = o.latents
        if handle.family.name == "flux2":
            z = rearrange(z, "b (c i j) h w -> b c (h i) (w j)", i=2, j=2)
        assert torch.equal(o.images, vae.decode(z))
    clip = stream.run(frames)
    assert clip.shape == (3, 3, H, W)
    assert torch.allclose(clip, run_sequential(stream, frames), atol=1e-4)


def test_zimage_prompts_drop_their_padding_tokens():
    handle = open_model("dummy:zimage-tiny", device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    context = torch.randn(1, 5, handle.params.cap_feat_dim, generator=g)
    padded = TextCondition(context, mask=torch.tensor([[True, True, True, False, False]]))
    lat = _latents(handle, 1)
    ours = _stream(handle, None, padded, t_index_list=(25,)).push_latents(lat).latents
    real = _stream(handle, None, TextCondition(context[:, :3]), t_index_list=(25,)).push_latents(lat).latents
    assert torch.equal(ours, real)


def test_wrong_tiny_ae_frame_size_and_conditioning_are_errors():
    zimage = open_model("dummy:zimage-tiny", device="cpu", dtype=torch.float32)
    flux2 = open_model("dummy:flux2-tiny", device="cpu", dtype=torch.float32)
    taef1 = load_tiny_vae("dummy:taef1", device="cpu", dtype=torch.float32)
    taef2 = load_tiny_vae("dummy:taef2", device="cpu", dtype=torch.float32)
    z_cond = TextCondition(torch.randn(1, 4, 2560))
    f_cond = TextCondition(torch.randn(1, 4, 7680))
    with pytest.raises(InputError, match=r"^input 'tiny_vae': taef1 \(FLUX.1, Z-Image, HiDream\) is a 16-channel "
                                         r"image autoencoder; this flux2 model denoises 128-channel flux2 latents: "
                                         r"use taef2 \(taef2_encoder.pth and taef2_decoder.pth\)$"):  # fmt: skip
        StreamBatch(flux2, taef1, f_cond, height=H, width=W)
    with pytest.raises(InputError, match=r"^input 'tiny_vae': taef2 \(FLUX.2\) is a 32-channel image autoencoder; "
                                         r"this zimage model denoises 16-channel flux1 latents: use taef1 "
                                         r"\(taef1_encoder.pth and taef1_decoder.pth\)$"):  # fmt: skip
        StreamBatch(zimage, taef2, z_cond, height=H, width=W)
    with pytest.raises(InputError, match=r"^input 'tiny_vae': taew2_1 .* this flux2 model .* use taef2"):
        StreamBatch(flux2, load_tiny_vae("dummy:taew2_1", device="cpu"), f_cond, height=H, width=W)
    with pytest.raises(InputError, match=r"^input 'frames': frame size 40x24 px is not a multiple of 16 \(FLUX.2's "
                                         r"16x latent downscale, one token a latent pixel\)"):  # fmt: skip
        StreamBatch(flux2, taef2, f_cond, height=24, width=40)
    with pytest.raises(InputError, match=r"^input 'frames': frame size 24x24 px is not a multiple of 16 \(8x latent "
                                         r"downscale, then Z-Image's 2x2 patches\)"):  # fmt: skip
        StreamBatch(zimage, taef1, z_cond, height=24, width=24)
    stream = StreamBatch(flux2, taef2, f_cond, height=H, width=W)
    with pytest.raises(
        InputError, match=r"^input 'frames': frames are 48x32 px; this stream was prepared for 32x32"
    ):
        stream.push(torch.rand(3, 32, 48))
    with pytest.raises(InputError, match=r"^input 'latents': expected a group of latents \[1, 128, 2, 2\]; got "
                                         r"\[1, 16, 4, 4\]"):  # fmt: skip
        stream.push_latents(torch.zeros(1, 16, 4, 4))
    with pytest.raises(InputError, match=r"^input 'tiny_vae': push\(\) encodes frames: create the stream with a "
                                         r"tiny VAE \(taef2\)"):  # fmt: skip
        StreamBatch(flux2, None, f_cond, height=H, width=W).push(torch.rand(3, H, W))
    with pytest.raises(
        InputError, match=r"^input 'positive': conditioning tokens are \[1, 4, 2560\]; this FLUX.2 "
    ):
        StreamBatch(flux2, taef2, z_cond, height=H, width=W)
    with pytest.raises(
        InputError, match=r"^input 'negative': conditioning tokens are \[1, 4, 7680\]; this Z-Image"
    ):
        StreamBatch(zimage, taef1, z_cond, negative=f_cond, height=H, width=W)


def test_flux2_dev_guidance_embedding_streams_with_cfg():
    handle = open_model("dummy:flux2-tiny-dev", device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    pos = TextCondition(torch.randn(1, 4, handle.params.context_in_dim, generator=g), guidance=3.0)
    neg = TextCondition(torch.randn(1, 4, handle.params.context_in_dim, generator=g), guidance=3.0)
    stream = _stream(handle, None, pos, neg, t_index_list=(10, 30), cfg_mode="initialize", guidance_scale=1.5)
    lat = _latents(handle, 2)
    outs = [stream.push_latents(lat[g : g + 1]) for g in range(2)] + stream.flush()
    assert stream.stats.rows == [2, 3, 1]  # positive and negative share a forward
    for o in (o for o in outs if o is not None):
        exp = reference_x0(handle, pos, neg, lat[o.group : o.group + 1], stream.noise, stream.sigmas.tolist(),
                           "initialize", 1.5, "euler")  # fmt: skip
        assert (o.latents - exp).abs().max() <= 1e-4


def test_the_node_streams_zimage_and_flux2(pack, setup):
    from fewstep.nodes.conditioning import to_comfy

    node = importlib.import_module(f"{COMFY_MODULE_NAME}.nodes.stream_batch").FewStepStreamBatch
    handle, vae, pos, _ = setup
    frames = torch.rand(3, H, W, 3, generator=torch.Generator().manual_seed(2))
    args = {name: entry[1].get("default") for name, entry in node.INPUT_TYPES()["required"].items()}
    args.update(
        model=handle, tiny_vae=vae, frames=frames, positive=to_comfy(pos), t_index_list="10,30", seed=SEED
    )
    images, report = node().stylize(**args)
    assert images.shape == (3, H, W, 3) and images.dtype == torch.float32
    assert "steady state 2 rows per forward" in report
    stream = _stream(handle, vae, pos, t_index_list=(10, 30))
    seq = run_sequential(stream, frames.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    assert torch.allclose(images, seq, atol=1e-4)
