"""Arguments and helpers shared by CLI commands."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import sys

import torch

from ..engine.attention import BACKENDS as ATTENTION_BACKENDS
from ..engine.checks import check_finite_number, check_image_size
from ..engine.compile.options import COMPILE_BACKENDS, COMPILE_MODES, GRAPH_MODES, CompileConfig
from ..engine.conditioning import TextCondition
from ..engine.errors import InputError
from ..engine.loader import DUMMY_PREFIX
from ..engine.lora import apply_lora
from ..engine.models.registry import Family, all_presets
from ..engine.ops import COMPUTE_DTYPES, WEIGHT_DTYPES
from ..engine.sampling import SAMPLERS, SCHEDULES
from ..engine.vae.tiny import variants_for
from ..engine.weights import check_weights_file
from .files import read_tensors, tensor_named


class DeprecatedAlias(argparse.Action):
    """An old spelling of a renamed flag: same meaning, stored under the new flag's dest, with a warning. Hidden
    from --help (the new name is the one documented)."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"warning: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


class RenamedUnit(argparse.Action):
    """An old flag whose name now means another unit elsewhere: refused, naming the flag to use, instead of
    being read silently in a unit the user did not mean."""

    def __init__(self, option_strings, dest, message: str, **kwargs):
        super().__init__(option_strings, argparse.SUPPRESS, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                         **kwargs)  # fmt: skip
        self.message = message

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(self.message.format(value=values))


def add_deprecated_alias(p: argparse.ArgumentParser, old: str, new: str, dest: str, type=int) -> None:
    p.add_argument(old, dest=dest, type=type, action=DeprecatedAlias, new=new)


def add_text_tokens_argument(p: argparse.ArgumentParser, help: str) -> None:
    """``--text-tokens`` (plan's name for the same count; ``--tokens`` before)."""
    p.add_argument("--text-tokens", type=int, default=64, help=help)
    add_deprecated_alias(p, "--tokens", "--text-tokens", "text_tokens")


def add_model_arguments(
    p: argparse.ArgumentParser,
    presets,
    default: str,
    model_help: str,
    checkpoints: str | None = None,
    elsewhere: dict[str, str] | None = None,
) -> None:
    """The flags that say which diffusion model a command loads and how it is stored and run: ``--model`` (one of
    ``presets``), ``--weights``, ``--dtype``, ``--weight-dtype``, ``--device``. ``checkpoints``: the checkpoint
    layouts ``--weights`` reads, where the command names them. ``elsewhere``: presets of other commands -> the
    one-line hint given when one of them is passed here."""
    names = sorted(presets)
    # the presets are listed once, in the help, not as a {a,b,...} metavar repeated in the usage line
    model = p.add_argument(
        "--model", default=default, choices=names, metavar="PRESET", help=f"{model_help}: {', '.join(names)}"
    )
    model.elsewhere = elsewhere or {}
    layouts = f" ({checkpoints})" if checkpoints else ""
    p.add_argument(
        "--weights",
        default="dummy",
        help=f"'dummy' (seeded random weights of --model) or a checkpoint path{layouts}",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=list(COMPUTE_DTYPES),
        help="compute dtype of the DiT (auto: bf16 on a GPU, fp16 on one without bf16, fp32 on the CPU)",
    )
    p.add_argument(
        "--weight-dtype",
        default="default",
        choices=[k for k, v in WEIGHT_DTYPES.items() if k == "default" or v],
        help="storage dtype of the linear weights (default: as the compute dtype)",
    )
    p.add_argument(
        "--device", default="auto", help="torch device: cpu, cuda, cuda:1 ... (auto: cuda when available)"
    )


def add_attention_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--attention",
        default="auto",
        choices=list(ATTENTION_BACKENDS),
        help="attention kernel (auto: flash-attn when installed, on CUDA in fp16/bf16 without a mask; else PyTorch "
        "SDPA)",
    )


def lora_option(text: str) -> tuple[str, float]:
    """``FILE[:STRENGTH]`` -> (path, strength); a tail after the last ``:`` that is not a number stays part of the
    path (``C:\\loras\\x.safetensors``), so the strength is 1.0 there."""
    path, sep, tail = text.rpartition(":")
    if sep and path:
        try:
            strength = float(tail)
        except ValueError:
            return os.path.expanduser(text), 1.0
        return os.path.expanduser(path), strength
    return os.path.expanduser(text), 1.0


def add_lora_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        type=lora_option,
        metavar="FILE[:STRENGTH]",
        help="a LoRA file for the diffusion model, at STRENGTH (1.0 if not given); repeat it to stack LoRAs, "
        "applied in order (default: none)",
    )


