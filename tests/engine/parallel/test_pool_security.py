"""The worker pool's store against a client on the same machine that has no token: where the store listens,
what such a client can read or plant, what is left in the store after a job, and how workers get the token.

The attacker here is a plain ``TCPStore`` client on loopback: the store itself has no authentication, so it can
connect, list, read, write and delete keys. What the pool guarantees is that it cannot read a payload in the
clear, cannot make the host return a result (or a worker run a job) it planted, and finds no payload of a job
that has ended."""

from __future__ import annotations

import io
import os
import re
import secrets
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from net_listen import listening_ports_of

from fewstep.engine import InputError
from fewstep.engine.parallel import ParallelConfig, ParallelError, WorkerPool, transport
from fewstep.engine.parallel.worker import Rendezvous, serve
from fewstep.engine.preflight.ledger import LEDGER

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is needed"
)

PAYLOADS = ("job", "result", "chunk", "dp", "error")  # the keys that carry data (tensors, messages)
COUNTERS = ("events", "progress", "failed", "finished", "read", "cancel", "cancelled", "step", "done")
MARKER = torch.arange(4096, dtype=torch.float32) * 1.2345 + 7.0  # recognisable bytes in a payload


def _config(**changes) -> ParallelConfig:
    """One local worker: the cheapest pool that exercises every message of a job."""
    values = {"mode": "dp", "dp_degree": 1, "backend": "gloo", "timeout": 30.0, "threads_per_rank": 1}
    return ParallelConfig(**{**values, **changes})


@pytest.fixture(scope="module")
def pool():
    pool = WorkerPool(_config()).start()
    yield pool
    pool.shutdown()


def _attacker(port: int):
    """A client of the pool's store that knows the port and nothing else."""
    return dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=5))


def _listening(port: int) -> set[str]:
    """Addresses with a TCP socket listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{name}") as table:
            for line in list(table)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(address)
                # the kernel prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(socket.inet_ntop(family, raw))
    return found


def _finish(pool: WorkerPool, n: int):
    """Wait for job ``n`` and return its result (``WorkerPool.events`` returns it)."""
    events = pool.events(n)
    while True:
        try:
            next(events)
        except StopIteration as done:
            return done.value


def _job_keys(spy, n: int, kinds=PAYLOADS) -> list[str]:
    """The keys in the store that belong to job ``n`` (``<kind>/<n>`` and below it)."""
    return sorted(
        k
        for k in spy.list_keys()
        if k.split("/")[0] in kinds and len(k.split("/")) > 1 and k.split("/")[1] == str(n)
    )


# -- where the store listens ----------------------------------------------------------------------------------------
def test_the_store_listens_only_on_master_addr(pool):
    assert _listening(pool.port) == {"127.0.0.1"}


def test_loopback_pools_keep_the_workers_collectives_on_loopback(pool):
    """gloo listens on the address of this machine's host name unless told otherwise; a loopback pool tells it."""
    pid = pool.pids()[0]
    with open(f"/proc/{pid}/environ", "rb") as f:
        environ = f.read().split(b"\0")
    assert b"GLOO_SOCKET_IFNAME=lo" in environ
    ports = listening_ports_of(pid)
    assert ports and all(address.startswith("127.") for address in ports.values()), ports


def test_a_shut_down_pool_stops_listening():
    pool = WorkerPool(_config()).start()
    port = pool.port
    assert _listening(port) == {"127.0.0.1"}
    pool.shutdown()
    assert _listening(port) == set()


