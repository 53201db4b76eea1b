"""Tiny random text encoders and tokenizers of the official architectures, written to folders in the Hugging Face
/ diffusers layout, so the tests load them the way a user's download is loaded (``transformers`` from local files).

Each builder is seeded (the same weights every call) and writes in well under a second. Widths follow the DiT
presets (the tiny presets keep the real conditioning widths: T5 / umT5 4096, CLIP-L 768, Qwen3-4B 2560 (x 3 layers
for klein: 7680), Mistral 5120 (x 3: 15360)); depths and heads are tiny, except that FLUX.2's encoders have the
layers their stacked hidden states are read from (27 for klein, 30 for dev).

The tokenizers are word-level over a small vocabulary (``WORDS``; anything else is the unknown token), built with
the ``tokenizers`` library and saved as transformers fast tokenizers, with each family's special tokens and, for
the Qwen3 ones, a chat template with Qwen3's turn format and its ``enable_thinking`` switch.
"""

from __future__ import annotations

import os

import torch

WORDS = (
    "a",
    "red",
    "fox",
    "running",
    "through",
    "snow",
    "at",
    "dawn",
    "blue",
    "sky",
    "over",
    "the",
    "quiet",
    "lake",
    "with",
    "mountains",
    "in",
    "background",
    "cat",
    "dog",
    "portrait",
    "of",
    "an",
    "old",
    "man",
    "sitting",
    "on",
    "bench",
    "city",
    "street",
    "night",
    "neon",
    "lights",
    "rain",
    "reflections",
    "forest",
    "path",
    "autumn",
    "leaves",
    "golden",
    "hour",
    "photo",
    "painting",
    "oil",
    "watercolor",
    "sketch",
    ".",
    ",",
    "!",
)

QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def _tokenizer(specials: list[str], unk: str, template: tuple[str, str] | None = None):
    """A word-level fast tokenizer: ``specials`` first (ids 0..), then ``WORDS``; ``template`` = (the single
    sequence's post-processing pattern, its special tokens) adds BOS / EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(specials)}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    if template is not None:
        pattern, names = template
        tok.post_processor = processors.TemplateProcessing(
            single=pattern, special_tokens=[(n, vocab[n]) for n in names]
        )
    return tok, vocab


def _save_tokenizer(tok, path: str, **special) -> None:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(path)


def _save_model(model, path: str) -> None:
    with torch.no_grad():  # weights of a trained model's scale, so every layer changes the result
        for name, t in model.named_parameters():
            t.normal_(0, 0.02) if t.ndim > 1 else t.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)


def write_clip(path: str, width: int, seed: int = 0) -> str:
    from transformers import CLIPTextConfig, CLIPTextModel

    specials = ["<|startoftext|>", "<|endoftext|>", "<unk>"]
    tok, vocab = _tokenizer(
        specials, "<unk>", ("<|startoftext|> $A <|endoftext|>", ["<|startoftext|>", "<|endoftext|>"])
    )
    _save_tokenizer(tok, path, bos_token="<|startoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                    unk_token="<unk>", model_max_length=77)  # fmt: skip
    torch.manual_seed(seed)
    config = CLIPTextConfig(
        vocab_size=len(vocab), hidden_size=width, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1, projection_dim=width,
    )  # fmt: skip
    _save_model(CLIPTextModel(config), path)
    return path


def _write_t5_like(path: str, width: int, seed: int, umt5: bool) -> str:
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    specials = ["<pad>", "</s>", "<unk>"]
    tok, vocab = _tokenizer(specials, "<unk>", ("$A </s>", ["</s>"]))
    _save_tokenizer(tok, path, eos_token="</s>", pad_token="<pad>", unk_token="<unk>", model_max_length=512)
    torch.manual_seed(seed)
    cls_config, cls_model = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    config = cls_config(
        vocab_size=len(vocab), d_model=width, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0,
    )  # fmt: skip
    _save_model(cls_model(config), path)
    return path


def write_t5(path: str, width: int = 4096, seed: int = 1) -> str:
    return _write_t5_like(path, width, seed, umt5=False)


def write_umt5(path: str, width: int = 4096, seed: int = 2) -> str:
    return _write_t5_like(path, width, seed, umt5=True)


def write_qwen3(path: str, hidden: int, layers: int, seed: int = 3) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<unk>", "user", "assistant",
                "system"]  # fmt: skip
    tok, vocab = _tokenizer(specials, "<unk>")
    _save_tokenizer(tok, path, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>",
                    model_max_length=131072, chat_template=QWEN3_CHAT_TEMPLATE)  # fmt: skip
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(vocab), hidden_size=hidden, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
        tie_word_embeddings=True,
    )  # fmt: skip
    _save_model(Qwen3ForCausalLM(config), path)
    return path


def write_flux1_folder(root: str, params) -> str:
    """A FLUX.1 pipeline folder: CLIP-L in text_encoder/ + tokenizer/, T5 in text_encoder_2/ + tokenizer_2/."""
    for sub, tsub, write, width in (("text_encoder", "tokenizer", write_clip, params.vec_in_dim),
                                    ("text_encoder_2", "tokenizer_2", write_t5, params.context_in_dim)):  # fmt: skip
        write(os.path.join(root, sub), width)
        os.replace(os.path.join(root, sub, "tokenizer.json"), os.path.join(root, "_t.json"))
        os.makedirs(os.path.join(root, tsub), exist_ok=True)
        for name in os.listdir(os.path.join(root, sub)):
            if name.startswith(("tokenizer", "special_tokens", "chat_template")):
                os.replace(os.path.join(root, sub, name), os.path.join(root, tsub, name))
        os.replace(os.path.join(root, "_t.json"), os.path.join(root, tsub, "tokenizer.json"))
    return root


def write_wan_folder(root: str, params) -> str:
    """A Wan pipeline's text encoder as one folder (config, weights and tokenizer together)."""
    return write_umt5(root, params.text_dim)


