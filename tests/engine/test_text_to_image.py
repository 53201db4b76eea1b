"""Sampling a DiT end to end: CFG call counts, noise, latent format, conditioning batch, bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_cond

from fewstep.engine import FLUX1, InputError, TextCondition, noise_for, sample_latent


class ForwardCounter:
    def __init__(self, model):
        self.calls, self.rows = 0, []
        self.handle = model.register_forward_hook(self.hook)

    def hook(self, module, args, output):
        self.calls += 1
        self.rows.append(output.shape[0])

    def close(self):
        self.handle.remove()


def _latent(h=16, w=16, b=1):
    return torch.zeros(b, 16, h, w)


def test_cfg_one_makes_exactly_one_forward_per_step(tiny_handle):
    p = tiny_handle.params
    counter = ForwardCounter(tiny_handle.model)
    try:
        _, r1 = sample_latent(tiny_handle, [make_cond(p)], _latent(), steps=4)
        _, r2 = sample_latent(
            tiny_handle, [make_cond(p)], _latent(), negative=[make_cond(p, seed=9)], steps=4, cfg=1.0
        )
        assert counter.calls == 8 and counter.rows == [1] * 8
        counter.calls, counter.rows = 0, []
        _, r3 = sample_latent(
            tiny_handle, [make_cond(p)], _latent(), negative=[make_cond(p, seed=9)], steps=4, cfg=4.0
        )
        assert counter.calls == 4 and counter.rows == [2] * 4  # positive and negative batched
        counter.calls, counter.rows = 0, []
        neg_other_len = make_cond(p, tokens=5, seed=9)
        sample_latent(tiny_handle, [make_cond(p)], _latent(), negative=[neg_other_len], steps=4, cfg=4.0)
        assert counter.calls == 8 and counter.rows == [1] * 8  # token counts differ: two forwards
    finally:
        counter.close()
    assert (r1.model_calls, r2.model_calls, r3.model_calls) == (4, 4, 4)
    assert (r1.cfg_used, r2.cfg_used, r3.cfg_used) == (False, False, True)


def test_cfg_combines_velocities(tiny_handle):
    p = tiny_handle.params
    pos, neg = make_cond(p), make_cond(p, seed=9)
    sigmas = torch.tensor([1.0, 0.0])  # one Euler step from pure noise to sigma 0: x0 = noise - v
    out_pos, _ = sample_latent(tiny_handle, [pos], _latent(), sigmas=sigmas, seed=3)
    out_neg, _ = sample_latent(tiny_handle, [neg], _latent(), sigmas=sigmas, seed=3)
    out_cfg, _ = sample_latent(tiny_handle, [pos], _latent(), negative=[neg], sigmas=sigmas, seed=3, cfg=3.0)
    x0_pos, x0_neg = FLUX1.process_in(out_pos), FLUX1.process_in(out_neg)
    expected = FLUX1.process_out(x0_neg + 3.0 * (x0_pos - x0_neg))
    assert torch.allclose(out_cfg, expected, atol=1e-4)


def test_noise_is_comfyui_prepare_noise_without_touching_global_rng():
    latent = torch.zeros(2, 16, 8, 8)
    state = torch.get_rng_state()
    noise = noise_for(latent, 1234)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(1234)  # what comfy.sample.prepare_noise does
    assert torch.equal(noise, torch.randn(latent.size(), dtype=torch.float32, device="cpu"))
    # batch_index picks the rows the full batch would have had
    full = noise_for(torch.zeros(4, 16, 8, 8), 5)
    picked = noise_for(torch.zeros(2, 16, 8, 8), 5, batch_index=[3, 1])
    assert torch.equal(picked, full[[3, 1]])


def test_sigma_one_start_ignores_latent_and_output_is_raw_vae_space(tiny_handle):
    p = tiny_handle.params
    a, _ = sample_latent(tiny_handle, [make_cond(p)], torch.zeros(1, 16, 8, 8), steps=2, seed=1)
    b, _ = sample_latent(tiny_handle, [make_cond(p)], torch.randn(1, 16, 8, 8), steps=2, seed=1)
    assert torch.equal(a, b)  # sigma 1: the start latent gets weight 0
    # a single step to sigma 0 returns process_out(noise - v); process_in/out are the FLUX affine map
    raw = torch.randn(1, 16, 4, 4)
    assert torch.allclose(FLUX1.process_in(raw), (raw - 0.1159) * 0.3611)
    assert torch.allclose(FLUX1.process_out(FLUX1.process_in(raw)), raw, atol=1e-6)


def test_img2img_denoise_uses_the_latent(tiny_handle):
    p = tiny_handle.params
    lat = torch.randn(1, 16, 8, 8)
    a, rep = sample_latent(tiny_handle, [make_cond(p)], lat, steps=2, denoise=0.5, seed=1)
    b, _ = sample_latent(tiny_handle, [make_cond(p)], torch.zeros_like(lat), steps=2, denoise=0.5, seed=1)
    assert rep.sigmas == [0.5, 0.25, 0.0]
    assert not torch.allclose(a, b)


def test_prompt_batch_tiles_over_latent_batch(tiny_handle):
    p = tiny_handle.params
    c0, c1 = make_cond(p, seed=1), make_cond(p, seed=2)
    both = TextCondition(torch.cat([c0.context, c1.context]), torch.cat([c0.pooled, c1.pooled]), 3.5)
    out4, _ = sample_latent(tiny_handle, [both], _latent(8, 8, 4), steps=2, seed=0)
    single, _ = sample_latent(tiny_handle, [c1], _latent(8, 8, 4), steps=2, seed=0)
    assert torch.allclose(out4[3], single[3], atol=1e-5)  # rows go c0, c1, c0, c1 as in ComfyUI


def test_guidance_comes_from_the_conditioning(tiny_guidance_handle):
    p = tiny_guidance_handle.params
    a, _ = sample_latent(tiny_guidance_handle, [make_cond(p, guidance=1.0)], _latent(8, 8), steps=2)
    b, _ = sample_latent(tiny_guidance_handle, [make_cond(p, guidance=6.0)], _latent(8, 8), steps=2)
    c, _ = sample_latent(tiny_guidance_handle, [make_cond(p, guidance=None)], _latent(8, 8), steps=2)
    d, _ = sample_latent(tiny_guidance_handle, [make_cond(p, guidance=3.5)], _latent(8, 8), steps=2)
    assert not torch.allclose(a, b)
    assert torch.equal(c, d)  # ComfyUI's default distilled guidance is 3.5


def test_runs_are_deterministic(tiny_handle):
    p = tiny_handle.params
    for sampler in ("euler", "dmd", "lcm", "tcd"):
        a, _ = sample_latent(tiny_handle, [make_cond(p)], _latent(8, 8), steps=3, sampler=sampler, seed=11)
        b, _ = sample_latent(tiny_handle, [make_cond(p)], _latent(8, 8), steps=3, sampler=sampler, seed=11)
        assert torch.equal(a, b), sampler


@pytest.mark.parametrize(
    "latent,pattern",
    [
        (
            torch.zeros(1, 4, 16, 16),
            r"input 'latent': expected an image latent \[batch, 16, height/8, width/8\]",
        ),
        (torch.zeros(1, 16, 16, 16, 1), r"input 'latent': expected an image latent"),
        (torch.zeros(1, 16, 15, 16), r"input 'latent': image size 128x120 px is not a multiple of 16"),
    ],
)
def test_bad_latents(tiny_handle, latent, pattern):
    with pytest.raises(InputError, match=pattern):
        sample_latent(tiny_handle, [make_cond(tiny_handle.params)], latent)


def test_bad_conditioning(tiny_handle):
    p = tiny_handle.params
    wrong = TextCondition(torch.zeros(1, 8, 768), torch.zeros(1, 768))
    with pytest.raises(
        InputError,
        match=r"input 'positive': conditioning tokens are \[1, 8, 768\]; .* \[batch, tokens, 4096\]",
    ):
        sample_latent(tiny_handle, [wrong], _latent())
    no_pooled = TextCondition(torch.zeros(1, 8, 4096), None)
    with pytest.raises(InputError, match="input 'positive': conditioning has no pooled_output"):
        sample_latent(tiny_handle, [no_pooled], _latent())
    with pytest.raises(InputError, match=r"input 'negative': pooled_output is \[1, 512\]"):
        sample_latent(
            tiny_handle,
            [make_cond(p)],
            _latent(),
            negative=[TextCondition(torch.zeros(1, 8, 4096), torch.zeros(1, 512))],
            cfg=2,
        )
    with pytest.raises(InputError, match="input 'sampler': unknown sampler 'ddim'"):
        sample_latent(tiny_handle, [make_cond(p)], _latent(), sampler="ddim")


# -- the sampler nodes, for every image family ---------------------------------------------------------------

FAMILY_CASES = [
    # preset, LATENT of a 64x64 image, (token width, pooled width), what "auto" picks
    ("flux-tiny", (1, 16, 8, 8), (4096, 768), "flux.1-schnell"),
    ("flux-tiny-guidance", (1, 16, 8, 8), (4096, 768), "flux.1-dev"),
    ("flux2-tiny", (1, 128, 4, 4), (7680, 0), "flux.2-klein"),
    ("flux2-tiny-dev", (1, 128, 4, 4), (15360, 0), "flux.2-dev"),
    ("zimage-tiny", (1, 16, 8, 8), (2560, 0), "z-image-turbo"),
]


def _node_model(pack, preset):
    (model,) = pack.NODE_CLASS_MAPPINGS["FewStepDiTLoader"]().load(f"dummy:{preset}")
    return model


def _synthetic(pack, model=None, width=4096, pooled_width=768, tokens=6):
    node = pack.NODE_CLASS_MAPPINGS["FewStepSyntheticConditioning"]()
    return node.make(tokens, width, pooled_width, 3.5, 0, model=model)[0]


def _sample(pack, model, cond, shape, schedule="auto", steps=2):
    node = pack.NODE_CLASS_MAPPINGS["FewStepSampler"]()
    return node.sample(model, cond, {"samples": torch.zeros(shape)}, 0, steps, schedule, "euler", 1.0, 1.0)


@pytest.mark.parametrize("preset,shape,widths,auto", FAMILY_CASES)
def test_sampler_node_runs_every_image_family(pack, preset, shape, widths, auto):
    from fewstep.engine.sampling import schedule_sigmas
    from fewstep.nodes.sampling import auto_schedule

    model = _node_model(pack, preset)
    cond = _synthetic(pack, model=model)
    context, opts = cond[0]
    assert context.shape == (1, 6, widths[0])
    assert (opts["pooled_output"].shape[-1] if "pooled_output" in opts else 0) == widths[1]
    assert auto_schedule(model) == auto
    out, report = _sample(pack, model, cond, shape)
    assert out["samples"].shape == shape and "2 DiT forwards" in report
    # "auto" is the model's schedule, at the image's token count (one token per 16x16 px in every family)
    expected = schedule_sigmas(auto, 2, image_seq_len=16)
    assert report.startswith(f"euler, 2 steps, sigmas {[round(s, 4) for s in expected.tolist()]}")


@pytest.mark.parametrize("preset,shape,widths,auto", FAMILY_CASES)
def test_sampler_node_names_a_wrong_conditioning_width(pack, preset, shape, widths, auto):
    model = _node_model(pack, preset)
    wrong = _synthetic(pack, width=widths[0] // 2, pooled_width=widths[1])
    with pytest.raises(  # ValueError: the pack, loaded as ComfyUI loads it, has its own InputError class
        ValueError,
        match=rf"^FewStepSampler: input 'positive': conditioning tokens are \[1, 6, {widths[0] // 2}\]; this .* "
        rf"model \({preset}\) expects \[batch, tokens, {widths[0]}\]",
    ):
        _sample(pack, model, wrong, shape)


def test_flux1_synthetic_draws_do_not_change_with_a_model(pack):
    model = _node_model(pack, "flux-tiny")
    a, b = _synthetic(pack), _synthetic(pack, model=model)
    assert torch.equal(a[0][0], b[0][0]) and torch.equal(a[0][1]["pooled_output"], b[0][1]["pooled_output"])


def test_a_sample_request_is_what_sample_latent_runs_and_survives_a_job(tiny_handle):
    from fewstep.engine.parallel.jobs import request_from_job, request_to_job
    from fewstep.engine.text_to_image import SampleRequest, sample

    p = tiny_handle.params
    fields = {"negative": [make_cond(p, seed=9)], "seed": 5, "steps": 3, "cfg": 2.0, "batch_index": [1, 0]}
    request = SampleRequest([make_cond(p)], torch.randn(2, 16, 16, 16), **fields)
    expected, _ = sample_latent(tiny_handle, request.positive, request.latent, **fields)
    assert torch.equal(sample(tiny_handle, request)[0], expected)
    # on the wire the schedule travels built; the worker's request samples the same latent
    sent = request_from_job(
        request_to_job(dataclasses.replace(request, sigmas=request.schedule_for(tiny_handle)))
    )
    assert torch.equal(sample(tiny_handle, sent)[0], expected)


def test_klein_width_error_names_the_comfyui_release_that_encodes_klein(pack):
    # ComfyUI 0.8.0 encodes qwen_3_4b 2560 wide under CLIPLoader type flux2 (Z-Image's encoder); the message
    # must send the user to the release with the klein encoder, not only to a loader setting they already use.
    model = _node_model(pack, "flux2-tiny")
    z_image_width = _synthetic(pack, width=2560, pooled_width=0)
    expected = (
        "FewStepSampler: input 'positive': conditioning tokens are [1, 6, 2560]; this FLUX.2 (BFL MMDiT, shared "
        "modulation) model (flux2-tiny) expects [batch, tokens, 7680]: Qwen3-4B hidden states of layers 9, 18, 27 "
        "stacked (3 x 2560) (CLIPLoader type flux2 with qwen_3_4b, CLIPTextEncode, on ComfyUI 0.9.2 or newer; "
        "older ComfyUI, 0.8.0 included, encodes Qwen3-4B 2560 wide, as for Z-Image, whatever the type)"
    )
    with pytest.raises(ValueError) as caught:
        _sample(pack, model, z_image_width, (1, 128, 4, 4))
    assert str(caught.value) == expected


def test_flux2_text_encoder_hints_name_the_loader_for_every_width():
    from fewstep.engine.models import flux2

    klein_9b = flux2.with_overrides(flux2.PRESETS["flux2-tiny"], context_in_dim=12288)
    assert flux2.text_encoder_for(klein_9b) == (
        "Qwen3-8B hidden states of layers 9, 18, 27 stacked (3 x 4096) (CLIPLoader type flux2 with the Qwen3-8B "
        "file, CLIPTextEncode, on ComfyUI 0.9.2 or newer; older ComfyUI has no klein encoder for Qwen3-8B)"
    )
    dev = flux2.with_overrides(flux2.PRESETS["flux2-tiny"], context_in_dim=15360)
    assert flux2.text_encoder_for(dev).endswith(
        "(CLIPLoader type flux2 with the Mistral-Small-3.1 file, CLIPTextEncode)"
    )
    odd = flux2.with_overrides(flux2.PRESETS["flux2-tiny"], context_in_dim=96)
    assert (
        flux2.text_encoder_for(odd)
        == "96-wide stacked text-encoder states (CLIPLoader type flux2, CLIPTextEncode)"
    )