# -- the token -----------------------------------------------------------------------------------------------------
def test_local_workers_get_the_token_through_a_pipe_never_in_their_environment_or_command_line(
    pool, monkeypatch
):
    pid = pool.pids()[0]
    token = pool.token.decode()
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read()
    with open(f"/proc/{pid}/environ", "rb") as f:
        environ = f.read()
    assert token.encode() not in environ  # another process of this user could read it there
    assert b"FEWSTEP_POOL_TOKEN_STDIN=1" in environ.split(b"\0")
    assert token.encode() not in cmdline  # argv is readable by every user of the machine
    assert os.readlink(f"/proc/{pid}/fd/0").startswith("pipe:")  # read once at start, closed by the host
    assert token not in pool.join_command() and token not in pool.describe()
    assert len(token) == 64 and WorkerPool(_config()).token != pool.token  # 256 random bits, one per pool
    # an administrator's FEWSTEP_POOL_TOKEN (for ranks joining by hand) does not reach local workers' environment
    monkeypatch.setenv("FEWSTEP_POOL_TOKEN", secrets.token_hex(32))
    host = WorkerPool(_config()).start()
    try:
        with open(f"/proc/{host.pids()[0]}/environ", "rb") as f:
            assert b"FEWSTEP_POOL_TOKEN=" not in f.read()
        assert host.run({"kind": "task", "name": "ping"})["world"] == 1
    finally:
        host.shutdown()


@pytest.mark.parametrize(
    "token, problem",
    [
        ("a" * 64, "only 1 distinct byte values in 32 bytes (a pattern, not random)"),
        ("0123456789abcdef" * 4, "only 8 distinct byte values in 32 bytes (a pattern, not random)"),
        ("A" * 43, "only 1 distinct byte values in 32 bytes (a pattern, not random)"),
        ("short", "5 characters that are not hex or URL-safe base64"),
        ("s3cret-" * 6, "31 bytes"),
        (
            "not a secret at all, but quite a long sentence",
            "46 characters that are not hex or URL-safe base64",
        ),
        (bytes(range(16)).hex() * 2, "a block of 16 bytes repeated (a pattern, not random)"),
    ],
)
def test_a_token_without_the_entropy_of_a_secret_is_refused(monkeypatch, token, problem):
    expected = (
        f"input 'FEWSTEP_POOL_TOKEN': {problem}; expected at least 32 random bytes written as hex (64 characters) "
        "or URL-safe base64 (43 characters), e.g. the output of `python -c 'import secrets; "
        "print(secrets.token_hex(32))'`"
    )
    monkeypatch.setenv("FEWSTEP_POOL_TOKEN", token)
    with pytest.raises(InputError) as refused:
        WorkerPool(_config())
    assert str(refused.value) == expected
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "WORLD_SIZE": "1", "RANK": "0"}
    with pytest.raises(InputError) as refused:  # a worker joining by hand checks it too
        Rendezvous.from_env({**env, "FEWSTEP_POOL_TOKEN": token})
    assert str(refused.value) == expected


def test_random_tokens_are_accepted(monkeypatch):
    for token in (secrets.token_hex(32), secrets.token_urlsafe(32), secrets.token_hex(48)):
        monkeypatch.setenv("FEWSTEP_POOL_TOKEN", token)
        assert WorkerPool(_config()).token == token.encode()


def test_remote_ranks_need_a_token_set_on_the_host_and_the_join_command_does_not_print_it(monkeypatch):
    remote = {"mode": "sp", "ulysses_degree": 2, "local_ranks": 1}
    monkeypatch.delenv("FEWSTEP_POOL_TOKEN", raising=False)
    with pytest.raises(
        InputError,
        match=r"input 'local_ranks': 1 of 2 ranks start here; the ranks that join need the pool's secret: set "
        r"FEWSTEP_POOL_TOKEN",
    ):
        WorkerPool(_config(**remote))
    monkeypatch.setenv("FEWSTEP_POOL_TOKEN", "short")
    with pytest.raises(
        InputError,
        match=r"input 'FEWSTEP_POOL_TOKEN': 5 characters that are not hex or URL-safe base64; expected at least 32 random",
    ):
        WorkerPool(_config(**remote))
    secret = secrets.token_hex(32)
    monkeypatch.setenv("FEWSTEP_POOL_TOKEN", secret)
    host = WorkerPool(_config(**remote))
    assert host.token == secret.encode()
    assert "FEWSTEP_POOL_TOKEN" in host.join_command() and secret not in host.join_command()


