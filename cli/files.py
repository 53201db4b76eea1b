"""Output files of the CLI: one permission rule for all of them.

A file the CLI writes gets what a plain ``open(path, "w")`` gives (0o666 less the umask: 0644 by default),
whichever library wrote it: ``safetensors`` writes through a private temporary file (0600) and a download goes
through ``tempfile.mkstemp`` (0600), so both are set to the same mode as the PNG and JSON outputs.
Standard library only at import (the queue client imports it).
"""

from __future__ import annotations

import os


def umask_mode() -> int:
    """The mode a plain ``open(path, "w")`` gives a new file here: 0o666 less the process umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def save_tensors(tensors: dict, path: str) -> None:
    """``safetensors.torch.save_file`` with the CLI's output permissions."""
    from safetensors.torch import save_file

    save_file(tensors, path)
    os.chmod(path, umask_mode())
