"""``python -m fewstep encode``: a text prompt -> the conditioning file ``--cond`` reads, encoded once with the model
family's official text encoder (``engine.text_encoders``), so later runs reuse it without loading the encoder."""

from __future__ import annotations

import json
import os
import time

from ..engine.errors import InputError
from ..engine.models.registry import all_presets
from ..engine.ops import COMPUTE_DTYPES
from .files import save_tensors
from .text_prompts import add_text_encoder_arguments, check_text_flags, encode_texts, text_encoder_line

HELP = "encode a text prompt with the model family's text encoder into a --cond file (context, pooled)"


def add_arguments(p) -> None:
    presets = sorted(all_presets())
    p.add_argument(
        "--model", default="flux.1-schnell", choices=presets, metavar="PRESET",
        help=f"model preset whose conditioning to make (its family and widths; nothing of it is loaded): "
        f"{', '.join(presets)}",
    )  # fmt: skip
    p.add_argument(
        "--weights",
        default="dummy",
        help="'dummy' (the --model preset) or a checkpoint path: its family and widths are read from the file's "
        "header, no weights are loaded",
    )
    add_text_encoder_arguments(p, "the prompt to encode (default: none; required)")
    p.add_argument(
        "--dtype", default="auto", choices=list(COMPUTE_DTYPES),
        help="compute dtype of the text encoder (auto: bf16 on a GPU, fp16 on one without bf16, fp32 on the CPU); "
        "the file holds float32",
    )  # fmt: skip
    p.add_argument(
        "--device", default="auto", help="torch device: cpu, cuda, cuda:1 ... (auto: cuda when available)"
    )
    p.add_argument(
        "--out",
        default="prompt.safetensors",
        help="the conditioning file to write (a .safetensors that --cond reads)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the summary")


def run(args) -> int:
    if args.prompt is None:
        raise InputError("--prompt", "give the prompt to encode: --prompt TEXT")
    if not args.text_encoder:
        raise InputError(
            "--text-encoder", "give the folder of the model family's text encoder: --text-encoder DIR"
        )
    check_text_flags(args, cond_flag=None)
    out = args.out
    if not out.endswith(".safetensors"):
        raise InputError("--out", f"{out}: expected a .safetensors file name (the format --cond reads)")
    if os.path.isdir(out):
        raise InputError("--out", f"{out} is a folder; --out names the file to write")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise InputError("--out", f"the folder {parent} does not exist")
    texts, report = encode_texts(args, [args.prompt], "--model" if args.weights == "dummy" else "--weights")
    embedding = texts[args.prompt]
    t = time.perf_counter()
    tensors = {k: v.contiguous() for k, v in embedding.tensors().items()}
    metadata = {"prompt": args.prompt, "encoder": report["encoder"], "family": report["family"],
                "settings": json.dumps(report["settings"], sort_keys=True), "format": "fewstep.cond/1"}  # fmt: skip
    save_tensors(tensors, out, metadata)
    report["save_s"] = time.perf_counter() - t
    report["out"] = out
    report["tensors"] = {k: list(v.shape) for k, v in tensors.items()}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(text_encoder_line(report))
    shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in tensors.items())
    print(f"wrote {out} ({shapes}); use it as --cond {out}")
    return 0