def test_a_worker_without_the_pools_token_is_refused(pool):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(pool.port), "WORLD_SIZE": "1", "RANK": "0"}
    with pytest.raises(
        InputError, match=r"input 'FEWSTEP_POOL_TOKEN': not set; a worker needs the pool's secret"
    ):
        Rendezvous.from_env(env)
    other = secrets.token_hex(32)
    wrong = Rendezvous.from_env({**env, "FEWSTEP_POOL_TOKEN": other})
    assert other not in repr(wrong)  # a logged rendezvous does not show the secret
    with pytest.raises(
        InputError, match=rf"input 'FEWSTEP_POOL_TOKEN': the pool at 127.0.0.1:{pool.port} does not accept it"
    ):
        serve(wrong)
    assert pool.run({"kind": "task", "name": "ping"})["world"] == 1  # the pool is unharmed


# -- what a client without the token can read or plant -------------------------------------------------------------
def test_a_loopback_client_without_the_token_cannot_read_a_job_in_the_clear(pool):
    busy = pool.submit({"kind": "task", "name": "sleep", "args": {"seconds": 1.0}})
    waiting = pool.submit({"kind": "task", "name": "ping", "context": MARKER})  # read when the sleep ends
    spy = _attacker(pool.port)
    parts = [k for k in _job_keys(spy, waiting, ("job",)) if "/part" in k]
    assert parts, spy.list_keys()
    raw = b"".join(spy.get(k) for k in sorted(parts))
    assert MARKER.numpy().tobytes()[:256] not in raw
    with pytest.raises(Exception):  # noqa: B017 - whatever torch.load says, it must not decode the job
        torch.load(io.BytesIO(raw), weights_only=True)
    assert _finish(pool, busy) == {"slept": 1.0}
    assert _finish(pool, waiting)["world"] == 1