def check_lora_files(loras) -> None:
    """Before anything is loaded: each --lora names a weights file that exists."""
    for path, strength in loras:
        check_finite_number(strength, "--lora")
        check_weights_file(path, "--lora")


def with_loras(handle, loras):
    """The handle carrying each --lora (the files are read and checked against the model here)."""
    for path, strength in loras:
        handle = apply_lora(handle, path, strength, input_name="--lora")
    return handle


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--height", type=int, default=256, help="image height in pixels (multiple of 16)")
    p.add_argument("--width", type=int, default=256, help="image width in pixels (multiple of 16)")
    p.add_argument("--batch", type=int, default=1, help="images sampled together in one job")
    p.add_argument(
        "--steps", type=int, default=None, help="denoising steps (default: the schedule's own step count)"
    )
    p.add_argument(
        "--schedule",
        default=None,
        choices=list(SCHEDULES) + ["custom"],
        help="sigma schedule (default: the model's own: its few-step schedule, the dev schedule for FLUX.1-dev "
        "and FLUX.2-dev)",
    )
    p.add_argument(
        "--sigmas", default="", help="with --schedule custom: the sigmas, comma separated (default: none)"
    )
    p.add_argument(
        "--sampler",
        default=None,
        choices=list(SAMPLERS),
        help="sampler (default: the schedule's sampler; euler with --schedule custom)",
    )
    p.add_argument(
        "--cfg",
        type=float,
        default=1.0,
        help="CFG scale; other than 1 it needs --negative-seed (refused without)",
    )
    p.add_argument(
        "--guidance",
        type=float,
        default=None,
        help="distilled guidance of guidance-embedded models (default: the model's, 3.5 FLUX.1-dev, 4 FLUX.2-dev)",
    )
    p.add_argument("--seed", type=int, default=0, help="noise seed: the same seed gives the same latent")
    p.add_argument(
        "--cond",
        default=None,
        help="safetensors with 'context' [B,L,D] (and 'pooled' [B,P] for FLUX.1): D 4096 / P 768 for FLUX.1, "
        "the model's context width for FLUX.2 (7680 klein-4b, 12288 klein-9b, 15360 dev), 2560 for Z-Image"
        "; the encode command writes one from a prompt (default: --prompt with --text-encoder, else seeded "
        "synthetic embeddings)",
    )
    add_text_tokens_argument(p, "text tokens per prompt of the synthetic embeddings")
    p.add_argument(
        "--negative-seed",
        type=int,
        default=None,
        help="seed of synthetic negative embeddings, which enable CFG (default: none, no CFG)",
    )


def add_compile_arguments(p: argparse.ArgumentParser) -> None:
    """``--compile`` / ``--compile-backend`` / ``--cuda-graph``: plain strings, checked by the engine's
    CompileConfig, so a bad value is the engine's one-line error naming the flag (not argparse's usage dump)."""
    p.add_argument(
        "--compile",
        default="off",
        help=f"torch.compile of the DiT: {' | '.join(COMPILE_MODES)} (regional: one compiled block graph "
        "reused by every block; full: the whole forward)",
    )
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help=f"torch.compile backend: {' | '.join(COMPILE_BACKENDS)} (aot_eager compiles fast: checks, CPU)",
    )
    p.add_argument(
        "--cuda-graph",
        default="off",
        help=f"replay the forward from CUDA graphs: {' | '.join(GRAPH_MODES)} (needs a CUDA GPU; refused "
        "elsewhere)",
    )


def compile_config(args) -> CompileConfig | None:
    """The run's compile choice, checked before anything is loaded (None: compile and graphs both off).

    CUDA graphs without a GPU are refused when the model is on the CPU (``allow_fallback`` stays off): a user
    who asks for graphs is told they do not run here instead of getting a silently eager run."""
    config = CompileConfig(mode=args.compile, cuda_graph=args.cuda_graph, backend=args.compile_backend)
    return None if config.mode == "off" and not config.graphs_requested else config


def with_compile(handle, config: CompileConfig | None):
    """``handle`` with the engine's compile feature for ``config`` (the handle itself when it is None)."""
    if config is None:
        return handle
    from ..engine.compile import attach_compile_config

    return attach_compile_config(handle, config)  # checked once, when compile_config built it


def compile_report(telemetry) -> dict | None:
    """The ``--json`` view of a run's CompileTelemetry: its own fields plus the totals a reader compares
    (graph breaks summed over their reasons; graph replays, and eager calls other than a shape's warm-up: the
    engine's ``hits`` / ``misses``); None when compile and graphs were both off."""
    if telemetry is None:
        return None
    report = telemetry.as_dict()
    graphs = report["graphs"]
    report["graph_breaks_total"] = sum(telemetry.graph_breaks.values())
    report["graph_hits"] = 0 if graphs is None else graphs["hits"]
    report["graph_misses"] = 0 if graphs is None else graphs["misses"]
    return report


