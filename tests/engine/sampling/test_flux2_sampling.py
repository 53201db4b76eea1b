"""FLUX.2 sampling end to end: whole runs against diffusers' Flux2KleinPipeline / Flux2Pipeline denoising loops
(optional: they run when diffusers and transformers are importable), the sampler node, and the text mask.

The pipelines run latents in, latents out: ``prompt_embeds=`` and ``latents=`` given, ``output_type="latent"``,
no text encoder. Both take ``latents`` as ``[B, 128, H/16, W/16]`` and pack them one token per latent pixel.
Flux2KleinPipeline's "latent" output is after its un-packing, the VAE batch-norm inverse and the 2x2
un-patchify to 32 channels; the stand-in VAE here has an identity batch-norm (mean 0, var 1, eps 0: exact), and
the pipeline's own ``_patchify_latents`` undoes the un-patchify (a permutation). Flux2Pipeline returns its packed
tokens, which its own ``_unpack_latents_with_ids`` un-packs. Either way that is the ``[B, 128, H/16, W/16]``
latent the transformer sampled, before any batch-norm inverse: ComfyUI's FLUX.2 LATENT, which ours returns.
"""

from __future__ import annotations

import types

import pytest
import torch

from fewstep.engine import TextCondition, noise_for, open_model, sample_latent
from fewstep.engine.models import flux2_checkpoint


def _pipelines():
    diffusers = pytest.importorskip("diffusers", reason="diffusers not installed (optional cross-check)")
    try:
        diffusers.Flux2KleinPipeline  # noqa: B018 - lazy imports: they need transformers too
        diffusers.Flux2Pipeline  # noqa: B018
    except (AttributeError, ImportError) as err:
        pytest.skip(
            f"diffusers {diffusers.__version__} has no FLUX.2 pipelines here: {str(err).strip()[:120]}"
        )
    return diffusers


def _reference_pair(diffusers, preset: str, seed: int = 4):
    """A random diffusers Flux2Transformer2DModel and a handle on the same weights (converted to ours)."""
    handle = open_model(f"dummy:{preset}", device="cpu", dtype=torch.float32)
    p = handle.params
    torch.manual_seed(seed)
    ref = diffusers.Flux2Transformer2DModel(**flux2_checkpoint.diffusers_config(p)).eval()
    with torch.no_grad():
        for t in ref.parameters():  # weights of a trained model's scale, so every block changes the result
            t.normal_(0, 0.1) if t.ndim > 1 else t.normal_(1, 0.2)
    handle.model.load_state_dict(flux2_checkpoint.diffusers_to_official(ref.state_dict()), strict=True)
    return handle, ref


def _scheduler(diffusers):
    # FLUX.2's scheduler config: dynamic (exponential) shifting, so the pipelines' compute_empirical_mu applies
    return diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")


def _identity_bn_vae():
    """The only parts of AutoencoderKLFlux2 the pipelines read on the latent path: its latent batch-norm."""
    bn = types.SimpleNamespace(running_mean=torch.zeros(128), running_var=torch.ones(128))
    return types.SimpleNamespace(bn=bn, config=types.SimpleNamespace(batch_norm_eps=0.0))


def _run_pipeline(pipe, noise, context, steps, **kwargs):
    pipe.set_progress_bar_config(disable=True)
    pipe.vae = _identity_bn_vae()
    out = pipe(
        prompt_embeds=context, height=16 * noise.shape[-2], width=16 * noise.shape[-1],
        num_inference_steps=steps, latents=noise.clone(), output_type="latent", return_dict=False, **kwargs,
    )[0]  # fmt: skip
    if out.ndim == 3:  # Flux2Pipeline returns its packed tokens [B, H*W, 128] for "latent": un-pack them
        return pipe._unpack_latents_with_ids(out, pipe._prepare_latent_ids(noise))
    return pipe._patchify_latents(out)


def test_klein_sampling_matches_diffusers_flux2_klein_pipeline():
    """4 steps of flux.2-klein against Flux2KleinPipeline(is_distilled=True), guidance 1 (no CFG)."""
    diffusers = _pipelines()
    handle, ref = _reference_pair(diffusers, "flux2-tiny")
    latent = torch.zeros(1, 128, 6, 4)  # 96x64 px: 24 tokens
    seed = 11
    noise = noise_for(latent, seed)  # what sample_latent draws for this seed
    context = torch.randn(1, 9, handle.params.context_in_dim, generator=torch.Generator().manual_seed(2))
    pipe = diffusers.Flux2KleinPipeline(
        scheduler=_scheduler(diffusers), vae=None, text_encoder=None, tokenizer=None, transformer=ref,
        is_distilled=True,
    )  # fmt: skip
    expected = _run_pipeline(pipe, noise, context, 4, guidance_scale=1.0)
    ours, report = sample_latent(handle, [TextCondition(context)], latent, seed=seed, schedule="flux.2-klein")
    diff = (ours - expected).abs().max().item()
    print(f"max abs diff vs diffusers Flux2KleinPipeline (4 steps): {diff:.3g}; sigmas {report.sigmas}")
    assert report.model_calls == 4 and len(pipe.scheduler.timesteps) == 4
    assert torch.allclose(torch.tensor(report.sigmas), pipe.scheduler.sigmas, atol=1e-6)
    assert diff <= 1e-4


def test_dev_sampling_matches_diffusers_flux2_pipeline():
    """flux.2-dev (here 3 steps, mu read at 3) with embedded guidance 4 against Flux2Pipeline."""
    diffusers = _pipelines()
    handle, ref = _reference_pair(diffusers, "flux2-tiny-dev", seed=5)
    latent = torch.zeros(1, 128, 4, 4)
    seed = 3
    noise = noise_for(latent, seed)
    context = torch.randn(1, 6, handle.params.context_in_dim, generator=torch.Generator().manual_seed(8))
    pipe = diffusers.Flux2Pipeline(
        scheduler=_scheduler(diffusers), vae=None, text_encoder=None, tokenizer=None, transformer=ref
    )
    expected = _run_pipeline(pipe, noise, context, 3, guidance_scale=4.0)
    ours, report = sample_latent(
        handle, [TextCondition(context, guidance=4.0)], latent, seed=seed, steps=3, schedule="flux.2-dev"
    )
    diff = (ours - expected).abs().max().item()
    print(f"max abs diff vs diffusers Flux2Pipeline (3 steps, guidance 4): {diff:.3g}")
    assert report.model_calls == 3 and diff <= 1e-4


def test_klein_keeps_masked_tokens():
    """A ComfyUI klein conditioning is padded to 512 with a mask marking the padding; FLUX.2 (BFL, ComfyUI)
    attends to every token, so the mask changes nothing."""
    from fewstep.nodes.conditioning import from_comfy

    handle = open_model("dummy:flux2-tiny", device="cpu", dtype=torch.float32)
    context = torch.randn(1, 12, handle.params.context_in_dim, generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(1, 12, dtype=torch.long)
    mask[:, :5] = 1
    (masked,) = from_comfy([[context, {"attention_mask": mask}]], "positive")
    assert masked.mask is not None and masked.mask.sum() == 5
    latent = torch.zeros(1, 128, 2, 2)
    a, _ = sample_latent(handle, [masked], latent, steps=2, schedule="flux.2-klein")
    b, _ = sample_latent(handle, [TextCondition(context)], latent, steps=2, schedule="flux.2-klein")
    assert torch.equal(a, b)
