"""Stream batch (issue 9): buffered frames equal sequential per-frame denoising, warm-up, residual-CFG rows,
the seeded similarity filter, StreamDiffusion's stock-noise recursion, bad input, and the node.

Stream batch on the new image families (issue 16): Z-Image-Turbo with taef1 (16-channel latent at 1/8, 2x2
token patches, 2560-wide caption features, no pooled vector) and FLUX.2 with taef2 (the 128-channel latent at 1/16
through taef2's 2x2 patchify, one token a latent pixel). Each finished frame equals its own denoising written out
from the formulas, and the engine's own img2img sampler (``sample_latent``); frames go through the tiny AE
exactly; wrong tiny AE / frame size / conditioning are errors naming the input."""

from __future__ import annotations

import importlib
from contextlib import contextmanager

import pytest
import torch
from conftest import COMFY_MODULE_NAME, make_cond
from einops import rearrange

from fewstep.engine import TextCondition, load_tiny_vae, open_model
from fewstep.engine.errors import InputError
from fewstep.engine.models.flux import flux_velocity
from fewstep.engine.stream_batch import (
    SimilarityFilter,
    StreamBatch,
    StreamConfig,
    check_frames,
    cosine_similarity,
    denoise_sequential,
    parse_t_index_list,
    run_sequential,
)
from fewstep.engine.text_to_image import sample_latent

H = W = 32  # px: a 4x4 latent, 4 image tokens
SEED = 5