def test_a_replayed_or_moved_message_is_refused():
    """A message is bound to its key and its pool: a copy under another key, or in another pool of the same
    secret, does not authenticate."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=5), wait_for_workers=False)
    secret = b"k" * 32
    store = transport.SecureStore(server, secret, "pool1-abc")
    transport.put(store, "result/1", {"latent": MARKER})
    assert torch.equal(transport.get(store, "result/1")["latent"], MARKER)
    for key in server.list_keys():
        if key.startswith("result/1"):
            server.set(key.replace("result/1", "result/2"), server.get(key))
    with pytest.raises(transport.ForgedMessageError, match=r"'result/2' .*refused"):
        transport.get(store, "result/2")
    with pytest.raises(transport.ForgedMessageError, match=r"'result/1' .*refused"):
        transport.get(transport.SecureStore(server, secret, "pool2-def"), "result/1")
    server.set("result/1", "1000000000")  # a header claiming parts that were never written
    with pytest.raises(transport.ForgedMessageError, match=r"'result/1'"):
        transport.get(store, "result/1")


def test_a_planted_result_is_refused_and_stops_the_pool():
    pool = WorkerPool(_config()).start()
    port, pids = pool.port, pool.pids()
    n = pool.submit({"kind": "task", "name": "sleep", "args": {"seconds": 5.0}})
    spy = _attacker(port)
    spy.set(f"result/{n}/part0", transport.dumps({"forged": True}))  # the layout the pool writes
    spy.set(f"result/{n}", "1")
    spy.add(f"events/{n}", 1)
    with pytest.raises(ParallelError, match=rf"job {n}: the message under 'result/{n}' .*refused"):
        _finish(pool, n)
    assert pool.closed
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _listening(port) == set()


def test_a_planted_job_is_refused_by_the_workers():
    pool = WorkerPool(_config()).start()
    try:
        spy = _attacker(pool.port)
        spy.set("job/1/part0", transport.dumps({"kind": "task", "name": "sleep", "args": {"seconds": 0.0}}))
        spy.set("job/1", "1")
        deadline = time.monotonic() + 10
        while spy.add("finished/1", 0) < 1 and time.monotonic() < deadline:  # the worker has dealt with it
            time.sleep(0.01)
        with pytest.raises(ParallelError, match=r"rank 0 .*the message under 'job/1' .*refused"):
            pool.run({"kind": "task", "name": "ping"})
    finally:
        pool.shutdown()


def test_a_failure_marked_without_a_report_is_an_error_not_a_traceback():
    pool = WorkerPool(_config()).start()
    n = pool.submit({"kind": "task", "name": "sleep", "args": {"seconds": 2.0}})
    spy = _attacker(pool.port)
    spy.add(f"failed/{n}", 1)
    spy.add(f"events/{n}", 1)
    with pytest.raises(ParallelError, match=rf"the store marks job {n} failed but no rank reported an error"):
        _finish(pool, n)
    assert pool.closed


# -- nothing of a job is left in the store when it ends -------------------------------------------------------------
def test_payload_keys_are_gone_when_a_job_succeeds_and_the_store_stays_flat(pool):
    spy = _attacker(pool.port)
    first = pool._jobs + 1
    for _ in range(3):
        assert pool.run({"kind": "task", "name": "ping", "context": MARKER})["world"] == 1
        assert _job_keys(spy, pool._jobs) == []
    for n in (first, first + 1):  # counters too, once every rank is done with a job
        assert _job_keys(spy, n, PAYLOADS + COUNTERS) == []


def test_payload_keys_are_gone_when_a_job_fails_or_is_cancelled(pool):
    spy = _attacker(pool.port)
    with pytest.raises(InputError, match="unknown task 'nope'"):
        pool.run({"kind": "task", "name": "nope", "context": MARKER})
    assert _job_keys(spy, pool._jobs) == []

    class CancelledError(Exception):
        pass

    def cancel(_count):
        raise CancelledError

    with pytest.raises(CancelledError):  # the sleep task does not look at cancel: the host waits for its end
        pool.run(
            {"kind": "task", "name": "sleep", "args": {"seconds": 1.0}, "context": MARKER}, on_progress=cancel
        )
    assert _job_keys(spy, pool._jobs) == []
    assert pool.run({"kind": "task", "name": "ping"})["world"] == 1


# -- what a workflow may choose: address, port, size -----------------------------------------------------------------
@pytest.mark.parametrize("address", ["0.0.0.0", "::", "192.168.1.10", "example.com", "127.0.0.1.nip.io"])
def test_a_workflow_may_choose_loopback_only(monkeypatch, address):
    monkeypatch.delenv("FEWSTEP_POOL_ALLOWED_ADDRS", raising=False)
    with pytest.raises(InputError) as refused:
        _config(master_addr=address).check("FewStepParallelLauncher")
    assert str(refused.value) == (
        f"FewStepParallelLauncher: input 'master_addr': {address!r} is not a loopback address; a workflow may "
        "choose 127.0.0.1, ::1 or localhost, and other addresses only when the administrator lists them in "
        "FEWSTEP_POOL_ALLOWED_ADDRS (the server's environment)"
    )
    for loopback in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        _config(master_addr=loopback).check()


def test_the_administrator_allows_other_addresses(monkeypatch):
    monkeypatch.setenv("FEWSTEP_POOL_ALLOWED_ADDRS", "192.168.1.10, 0:0::0")
    _config(master_addr="192.168.1.10").check()
    _config(master_addr="::").check()  # the same address written another way
    with pytest.raises(InputError, match="input 'master_addr': '0.0.0.0' is not a loopback address"):
        _config(master_addr="0.0.0.0").check()


def test_privileged_and_unlisted_ports_are_refused(monkeypatch):
    monkeypatch.delenv("FEWSTEP_POOL_ALLOWED_PORTS", raising=False)
    for port in (1, 80, 1023):
        with pytest.raises(InputError) as refused:
            _config(master_port=port).check("FewStepParallelLauncher")
        assert str(refused.value) == (
            f"FewStepParallelLauncher: input 'master_port': {port} is a privileged port (below 1024); use 0 for "
            "any free port"
        )
    with pytest.raises(InputError) as refused:
        _config(master_port=29500).check("FewStepParallelLauncher")
    assert str(refused.value) == (
        "FewStepParallelLauncher: input 'master_port': 29500: an explicit port needs the administrator to list it "
        "in FEWSTEP_POOL_ALLOWED_PORTS (the server's environment); use 0 for any free port"
    )
    monkeypatch.setenv("FEWSTEP_POOL_ALLOWED_PORTS", "29500, 30000-30002, 1-2000, junk")
    for port in (29500, 30001, 1024, 2000):
        _config(master_port=port).check()
    for port in (1, 1023, 30003):  # listing a privileged port does not allow it
        with pytest.raises(InputError, match="input 'master_port'"):
            _config(master_port=port).check()


def test_an_explicit_port_that_cannot_be_bound_does_not_say_why(monkeypatch):
    """One message for every failure: a workflow must not learn which ports of this machine are in use."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        monkeypatch.setenv("FEWSTEP_POOL_ALLOWED_PORTS", str(port))
        with pytest.raises(InputError) as refused:
            WorkerPool(_config(master_port=port)).start()
    assert (
        str(refused.value)
        == f"input 'master_port': cannot listen on 127.0.0.1 port {port}; use 0 for any free port"
    )


