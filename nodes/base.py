"""Shared pieces of the node adapters: category prefix, type names, the input declarations several nodes
make, error attribution, one-prompt check."""

from __future__ import annotations

import functools
import inspect

from ..engine.conditioning import TextCondition
from ..engine.errors import InputError
from ..engine.handle import ModelHandle
from .conditioning import from_comfy
from .inputs import check_node_inputs, register_object_type

CATEGORY = "FewStep"
FEWSTEP_MODEL = "FEWSTEP_MODEL"
register_object_type(FEWSTEP_MODEL, ModelHandle, "a FEWSTEP_MODEL from FewStepDiTLoader")


MAX_SEED = 0xFFFFFFFFFFFFFFFF
# the families FewStepDiTLoader builds: what a node that takes any of them says it takes
ALL_FAMILIES = "FLUX.1, FLUX.2, Z-Image or Wan"


class ReturnsModel:
    """A node whose one output is a FEWSTEP_MODEL named ``model``: the loader, and the nodes that hand the model
    on with a LoRA, a step cache or compilation attached."""

    RETURN_TYPES = (FEWSTEP_MODEL,)
    RETURN_NAMES = ("model",)


def model_input(which: str | None = None) -> tuple:
    """The ``model`` input of every node that runs or extends a FEWSTEP_MODEL, one wording for all; ``which``
    adds what this node says about it (the families it runs, another node the model may come through)."""
    detail = f" ({which})" if which else ""
    return (FEWSTEP_MODEL, {"tooltip": f"A model from FewStepDiTLoader{detail}."})


def schedule_fraction_input(default: float, tooltip: str, minimum: float = 0.0) -> tuple:
    """A fraction of the sampling schedule (denoise, where a step cache starts and ends, CFG gating's cutoff)."""
    return ("FLOAT", {"default": default, "min": minimum, "max": 1.0, "step": 0.01, "tooltip": tooltip})


def seed_input(tooltip: str) -> tuple:
    """A seed widget as ComfyUI's own samplers declare it (full 64-bit range, control after generate)."""
    return (
        "INT",
        {"default": 0, "min": 0, "max": MAX_SEED, "control_after_generate": True, "tooltip": tooltip},
    )


def reports_input_errors(
    node_name: str, renames: dict[str, str] | None = None, file_lists: tuple[str, ...] = ()
):
    """Decorate a node's FUNCTION: first check every argument against the node's ``INPUT_TYPES`` (types, ranges,
    combo lists: ``nodes.inputs``), then run it; engine input errors name this node and its own input names.

    ``file_lists``: combo inputs listing files, which the node resolves itself (any text passes the shared check).
    """
    renames = renames or {}

    def wrap(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def run(self, *args, **kwargs):
            try:
                try:
                    arguments = signature.bind(self, *args, **kwargs).arguments
                except TypeError as err:
                    raise InputError("inputs", str(err)) from None
                check_node_inputs(type(self).INPUT_TYPES(), arguments, file_lists)
                return fn(self, *args, **kwargs)
            except InputError as err:
                err.input_name = renames.get(err.input_name, err.input_name)
                raise err.located(node_name) from None

        run.checks_node_inputs = True  # tests walk every node's FUNCTION for this mark
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
