"""Z-Image sampling end to end: a whole z-image-turbo run against diffusers' ZImagePipeline denoising loop
(optional: it runs when diffusers and transformers are importable), and the caption mask.

The pipeline runs latents in, latents out (``prompt_embeds=``, ``latents=``, ``output_type="latent"``; no text
encoder or VAE). Its "latent" output is the model-space latent; its VAE decode starts with
``latents / scaling_factor + shift_factor`` (Z-Image's AE is FLUX.1's: 0.3611, 0.1159), which is
``FLUX1.process_out``: ComfyUI's raw LATENT, what ours returns.
"""

from __future__ import annotations

import pytest
import torch

from fewstep.engine import FLUX1, InputError, TextCondition, noise_for, open_model, sample_latent
from fewstep.engine.conditioning import real_tokens_only
from fewstep.engine.models import zimage_checkpoint
from fewstep.nodes.conditioning import from_comfy


@pytest.fixture(scope="module")
def handle():
    return open_model("dummy:zimage-tiny", device="cpu", dtype=torch.float32)


def zimage_pipeline(model):
    """diffusers' ZImagePipeline around a ZImageTransformer2DModel holding ``model``'s weights (no text encoder,
    no VAE: latents in, latents out); skips when diffusers cannot give it."""
    diffusers = pytest.importorskip("diffusers", reason="diffusers not installed (optional cross-check)")
    try:
        diffusers.ZImagePipeline  # noqa: B018 - a lazy import: it needs transformers too
    except (AttributeError, ImportError) as err:
        pytest.skip(
            f"diffusers {diffusers.__version__} cannot give ZImagePipeline here: {str(err).strip()[:120]}"
        )
    p = model.params
    ref = diffusers.ZImageTransformer2DModel(**zimage_checkpoint.diffusers_config(p)).eval()
    ref.load_state_dict(model.state_dict(), strict=True)  # the diffusers layout is the official one
    # Z-Image-Turbo's scheduler/scheduler_config.json: FlowMatchEulerDiscreteScheduler, shift 3, no dynamic shift
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    pipe = diffusers.ZImagePipeline(
        scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None, transformer=ref
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run_pipeline(pipe, noise, captions, steps):
    """``captions``: one ``[L_i, 2560]`` tensor per image, the real tokens only (how the pipeline encodes)."""
    return pipe(
        prompt_embeds=captions, height=8 * noise.shape[-2], width=8 * noise.shape[-1], num_inference_steps=steps,
        guidance_scale=0.0, latents=noise.clone(), output_type="latent", return_dict=False,
    )[0]  # fmt: skip


def test_turbo_sampling_matches_diffusers_zimage_pipeline(handle):
    """The preset's own 8 steps (8 forwards) against ZImagePipeline at num_inference_steps=8."""
    pipe = zimage_pipeline(handle.model)
    latent = torch.zeros(1, 16, 10, 12)  # 80x96 px: 30 patches, padded to 32 by both
    seed = 5
    noise = noise_for(latent, seed)
    cap = torch.randn(1, 7, handle.params.cap_feat_dim, generator=torch.Generator().manual_seed(6))
    expected = FLUX1.process_out(_run_pipeline(pipe, noise, [cap[0]], 8))
    ours, report = sample_latent(
        handle, [TextCondition(cap)], latent, seed=seed, steps=8, schedule="z-image-turbo"
    )
    diff = (ours - expected).abs().max().item()
    model_space = (FLUX1.process_in(ours) - FLUX1.process_in(expected)).abs().max().item()
    print(
        f"max abs diff vs diffusers ZImagePipeline (8 steps): {diff:.3g} raw LATENT, {model_space:.3g} model space"
    )
    assert report.model_calls == 8 == len(pipe.scheduler.timesteps)
    assert torch.allclose(torch.tensor(report.sigmas), pipe.scheduler.sigmas, atol=1e-6)
    assert diff <= 1e-4


def test_masked_caption_tokens_are_dropped_as_the_pipeline_drops_them(handle):
    """A conditioning padded 7 -> 12 tokens with ComfyUI's attention_mask samples as the 7 real tokens do, which
    is what the pipeline feeds (``prompt_embeds[i][mask[i]]``): the padding never reaches the DiT."""
    pipe = zimage_pipeline(handle.model)
    latent = torch.zeros(2, 16, 4, 6)
    g = torch.Generator().manual_seed(9)
    real = torch.randn(2, 7, handle.params.cap_feat_dim, generator=g)
    padded = torch.cat([real, 100 * torch.randn(2, 5, handle.params.cap_feat_dim, generator=g)], dim=1)
    mask = torch.cat([torch.ones(2, 7), torch.zeros(2, 5)], dim=1).long()
    (cond,) = from_comfy([[padded, {"attention_mask": mask}]], "positive")
    ours, _ = sample_latent(handle, [cond], latent, seed=1, steps=3, schedule="z-image-turbo")
    expected = FLUX1.process_out(_run_pipeline(pipe, noise_for(latent, 1), list(real), 3))
    assert (ours - expected).abs().max().item() <= 1e-4
    unmasked, _ = sample_latent(
        handle, [TextCondition(padded)], latent, seed=1, steps=3, schedule="z-image-turbo"
    )
    assert not torch.allclose(unmasked, ours, atol=1e-3)  # the padding would have changed the image


def test_real_tokens_only():
    context = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    mask = torch.tensor([[True, False, True, False], [False, True, True, False]])
    kept = real_tokens_only(TextCondition(context, None, 2.0, mask), "positive")
    assert kept.mask is None and kept.guidance == 2.0
    assert torch.equal(kept.context, torch.stack([context[0, [0, 2]], context[1, [1, 2]]]))
    # ComfyUI's own Z-Image encoder does not pad: its all-ones mask is no mask
    (plain,) = from_comfy([[context, {"attention_mask": torch.ones(2, 4, dtype=torch.long)}]], "positive")
    assert plain.mask is None and plain.context is context


def test_bad_masks(handle):
    context = torch.zeros(2, 4, handle.params.cap_feat_dim)
    ragged = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    (cond,) = from_comfy([[context, {"attention_mask": ragged}]], "positive")
    with pytest.raises(
        InputError, match=r"input 'positive': the prompts of this conditioning have \[2, 3\] real"
    ):
        sample_latent(handle, [cond], torch.zeros(2, 16, 4, 4), steps=1, schedule="z-image-turbo")
    empty = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])
    (cond,) = from_comfy([[context, {"attention_mask": empty}]], "negative")
    with pytest.raises(InputError, match=r"input 'negative': the attention_mask of prompt 1 marks no token"):
        real_tokens_only(cond, "negative")
    with pytest.raises(
        InputError, match=r"input 'positive': entry 0: attention_mask is \[2, 3\] but the tokens"
    ):
        from_comfy([[context, {"attention_mask": torch.ones(2, 3)}]], "positive")
    with pytest.raises(
        InputError, match=r"input 'positive': entry 0: attention_mask is a list, not a tensor"
    ):
        from_comfy([[context, {"attention_mask": [1, 1, 1, 1]}]], "positive")


