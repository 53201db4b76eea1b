"""Sequence parallel (issue 8): Ulysses over two ranks for FLUX.1 images and causal Wan video."""

from __future__ import annotations

from .graph import Graph, Node, workflow
from .parts import (
    FLUX_SIDE_FILES,
    WAN_FILES,
    ImageInputs,
    causal_video,
    dummy_image_inputs,
    dummy_wan_inputs,
    fewstep_sampler,
    flux1_inputs,
    self_forcing_inputs,
)


def launcher(g: Graph, col: int, **widgets) -> Node:
    return g.add(
        "FewStepParallelLauncher", "FewStep Parallel Launcher (Ulysses x2)", col, mode="sp", ulysses_degree=2,
        ring_degree=1, backend="auto", timeout=120.0, **widgets,
    )  # fmt: skip


def sequence_parallel_image(
    g: Graph, inputs: ImageInputs, save_col: int, prefix: str, **pool_widgets
) -> None:
    pool = launcher(g, inputs.col, **pool_widgets)
    sampler = fewstep_sampler(
        g,
        "FewStep Sampler (4 steps, on the pool)",
        inputs.col,
        inputs.model,
        inputs.cond,
        inputs.latent,
        parallel=pool[0],
    )
    g.add("PreviewAny", "Pool", inputs.col, ui_height=140, source=pool[1])
    g.add("PreviewAny", "Sampler report", inputs.col + 1, ui_height=200, source=sampler[1])
    inputs.save(g, sampler[0], save_col, prefix)


@workflow("flux_sequence_parallel")
def flux_sequence_parallel(g: Graph) -> None:
    g.note = f"""FLUX.1-schnell at 2048x2048 on two GPUs with sequence parallelism (Ulysses, degree 2).

The launcher starts two worker processes on torch.distributed (NCCL); each loads the model once and keeps it.
Every forward runs on half of the image tokens per rank (text tokens replicated); attention exchanges heads
for tokens with an all-to-all. The sampler sends the job to the pool and gets the latent back from rank 0.
Unload models (or switch the launcher off) to stop the workers. For more ranks raise ulysses_degree (it must
divide FLUX's 24 heads) or ring_degree.

Files (ComfyUI/models/...):
- diffusion_models/flux1-schnell.safetensors
{FLUX_SIDE_FILES}

No GPUs? Open flux_sequence_parallel_dummy.json (two CPU workers on gloo)."""
    sequence_parallel_image(g, flux1_inputs(g, 2048), save_col=4, prefix="fewstep/schnell_sp")


@workflow("flux_sequence_parallel_dummy")
def flux_sequence_parallel_dummy(g: Graph) -> None:
    g.note = """Sequence parallelism with no model files and no GPU: two CPU worker processes (gloo).

The tiny random-weight FLUX runs with its image tokens split over two ranks (Ulysses all-to-all). The result
equals the single-process run. The first run starts the workers (a few seconds); unload models to stop them.

Needs no files. For the real model open flux_sequence_parallel.json."""
    sequence_parallel_image(
        g, dummy_image_inputs(g), save_col=3, prefix="fewstep/sp_dummy", threads_per_rank=1
    )


@workflow("wan_causal_sequence_parallel")
def wan_causal_sequence_parallel(g: Graph) -> None:
    g.note = f"""Causal streaming video on two GPUs with sequence parallelism (Ulysses, degree 2).

Each rank holds half of every frame's tokens and its share of the rolling KV cache; chunks stream back from
rank 0 and are decoded by TAEW2.1 here. Use it for resolutions or windows one GPU cannot hold. ulysses_degree
must divide Wan-1.3B's 12 heads.

Files (ComfyUI/models/...):
{WAN_FILES}

No GPUs? Open wan_causal_sequence_parallel_dummy.json."""
    inputs = self_forcing_inputs(g)
    pool = launcher(g, inputs.col - 1)  # under the inputs: the sampler's column holds its report too
    causal_video(
        g, inputs, "FewStep Causal Video Sampler (on the pool)", "Report", "fewstep/wan_stream_sp", width=832,
        height=480, num_chunks=7, chunk_frames=3, window_frames=21, sink_frames=0, seed=7, parallel=pool[0],
    )  # fmt: skip


@workflow("wan_causal_sequence_parallel_dummy")
def wan_causal_sequence_parallel_dummy(g: Graph) -> None:
    g.note = """Causal video under sequence parallelism with no files and no GPU (two CPU workers, gloo).

The tiny random-weight Wan runs chunk by chunk with each rank caching its share of the KV window; chunks
equal the single-process ones. The output is noise.

Needs no files. For the real model open wan_causal_sequence_parallel.json."""
    inputs = dummy_wan_inputs(g)
    pool = launcher(g, inputs.col - 1, threads_per_rank=1)
    causal_video(
        g, inputs, "FewStep Causal Video Sampler (on the pool)", "Report", "fewstep/wan_stream_sp_dummy",
        width=96, height=64, num_chunks=3, chunk_frames=2, window_frames=6, sink_frames=1, seed=7,
        parallel=pool[0],
    )  # fmt: skip
