"""Finding, sizing and loading a text encoder from a local folder: the Hugging Face / diffusers layout a user
downloaded (a pipeline folder with ``text_encoder*/`` and ``tokenizer*/``, or one encoder's folder holding its
``config.json``, weights and tokenizer files). Nothing is downloaded: ``transformers`` is asked for local files
only, and a folder without them is an error naming the flag and what was expected there."""

from __future__ import annotations

import json
import logging
import math
import os

import torch

from ..errors import InputError
from ..preflight import LEDGER, check_fits
from ..weights import SAFETENSORS_DTYPES, safetensors_header
from .base import EncoderFolder

log = logging.getLogger(__name__)

CONFIG = "config.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin")
# what a tokenizer folder holds (any one): the fast tokenizer, its config, or a slow tokenizer's vocabulary
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "spiece.model", "vocab.json", "tekken.json")
SINGLE_FILE_HINT = (
    "a single-file text encoder (ComfyUI's t5xxl_fp16.safetensors, clip_l.safetensors, qwen_3_4b.safetensors...) "
    "has no tokenizer or config: give the folder of the model's Hugging Face / diffusers download instead (see "
    "docs/text-encoders.md)"
)


def _is_encoder_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG))


def _has_weights(path: str) -> bool:
    return any(name.endswith(WEIGHT_SUFFIXES) for name in os.listdir(path))