def test_sampler_node_drops_masked_tokens_before_any_worker_sees_them(pack):
    """FewStepSampler puts the conditioning in Z-Image's form itself (a worker pool gets no mask), with its
    errors naming the node."""
    m = pack.NODE_CLASS_MAPPINGS
    (model,) = m["FewStepDiTLoader"]().load("dummy:zimage-tiny")
    g = torch.Generator().manual_seed(3)
    real = torch.randn(1, 5, 2560, generator=g)
    padded = torch.cat([real, torch.randn(1, 3, 2560, generator=g)], dim=1)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]])
    latent = {"samples": torch.zeros(1, 16, 4, 4)}
    args = (0, 2, "z-image-turbo", "euler", 1.0, 1.0)
    masked, _ = m["FewStepSampler"]().sample(model, [[padded, {"attention_mask": mask}]], latent, *args)
    plain, _ = m["FewStepSampler"]().sample(model, [[real, {}]], latent, *args)
    assert torch.equal(masked["samples"], plain["samples"])
    ragged = [
        [padded.repeat(2, 1, 1), {"attention_mask": torch.cat([mask, torch.ones(1, 8, dtype=torch.long)])}]
    ]
    with pytest.raises(
        ValueError, match=r"^FewStepSampler: input 'positive': the prompts of this conditioning"
    ):
        m["FewStepSampler"]().sample(model, ragged, {"samples": torch.zeros(2, 16, 4, 4)}, *args)