def _no_process_may_start(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr("fewstep.engine.parallel.pool.subprocess.Popen", refuse)


def test_more_local_ranks_than_cores_are_refused_before_any_process_starts(monkeypatch):
    from fewstep.engine.parallel import config

    _no_process_may_start(monkeypatch)
    monkeypatch.delenv("FEWSTEP_POOL_MAX_LOCAL_RANKS", raising=False)
    monkeypatch.setattr(config, "usable_cores", lambda: 8)
    with pytest.raises(InputError) as refused:
        WorkerPool(_config(mode="sp", ulysses_degree=16, ring_degree=16), "FewStepParallelLauncher")
    assert str(refused.value) == (
        "FewStepParallelLauncher: input 'ring_degree': ulysses_degree 16 x ring_degree 16 would start 256 local "
        "worker processes, but this machine has 8 cores (the administrator may allow more with "
        "FEWSTEP_POOL_MAX_LOCAL_RANKS); lower the degrees or set local_ranks and join the other ranks from other "
        "machines"
    )
    _config(mode="sp", ulysses_degree=4, ring_degree=2).check()
    monkeypatch.setenv("FEWSTEP_POOL_MAX_LOCAL_RANKS", "2")
    with pytest.raises(InputError, match=r"input 'dp_degree': dp_degree 4 would start 4 local worker processes, "
                       r"but the administrator's FEWSTEP_POOL_MAX_LOCAL_RANKS is 2"):  # fmt: skip
        WorkerPool(_config(dp_degree=4))
    monkeypatch.setenv("FEWSTEP_POOL_MAX_LOCAL_RANKS", "16")
    _config(dp_degree=16).check()  # the administrator's cap replaces the cores


def test_threads_beyond_the_cores_are_refused(monkeypatch):
    from fewstep.engine.parallel import config

    monkeypatch.setattr(config, "usable_cores", lambda: 8)
    with pytest.raises(InputError) as refused:
        _config(dp_degree=2, threads_per_rank=1024).check("FewStepParallelLauncher")
    assert str(refused.value) == (
        "FewStepParallelLauncher: input 'threads_per_rank': 1024 threads x 2 local ranks = 2048 threads, but this "
        "machine has 8 cores; at most 4 per rank (0 = cores / local ranks)"
    )
    _config(dp_degree=2, threads_per_rank=4).check()


def test_local_workers_whose_memory_does_not_fit_are_refused_before_any_process_starts(monkeypatch):
    _no_process_may_start(monkeypatch)
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", "1")  # 0.9 GiB usable: 3 workers of 256 MiB fit, 4 do not
    # what earlier tests of this process still hold (models, a pool) would count against the limit: not here
    monkeypatch.setattr(LEDGER, "holdings", lambda *args, **kwargs: [])
    WorkerPool(_config(dp_degree=3))
    with pytest.raises(InputError) as refused:
        WorkerPool(_config(dp_degree=4), "FewStepParallelLauncher")
    assert str(refused.value).startswith(
        "FewStepParallelLauncher: input 'dp_degree': this needs about 1.00 GiB (4 worker processes x 256 MiB "
        "1.00 GiB) but only "
    ), str(refused.value)


@pytest.mark.slow
def test_a_rank_refuses_weights_beyond_the_memory_limit_in_the_preflights_words(monkeypatch):
    # the rank's process inherits the limit (0.3 GiB: 276.48 MiB usable, its ledger empty before it loads)
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", "0.3")
    # what earlier tests of this process hold would count against the host's launch check: not here
    monkeypatch.setattr(LEDGER, "holdings", lambda *args, **kwargs: [])
    pool = WorkerPool(_config()).start()
    try:
        # a raw job, as the host sends it once its own check has passed: the rank checks before it loads
        spec = {"source": "dummy:flux-tiny", "dtype": "float32", "weight_dtype": "float32", "attention": "auto",
                "weight_bytes": 280 << 20}  # fmt: skip
        with pytest.raises(InputError) as refused:
            pool.run({"kind": "sample", "model": spec})
        assert str(refused.value) == (
            "input 'model': this needs about 280.00 MiB (model weights 280.00 MiB) but only 276.48 MiB of available "
            "host memory can be used on cpu; refused before allocating. Rank 0 holds a whole copy of the model: use "
            "fewer ranks per machine or a smaller dtype"
        )
        # a refusal, not a failure: the pool stays up
        assert pool.run({"kind": "task", "name": "ping"})["world"] == 1
    finally:
        pool.shutdown()


# -- a reader authenticates before it reads -------------------------------------------------------------------------
class _CountingStore:
    """A store client that counts the bytes each ``get`` returns (what a reader held before deciding)."""

    def __init__(self, store):
        self.store, self.read = store, []

    def get(self, key):
        value = self.store.get(key)
        self.read.append((key, len(value)))
        return value

    def __getattr__(self, name):
        return getattr(self.store, name)


def _sealed_store(pool_id: str = "pool1-abc"):
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=5), wait_for_workers=False)
    counting = _CountingStore(server)
    return server, counting, transport.SecureStore(counting, b"k" * 32, pool_id)


