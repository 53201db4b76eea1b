"""What a worker pool is: mode, degrees, backend, timeouts, where the ranks meet. Checked before anything starts.

``mode="sp"`` (sequence parallel): ``ulysses_degree x ring_degree`` ranks share every forward; each rank holds a
shard of the image / video tokens (text replicated) and attention exchanges them (``engine.parallel.sequence``).
``mode="dp"`` (data parallel): ``dp_degree`` ranks each run a whole replica on a share of the batch.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from ..errors import InputError

MODES = ("sp", "dp")
BACKENDS = ("auto", "nccl", "gloo")
MAX_WORLD = 256


@dataclass(frozen=True)
class ParallelConfig:
    mode: str = "sp"
    ulysses_degree: int = 1
    ring_degree: int = 1
    dp_degree: int = 1
    backend: str = "auto"  # auto: nccl when this machine has a CUDA GPU per local rank, else gloo
    timeout: float = 60.0  # s: each collective, and how long a worker may stay silent during a job
    startup_timeout: float = 300.0  # s: ranks joining the pool, and a job's model load
    master_addr: str = "127.0.0.1"  # the pool's TCP store (this process hosts it)
    master_port: int = 0  # 0: any free port
    local_ranks: int | None = None  # ranks this machine starts (0 .. local_ranks - 1); None: all of them
    threads_per_rank: int | None = (
        None  # torch CPU threads per worker; None: this machine's cores / local ranks
    )
    world_size: int | None = None  # None: the degrees' product; when given it must equal it

    @property
    def world(self) -> int:
        return self.ulysses_degree * self.ring_degree if self.mode == "sp" else self.dp_degree

    @property
    def degrees(self) -> tuple[int, int]:
        """(ulysses, ring) of the sequence-parallel grid; (1, 1) in data-parallel mode."""
        return (self.ulysses_degree, self.ring_degree) if self.mode == "sp" else (1, 1)

    @property
    def launched_ranks(self) -> int:
        return self.world if self.local_ranks is None else self.local_ranks

    def check(self, where: str | None = None) -> ParallelConfig:
        if self.mode not in MODES:
            raise InputError(
                "mode", f"unknown mode {self.mode!r}; expected sp (sequence) or dp (data)", where
            )
        if self.backend not in BACKENDS:
            raise InputError(
                "backend", f"unknown backend {self.backend!r}; expected {', '.join(BACKENDS)}", where
            )
        for name in ("ulysses_degree", "ring_degree", "dp_degree"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InputError(name, f"expected a whole number >= 1, got {value!r}", where)
        if self.world > MAX_WORLD:
            raise InputError("ring_degree", f"{self.world} ranks; at most {MAX_WORLD}", where)
        if self.world_size is not None and self.world_size != self.world:
            product = (
                f"ulysses_degree {self.ulysses_degree} x ring_degree {self.ring_degree} = {self.world}"
                if self.mode == "sp"
                else f"dp_degree {self.dp_degree}"
            )
            raise InputError(
                "world_size",
                f"{product} ranks, but the world size is {self.world_size}; the degrees' product must equal it",
                where,
            )
        for name in ("timeout", "startup_timeout"):
            if not getattr(self, name) > 0:
                raise InputError(name, f"expected seconds > 0, got {getattr(self, name)!r}", where)
        if self.local_ranks is not None and not 1 <= self.local_ranks <= self.world:
            raise InputError(
                "local_ranks",
                f"{self.local_ranks} local ranks for a pool of {self.world}; expected 1 to {self.world} (the "
                "others join with `python -m fewstep worker`)",
                where,
            )
        if not 0 <= self.master_port < 65536:
            raise InputError(
                "master_port", f"{self.master_port} is not a TCP port (0 = any free port)", where
            )
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise InputError("threads_per_rank", f"expected >= 1, got {self.threads_per_rank}", where)
        return self

    def resolved_backend(self, where: str | None = None) -> str:
        """nccl or gloo for this machine's ranks; a clear error when nccl cannot work here."""
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        local = self.launched_ranks
        if self.backend == "auto":
            return "nccl" if gpus >= local and _nccl_available() else "gloo"
        if self.backend == "nccl":
            if gpus == 0:
                raise InputError(
                    "backend",
                    "nccl needs CUDA GPUs and this machine has none (torch.cuda.is_available() is False); "
                    "choose gloo (CPU) or auto",
                    where,
                )
            if gpus < local:
                raise InputError(
                    "backend",
                    f"nccl runs one rank per GPU: {local} local ranks but {gpus} GPU(s) visible "
                    "(CUDA_VISIBLE_DEVICES); lower the degrees, set local_ranks, or choose gloo",
                    where,
                )
            if not _nccl_available():
                raise InputError("backend", "this torch build has no NCCL; choose gloo or auto", where)
        return self.backend

    def threads(self) -> int:
        if self.threads_per_rank is not None:
            return self.threads_per_rank
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cores // self.launched_ranks)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> ParallelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def describe(self) -> str:
        if self.mode == "sp":
            grid = f"sequence parallel: ulysses {self.ulysses_degree} x ring {self.ring_degree}"
        else:
            grid = f"data parallel: {self.dp_degree} replicas"
        return f"{grid} ({self.world} ranks, backend {self.backend}, timeout {self.timeout:g} s)"


def _nccl_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available()
