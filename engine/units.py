"""Quantities as people read them in reports and error messages."""

from __future__ import annotations


def format_bytes(n: int, digits: int = 2) -> str:
    """``n`` bytes in the largest binary unit that keeps the number >= 1: "512 B", "1.23 MiB" (``digits``
    decimals)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{n} B"
