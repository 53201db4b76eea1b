"""Live video through a real ComfyUI server (issue 33): 1, 2 and 4 concurrent clients, each with its own session
on one FewStep Live Video node, and the realtime metrics they get.

    python bench/live_video.py                       # 1, 2 and 4 clients, 6 chunks each (wan-tiny dummy workflow)
    python bench/live_video.py --quick               # 1 and 2 clients, 3 chunks each (what the test runs)
    python bench/live_video.py --comfyui /root/.cache/fewstep-comfyui-0.8.0/ComfyUI --clients 1,2,4,8

The script starts its own ComfyUI (``--comfyui`` or ``$COMFYUI_DIR``, default the 0.3.64 snapshot of this machine;
its ``../venv`` interpreter) on a free port with this pack linked into a temporary base directory, queues the live
node's dummy workflow (``workflows/live_video_dummy.api.json``: wan-tiny at 96x64, chunks of 2 latent frames, dummy
weights, the tiny VAE, no text encoder: prompts get the synthetic text embedding; ``max_sessions`` raised to the
most clients, no time or idle limit), waits until ``GET /fewstep/live`` lists the node, then for each
client count runs that many clients at once, each in its own thread as a separate client would: its own websocket
(``/ws?clientId=...``), ``POST /fewstep/live/sessions`` (its own prompt and seed, ``chunks`` chunks: the session
closes after them), and the events until its session is closed (``--client cli``: each client is a ``python -m
fewstep live --script FILE --out DIR`` process instead, the user's client). Finally ``POST /fewstep/live/stop`` ends
the node.

Measured, per client count (all clients' sessions run at the same time):

* **server metrics**: the ``fewstep.metrics`` event each session gets at close (``engine.live.RealtimeMetrics``,
  timed on the generation thread): time to first chunk (TTFC), inter-chunk interval p50 / p99, realtime factor
  (video seconds made / wall seconds since the session opened), deadline attainment, viewer stalls, the batch
  sizes its chunks ran in. Reported: median over the clients of TTFC, p50 and RTF, the largest p99, the smallest
  attainment, stalls summed, batch sizes merged;
* **client view**: the same from the arrival times of the ``fewstep.chunk`` events at each client (TTFC from
  before its open request; intervals between arrivals): what a viewer on the websocket gets, delivery included.

Beside the table: the planner's prediction of the same metrics for Wan2.1-1.3B at 832x480 on an H100 and an H200
(``engine/plan/live.py``; ``python -m fewstep plan --model wan2.1-1.3b --live``). On this CPU wan-tiny's chunks are
far from a GPU's: the measured table shows the service's behaviour (batching, fairness, delivery), not GPU speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from _common import RESULTS, header, parse_args, summary_row

from fewstep.cli.comfy_client import ComfyClient, Deadline, DeadlineError
from fewstep.engine.live.metrics import percentile
from fewstep.engine.live.protocol import (
    EVENT_CHUNK,
    EVENT_METRICS,
    EVENT_SESSION,
    EVENT_STALL,
    SECRET_HEADER,
    SESSIONS_ROUTE,
    STATUS_ROUTE,
    STOP_ROUTE,
)
from fewstep.engine.plan import plan_preset

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_COMFYUI = Path("/root/.cache/fewstep-comfyui/ComfyUI")
WORKFLOW = ROOT / "workflows" / "live_video_dummy.api.json"
LIVE_NODE = "FewStepLiveVideo"
QUICK = {"clients": "1,2", "chunks": 3}
CLOSING_METRICS_S = 3.0  # how long a client waits after its session closed for the closing metrics event


# -- the server --------------------------------------------------------------------------------------------------
def comfyui_dir(arg: str | None) -> Path | None:
    d = Path(arg or os.environ.get("COMFYUI_DIR") or DEFAULT_COMFYUI)
    return d if (d / "main.py").exists() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    """A ComfyUI server subprocess on 127.0.0.1 with this pack linked into a temporary base directory."""

    def __init__(self, comfyui: Path, port: int | None = None):
        self.comfyui = comfyui
        venv = comfyui.parent / "venv" / "bin" / "python"
        self.python = os.environ.get("COMFYUI_PYTHON") or (str(venv) if venv.exists() else sys.executable)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base = Path(tempfile.mkdtemp(prefix="fewstep-live-bench-"))
        self.proc = None

    def __enter__(self) -> ComfyServer:
        for sub in ("custom_nodes", "output", "input", "temp", "user", "models"):
            (self.base / sub).mkdir()
        (self.base / "custom_nodes" / "ComfyUI-FewStep").symlink_to(ROOT)
        self.log = open(self.base / "server.log", "w")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(
            [self.python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
             "--base-directory", str(self.base), "--database-url", f"sqlite:///{self.base}/user/comfyui.db",
             "--disable-auto-launch", "--preview-method", "none"],
            cwd=self.comfyui, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 240
        while True:
            try:
                with urllib.request.urlopen(self.url + "/object_info", timeout=5) as r:
                    self.object_info = json.load(r)
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise RuntimeError("ComfyUI did not start:\n" + self.log_tail()) from None
                time.sleep(0.5)

    def log_tail(self, chars: int = 3000) -> str:
        return (self.base / "server.log").read_text(errors="replace")[-chars:]

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.base, ignore_errors=True)


def request(url: str, method: str = "GET", body: dict | None = None, secret: str | None = None,
            timeout: float = 30) -> tuple[int, object]:  # fmt: skip
    """(HTTP status, JSON answer) of one request; a 4xx / 5xx answer is returned, not raised."""
    headers = {"Content-Type": "application/json"}
    if secret is not None:
        headers[SECRET_HEADER] = secret
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as err:
        text = err.read()
        try:
            return err.code, json.loads(text)
        except ValueError:
            return err.code, text.decode(errors="replace")


# -- the live node -----------------------------------------------------------------------------------------------
def live_workflow(path: Path, slots: int) -> dict:
    """The dummy live workflow with room for ``slots`` sessions (one client each) and no idle stop while the
    bench runs (the bench stops the node itself)."""
    graph = json.loads(path.read_text())
    node = next((n for n in graph.values() if n.get("class_type") == LIVE_NODE), None)
    if node is None:
        raise SystemExit(f"{path}: no {LIVE_NODE} node in this workflow")
    inputs = node["inputs"]
    for name, value in (
        ("max_sessions", slots),
        ("idle_seconds", 0.0),
        ("max_seconds", 0.0),
        ("max_chunks", 0),
    ):
        if name in inputs and not isinstance(inputs[name], list):  # a widget value, not a link
            inputs[name] = value
    return graph


def wait_for_node(url: str, proc, timeout: float = 300) -> dict:
    """The live node's public status once ``GET /fewstep/live`` lists it (the model is loaded, the pool open)."""
    deadline = time.monotonic() + timeout
    while True:
        status, nodes = request(url + STATUS_ROUTE)
        if status == 200 and nodes:
            return nodes[0]
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"no live node running after {timeout:.0f} s (GET {STATUS_ROUTE}: {status} {nodes})"
            )
        time.sleep(0.2)


