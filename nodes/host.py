"""The pack's only contact with ComfyUI's runtime, used lazily.

Inside a running ComfyUI server its modules (``folder_paths``, ``comfy.model_management``, ``comfy.utils``)
are already imported before custom nodes load, so this module *looks them up* in ``sys.modules`` and never
imports them itself: outside ComfyUI (tests, CLI, scripts) every helper falls back to a plain behaviour
(file paths as given, a tqdm progress bar, no interrupt, no memory manager).
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from ..engine.errors import InputError

log = logging.getLogger(__name__)


def comfy_module(name: str):
    """A ComfyUI module if this process is a ComfyUI server, else None."""
    return sys.modules.get(name)


def in_comfyui() -> bool:
    return comfy_module("comfy.model_management") is not None


def list_model_files(folder: str) -> list[str]:
    fp = comfy_module("folder_paths")
    if fp is None:
        return []
    try:
        return list(fp.get_filename_list(folder))
    except Exception:  # noqa: BLE001 - an unknown folder name must not break node registration
        return []


def register_model_folder(folder: str, extensions: set[str]) -> list[str] | None:
    """Make ``models/<folder>`` a ComfyUI model folder listing files with ``extensions``; its paths (the first is
    where to write), or None outside ComfyUI. A folder set up by extra_model_paths.yaml keeps its paths."""
    fp = comfy_module("folder_paths")
    if fp is None:
        return None
    registry = fp.folder_names_and_paths
    if folder not in registry:
        registry[folder] = ([os.path.join(fp.models_dir, folder)], set(extensions))
    elif not registry[folder][1]:  # registered without extensions (every file): list only ours
        registry[folder] = (registry[folder][0], set(extensions))
    return fp.get_folder_paths(folder)


def model_file_path(folder: str, name: str, input_name: str) -> str:
    """Full path of ``name`` in a ComfyUI model folder; outside ComfyUI (CLI, scripts) the name is a path.

    Inside ComfyUI (where anyone who can POST /prompt chooses ``name``) only a file the folder lists is accepted:
    a path anywhere else, existing or not, gets the same error, so the answer tells nothing about other files.
    """
    fp = comfy_module("folder_paths")
    if fp is None:
        return os.path.expanduser(name)
    if name in list_model_files(folder):
        path = fp.get_full_path(folder, name)
        if path is not None:
            return path
    raise InputError(
        input_name,
        f"{name!r} is not a file in ComfyUI's models/{folder} folder; inside ComfyUI only a name from its list "
        "(or a dummy: entry) is accepted, not a path",
    )


def check_interrupt() -> None:
    """Raise ComfyUI's interrupt exception when the user pressed Cancel (no-op outside ComfyUI)."""
    mm = comfy_module("comfy.model_management")
    if mm is not None:
        mm.throw_exception_if_processing_interrupted()


def interrupt_check():
    """ComfyUI's own cancel check for a run's ``RunOptions.interrupt_check`` (the engine calls it between the
    transformer blocks of a forward, so Cancel / POST /interrupt stops within one block), or None outside ComfyUI.
    It raises ComfyUI's ``InterruptProcessingException`` after a Cancel and otherwise only reads a flag under a
    lock: no device sync, so calling it between queued GPU kernels costs nothing."""
    mm = comfy_module("comfy.model_management")
    return None if mm is None else mm.throw_exception_if_processing_interrupted


def torch_device() -> torch.device:
    mm = comfy_module("comfy.model_management")
    if mm is not None:
        return mm.get_torch_device()
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def offload_device() -> torch.device:
    mm = comfy_module("comfy.model_management")
    if mm is not None:
        return mm.unet_offload_device()
    return torch_device()


class Progress:
    """ComfyUI's progress bar (with optional preview images) or a tqdm bar outside ComfyUI."""

    def __init__(self, total: int, desc: str = "fewstep"):
        self.total = total
        utils = comfy_module("comfy.utils")
        self._bar = utils.ProgressBar(total) if utils is not None else None
        self._tqdm = None
        if self._bar is None:
            from tqdm.auto import tqdm

            self._tqdm = tqdm(total=total, desc=desc, disable=None, leave=False)

    def update(self, done: int, preview=None) -> None:
        if self._bar is not None:
            self._bar.update_absolute(done, self.total, preview)
        elif self._tqdm is not None:
            self._tqdm.update(done - self._tqdm.n)

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()


def preview_payload(image: torch.Tensor):
    """ComfyUI's progress-bar preview for an image ``[H, W, 3]`` in [0, 1]: ``("JPEG", PIL image, max size)``."""
    from PIL import Image

    args = getattr(comfy_module("comfy.cli_args"), "args", None)
    max_size = getattr(args, "preview_size", 512)
    array = (image.clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
    return ("JPEG", Image.fromarray(array), max_size)


def executing_node() -> tuple[str, str] | None:
    """(prompt id, node id) of the node ComfyUI is executing in this thread, or None outside a ComfyUI run."""
    utils = comfy_module("comfy_execution.utils")
    context = utils.get_executing_context() if utils is not None else None
    return None if context is None else (str(context.prompt_id), str(context.node_id))


def temp_directory() -> str | None:
    """ComfyUI's temp folder (served by /view?type=temp, emptied when the server starts), or None outside it."""
    fp = comfy_module("folder_paths")
    return None if fp is None else fp.get_temp_directory()


def prompt_server():
    """ComfyUI's running ``PromptServer`` (its aiohttp ``routes``, event ``loop`` and websocket ``sockets`` by
    client id), or None outside a ComfyUI server."""
    server = comfy_module("server")
    return getattr(getattr(server, "PromptServer", None), "instance", None)


def send_to_client(event: str, data: dict) -> bool:
    """Send a websocket event to the client that queued the running prompt; False when there is no server."""
    instance = prompt_server()
    if instance is None:
        return False
    instance.send_sync(event, data, instance.client_id)
    return True
