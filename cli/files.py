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


def save_tensors(tensors: dict, path: str, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file`` with the CLI's output permissions."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata=metadata)
    os.chmod(path, umask_mode())


def read_tensors(path: str, flag: str) -> dict:
    """The tensors of the safetensors file ``path`` a flag names (``--cond``, ``--init-latents``...), or an
    ``InputError`` naming ``flag``: a folder, a missing file, a file safetensors cannot read. Nothing else is
    read: the CLI opens only the files the user names."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from ..engine.errors import InputError

    if os.path.isdir(path):
        raise InputError(flag, f"{path} is a folder, not a safetensors file")
    if not os.path.isfile(path):
        raise InputError(flag, f"file not found: {path}")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise InputError(
            flag, f"{path} is not a readable safetensors file ({type(exc).__name__}: {exc})"
        ) from None


def tensor_named(tensors: dict, key: str, path: str, flag: str):
    """``tensors[key]``, or an ``InputError`` naming ``flag`` that lists the keys the file has instead."""
    from ..engine.errors import InputError

    if key not in tensors:
        found = sorted(tensors)
        shown = ", ".join(found[:8]) + (f", ... ({len(found) - 8} more)" if len(found) > 8 else "")
        raise InputError(flag, f"{path} has no '{key}' tensor (found {shown})")
    return tensors[key]
