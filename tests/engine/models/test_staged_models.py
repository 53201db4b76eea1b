"""One owner per formula in the model families (issue 29): every family's forward is the shared staged forward
(engine.models.staged), and the image pipelines refuse a model through one check (their words, one logic)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fewstep.engine import InputError
from fewstep.engine.handle import ModelHandle
from fewstep.engine.models import flux, flux2, wan, zimage
from fewstep.engine.models.registry import FAMILIES
from fewstep.engine.models.staged import StagedHidden, StagedModel
from fewstep.engine.stream_batch.pipeline import STREAM_BATCH
from fewstep.engine.text_to_image import check_image_model


def _model_and_inputs(name: str):
    """A tiny model of family ``name`` with seeded weights and the inputs of its ``embed``."""
    torch.manual_seed(0)
    if name == "flux":
        model = flux.Flux(flux.PRESETS["flux-tiny-guidance"])
        inputs = flux.random_inputs(model.params, 64, 48, 5)
    elif name == "flux2":
        model = flux2.Flux2(flux2.PRESETS["flux2-tiny-dev"])
        inputs = flux2.random_inputs(model.params, 64, 48, 5)
    elif name == "zimage":
        model = zimage.ZImage(zimage.PRESETS["zimage-tiny"])
        inputs = zimage.random_inputs(model.params, 64, 48, 5)
    else:
        model = wan.Wan(wan.PRESETS["wan-tiny"])
        inputs = {"x": torch.randn(1, 16, 2, 4, 6), "timestep": torch.tensor([500.0]),
                  "context": torch.randn(1, 5, 4096)}  # fmt: skip
    for p in model.parameters():  # zero-initialised parameters (pad tokens, gates) would hide a wrong order
        p.data.normal_(0, 0.2)
    return model.eval(), inputs


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_runs_the_shared_staged_forward(name):
    model, inputs = _model_and_inputs(name)
    assert isinstance(model, StagedModel)
    with torch.no_grad():
        reference = model(**inputs)
        h = model.embed(**inputs)
        assert isinstance(h, StagedHidden)
        # any split of the stack, block by block included, is the whole forward bit for bit
        for split in range(model.num_blocks + 1):
            assert torch.equal(
                model.finish(model.run_blocks(model.run_blocks(h, 0, split), split)), reference
            )
        by_block = h
        for i in range(model.num_blocks):
            by_block = model.run_blocks(by_block, i, i + 1)
        assert torch.equal(model.finish(by_block), reference)
        assert torch.equal(model(**inputs, block_runner=lambda m, hidden: m.run_blocks(hidden)), reference)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_run_blocks_checks_cancel_before_each_block_and_leaves_its_input_alone(name):
    model, inputs = _model_and_inputs(name)
    calls = []
    with torch.no_grad():
        h = dataclasses.replace(model.embed(**inputs), interrupt_check=lambda: calls.append(1))
        before = {f.name: getattr(h, f.name) for f in dataclasses.fields(h)}
        model.run_blocks(h)
    assert len(calls) == model.num_blocks
    assert all(getattr(h, k) is v for k, v in before.items())  # the caller's state is not written to


def test_num_blocks_counts_the_stacks_each_family_names():
    counts = {
        "flux": flux.Flux(flux.PRESETS["flux-tiny"]).num_blocks,
        "flux2": flux2.Flux2(flux2.PRESETS["flux2-tiny"]).num_blocks,
        "zimage": zimage.ZImage(zimage.PRESETS["zimage-tiny"]).num_blocks,  # the layers, not the refiners
        "wan": wan.Wan(wan.PRESETS["wan-tiny"]).num_blocks,
    }
    assert counts == {"flux": 4, "flux2": 4, "zimage": 2, "wan": 2}


def test_head_split_errors_keep_each_family_s_words():
    with pytest.raises(ValueError, match=r"^hidden size 65 is not divisible by 2 heads$"):
        flux.Flux(dataclasses.replace(flux.PRESETS["flux-tiny"], hidden_size=65))
    with pytest.raises(ValueError, match=r"^axes_dim \(8, 8, 8, 4\) does not sum to the head size 32$"):
        flux2.Flux2(dataclasses.replace(flux2.PRESETS["flux2-tiny"], axes_dim=(8, 8, 8, 4)))
    with pytest.raises(ValueError, match=r"^dim 65 is not divisible by 2 heads$"):
        zimage.ZImage(dataclasses.replace(zimage.PRESETS["zimage-tiny"], dim=65))
    with pytest.raises(ValueError, match=r"^axes_dims \(8, 12, 8\) does not sum to the head size 32$"):
        zimage.ZImage(dataclasses.replace(zimage.PRESETS["zimage-tiny"], axes_dims=(8, 12, 8)))


def test_missing_guidance_names_the_family():
    for model, inputs, name in (
        (flux.Flux(flux.PRESETS["flux-tiny-guidance"]), flux.random_inputs, "FLUX"),
        (flux2.Flux2(flux2.PRESETS["flux2-tiny-dev"]), flux2.random_inputs, "FLUX.2"),
    ):
        kwargs = inputs(model.params, 32, 32, 3)
        del kwargs["guidance"]
        with pytest.raises(ValueError, match=rf"^this {name} model has a guidance embedding: pass guidance$"):
            model(**kwargs)


def _handle(model) -> ModelHandle:
    return ModelHandle(model=model, source="test", dtype=torch.float32)


def test_one_image_model_check_words_each_pipeline_as_before():
    video = _handle(wan.Wan(wan.PRESETS["wan-tiny"]))
    with pytest.raises(InputError) as sampler:
        check_image_model(video)
    assert str(sampler.value) == (
        "input 'model': this sampler runs image DiTs (FLUX.1, FLUX.2, Z-Image); wan-tiny is a wan video model: use "
        "the causal video sampler (FewStepCausalVideoSampler, `python -m fewstep stream`)"
    )
    with pytest.raises(InputError) as stream:
        check_image_model(video, use=STREAM_BATCH)
    assert str(stream.value) == (
        "input 'model': the stream batch runs FLUX-family image DiTs and Z-Image (img2img per frame); wan is a "
        "video model: use the causal video sampler"
    )

    variant = _handle(zimage.ZImage(dataclasses.replace(zimage.PRESETS["zimage-tiny"], in_channels=32)))
    with pytest.raises(InputError) as sampler:
        check_image_model(variant, "--weights")
    assert str(sampler.value) == (
        "input '--weights': this checkpoint takes 32 input channels per token (an inpainting/control variant); "
        "text-to-image sampling of Z-Image (Tongyi S3-DiT) needs the 16-channel flux1 latent"
    )
    with pytest.raises(InputError) as stream:
        check_image_model(variant, use=STREAM_BATCH)
    assert str(stream.value) == (
        "input 'model': this checkpoint takes 32 input channels per token (an inpainting/control variant); the "
        "stream batch needs the 16-channel flux1 latent of Z-Image (Tongyi S3-DiT)"
    )
    check_image_model(
        _handle(flux.Flux(flux.PRESETS["flux-tiny"])), use=STREAM_BATCH
    )  # an image model passes