@pytest.fixture(scope="module")
def taef1():
    return load_tiny_vae("dummy:taef1", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(tiny_handle):
    return make_cond(tiny_handle.params, seed=0), make_cond(tiny_handle.params, seed=1)


def _stream(handle, vae, prompts, **config):
    pos, neg = prompts
    return StreamBatch(
        handle, vae, pos, negative=neg, height=H, width=W, config=StreamConfig(**config), seed=SEED
    )


def _latents(n, seed=0):
    return torch.randn(n, 16, H // 8, W // 8, generator=torch.Generator().manual_seed(seed))


@contextmanager
def counted_rows(model):
    """Rows of every DiT forward, seen by a forward pre-hook on the model."""
    rows: list[int] = []
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: rows.append(kwargs["img"].shape[0]),
                                           with_kwargs=True)  # fmt: skip
    try:
        yield rows
    finally:
        hook.remove()


def reference_x0(handle, pos, neg, latents, noise, sigmas, mode, scale, sampler):
    """One frame group denoised on its own, written out from the documented formulas (x0 form of the CFG), with
    the family's velocity (``flux_velocity`` for FLUX.1; also used for FLUX.2 and Z-Image)."""
    model, velocity = handle.model, handle.family.velocity

    def vel(x, s, cond):
        c = cond.repeat_to(x.shape[0])
        return velocity(model, x, torch.full((x.shape[0],), float(s)), c)

    x = (1 - sigmas[0]) * latents + sigmas[0] * noise[0]
    x_ref = latents
    cfg = mode != "none" and scale != 1.0
    for k in range(len(sigmas) - 1):
        s, s_next = sigmas[k], sigmas[k + 1]
        x0_c = x - s * vel(x, s, pos)
        if not cfg:
            x0 = x0_c
        elif mode == "full":
            x0_u = x - s * vel(x, s, neg)
            x0 = x0_u + scale * (x0_c - x0_u)
        else:
            if mode == "initialize" and k == 0:
                x_ref = x - s * vel(x, s, neg)
            x0 = x_ref + scale * (x0_c - x_ref)
        if sampler == "euler":
            x = x + (s_next - s) * (x - x0) / s
        else:
            x = (1 - s_next) * x0 + (s_next * noise[k + 1] if k + 1 < len(noise) else 0)
    return x0


def streamdiffusion_recursion_x0(handle, pos, neg, latents, noise, sigmas, mode, scale, delta=1.0):
    """StreamDiffusion's own update written in eps terms (a = 1 - s, b = s; c_skip = 0, c_out = 1): the stock
    noise starts as the added noise (or, initialize, the unconditional eps), the uncond eps is delta x the stock
    noise, and after each step stock' = n' + (a'/b') * delta_x with delta_x = (b stock - b eps) / a."""

    def eps(x, s, cond):  # flow velocity -> eps: n = x + (1 - s) v
        c = cond.repeat_to(x.shape[0])
        return x + (1 - s) * flux_velocity(handle.model, x, torch.full((x.shape[0],), float(s)), c)

    a = [1 - s for s in sigmas[:-1]] + [1.0]
    b = list(sigmas[:-1]) + [1.0]
    x = a[0] * latents + b[0] * noise[0]
    stock = noise[0]
    for k in range(len(sigmas) - 1):
        e_c = eps(x, sigmas[k], pos)
        if mode == "initialize" and k == 0:
            stock = eps(x, sigmas[k], neg)
        e = delta * stock + scale * (e_c - delta * stock)
        x0 = (x - b[k] * e) / a[k]
        delta_x = (b[k] * stock - b[k] * e) / a[k]
        n_next = noise[k + 1] if k + 1 < len(noise) else torch.zeros_like(x)
        stock = n_next + a[k + 1] / b[k + 1] * delta_x
        x = a[k + 1] * x0 + (b[k + 1] * n_next if k + 1 < len(noise) else 0)
    return x0


MODES = ["none", "self", "initialize", "full"]


@pytest.mark.parametrize("sampler", ["euler", "renoise"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fb", [1, 2])
def test_every_frame_equals_its_sequential_denoising(tiny_handle, taef1, prompts, mode, sampler, fb):
    t_index = (10, 25, 40)
    stream = _stream(tiny_handle, None, prompts, t_index_list=t_index, cfg_mode=mode, guidance_scale=1.7,
                     sampler=sampler, frame_buffer_size=fb)  # fmt: skip
    groups = 5
    lat = _latents(groups * fb)
    outs = [stream.push_latents(lat[g * fb : (g + 1) * fb]) for g in range(groups)]
    outs += stream.flush()
    finished = [o for o in outs if o is not None]
    assert [o.group for o in finished] == list(range(groups))
    sigmas = [1 - i / 50 for i in t_index] + [0.0]
    assert stream.sigmas.tolist() == pytest.approx(sigmas)
    pos, neg = prompts
    for o in finished:
        group = lat[o.group * fb : (o.group + 1) * fb]
        expected = reference_x0(tiny_handle, pos, neg, group, stream.noise, sigmas, mode, 1.7, sampler)
        assert (o.latents - expected).abs().max() <= 1e-4, (o.group, mode, sampler)
        # the engine's own sequential path (the bench baseline) agrees too
        assert (denoise_sequential(stream, group) - expected).abs().max() <= 1e-4


def test_a_guidance_embedding_model_streams_too(tiny_guidance_handle):
    pos = make_cond(tiny_guidance_handle.params, guidance=2.5)
    neg = make_cond(tiny_guidance_handle.params, seed=1, guidance=2.5)
    stream = StreamBatch(tiny_guidance_handle, None, pos, negative=neg, height=H, width=W, seed=SEED,
                         config=StreamConfig(t_index_list=(10, 30), cfg_mode="initialize", guidance_scale=1.5))  # fmt: skip
    lat = _latents(3)
    outs = [stream.push_latents(lat[g : g + 1]) for g in range(3)] + stream.flush()
    assert stream.stats.rows == [2, 3, 3, 1]  # positive and negative share a forward
    for o in (o for o in outs if o is not None):
        exp = reference_x0(tiny_guidance_handle, pos, neg, lat[o.group : o.group + 1], stream.noise,
                           stream.sigmas.tolist(), "initialize", 1.5, "euler")  # fmt: skip
        assert (o.latents - exp).abs().max() <= 1e-4


@pytest.mark.parametrize(
    ("mode", "delta"), [("self", 1.0), ("self", 0.7), ("initialize", 1.0), ("initialize", 1.3), ("full", 1.0),
                        ("none", 1.0)],
)  # fmt: skip
def test_residual_cfg_follows_the_streamdiffusion_stock_noise_recursion(tiny_handle, prompts, mode, delta):
    """The closed form x_ref + g (x0_c - x_ref) (with delta: see guidance.py) equals StreamDiffusion's recursion
    (renoise = its LCM update)."""
    stream = _stream(tiny_handle, None, prompts, t_index_list=(5, 20, 35), cfg_mode=mode, guidance_scale=2.0,
                     sampler="renoise", delta=delta)  # fmt: skip
    lat = _latents(3, seed=4)
    outs = [stream.push_latents(lat[g : g + 1]) for g in range(3)] + stream.flush()
    pos, neg = prompts
    sigmas = stream.sigmas.tolist()
    for o in (o for o in outs if o is not None):
        group = lat[o.group : o.group + 1]
        if mode in ("self", "initialize"):
            expected = streamdiffusion_recursion_x0(
                tiny_handle, pos, neg, group, stream.noise, sigmas, mode, 2.0, delta
            )
        else:
            expected = reference_x0(tiny_handle, pos, neg, group, stream.noise, sigmas, mode, 2.0, "renoise")
        assert (o.latents - expected).abs().max() <= 1e-4


def _official_streamdiffusion():
    """StreamDiffusion's ``pipeline`` and ``image_filter`` modules from a checkout's ``src`` folder
    (FEWSTEP_STREAMDIFFUSION_DIR); diffusers names it imports but these checks never call are stubbed when
    diffusers is absent."""
    import os
    import sys
    import types

    root = os.environ.get("FEWSTEP_STREAMDIFFUSION_DIR")
    if not root or not os.path.isfile(os.path.join(root, "streamdiffusion", "pipeline.py")):
        pytest.skip(
            "set FEWSTEP_STREAMDIFFUSION_DIR to StreamDiffusion's src/ folder, or to a `pip install --no-deps "
            "--target` folder of PyPI streamdiffusion 0.1.1 (`make test-all` makes one), for the official "
            "cross-check; it is not in the test extra because it pins diffusers==0.24.0 and the extra pins 0.42.1"
        )
    stubs = []
    try:
        import diffusers  # noqa: F401
    except ImportError:
        names = {
            "diffusers": {"LCMScheduler": object, "StableDiffusionPipeline": object},
            "diffusers.image_processor": {"VaeImageProcessor": object},
            "diffusers.pipelines": {},
            "diffusers.pipelines.stable_diffusion": {},
            "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img": {
                "retrieve_latents": None
            },
        }
        for name, attrs in names.items():
            sys.modules[name] = types.SimpleNamespace(__name__=name, **attrs)
            stubs.append(name)
    sys.path.insert(0, root)
    try:
        return importlib.import_module("streamdiffusion.pipeline"), importlib.import_module(
            "streamdiffusion.image_filter"
        )
    finally:
        sys.path.remove(root)
        for name in stubs:  # other tests must still see that diffusers is not installed
            del sys.modules[name]


@pytest.mark.parametrize(("mode", "delta"), [("none", 1.0), ("self", 1.0), ("self", 0.7), ("initialize", 1.3),
                                             ("full", 1.0)])  # fmt: skip
def test_matches_the_official_streamdiffusion_stream_batch(tiny_handle, prompts, mode, delta):
    """StreamDiffusion's own ``predict_x0_batch`` (stream batch, stock noise, delta), on the flux-tiny model
    seen as an eps-predictor (a = 1 - s, b = s, LCM scalings c_skip 0 / c_out 1), against the stream with the
    renoise sampler. Its zero-filled buffer makes its first T - 1 outputs placeholders; from then on push p
    returns frame p - (T - 1) in both."""
    official, _ = _official_streamdiffusion()
    pos, neg = prompts
    t_index = (10, 25, 40)
    steps = len(t_index)
    stream = _stream(tiny_handle, None, prompts, t_index_list=t_index, cfg_mode=mode, guidance_scale=1.7,
                     delta=delta, sampler="renoise")  # fmt: skip
    sig = stream.sigmas[:steps]

    def unet(x, t, encoder_hidden_states, return_dict=False):  # rows flagged 1 are unconditional
        s = t.float() / 1000
        out = torch.empty_like(x)
        for flag, cond in ((0, pos), (1, neg)):
            rows = (encoder_hidden_states == flag).nonzero().flatten()
            if len(rows):
                v = flux_velocity(tiny_handle.model, x[rows], s[rows], cond.repeat_to(len(rows)))
                out[rows] = x[rows] + (1 - s[rows]).view(-1, 1, 1, 1) * v
        return (out,)

    sd = official.StreamDiffusion.__new__(
        official.StreamDiffusion
    )  # its prepare() needs a diffusers pipeline
    sd.denoising_steps_num, sd.frame_bff_size, sd.batch_size = steps, 1, steps
    sd.cfg_type, sd.guidance_scale, sd.delta = mode, 1.0 if mode == "none" else 1.7, delta
    sd.use_denoising_batch, sd.do_add_noise, sd.unet = True, True, unet
    sd.x_t_latent_buffer = torch.zeros(steps - 1, 16, H // 8, W // 8)
    sd.init_noise = stream.noise.reshape(steps, 16, H // 8, W // 8).clone()
    sd.stock_noise = torch.zeros_like(sd.init_noise)
    sd.sub_timesteps_tensor = sig * 1000
    sd.alpha_prod_t_sqrt, sd.beta_prod_t_sqrt = (1 - sig).view(-1, 1, 1, 1), sig.view(-1, 1, 1, 1)
    sd.c_skip, sd.c_out = torch.zeros(steps, 1, 1, 1), torch.ones(steps, 1, 1, 1)
    uncond_first = {"full": [1] * steps + [0] * steps, "initialize": [1] + [0] * steps}
    sd.prompt_embeds = torch.tensor(uncond_first.get(mode, [0] * steps))
    lat = _latents(6, seed=9)
    with torch.no_grad():
        theirs = [
            sd.predict_x0_batch((1 - sig[0]) * lat[i : i + 1] + sig[0] * sd.init_noise[0]) for i in range(6)
        ]
    ours = [stream.push_latents(lat[i : i + 1]) for i in range(6)]
    assert all(o is None for o in ours[: steps - 1])
    for p in range(steps - 1, 6):
        assert ours[p].group == p - (steps - 1)
        assert (theirs[p] - ours[p].latents).abs().max() <= 1e-4, p


def test_the_official_filter_differs_only_in_its_skip_counter():
    """Same cosine (on [-1, 1] pixels) and skip probability; StreamDiffusion lets max_skip_frame + 1 skips
    through and never resets its counter on a processed frame, the stream caps the run at exactly max_skip."""
    import random

    _, official = _official_streamdiffusion()
    frame = torch.rand(1, 3, H, W, generator=torch.Generator().manual_seed(0))
    theirs = official.SimilarImageFilter(threshold=0.98, max_skip_frame=3)
    random.seed(0)
    assert [i for i in range(12) if theirs(frame * 2 - 1) is None] == [1, 2, 3, 4, 6, 7, 8, 9, 11]
    ours = SimilarityFilter(0.98, 3, seed=0)
    assert [i for i in range(12) if ours(frame)] == [1, 2, 3, 5, 6, 7, 9, 10, 11]


def test_delta_needs_a_first_sigma_below_one(tiny_handle, prompts):
    with pytest.raises(InputError, match=r"input 'delta': delta 0.5 scales the stock noise, which is undefined "
                                         r"at sigma 1 \(t_index 0 of flux.1-schnell is pure noise\)"):  # fmt: skip
        _stream(
            tiny_handle, None, prompts, t_index_list=(0, 25), cfg_mode="self", guidance_scale=1.5, delta=0.5
        )
    with pytest.raises(InputError, match=r"input 'delta': expected a scale >= 0"):
        _stream(tiny_handle, None, prompts, cfg_mode="self", delta=float("nan"))
    # delta is unused (so allowed) without residual CFG, and delta 1 is fine from pure noise
    _stream(tiny_handle, None, prompts, t_index_list=(0, 25), cfg_mode="full", guidance_scale=1.5, delta=0.5)
    _stream(tiny_handle, None, prompts, t_index_list=(0, 25), cfg_mode="self", guidance_scale=1.5)


def test_warm_up_returns_nothing_then_each_frame_t_minus_1_pushes_later(tiny_handle, taef1, prompts):
    stream = _stream(tiny_handle, taef1, prompts, t_index_list=(10, 25, 40))  # T = 3
    frames = torch.rand(5, 3, H, W, generator=torch.Generator().manual_seed(0))
    with counted_rows(tiny_handle.model) as rows:
        outs = [stream.push(frames[i]) for i in range(5)]
        assert outs[0] is None and outs[1] is None  # T - 1 = 2 pushes of warm-up
        assert [o.group for o in outs[2:]] == [0, 1, 2]  # push p returns frame p - (T - 1)
        assert stream.frames_in_flight == 2
        tail = stream.flush()
    assert [o.group for o in tail] == [3, 4] and stream.frames_in_flight == 0
    # warm-up and flush run only the occupied step slots
    assert rows == [1, 2, 3, 3, 3, 2, 1] == stream.stats.rows
    for o in outs[2:] + tail:
        latents = taef1.encode(frames[o.group : o.group + 1])
        assert torch.allclose(o.latents, denoise_sequential(stream, latents), atol=1e-4)
        assert torch.allclose(o.images, taef1.decode(o.latents), atol=1e-6)
        assert o.images.shape == (1, 3, H, W)
    # the whole-clip API gives one output per input, aligned with the inputs, and starts from a fresh state
    clip = stream.run(frames)
    assert clip.shape == (5, 3, H, W)
    assert torch.allclose(clip, run_sequential(stream, frames), atol=1e-4)
    assert torch.allclose(clip[3], tail[0].images[0], atol=1e-6)


def test_a_single_step_stream_has_no_latency(tiny_handle, taef1, prompts):
    stream = _stream(tiny_handle, None, prompts, t_index_list=(20,))
    lat = _latents(2)
    out = stream.push_latents(lat[:1])
    assert out is not None and out.group == 0 and stream.flush() == []
    # latents in, latents out: with a tiny VAE attached, push_latents and the flush after it do not decode
    stream = _stream(tiny_handle, taef1, prompts, t_index_list=(10, 30))
    assert stream.push_latents(lat[:1]) is None
    out = stream.push_latents(lat[1:])
    (last,) = stream.flush()
    assert out.images is None and last.images is None and last.group == 1


@pytest.mark.parametrize("fb", [1, 2])
def test_residual_cfg_modes_make_the_documented_rows_per_forward(tiny_handle, prompts, fb):
    steps = 3
    documented = {
        "none": steps * fb,
        "self": steps * fb,
        "initialize": (steps + 1) * fb,
        "full": 2 * steps * fb,
    }
    for mode, want in documented.items():
        for scale, expected in ((1.5, want), (1.0, steps * fb)):  # scale 1: no CFG in any mode
            stream = _stream(tiny_handle, None, prompts, t_index_list=(10, 25, 40), cfg_mode=mode,
                             guidance_scale=scale, frame_buffer_size=fb)  # fmt: skip
            lat = _latents(4 * fb)
            for g in range(2):  # warm-up
                stream.push_latents(lat[g * fb : (g + 1) * fb])
            with counted_rows(tiny_handle.model) as rows:
                for g in range(2, 4):
                    stream.push_latents(lat[g * fb : (g + 1) * fb])
            assert rows == [expected, expected], (mode, scale)
            assert stream.config.rows_per_forward() == expected


def test_prompts_with_different_token_counts_take_two_forwards(tiny_handle):
    pos, neg = make_cond(tiny_handle.params, tokens=8), make_cond(tiny_handle.params, tokens=5, seed=1)
    stream = StreamBatch(tiny_handle, None, pos, negative=neg, height=H, width=W, seed=SEED,
                         config=StreamConfig(t_index_list=(10, 30), cfg_mode="full", guidance_scale=2.0))  # fmt: skip
    lat = _latents(3)
    with counted_rows(tiny_handle.model) as rows:
        outs = [stream.push_latents(lat[g : g + 1]) for g in range(3)] + stream.flush()
    assert rows == [1, 1, 2, 2, 2, 2, 1, 1]  # positive rows, then negative rows, per forward
    for o in (o for o in outs if o is not None):
        exp = reference_x0(tiny_handle, pos, neg, lat[o.group : o.group + 1], stream.noise,
                           stream.sigmas.tolist(), "full", 2.0, "euler")  # fmt: skip
        assert (o.latents - exp).abs().max() <= 1e-4


def _filter_frames():
    """Identical runs, a cut, and blends whose similarity to the last processed frame lands mid-probability."""
    g = torch.Generator().manual_seed(11)
    a, b = torch.rand(3, H, W, generator=g), torch.rand(3, H, W, generator=g)
    frames = [a, a, a, a, b]
    prev = b
    for _ in range(10):
        nxt = 0.8 * prev + 0.2 * torch.rand(3, H, W, generator=g)
        frames.append(nxt)
        prev = nxt
    return torch.stack(frames)


def expected_skips(frames, threshold, max_skip, seed):
    """The filter's rule written out: draw k for input k >= 1, p = max(0, 1 - (1 - cos) / (1 - threshold))."""
    gen = torch.Generator().manual_seed(seed)
    reference, run, skips, probabilities = frames[0], 0, [], []
    for i in range(1, len(frames)):
        x = (frames[i] * 2 - 1).flatten().double()
        y = (reference * 2 - 1).flatten().double()
        cos = float(torch.nn.functional.cosine_similarity(x, y, dim=0))
        p = max(0.0, 1 - (1 - cos) / (1 - threshold))
        probabilities.append(p)
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        if u < p and run < max_skip:
            skips.append(i)
            run += 1
        else:
            reference, run = frames[i], 0
    return skips, probabilities


def test_similarity_filter_skips_exactly_the_seeded_frames(tiny_handle, taef1, prompts):
    frames = _filter_frames()
    threshold, max_skip = 0.9, 2
    seen = set()
    for seed in (0, 1, 2, 3):
        want, probabilities = expected_skips(frames, threshold, max_skip, seed)
        assert (
            want[:2] == [1, 2] and 3 not in want and 4 not in want
        )  # identical: p = 1, capped at 2 in a row
        assert any(0.05 < p < 0.95 for p in probabilities)  # some frames are left to the draw
        stream = StreamBatch(tiny_handle, taef1, prompts[0], height=H, width=W, seed=seed,
                             config=StreamConfig(t_index_list=(10, 30), similarity_threshold=threshold,
                                                 max_skip_frames=max_skip))  # fmt: skip
        got = []
        for i, f in enumerate(frames):
            stream.push(f)
            if stream.last_push_skipped:
                got.append(i)
        assert got == want, seed
        assert stream.stats.groups_skipped == len(want) and stream.filter.skipped == len(want)
        seen.add(tuple(want))
    assert len(seen) > 1  # the seed decides the mid-probability frames


def test_a_skip_returns_the_previous_output_and_runs_nothing(tiny_handle, taef1, prompts):
    g = torch.Generator().manual_seed(3)
    a, b = torch.rand(3, H, W, generator=g), torch.rand(3, H, W, generator=g)
    frames = torch.stack([a, a, b, a, a])
    config = StreamConfig(t_index_list=(20,), similarity_threshold=0.5, max_skip_frames=5)
    stream = StreamBatch(tiny_handle, taef1, prompts[0], height=H, width=W, config=config, seed=0)
    first = stream.push(frames[0])
    with counted_rows(tiny_handle.model) as rows:
        again = stream.push(frames[1])
    assert rows == [] and again.skipped and again.group == first.group
    assert torch.equal(again.images, first.images)
    # whole clip: a skipped frame repeats the output of the last processed frame before it
    clip = stream.run(frames)
    assert stream.stats.groups_skipped == 2  # frames 1 and 4 (frame 3 differs from frame 2, the reference)
    assert torch.equal(clip[1], clip[0]) and torch.equal(clip[4], clip[3])
    seq = run_sequential(stream, frames)
    for i in (0, 2, 3):
        assert torch.allclose(clip[i], seq[i], atol=1e-4)
    # T = 2: a skip during warm-up has no previous output to repeat
    stream = StreamBatch(tiny_handle, taef1, prompts[0], height=H, width=W, seed=0,
                         config=StreamConfig(t_index_list=(10, 30), similarity_threshold=0.5))  # fmt: skip
    assert stream.push(frames[0]) is None and stream.push(frames[1]) is None and stream.last_push_skipped


def test_similarity_filter_off(tiny_handle, taef1, prompts):
    frames = torch.stack([torch.full((3, H, W), 0.3)] * 4)
    for config in (
        StreamConfig(similarity_threshold=1.0),
        StreamConfig(similarity_threshold=0.5, max_skip_frames=0),
    ):
        stream = StreamBatch(tiny_handle, taef1, prompts[0], height=H, width=W, config=config)
        stream.run(frames)
        assert stream.stats.groups_skipped == 0 and stream.stats.forwards == 4 + 1
    assert cosine_similarity(frames[0], frames[1]) == pytest.approx(1.0)


def test_t_index_list_must_increase_and_stay_in_range(tiny_handle, prompts):
    def make(t, **kw):
        return _stream(tiny_handle, None, prompts, t_index_list=t, **kw)

    with pytest.raises(InputError, match=r"input 't_index_list': \[32, 16\] is not strictly increasing"):
        make((32, 16))
    with pytest.raises(InputError, match=r"input 't_index_list': \[16, 16\] is not strictly increasing"):
        make((16, 16))
    with pytest.raises(InputError, match=r"input 't_index_list': indices \[50\] are out of range: .* 0..49"):
        make((16, 50))
    with pytest.raises(InputError, match=r"indices \[-1\] are out of range"):
        make((-1, 16))
    with pytest.raises(InputError, match=r"indices \[4\] are out of range: flux.1-schnell at 4 steps"):
        make((0, 4), schedule_steps=4)
    with pytest.raises(InputError, match="expected whole numbers separated by commas"):
        parse_t_index_list("16, 3x")
    with pytest.raises(InputError, match="the list is empty"):
        parse_t_index_list(" , ")
    assert parse_t_index_list("16, 32") == (16, 32) == parse_t_index_list("16 32")


def test_bad_frames(tiny_handle, taef1, prompts):
    with pytest.raises(InputError, match=r"input 'frames': frame 2 is 32x48 px but frame 0 is 32x32 px"):
        check_frames([torch.rand(3, 32, 32), torch.rand(3, 32, 32), torch.rand(3, 48, 32)])
    with pytest.raises(InputError, match=r"input 'frames': frame size 40x32 px is not a multiple of 16"):
        check_frames(torch.rand(2, 3, 32, 40))
    with pytest.raises(InputError, match=r"input 'frames': frame size 24x24 px is not a multiple of 16"):
        StreamBatch(tiny_handle, taef1, prompts[0], height=24, width=24)
    stream = _stream(tiny_handle, taef1, prompts, t_index_list=(10, 30))
    with pytest.raises(
        InputError, match=r"input 'frames': frames are 48x32 px; this stream was prepared for 32x32"
    ):
        stream.push(torch.rand(3, 32, 48))
    with pytest.raises(InputError, match=r"input 'frames': frame 1 is 48x32 px but frame 0 is 32x32 px"):
        stream.run([torch.rand(3, 32, 32), torch.rand(3, 32, 48)])
    with pytest.raises(InputError, match=r"push takes a group of frame_buffer_size=1 RGB frames"):
        stream.push(torch.rand(2, 3, 32, 32))
    with pytest.raises(InputError, match=r"frame values must be in \[0, 1\]"):
        stream.run(torch.full((1, 3, 32, 32), 2.0))
    with pytest.raises(InputError, match=r"input 'frames': frames contain NaN or infinite values"):
        stream.run(torch.full((2, 3, 32, 32), float("nan")))
    with pytest.raises(InputError, match=r"input 'frames': frame values must be in \[0, 1\]"):
        stream.push(torch.full((3, 32, 32), 2.0))


def test_tiny_vae_must_match_the_model_latents(tiny_handle, prompts):
    for variant, channels in (("taesd", 4), ("taesd3", 16), ("taef2", 32)):
        vae = load_tiny_vae(f"dummy:{variant}", device="cpu", dtype=torch.float32)
        with pytest.raises(InputError, match=rf"input 'tiny_vae': {variant} .* is a {channels}-channel image "
                                             r"autoencoder; this flux model denoises 16-channel flux1 latents: "
                                             "use taef1"):  # fmt: skip
            StreamBatch(tiny_handle, vae, prompts[0], height=H, width=W)
    half = load_tiny_vae("dummy:taef1", device="cpu", dtype=torch.float32)
    half.encoder = None
    with pytest.raises(InputError, match="input 'tiny_vae': this taef1 has no encoder"):
        StreamBatch(tiny_handle, half, prompts[0], height=H, width=W)


def test_other_bad_settings(tiny_handle, taef1, prompts):
    pos = prompts[0]
    with pytest.raises(InputError, match=r"input 'negative': cfg_mode 'full' runs the unconditional branch"):
        StreamBatch(tiny_handle, taef1, pos, height=H, width=W, config=StreamConfig(cfg_mode="full"))
    StreamBatch(
        tiny_handle, taef1, pos, height=H, width=W, config=StreamConfig(cfg_mode="self")
    )  # needs none
    with pytest.raises(InputError, match=r"input 'positive': expected one prompt \(batch 1\)"):
        StreamBatch(tiny_handle, taef1, make_cond(tiny_handle.params, batch=2), height=H, width=W)
    with pytest.raises(InputError, match="input 'cfg_mode': unknown CFG mode 'half'"):
        StreamBatch(tiny_handle, taef1, pos, height=H, width=W, config=StreamConfig(cfg_mode="half"))
    with pytest.raises(InputError, match="input 'similarity_threshold'"):
        StreamBatch(tiny_handle, taef1, pos, height=H, width=W, config=StreamConfig(similarity_threshold=1.5))
    wan = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32)
    with pytest.raises(InputError, match="input 'model': the stream batch runs FLUX-family image DiTs"):
        StreamBatch(wan, taef1, pos, height=H, width=W)


# -- the node ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def node(pack):
    return importlib.import_module(f"{COMFY_MODULE_NAME}.nodes.stream_batch").FewStepStreamBatch


def _node_args(node, **links):
    args = {}
    for name, entry in node.INPUT_TYPES()["required"].items():
        if name in links:
            args[name] = links.pop(name)
        else:
            opts = entry[1]
            args[name] = opts.get("default", entry[0][0] if isinstance(entry[0], list) else None)
    args.update(links)
    return args


def test_node_contract(node):
    assert node.CATEGORY.startswith("FewStep/") and node.RETURN_TYPES == ("IMAGE", "STRING")
    spec = node.INPUT_TYPES()
    for section in ("required", "optional"):
        for name, entry in spec[section].items():
            assert entry[1].get("tooltip"), name
            if entry[0] in ("INT", "FLOAT"):
                assert entry[1]["min"] <= entry[1]["default"] <= entry[1]["max"], name
            if isinstance(entry[0], list):
                assert entry[1]["default"] in entry[0], name


def test_node_stylizes_a_frame_sequence(node, tiny_handle, taef1, prompts):
    from fewstep.nodes.conditioning import to_comfy

    frames = torch.rand(5, H, W, 3, generator=torch.Generator().manual_seed(2))
    frames[3] = frames[2]  # identical: skipped with threshold 0.9
    images, report = node().stylize(**_node_args(
        node, model=tiny_handle, tiny_vae=taef1, frames=frames, positive=to_comfy(prompts[0]),
        t_index_list="10,30", cfg_mode="full", guidance_scale=1.5, similarity_threshold=0.9, seed=SEED,
        negative=to_comfy(prompts[1]),
    ))  # fmt: skip
    assert images.shape == (5, H, W, 3) and images.dtype == torch.float32
    assert torch.equal(images[3], images[2])
    assert "frames/s" in report and "1 of 5 frames skipped" in report and "frames 3 (0-based)" in report
    assert "steady state 4 rows per forward" in report
    stream = StreamBatch(tiny_handle, taef1, prompts[0], negative=prompts[1], height=H, width=W, seed=SEED,
                         config=StreamConfig(t_index_list=(10, 30), cfg_mode="full", guidance_scale=1.5))  # fmt: skip
    seq = run_sequential(stream, frames.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    assert torch.allclose(images[[0, 1, 2, 4]], seq[[0, 1, 2, 4]], atol=1e-4)


def _flat(rgb: int, n: int, size: int = 64) -> torch.Tensor:
    """ComfyUI EmptyImage: n frames [n, H, W, 3] of one 0xRRGGBB colour."""
    colour = torch.tensor([(rgb >> 16) & 255, (rgb >> 8) & 255, rgb & 255]) / 255.0
    return colour.view(1, 1, 1, 3).expand(n, size, size, 3).contiguous()


def test_the_shipped_dummy_workflow_skips_the_repeated_frames(node, tiny_handle, taef1, prompts):
    """flux_schnell_stream_batch_dummy: 3 blue then 3 orange 64x64 frames, t_index_list 20,35 of flux.1-schnell
    x50, threshold 0.98, at most 10 skips in a row, seed 42. Repeats have cosine 1 (skip probability 1); blue
    and orange are far apart (probability 0): frames 1, 2, 4, 5 are skipped whatever the seed."""
    from fewstep.nodes.conditioning import to_comfy

    frames = torch.cat([_flat(0x3366CC, 3), _flat(0xEE8833, 3)])
    widgets = dict(t_index_list="20,35", schedule="flux.1-schnell", schedule_steps=50, similarity_threshold=0.98,
                   max_skip_frames=10, seed=42)  # fmt: skip
    with counted_rows(tiny_handle.model) as rows:
        images, report = node().stylize(**_node_args(
            node, model=tiny_handle, tiny_vae=taef1, frames=frames, positive=to_comfy(prompts[0]), **widgets
        ))  # fmt: skip
    assert rows == [1, 2, 1]  # two processed frames through a T = 2 stream: warm-up, steady, flush
    assert "sigmas 0.6, 0.3" in report
    assert "4 of 6 frames skipped" in report and "frames 1, 2, 4, 5 (0-based)" in report
    assert torch.equal(images[1], images[0]) and torch.equal(images[2], images[0])
    assert torch.equal(images[4], images[3]) and torch.equal(images[5], images[3])
    assert not torch.equal(images[3], images[0])


def test_node_errors_name_the_node_and_input(node, tiny_handle, taef1, prompts):
    from fewstep.nodes.conditioning import to_comfy

    base = {"model": tiny_handle, "tiny_vae": taef1, "positive": to_comfy(prompts[0])}
    cases = [
        (
            {"frames": torch.rand(2, 32, 40, 3)},
            r"input 'frames': frame size 40x32 px is not a multiple of 16",
        ),
        ({"frames": torch.rand(2, 32, 32, 3), "t_index_list": "32,16"}, r"input 't_index_list': \[32, 16\]"),
        (
            {"frames": torch.rand(2, 32, 32, 3), "t_index_list": "10,60"},
            r"input 't_index_list': indices \[60\]",
        ),
        (
            {"frames": torch.rand(2, 32, 32, 3), "cfg_mode": "initialize"},
            r"input 'negative': cfg_mode 'initialize'",
        ),
        (
            {"frames": torch.rand(2, 32, 32), "t_index_list": "10"},
            r"input 'frames': expected an IMAGE \(a float tensor \[batch, height, width, channels\]\), got a tensor of shape \[2, 32, 32\]",
        ),
        (
            {"frames": torch.rand(2, 32, 32, 3), "tiny_vae": load_tiny_vae("dummy:taesd", device="cpu")},
            r"input 'tiny_vae': taesd .* 4-channel",
        ),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError, match=rf"^FewStepStreamBatch: {message}"):
            node().stylize(**_node_args(node, **{**base, **extra}))


def test_non_finite_model_output_is_an_error_naming_the_group(taef1):
    """NaN weights (finite frames and prompt) are caught on the first finished group, not streamed out."""
    handle = open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32)
    handle.model.final_layer.linear.bias.data[0] = float("nan")
    stream = _stream(handle, taef1, (make_cond(handle.params, seed=0), make_cond(handle.params, seed=1)),
                     t_index_list=(10, 25))  # fmt: skip
    frames = torch.rand(2, 3, H, W, generator=torch.Generator().manual_seed(0))
    assert stream.push(frames[0]) is None  # warm-up: nothing finished yet
    with pytest.raises(InputError, match=r"input 'model': the denoised latents of input group 0 hold NaN"):
        stream.push(frames[1])


# H = W = 32 px (above): Z-Image a 16x4x4 latent (4 tokens, padded to 32), FLUX.2 a 128x2x2 latent (4 tokens)
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


def _family_stream(handle, vae, pos, neg=None, **config):
    return StreamBatch(
        handle, vae, pos, negative=neg, height=H, width=W, config=StreamConfig(**config), seed=SEED
    )


def _family_latents(handle, n, seed=0):
    fmt = handle.family.latent_format
    shape = (n, fmt.channels, H // fmt.downscale, W // fmt.downscale)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("mode", "sampler", "fb"), [("none", "euler", 1), ("self", "renoise", 1), ("initialize", "euler", 2),
                                ("full", "renoise", 2)],
)  # fmt: skip
def test_every_frame_equals_its_own_denoising(setup, mode, sampler, fb):
    handle, _, pos, neg = setup
    stream = _family_stream(handle, None, pos, neg, t_index_list=(10, 30), cfg_mode=mode, guidance_scale=1.6,
                     sampler=sampler, frame_buffer_size=fb)  # fmt: skip
    groups = 3
    lat = _family_latents(handle, groups * fb)
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
    stream = _family_stream(handle, None, pos, t_index_list=(15, 30, 40))
    lat = _family_latents(handle, 3, seed=2)
    outs = [stream.push_latents(lat[g : g + 1]) for g in range(3)] + stream.flush()
    for o in (o for o in outs if o is not None):
        raw, _ = sample_latent(handle, [pos], fmt.process_out(lat[o.group : o.group + 1]), sigmas=stream.sigmas,
                               seed=SEED)  # fmt: skip
        assert (o.latents - fmt.process_in(raw)).abs().max() <= 1e-4


def test_frames_go_through_the_tiny_ae_exactly(setup):
    handle, vae, pos, _ = setup
    stream = _family_stream(handle, vae, pos, t_index_list=(20, 35))
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
    lat = _family_latents(handle, 1)
    ours = _family_stream(handle, None, padded, t_index_list=(25,)).push_latents(lat).latents
    real = (
        _family_stream(handle, None, TextCondition(context[:, :3]), t_index_list=(25,))
        .push_latents(lat)
        .latents
    )
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
    stream = _family_stream(
        handle, None, pos, neg, t_index_list=(10, 30), cfg_mode="initialize", guidance_scale=1.5
    )
    lat = _family_latents(handle, 2)
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
    stream = _family_stream(handle, vae, pos, t_index_list=(10, 30))
    seq = run_sequential(stream, frames.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    assert torch.allclose(images, seq, atol=1e-4)
