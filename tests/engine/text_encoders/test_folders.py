"""Finding, checking and sizing an encoder folder before anything is loaded: missing pieces, another family's
encoder, a width the model does not read, a folder too large for the device; and the engine API end to end
(``open_text_encoder`` + ``PromptEmbeddingCache.embed``)."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch
from tiny_text_encoders import presets

from fewstep.engine.errors import InputError
from fewstep.engine.prompt_embeddings import PromptEmbeddingCache
from fewstep.engine.text_encoders import folders as folder_module
from fewstep.engine.text_encoders import open_text_encoder

PRESETS = presets()


def _open(path, preset, **kw):
    family, params = PRESETS[preset]
    return open_text_encoder(path, family, params, **kw)


@pytest.fixture
def nothing_loads(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the checks passed")

    monkeypatch.setattr(folder_module, "load_model", refuse)
    monkeypatch.setattr(folder_module, "load_tokenizer", refuse)
    for module in ("flux1", "flux2", "zimage", "wan"):
        mod = __import__(f"fewstep.engine.text_encoders.{module}", fromlist=["x"])
        monkeypatch.setattr(mod, "load_model", refuse)
        monkeypatch.setattr(mod, "load_tokenizer", refuse)


def test_a_file_or_a_missing_folder_is_refused(tmp_path, nothing_loads):
    single = tmp_path / "t5xxl_fp16.safetensors"
    single.write_bytes(b"x")
    with pytest.raises(InputError, match=r"is a file, not a folder; a single-file text encoder \(ComfyUI's "):
        _open(single, "wan-tiny")
    with pytest.raises(InputError, match="does not exist; expected the folder of a text encoder download"):
        _open(tmp_path / "nope", "wan-tiny")


def test_a_folder_without_weights_or_tokenizer_is_refused(tmp_path, encoder_folders, nothing_loads):
    no_tok = tmp_path / "no_tokenizer"
    shutil.copytree(encoder_folders["wan"], no_tok)
    for name in os.listdir(no_tok):
        if name.startswith(("tokenizer", "special_tokens")):
            os.remove(no_tok / name)
    with pytest.raises(InputError) as err:
        _open(no_tok, "wan-tiny")
    assert str(err.value) == (
        f"input '--text-encoder': {os.path.realpath(no_tok)} holds no tokenizer (umT5-XXL): expected one of "
        "tokenizer.json, tokenizer_config.json, spiece.model, vocab.json, tekken.json (a Hugging Face model "
        "download, or a diffusers pipeline's tokenizer/ folder)"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        InputError, match=r"holds no text encoder \(umT5-XXL\): expected a folder with config.json"
    ):
        _open(empty, "wan-tiny")


def test_the_width_is_checked_before_loading(encoder_folders, nothing_loads):
    family, params = PRESETS["wan-tiny"]
    narrow = dataclasses.replace(params, text_dim=1024)
    with pytest.raises(InputError) as err:
        open_text_encoder(encoder_folders["wan"], family, narrow)
    assert str(err.value) == (
        f"input '--text-encoder': {os.path.realpath(encoder_folders['wan'])} holds a umT5 text encoder that makes "
        "4096-wide context; this model needs 1024 (umT5-XXL (context 1024))"
    )
    family, dev = PRESETS["flux2-tiny-dev"]
    with pytest.raises(
        InputError, match=r"holds a Qwen3 .* text encoder; this model needs Mistral Small 3.1"
    ):
        open_text_encoder(encoder_folders["klein"], family, dev)


def test_an_encoder_too_large_for_the_device_is_refused_before_loading(
    encoder_folders, nothing_loads, monkeypatch
):
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", "0.001")  # 1 MB: the tiny T5 alone is 16 MiB in float32
    with pytest.raises(InputError, match=r"input '--text-encoder': this needs about .*text encoder weights .* refused "
                       "before allocating"):  # fmt: skip
        _open(encoder_folders["flux"], "flux-tiny", dtype=torch.float32)


def test_weight_bytes_come_from_the_headers(encoder_folders):
    from safetensors.torch import load_file

    path = encoder_folders["wan"]
    stored = sum(t.numel() for t in load_file(os.path.join(path, "model.safetensors")).values())
    assert folder_module.weight_bytes(path, torch.float32) == 4 * stored
    assert folder_module.weight_bytes(path, torch.bfloat16) == 2 * stored


def test_the_engine_api_through_the_prompt_cache(encoder_folders):
    encoder = _open(encoder_folders["zimage"], "zimage-tiny")
    cache = PromptEmbeddingCache()
    first = cache.embed(encoder, "a red fox")
    assert cache.embed(encoder, "a red fox") is first and cache.stats()["hits"] == 1
    assert first.context.dtype == torch.float32 and first.context.device.type == "cpu"
    assert (
        encoder.key == f"zimage|{os.path.realpath(encoder_folders['zimage'])}|float32|max_sequence_length=512"
    )
    cond = first.condition()
    assert torch.equal(cond.context, first.context) and cond.pooled is None
    encoder.close()
    assert cache.embed(encoder, "a red fox") is first  # a cached prompt needs no encoder


@pytest.mark.parametrize("length", [0, -1, 513, 10**9, 3.0, True])
def test_a_token_count_outside_1_to_512_is_refused_before_loading(encoder_folders, nothing_loads, length):
    with pytest.raises(InputError) as err:
        _open(encoder_folders["wan"], "wan-tiny", max_sequence_length=length)
    assert str(err.value) == (
        "input 'max_sequence_length': expected an integer from 1 to 512 (the longest prompt the official pipelines "
        f"encode), got {length!r}"
    )