def _bytes_read(counting) -> int:
    return sum(size for _, size in counting.read)


BIG = torch.arange(3 * 2**20, dtype=torch.float32)  # 12 MiB: 3 parts of 4 MiB


def test_a_planted_header_is_refused_before_any_part_is_read_and_deleted():
    server, counting, store = _sealed_store()
    planted = b"\xab" * transport.PART_BYTES
    for header in (b"4", os.urandom(transport.HEADER_BYTES)):  # the old layout, and one of the right size
        for i in range(4):
            server.set(f"result/1/part{i}", planted)
        server.set("result/1", header)
        counting.read.clear()
        with pytest.raises(transport.ForgedMessageError, match=r"'result/1' .*refused"):
            transport.get(store, "result/1", transport.MAX_MESSAGE_BYTES)
        assert counting.read == [("result/1", len(header))]  # the header only, never a part
        assert [k for k in server.list_keys() if k.startswith("result/1")] == []  # what failed is deleted


def test_a_changed_part_is_refused_when_it_is_read_and_the_rest_is_not_read():
    server, counting, store = _sealed_store()
    transport.put(store, "result/1", {"latent": BIG})
    assert server.check([f"result/1/part{i}" for i in range(4)])  # 12 MiB and the pickle's framing: 4 parts
    server.set("result/1/part1", os.urandom(transport.PART_BYTES + 28))
    counting.read.clear()
    with pytest.raises(transport.ForgedMessageError, match=r"'result/1' .*does not authenticate"):
        transport.get(store, "result/1", transport.MAX_MESSAGE_BYTES)
    assert [key for key, _ in counting.read] == ["result/1", "result/1/part0", "result/1/part1"]
    assert [k for k in server.list_keys() if k.startswith("result/1")] == []


