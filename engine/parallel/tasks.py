"""Diagnostic jobs (``kind="task"``): the pool's own checks, used by the tests and the benchmark.

Only the functions listed in ``TASKS`` can be run by name; a job carries data, never code.
"""

from __future__ import annotations

import os
import time

import torch

from ..backends import Backends
from ..lora import ensure_patches
from .sequence import SequenceParallelPlan
from .sharding import wan_block_runner


def ping(ctx) -> dict:
    ctx.progress()
    return {
        "world": ctx.world,
        "backend": ctx.backend,
        "pid": os.getpid(),
        "models_loaded": ctx.models_loaded,
        "loras_read": ctx.loras_read,
    }


def sleep(ctx, seconds: float) -> dict:
    """Sleep, reporting progress every 0.1 s (a job to kill or stop a worker in)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ctx.progress()
        time.sleep(0.1)
    return {"slept": seconds}


def sequence_attention(ctx, q, k, v, replicated_prefix: int = 0, degrees=None) -> dict | None:
    """``Backends.attention`` on this rank's shard of ``q, k, v [B, T + N, H, D]`` (the first
    ``replicated_prefix`` tokens whole on every rank) under a (ulysses, ring) plan; rank 0 returns the whole
    output (its text rows, every rank's image rows) and how far the ranks' text rows differ."""
    mesh = ctx.mesh(degrees)
    t = replicated_prefix
    local = [torch.cat((x[:, :t], mesh.shard(x[:, t:])), dim=1).to(ctx.device) for x in (q, k, v)]
    out = Backends(parallel=SequenceParallelPlan(mesh)).attention(*local, replicated_prefix=t)
    comm = mesh.stats.snapshot()
    image = mesh.gather(out[:, t:].contiguous())
    text = out[:, :t].contiguous()
    spread = torch.zeros(())
    if t and mesh.world > 1:
        texts = [torch.empty_like(text) for _ in range(mesh.world)]
        torch.distributed.all_gather(texts, text)
        spread = max((x - texts[0]).abs().max() for x in texts)
    if ctx.rank != 0:
        return None
    return {"out": torch.cat((text, image), dim=1).cpu(), "text_spread": float(spread), "comm": comm}


def wan_forward(ctx, model, x, timestep, context, degrees=None) -> dict | None:
    """A whole (bidirectional) Wan forward with every frame's tokens sharded over the ranks: self-attention
    through the mesh, cross-attention to the replicated prompt locally; rank 0 returns the velocity."""
    handle = ctx.model(model)
    ensure_patches(handle.model, handle.loras)  # no run here: merge the job's LoRAs (or restore) directly
    mesh = ctx.mesh(degrees)
    with torch.inference_mode():
        out = handle.model(
            x.to(ctx.device),
            timestep.to(ctx.device),
            context.to(ctx.device),
            block_runner=wan_block_runner(mesh),
        )
    if ctx.rank != 0:
        return None
    return {"out": out.cpu(), "comm": mesh.stats.snapshot()}


TASKS = {"ping": ping, "sleep": sleep, "sequence_attention": sequence_attention, "wan_forward": wan_forward}
