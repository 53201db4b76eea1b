"""``python -m fewstep plan``: the bill of a job before it runs (FLOPs, forwards, KV and weight bytes, seconds)."""

from __future__ import annotations

import json

from ..engine.checks import check_image_size
from ..engine.errors import InputError
from ..engine.plan import DEFAULT_MFU, GPUS, KV_LAYOUTS, WEIGHT_DTYPE_BYTES, known_models, plan_preset
from ..engine.plan.live import LIVE_SESSIONS
from .common import add_deprecated_alias, did_you_mean

HELP = (
    "cost plan of a job: FLOPs per DiT forward, forwards, KV-cache and weight bytes, predicted seconds on a GPU "
    "(no weights needed)"
)


def add_arguments(p) -> None:
    p.add_argument(
        "--model",
        required=True,
        help=f"model preset (required): {', '.join(known_models())}; a 'dummy:' prefix is accepted",
    )
    p.add_argument(
        "--height", type=int, default=None, help="height in pixels (default: 1024 for images, 480 for Wan)"
    )
    p.add_argument(
        "--width", type=int, default=None, help="width in pixels (default: 1024 for images, 832 for Wan)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="denoising steps (default: the family's schedule preset: 4 for schnell, klein and the Wan students, "
        "8 Z-Image-Turbo, "
        "28 FLUX.1-dev, 50 FLUX.2-dev)",
    )
    p.add_argument(
        "--cfg",
        type=float,
        default=1.0,
        help="CFG scale; other than 1 means a negative prompt too: 2 rows per step (image models only)",
    )
    p.add_argument("--batch", type=int, default=1, help="images or videos sampled together in one job")
    p.add_argument(
        "--text-tokens",
        type=int,
        default=None,
        help="image models: text tokens per prompt (default: what the pipeline feeds; FLUX.1 256 without a "
        "guidance embedding, 512 with; FLUX.2 512; Z-Image at most 512); Wan always reads 512",
    )
    p.add_argument(
        "--video-frames",
        type=int,
        default=None,
        help="Wan: video frames, 4k + 1 (default: 81, 21 latent frames)",
    )
    add_deprecated_alias(p, "--frames", "--video-frames", "video_frames")
    p.add_argument(
        "--latent-frames",
        type=int,
        default=None,
        help="Wan: latent frames instead of --video-frames; n latent frames are 4n - 3 video frames "
        "(default: from --video-frames)",
    )
    p.add_argument("--chunk-frames", type=int, default=None, help="Wan: latent frames per chunk (default: 3)")
    p.add_argument(
        "--window-frames",
        type=int,
        default=None,
        help="Wan: latent frames of the rolling KV window a chunk attends to (default: 21)",
    )
    p.add_argument(
        "--sink-frames",
        type=int,
        default=None,
        help="Wan: first latent frames kept in the KV window forever (default: 0)",
    )
    p.add_argument(
        "--kv-dtype",
        default=None,
        help=f"Wan: KV cache storage, {'/'.join(KV_LAYOUTS)} (default: bf16, the compute dtype)",
    )
    p.add_argument(
        "--keep-recent-chunks",
        type=int,
        default=None,
        help="Wan, int8/int4: completed chunks kept unquantized besides the current one (default: 1)",
    )
    p.add_argument(
        "--sessions",
        type=int,
        default=None,
        help="Wan: also predict a session-pool tick of this many sessions' chunks batched into one forward per "
        "step, against solo chunks (default: off)",
    )
    p.add_argument(
        "--live",
        nargs="?",
        const=",".join(map(str, LIVE_SESSIONS)),
        default=None,
        metavar="N,N,...",
        help="Wan: also predict the realtime metrics of a live node's sessions (chunk interval p50 / p99, time to "
        "first chunk without the text encoder, realtime factor, deadline, stalls) for these session counts, and "
        f"how many sessions stay realtime (default when given alone: {','.join(map(str, LIVE_SESSIONS))})",
    )
    p.add_argument(
        "--weight-dtype",
        default="bf16",
        help=f"weight storage for the memory check: {'/'.join(WEIGHT_DTYPE_BYTES)} (fp8: linear weights)",
    )
    p.add_argument("--gpu", default="h100", help=f"GPU preset: {', '.join(GPUS)} (dense bf16 peak)")
    p.add_argument(
        "--mfu",
        type=float,
        default=DEFAULT_MFU,
        help="model FLOP utilisation assumed for the predicted seconds",
    )
    p.add_argument(
        "--no-vae",
        action="store_true",
        help="leave out the VAE decode FLOPs (counted on the meta device when included)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")


def run(args) -> int:
    settings = {
        "height": args.height,
        "width": args.width,
        "steps": args.steps,
        "cfg": args.cfg,
        "batch": args.batch,
        "text_tokens": args.text_tokens,
        "frames": args.video_frames,
        "latent_frames": args.latent_frames,
        "chunk_frames": args.chunk_frames,
        "window_frames": args.window_frames,
        "sink_frames": args.sink_frames,
        "kv_dtype": args.kv_dtype,
        "keep_recent_chunks": args.keep_recent_chunks,
        "sessions": args.sessions,
        "live": None if args.live is None else parse_counts(args.live, "--live"),
        "weight_dtype": args.weight_dtype,
        "gpu": args.gpu,
        "mfu": args.mfu,
        "vae": not args.no_vae,
    }
    check_model_name(args.model)
    # 0 means "the default" on the node; here an omitted option does
    check_image_size(settings["height"], settings["width"], 16, "omit the option for the model's default")
    plan = plan_preset(args.model, **settings)  # errors name engine arguments; main() maps them to the flags
    print(json.dumps(plan.fields, indent=2) if args.json else plan.table())
    return 0


def check_model_name(model: str) -> None:
    """A typo of a known preset: the closest names, in one line (an unrelated name gets the engine's error,
    which lists every model)."""
    known = known_models()
    name = model.removeprefix("dummy:")
    hint = did_you_mean(name, known) if name not in known else None
    if hint:
        raise InputError("--model", f"unknown model {model!r}; {hint}")


def parse_counts(text: str, flag: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4); anything else is refused naming the flag."""
    try:
        counts = tuple(int(v) for v in text.split(","))
    except ValueError:
        counts = ()
    if not counts or any(n < 1 for n in counts):
        raise InputError(flag, f"expected comma-separated session counts >= 1 (e.g. 1,2,4,8), got {text!r}")
    return counts
