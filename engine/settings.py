"""``FEWSTEP_*`` environment settings, read tolerantly.

A bad value (``FEWSTEP_MAX_SESSIONS=abc``) must not stop the pack from importing inside a server: it is logged
once per process, in one line naming the variable, the value and the default used instead.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable

log = logging.getLogger(__name__)

_warned: set[tuple[str, str]] = set()  # (variable, bad value) pairs already logged


def _env(name: str, default, parse: Callable[[str], object], check: Callable[[object], bool], expected: str,
         default_text: str | None):  # fmt: skip
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = parse(raw.strip())
        if check(value):
            return value
    except (TypeError, ValueError):
        pass
    if (name, raw) not in _warned:
        _warned.add((name, raw))
        log.warning("fewstep: ignoring %s=%r (expected %s); using %s", name, raw, expected,
                    default_text or repr(default))  # fmt: skip
    return default


def env_int(name: str, default: int | None, minimum: int = 0, default_text: str | None = None) -> int | None:
    """An integer >= ``minimum`` from the environment, else ``default`` (a bad value is logged once;
    ``default_text`` says what the default means, e.g. when it is None)."""
    return _env(name, default, int, lambda v: v >= minimum, f"an integer >= {minimum}", default_text)


def env_float(
    name: str, default: float | None, minimum: float = 0.0, default_text: str | None = None
) -> float | None:
    """A finite number > ``minimum`` from the environment, else ``default`` (a bad value is logged once;
    ``default_text`` says what the default means, e.g. when it is None)."""
    return _env(name, default, float, lambda v: math.isfinite(v) and v > minimum, f"a number > {minimum}",
                default_text)  # fmt: skip


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` from the environment, else ``default`` (a bad value is logged once)."""
    return _env(name, default, str, lambda v: v in choices, "one of " + ", ".join(choices), None)


def env_list(name: str) -> tuple[str, ...]:
    """The comma-separated entries of a setting (blanks dropped); () when unset. Entries are checked by the
    caller, which knows what each one must be."""
    return tuple(entry.strip() for entry in os.environ.get(name, "").split(",") if entry.strip())
