"""``FEWSTEP_*`` environment settings, read tolerantly.

A bad value (``FEWSTEP_MAX_SESSIONS=abc``) or one out of the setting's range (``FEWSTEP_SESSION_GB=1e300``,
``inf``, a negative number) must not stop the pack from importing inside a server: it is logged once per process,
in one line naming the variable, the value and the default used instead. Every numeric setting has a range; the
shared maxima are here.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable

log = logging.getLogger(__name__)

# The most memory any one setting may name, in GiB (64 TiB): more than any single machine's RAM or GPU memory
# today, and far below where GiB -> bytes arithmetic loses precision or overflows a float.
MAX_MEMORY_GB = float(1 << 16)

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


def env_int(
    name: str, default: int | None, *, minimum: int, maximum: int, default_text: str | None = None
) -> int | None:
    """An integer in ``[minimum, maximum]`` from the environment, else ``default`` (a bad or out-of-range value is
    logged once; ``default_text`` says what the default means, e.g. when it is None). Every setting names its
    maximum: a value past any sensible one (``2**80`` sessions) is a typo, not a wish, and must not reach the
    arithmetic that sizes things from it."""
    return _env(name, default, int, lambda v: minimum <= v <= maximum,
                f"an integer from {minimum} to {maximum}", default_text)  # fmt: skip


def env_float(
    name: str, default: float | None, *, minimum: float, maximum: float, default_text: str | None = None
) -> float | None:
    """A finite number > ``minimum`` and <= ``maximum`` from the environment, else ``default`` (a bad or
    out-of-range value is logged once; ``default_text`` says what the default means, e.g. when it is None).
    The maximum keeps ``1e300`` GB from overflowing when it is turned into bytes."""
    return _env(name, default, float, lambda v: math.isfinite(v) and minimum < v <= maximum,
                f"a number > {minimum:.15g} and <= {maximum:.15g}", default_text)  # fmt: skip


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` from the environment, else ``default`` (a bad value is logged once)."""
    return _env(name, default, str, lambda v: v in choices, "one of " + ", ".join(choices), None)


def env_list(name: str) -> tuple[str, ...]:
    """The comma-separated entries of a setting (blanks dropped); () when unset. Entries are checked by the
    caller, which knows what each one must be."""
    return tuple(entry.strip() for entry in os.environ.get(name, "").split(",") if entry.strip())
