"""Shared pieces of the node adapters: category prefix, type names, error attribution, one-prompt check."""

from __future__ import annotations

import functools

from ..engine.conditioning import TextCondition
from ..engine.errors import InputError
from .conditioning import from_comfy

CATEGORY = "FewStep"
FEWSTEP_MODEL = "FEWSTEP_MODEL"


MAX_SEED = 0xFFFFFFFFFFFFFFFF


def seed_input(tooltip: str) -> tuple:
    """A seed widget as ComfyUI's own samplers declare it (full 64-bit range, control after generate)."""
    return (
        "INT",
        {"default": 0, "min": 0, "max": MAX_SEED, "control_after_generate": True, "tooltip": tooltip},
    )


def reports_input_errors(node_name: str, renames: dict[str, str] | None = None):
    """Decorate a node's FUNCTION so engine input errors name this node and its own input names."""
    renames = renames or {}

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except InputError as err:
                err.input_name = renames.get(err.input_name, err.input_name)
                raise err.located(node_name) from None

        return run

    return wrap


def single_prompt(conditioning, input_name: str, refusal: str) -> TextCondition:
    """The one prompt of a ComfyUI CONDITIONING, for nodes that run every frame under a single prompt.

    ``refusal`` finishes the message when there are several entries (what the node takes, and what to do).
    """
    conds = from_comfy(conditioning, input_name)
    if len(conds) != 1:
        raise InputError(input_name, f"{len(conds)} conditioning entries; {refusal}")
    return conds[0]
