"""The shipped workflows, one module per capability, and what builds and checks them.

``graph`` holds the graph type and both ComfyUI formats, ``nodes`` the node definitions (the pack's and the
core ones), ``validate`` the offline checks, ``parts`` what several workflows share; the other modules each
register their workflows with ``@workflow``. Importing this package registers all of them (each writes its own
files, so the order does not matter). Only ``workflows/build_workflows.py`` and the tests import it; the pack never does.
"""

from . import (  # noqa: F401
    cache,
    causal_video,
    compile,
    flux2_zimage,
    image,
    interactive_video,
    live_video,
    lora,
    parallel,
    plan,
    stream,
    tiny_vae,
)
from .graph import WORKFLOWS

__all__ = ["WORKFLOWS"]
