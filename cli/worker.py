"""``python -m fewstep worker``: join a FewStep worker pool from this machine as one rank.

The host (ComfyUI with a FewStepParallelLauncher whose ``local_ranks`` is below the pool size, or a script that
started a ``WorkerPool``) prints the command when it waits for remote ranks. The usual torchrun variables say
where and who; options override them::

    export FEWSTEP_POOL_TOKEN="$(cat ~/.fewstep_pool_token)"  # the host's value; never a command-line option
    MASTER_ADDR=10.0.0.5 MASTER_PORT=29500 WORLD_SIZE=4 RANK=2 LOCAL_RANK=0 python -m fewstep worker

The pool's secret comes from the environment only (``FEWSTEP_POOL_TOKEN``, the value the host was started with):
argv is readable by every user of the machine. Without it, or with another value, the worker exits with status 2
naming the variable.

The worker loads the model of each job itself (the same path must exist on this machine, or ``dummy:<preset>``)
and keeps it between jobs. It exits when the host shuts the pool down or disappears. Exit status 2 with a
one-line message when the host cannot be reached within ``--timeout`` or the rank does not fit the pool.
"""

from __future__ import annotations

import logging
import os

from ..engine.parallel.worker import Rendezvous, serve

HELP = (
    "join a FewStep worker pool as one rank (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK; the pool's "
    "secret in FEWSTEP_POOL_TOKEN)"
)


def add_arguments(p) -> None:
    p.add_argument("--master-addr", default=None, help="the host's address (default: $MASTER_ADDR)")
    p.add_argument(
        "--master-port", type=int, default=None, help="the host's store port (default: $MASTER_PORT)"
    )
    p.add_argument("--world-size", type=int, default=None, help="ranks in the pool (default: $WORLD_SIZE)")
    p.add_argument("--rank", type=int, default=None, help="this worker's rank (default: $RANK)")
    p.add_argument(
        "--local-rank", type=int, default=None, help="GPU index on this machine (default: $LOCAL_RANK or 0)"
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the host's store")
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: the pool's setting)"
    )


def run(args) -> int:
    env = dict(os.environ)
    for option, key in (
        ("master_addr", "MASTER_ADDR"), ("master_port", "MASTER_PORT"), ("world_size", "WORLD_SIZE"),
        ("rank", "RANK"), ("local_rank", "LOCAL_RANK"),
    ):  # fmt: skip
        value = getattr(args, option)
        if value is not None:
            env[key] = str(value)
    env["FEWSTEP_WORKER_TIMEOUT"] = str(args.timeout)
    env.pop("FEWSTEP_PARENT_PID", None)  # a joined worker has no host process on this machine
    if args.threads is not None:
        env["FEWSTEP_WORKER_THREADS"] = str(args.threads)
    rendezvous = Rendezvous.from_env(env)
    logging.getLogger("fewstep").setLevel(logging.INFO)
    return serve(rendezvous)