# -- one client ----------------------------------------------------------------------------------------------------
def run_client(url: str, client_id: str, prompt: str, seed: int, chunks: int, timeout: float, start: threading.Barrier,
               out: dict) -> None:  # fmt: skip
    """One client: its websocket, its session's open, its events until the session is closed (and its last
    metrics event). Fills ``out`` (an exception goes to ``out["error"]``)."""
    ws = None
    try:
        client = ComfyClient(url, timeout=timeout)
        ws = client.websocket(client_id)
        start.wait()
        t0 = time.perf_counter()
        status, answer = request(url + SESSIONS_ROUTE, "POST",
                                 {"client_id": client_id, "prompt": prompt, "seed": seed, "chunks": chunks})  # fmt: skip
        if status != 201:
            raise RuntimeError(f"POST {SESSIONS_ROUTE}: {status} {answer}")
        sid = answer["session"]
        out.update(session=sid, opened=answer, arrivals=[], chunk_events=[], metrics=None, states=[],
                   stall_events=0)  # fmt: skip
        closed = False
        while True:
            try:
                kind, payload = ws.receive()
            except DeadlineError:
                if closed:  # no metrics event after the close: the last one seen stands
                    break
                raise
            if kind != "text":
                continue
            message = json.loads(payload)
            data = message.get("data") or {}
            if not isinstance(data, dict) or data.get("session") != sid:
                continue
            now = time.perf_counter() - t0
            event = message.get("type")
            if event == EVENT_CHUNK:
                out["arrivals"].append(now)
                out["chunk_events"].append({k: data.get(k) for k in ("chunk", "latency", "batch", "bucket",
                                                                        "deadline_met", "seconds")})  # fmt: skip
            elif event == EVENT_STALL:
                out["stall_events"] += 1
            elif event == EVENT_METRICS:
                out["metrics"] = data
                if closed:
                    break
            elif event == EVENT_SESSION:
                out["states"].append((data.get("state"), data.get("why")))
                if data.get("state") == "closed":
                    if out["metrics"] is not None and out["metrics"].get("chunks") == len(out["arrivals"]):
                        break  # the closing metrics came first
                    closed = True
                    ws.deadline = ws.sock.deadline = Deadline(CLOSING_METRICS_S)
    except BaseException as err:  # noqa: BLE001 - reported by the main thread
        out["error"] = f"{type(err).__name__}: {err}"
    finally:
        if ws is not None:
            ws.close()


