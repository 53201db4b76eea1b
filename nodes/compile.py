"""FewStepCompile: torch.compile and CUDA graphs for a FEWSTEP_MODEL, as a node of its own.

A separate node rather than more loader inputs: the loader stays the place that decides what the weights are
(file, storage dtype), and compilation comes after everything that changes them (fp8 storage, patches), which
is what the compiled code and the graphs must see. It can also be put on any FEWSTEP_MODEL (a cache-gated one
included) and removed without touching the loader. The model object is shared, not changed: the node attaches
the ``compile`` feature to a new handle, and FewStepSampler applies it.
"""

from __future__ import annotations

from ..engine.compile import COMPILE_BACKENDS, COMPILE_MODES, GRAPH_MODES, attach_compile, parse_buckets
from .base import ALL_FAMILIES, CATEGORY, ReturnsModel, model_input, reports_input_errors


class FewStepCompile(ReturnsModel):
    DESCRIPTION = (
        "Compiles a FEWSTEP_MODEL's DiT forward (torch.compile: 'regional' compiles the repeated block once and "
        "reuses it for every block; 'full' the whole forward) and/or replays it from CUDA graphs ('whole': one "
        "graph per shape, a causal video step with its KV cache included; 'breakable': graph segments with "
        "collectives run eagerly between them). Prompt length "
        "and image size changes reuse the compiled code (dynamic shapes). Used by FewStepSampler, "
        "FewStepCausalVideoSampler and FewStepStreamBatch, whose reports list compile time, recompiles and their "
        "reasons, and graph replays / captures / eager calls with the reason."
    )
    CATEGORY = f"{CATEGORY}/speed"
    FUNCTION = "attach"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": model_input(ALL_FAMILIES),
                "compile": (
                    list(COMPILE_MODES),
                    {
                        "default": "regional",
                        "tooltip": "off: eager. regional: compile the repeated transformer block once, reused by "
                        "every block (compile time of one block). full: the whole forward (longer compile).",
                    },
                ),
                "cuda_graph": (
                    list(GRAPH_MODES),
                    {
                        "default": "off",
                        "tooltip": "off: no graphs. whole: replay the forward from a CUDA graph per input shape "
                        "(captured on its second run), causal video steps included. breakable: graph segments "
                        "with collectives run eagerly between them (sequence parallelism over gloo). Needs a CUDA "
                        "GPU; turned off for a run whose step cache is on or whose weights are offloaded.",
                    },
                ),
                "dynamic": (
                    "BOOLEAN",
                    {
                        "default": True,
                        "tooltip": "On: compiled code is generic in prompt length and image size (no recompile "
                        "when they change). Off: specialised per shape (one compile per size).",
                    },
                ),
                "backend": (
                    list(COMPILE_BACKENDS),
                    {
                        "default": "inductor",
                        "tooltip": "torch.compile backend. inductor: generated kernels (fast, long first "
                        "compile). aot_eager / eager: tracing only, for debugging graph breaks and recompiles.",
                    },
                ),
                "allow_fallback": (
                    "BOOLEAN",
                    {
                        "default": False,
                        "tooltip": "If CUDA graphs cannot run here (no CUDA GPU, model on the CPU), run without "
                        "them and say so in the report, instead of stopping with an error.",
                    },
                ),
            },
            "optional": {
                "buckets": (
                    "STRING",
                    {
                        "default": "",
                        "tooltip": "Image sizes you will use, e.g. 1024x1024,768x1344 (px). CUDA graphs are "
                        "captured only for these; with dynamic off only these are compiled. No padding is done. "
                        "Empty: any size.",
                    },
                ),
                "max_graphs": (
                    "INT",
                    {
                        "default": 4,
                        "min": 1,
                        "max": 64,
                        "tooltip": "CUDA graphs kept (least recently used dropped); each holds its own memory.",
                    },
                ),
            },
        }

    @reports_input_errors("FewStepCompile")
    def attach(self, model, compile, cuda_graph, dynamic, backend, allow_fallback, buckets="", max_graphs=4):
        handle = attach_compile(
            model, compile, cuda_graph, dynamic=dynamic, backend=backend, allow_fallback=allow_fallback,
            buckets=parse_buckets(buckets), max_graphs=max_graphs,
        )  # fmt: skip
        return (handle,)


__all__ = ["FewStepCompile"]
