"""``python -m fewstep queue WORKFLOW.json``: run a workflow on a ComfyUI server through its API queue.

Submits the workflow to ``POST /prompt``, follows the server's event stream (per-step and per-chunk progress),
with ``--stream-dir`` saves each chunk clip a fewstep sampler streams (``fewstep.chunk`` events) while the prompt
runs, then downloads every file the outputs list (``--out``) and prints text outputs. Exit status: 0 success, 2 the
server rejected the workflow (including a partial rejection: /prompt answers 200 but lists node errors; the valid
outputs still run), 3 a node raised during execution, 4 timeout (``--timeout`` bounds the whole command), 5 server
unreachable, not a workflow, or an answer that is not ComfyUI's (including an output or chunk file the server names
outside ``--out`` / ``--stream-dir``, or a ``fewstep.chunk`` event not in the documented layout: refused, reported,
the rest still saved; and a run that would write more than ``--max-files`` files or ``--max-total-gb`` GiB under
both folders together: it stops there, the file over the cap not kept). A chunk file that cannot be downloaded (the
server keeps only the newest ones) is reported and does not change the exit status.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import uuid

from ..engine.units import format_bytes
from .comfy_client import (
    ChunkEvent,
    ComfyClient,
    DeadlineError,
    LocalWriteError,
    MalformedEventError,
    ProtocolError,
    ServerError,
    UnreachableError,
    UnsafeOutputError,
    WriteBudget,
    WriteCapError,
    is_ui_format,
    parse_chunk_event,
    parse_json,
    snippet,
    ui_to_api,
)

# What one run may write under --out and --stream-dir together. An honest run writes far less: a stream saves one
# clip of a few hundred KB per chunk (2000 chunks in the default --timeout would be a fast one), a long video is a
# few GB. A flooding server (measured: 893 files, 3.5 GiB in 20 s; about 100 GB in the default --timeout) hits
# 10000 files in about 4 minutes and never gets past 64 GiB: four of the largest files FEWSTEP_QUEUE_MAX_FILE_GB
# lets through by default.
DEFAULT_MAX_FILES = 10_000
DEFAULT_MAX_TOTAL_GB = 64.0
MAX_TOTAL_GB = float(1 << 20)  # 1 PiB: any larger value is a typo (and 1e300 GiB would overflow as bytes)

HELP = "run a workflow on a ComfyUI server through its API queue, with live progress and output download"


def add_arguments(p) -> None:
    p.add_argument(
        "workflow",
        help="API-format workflow JSON (a UI-format file is converted with the server's node definitions)",
    )
    p.add_argument(
        "--server",
        default="http://127.0.0.1:8188",
        help="ComfyUI address, http://host:port (host:port means http://; https is not supported)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NODE.INPUT=VALUE",
        help='override an input; VALUE is JSON (numbers, true, "text") or a bare string; repeat for several '
        "(default: none)",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="download the output files into DIR (default: none, the outputs are listed, not downloaded)",
    )
    p.add_argument(
        "--stream-dir",
        default=None,
        metavar="DIR",
        help="save each chunk clip a fewstep sampler streams while the prompt runs into DIR as it arrives, "
        "one line per chunk (default: none, chunk events are ignored)",
    )
    p.add_argument(
        "--max-files",
        type=_file_count,
        default=DEFAULT_MAX_FILES,
        metavar="N",
        help="the most files one run writes under --out and --stream-dir together; past it the run stops, exit 5 "
        f"(default: {DEFAULT_MAX_FILES})",
    )
    p.add_argument(
        "--max-total-gb",
        type=_gigabytes,
        default=DEFAULT_MAX_TOTAL_GB,
        metavar="GB",
        help="the most GiB one run writes under --out and --stream-dir together; past it the run stops, exit 5, "
        f"the file over it is not kept (default: {DEFAULT_MAX_TOTAL_GB:g})",
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=600.0,
        help="seconds the whole command may take: submitting, the run and the downloads",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _positive_number(what: str, maximum: float = math.inf):
    """An argparse type: a finite number > 0 (and at most ``maximum``), refused naming ``what`` it counts."""
    bound = f" and <= {maximum:.15g}" if math.isfinite(maximum) else ""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and 0 < value <= maximum):
            raise argparse.ArgumentTypeError(f"expected {what} > 0{bound}, got {text!r}")
        return value

    return parse


_seconds = _positive_number("a number of seconds")
_gigabytes = _positive_number("GiB", MAX_TOTAL_GB)


def _file_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 10**9:
        raise argparse.ArgumentTypeError(f"expected a number of files from 1 to 1000000000, got {text!r}")
    return value


def load_prompt(path: str, client: ComfyClient) -> tuple[dict, dict]:
    try:
        with open(path) as f:
            workflow = json.load(f)
    except (OSError, ValueError) as exc:
        raise SystemExit(_fail(5, f"cannot read {path}: {exc}")) from None
    extra = {}
    if isinstance(workflow, dict) and isinstance(workflow.get("prompt"), dict):
        extra, workflow = workflow.get("extra_data", {}), workflow["prompt"]
    if is_ui_format(workflow):
        print(f"{path} is a UI-format (canvas) workflow; converting it with the server's node definitions. "
              "ComfyUI's 'Save (API)' (developer mode) writes the API format this command takes directly.",
              file=sys.stderr)  # fmt: skip
        object_info = client.object_info()
        try:
            workflow = ui_to_api(workflow, object_info)
        except ValueError as exc:
            raise SystemExit(_fail(5, f"cannot convert {path}: {exc}")) from None
        # a field missing or of the wrong type, in the user's file or in the server's answer
        except (KeyError, TypeError, IndexError, AttributeError) as exc:
            raise SystemExit(
                _fail(5, f"cannot convert {path}: the workflow or the server's node definitions have an "
                      f"unexpected layout ({type(exc).__name__}: {exc})")
            ) from None  # fmt: skip
    if not isinstance(workflow, dict) or not all(
        isinstance(v, dict) and "class_type" in v for v in workflow.values()
    ):
        raise SystemExit(
            _fail(5, f"{path} is not a ComfyUI workflow (expected {{node id: {{class_type, inputs}}}})")
        )
    return workflow, extra


def apply_sets(prompt: dict, sets: list[str]) -> None:
    for item in sets:
        key, sep, raw = item.partition("=")
        node, dot, name = key.partition(".")
        if not (sep and dot and node in prompt):
            raise SystemExit(_fail(5, f"--set {item!r}: expected NODE.INPUT=VALUE with an existing node id"))
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        prompt[node].setdefault("inputs", {})[name] = value


def _fail(code: int, message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def format_node_errors(node_errors: dict, prompt: dict) -> list[str]:
    lines = []
    for node_id, info in (node_errors if isinstance(node_errors, dict) else {}).items():
        if not isinstance(info, dict):
            continue
        kind = info.get("class_type") or prompt.get(node_id, {}).get("class_type", "?")
        for err in info.get("errors") if isinstance(info.get("errors"), list) else []:
            if not isinstance(err, dict):
                continue
            extra = err.get("extra_info") if isinstance(err.get("extra_info"), dict) else {}
            where = f" input '{extra['input_name']}'" if extra.get("input_name") else ""
            lines.append(
                f"node {node_id} ({kind}){where}: {err.get('message')}: {err.get('details', '')}".rstrip(": ")
            )
    return lines


class _PrintableOnly:
    """A text stream that escapes control characters (other than newline and tab) before writing: names, texts and
    error messages the server sends are printed, and a hostile server must not drive the user's terminal with
    escape sequences."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(printable(text))

    def __getattr__(self, name):
        return getattr(self._stream, name)