def write_klein_folder(root: str, params) -> str:
    """FLUX.2 klein's Qwen3 (27+ layers: the pipeline reads layers 9, 18, 27) of width context_in_dim / 3."""
    return write_qwen3(root, params.context_in_dim // 3, layers=28)


def write_zimage_folder(root: str, params) -> str:
    return write_qwen3(root, params.cap_feat_dim, layers=3)


def presets():
    from fewstep.engine.models.registry import all_presets

    return all_presets()


MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = message['content'][0]['text'] %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{- text + eos_token }}{%- endif %}{%- endfor %}"
)


def write_flux2_dev_folder(root: str, params) -> str:
    """FLUX.2 dev's pipeline layout: a tiny Mistral3ForConditionalGeneration (31 text layers: the pipeline reads
    10, 20 and 30) in text_encoder/ and its Pixtral processor in tokenizer/ (transformers' Pixtral processor needs
    torchvision)."""
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralImageProcessor,
        PixtralProcessor,
        PixtralVisionConfig,
        PreTrainedTokenizerFast,
    )

    specials = ["<s>", "</s>", "<unk>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
                "[IMG_BREAK]", "[IMG_END]"]  # fmt: skip
    tok, vocab = _tokenizer(specials, "<unk>")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", model_max_length=131072)  # fmt: skip
    PixtralProcessor(
        image_processor=PixtralImageProcessor(), tokenizer=fast, chat_template=MISTRAL_CHAT_TEMPLATE, patch_size=4,
        image_token="[IMG]", image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]",
    ).save_pretrained(os.path.join(root, "tokenizer"))  # fmt: skip
    text = MistralConfig(
        vocab_size=len(vocab), hidden_size=params.context_in_dim // 3, intermediate_size=32, num_hidden_layers=31,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
    )  # fmt: skip
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=32, patch_size=4, head_dim=8)  # fmt: skip
    torch.manual_seed(4)
    config = Mistral3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                            image_token_index=vocab["[IMG]"], spatial_merge_size=2)  # fmt: skip
    _save_model(Mistral3ForConditionalGeneration(config), os.path.join(root, "text_encoder"))
    return root