def test_parts_cannot_be_reordered_or_taken_from_another_message():
    server, _, store = _sealed_store()
    transport.put(store, "result/1", {"latent": BIG})
    first = {i: server.get(f"result/1/part{i}") for i in range(4)}
    server.set("result/1/part0", first[1])
    server.set("result/1/part1", first[0])
    with pytest.raises(transport.ForgedMessageError, match=r"'result/1'"):
        transport.get(store, "result/1", transport.MAX_MESSAGE_BYTES)
    transport.put(store, "result/1", {"latent": BIG + 1})  # a new message under the same key
    server.set("result/1/part0", first[0])  # an authentic part of the earlier one
    with pytest.raises(transport.ForgedMessageError, match=r"'result/1'"):
        transport.get(store, "result/1", transport.MAX_MESSAGE_BYTES)
    transport.put(store, "result/1", {"latent": BIG})
    assert torch.equal(transport.get(store, "result/1", transport.MAX_MESSAGE_BYTES)["latent"], BIG)


def test_a_message_larger_than_the_job_produces_is_refused_before_its_parts_are_read():
    server, counting, store = _sealed_store()
    transport.put(store, "result/1", {"latent": BIG})
    counting.read.clear()
    with pytest.raises(
        transport.ForgedMessageError, match=r"'result/1' .*bytes where this job produces at most"
    ):
        transport.get(store, "result/1", 2**20)
    assert counting.read == [("result/1", transport.HEADER_BYTES)]
    assert (
        transport.message_limit({"latent": torch.zeros(1, 16, 8, 8)}) == transport.RECORD_BYTES + 4 * 1024 * 4
    )


def test_payloads_are_chacha20_poly1305_under_a_key_from_the_secret():
    """The vetted AEAD of ``cryptography``, not a composition of stdlib primitives: a part decrypts with it."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    server, _, store = _sealed_store("pool7-xyz")
    transport.put(store, "job/3", {"context": MARKER})
    key = HKDF(hashes.SHA256(), 32, None, b"fewstep pool seal\0pool7-xyz").derive(b"k" * 32)
    header = server.get("job/3")
    plain = ChaCha20Poly1305(key).decrypt(header[:12], header[12:], b"fewstep\0header\0job/3")
    message_id, parts, size = (
        plain[:16],
        int.from_bytes(plain[16:20], "big"),
        int.from_bytes(plain[20:], "big"),
    )
    part = server.get("job/3/part0")
    context = b"fewstep\0part" + message_id + (0).to_bytes(4, "big") + parts.to_bytes(4, "big") + b"\0job/3"
    data = ChaCha20Poly1305(key).decrypt(part[:12], part[12:], context)
    assert parts == 1 and len(data) == size
    assert torch.equal(transport.loads(data)["context"], MARKER)


# -- the process group's rendezvous ---------------------------------------------------------------------------------
def test_rendezvous_values_are_sealed_and_a_planted_one_is_refused():
    server, _, store = _sealed_store()
    rendezvous = transport.RendezvousStore(store, "pg/")
    rendezvous.set("0//cpu//0/0", b"rank 0's address")
    assert server.get("pg/0//cpu//0/0") != b"rank 0's address"  # sealed in the store
    assert rendezvous.get("0//cpu//0/0") == b"rank 0's address"
    server.set("pg/0//cpu//0/1", b"an address of the planter's choosing")
    with pytest.raises(transport.ForgedMessageError, match=r"'pg/0//cpu//0/1' .*refused"):
        rendezvous.get("0//cpu//0/1")
    server.set("pg/0//cpu//0/1", server.get("pg/0//cpu//0/0"))  # rank 0's sealed value copied to rank 1's key
    with pytest.raises(transport.ForgedMessageError, match=r"'pg/0//cpu//0/1'"):
        rendezvous.get("0//cpu//0/1")
    assert rendezvous.add("counter", 2) == 2 and rendezvous.check(["0//cpu//0/0"])
    assert rendezvous.compare_set("cas", b"", b"first") == b"first"
    assert rendezvous.compare_set("cas", b"other", b"second") == b"first"
    assert rendezvous.get("cas") == b"first"


def test_a_planted_rank_address_stops_the_start_with_an_error_instead_of_a_connection(monkeypatch):
    """A local process without the secret takes the place of rank 1 and plants its 'address' for rank 0's gloo."""
    monkeypatch.setenv("FEWSTEP_POOL_TOKEN", secrets.token_hex(32))
    pool = WorkerPool(_config(mode="sp", ulysses_degree=2, local_ranks=1, startup_timeout=60.0))
    failure = {}

    def start():
        try:
            pool.start()
        except Exception as err:  # noqa: BLE001 - checked below
            failure["error"] = err

    starter = threading.Thread(target=start)
    starter.start()
    try:
        while pool.port is None:
            time.sleep(0.01)
        spy = _attacker(pool.port)
        spy.add("claim/1", 1)
        spy.set("joined/1", "1")
        deadline = time.monotonic() + 30
        rank0 = []
        while not rank0 and time.monotonic() < deadline:
            rank0 = [k for k in spy.list_keys() if k.startswith("pg/") and k.endswith("/0")]
            time.sleep(0.01)
        assert rank0, spy.list_keys()
        spy.set(
            rank0[0][:-1] + "1", b"\x02\x00\x1f\x90\x7f\x00\x00\x01" + bytes(120)
        )  # the planter's address
        starter.join(60)
    finally:
        pool.shutdown()
    assert not starter.is_alive()
    message = str(failure.get("error"))
    assert re.search(r"rank 0 could not start: .*the message under 'pg/.*/1' in the pool's store was not written "
                     r"by this pool", message), message  # fmt: skip


