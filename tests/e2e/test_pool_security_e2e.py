"""The parallel launcher through a real ComfyUI server: what a posted workflow may choose for the worker pool.

A prompt is untrusted: it may put the pool's store on loopback only, on a free port only (explicit ports and other
addresses are the administrator's: FEWSTEP_POOL_ALLOWED_ADDRS / FEWSTEP_POOL_ALLOWED_PORTS), and start no more local
ranks and threads than the machine has cores. A refusal is the node's one-line error, and nothing starts or listens.
"""

# ruff: noqa: F811 - the tests take the imported ``server`` fixture as an argument
from __future__ import annotations

import os

import pytest
from comfy_server import queue, requires_comfyui, server  # noqa: F401
from net_listen import listening_ports_of

pytestmark = requires_comfyui

# The server inherits this process's environment when the module's server starts. Every test here is refused before
# the pool's secret is read, except the one about the secret itself.
WEAK_TOKEN = "a" * 64  # the length of a secret, not its entropy


@pytest.fixture(scope="module", autouse=True)
def _weak_pool_token():
    previous = os.environ.get("FEWSTEP_POOL_TOKEN")
    os.environ["FEWSTEP_POOL_TOKEN"] = WEAK_TOKEN
    yield
    if previous is None:
        del os.environ["FEWSTEP_POOL_TOKEN"]
    else:
        os.environ["FEWSTEP_POOL_TOKEN"] = previous


def _launcher(**inputs) -> dict:
    values = {"mode": "sp", "ulysses_degree": 2, "ring_degree": 1, "dp_degree": 1, "backend": "gloo",
              "timeout": 30.0, "enabled": True, "local_ranks": 0, "master_addr": "127.0.0.1", "master_port": 0,
              "threads_per_rank": 1}  # fmt: skip
    return {
        "1": {"class_type": "FewStepParallelLauncher", "inputs": {**values, **inputs}},
        "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 1]}},
    }


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _nothing_started(server) -> None:
    """The server holds only its own HTTP listener and started no worker process."""
    ports = listening_ports_of(server["pid"])
    http = int(server["url"].rsplit(":", 1)[1])
    assert ports == {http: "127.0.0.1"}, ports
    assert _children(server["pid"]) == [], _children(server["pid"])


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "192.0.2.1"])
def test_a_prompt_cannot_open_the_store_beyond_loopback(server, address):
    code, out = queue(server, _launcher(master_addr=address), "--quiet")
    assert code == 3, out
    assert (
        f"FewStepParallelLauncher: input 'master_addr': {address!r} is not a loopback address; a workflow may "
        "choose 127.0.0.1, ::1 or localhost, and other addresses only when the administrator lists them in "
        "FEWSTEP_POOL_ALLOWED_ADDRS" in out
    ), out
    _nothing_started(server)


@pytest.mark.parametrize(
    "port, expected",
    [
        (1, "input 'master_port': 1 is a privileged port (below 1024); use 0 for any free port"),
        (
            8188,
            "input 'master_port': 8188: an explicit port needs the administrator to list it in "
            "FEWSTEP_POOL_ALLOWED_PORTS",
        ),  # fmt: skip
    ],
)
def test_a_prompt_cannot_choose_a_privileged_or_unlisted_port(server, port, expected):
    code, out = queue(server, _launcher(master_port=port), "--quiet")
    assert code == 3 and f"FewStepParallelLauncher: {expected}" in out, out
    _nothing_started(server)


def test_a_prompt_cannot_start_more_ranks_or_threads_than_allowed(server):
    code, out = queue(server, _launcher(ulysses_degree=16, ring_degree=16), "--quiet")
    cap = os.environ.get("FEWSTEP_POOL_MAX_LOCAL_RANKS")  # the server inherits this process's environment
    assert code == 3, out
    assert (
        "FewStepParallelLauncher: input 'ring_degree': ulysses_degree 16 x ring_degree 16 would start 256 local "
        "worker processes, but "
        + (f"the administrator's FEWSTEP_POOL_MAX_LOCAL_RANKS is {cap}" if cap else "")
        in out
    ), out
    code, out = queue(server, _launcher(threads_per_rank=1024), "--quiet")
    assert (
        code == 3 and "FewStepParallelLauncher: input 'threads_per_rank': 1024 threads x 2 local ranks" in out
    ), out
    _nothing_started(server)


def test_a_secret_without_entropy_in_the_servers_environment_is_refused(server):
    code, out = queue(server, _launcher(), "--quiet")
    assert code == 3, out
    assert (
        "FewStepParallelLauncher: input 'FEWSTEP_POOL_TOKEN': only 1 distinct byte values in 32 bytes (a pattern, "
        "not random); expected at least 32 random bytes written as hex (64 characters)" in out
    ), out
    assert WEAK_TOKEN not in out  # the error names the rule, never the value
    _nothing_started(server)
