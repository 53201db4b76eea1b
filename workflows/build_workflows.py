"""Build the shipped workflows: each graph is defined once and written in both ComfyUI formats.

    python workflows/build_workflows.py          # (re)write workflows/<name>.json and <name>.api.json
    python workflows/build_workflows.py --check  # exit 1 if the files on disk differ from what it would write

<name>.json is the canvas (UI) format the frontend's Load opens; <name>.api.json is the API format that
POST /prompt takes. Widget values are given by input name; the UI's positional widgets_values are laid out
from the node definitions (the pack's INPUT_TYPES and fewstep_workflows/nodes.py's CORE_NODES), and every
file is validated against them before it is written.

The graphs live in workflows/fewstep_workflows/, one module per capability (image, cache, tiny_vae,
causal_video, stream, compile, parallel, plan, flux2_zimage). To add a workflow: write a function that fills a
Graph in one of them and decorate it with @workflow("<name>").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # run as a script or loaded by file path: the package sits next to this file

from fewstep_workflows import WORKFLOWS  # noqa: E402
from fewstep_workflows.graph import Graph, to_api, to_ui  # noqa: E402
from fewstep_workflows.nodes import NodeSpec, node_specs  # noqa: E402
from fewstep_workflows.validate import compare_twins, validate  # noqa: E402

__all__ = ["WORKFLOWS", "Graph", "main", "render", "to_api", "to_ui"]


def render(name: str, specs: dict[str, NodeSpec]) -> dict[str, str]:
    """File name -> text for one workflow, validated."""
    g = Graph(name, specs)
    WORKFLOWS[name](g)
    ui, api = to_ui(g), to_api(g)
    errors = validate(ui, specs) + validate(api, specs) + compare_twins(ui, api, specs)
    if errors:
        raise SystemExit(f"{name}: invalid workflow:\n  " + "\n  ".join(errors))
    return {f"{name}.json": dump(ui), f"{name}.api.json": dump(api)}


def dump(obj) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the files on disk, write nothing")
    args = ap.parse_args(argv)
    specs = node_specs()
    files = {}
    for name in WORKFLOWS:
        files.update(render(name, specs))
    if not args.check:
        for fname, text in files.items():
            (HERE / fname).write_text(text)
        print(f"wrote {len(files)} files to {HERE}")
        return 0
    problems = [f"{f}: missing" for f in files if not (HERE / f).exists()]
    problems += [
        f"{f}: differs" for f, t in files.items() if (HERE / f).exists() and (HERE / f).read_text() != t
    ]
    problems += [
        f"{p.name}: stale (not built by this script)"
        for p in sorted(HERE.glob("*.json"))
        if p.name not in files
    ]
    for p in problems:
        print(p)
    if problems:
        print("run: python workflows/build_workflows.py")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
