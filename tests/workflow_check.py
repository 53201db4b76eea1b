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

# The Missing Models dialog's rule, from ComfyUI frontend 1.27.10 (ComfyUI 0.3.64's frontend package;
# src/components/dialog/content/MissingModelsWarning.vue): a model is offered for download only if its URL is one
# of three exact URLs, or starts with one of these sources and its *name* ends with one of these suffixes.
FRONTEND_DOWNLOAD_SOURCES = ("https://civitai.com/", "https://huggingface.co/", "http://localhost:")
FRONTEND_DOWNLOAD_SUFFIXES = (".safetensors", ".sft")
FRONTEND_WHITELISTED_URLS = frozenset(
    {
        "https://huggingface.co/stabilityai/stable-zero123/resolve/main/stable_zero123.ckpt",
        "https://huggingface.co/TencentARC/T2I-Adapter/resolve/main/models/t2iadapter_depth_sd14v1.pth?download=true",
        "https://github.com/xinntao/Real-ESRGAN/releases/download/v0.1.0/RealESRGAN_x4plus.pth",
    }
)


def frontend_download_refusal(name: str, url: str) -> str | None:
    """Why the frontend's Missing Models dialog would refuse to offer ``url`` for ``name`` (its own message), or
    None when it offers the download."""
    if url in FRONTEND_WHITELISTED_URLS:
        return None
    if not url.startswith(FRONTEND_DOWNLOAD_SOURCES):
        allowed = "', '".join(FRONTEND_DOWNLOAD_SOURCES)
        return f"Download not allowed from source '{url}', only allowed from '{allowed}'"
    if not name.endswith(FRONTEND_DOWNLOAD_SUFFIXES):
        suffixes = "', '".join(FRONTEND_DOWNLOAD_SUFFIXES)
        return f"Only allowed suffixes are: '{suffixes}'"
    return None


__all__ = [
    "FRONTEND_DOWNLOAD_SOURCES",
    "FRONTEND_DOWNLOAD_SUFFIXES",
    "FRONTEND_WHITELISTED_URLS",
    "frontend_download_refusal",
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
