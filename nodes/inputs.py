"""The one check of every node input against what its node declares, before the node does any work.

ComfyUI checks a widget value typed into the canvas against the widget's ``min`` / ``max`` and its combo list, but
not a value that arrives through a link: a core ``PrimitiveInt`` linked to ``steps`` delivers 2^31, a wildcard
output of another pack delivers the string ``"false"`` to a BOOLEAN, NaN to a FLOAT or a number to a LATENT. So
every node of the pack runs :func:`check_node_inputs` on its arguments first (``nodes.base.reports_input_errors``
does it), against its own ``INPUT_TYPES``:

* INT: an integer (not a bool, not a float) inside the declared ``[min, max]``;
* FLOAT: a real number (ints accepted), finite, inside ``[min, max]``;
* BOOLEAN: ``True`` or ``False`` (no string, no number);
* STRING: text of at most ``MAX_TEXT_CHARS`` characters that encodes as UTF-8 (no lone surrogate);
* a combo: one of its listed values (a combo that lists files takes any text: the node resolves the name itself,
  and outside ComfyUI it is a path);
* the pack's and ComfyUI's object types (FEWSTEP_MODEL, LATENT, IMAGE, CONDITIONING, ...): an object of that kind.

A refusal is one :class:`InputError` naming the node, the input and what was expected.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch

from ..engine.errors import InputError

MAX_TEXT_CHARS = (
    65536  # a text widget longer than this is not something a person typed (and costs parsing time)
)

# object types: name -> (is this value one?, what was expected). Node modules register their own types.
OBJECT_TYPES: dict[str, tuple[Callable[[object], bool], str]] = {}


def register_object_type(type_name: str, accepts: Callable[[object], bool] | type, expected: str) -> None:
    """``accepts``: a predicate, or the class whose instances are that type (see :func:`is_instance_of`)."""
    if isinstance(accepts, type):
        cls = accepts

        def accepts(value):
            return is_instance_of(value, cls)

    OBJECT_TYPES[type_name] = (accepts, expected)


def is_instance_of(value, cls: type) -> bool:
    """``isinstance`` that also accepts the same class from another import of this package.

    The pack can be imported twice in one process: by ComfyUI under a module name made from its folder path, and as
    ``fewstep`` (the engine API, the CLI, a script or another pack using the engine). A model loaded through one is a
    valid model for the other: compare the class's name and the last two parts of its module path.
    """
    suffix = ".".join(cls.__module__.split(".")[-2:])
    return any(
        c.__qualname__ == cls.__qualname__ and ".".join(c.__module__.split(".")[-2:]) == suffix
        for c in type(value).__mro__
    )


def _is_latent(value) -> bool:
    return isinstance(value, dict) and isinstance(value.get("samples"), torch.Tensor)


def _is_image(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 4 and value.is_floating_point()


def _is_model_patcher(value) -> bool:
    # duck-typed: nodes/ must not import ComfyUI; a ModelPatcher clones and carries the model it patches
    return callable(getattr(value, "clone", None)) and hasattr(value, "model")


register_object_type("LATENT", _is_latent, "a LATENT (a dict with a 'samples' tensor)")
register_object_type("IMAGE", _is_image, "an IMAGE (a float tensor [batch, height, width, channels])")
register_object_type("CONDITIONING", lambda v: isinstance(v, list), "a CONDITIONING list")
register_object_type("MODEL", _is_model_patcher, "a ComfyUI MODEL (from a model loader)")


def describe(value, limit: int = 60) -> str:
    """A short, printable description of an untrusted value: a bounded, escaped repr, or its kind."""
    if isinstance(value, bool):
        return f"{value} (a boolean)"
    if isinstance(value, numbers.Integral):
        value = int(value)
        if value.bit_length() > 128:  # str() of a huge int is slow (and refused past 4300 digits)
            return f"an integer of {value.bit_length()} bits"
        text = str(value)
    elif isinstance(value, float):
        text = repr(value)
    elif isinstance(value, str):
        text = "the text " + ascii(value)  # escapes control, bidi and unpaired surrogate characters
    elif isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    else:
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_int(value, spec: dict, name: str):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputError(name, f"expected an integer{_range(spec)}, got {describe(value)}")
    value = int(value)
    low, high = spec.get("min"), spec.get("max")
    if (low is not None and value < low) or (high is not None and value > high):
        raise InputError(name, f"expected an integer{_range(spec)}, got {describe(value)}")
    return value


def _check_float(value, spec: dict, name: str):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputError(name, f"expected a number{_range(spec)}, got {describe(value)}")
    try:
        number = float(value)
    except OverflowError:
        raise InputError(name, f"expected a number{_range(spec)}, got {describe(value)}") from None
    low, high = spec.get("min"), spec.get("max")
    if (
        not math.isfinite(number)
        or (low is not None and number < low)
        or (high is not None and number > high)
    ):
        raise InputError(name, f"expected a finite number{_range(spec)}, got {describe(value)}")
    return value


def _check_bool(value, spec: dict, name: str):
    if not isinstance(value, bool):
        raise InputError(name, f"expected a boolean (true or false), got {describe(value)}")
    return value


def _check_text(value, spec: dict, name: str):
    if not isinstance(value, str):
        raise InputError(name, f"expected text, got {describe(value)}")
    if len(value) > MAX_TEXT_CHARS:
        raise InputError(name, f"expected text of at most {MAX_TEXT_CHARS} characters, got {len(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = value[err.start]
        raise InputError(
            name, f"is not valid text: it holds the unpaired surrogate U+{ord(bad):04X}"
        ) from None
    return value


WIDGET_CHECKS = {"INT": _check_int, "FLOAT": _check_float, "BOOLEAN": _check_bool, "STRING": _check_text}


def _range(spec: dict) -> str:
    low, high = spec.get("min"), spec.get("max")
    if low is None and high is None:
        return ""
    if high is None:
        return f" >= {low}"
    if low is None:
        return f" <= {high}"
    return f" in [{low}, {high}]"


def _check_combo(value, choices: list, name: str):
    try:
        listed = value in choices
    except Exception:  # noqa: BLE001 - an untrusted object's __eq__ may raise anything; it is not a choice then
        listed = False
    if not listed or (all(isinstance(c, str) for c in choices) and not isinstance(value, str)):
        shown = ", ".join(repr(c) for c in choices[:12]) + (", ..." if len(choices) > 12 else "")
        raise InputError(name, f"expected one of {shown}; got {describe(value)}")
    return value


def check_node_inputs(input_types: dict, arguments: dict, file_lists: tuple[str, ...] = ()) -> None:
    """Check ``arguments`` (input name -> value, as the node's function receives them) against ``input_types``
    (the node's ``INPUT_TYPES()``); raise an unattributed :class:`InputError` for the first bad one.

    ``file_lists`` names combo inputs that list files: they take any text, which the node itself resolves.
    """
    for section in ("required", "optional"):
        for name, declaration in (input_types.get(section) or {}).items():
            if name not in arguments:
                continue
            value = arguments[name]
            kind = declaration[0]
            spec = declaration[1] if len(declaration) > 1 and isinstance(declaration[1], dict) else {}
            if value is None:
                if section == "required":
                    raise InputError(name, "expected a value, got none (is the link's source node disabled?)")
                continue
            if isinstance(kind, (list, tuple)):
                if name in file_lists:
                    _check_text(value, spec, name)
                else:
                    _check_combo(value, list(kind), name)
            elif kind in WIDGET_CHECKS:
                WIDGET_CHECKS[kind](value, spec, name)
            elif kind in OBJECT_TYPES:
                accepts, expected = OBJECT_TYPES[kind]
                if not accepts(value):
                    raise InputError(name, f"expected {expected}, got {describe(value)}")