def run_clients(url: str, n: int, chunks: int, timeout: float) -> list[dict]:
    """``n`` clients at once, each its own session (seed = its index, its own prompt)."""
    outs = [{} for _ in range(n)]
    start = threading.Barrier(n)
    threads = [threading.Thread(target=run_client, args=(url, f"bench{n}x{i}", f"a live stream for client {i}",
                                                         i, chunks, timeout, start, outs[i]), daemon=True)
               for i in range(n)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    errors = [o.get("error") or ("did not finish" if "session" not in o else None) for o in outs]
    if any(errors):
        raise RuntimeError(f"{n} clients: " + "; ".join(e for e in errors if e))
    return outs


def run_cli_clients(url: str, n: int, chunks: int, timeout: float, workdir: Path) -> list[dict]:
    """``n`` clients at once, each a ``python -m fewstep live --script FILE --out DIR --quiet`` process (the
    user's client: it also downloads every chunk's latents and clip); each one's ``DIR/live.json`` gives its
    session's chunks, closing metrics and stall events (no arrival times: no client view)."""
    procs = []
    for i in range(n):
        folder = workdir / f"{n}clients_{i}"
        folder.mkdir(parents=True)
        script = folder / "script.json"
        script.write_text(
            json.dumps({"prompt": f"a live stream for client {i}", "seed": i, "chunks": chunks})
        )
        cmd = [sys.executable, "-m", "fewstep", "live", "--server", url, "--script", str(script), "--out",
               str(folder / "out"), "--quiet", "--timeout", str(timeout)]  # fmt: skip
        procs.append(
            (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), folder)
        )
    outs, errors = [], []
    for proc, folder in procs:
        text, _ = proc.communicate(timeout=timeout + 60)
        if proc.returncode != 0:
            errors.append(f"fewstep live exited with {proc.returncode}: {text.strip()[-1000:]}")
            continue
        report = json.loads((folder / "out" / "live.json").read_text())
        outs.append({"metrics": report["metrics"], "arrivals": [], "chunk_events": report["chunks"],
                     "states": [("closed", report["closed"])], "stall_events": report["stalls"]})  # fmt: skip
    if errors:
        raise RuntimeError(f"{n} clients: " + "; ".join(errors))
    return outs