def test_without_the_cryptography_package_a_pool_is_refused_before_it_starts(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_cryptography(name, *args, **kwargs):
        if name.startswith("cryptography"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    _no_process_may_start(monkeypatch)
    monkeypatch.setattr(builtins, "__import__", no_cryptography)
    with pytest.raises(InputError) as refused:
        WorkerPool(_config(), "FewStepParallelLauncher")
    assert str(refused.value) == (
        "FewStepParallelLauncher: input 'cryptography': the worker pool seals its messages with the Python package "
        "'cryptography' (>= 42), which this Python lacks; install the pack's requirements (pip install -r "
        "requirements.txt) into it"
    )


@pytest.mark.parametrize(
    "key, raw, expected",
    [
        ("FEWSTEP_WORKER_TIMEOUT", "abc", "expected seconds in (0, 604800], got 'abc'"),
        ("FEWSTEP_WORKER_TIMEOUT", "inf", "expected seconds in (0, 604800], got 'inf'"),
        ("FEWSTEP_WORKER_TIMEOUT", "nan", "expected seconds in (0, 604800], got 'nan'"),
        ("FEWSTEP_WORKER_THREADS", "1e3", "expected a whole number from 1 to 4096, got '1e3'"),
        ("FEWSTEP_WORKER_THREADS", str(2**80), "expected a whole number from 1 to 4096, got"),
        ("FEWSTEP_PARENT_PID", "-1", "expected a whole number from 1 to 4194304, got '-1'"),
        ("MASTER_PORT", "70000", "expected a whole number from 1 to 65535, got '70000'"),
        ("WORLD_SIZE", "0", "expected a whole number from 1 to 65536, got '0'"),
        ("RANK", "1", "expected a rank below WORLD_SIZE=1, got 1"),
        ("LOCAL_RANK", "x", "expected a whole number from 0 to 4096, got 'x'"),
    ],
)
def test_a_hand_started_worker_refuses_out_of_range_variables_in_one_line(key, raw, expected):
    from fewstep.engine.parallel.transport import new_token

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "1", "RANK": "0",
           "FEWSTEP_POOL_TOKEN": new_token().decode(), key: raw}  # fmt: skip
    with pytest.raises(InputError) as refused:
        Rendezvous.from_env(env)
    assert str(refused.value).startswith(f"input '{key}': {expected}"), str(refused.value)
