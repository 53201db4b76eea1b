"""The host side of a worker pool: start the ranks, hand them jobs, watch them, stop them.

The host process is not a rank: it hosts the TCP store the ranks meet at, listening on ``master_addr:master_port``
only (loopback by default), starts the local ranks as fresh interpreters and only ever talks to the store, with a
deadline on every wait. So a dead or hung worker becomes an error naming the rank, never a hang of the host:

* a local worker that exits is noticed at once (its exit status or signal is in the error);
* a worker whose heartbeat (every 0.5 s, from a thread of its own) stops for ``timeout`` seconds is named as
  hung or unreachable;
* a job where no rank makes progress (a step, a chunk) for ``timeout`` seconds names the ranks that are behind
  (``startup_timeout`` until every rank has its model loaded);
* a worker that reports an error is named with its message.

After such a failure the pool is stopped (its workers may be stuck inside a collective) and the next job
starts a new one. ``shutdown`` (called by the node, on interpreter exit through ``atexit``, or when ComfyUI
frees memory) asks the workers to leave, then terminates and reaps whatever is left: no process outlives it.

Security: the store has no authentication of its own, so every payload is sealed with a per-pool secret
(``transport.SecureStore``): a random token handed to local workers through a pipe (their stdin, read once at
start; never on the command line or in their environment), or ``FEWSTEP_POOL_TOKEN`` from this process's environment when ranks join from elsewhere. A job's payloads
are deleted from the store when the job ends (done, failed or cancelled), and a stopped pool stops listening.

Local workers are started with ``subprocess`` as ``python -c <bootstrap>``: a fresh interpreter, which is what
multiprocessing's spawn method gives, without spawn re-running the host's ``__main__`` in each child (ComfyUI's
``main.py`` runs its start-up at import) or importing the pack by a module name that only exists inside ComfyUI.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import itertools
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ..errors import FewStepError, InputError
from . import transport
from .config import ParallelConfig
from .worker import HEARTBEAT_SECONDS

log = logging.getLogger(__name__)

PACKAGE_ROOT = Path(__file__).resolve().parents[2]

# The worker imports the engine from this checkout as the package ``fewstep``, whatever name the host uses.
BOOTSTRAP = """
import os, sys, types
package = types.ModuleType("fewstep")
package.__path__ = [os.environ["FEWSTEP_PACKAGE_ROOT"]]
sys.modules["fewstep"] = package
from fewstep.engine.parallel.worker import main
sys.exit(main())
"""


# the counters a job leaves in the store (see ``jobs``), deleted with its payloads when every rank is done
JOB_COUNTERS = ("events", "progress", "failed", "finished", "read", "cancel")
RANK_COUNTERS = ("step", "done", "cancelled")


class ParallelError(FewStepError):
    """A worker failed, died or stopped responding; the message names the rank."""


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _listen(addr: str, port: int) -> socket.socket:
    """A socket listening on ``addr:port`` only, for the store (torch's TCPStore server would listen on every
    interface); an error naming the input at once when it cannot (TCPStore would retry for its whole timeout)."""
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except OSError as err:
        raise InputError("master_addr", f"{addr!r} does not resolve ({err.strerror or err})") from None
    family, _, _, _, sockaddr = infos[0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((sockaddr[0], port))
        listener.listen(128)
    except OSError as err:
        listener.close()
        if port:
            # one message whatever the reason (in use, not permitted, ...): it must not tell a workflow which
            # ports are open on this machine
            raise InputError(
                "master_port", f"cannot listen on {addr} port {port}; use 0 for any free port"
            ) from None
        raise InputError(
            "master_addr",
            f"{addr!r} is not an address of this machine ({err.strerror or err}): the store listens here; "
            "use 127.0.0.1 for local ranks or this machine's address on the network",
        ) from None
    return listener


def is_loopback(addr: str) -> bool:
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def _loopback_interface() -> str | None:
    """The name of the loopback interface (``lo`` on Linux, ``lo0`` on macOS), None when there is none."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in names if name in ("lo", "lo0")), None)


