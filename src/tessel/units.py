"""Sizes in the units people read."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """`1536` -> `"1.5 KiB"`: the largest binary unit that keeps the figure at least 1."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