def summarize(outs: list[dict]) -> dict:
    """One row of the table from every client of one run (see the module docstring)."""
    ms = [o["metrics"] for o in outs]
    if any(m is None for m in ms):
        raise RuntimeError("a session closed without a fewstep.metrics event")
    batches: dict[str, int] = {}
    for m in ms:
        for k, v in m["batch_sizes"].items():
            batches[k] = batches.get(k, 0) + v
    intervals = [[b - a for a, b in zip(o["arrivals"], o["arrivals"][1:])] for o in outs]
    client_p50 = [percentile(x, 50) for x in intervals if x]
    client_p99 = [percentile(x, 99) for x in intervals if x]
    firsts = [o["arrivals"][0] for o in outs if o["arrivals"]]  # the `live` CLI's clients record no arrivals
    return {
        "clients": len(outs),
        "chunks": [len(o["chunk_events"]) for o in outs],
        "ttfc_s": statistics.median(m["time_to_first_chunk_s"] for m in ms),
        "ttfc_max_s": max(m["time_to_first_chunk_s"] for m in ms),
        "inter_chunk_p50_s": statistics.median(m["inter_chunk_p50_s"] for m in ms),
        "inter_chunk_p99_s": max(m["inter_chunk_p99_s"] for m in ms),
        "realtime_factor": statistics.median(m["realtime_factor"] for m in ms),
        "deadline_attainment": min(m["deadline_attainment"] for m in ms),
        "viewer_stalls": sum(m["viewer_stalls"] for m in ms),
        "batch_sizes": dict(sorted(batches.items(), key=lambda kv: int(kv[0]))),
        "client_ttfc_s": statistics.median(firsts) if firsts else None,
        "client_inter_chunk_p50_s": statistics.median(client_p50) if client_p50 else None,
        "client_inter_chunk_p99_s": max(client_p99) if client_p99 else None,
        "stall_events": sum(o["stall_events"] for o in outs),
        "sessions": [
            {
                "metrics": o["metrics"],
                "states": o["states"],
                "chunk_events": o["chunk_events"],
                "arrivals": o["arrivals"],
            }
            for o in outs
        ],  # fmt: skip
    }


# -- the planner -------------------------------------------------------------------------------------------------
def predictions(counts: tuple[int, ...]) -> dict[str, dict]:
    """The planner's live metrics of Wan2.1-1.3B at 832x480 (chunks of 3, window 21, 4 steps, the tiny VAE) on
    an H100 and an H200, MFU 0.5."""
    return {gpu: plan_preset("wan2.1-1.3b", height=480, width=832, gpu=gpu, live=counts)["live"]
            for gpu in ("h100", "h200")}  # fmt: skip


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def table(rows: list[dict]) -> str:
    lines = ["| clients | TTFC s (max) | inter-chunk p50 / p99 s | RTF | deadline attainment | viewer stalls "
             "(stall events) | batch sizes (chunks) | client view: TTFC s, p50 / p99 s |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['clients']} | {_s(r['ttfc_s'])} ({_s(r['ttfc_max_s'])}) | {_s(r['inter_chunk_p50_s'])} / "
            f"{_s(r['inter_chunk_p99_s'])} | {r['realtime_factor']:.2f}x | {r['deadline_attainment']:.0%} | "
            f"{r['viewer_stalls']} ({r['stall_events']}) | {', '.join(f'{k}: {v}' for k, v in r['batch_sizes'].items())} | "
            f"{_s(r['client_ttfc_s'])}, {_s(r['client_inter_chunk_p50_s'])} / {_s(r['client_inter_chunk_p99_s'])} |"
        )
    return "\n".join(lines)


