"""Each family's text encoder against its diffusers pipeline's own ``encode_prompt`` on the same tiny random
encoder and tokenizer (loaded by both from the same folder): embeddings, pooled vectors and masks within 1e-6,
for a short prompt, one longer than the token limit (truncated) and the empty prompt.

FluxPipeline (CLIP-L pooled + T5), Flux2KleinPipeline (Qwen3, layers 9/18/27), ZImagePipeline (Qwen3, chat
template, padding dropped) and WanPipeline (umT5, zeros past the prompt)."""

from __future__ import annotations

import pytest
import torch
from tiny_text_encoders import presets

from fewstep.engine.text_encoders import open_text_encoder

PRESETS = presets()

PROMPTS = {
    "short": "a red fox running through snow at dawn",
    # 300+ words: longer than every limit used below (so each pipeline truncates it)
    "long": " ".join(["portrait of an old man sitting on bench , city street at night"] * 30),
    "empty": "",
}


def _diffusers():
    return pytest.importorskip("diffusers", reason="diffusers not installed (optional cross-check)")


def _tf():
    return pytest.importorskip("transformers")


def _close(ours, theirs):
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    assert (ours - theirs.float()).abs().max().item() <= 1e-6


@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
@pytest.mark.parametrize("length", [256, 512])
def test_flux1_equals_flux_pipeline_encode_prompt(encoder_folders, prompt, length):
    diffusers, tf = _diffusers(), _tf()
    root = encoder_folders["flux"]
    pipe = diffusers.FluxPipeline(
        scheduler=None, vae=None, transformer=None,
        text_encoder=tf.CLIPTextModel.from_pretrained(f"{root}/text_encoder"),
        tokenizer=tf.AutoTokenizer.from_pretrained(f"{root}/tokenizer"),
        text_encoder_2=tf.T5EncoderModel.from_pretrained(f"{root}/text_encoder_2"),
        tokenizer_2=tf.AutoTokenizer.from_pretrained(f"{root}/tokenizer_2"),
    )  # fmt: skip
    with torch.no_grad():
        context, pooled, _ = pipe.encode_prompt(
            prompt, prompt_2=None, device="cpu", max_sequence_length=length
        )
    family, params = PRESETS["flux-tiny"]
    ours = open_text_encoder(root, family, params, max_sequence_length=length).encode(prompt)
    _close(ours.context, context)
    _close(ours.pooled, pooled)
    assert ours.mask is None


def test_flux1_defaults_to_bfl_token_counts(encoder_folders):
    """256 T5 tokens for schnell (no guidance embedding), 512 for dev, as BFL's flux package."""
    family, params = PRESETS["flux-tiny"]
    assert open_text_encoder(encoder_folders["flux"], family, params).settings == {"max_sequence_length": 256}
    _, guided = PRESETS["flux-tiny-guidance"]
    assert open_text_encoder(encoder_folders["flux"], family, guided).settings == {"max_sequence_length": 512}


@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
def test_wan_equals_wan_pipeline_encode_prompt(encoder_folders, prompt):
    diffusers, tf = _diffusers(), _tf()
    root = encoder_folders["wan"]
    pipe = diffusers.WanPipeline(
        tokenizer=tf.AutoTokenizer.from_pretrained(root), text_encoder=tf.UMT5EncoderModel.from_pretrained(root),
        transformer=None, vae=None, scheduler=None,
    )  # fmt: skip
    with torch.no_grad():
        context, _ = pipe.encode_prompt(prompt, do_classifier_free_guidance=False, max_sequence_length=512,
                                        device="cpu")  # fmt: skip
    family, params = PRESETS["wan-tiny"]
    ours = open_text_encoder(root, family, params).encode(prompt)
    _close(ours.context, context)
    real = int(ours.mask.sum())
    assert ours.mask.shape == (1, 512) and ours.mask[0, :real].all() and not ours.mask[0, real:].any()
    assert ours.context[0, real:].abs().max() == 0 and ours.context[0, :real].abs().min() >= 0


