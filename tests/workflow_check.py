"""Offline validation of ComfyUI workflow files against node definitions, for the tests.

The checks ship with the workflow builder (workflows/fewstep_workflows/: ``nodes`` the node definitions and
``CORE_NODES``, ``validate`` the checks), which must not depend on tests/; this module gives the tests the
same names under the one import they use (``import workflow_check as wc``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflows"))

from fewstep_workflows.nodes import (  # noqa: E402
    CORE_NODES,
    NEWER_COMBO_OPTIONS,
    NEWER_CORE_NODES,
    PACK_MODULE,
    ROOT,
    InputSpec,
    NodeSpec,
    compare_object_info,
    load_pack,
    node_specs,
)
from fewstep_workflows.validate import compare_twins, is_ui_format, read_workflow, validate  # noqa: E402

__all__ = [
    "CORE_NODES",
    "NEWER_COMBO_OPTIONS",
    "NEWER_CORE_NODES",
    "PACK_MODULE",
    "ROOT",
    "InputSpec",
    "NodeSpec",
    "compare_object_info",
    "compare_twins",
    "is_ui_format",
    "load_pack",
    "node_specs",
    "read_workflow",
    "validate",
]
