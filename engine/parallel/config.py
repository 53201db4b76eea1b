"""What a worker pool is: mode, degrees, backend, timeouts, where the ranks meet. Checked before anything starts.

``mode="sp"`` (sequence parallel): ``ulysses_degree x ring_degree`` ranks share every forward; each rank holds a
shard of the image / video tokens (text replicated) and attention exchanges them (``engine.parallel.sequence``).
``mode="dp"`` (data parallel): ``dp_degree`` ranks each run a whole replica on a share of the batch.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
from dataclasses import dataclass

import torch

from ..errors import InputError
from ..preflight.budget import check_fits
from ..settings import env_int, env_list

log = logging.getLogger(__name__)

MODES = ("sp", "dp")
BACKENDS = ("auto", "nccl", "gloo")
MAX_WORLD = 256
# What a workflow may choose is untrusted: beyond loopback and "any free port", the administrator decides.
ALLOWED_ADDRS_ENV = "FEWSTEP_POOL_ALLOWED_ADDRS"  # addresses beyond loopback the store may listen on
ALLOWED_PORTS_ENV = "FEWSTEP_POOL_ALLOWED_PORTS"  # explicit store ports (e.g. 29500 or 29500-29510)
MAX_LOCAL_RANKS_ENV = "FEWSTEP_POOL_MAX_LOCAL_RANKS"  # local ranks allowed; default: this machine's cores
LOWEST_PORT = 1024  # below: privileged ports, never bound for a workflow
# Host memory of one idle worker (interpreter, torch, gloo, store clients) before any model: 226 MiB RSS
# measured for a gloo rank on CPU (torch 2.13), rounded up. The model's weights are checked by the same preflight
# when a job names the model: on the host for the local workers (client.check_local_workers_fit), and by each
# rank on its own device (jobs.WorkerContext.check_model_fits).
WORKER_BASELINE_BYTES = 256 << 20


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def is_loopback_literal(addr: str) -> bool:
    """``localhost`` or a loopback IP literal (127.0.0.0/8, ::1). Names are not resolved: what a name resolves to
    is not the workflow's to decide either."""
    if addr.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr.strip()).is_loopback
    except ValueError:
        return False


def _same_address(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a.lower() == b.lower()


def allowed_ports() -> set[int]:
    """The explicit ports the administrator allows (``FEWSTEP_POOL_ALLOWED_PORTS``: ports or ranges ``a-b``)."""
    ports: set[int] = set()
    for entry in env_list(ALLOWED_PORTS_ENV):
        low, _, high = entry.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            log.warning(
                "fewstep: ignoring %r in %s (expected a port or a range a-b)", entry, ALLOWED_PORTS_ENV
            )
            continue
        ports.update(range(max(first, LOWEST_PORT), min(last, 65535) + 1))
    return ports


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
        self._check_address(where)
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise InputError("threads_per_rank", f"expected >= 1, got {self.threads_per_rank}", where)
        self._check_local_size(where)
        return self

    def _check_address(self, where: str | None) -> None:
        """Loopback and a free port unless the administrator allows more: a workflow must not open the store on
        the network, bind a privileged port, or probe which ports are in use."""
        addr = self.master_addr
        if not isinstance(addr, str) or not addr.strip():
            raise InputError("master_addr", f"expected an address, got {addr!r}", where)
        allowed = env_list(ALLOWED_ADDRS_ENV)
        if not is_loopback_literal(addr) and not any(_same_address(addr.strip(), a) for a in allowed):
            raise InputError(
                "master_addr",
                f"{addr!r} is not a loopback address; a workflow may choose 127.0.0.1, ::1 or localhost, and "
                f"other addresses only when the administrator lists them in {ALLOWED_ADDRS_ENV} (the server's "
                "environment)",
                where,
            )
        port = self.master_port
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise InputError("master_port", f"{port!r} is not a TCP port (0 = any free port)", where)
        if 0 < port < LOWEST_PORT:
            raise InputError(
                "master_port",
                f"{port} is a privileged port (below {LOWEST_PORT}); use 0 for any free port",
                where,
            )
        if port and port not in allowed_ports():
            raise InputError(
                "master_port",
                f"{port}: an explicit port needs the administrator to list it in {ALLOWED_PORTS_ENV} (the "
                "server's environment); use 0 for any free port",
                where,
            )

    def _check_local_size(self, where: str | None) -> None:
        """Local ranks within the cores (or the administrator's cap), threads within the cores."""
        cores = usable_cores()
        ranks = self.launched_ranks
        cap = env_int(MAX_LOCAL_RANKS_ENV, None, minimum=1, maximum=4096, default_text="this machine's cores")
        limit = cores if cap is None else cap
        if ranks > limit:
            why = (
                f"the administrator's {MAX_LOCAL_RANKS_ENV} is {cap}"
                if cap is not None
                else f"this machine has {cores} cores (the administrator may allow more with {MAX_LOCAL_RANKS_ENV})"
            )
            raise InputError(
                self.ranks_input,
                f"{self._ranks_text()} would start {ranks} local worker processes, but {why}; lower the degrees or "
                "set local_ranks and join the other ranks from other machines",
                where,
            )
        # one thread per rank is always allowed: how many ranks may share the cores is the cap's to say
        if self.threads_per_rank is not None and self.threads_per_rank > max(1, cores // ranks):
            raise InputError(
                "threads_per_rank",
                f"{self.threads_per_rank} threads x {ranks} local ranks = {self.threads_per_rank * ranks} threads, "
                f"but this machine has {cores} cores; at most {max(1, cores // ranks)} per rank (0 = cores / local "
                "ranks)",
                where,
            )

    @property
    def ranks_input(self) -> str:
        """The input that set how many ranks start here (for errors about their number)."""
        if self.local_ranks is not None:
            return "local_ranks"
        return "ring_degree" if self.mode == "sp" else "dp_degree"

    def _ranks_text(self) -> str:
        if self.local_ranks is not None:
            return f"local_ranks {self.local_ranks}"
        if self.mode == "sp":
            return f"ulysses_degree {self.ulysses_degree} x ring_degree {self.ring_degree}"
        return f"dp_degree {self.dp_degree}"

    def check_memory(self, where: str | None = None) -> int:
        """Refuse local workers whose baseline memory does not fit the host, before any process starts."""
        ranks = self.launched_ranks
        return check_fits(
            {f"{ranks} worker processes x {WORKER_BASELINE_BYTES >> 20} MiB": ranks * WORKER_BASELINE_BYTES},
            "cpu",
            self.ranks_input,
            where,
            hint="Each local rank is a process of its own (before any model); start fewer ranks here",
        )

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
        return max(1, usable_cores() // self.launched_ranks)

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
