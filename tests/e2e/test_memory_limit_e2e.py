"""FEWSTEP_MEMORY_LIMIT_GB is a limit for the whole pack in a real ComfyUI server (issue 28: eight dummy:flux-mid
loaders in one prompt under a 1 GB limit took the server from 518 MB to 4.5 GB, each load fitting on its own).
"""

# ruff: noqa: F811 - the tests take the imported ``server`` fixture as an argument
from __future__ import annotations

import os

import pytest
from comfy_server import queue, requires_comfyui, server  # noqa: F401

pytestmark = requires_comfyui


@pytest.fixture(scope="module", autouse=True)
def _one_gb_limit():
    """The server inherits this process's environment: set before the (module-scoped) server starts."""
    before = os.environ.get("FEWSTEP_MEMORY_LIMIT_GB")
    os.environ["FEWSTEP_MEMORY_LIMIT_GB"] = "1"
    yield
    if before is None:
        del os.environ["FEWSTEP_MEMORY_LIMIT_GB"]
    else:
        os.environ["FEWSTEP_MEMORY_LIMIT_GB"] = before


def _loaders(count: int) -> dict:
    """``count`` flux-mid loaders (their attention inputs differ, so ComfyUI runs each), each shown by PreviewAny."""
    workflow = {}
    variants = [("auto", "auto"), ("auto", "sdpa"), ("fp32", "auto")]  # fp32 on the CPU, all three
    for i in range(count):
        compute_dtype, attention = variants[i]
        workflow[str(10 + i)] = {
            "class_type": "FewStepDiTLoader",
            "inputs": {"model_name": "dummy:flux-mid", "weight_dtype": "default", "compute_dtype": compute_dtype,
                       "attention": attention},
        }  # fmt: skip
        workflow[str(20 + i)] = {"class_type": "PreviewAny", "inputs": {"source": [str(10 + i), 0]}}
    return workflow


def test_a_second_model_is_refused_while_the_first_is_held(server):
    code, out = queue(server, _loaders(3), "--quiet")
    assert code == 3, out  # a node failed while the prompt ran
    (line,) = [line for line in out.splitlines() if "input 'model_name'" in line]
    assert (
        "(FewStepDiTLoader) failed: FewStepDiTLoader: input 'model_name': this needs about 564.95 MiB" in line
    )
    assert "refused before allocating" in line and "FEWSTEP_MEMORY_LIMIT_GB allows the pack 1.00 GiB" in line
    assert "already holds 564.95 MiB on cpu (1 model 564.95 MiB)" in line, out
