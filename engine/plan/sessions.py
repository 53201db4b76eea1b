"""The predicted cost of a session-pool tick: N sessions' chunks in one batched forward per denoising step.

A tick of ``engine.causal.session_pool.SessionPool`` runs, for the N sessions whose chunk is due, one batched
clean-context pass (the previous chunks' deferred commits) and ``steps`` batched denoising forwards. Every row is
one session's chunk: the linear layers run one GEMM of ``M = N x chunk tokens`` rows, and each row's attention
reads its own slot's window and its own prompt, so the FLOPs of a tick are exactly N times one session's
(:func:`~.flops.wan_forward_flops` with ``batch = N``). What batching can change is the efficiency, not the work.

The planner's solo prediction is FLOPs / (peak x MFU), MFU a knob. For the batched case the one effect modelled
on top of it is the GEMM's size, from two facts of the GPU preset (``hardware.py``) and one assumption:

* **tiles and waves** (assumption: a bf16 GEMM kernel computes its output in 128 x 128 tiles, one tile per
  streaming multiprocessor at a time, as Hopper's cuBLAS / CUTLASS kernels commonly do): a GEMM of ``M`` rows
  and ``n`` output features is ``ceil(M/128) x ceil(n/128)`` tiles run in ``ceil(tiles / SMs)`` waves; its
  efficiency is the useful share of those waves, ``M n / (waves x SMs x 128^2)``. Batching raises ``M``, which
  fills the last wave better and cuts the padding of partial tiles; once a GEMM runs many waves it no longer
  matters. A batched forward's linear seconds are the solo prediction scaled, GEMM by GEMM, by
  ``efficiency(M_solo) / efficiency(M_batched)``: at N = 1 the prediction is the planner's own, unchanged
  (wherever the chunk is compute-bound, i.e. above the weight-read floor below).
* **weight reads**: a forward reads every weight once whatever its batch; its linear layers take at least
  ``weight bytes / memory bandwidth``. Below ``peak x MFU / bandwidth`` FLOPs a weight byte (the ridge: a bf16
  GEMM of that many rows) the GPU waits on memory, and batching is then nearly free.

Attention scales with N (each row's own window: flash attention's grid is batch x heads x query blocks, already
many waves for one session at 480p) and so do the per-frame time embeddings. Nothing here is fitted to a
measurement; the fixed costs of a forward that batching also shares (kernel launches, Python) are not modelled
(CUDA graphs remove most of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..causal.session_pool import DEFAULT_BUCKETS
from ..errors import InputError
from ..models.wan import WanParams
from .flops import ForwardFlops, wan_forward_flops
from .hardware import DEFAULT_MFU, GpuSpec, check_mfu, gpu_spec

TILE = 128  # output tile edge of the GEMM kernels modelled (see the module docstring)
SCAN_SESSIONS = (1, 2, 3, 4, 6, 8, 16, 32, 64)
PAYS = 0.01  # batching "stops paying" once no larger batch gains 1 % more per session-chunk


@dataclass(frozen=True)
class Gemm:
    """One token-wise linear layer of a Wan forward: ``count`` GEMMs (per forward) of ``rows`` x ``inner`` by
    ``inner`` x ``out``."""

    name: str
    inner: int
    out: int
    count: int

    def flops(self, rows: int) -> int:
        return 2 * rows * self.inner * self.out * self.count


def wan_gemms(p: WanParams) -> list[Gemm]:
    """Every token-wise GEMM of one Wan forward, with its widths (the same weights ``wan_forward_flops`` counts:
    per layer self q/k/v/o and cross q/o, ``dim x dim``; the FFN in and out; the patch embedding and head)."""
    d, f, patch = p.dim, p.ffn_dim, math.prod(p.patch_size)
    return [
        Gemm("patch embedding", p.in_dim * patch, d, 1),
        Gemm("attention projections (self q/k/v/o, cross q/o)", d, d, 6 * p.num_layers),
        Gemm("FFN in", d, f, p.num_layers),
        Gemm("FFN out", f, d, p.num_layers),
        Gemm("head", d, p.out_dim * patch, 1),
    ]


def wave_efficiency(rows: int, out: int, sms: int, tile: int = TILE) -> float:
    """The useful share of the waves a ``rows x out`` GEMM output takes in ``tile x tile`` tiles on ``sms``
    multiprocessors (1.0: every tile full and every wave full)."""
    tiles = math.ceil(rows / tile) * math.ceil(out / tile)
    waves = math.ceil(tiles / sms)
    return rows * out / (waves * sms * tile * tile)


def fill_rows(out: int, sms: int, tile: int = TILE) -> int:
    """The fewest rows whose ``rows x out`` GEMM has a tile for every multiprocessor (one full wave)."""
    return math.ceil(sms / math.ceil(out / tile)) * tile


def ridge_rows(gpu: GpuSpec, mfu: float, weight_bytes_per_param: float = 2.0) -> int:
    """The rows at which a GEMM's FLOPs (2 per weight a row) take as long as reading its weights once: fewer and
    it waits on memory."""
    flops_per_byte = gpu.peak_flops * mfu / (gpu.memory_tb_s * 1e12)
    return math.ceil(flops_per_byte * weight_bytes_per_param / 2)


@dataclass(frozen=True)
class SessionTick:
    """The predicted bill of one steady-state tick (every session's window full) of ``sessions`` sessions."""

    sessions: int
    computed_rows: int  # sessions plus the padding rows of the buckets
    batches: tuple[int, ...]  # the bucketed size of each batched forward of the tick
    tokens_per_chunk: int
    gemm_rows: int  # M of the largest batch's linear GEMMs: its rows x tokens per chunk
    forwards: int  # steps + the clean-context pass, each over every session
    flops: ForwardFlops  # the whole tick
    seconds: float
    linear_seconds: float
    attention_seconds: float
    weight_read_seconds: float  # per forward: the floor of its linear layers
    linear_efficiency: float  # FLOP-weighted wave efficiency of the linear GEMMs at gemm_rows
    solo_seconds_per_chunk: float  # the same chunk run alone (sessions = 1)

    @property
    def seconds_per_session_chunk(self) -> float:
        return self.seconds / self.sessions

    @property
    def gain(self) -> float:
        """Solo seconds per chunk / batched seconds per session-chunk (> 1: batching pays)."""
        return self.solo_seconds_per_chunk / self.seconds_per_session_chunk

    def as_dict(self) -> dict:
        return {
            "sessions": self.sessions,
            "computed_rows": self.computed_rows,
            "batches": list(self.batches),
            "tokens_per_chunk": self.tokens_per_chunk,
            "gemm_rows": self.gemm_rows,
            "forwards": self.forwards,
            "flops": self.flops.total,
            "flops_per_row": self.flops.total // self.computed_rows,
            "seconds": self.seconds,
            "seconds_per_session_chunk": self.seconds_per_session_chunk,
            "solo_seconds_per_chunk": self.solo_seconds_per_chunk,
            "gain": self.gain,
            "linear_seconds": self.linear_seconds,
            "attention_seconds": self.attention_seconds,
            "weight_read_seconds_per_forward": self.weight_read_seconds,
            "linear_efficiency": self.linear_efficiency,
        }


def _linear_seconds(gemms: list[Gemm], rows: int, solo_rows: int, gpu: GpuSpec, mfu: float) -> float:
    rate = gpu.peak_flops * mfu
    return sum(
        g.flops(rows)
        / rate
        * wave_efficiency(solo_rows, g.out, gpu.sms)
        / wave_efficiency(rows, g.out, gpu.sms)
        for g in gemms
    )


def batch_sizes(sessions: int, buckets: tuple[int, ...] | None) -> list[int]:
    """The rows each batched forward of a tick computes for ``sessions`` due sessions: as the pool cuts them,
    batches of at most the largest bucket, each padded up to the smallest bucket that holds it (``None``: one
    unpadded batch)."""
    if buckets is None:
        return [sessions]
    largest = max(buckets)
    sizes = [largest] * (sessions // largest) + ([sessions % largest] if sessions % largest else [])
    return [min(b for b in buckets if b >= n) for n in sizes]


def plan_session_tick(
    p: WanParams,
    sessions: int,
    tokens_per_frame: int,
    chunk_frames: int = 3,
    window_frames: int = 21,
    steps: int = 4,
    gpu: str | GpuSpec = "h100",
    mfu: float = DEFAULT_MFU,
    buckets: tuple[int, ...] | None = DEFAULT_BUCKETS,
    weight_bytes_per_param: float = 2.0,
) -> SessionTick:
    """The predicted cost of one steady-state pool tick of ``sessions`` sessions (see the module docstring).
    The pool runs them in batches of its ``buckets`` (padded rows are computed and dropped: 3 sessions cost a
    batch of 4); each batch's FLOPs are its rows times one session's chunk (``steps`` + 1 forwards, each reading
    the whole static window of ``window_frames`` and the 512-token prompt). The per-prompt work (text
    embedding, cross K/V) is paid once per join, not per tick, and is left out."""
    spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
    check_mfu(mfu)
    for value, name in ((sessions, "sessions"), (tokens_per_frame, "tokens_per_frame"), (steps, "steps"),
                        (chunk_frames, "chunk_frames"), (window_frames, "window_frames")):  # fmt: skip
        if not isinstance(value, int) or value < 1:
            raise InputError(name, f"expected a positive integer, got {value!r}")
    tokens = chunk_frames * tokens_per_frame
    keys = window_frames * tokens_per_frame
    forwards = steps + 1
    gemms = wan_gemms(p)
    rate = spec.peak_flops * mfu
    weights = sum(g.inner * g.out * g.count for g in gemms) * weight_bytes_per_param
    weight_read = weights / (spec.memory_tb_s * 1e12)

    def forward_seconds(rows: int) -> tuple[float, float]:
        """(linear, attention + per-frame) seconds of one forward of ``rows`` sessions' chunks."""
        flops = wan_forward_flops(p, chunk_frames, tokens_per_frame, keys, rows)
        linear = max(_linear_seconds(gemms, rows * tokens, tokens, spec, mfu), weight_read)
        return linear, (flops.attention + flops.per_sample) / rate

    sizes = batch_sizes(sessions, buckets)
    parts = [forward_seconds(rows) for rows in sizes]
    flops = sum((wan_forward_flops(p, chunk_frames, tokens_per_frame, keys, rows) for rows in sizes),
                ForwardFlops()).times(forwards)  # fmt: skip
    solo = forwards * sum(forward_seconds(1))
    computed = sum(sizes)
    weighted = sum(g.flops(rows * tokens) * wave_efficiency(rows * tokens, g.out, spec.sms)
                   for rows in sizes for g in gemms)  # fmt: skip
    return SessionTick(
        sessions=sessions,
        computed_rows=computed,
        batches=tuple(sizes),
        tokens_per_chunk=tokens,
        gemm_rows=max(sizes) * tokens,
        forwards=forwards,
        flops=flops,
        seconds=forwards * sum(a + b for a, b in parts),
        linear_seconds=forwards * sum(a for a, _ in parts),
        attention_seconds=forwards * sum(b for _, b in parts),
        weight_read_seconds=weight_read,
        linear_efficiency=weighted / sum(g.flops(rows * tokens) for rows in sizes for g in gemms),
        solo_seconds_per_chunk=solo,
    )


def session_scan(p: WanParams, tokens_per_frame: int, chunk_frames: int = 3, window_frames: int = 21,
                 steps: int = 4, gpu: str | GpuSpec = "h100", mfu: float = DEFAULT_MFU,
                 sessions: tuple[int, ...] = SCAN_SESSIONS,
                 buckets: tuple[int, ...] | None = DEFAULT_BUCKETS) -> dict:  # fmt: skip
    """Ticks of every session count in ``sessions``, the GEMM sizes that fill the GPU, and ``pays_until``: the
    fewest sessions whose gain is within :data:`PAYS` of the best in the scan (past it, batching more sessions
    buys under 1 % per session-chunk)."""
    spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
    ticks = [plan_session_tick(p, n, tokens_per_frame, chunk_frames, window_frames, steps, spec, mfu, buckets)
             for n in sessions]  # fmt: skip
    best = max(t.gain for t in ticks)
    pays_until = next(t.sessions for t in ticks if t.gain >= best * (1 - PAYS))
    # the per-layer GEMMs set the size that fills the GPU (the one-off patch embedding and head are negligible)
    widths = sorted({g.out for g in wan_gemms(p) if g.count > 1})
    return {
        "gpu": spec.name,
        "sms": spec.sms,
        "memory_tb_s": spec.memory_tb_s,
        "tile": TILE,
        "buckets": None if buckets is None else list(buckets),
        "tokens_per_chunk": chunk_frames * tokens_per_frame,
        "fill_rows_by_width": {w: fill_rows(w, spec.sms) for w in widths},
        "fill_rows": max(fill_rows(w, spec.sms) for w in widths),
        "ridge_rows": ridge_rows(spec, mfu),
        "ticks": [t.as_dict() for t in ticks],
        "best_gain": best,
        "pays_until": pays_until,
    }


__all__ = [
    "PAYS",
    "SCAN_SESSIONS",
    "TILE",
    "Gemm",
    "SessionTick",
    "batch_sizes",
    "fill_rows",
    "plan_session_tick",
    "ridge_rows",
    "session_scan",
    "wan_gemms",
    "wave_efficiency",
]
