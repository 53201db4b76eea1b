"""Text prompts on the command line: ``--text-encoder DIR`` with ``--prompt`` (``generate``, ``stream``,
``encode``), ``--negative-prompt`` (``generate``), ``--prompt-switch CHUNK:TEXT`` and ``--script`` prompts
(``stream``).

Order: the encoder's folder is checked and its weights sized against the device before anything loads; every
prompt of the run is encoded (each distinct text once, through the process's :data:`PROMPT_CACHE`); the encoder
is closed; only then is the DiT loaded. The two never need to fit the device together.
"""

from __future__ import annotations

import time

from ..engine.errors import InputError
from ..engine.loader import checkpoint_params
from ..engine.ops import COMPUTE_DTYPES
from ..engine.prompt_embeddings import PromptEmbeddingCache
from ..engine.text_encoders import PromptEmbedding, check_max_sequence_length, open_text_encoder
from ..engine.units import format_bytes
from .common import source_of

# one cache for every prompt this process encodes (generate's positive and negative, a stream's switches and
# script prompts): a text repeated within a run is encoded once
PROMPT_CACHE = PromptEmbeddingCache()

TEXT_ENCODER_HELP = (
    "folder of the model family's text encoder(s) and tokenizer(s), as downloaded from Hugging Face (a diffusers "
    "pipeline folder with text_encoder*/ and tokenizer*/, or one encoder's folder), run on --device in --dtype; "
    "needs the transformers package. Every prompt is encoded first, the encoder freed, then the model loaded "
    "(docs/text-encoders.md) (default: none, no text is encoded)"
)


def add_text_encoder_arguments(p, prompt_help: str, negative: bool = False) -> None:
    p.add_argument("--prompt", default=None, metavar="TEXT", help=prompt_help)
    if negative:
        p.add_argument(
            "--negative-prompt",
            default=None,
            metavar="TEXT",
            help="with --text-encoder and --cfg other than 1: the prompt CFG guides away from (default: none)",
        )
    p.add_argument("--text-encoder", default=None, metavar="DIR", help=TEXT_ENCODER_HELP)
    p.add_argument(
        "--max-sequence-length",
        type=int,
        default=None,
        metavar="N",
        help="tokens each prompt is padded or truncated to, 1 to 512 (default: the family's official value: "
        "FLUX.1-schnell 256, FLUX.1-dev / FLUX.2 / Z-Image / Wan 512)",
    )


def check_text_flags(args, cond_flag: str | None = "--cond") -> bool:
    """The prompt flags' combinations; True when this run encodes text."""
    prompt = getattr(args, "prompt", None)
    negative = getattr(args, "negative_prompt", None)
    encoder = getattr(args, "text_encoder", None)
    if prompt is not None and not encoder:
        raise InputError("--prompt", "a text prompt needs --text-encoder DIR (the family's text encoder folder); "
                         "without one, pass embeddings made elsewhere as --cond FILE")  # fmt: skip
    if negative is not None:
        if not encoder:
            raise InputError("--negative-prompt", "needs --text-encoder DIR")
        if getattr(args, "negative_seed", None) is not None:
            raise InputError("--negative-prompt", "give --negative-prompt or --negative-seed, not both")
    if cond_flag and prompt is not None and getattr(args, "cond", None):
        raise InputError("--prompt", f"give --prompt or {cond_flag}, not both")
    if args.max_sequence_length is not None and not encoder:
        raise InputError("--max-sequence-length", "applies to prompts encoded with --text-encoder")
    if args.max_sequence_length is not None:
        check_max_sequence_length(args.max_sequence_length, "--max-sequence-length")
    return bool(encoder)


def encode_texts(
    args, texts: list[str], input_name: str = "--weights"
) -> tuple[dict[str, PromptEmbedding], dict]:
    """Every text of ``texts`` encoded with ``--text-encoder`` for the model ``--model`` / ``--weights`` names
    (read from its header, not loaded); the encoder freed before returning. ``(embeddings by text, report)``."""
    family, params = checkpoint_params(source_of(args), input_name)
    _quiet_transformers()
    before = PROMPT_CACHE.stats()
    started = time.perf_counter()
    encoder = open_text_encoder(
        args.text_encoder, family, params, device=args.device, dtype=COMPUTE_DTYPES[args.dtype],
        max_sequence_length=args.max_sequence_length,
    )  # fmt: skip
    loaded = time.perf_counter()
    try:
        embeddings = {}
        for text in texts:  # a text given twice is a cache hit the second time
            embeddings[text] = PROMPT_CACHE.embed(encoder, text)
    finally:
        encoder.close()
    done = time.perf_counter()
    after = PROMPT_CACHE.stats()
    report = {
        "family": family.name,
        "encoder": encoder.description,
        "folder": encoder.folder.root,
        "settings": encoder.settings,
        "weight_bytes": encoder.weight_bytes,
        "load_s": loaded - started,
        "encode_s": done - loaded,
        "prompts": len(texts),
        "cache_misses": after["misses"] - before["misses"],
        "cache_hits": after["hits"] - before["hits"],
        "cache": after,
    }
    return embeddings, report


def text_encoder_line(report: dict) -> str:
    n = report["prompts"]
    return (
        f"text encoder: {report['encoder']} ({format_bytes(report['weight_bytes'])}), loaded in "
        f"{report['load_s']:.2f} s; {n} prompt{'s' if n != 1 else ''} in {report['encode_s']:.2f} s: "
        f"{report['cache_misses']} encoded, {report['cache_hits']} from the prompt cache; freed before the model "
        "loaded"
    )


def _quiet_transformers() -> None:
    """transformers' own progress bars and warnings would interleave with the CLI's lines (-v keeps its INFO
    logs through the logging module)."""
    try:
        from transformers.utils import logging as tf_logging
    except ImportError:
        return  # open_text_encoder says what to install
    tf_logging.disable_progress_bar()
    tf_logging.set_verbosity_error()
