"""A pool worker: one rank. Started by the host (``WorkerPool``) or on another machine with
``MASTER_ADDR=<host> MASTER_PORT=<port> WORLD_SIZE=<n> RANK=<r> [LOCAL_RANK=<gpu>] python -m fewstep worker``, with
the pool's secret in ``FEWSTEP_POOL_TOKEN`` (the environment, never the command line; workers the host starts
read it from a pipe on their stdin instead, see ``Rendezvous.from_env``). The process group forms through
``transport.RendezvousStore``, so the rank addresses it exchanges are sealed like every payload.

A worker connects to the host's TCP store (an error naming ``MASTER_ADDR`` within the timeout when it cannot),
reads the pool's configuration from it (an error naming ``FEWSTEP_POOL_TOKEN`` when it does not authenticate with
the worker's secret), checks its rank and device, waits for every rank (``startup_timeout``),
joins the process group (gloo or nccl, every collective bounded by ``timeout``) and then serves jobs until the
host says ``shutdown``: job ``n`` is read from the store by every rank, rank 0 writes the result. A heartbeat
thread bumps a counter in the store every half second so the host can name a rank that stopped; it also ends
the process when the host's store is gone for longer than the timeout or a local host process died, so no
worker outlives its pool. The model of a job is loaded once and kept for the jobs that follow.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import InputError
from . import transport
from .config import ParallelConfig
from .jobs import WorkerContext
from .rank import describe_device, error_record

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 0.5


@dataclass(frozen=True)
class Rendezvous:
    """Where and who: the torchrun variables, plus how long to try reaching the host."""

    master_addr: str
    master_port: int
    world_size: int
    rank: int
    local_rank: int
    timeout: float = 60.0
    parent_pid: int | None = None  # the host process, for workers it started itself
    threads: int | None = None
    # the pool's secret (FEWSTEP_POOL_TOKEN): kept out of repr, so a logged rendezvous does not show it
    token: bytes | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, env=None, stdin=None) -> Rendezvous:
        """From the torchrun variables; the secret from ``FEWSTEP_POOL_TOKEN``, or from ``stdin`` (one line, read
        once) for a worker the host started (``FEWSTEP_POOL_TOKEN_STDIN=1``)."""
        env = os.environ if env is None else env
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK") if not env.get(k)]
        if missing:
            raise InputError(
                missing[0],
                f"not set; a worker needs {', '.join(missing)} (the host prints them when it waits for "
                "remote ranks: MASTER_ADDR=<host> MASTER_PORT=<port> WORLD_SIZE=<n> RANK=<r>)",
            )
        # what the variables may hold: a typo (2**80 ranks, a timeout of inf) is refused here, not acted on
        ranges = {"MASTER_PORT": (1, 65535), "WORLD_SIZE": (1, 65536), "RANK": (0, 65535), "LOCAL_RANK": (0, 4096),
                  "FEWSTEP_WORKER_THREADS": (1, 4096), "FEWSTEP_PARENT_PID": (1, 2**22)}  # fmt: skip
        values = {}
        for key, (low, high) in ranges.items():
            raw = env.get(key) or ("0" if key == "LOCAL_RANK" else None)
            if raw is None:
                continue
            try:
                values[key] = int(raw)
            except ValueError:
                values[key] = None
            if values[key] is None or not low <= values[key] <= high:
                raise InputError(key, f"expected a whole number from {low} to {high}, got {raw[:40]!r}")
        if values["RANK"] >= values["WORLD_SIZE"]:
            raise InputError(
                "RANK", f"expected a rank below WORLD_SIZE={values['WORLD_SIZE']}, got {values['RANK']}"
            )
        raw_timeout = env.get("FEWSTEP_WORKER_TIMEOUT", "60")
        try:
            timeout = float(raw_timeout)
        except ValueError:
            timeout = math.nan
        if not 0 < timeout <= 7 * 86400:  # NaN fails too
            raise InputError(
                "FEWSTEP_WORKER_TIMEOUT", f"expected seconds in (0, 604800], got {raw_timeout[:40]!r}"
            )
        if env.get("FEWSTEP_POOL_TOKEN_STDIN") == "1" and stdin is not None:
            token = stdin.readline().decode(errors="replace").strip()  # written by the host, then closed
            stdin.close()
        else:
            token = env.get(transport.TOKEN_ENV, "").strip()
        if not token:
            raise InputError(
                transport.TOKEN_ENV,
                "not set; a worker needs the pool's secret: set it in this worker's environment to the value of "
                f"{transport.TOKEN_ENV} on the host (never as a command-line argument, which other users can read)",
            )
        transport.check_token(token)
        return cls(
            master_addr=env["MASTER_ADDR"],
            master_port=values["MASTER_PORT"],
            world_size=values["WORLD_SIZE"],
            rank=values["RANK"],
            local_rank=values["LOCAL_RANK"],
            timeout=timeout,
            parent_pid=values.get("FEWSTEP_PARENT_PID"),
            threads=values.get("FEWSTEP_WORKER_THREADS"),
            token=token.encode(),
        )


def connect(addr: str, port: int, timeout: float):
    """A client of the host's store, or an error naming MASTER_ADDR after at most ``timeout`` seconds.

    Plain TCP connects are retried until the deadline first (the host may still be starting), so the deadline
    holds exactly; the store client is made once the port answers."""
    deadline = time.monotonic() + timeout
    last = "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise InputError(
                "MASTER_ADDR",
                f"could not reach the pool's store at {addr}:{port} within {timeout:g} s ({last}); start the pool "
                "on the host first (FewStepParallelLauncher) and check MASTER_ADDR / MASTER_PORT and the firewall",
            )
        try:
            socket.create_connection((addr, port), timeout=min(left, 5.0)).close()
            break
        except OSError as err:
            last = err.strerror or type(err).__name__
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
    try:
        return dist.TCPStore(addr, port, None, False, timeout=timedelta(seconds=max(1.0, left)))
    except (RuntimeError, OSError) as err:  # DistNetworkError / DistStoreError are RuntimeErrors
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InputError(
            "MASTER_ADDR", f"{addr}:{port} answered but is not a FewStep pool's store ({first})"
        ) from None


class Heartbeat:
    """Bumps ``hb/<rank>`` every half second from its own store client; ends the process when the host is gone."""

    def __init__(self, rdzv: Rendezvous, timeout: float):
        self.rdzv, self.timeout = rdzv, timeout
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"fewstep-heartbeat-{rdzv.rank}", daemon=True)

    def start(self) -> Heartbeat:
        self.thread.start()
        return self

    def _run(self) -> None:
        r = self.rdzv
        try:
            store = dist.TCPStore(r.master_addr, r.master_port, None, False, timeout=timedelta(seconds=5))
        except (RuntimeError, OSError):
            log.error("fewstep worker %d: heartbeat cannot reach the host; exiting", r.rank)
            os._exit(3)
        last_ok = time.monotonic()
        while not self.stop.is_set():
            if r.parent_pid is not None and os.getppid() != r.parent_pid:
                log.error("fewstep worker %d: the host process %d is gone; exiting", r.rank, r.parent_pid)
                os._exit(3)
            try:
                store.add(f"hb/{r.rank}", 1)
                last_ok = time.monotonic()
            except (RuntimeError, OSError):
                if time.monotonic() - last_ok > self.timeout:
                    log.error("fewstep worker %d: the host's store is unreachable; exiting", r.rank)
                    os._exit(3)
            self.stop.wait(HEARTBEAT_SECONDS)


def serve(rdzv: Rendezvous) -> int:
    """Join the pool and serve jobs until the host shuts it down. Returns the exit status."""
    if not rdzv.token:
        raise InputError(transport.TOKEN_ENV, "not set; a worker needs the pool's secret")
    raw = connect(rdzv.master_addr, rdzv.master_port, rdzv.timeout)
    try:
        raw.wait(["config"], timedelta(seconds=rdzv.timeout))
    except RuntimeError:
        raise InputError(
            "MASTER_ADDR", f"{rdzv.master_addr}:{rdzv.master_port} is not a FewStep pool"
        ) from None
    store = transport.SecureStore(raw, rdzv.token, raw.get(transport.POOL_ID_KEY).decode(errors="replace"))
    try:
        config = ParallelConfig.from_dict(transport.get(store, "config"))
        pool = transport.get(store, "pool")
    except transport.ForgedMessageError:
        raise InputError(
            transport.TOKEN_ENV,
            f"the pool at {rdzv.master_addr}:{rdzv.master_port} does not accept it (its configuration does not "
            f"authenticate with this secret): set {transport.TOKEN_ENV} to the host's value",
        ) from None
    rank, world = rdzv.rank, config.world
    if rdzv.world_size != world:
        raise InputError(
            "WORLD_SIZE",
            f"{rdzv.world_size}, but the pool at {rdzv.master_addr}:{rdzv.master_port} has {world} ranks "
            f"({config.describe()}); the degrees' product must equal the world size",
        )
    if not 0 <= rank < world:
        raise InputError("RANK", f"{rank} is outside the pool's ranks 0..{world - 1}")
    if store.add(f"claim/{rank}", 1) > 1:
        raise InputError("RANK", f"rank {rank} has already joined this pool")
    try:
        return _serve(rdzv, store, config, pool, rank, world)
    except BaseException as err:  # the host is waiting for this rank: tell it why it will not come
        with contextlib.suppress(RuntimeError, OSError):
            transport.put(store, f"fatal/{rank}", error_record(err, rank))
        raise


def _serve(rdzv, store, config: ParallelConfig, pool: dict, rank: int, world: int) -> int:
    backend = pool["backend"]
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if rdzv.local_rank >= gpus:
            raise InputError(
                "LOCAL_RANK",
                f"rank {rank} wants GPU {rdzv.local_rank} for nccl but this machine has {gpus} GPU(s) "
                f"({socket.gethostname()})",
            )
        device = torch.device("cuda", rdzv.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.set_num_threads(rdzv.threads or pool["threads"])
    heartbeat = Heartbeat(rdzv, config.timeout).start()
    try:
        _wait_for_everyone(store, rank, world, config.startup_timeout)
        # kept referenced while the groups live: torch holds the C++ side only, and a collected Python store
        # leaves every later new_group without the methods it overrides
        rendezvous = transport.RendezvousStore(store, "pg/")
        dist.init_process_group(
            backend, store=rendezvous, rank=rank, world_size=world,
            timeout=timedelta(seconds=config.timeout), device_id=device if backend == "nccl" else None,
        )  # fmt: skip
        info = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "backend": backend,
                "threads": torch.get_num_threads(), **describe_device(device)}  # fmt: skip
        transport.put(store, f"ready/{rank}", info)
        WorkerContext(store, config, rank, world, device, backend).serve()
        return 0
    finally:
        heartbeat.stop.set()
        if dist.is_initialized():
            dist.destroy_process_group()


def _wait_for_everyone(store, rank: int, world: int, timeout: float) -> None:
    """A store barrier before the process group forms: remote ranks may join long after the local ones."""
    store.set(f"joined/{rank}", "1")
    deadline = time.monotonic() + timeout
    poll = transport.Poll(longest=0.05)
    while not all(store.check([f"joined/{r}"]) for r in range(world)):
        if store.check(["shutdown"]):
            raise SystemExit(0)
        if time.monotonic() > deadline:
            missing = [r for r in range(world) if not store.check([f"joined/{r}"])]
            raise InputError("startup_timeout", f"ranks {missing} did not join within {timeout:g} s")
        poll.wait()


def main(env=None) -> int:
    """Entry point of a worker process started by the host (errors are logged; exit status 2 or 1)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s fewstep worker: %(message)s")
    try:
        return serve(Rendezvous.from_env(env, sys.stdin.buffer if env is None else None))
    except InputError as err:
        log.error("%s", err)
        return 2
    except SystemExit as done:
        return int(done.code or 0)
    except BaseException:
        log.exception("worker failed")
        return 1
