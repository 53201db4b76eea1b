"""What the user can ask for (compile mode, CUDA-graph mode, backend, buckets) and the checks on it.

Every bad choice is an :class:`~..errors.InputError` naming the input: an unknown mode, a torch too old for a
feature (with the version it needs), CUDA graphs without a CUDA device (unless ``allow_fallback``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import InputError

COMPILE_MODES = ("off", "regional", "full")
GRAPH_MODES = ("off", "whole", "breakable")
# torch.compile backends offered: inductor generates kernels; aot_eager traces and runs the captured graph with
# eager kernels (quick to compile: tests, debugging); eager stops after dynamo (graph breaks and guards only).
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
# Break points of a breakable graph (capture.py). No "kv": the causal KV cache has static shapes and is
# captured with the step. A collective is cut by default: over gloo it has no kernel a graph could record.
BREAK_KINDS = ("collective", "attention")
DEFAULT_BREAKS = ("collective",)

# Oldest torch each feature needs, and why.
MIN_TORCH = {
    "compile": (
        (2, 5),
        "torch.compile inlines nn.Module calls by default from 2.5 (inline_inbuilt_nn_modules), which is what "
        "lets every block reuse one compiled block graph instead of compiling one per layer",
    ),
    "cuda_graph": (
        (2, 1),
        "torch.cuda.CUDAGraph with private memory pools and thread-local capture errors",
    ),
    "breakable": (
        (2, 1),
        "TorchFunctionMode sees torch.ops calls (the attention and collective break points)",
    ),
}


def torch_version(version: str | None = None) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13)`` (the running torch by default)."""
    text = str(version if version is not None else torch.__version__)
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_torch(feature: str, input_name: str, version: str | None = None) -> None:
    """Raise when the running torch (or ``version``) is older than ``feature`` needs."""
    needed, why = MIN_TORCH[feature]
    have = torch_version(version)
    if have < needed:
        raise InputError(
            input_name,
            f"{feature} needs torch >= {needed[0]}.{needed[1]} ({why}); this is torch "
            f"{version if version is not None else torch.__version__}: upgrade torch or turn {input_name} off",
        )


def parse_buckets(text: str | None, input_name: str = "buckets") -> tuple[tuple[int, int], ...] | None:
    """``"1024x1024, 768x1344"`` (width x height in px, multiples of 16) -> ``((1024, 1024), (768, 1344))``."""
    if text is None or not str(text).strip():
        return None
    out = []
    for part in str(text).replace(";", ",").split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            w, h = (int(v) for v in part.split("x"))
        except ValueError:
            raise InputError(
                input_name, f"{part!r} is not a size; expected WIDTHxHEIGHT in px, e.g. 1024x1024,768x1344"
            ) from None
        if w <= 0 or h <= 0 or w % 16 or h % 16:
            raise InputError(input_name, f"{w}x{h} px: width and height must be positive multiples of 16")
        out.append((w, h))
    return tuple(out) or None


@dataclass(frozen=True)
class CompileConfig:
    """The user's choice for one model; each feature can be off on its own.

    ``buckets``: the image sizes (width, height px) a workflow expects. No padding is done (the joint attention
    of FLUX.1, FLUX.2 and Z-Image has no mask, so padding tokens would change every real token's result; Z-Image's
    own padding to a multiple of 32 tokens is part of the model). They bound what is specialised: with
    ``dynamic=False`` a size outside the buckets runs uncompiled instead of compiling one more static graph, and
    CUDA graphs are captured only for bucket sizes (others run without a graph). A bucket of an image model is a
    number of image tokens, so it covers every size with as many (FLUX.1 and Z-Image, 16 px a token: 1024x1024
    and 512x2048 both give 4096; FLUX.2 likewise, its 16x16 px latent pixels one token each); for Wan it is the
    latent height x width.
    """

    mode: str = "regional"
    cuda_graph: str = "off"
    dynamic: bool = True
    buckets: tuple[tuple[int, int], ...] | None = None
    backend: str = "inductor"
    allow_fallback: bool = False
    max_graphs: int = 4
    warmup: int = 1
    break_at: tuple[str, ...] = DEFAULT_BREAKS
    # the seam for a test double of CUDA graphs (tests/compile_doubles.py): a factory of segment backends
    graph_segments: Callable[[], object] | None = None

    def __post_init__(self):
        # the engine API takes the node's text forms too ("1024x1024,768x1344", "collective,attention")
        if isinstance(self.buckets, str):
            object.__setattr__(self, "buckets", parse_buckets(self.buckets))
        if isinstance(self.break_at, str):
            object.__setattr__(
                self, "break_at", tuple(k.strip() for k in self.break_at.split(",") if k.strip())
            )
        if self.mode not in COMPILE_MODES:
            raise InputError(
                "compile",
                f"unknown compile mode {self.mode!r}; expected one of {', '.join(COMPILE_MODES)} (regional: "
                "one compiled block graph reused by every block; full: the whole forward)",
            )
        if self.cuda_graph not in GRAPH_MODES:
            raise InputError(
                "cuda_graph",
                f"unknown CUDA-graph mode {self.cuda_graph!r}; expected one of {', '.join(GRAPH_MODES)} (whole: "
                "the forward as one graph per shape, a causal step with its KV cache included; breakable: graph "
                "segments with collectives run eagerly between them)",
            )
        if self.backend not in COMPILE_BACKENDS:
            raise InputError(
                "backend",
                f"unknown compile backend {self.backend!r}; expected one of {', '.join(COMPILE_BACKENDS)}",
            )
        if not isinstance(self.max_graphs, int) or self.max_graphs < 1:
            raise InputError("max_graphs", f"{self.max_graphs}: expected at least 1 graph kept")
        if not isinstance(self.warmup, int) or self.warmup < 1:
            raise InputError(
                "warmup", f"{self.warmup}: expected at least 1 eager warm-up call before a capture"
            )
        unknown = [k for k in self.break_at if k not in BREAK_KINDS]
        if unknown:
            raise InputError(
                "break_at", f"unknown break points {unknown}; expected some of {', '.join(BREAK_KINDS)}"
            )
        if self.mode != "off":
            check_torch("compile", "compile")
        if self.cuda_graph != "off":
            check_torch("cuda_graph", "cuda_graph")
        if self.cuda_graph == "breakable":
            check_torch("breakable", "cuda_graph")

    @property
    def graphs_requested(self) -> bool:
        return self.cuda_graph != "off"

    def describe(self) -> str:
        parts = [f"compile {self.mode}"]
        if self.mode != "off":
            parts.append(f"backend {self.backend}, {'dynamic' if self.dynamic else 'static'} shapes")
        parts.append(
            f"CUDA graph {self.cuda_graph}" + (" (injected segments)" if self.graph_segments else "")
        )
        if self.buckets:
            parts.append("buckets " + ", ".join(f"{w}x{h}" for w, h in self.buckets))
        return "; ".join(parts)


def graph_device_problem() -> str | None:
    """Why CUDA graphs cannot run in this process (None: they can)."""
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no CUDA device is visible"
        return f"CUDA graphs need a CUDA GPU; this torch {torch.__version__} has {build}"
    return None


__all__ = [
    "BREAK_KINDS",
    "COMPILE_BACKENDS",
    "COMPILE_MODES",
    "CompileConfig",
    "DEFAULT_BREAKS",
    "GRAPH_MODES",
    "MIN_TORCH",
    "check_torch",
    "graph_device_problem",
    "parse_buckets",
    "torch_version",
]
