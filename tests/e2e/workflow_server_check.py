"""The shipped workflows against a running ComfyUI's /object_info: what must hold on every supported version.

Not one version's node lists (each release adds combo entries, e.g. 0.8.0's CLIPLoader ``ovis`` and
DualCLIPLoader ``kandinsky5``), but what a user's load of a shipped workflow depends on:

- every node type a workflow uses exists on the server (a core node or combo entry of a release newer than the
  server's, listed in ``NEWER_CORE_NODES`` / ``NEWER_COMBO_OPTIONS``, is reported apart: its workflows need that
  release);
- every input a workflow sets, by value or by link, is one the server declares, with our node table's type and
  required flag;
- every value a workflow sets is one the server accepts: a fixed combo entry in the server's list (a model-file
  name is the user's own file, so only the entries our table fixes, such as ``dummy:flux-tiny``, are checked), a
  number within the server's min / max;
- the widgets of each node come in our table's order on the server (UI-format files store widget values by
  position, each seed followed by its "control after generate" value), the server adding widgets only after ours.

Used by tests/e2e/test_comfyui_server.py (on the server fixture, in CI on every ComfyUI version) and by
tests/workflows/test_workflows.py (``FEWSTEP_COMFY_URL``: a server started by hand).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import workflow_check as wc  # noqa: E402
from fewstep_workflows.nodes import NodeSpec, comfy_format, spec_from_object_info  # noqa: E402

WORKFLOWS = wc.ROOT / "workflows"


def _link(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[1], int)


def _widget_row(spec: NodeSpec) -> list[tuple[str, str, bool]]:
    return [(w.name, w.type, w.companion is not None) for w in spec.widgets]


def used_inputs(files) -> dict[str, dict[str, list]]:
    """node type -> input name -> the literal values the API files set (a link adds no value)."""
    used: dict[str, dict[str, list]] = {}
    for path in files:
        for node in json.loads(Path(path).read_text()).values():
            inputs = used.setdefault(node["class_type"], {})
            for name, value in node.get("inputs", {}).items():
                inputs.setdefault(name, [])
                if not _link(value):
                    inputs[name].append(value)
    return used


def _value_problem(ours, theirs, value) -> str | None:
    if ours.type == "COMBO":
        # a model file the user supplies is checked by the loader at run time; a fixed entry must exist
        fixed = value in ours.options or not ours.is_file_combo
        if fixed and value not in theirs.options:
            return f"value {value!r} is not among the server's {list(theirs.options)}"
        return None
    if ours.type in ("INT", "FLOAT") and isinstance(value, (int, float)) and not isinstance(value, bool):
        low, high = theirs.opts.get("min"), theirs.opts.get("max")
        if (low is not None and value < low) or (high is not None and value > high):
            return f"value {value!r} is outside the server's range [{low}, {high}]"
    return None


def mismatches(
    object_info: dict, specs: dict[str, NodeSpec] | None = None, files=None
) -> dict[str, list[str]]:
    """{"errors": [...], "newer": [...]}: what a user's load of the shipped workflows would trip over on this
    server, and the node types and combo entries of a newer ComfyUI the server lacks (their workflows need that
    release)."""
    specs = specs if specs is not None else wc.node_specs()
    files = sorted(files if files is not None else WORKFLOWS.glob("*.json"))
    api_files = [p for p in files if p.name.endswith(".api.json")]
    ui_types = {
        n["type"]
        for p in files
        if not p.name.endswith(".api.json")
        for n in json.loads(p.read_text()).get("nodes", [])
        if n["type"] not in comfy_format().FRONTEND_ONLY_NODES
    }
    errors, newer = [], []
    used = used_inputs(api_files)
    for name in sorted(set(used) | ui_types):
        if name not in object_info:
            (newer if name in wc.NEWER_CORE_NODES else errors).append(
                f"{name}: used by the shipped workflows, not on the server"
            )
            continue
        ours, server = specs[name], spec_from_object_info(name, object_info[name])
        for input_name, values in sorted(used.get(name, {}).items()):
            mine, theirs = ours.input(input_name), server.input(input_name)
            where = f"{name}.{input_name}"
            if mine is None:
                errors.append(f"{where}: set by a workflow, not in our node table")
                continue
            if theirs is None:
                errors.append(f"{where}: set by a workflow, not declared by the server")
                continue
            if (mine.type, mine.required) != (theirs.type, theirs.required):
                errors.append(
                    f"{where}: ours {mine.type} required={mine.required}, "
                    f"server {theirs.type} required={theirs.required}"
                )
                continue
            later = wc.NEWER_COMBO_OPTIONS.get((name, input_name), ())
            for value in values:
                problem = _value_problem(mine, theirs, value)
                if problem:
                    (newer if value in later else errors).append(f"{where}: {problem}")
        row, server_row = _widget_row(ours), _widget_row(server)
        if server_row[: len(row)] != row:
            errors.append(f"{name}: widgets (name, type, control) ours {row}, server {server_row}")
    return {"errors": errors, "newer": newer}