def test_wan_cleans_the_prompt_as_wan_does(encoder_folders):
    """HTML entities and runs of whitespace: the same tokens as the clean prompt."""
    family, params = PRESETS["wan-tiny"]
    encoder = open_text_encoder(encoder_folders["wan"], family, params)
    a = encoder.encode("  a red   fox &amp;amp;\n\tsnow ")
    b = encoder.encode("a red fox & snow")
    assert torch.equal(a.context, b.context)


@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
def test_flux2_klein_equals_flux2_klein_pipeline_encode_prompt(encoder_folders, prompt):
    diffusers, tf = _diffusers(), _tf()
    root = encoder_folders["klein"]
    pipe = diffusers.Flux2KleinPipeline(
        scheduler=None, vae=None, transformer=None, text_encoder=tf.Qwen3ForCausalLM.from_pretrained(root),
        tokenizer=tf.AutoTokenizer.from_pretrained(root),
    )  # fmt: skip
    with torch.no_grad():
        context, _ = pipe.encode_prompt(prompt, device="cpu", max_sequence_length=64)
    family, params = PRESETS["flux2-tiny"]
    ours = open_text_encoder(root, family, params, max_sequence_length=64).encode(prompt)
    _close(ours.context, context)
    assert ours.context.shape == (1, 64, 7680) and ours.mask is None


@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
def test_zimage_equals_zimage_pipeline_encode_prompt(encoder_folders, prompt):
    diffusers, tf = _diffusers(), _tf()
    root = encoder_folders["zimage"]
    pipe = diffusers.ZImagePipeline(
        scheduler=None, vae=None, transformer=None, text_encoder=tf.Qwen3ForCausalLM.from_pretrained(root),
        tokenizer=tf.AutoTokenizer.from_pretrained(root),
    )  # fmt: skip
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(prompt, device="cpu", do_classifier_free_guidance=False,
                                       max_sequence_length=48)  # fmt: skip
    family, params = PRESETS["zimage-tiny"]
    ours = open_text_encoder(root, family, params, max_sequence_length=48).encode(prompt)
    (theirs,) = embeds
    _close(ours.context[0], theirs)  # only the real tokens: fewer than 48 unless truncated
    assert ours.mask is None and ours.context.shape[1] <= 48


def test_flux2_dev_system_message_is_bfls():
    """The system message FLUX.2 dev's Mistral encoder is run with: the pipeline's, character for character."""
    _diffusers()
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    from fewstep.engine.text_encoders.flux2 import DEV_SYSTEM_MESSAGE

    assert DEV_SYSTEM_MESSAGE == SYSTEM_MESSAGE


@pytest.mark.parametrize(
    "prompt", ["a red fox [IMG] running through snow", PROMPTS["long"]], ids=["img", "long"]
)
def test_flux2_dev_equals_flux2_pipeline_encode_prompt(tmp_path, prompt):
    """Mistral Small 3.1 through its Pixtral processor (which needs torchvision: skipped without it)."""
    pytest.importorskip(
        "torchvision", reason="transformers' Pixtral processor (FLUX.2 dev's tokenizer) needs it"
    )
    diffusers, tf = _diffusers(), _tf()
    import tiny_text_encoders as tiny

    family, params = PRESETS["flux2-tiny-dev"]
    root = tiny.write_flux2_dev_folder(str(tmp_path / "dev"), params)
    pipe = diffusers.Flux2Pipeline(
        scheduler=None, vae=None, transformer=None,
        text_encoder=tf.Mistral3ForConditionalGeneration.from_pretrained(f"{root}/text_encoder"),
        tokenizer=tf.AutoProcessor.from_pretrained(f"{root}/tokenizer"),
    )  # fmt: skip
    with torch.no_grad():
        context, _ = pipe.encode_prompt(prompt, device="cpu", max_sequence_length=64)
    ours = open_text_encoder(root, family, params, max_sequence_length=64).encode(prompt)
    _close(ours.context, context)
    assert ours.context.shape == (1, 64, 15360)