def source_of(args) -> str:
    return f"dummy:{args.model}" if args.weights == "dummy" else args.weights


def family_of_preset(name: str) -> Family:
    return all_presets()[name][0]


def synthetic_condition(
    family: Family, params, tokens: int, seed: int, guidance: float | None
) -> TextCondition:
    """Seeded stand-in embeddings of the widths the model takes (its family's ImageSpec): context first, then
    the pooled vector where the family has one, so FLUX.1's draws are the same as before FLUX.2 / Z-Image."""
    spec = family.image
    gen = torch.Generator().manual_seed(seed % 2**64)  # seed + 1 of the largest seed wraps, as a uint64 does
    context = torch.randn(1, tokens, spec.context_dim(params), generator=gen)
    pooled_dim = spec.pooled_dim(params)
    pooled = torch.randn(1, pooled_dim, generator=gen) if pooled_dim else None
    return TextCondition(context, pooled, guidance)


def default_schedule(family: Family, params) -> str:
    """The schedule a model is sampled with when --schedule is not given: the family's few-step preset
    (flux.1-schnell, flux.2-klein, z-image-turbo), or for a guidance-distilled model (FLUX.1-dev, FLUX.2-dev,
    which are many-step models) its dev preset."""
    return family.image.schedule_for(params)


def default_tiny_vae(family: Family) -> str:
    """``dummy:<variant>`` of the tiny AE that decodes the family's LATENT (taef1, or taef2 for FLUX.2)."""
    return DUMMY_PREFIX + variants_for(family.latent_format)[0].name


def latent_shape(family: Family, batch: int, height: int, width: int) -> tuple[int, int, int, int]:
    """The empty LATENT of a text-to-image run: the family's channels at its VAE's downscale (FLUX.2: 128
    channels at 1/16, ComfyUI's EmptyFlux2LatentImage; FLUX.1 / Z-Image: 16 at 1/8, EmptySD3LatentImage)."""
    fmt = family.latent_format
    return (batch, fmt.channels, height // fmt.downscale, width // fmt.downscale)


def load_condition(path: str, guidance: float | None, flag: str = "--cond") -> TextCondition:
    """``--cond`` (or ``flag``, another option that takes the same file): a safetensors file with ``context``
    (and ``pooled``)."""
    tensors = read_tensors(path, flag)
    return TextCondition(tensor_named(tensors, "context", path, flag), tensors.get("pooled"), guidance)


def check_at_least(args, **minimums: int) -> None:
    """Counts the CLI builds tensors from (--batch, --text-tokens...) before any engine function sees them."""
    for dest, low in minimums.items():
        value = getattr(args, dest)
        if value is not None and value < low:
            raise InputError("--" + dest.replace("_", "-"), f"expected at least {low}, got {value}")


def prepare_out(path: str) -> None:
    """Create ``--out`` (a folder); a file already at that path is an error naming the flag."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise InputError("--out", f"{path} exists and is not a folder; --out names the folder to write into")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise InputError("--out", f"cannot create the folder {path}: {err.strerror or err}") from None


def check_size(height: int, width: int, family: Family | None = None) -> None:
    """Pixels per image token side: the VAE's downscale times the token patch (16 for every image family;
    before the model is loaded, when its family is not known yet, that common 16)."""
    if family is None:
        check_image_size(height, width, 16, "the image models' 16 px per latent token")
        return
    fmt, patch = family.latent_format, family.image.token_patch
    why = f"{fmt.downscale}x VAE downscaling" + (f" and {patch}x{patch} patches" if patch > 1 else "")
    check_image_size(height, width, fmt.downscale * patch, why)


def write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


@contextlib.contextmanager
def progress_bar(desc: str, total: int | None, position: int = 0):
    """A tqdm bar on stderr, shown only when stderr is a terminal (tqdm's ``disable=None``): a run piped to a
    file or another program gets no bar characters in its output. Removed from the screen when done (the
    command prints its own summary)."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=desc.rstrip("s"), disable=None, leave=False, file=sys.stderr,
               position=position, dynamic_ncols=True)  # fmt: skip
    try:
        yield bar
    finally:
        bar.close()


def say(line: str) -> None:
    """A result line on stdout that does not tear a progress bar drawn on the same terminal."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def did_you_mean(value: str, names) -> str | None:
    """ "did you mean a, b or c?" with the names closest to a mistyped ``value`` (difflib), None when none is."""
    close = difflib.get_close_matches(value, [str(n) for n in names], n=3, cutoff=0.6)
    if not close:
        return None
    listed = close[0] if len(close) == 1 else f"{', '.join(close[:-1])} or {close[-1]}"
    return f"did you mean {listed}?"
