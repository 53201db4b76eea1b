"""The one check of a file name someone else chose (a workflow's ``calibration_name``, a server's output names).

A name the pack writes to disk and later lists to everyone must show what it is. Refused: every character of the
Unicode "Other" categories and the line / paragraph separators: control characters (``Cc``: NUL, newline, ESC),
format characters (``Cf``: the bidi overrides and isolates U+202A-202E and U+2066-2069, the zero-width U+200B-200F,
U+FEFF, which make a listed name read differently from what it is), surrogates (``Cs``: a lone one cannot even be
encoded to a file name, so it would fail only when the file is finally written), private-use (``Co``: drawn by
whatever font has one) and unassigned code points (``Cn``), and U+2028 / U+2029 (``Zl`` / ``Zp``: line breaks).
Standard library only (the queue client imports it).
"""

from __future__ import annotations

import unicodedata

from .errors import InputError

# Unicode general category -> what it is, in words for the refusal
REFUSED_CATEGORIES = {
    "Cc": "a control character",
    "Cf": "an invisible format character such as a bidi override or a zero-width space",
    "Cs": "a lone surrogate, which no file name can hold",
    "Co": "a private-use character",
    "Cn": "an unassigned code point",
    "Zl": "a line separator",
    "Zp": "a paragraph separator",
}


def describe_code_point(ch: str) -> str:
    """``U+202E RIGHT-TO-LEFT OVERRIDE``; characters without a Unicode name (controls, surrogates) by number."""
    name = unicodedata.name(ch, "")
    return f"U+{ord(ch):04X}" + (f" {name}" if name else "")


def name_problem(name: str) -> str | None:
    """Why ``name`` may not name a file the pack writes (its first refused character), or None when it may."""
    for ch in name:
        kind = REFUSED_CATEGORIES.get(unicodedata.category(ch))
        if kind is not None:
            return f"it contains {describe_code_point(ch)}, {kind}"
    return None


def check_name(name: str, input_name: str, where: str | None = None) -> str:
    """``name`` itself, or an :class:`InputError` on ``input_name`` naming the first refused character; the name is
    printed escaped (``repr`` writes every refused character as its ``\\u`` escape)."""
    if not isinstance(name, str):
        raise InputError(input_name, f"{name!r} is not text: expected a file name", where)
    problem = name_problem(name)
    if problem is not None:
        raise InputError(input_name, f"{name!r} cannot name a file: {problem}", where)
    return name


__all__ = ["REFUSED_CATEGORIES", "check_name", "describe_code_point", "name_problem"]
