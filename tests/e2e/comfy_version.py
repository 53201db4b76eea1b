"""Which ComfyUI a checkout is: its release (``comfyui_version.py``) and commit, read from the files alone.

Shared by the server fixture (comfy_server.py: tests name the version they run against) and the suite driver
(run_suites.py: one summary line per ComfyUI version). Importing ComfyUI here would run its start-up code in the
test process, so the version file is parsed, not imported.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path


def comfyui_version(checkout: str | Path) -> str:
    """The release a ComfyUI checkout declares (``__version__`` in its comfyui_version.py), e.g. ``"0.8.0"``;
    ``"unknown"`` when the file or the assignment is missing (a checkout older than that file)."""
    try:
        text = (Path(checkout) / "comfyui_version.py").read_text()
    except OSError:
        return "unknown"
    match = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", text, re.MULTILINE)
    return match.group(1) if match else "unknown"


def comfyui_commit(checkout: str | Path) -> str:
    """The checkout's commit, 8 hex digits: from ``.comfy_commit`` (written by ../shared/comfyui/comfy_host.sh,
    whose checkouts are not git work trees), else from git; ``"?"`` when neither knows."""
    stamp = Path(checkout) / ".comfy_commit"
    if stamp.is_file():
        return stamp.read_text().strip()[:8] or "?"
    try:
        run = subprocess.run(
            ["git", "-C", str(checkout), "rev-parse", "--short=8", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return run.stdout.strip() if run.returncode == 0 and run.stdout.strip() else "?"


def describe(checkout: str | Path) -> str:
    """``"ComfyUI 0.8.0 (618b803d)"``: how summaries and skip reasons name a checkout."""
    return f"ComfyUI {comfyui_version(checkout)} ({comfyui_commit(checkout)})"


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.8.0"`` -> ``(0, 8, 0)`` for comparisons; non-numeric parts (``"unknown"``) read as 0."""
    return tuple(int(part) if part.isdigit() else 0 for part in version.split("."))
