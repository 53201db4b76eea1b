"""FewStepLiveVideo's own checks (nodes/live.py): what it refuses before any pool is allocated, how prompts are
encoded (a connected CLIP, else the synthetic embedding only dummy weights take), that it always re-runs, and that
its shape inputs are the causal sampler's."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_nodes import _default_args, _run

from fewstep.engine.prompt_embeddings import synthetic_text_embedding

LIVE = "FewStepLiveVideo"
TINY = dict(width=48, height=32, chunk_frames=2, window_frames=6, sink_frames=1)


@pytest.fixture(scope="module")
def wan(pack):
    (model,) = _run(pack.NODE_CLASS_MAPPINGS["FewStepDiTLoader"], model_name="dummy:wan-tiny")
    return model


def live_module(pack):
    import sys

    return sys.modules[f"{pack.__name__}.nodes.live"]


def serve(pack, **links):
    """Run the node; a test that does not stop it itself is bounded by max_seconds (not the 3600 s default)."""
    cls = pack.NODE_CLASS_MAPPINGS[LIVE]
    links.setdefault("max_seconds", 60.0)
    return getattr(cls(), cls.FUNCTION)(**_default_args(cls, **links))


class FakeClip:
    """ComfyUI's CLIP as the node uses it: tokenize, then encode into a CONDITIONING."""

    def __init__(self, tokens: int = 7, width: int = 4096):
        self.tokens, self.width = tokens, width
        self.encoded: list[str] = []

    def tokenize(self, text: str):
        return {"text": text}

    def encode_from_tokens_scheduled(self, tokens):
        self.encoded.append(tokens["text"])
        g = torch.Generator().manual_seed(len(tokens["text"]))
        return [
            [
                torch.randn(1, self.tokens, self.width, generator=g, dtype=torch.float16),
                {"pooled_output": None},
            ]
        ]


def test_the_shape_inputs_are_the_causal_samplers(pack):
    live = pack.NODE_CLASS_MAPPINGS[LIVE].INPUT_TYPES()
    sampler = pack.NODE_CLASS_MAPPINGS["FewStepCausalVideoSampler"].INPUT_TYPES()
    for name in ("width", "height", "chunk_frames", "window_frames", "sink_frames", "schedule", "steps"):
        assert live["required"][name] == sampler["required"][name], name
    for name in ("context_noise", "rope", "kv_dtype", "keep_recent_chunks"):
        assert live["optional"][name] == sampler["optional"][name], name
    assert pack.NODE_DISPLAY_NAME_MAPPINGS[LIVE] == "FewStep Live Video"
    cls = pack.NODE_CLASS_MAPPINGS[LIVE]
    assert cls.OUTPUT_NODE and cls.RETURN_TYPES == ("STRING",)
    assert "prompts queued meanwhile wait" in cls.DESCRIPTION


def test_it_always_runs_again_when_queued(pack):
    changed = pack.NODE_CLASS_MAPPINGS[LIVE].IS_CHANGED(max_seconds=10.0)
    assert math.isnan(changed) and changed != changed  # NaN equals nothing: ComfyUI never reuses its output


def test_a_model_that_is_not_wan_is_refused(pack):
    (flux,) = _run(pack.NODE_CLASS_MAPPINGS["FewStepDiTLoader"], model_name="dummy:flux-tiny")
    with pytest.raises(
        ValueError, match=r"^FewStepLiveVideo: input 'model': FewStepLiveVideo runs Wan-family"
    ):
        serve(pack, model=flux)
    assert len(live_module(pack).LIVE_HOSTS) == 0


def test_real_weights_without_a_text_encoder_are_refused_naming_clip(pack, wan):
    real = dataclasses.replace(wan, source="self_forcing_dmd.pt")
    with pytest.raises(ValueError) as err:
        serve(pack, model=real, **TINY)
    assert str(err.value) == (
        "FewStepLiveVideo: input 'clip': the model is self_forcing_dmd.pt, not dummy weights: connect a text "
        "encoder (CLIPLoader with umt5_xxl_fp8_e4m3fn_scaled.safetensors, type wan) so that clients' prompts are "
        "encoded; without one, prompts become synthetic embeddings, which only dummy: models take"
    )


def test_a_clip_input_that_is_no_text_encoder_is_refused(pack, wan):
    with pytest.raises(ValueError, match=r"^FewStepLiveVideo: input 'clip': expected a CLIP text encoder"):
        serve(pack, model=wan, clip="umt5", **TINY)


def test_prompts_without_a_clip_are_the_synthetic_embedding_of_the_text(pack, wan):
    encode = live_module(pack).prompt_encoder(wan, None)
    got = encode("a red fox running through snow")
    expected = synthetic_text_embedding("a red fox running through snow", text_tokens=wan.params.text_len)
    assert torch.equal(got, expected) and got.shape == (1, wan.params.text_len, 4096)


def test_prompts_with_a_clip_are_its_encoding_as_float32_on_the_cpu(pack, wan):
    clip = FakeClip()
    encode = live_module(pack).prompt_encoder(wan, clip)
    got = encode("a fox at night")
    (expected,) = [c for c, _ in clip.encode_from_tokens_scheduled({"text": "a fox at night"})]
    assert got.dtype == torch.float32 and got.device.type == "cpu"
    assert torch.equal(got, expected.float()) and clip.encoded == ["a fox at night"] * 2


def test_a_pool_that_cannot_fit_is_refused_before_anything_is_allocated(pack, wan):
    huge = dict(width=4096, height=4096, chunk_frames=64, window_frames=4096, sink_frames=0)
    with pytest.raises(ValueError, match=r"^FewStepLiveVideo: input 'max_sessions': not one session fits"):
        serve(pack, model=wan, **huge)
    assert len(live_module(pack).LIVE_HOSTS) == 0


def test_a_prompt_the_text_encoder_fails_on_is_that_prompts_error_not_the_runs(pack, wan):
    class BrokenClip(FakeClip):
        def encode_from_tokens_scheduled(self, tokens):
            raise RuntimeError("CUDA out of memory.\nTried to allocate 2 GiB")

    encode = live_module(pack).prompt_encoder(wan, BrokenClip())
    with pytest.raises(ValueError) as err:
        encode("a fox")
    assert type(err.value).__name__ == "InputError" and err.value.input_name == "prompt"
    assert err.value.problem == (
        "the text encoder failed on it (RuntimeError: CUDA out of memory. Tried to allocate 2 GiB)"
    )


def test_a_text_encoder_of_another_model_is_refused_before_serving(pack, wan):
    with pytest.raises(ValueError) as err:
        serve(pack, model=wan, clip=FakeClip(width=768), **TINY)
    assert str(err.value).startswith(
        "FewStepLiveVideo: input 'clip': not the Wan text encoder (umT5-XXL, CLIPLoader type wan): conditioning is "
        "[1, 7, 768]; Wan expects umT5 tokens"
    ), err.value
    assert len(live_module(pack).LIVE_HOSTS) == 0
