"""Sizes in the units people read."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """`1536` -> `"1.5 KiB"`: the largest binary unit that keeps the figure at least 1."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def two_sizes(a: float, b: float) -> tuple[str, str]:
    """`a` and `b` as `human_bytes` gives them where that tells them apart; else in their
    common unit with a third decimal, or where that is not enough, in exact bytes with
    thousands separators. For messages that compare two sizes: `3.00 MiB` beside `3.00 MiB`
    says nothing."""
    x, y = human_bytes(a), human_bytes(b)
    if x != y or a == b:
        return x, y
    unit = x.split()[1]
    if unit != "B":
        scale = 1024 ** ("B", "KiB", "MiB", "GiB", "TiB").index(unit)
        x, y = f"{a / scale:.3f} {unit}", f"{b / scale:.3f} {unit}"
        if x != y:
            return x, y
    return f"{round(a):,} bytes", f"{round(b):,} bytes"
