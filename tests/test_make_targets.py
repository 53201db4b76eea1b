"""What ``make demo`` and ``make test`` would install on a fresh machine (``make -n``: printed, not run): the demo
only the runtime and the images / video extras it writes PNG and MP4 with, the tests the test extra (pytest, ruff,
triton alone about 1 GB)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def planned(target: str, venv: Path) -> list[str]:
    done = subprocess.run(["make", "-n", "-C", str(ROOT), target, f"VENV={venv}"], capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    return [line for line in done.stdout.splitlines() if "pip install" in line]


def test_demo_installs_the_runtime_and_the_output_extras_only(tmp_path):
    installs = planned("demo", tmp_path / "venv")
    assert any('"torch==2.13.0"' in line for line in installs)
    assert [line for line in installs if "-e " in line] == [
        f'{tmp_path / "venv"}/bin/python -m pip install -q -e ".[images,video]"'
    ]


def test_test_installs_the_test_extra(tmp_path):
    installs = planned("test", tmp_path / "venv")
    assert [line for line in installs if "-e " in line] == [
        f'{tmp_path / "venv"}/bin/python -m pip install -q -e ".[test]"'
    ]
