"""fewstep: few-step image models and realtime causal video for ComfyUI.

ComfyUI imports this folder as a custom-node pack (under a module name derived from its path); pip installs it
as the package ``fewstep`` (engine at ``fewstep.engine``, CLI ``python -m fewstep``). Importing it registers
node classes and changes nothing global.
"""

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

# The version is pyproject.toml's (static: the Comfy Registry reads it there). ComfyUI imports this folder
# without an installed distribution, so there is no metadata to ask: this line mirrors it, and
# tests/test_registry_metadata.py fails the moment the two differ.
__version__ = "0.1.0"
__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "__version__"]
