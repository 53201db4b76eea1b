"""``python -m fewstep queue WORKFLOW.json``: run a workflow on a ComfyUI server through its API queue.

Submits the workflow to ``POST /prompt``, follows the server's event stream (per-step and per-chunk progress),
downloads every file the outputs list (``--out``) and prints text outputs. Exit status: 0 success, 2 the server
rejected the workflow (including a partial rejection: /prompt answers 200 but lists node errors; the valid
outputs still run), 3 a node raised during execution, 4 timeout, 5 server unreachable or not a workflow.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid

from .comfy_client import ComfyClient, ServerError, UnreachableError, is_ui_format, ui_to_api

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
        help='override an input; VALUE is JSON (numbers, true, "text") or a bare string',
    )
    p.add_argument("--out", default=None, help="download the output files here")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the run")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


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
        try:
            workflow = ui_to_api(workflow, client.object_info())
        except ValueError as exc:
            raise SystemExit(_fail(5, f"cannot convert {path}: {exc}")) from None
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
    for node_id, info in (node_errors or {}).items():
        kind = info.get("class_type") or prompt.get(node_id, {}).get("class_type", "?")
        for err in info.get("errors", []):
            extra = err.get("extra_info", {})
            where = f" input '{extra['input_name']}'" if extra.get("input_name") else ""
            lines.append(
                f"node {node_id} ({kind}){where}: {err.get('message')}: {err.get('details', '')}".rstrip(": ")
            )
    return lines


def run(args) -> int:
    try:
        client = ComfyClient(args.server)
    except ValueError as exc:
        return _fail(5, str(exc))
    try:
        prompt, extra = load_prompt(args.workflow, client)
        apply_sets(prompt, args.set)
        return _run(client, prompt, extra, args)
    except UnreachableError as exc:
        return _fail(5, f"{exc}; is the server running? (python main.py --listen 127.0.0.1 --port 8188)")


def _run(client: ComfyClient, prompt: dict, extra: dict, args) -> int:
    client_id = uuid.uuid4().hex
    ws = client.websocket(client_id, timeout=args.timeout)  # open first: no event can be missed
    try:
        try:
            answer = client.submit(prompt, client_id, extra)
        except ServerError as exc:
            body = exc.body if isinstance(exc.body, dict) else {"error": {"message": str(exc.body)}}
            err = body.get("error") or {}
            print(f"error: the server rejected the workflow: {err.get('message', err)} "
                  f"{err.get('details', '')}".rstrip(), file=sys.stderr)  # fmt: skip
            for line in format_node_errors(body.get("node_errors"), prompt):
                print(f"  {line}", file=sys.stderr)
            return 2
        prompt_id = answer["prompt_id"]
        partial = format_node_errors(answer.get("node_errors"), prompt)
        for line in partial:
            print(f"error: {line} (the valid outputs still run)", file=sys.stderr)
        status = _follow(ws, prompt_id, prompt, args)
    finally:
        ws.close()
    if status:
        return status
    _collect(client, prompt_id, args)
    return 2 if partial else 0


def _follow(ws, prompt_id: str, prompt: dict, args) -> int:
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        try:
            kind, payload = ws.receive()
        except TimeoutError:
            break
        except ConnectionError as exc:
            return _fail(5, f"lost the server's event stream: {exc}")
        if kind != "text":
            continue  # preview images
        msg = json.loads(payload)
        data = msg.get("data", {})
        if data.get("prompt_id") not in (None, prompt_id):
            continue
        event = msg.get("type")
        if event == "progress" and not args.quiet:
            node = data.get("node")
            kind_name = prompt.get(str(node), {}).get("class_type", "")
            print(f"node {node} {kind_name}: {data['value']}/{data['max']}", file=sys.stderr, flush=True)
        elif event == "executing" and data.get("node") is None and data.get("prompt_id") == prompt_id:
            return 0
        elif event == "execution_error":
            print(f"error: node {data.get('node_id')} ({data.get('node_type')}) failed: "
                  f"{data.get('exception_message', '').strip()}", file=sys.stderr)  # fmt: skip
            return 3
        elif event == "execution_interrupted":
            return _fail(3, f"the run was interrupted at node {data.get('node_id')}")
    return _fail(4, f"no result within {args.timeout:g} s")


def _collect(client: ComfyClient, prompt_id: str, args) -> None:
    history = {}
    for _ in range(20):  # the history entry is written as the run ends; give the server a moment
        history = client.history(prompt_id)
        if history:
            break
        time.sleep(0.25)
    for node_id, output in history.get("outputs", {}).items():
        for key, items in output.items():
            for item in items if isinstance(items, list) else []:
                if isinstance(item, dict) and "filename" in item:
                    if args.out:
                        os.makedirs(args.out, exist_ok=True)
                        print(f"node {node_id} {key}: {client.download(item, args.out)}")
                    else:
                        print(
                            f"node {node_id} {key}: {item.get('subfolder', '')}/{item['filename']} ({item.get('type')})"
                        )
                elif isinstance(item, str) and key == "text":
                    print(f"node {node_id} text:\n{item}")