def prediction_table(planned: dict[str, dict]) -> str:
    lines = ["| GPU | sessions | TTFC s (joining) | chunk interval s (p50 = p99) | RTF | deadline | stall s a chunk "
             "| batches |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for gpu, live in planned.items():
        for r in live["predictions"]:
            lines.append(
                f"| {gpu} | {r['sessions']} | {r['first_chunk_seconds']:.3f} ({r['first_chunk_seconds_joining']:.3f})"
                f" | {r['interval_seconds']:.3f} | {r['realtime_factor']:.2f}x | "
                f"{'met' if r['deadline_met'] else 'missed'} | {r['stall_seconds_per_chunk']:.3f} | "
                f"{'+'.join(map(str, r['batches']))} |"
            )
    realtime = ", ".join(f"{gpu} {live['realtime_sessions_that_fit']} (memory holds {live['sessions_that_fit']})"
                         for gpu, live in planned.items())  # fmt: skip
    return "\n".join(lines) + f"\n\nsessions that stay realtime: {realtime}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfyui", default=None, help="a ComfyUI checkout (default: $COMFYUI_DIR, else the 0.3.64 "
                    f"snapshot at {DEFAULT_COMFYUI})")  # fmt: skip
    ap.add_argument("--workflow", default=str(WORKFLOW), help="the live node's API-format workflow")
    ap.add_argument("--clients", default="1,2,4", help="client counts, one run each (default 1,2,4)")
    ap.add_argument("--chunks", type=int, default=6, help="chunks per session (default 6)")
    ap.add_argument("--client", choices=("threads", "cli"), default="threads",
                    help="threads: each client a thread of this script with its own websocket (the client view "
                    "columns); cli: each client a `python -m fewstep live` process saving its chunks (--out), "
                    "the user's client (server metrics only)")  # fmt: skip
    ap.add_argument("--port", type=int, default=None, help="the server's port (default: a free one)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a client waits for its session")
    ap.add_argument("--out", default=None, help="JSON report (default bench/results/live_video.json)")
    args = parse_args(ap, QUICK)
    counts = tuple(int(v) for v in args.clients.split(","))
    comfyui = comfyui_dir(args.comfyui)
    out = Path(args.out) if args.out else RESULTS / "live_video.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if comfyui is None:  # bench/run_all runs every script: without a ComfyUI this one says so and passes
        why = "no ComfyUI checkout found (--comfyui DIR or COMFYUI_DIR): not run"
        print(why)
        out.write_text(json.dumps({"quick": args.quick, "rows": [], "summary": [
            summary_row("live video through ComfyUI", why)]}, indent=2) + "\n")  # fmt: skip
        return 0
    env = header("Live video through a real ComfyUI server (issue 33)")
    planned = predictions(counts)
    graph = live_workflow(Path(args.workflow), max(counts))
    rows = []
    with ComfyServer(comfyui, args.port) as server:
        print(f"ComfyUI {comfyui} at {server.url}; workflow {args.workflow}")
        host = ComfyClient(server.url, timeout=args.timeout)
        prompt_id = host.submit(graph, "bench-host")["prompt_id"]
        try:
            node = wait_for_node(server.url, server.proc)
            print(f"live node: {json.dumps(node)}\n")
            for n in counts:
                if args.client == "cli":
                    outs = run_cli_clients(server.url, n, args.chunks, args.timeout, server.base / "clients")
                else:
                    outs = run_clients(server.url, n, args.chunks, args.timeout)
                rows.append(summarize(outs))
                print(f"{n} client{'s' if n > 1 else ''}: done", flush=True)
        except BaseException:
            print(server.log_tail(), file=sys.stderr)
            raise
        finally:
            request(server.url + STOP_ROUTE, "POST", {})
        history = wait_history(host, prompt_id)
    env["loadavg_1min_at_end"] = os.getloadavg()[0]
    print(f"\n1-min load average at the end {env['loadavg_1min_at_end']:.2f}\n")
    print(table(rows))
    node_report = next((t for o in history.get("outputs", {}).values() for t in o.get("text", [])
                        if isinstance(t, str)), None)  # fmt: skip
    if node_report:
        print(f"\nThe live node's report:\n\n{node_report}")
    print("\nPlanner prediction, Wan2.1-1.3B 832x480, chunks of 3, window 21, 4 steps, taew2_1, MFU 0.5:\n")
    print(prediction_table(planned))
    summary = [
        summary_row(
            f"{r['clients']} client{'s' if r['clients'] > 1 else ''}: TTFC, inter-chunk p50 / p99, RTF, deadline "
            "attainment, viewer stalls",
            f"{_s(r['ttfc_s'])} s, {_s(r['inter_chunk_p50_s'])} / {_s(r['inter_chunk_p99_s'])} s, "
            f"{r['realtime_factor']:.2f}x, {r['deadline_attainment']:.0%}, {r['viewer_stalls']}",
        )
        for r in rows
    ]
    report = {"quick": args.quick, "client": args.client, "environment": env, "comfyui": str(comfyui),
              "workflow": args.workflow, "node": node, "chunks_per_session": args.chunks, "rows": rows,
              "planner": planned, "node_status": history.get("status"), "node_report": node_report,
              "summary": summary}  # fmt: skip
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nresults: {out}")
    return 0


def wait_history(host: ComfyClient, prompt_id: str, timeout: float = 120) -> dict:
    """The queued live prompt's history entry once it has finished (the node returned after the stop)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = ComfyClient(host.server).history(prompt_id)
        if (entry.get("status") or {}).get("completed") is not None:
            return entry
        time.sleep(0.3)
    raise RuntimeError(f"the live prompt {prompt_id} did not finish within {timeout:.0f} s of the stop")


if __name__ == "__main__":
    sys.exit(main())