def _is_tokenizer_dir(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def _check_encoder_dir(path: str, what: str, input_name: str) -> str:
    if not os.path.isdir(path) or not _is_encoder_dir(path) or not _has_weights(path):
        raise InputError(
            input_name,
            f"{path} holds no text encoder ({what}): expected a folder with config.json and *.safetensors "
            "(a Hugging Face model download, or a diffusers pipeline's text_encoder/ folder)",
        )
    return path


def _check_tokenizer_dir(path: str, what: str, input_name: str) -> str:
    if not _is_tokenizer_dir(path):
        raise InputError(
            input_name,
            f"{path} holds no tokenizer ({what}): expected one of {', '.join(TOKENIZER_FILES)} (a Hugging Face "
            "model download, or a diffusers pipeline's tokenizer/ folder)",
        )
    return path


def find_encoder_folder(
    path: str, encoders: tuple[str, ...], input_name: str = "--text-encoder"
) -> EncoderFolder:
    """The encoder and tokenizer folders under ``path`` for a family needing ``encoders`` (their names, for the
    messages: ``("CLIP-L", "T5-XXL")`` for FLUX.1, one name elsewhere).

    Two encoders: ``path`` is a pipeline folder with ``text_encoder/``, ``tokenizer/``, ``text_encoder_2/`` and
    ``tokenizer_2/`` (FLUX.1's diffusers layout). One encoder: a pipeline folder with ``text_encoder/`` and
    ``tokenizer/``, or the encoder's own folder (``config.json``, weights and tokenizer files together)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise InputError(input_name, f"{path} does not exist; expected the folder of a text encoder download")
    if not os.path.isdir(path):
        raise InputError(input_name, f"{path} is a file, not a folder; {SINGLE_FILE_HINT}")
    root = os.path.realpath(path)
    sub = lambda name: os.path.join(root, name)  # noqa: E731
    if len(encoders) == 2:
        first, second = encoders
        if not os.path.isdir(sub("text_encoder_2")):
            raise InputError(
                input_name,
                f"{path} holds no {first} + {second} pair: expected a pipeline folder with text_encoder/ ({first}),"
                f" tokenizer/, text_encoder_2/ ({second}) and tokenizer_2/ (the diffusers layout of "
                "black-forest-labs/FLUX.1-schnell or FLUX.1-dev)",
            )
        return EncoderFolder(
            root,
            _check_encoder_dir(sub("text_encoder"), first, input_name),
            _check_tokenizer_dir(sub("tokenizer"), first, input_name),
            _check_encoder_dir(sub("text_encoder_2"), second, input_name),
            _check_tokenizer_dir(sub("tokenizer_2"), second, input_name),
        )
    (name,) = encoders
    if os.path.isdir(sub("text_encoder")):
        return EncoderFolder(
            root,
            _check_encoder_dir(sub("text_encoder"), name, input_name),
            _check_tokenizer_dir(sub("tokenizer"), name, input_name),
        )
    return EncoderFolder(
        root, _check_encoder_dir(root, name, input_name), _check_tokenizer_dir(root, name, input_name)
    )


def read_config(path: str, input_name: str = "--text-encoder") -> dict:
    """``config.json`` of an encoder folder (checked by :func:`find_encoder_folder`)."""
    try:
        with open(os.path.join(path, CONFIG), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise InputError(input_name, f"cannot read {os.path.join(path, CONFIG)}: {err}") from None
    if not isinstance(config, dict):
        raise InputError(input_name, f"{os.path.join(path, CONFIG)} is not a JSON object")
    return config


def weight_bytes(path: str, dtype: torch.dtype, input_name: str = "--text-encoder") -> int:
    """What an encoder folder's weights take once loaded in ``dtype``: each floating tensor of the safetensors
    headers at ``dtype``'s size, other tensors at their own (nothing is read but the headers); ``.bin`` files by
    their size."""
    from safetensors import SafetensorError

    item = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name in sorted(os.listdir(path)):
        file = os.path.join(path, name)
        if name.endswith(".safetensors"):
            try:
                header = safetensors_header(file)
            except (SafetensorError, OSError, ValueError) as err:
                raise InputError(input_name, f"{file} is not a readable safetensors file: {err}") from None
            for stored, shape in header.values():
                stored_dtype = SAFETENSORS_DTYPES.get(stored, torch.float32)
                size = item if stored_dtype.is_floating_point else stored_dtype.itemsize
                total += math.prod(shape) * size
        elif name.endswith(".bin"):
            total += os.path.getsize(file)
    return total


def preflight(
    folder: EncoderFolder, dtype: torch.dtype, device: torch.device | str, input_name: str = "--text-encoder"
) -> int:
    """Refuse an encoder that cannot fit ``device`` before any of it is loaded; its weight bytes."""
    parts = {"text encoder weights": weight_bytes(folder.text_encoder, dtype, input_name)}
    if folder.text_encoder_2:
        parts["second text encoder weights"] = weight_bytes(folder.text_encoder_2, dtype, input_name)
    check_fits(
        parts,
        device,
        input_name,
        hint="Encode with --dtype bf16, on another device, or once with `python -m fewstep encode` and pass the "
        "file as --cond",
    )
    return sum(parts.values())


def load_model(class_name: str, path: str, dtype: torch.dtype, device, input_name: str = "--text-encoder"):
    """``transformers.<class_name>.from_pretrained(path)`` from local files only, on ``device`` in ``dtype``, in
    eval mode, counted in the memory ledger while alive."""
    transformers = import_transformers(input_name)
    cls = getattr(transformers, class_name)
    try:
        model = cls.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise InputError(
            input_name, f"cannot load a {class_name} from {path}: {str(err).strip()[:400]}"
        ) from None
    model = model.to(device).eval().requires_grad_(False)
    log.info("loaded %s from %s on %s", class_name, path, device)
    return LEDGER.hold_model(model)


def load_tokenizer(path: str, input_name: str = "--text-encoder", processor: bool = False):
    """``AutoTokenizer`` (or ``AutoProcessor``) from local files only."""
    transformers = import_transformers(input_name)
    cls = transformers.AutoProcessor if processor else transformers.AutoTokenizer
    try:
        return cls.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(
            input_name, f"cannot load the tokenizer in {path}: {str(err).strip()[:400]}"
        ) from None


def import_transformers(input_name: str = "--text-encoder"):
    try:
        import transformers
    except ImportError:
        raise InputError(
            input_name,
            "text encoders need the transformers package: pip install 'comfyui-fewstep[text]' (or pip install "
            "transformers); or encode elsewhere and pass the file as --cond",
        ) from None
    return transformers


def config_width(config: dict, input_name: str = "--text-encoder") -> int:
    """The hidden width of an encoder config (``hidden_size`` / ``d_model``; a multimodal model's ``text_config``)."""
    config = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    for key in ("hidden_size", "d_model"):
        if isinstance(config.get(key), int):
            return config[key]
    raise InputError(input_name, "its config.json names no hidden_size / d_model")


def config_kind(config: dict) -> str:
    """``model_type`` of an encoder config, or of its ``text_config`` (Mistral3 names its language model there)."""
    return str(config.get("model_type", "unknown"))


def check_width(
    path: str,
    kind: str,
    makes: int,
    needs: int,
    needs_what: str,
    input_name: str = "--text-encoder",
    what="context",
) -> None:
    """Refuse, before loading, an encoder whose conditioning is not as wide as the model reads it (another
    family's encoder, or another size of the same family's): named, with both widths."""
    if makes != needs:
        raise InputError(
            input_name,
            f"{path} holds a {kind} text encoder that makes {makes}-wide {what}; this model needs {needs} "
            f"({needs_what})",
        )


# config.json's model_type -> the encoder's name and the DiT families it belongs to, for messages
KINDS = {
    "clip_text_model": "CLIP text (FLUX.1's CLIP-L)",
    "clip": "CLIP (FLUX.1 uses its text model, CLIP-L)",
    "t5": "T5 (FLUX.1's T5-XXL)",
    "umt5": "umT5 (Wan 2.1's umT5-XXL)",
    "qwen3": "Qwen3 (Z-Image's Qwen3-4B, FLUX.2 klein's Qwen3-4B / 8B)",
    "mistral3": "Mistral 3 (FLUX.2 dev's Mistral Small 3.1)",
}


def check_kind(path: str, config: dict, accepted: tuple[str, ...], needs_what: str, input_name: str) -> None:
    """Refuse, before loading, a folder holding another kind of encoder than the model needs."""
    kind = config_kind(config)
    if kind not in accepted:
        held = KINDS.get(kind, f"{kind!r} model")
        raise InputError(input_name, f"{path} holds a {held} text encoder; this model needs {needs_what}")


def checked_encoder(
    path: str,
    name: str,
    kinds: tuple[str, ...],
    needs_width: int,
    needs_what: str,
    dtype: torch.dtype,
    device,
    input_name: str,
    layers: int = 1,
) -> tuple[EncoderFolder, int, int]:
    """A one-encoder family's folder, checked before anything loads: found, of an accepted kind (``kinds``), as
    wide as the model reads (``layers`` hidden-state layers stacked side by side), fitting the device.
    ``(folder, width, weight_bytes)``."""
    folder = find_encoder_folder(path, (name,), input_name)
    config = read_config(folder.text_encoder, input_name)
    check_kind(folder.text_encoder, config, kinds, needs_what, input_name)
    width = layers * config_width(config, input_name)
    kind = KINDS.get(config_kind(config), name).split(" (")[0]
    stacked = f" ({layers} layers stacked)" if layers > 1 else ""
    check_width(folder.text_encoder, kind + stacked, width, needs_width, needs_what, input_name)
    return folder, width, preflight(folder, dtype, device, input_name)
