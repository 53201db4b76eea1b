"""Compile and CUDA graphs (issue 7) on FLUX.1-schnell."""

from __future__ import annotations

from .graph import Graph, workflow
from .parts import FLUX_SIDE_FILES, ImageInputs, dummy_image_inputs, fewstep_sampler, flux1_inputs


def compiled_image(g: Graph, inputs: ImageInputs, backend: str, prefix: str) -> None:
    fast = g.add(
        "FewStepCompile", "FewStep Compile (regional + CUDA graph)", inputs.col, model=inputs.model,
        compile="regional", cuda_graph="whole", dynamic=True, backend=backend, allow_fallback=True,
    )  # fmt: skip
    sampler = fewstep_sampler(g, "FewStep Sampler (4 steps)", inputs.col, fast[0], inputs.cond, inputs.latent)
    g.add("PreviewAny", "Sampler report (compile, graphs)", inputs.col + 1, ui_height=260, source=sampler[1])
    inputs.save(g, sampler[0], inputs.col + 1, prefix)


@workflow("flux_schnell_compiled")
def flux_schnell_compiled(g: Graph) -> None:
    g.note = f"""FLUX.1-schnell with a compiled DiT and a CUDA graph.

FewStep Compile compiles the repeated transformer block once (regional: seconds, not minutes), with the
token dimension dynamic so a new prompt length or resolution does not recompile, and replays the whole
forward as a CUDA graph (one per shape, kept in a small LRU). The first run pays compile and capture; later
runs replay. The sampler report shows compile time, recompiles with their reasons, and graph hits / misses.
On a machine without a GPU the graph is skipped (allow_fallback) and the report says why.

Files (ComfyUI/models/...):
- diffusion_models/flux1-schnell.safetensors
{FLUX_SIDE_FILES}

No files? Open flux_schnell_compiled_dummy.json."""
    compiled_image(g, flux1_inputs(g, 1024), "inductor", "fewstep/schnell_compiled")


@workflow("flux_schnell_compiled_dummy")
def flux_schnell_compiled_dummy(g: Graph) -> None:
    g.note = """Compile and CUDA-graph switches with no model files (random weights, CPU).

Compiles the tiny FLUX block with the aot_eager backend (traced by dynamo, no C++ compiler needed); the
CUDA graph is requested, and on a CPU it falls back to eager with the reason in the report (allow_fallback).
The report lists compile time and recompiles. The output is noise.

Needs no files. For the real model open flux_schnell_compiled.json."""
    compiled_image(g, dummy_image_inputs(g), "aot_eager", "fewstep/compiled_dummy")
