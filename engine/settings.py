"""``FEWSTEP_*`` environment settings, read tolerantly.

A bad value (``FEWSTEP_MAX_SESSIONS=abc``) must not stop the pack from importing inside a server: it is logged
once, in one line naming the variable, the value and the default used instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)


def _env(name: str, default, parse: Callable[[str], object], check: Callable[[object], bool], expected: str):
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = parse(raw.strip())
        if check(value):
            return value
    except (TypeError, ValueError):
        pass
    log.warning("fewstep: ignoring %s=%r (expected %s); using %r", name, raw, expected, default)
    return default


def env_int(name: str, default: int | None, minimum: int = 0) -> int | None:
    """An integer >= ``minimum`` from the environment, else ``default`` (a bad value is logged)."""
    return _env(name, default, int, lambda v: v >= minimum, f"an integer >= {minimum}")


def env_float(name: str, default: float | None, minimum: float = 0.0) -> float | None:
    """A finite number > ``minimum`` from the environment, else ``default`` (a bad value is logged)."""
    return _env(
        name,
        default,
        float,
        lambda v: v == v and v not in (float("inf"),) and v > minimum,
        f"a number > {minimum}",
    )


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` from the environment, else ``default`` (a bad value is logged)."""
    return _env(name, default, str, lambda v: v in choices, "one of " + ", ".join(choices))
