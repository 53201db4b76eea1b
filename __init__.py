"""fewstep: few-step image models and realtime causal video for ComfyUI.

ComfyUI imports this folder as a custom-node pack (under a module name derived from its path); pip installs it
as the package ``fewstep`` (engine at ``fewstep.engine``, CLI ``python -m fewstep``). Importing it changes nothing
global; the node classes load when ``NODE_CLASS_MAPPINGS`` is first read (ComfyUI reads it right after the import).
"""

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

DISTRIBUTION = "fewstep"
_PROJECT_VERSION = re.compile(r'version\s*=\s*"([^"]+)"')


def project_version(pyproject: Path) -> str | None:
    """The ``version`` of the ``[project]`` table of a pyproject.toml, or None. A line scan rather than tomllib,
    which Python 3.10 lacks: table headers start a line with ``[``, keys of a table follow its header."""
    table = None
    for line in pyproject.read_text(encoding="utf-8").splitlines():
        if line.startswith("["):
            table = line.strip()
        elif table == "[project]" and (match := _PROJECT_VERSION.fullmatch(line.strip())):
            return match.group(1)
    return None


def _version() -> str:
    # The one version source is pyproject.toml (static: the Comfy Registry reads it there). ComfyUI imports this
    # folder as cloned or unpacked by the Registry, pyproject.toml beside it and no installed metadata; a wheel
    # ships no pyproject.toml but carries the version in its metadata.
    pyproject = Path(__file__).with_name("pyproject.toml")
    found = project_version(pyproject) if pyproject.is_file() else None
    if found is not None:
        return found
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"


__version__ = _version()

_NODE_MAPPINGS = ("NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS")


def __getattr__(name: str):
    # The node classes import the whole engine and every node module; ComfyUI reads the mappings right after it
    # imports the pack, but ``python -m fewstep`` and ``import fewstep.engine`` never do, and a command's cold start
    # should not pay for them (bench/cold_start.py).
    if name in _NODE_MAPPINGS:
        try:
            from . import nodes
        except AttributeError as err:  # ComfyUI asks through hasattr(), which would hide it as "no mappings"
            raise ImportError(f"fewstep's node modules failed to import: {err}") from err
        return getattr(nodes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "__version__"]