def pool_token(config: ParallelConfig, where: str | None = None) -> bytes:
    """The pool's secret: ``FEWSTEP_POOL_TOKEN`` when set here (ranks that join by hand need the same value),
    else a fresh random one that only the local workers receive."""
    raw = os.environ.get(transport.TOKEN_ENV, "").strip()
    if raw:
        return transport.check_token(raw, where)
    if config.launched_ranks < config.world:
        raise InputError(
            "local_ranks",
            f"{config.launched_ranks} of {config.world} ranks start here; the ranks that join need the pool's "
            f"secret: set {transport.TOKEN_ENV} (at least 32 random bytes as hex, e.g. from `python -c 'import "
            "secrets; print(secrets.token_hex(32))'`) in this process's environment before it starts, and the "
            "same value in each joining worker's environment",
            where,
        )
    return transport.new_token()


class WorkerPool:
    """``world`` ranks serving jobs for this process (see the module docstring)."""

    _ids = itertools.count(1)

    def __init__(self, config: ParallelConfig, where: str | None = None):
        self.config = config.check(where)
        if config.timeout < 1:
            raise InputError(
                "timeout", f"{config.timeout:g} s; at least 1 s (workers beat every 0.5 s)", where
            )
        self.backend = config.resolved_backend(where)
        config.check_memory(where)  # before any process starts
        self.world = config.world
        self.token = pool_token(config, where)
        transport.require_cipher(where)
        # random: the pool's keys are derived from it, so nothing sealed for another pool authenticates here
        self.id = f"pool{next(self._ids)}-{secrets.token_hex(16)}"
        self.store: transport.SecureStore | None = None
        self.port = None
        self.procs: dict[int, subprocess.Popen] = {}
        self.ranks: dict[int, dict] = {}
        self.closed = False
        self.failure: str | None = None
        self.model_key = None  # the model the workers hold (see client.model_spec)
        self.drop_sessions: list[str] = []  # worker-side video sessions to free with the next job
        self._jobs = 0
        self._unfinished: list[int] = []
        self._chunks_read: dict[int, int] = {}
        self._limits: dict[int, int] = {}
        self._lock = threading.RLock()

    # -- life cycle ------------------------------------------------------------------------------------------------
    def start(self, interrupt=None) -> WorkerPool:
        """Start the store and the local ranks and wait for every rank. ``interrupt``, called while waiting,
        may raise to cancel the start (ComfyUI's cancel button); the workers are then stopped."""
        cfg = self.config
        listener = _listen(cfg.master_addr, cfg.master_port)
        port = listener.getsockname()[1]
        try:
            store = dist.TCPStore(
                cfg.master_addr, port, None, True, timeout=timedelta(seconds=cfg.timeout), wait_for_workers=False,
                master_listen_fd=listener.fileno(),
            )  # fmt: skip
        except (RuntimeError, OSError) as err:
            listener.close()
            raise InputError(
                "master_port", f"cannot listen on {cfg.master_addr}:{port}: {str(err).splitlines()[0]}"
            ) from None
        listener.detach()  # the store's server owns the socket now and closes it when it stops
        self.store = transport.SecureStore(store, self.token, self.id)
        self.port = store.port
        store.set(transport.POOL_ID_KEY, self.id)
        transport.put(self.store, "config", cfg.to_dict())
        transport.put(self.store, "pool", {"backend": self.backend, "threads": cfg.threads(), "id": self.id})
        _track(self)
        try:
            for rank in range(cfg.launched_ranks):
                self.procs[rank] = self._spawn(rank)
            self._wait_ready(interrupt)
        except BaseException:
            self._abort("start-up failed")
            raise
        log.info("fewstep: %s", self.describe())
        return self

    def _spawn(self, rank: int) -> subprocess.Popen:
        cfg = self.config
        threads = cfg.threads()
        env = dict(
            os.environ,
            MASTER_ADDR=cfg.master_addr, MASTER_PORT=str(self.port), WORLD_SIZE=str(self.world), RANK=str(rank),
            LOCAL_RANK=str(rank), FEWSTEP_PACKAGE_ROOT=str(PACKAGE_ROOT), FEWSTEP_PARENT_PID=str(os.getpid()),
            FEWSTEP_WORKER_THREADS=str(threads), FEWSTEP_WORKER_TIMEOUT=str(cfg.timeout),
            OMP_NUM_THREADS=str(threads), TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
            FEWSTEP_POOL_TOKEN_STDIN="1",
        )  # fmt: skip
        # the secret goes through a pipe the worker reads once at start: not argv (every user reads it), not the
        # environment (/proc/<pid>/environ: this user's other processes read it for the worker's whole life)
        env.pop(transport.TOKEN_ENV, None)
        loopback = _loopback_interface() if is_loopback(cfg.master_addr) else None
        if loopback is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
            # gloo listens on the address of this machine's host name otherwise, often one on the network
            env["GLOO_SOCKET_IFNAME"] = loopback
        proc = subprocess.Popen([sys.executable, "-c", BOOTSTRAP], env=env, stdin=subprocess.PIPE)
        try:
            proc.stdin.write(self.token + b"\n")
            proc.stdin.close()
        except OSError:  # the worker died at once: the start-up wait names its exit status
            pass
        return proc

    def join_command(self) -> str:
        """How a rank joins from another machine; names the secret's variable, never its value (this is logged)."""
        return (
            f"MASTER_ADDR={self.config.master_addr} MASTER_PORT={self.port} WORLD_SIZE={self.world} "
            f"RANK=<rank> LOCAL_RANK=<gpu> python -m fewstep worker (with {transport.TOKEN_ENV} in its environment "
            f"set to this process's {transport.TOKEN_ENV})"
        )

    def _wait_ready(self, interrupt=None) -> None:
        cfg = self.config
        remote = list(range(cfg.launched_ranks, self.world))
        if remote:
            log.warning(
                "fewstep: waiting for ranks %s to join: on their machines run %s", remote, self.join_command()
            )
        deadline = time.monotonic() + cfg.startup_timeout
        poll = transport.Poll(longest=0.05)
        while True:
            missing = [r for r in range(self.world) if not transport.ready(self.store, f"ready/{r}")]
            if not missing:
                break
            for r in range(self.world):
                if transport.ready(self.store, f"fatal/{r}"):
                    record = transport.get(self.store, f"fatal/{r}")
                    if record.get("input_name"):
                        raise InputError(record["input_name"], f"rank {r}: {record['problem']}")
                    raise ParallelError(f"rank {r} could not start: {record['type']}: {record['message']}")
            for r, proc in self.procs.items():
                code = proc.poll()
                if code is not None:
                    raise ParallelError(f"rank {r} (pid {proc.pid}) {describe_exit(code)} while starting")
            if interrupt is not None:
                interrupt()
            if time.monotonic() > deadline:
                hint = (
                    f"; start remote ranks with: {self.join_command()}" if set(missing) & set(remote) else ""
                )
                raise ParallelError(f"ranks {missing} did not join within {cfg.startup_timeout:g} s{hint}")
            poll.wait()
        self.ranks = {r: transport.get(self.store, f"ready/{r}") for r in range(self.world)}

    @property
    def alive(self) -> bool:
        return not self.closed and all(p.poll() is None for p in self.procs.values())

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def describe(self) -> str:
        devices = sorted({info.get("device", "?") for info in self.ranks.values()})
        hosts = sorted({info.get("host", "?") for info in self.ranks.values()})
        threads = sorted({info.get("threads") for info in self.ranks.values()})
        return (
            f"{self.config.describe().replace(f'backend {self.config.backend}', f'backend {self.backend}')}; "
            f"{len(self.procs)} local worker(s), store {self.config.master_addr}:{self.port}, hosts "
            f"{', '.join(hosts)}, devices {', '.join(devices)}, threads per rank {threads}"
        )

    def shutdown(self, grace: float = 5.0) -> None:
        """Ask every rank to leave, then terminate and reap the local ones still running."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._tell_workers_to_leave()
            _stop(self.procs.values(), grace)
            self.store = None  # the store's server stops with its last reference: no port, no data left
            _untrack(self)

    def _abort(self, reason: str) -> None:
        """Stop at once (workers may be stuck inside a collective): a broken pool is replaced, never reused."""
        with self._lock:
            self.failure = reason
            if self.closed:
                return
            self.closed = True
            self._tell_workers_to_leave()
            _stop(self.procs.values(), grace=0.0, force=True)
            self.store = None
            _untrack(self)

    def _tell_workers_to_leave(self) -> None:
        """The ``shutdown`` key, and the marker in place of the next job that idle workers are blocked on."""
        with contextlib.suppress(RuntimeError, OSError, AttributeError):
            self.store.set("shutdown", "1")
            self.store.set(f"job/{self._jobs + 1}", "shutdown")

    # -- jobs ------------------------------------------------------------------------------------------------------
    def submit(self, job: dict, result_limit: int | None = None) -> int:
        with self._lock:
            if self.closed:
                raise ParallelError(f"the worker pool was shut down ({self.failure or 'closed'})")
            self._cleanup()
            self._jobs += 1
            n = self._jobs
            job = dict(job, drop_sessions=list(self.drop_sessions))
            self.drop_sessions.clear()
            transport.put(self.store, f"job/{n}", job)
            # the most a result or a chunk of this job can be: a larger one is refused before it is read
            self._limits[n] = result_limit or transport.message_limit(job)
            self._unfinished.append(n)
            return n

    def run(self, job: dict, on_progress=None, on_chunk=None, result_limit: int | None = None) -> dict:
        """Submit ``job`` and wait for its result. An exception raised by a callback (ComfyUI's interrupt)
        cancels the job on every rank, then propagates."""
        n = self.submit(job, result_limit)
        events = self.events(n, job.get("kind", "job"))
        try:
            while True:
                kind, payload = next(events)
                if kind == "progress" and on_progress is not None:
                    on_progress(payload)
                elif kind == "chunk" and on_chunk is not None:
                    on_chunk(payload)
        except StopIteration as done:
            return done.value
        except (ParallelError, InputError):
            raise
        except BaseException:
            self.cancel(n)
            raise

    def events(self, n: int, kind: str = "job"):
        """Generator of ``("progress", count)`` and ``("chunk", payload)`` events of job ``n``; returns its result.

        A payload that is not the pool's (planted or changed by another client of the store) stops the pool and
        is an error: the host never returns it."""
        try:
            result = yield from self._events(n, kind)
        except transport.ForgedMessageError as err:
            self._abort(f"a forged message in job {n}")
            raise ParallelError(
                f"job {n}: {err}; the worker pool was stopped and restarts on the next run"
            ) from None
        self._finished_with(n)
        return result

    @property
    def _live_store(self) -> transport.SecureStore:
        # read on each use, never kept in a local: a stopped pool's store must be free to go (and stop listening)
        store = self.store
        if store is None:
            raise ParallelError(f"the worker pool was shut down ({self.failure or 'closed'})")
        return store

    def _events(self, n: int, kind: str):
        watch = _Watch(self, n, kind)
        poll = transport.Poll(0.0005, 0.005)
        progress = 0
        seen = -1
        self._chunks_read[n] = 0
        while True:
            # one round trip per poll while nothing happens
            changes = transport.counter(self._live_store, f"events/{n}")
            if changes == seen:
                watch.check()
                poll.wait()
                continue
            seen = changes
            active = False
            for payload in self._read_chunks(n):
                active = True
                yield ("chunk", payload)
            count = transport.counter(self._live_store, f"progress/{n}")
            if count > progress:
                progress, active = count, True
                yield ("progress", count)
            if transport.ready(self._live_store, f"result/{n}"):
                result = transport.get(self._live_store, f"result/{n}", self._limit(n))
                transport.delete(self._live_store, f"result/{n}")
                for payload in self._read_chunks(n):  # written before the result
                    yield ("chunk", payload)
                return result
            if transport.counter(self._live_store, f"failed/{n}"):
                self._raise_failure(n, kind)
            if self._live_store.check([f"cancelled/{n}/0"]):
                raise ParallelError(f"{kind} was cancelled on the workers")
            watch.check()
            if active:
                poll.reset()
            else:
                poll.wait()

    def _limit(self, n: int) -> int:
        return self._limits.get(n, transport.RECORD_BYTES)

    def _read_chunks(self, n: int):
        """The video chunks of job ``n`` that are in the store, in order, each deleted once read."""
        while transport.ready(self._live_store, f"chunk/{n}/{self._chunks_read[n]}"):
            key = f"chunk/{n}/{self._chunks_read[n]}"
            payload = transport.get(self._live_store, key, self._limit(n))
            transport.delete(self._live_store, key)
            self._chunks_read[n] += 1
            yield payload

    def cancel(self, n: int) -> None:
        """Stop job ``n`` on every rank and wait (at most ``timeout``) until they are back; else stop the pool.
        Either way nothing of the job is left in the store."""
        with self._lock:
            if self.closed:
                return
            self.store.set(f"cancel/{n}", "1")
            deadline = time.monotonic() + self.config.timeout
            while transport.counter(self.store, f"finished/{n}") < self.world:
                if time.monotonic() > deadline or not self.alive:
                    self._abort(f"job {n} did not stop within {self.config.timeout:g} s of being cancelled")
                    return
                time.sleep(0.005)
            self._forget(n)

    def _finished_with(self, n: int) -> None:
        """Job ``n`` ended here: forget it now if every rank is done with it, else with the next submit."""
        with self._lock:
            if not self.closed and transport.counter(self.store, f"finished/{n}") >= self.world:
                self._forget(n)

    def _forget(self, n: int) -> None:
        """Delete every key of job ``n`` (payloads and counters). Only once every rank is done with the job: no
        rank writes to it again, and none deletes concurrently (the last rank to read the job deletes it)."""
        store = self.store
        transport.delete(store, f"job/{n}")
        transport.delete(store, f"result/{n}")
        chunk = self._chunks_read.pop(n, 0)
        self._limits.pop(n, None)
        while transport.ready(store, f"chunk/{n}/{chunk}"):
            transport.delete(store, f"chunk/{n}/{chunk}")
            chunk += 1
        for r in range(self.world):
            transport.delete(store, f"error/{n}/{r}")
            transport.delete(store, f"dp/{n}/{r}")
            for name in RANK_COUNTERS:
                store.delete_key(f"{name}/{n}/{r}")
        for name in JOB_COUNTERS:
            store.delete_key(f"{name}/{n}")
        if n in self._unfinished:
            self._unfinished.remove(n)

    def _raise_failure(self, n: int, kind: str) -> None:
        store = self.store
        started = time.monotonic()
        deadline = started + min(self.config.timeout, 5.0)
        beats = {r: transport.counter(store, f"hb/{r}") for r in range(self.world)}
        errors: dict[int, dict] = {}
        while True:
            for r in range(self.world):
                if r not in errors and transport.ready(store, f"error/{n}/{r}"):
                    errors[r] = transport.get(store, f"error/{n}/{r}")
            finished = transport.counter(store, f"finished/{n}")
            if finished >= self.world or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        if not errors:  # ranks write their report before they count the failure: the counter was not theirs
            self._abort(f"job {n}: a failure without a report")
            raise ParallelError(
                f"{kind}: the store marks job {n} failed but no rank reported an error (a client of the store "
                "without the pool's secret changed it); the worker pool was stopped and restarts on the next run"
            )
        first = errors[min(errors)]
        healthy = finished >= self.world and all(e.get("input_name") for e in errors.values())
        if healthy:  # a check every rank made before any collective: the pool is fine
            self._forget(n)
            raise InputError(first["input_name"], first["problem"])
        lost = self._lost_ranks(beats, time.monotonic() - started, exclude=set(errors))
        self._abort(f"rank {min(lost) if lost else first['rank']} failed")
        if lost:  # the errors are the survivors' collectives timing out or losing their peer: name the cause
            rank = min(lost)
            raise ParallelError(
                f"{kind}: rank {rank} (pid {self.ranks.get(rank, {}).get('pid')}) {lost[rank]} during the job; rank "
                f"{first['rank']} then failed with {first['type']}: {first['message'].splitlines()[0][:300]}; the "
                "worker pool was stopped and restarts on the next run"
            )
        others = sorted(set(errors) - {first["rank"]})
        also = f" (ranks {others} failed too)" if others else ""
        raise ParallelError(
            f"{kind}: rank {first['rank']} ({first.get('host')}, pid {first.get('pid')}) failed: "
            f"{first['type']}: {first['message']}{also}; the worker pool was stopped and restarts on the next run"
        )

    def _lost_ranks(self, beats: dict[int, int], waited: float, exclude: set[int]) -> dict[int, str]:
        """Ranks that died (local ones) or whose heartbeat stood still while we waited (> 2 beats long)."""
        lost = {}
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                lost[rank] = describe_exit(code)
        if waited > 2.5 * HEARTBEAT_SECONDS:
            for r in range(self.world):
                if (
                    r not in lost
                    and r not in exclude
                    and transport.counter(self.store, f"hb/{r}") == beats[r]
                ):
                    lost[r] = "stopped responding (no heartbeat: hung, stopped or unreachable)"
        return lost

    def _cleanup(self) -> None:
        """Forget the jobs that ended here while a rank was still busy with them, now that every rank is done."""
        for n in list(self._unfinished):
            if transport.counter(self.store, f"finished/{n}") >= self.world:
                self._forget(n)


class _Watch:
    """Liveness of one job: local processes, heartbeats, progress (see the module docstring)."""

    PERIOD = 0.25

    def __init__(self, pool: WorkerPool, n: int, kind: str):
        self.pool, self.n, self.kind = pool, n, kind
        now = time.monotonic()
        self.next_check = now
        self.beats = {r: -1 for r in range(pool.world)}
        self.beat_seen = dict.fromkeys(range(pool.world), now)
        self.steps = dict.fromkeys(range(pool.world), 0)
        self.step_seen = now

    def check(self) -> None:
        pool = self.pool
        if pool.closed:
            raise ParallelError(
                f"the worker pool was shut down during {self.kind} ({pool.failure or 'closed'})"
            )
        for rank, proc in pool.procs.items():
            code = proc.poll()
            if code is not None:
                pool._abort(f"rank {rank} {describe_exit(code)}")
                raise ParallelError(
                    f"{self.kind}: rank {rank} (pid {proc.pid}) {describe_exit(code)} during the job; the worker "
                    "pool was stopped and restarts on the next run"
                )
        now = time.monotonic()
        if now < self.next_check:
            return
        self.next_check = now + self.PERIOD
        store, cfg = pool.store, pool.config
        for r in range(pool.world):
            beat = transport.counter(store, f"hb/{r}")
            if beat != self.beats[r]:
                self.beats[r], self.beat_seen[r] = beat, now
            elif now - self.beat_seen[r] > cfg.timeout:
                pid = pool.ranks.get(r, {}).get("pid")
                pool._abort(f"rank {r} stopped responding")
                raise ParallelError(
                    f"{self.kind}: rank {r} (pid {pid}) stopped responding: no heartbeat for {cfg.timeout:g} s "
                    "(hung, stopped or unreachable); the worker pool was stopped and restarts on the next run"
                )
        steps = {r: transport.counter(store, f"step/{self.n}/{r}") for r in range(pool.world)}
        if steps != self.steps:
            self.steps, self.step_seen = steps, now
        done = {r for r in range(pool.world) if store.check([f"done/{self.n}/{r}"])}
        waiting = {r: s for r, s in steps.items() if r not in done}
        loading = any(s == 0 for s in waiting.values())
        limit = cfg.startup_timeout if loading else cfg.timeout
        if waiting and now - self.step_seen > limit:
            lowest = min(waiting.values())
            behind = sorted(r for r, s in waiting.items() if s == lowest)
            pool._abort(f"ranks {behind} made no progress")
            what = "loading the model" if lowest == 0 else f"after {lowest - 1} step(s)"
            raise ParallelError(
                f"{self.kind}: no progress for {limit:g} s; rank(s) {behind} stuck {what} (hung or waiting "
                "for a lost rank); the worker pool was stopped and restarts on the next run"
            )


def _stop(procs, grace: float, force: bool = False) -> None:
    """Wait ``grace`` seconds for the processes to leave, then terminate (``force``: kill) and reap them."""
    procs = list(procs)
    deadline = time.monotonic() + grace
    for proc in procs:
        remaining = deadline - time.monotonic()
        if remaining > 0:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(remaining)
    for proc in procs:
        if proc.poll() is None:
            (proc.kill if force else proc.terminate)()
    for proc in procs:
        try:
            proc.wait(2.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- pools of this process ---------------------------------------------------------------------------------------
_LIVE: set[WorkerPool] = set()
_POOLS: dict[ParallelConfig, WorkerPool] = {}
_REGISTRY_LOCK = threading.Lock()
_atexit_registered = False


def _track(pool: WorkerPool) -> None:
    global _atexit_registered
    _LIVE.add(pool)
    if not _atexit_registered:
        atexit.register(shutdown_all)
        _atexit_registered = True


def _untrack(pool: WorkerPool) -> None:
    _LIVE.discard(pool)


def get_pool(config: ParallelConfig, where: str | None = None, interrupt=None) -> WorkerPool:
    """The running pool for ``config``, started if needed; one pool at a time (others are shut down).
    ``interrupt`` may raise while the ranks start (see ``WorkerPool.start``)."""
    with _REGISTRY_LOCK:
        pool = _POOLS.get(config)
        if pool is not None and pool.alive:
            return pool
        for other in list(_POOLS.values()):
            other.shutdown()
        _POOLS.clear()
        pool = WorkerPool(config, where).start(interrupt)
        _POOLS[config] = pool
        return pool


def shutdown_pool(config: ParallelConfig) -> bool:
    with _REGISTRY_LOCK:
        pool = _POOLS.pop(config, None)
    if pool is None:
        return False
    pool.shutdown()
    return True


def shutdown_all() -> None:
    """Every pool this process started (registered with ``atexit`` when the first one starts)."""
    with _REGISTRY_LOCK:
        _POOLS.clear()
    for pool in list(_LIVE):
        pool.shutdown()