def printable(text: str) -> str:
    """``text`` with every control character but newline and tab written as its escape (``\\x1b``)."""
    return "".join(ch if ch in "\n\t" or ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def run(args) -> int:
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _PrintableOnly(stdout), _PrintableOnly(stderr)
    try:
        return _run_command(args)
    finally:
        sys.stdout, sys.stderr = stdout, stderr


def _run_command(args) -> int:
    try:
        client = ComfyClient(args.server, timeout=args.timeout)
    except ValueError as exc:
        return _fail(5, str(exc))
    # one budget for --out and --stream-dir together: a server cannot double it by naming files in both
    budget = WriteBudget(args.max_files, int(args.max_total_gb * (1 << 30)))
    try:
        prompt, extra = load_prompt(args.workflow, client)
        apply_sets(prompt, args.set)
        return _run(client, prompt, extra, args, budget)
    except UnreachableError as exc:
        return _fail(5, f"{exc}; is the server running? (python main.py --listen 127.0.0.1 --port 8188)")
    except ProtocolError as exc:
        return _fail(5, f"{exc}; is --server a ComfyUI server?")
    except ServerError as exc:
        return _fail(5, str(exc))
    except DeadlineError as exc:
        return _fail(4, f"no result within {args.timeout:g} s ({exc})")
    except LocalWriteError as exc:
        return _fail(5, str(exc))
    except WriteCapError as exc:
        return _fail(
            5, f"stopped writing: {exc}; that file was not kept, the {budget.files} files "
            f"({format_bytes(budget.bytes)}) written before it are whole (--max-files / --max-total-gb set the caps)",
        )  # fmt: skip


def _run(client: ComfyClient, prompt: dict, extra: dict, args, budget: WriteBudget) -> int:
    for flag, folder in (("--out", args.out), ("--stream-dir", args.stream_dir)):
        if folder is None:
            continue
        try:  # before queueing: a folder that cannot be made should not cost a run
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            return _fail(5, f"{flag} {folder}: cannot create the folder ({exc})")
    stream = None if args.stream_dir is None else ChunkStream(client, args.stream_dir, budget)
    client_id = uuid.uuid4().hex
    ws = client.websocket(client_id)  # open first: no event can be missed
    try:
        try:
            if stream is not None:
                stream.submitted_at = time.monotonic()
            answer = client.submit(prompt, client_id, extra)
        except ServerError as exc:
            body = exc.body
            if not (isinstance(body, dict) and ("error" in body or "node_errors" in body)):
                raise ProtocolError(str(exc)) from None  # not a validation answer: an HTML page, a proxy...
            err = body.get("error") or {}
            message = err if isinstance(err, str) else f"{err.get('message', err)} {err.get('details', '')}"
            print(f"error: the server rejected the workflow: {message}".rstrip(), file=sys.stderr)
            for line in format_node_errors(body.get("node_errors"), prompt):
                print(f"  {line}", file=sys.stderr)
            return 2
        prompt_id = answer["prompt_id"]
        partial = format_node_errors(answer.get("node_errors"), prompt)
        for line in partial:
            print(f"error: {line} (the valid outputs still run)", file=sys.stderr)
        status = _follow(ws, prompt_id, prompt, args, stream)
    finally:
        ws.close()
    if status:
        return status
    status = _collect(client, prompt_id, args, budget)
    if stream is not None and stream.refused:
        status = _fail(
            5, f"refused {stream.refused} fewstep.chunk events or files the server sent (see above)"
        )
    return status or (2 if partial else 0)


def _follow(ws, prompt_id: str, prompt: dict, args, stream: ChunkStream | None = None) -> int:
    # A node may report the same value twice: the video sampler reports a chunk's end with its last frame as
    # the preview, then the same count again before the next chunk's first step; the server forwards both.
    # One line per value and node: a repeat only refreshed the preview, which a terminal does not show.
    last_progress: dict[object, tuple[object, object]] = {}
    while True:
        try:
            kind, payload = ws.receive()
        except DeadlineError:
            return _fail(4, f"no result within {args.timeout:g} s")
        except ConnectionError as exc:
            return _fail(5, f"lost the server's event stream: {exc}")
        if kind != "text":
            continue  # preview images
        msg = parse_json(payload, "the event stream sent")
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise ProtocolError(
                f"the event stream sent a message that is not a ComfyUI event: {snippet(msg)}"
            )
        data = msg.get("data")
        if not isinstance(data, dict):
            continue  # a custom node's own event
        if data.get("prompt_id") not in (None, prompt_id):
            continue
        event = msg["type"]
        if event == "progress" and not args.quiet:
            node = data.get("node")
            if last_progress.get(node) == (data.get("value"), data.get("max")):
                continue
            last_progress[node] = (data.get("value"), data.get("max"))
            kind_name = prompt.get(str(node), {}).get("class_type", "")
            print(
                f"node {node} {kind_name}: {data.get('value')}/{data.get('max')}", file=sys.stderr, flush=True
            )
        elif event == "fewstep.chunk" and stream is not None:
            stream.receive(data, prompt_id)
        elif event == "executing" and data.get("node") is None and data.get("prompt_id") == prompt_id:
            return 0
        elif event == "execution_error":
            print(f"error: node {data.get('node_id')} ({data.get('node_type')}) failed: "
                  f"{str(data.get('exception_message', '')).strip()}", file=sys.stderr)  # fmt: skip
            return 3
        elif event == "execution_interrupted":
            return _fail(3, f"the run was interrupted at node {data.get('node_id')}")


class ChunkStream:
    """``--stream-dir``: saves the clip of each chunk a fewstep sampler announces (a ``fewstep.chunk`` event) as
    the event arrives, and prints one line per chunk on stdout (and, at the first chunk, its latency).

    Downloads run in the event loop under the command's one deadline, so none outlives ``--timeout``. A file that
    cannot be downloaded (the server keeps only its newest chunk files) is reported and the run goes on; an event
    not in the documented layout, or a file named outside the folder, is refused (reported, nothing written) and
    counted in ``refused``.
    """

    def __init__(self, client: ComfyClient, out_dir: str, budget: WriteBudget | None = None):
        self.client, self.out_dir, self.budget = client, out_dir, budget
        self.submitted_at = time.monotonic()  # reset by the caller right before POST /prompt
        self.refused = 0
        self.first_index: dict[str, int] = {}  # node id -> the first chunk index it sent in this prompt

    def receive(self, data: dict, prompt_id: str) -> None:
        """One ``fewstep.chunk`` event's data (of this prompt, or without a prompt_id: the caller skips others)."""
        received_at = time.monotonic()
        try:
            if data.get("prompt_id") != prompt_id:
                raise MalformedEventError("it has no 'prompt_id'")
            event = parse_chunk_event(data)
        except MalformedEventError as exc:
            self.refused += 1
            print(f"error: refused a fewstep.chunk event: {exc}; nothing was downloaded", file=sys.stderr)
            return
        if not self.first_index:
            print(f"first chunk: {received_at - self.submitted_at:.2f} s after submit (client), "
                  f"first_chunk_seconds {event.first_chunk_seconds:.2f} s (node)", flush=True)  # fmt: skip
        label = self.label(event)
        saved = []
        for item in event.files:
            try:
                saved.append(self.client.download(item, self.out_dir, self.budget))
            except UnsafeOutputError as exc:
                self.refused += 1
                print(f"error: refused a file of {label}: {exc}; nothing was written", file=sys.stderr)
            except (ServerError, UnreachableError, ProtocolError, LocalWriteError) as exc:
                print(f"error: {label}: could not save {item['filename']!r} ({exc}); the run goes on",
                      file=sys.stderr)  # fmt: skip
        if saved:
            where = " -> " + ", ".join(saved)
        else:
            where = (
                " (no file: the node decodes no frames)" if not event.files else " (no file saved, see above)"
            )
        print(f"{label}: frames {event.frames[0]}-{event.frames[1]}, {event.seconds:.2f} s, "
              f"KV {format_bytes(event.kv_bytes, 1)}{where}", flush=True)  # fmt: skip

    def label(self, event: ChunkEvent) -> str:
        """The chunk's place in this node run, as "chunk 3/7 (node 12)": the event's index counts across the
        session (a FewStepCausalContinue goes on from the sampler's), its ``chunks`` only this node run."""
        first = self.first_index.setdefault(event.node, event.chunk)
        return f"chunk {event.chunk - first + 1}/{event.chunks} (node {event.node})"


def _collect(client: ComfyClient, prompt_id: str, args, budget: WriteBudget | None = None) -> int:
    """Download (or list) the outputs; 5 when the server named files outside --out (refused, each reported)."""
    history = {}
    for _ in range(20):  # the history entry is written as the run ends; give the server a moment
        history = client.history(prompt_id)
        if history:
            break
        time.sleep(min(0.25, client.deadline.remaining(f"waiting for the history of {prompt_id}")))
    files = refused = 0
    for node_id, output in history.get("outputs", {}).items():
        for key, items in output.items():
            for item in items if isinstance(items, list) else []:
                if isinstance(item, dict) and "filename" in item:
                    files += 1
                    if not args.out:
                        print(
                            f"node {node_id} {key}: {item.get('subfolder', '')}/{item['filename']} ({item.get('type')})"
                        )
                        continue
                    try:
                        print(f"node {node_id} {key}: {client.download(item, args.out, budget)}")
                    except UnsafeOutputError as exc:
                        refused += 1
                        print(f"error: refused output of node {node_id} ({key}): {exc}; nothing was written",
                              file=sys.stderr)  # fmt: skip
                elif isinstance(item, str) and key == "text":
                    print(f"node {node_id} text:\n{item}")
    if not refused:
        return 0
    saved = "; the others were saved" if refused < files else ""
    return _fail(5, f"refused {refused} of {files} output files the server listed (see above){saved}")
