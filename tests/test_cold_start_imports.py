"""What a fresh process imports (issue 35's cold start, bench/cold_start.py): nothing a run does not use. Each
case runs in its own interpreter, since this test session has imported everything already."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules_after(code: str) -> set[str]:
    script = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT.parent)
    assert r.returncode == 0, r.stderr[-2000:]
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


def test_import_fewstep_leaves_the_node_modules_until_comfyui_reads_the_mappings():
    before = _modules_after("import fewstep")
    assert "fewstep.nodes" not in before and "fewstep.engine.causal" not in before
    after = _modules_after("import fewstep\nassert len(fewstep.NODE_CLASS_MAPPINGS) > 10")
    assert "fewstep.nodes" in after


def test_building_models_on_the_meta_device_imports_neither_sympy_nor_dynamo():
    loaded = _modules_after(
        "import torch\nfrom fewstep.engine.loader import load_dit\n"
        "for preset in ('wan-tiny', 'flux-tiny', 'flux2-tiny', 'zimage-tiny'):\n"
        "    load_dit(f'dummy:{preset}', torch.float32, 'cpu')"
    )
    assert "sympy" not in loaded and "torch._dynamo" not in loaded


def test_the_command_line_imports_only_the_command_it_runs():
    loaded = _modules_after("from fewstep.cli import build_parser, named_command\n"
                            "build_parser(only=named_command(['-v', 'generate', '--model', 'flux-tiny']))")  # fmt: skip
    commands = {m.rsplit(".", 1)[1] for m in loaded if m.startswith("fewstep.cli.")}
    assert "generate" in commands and not commands & {"stream", "demo", "live", "queue", "worker", "plan"}
    assert "fewstep.engine.causal" not in loaded
