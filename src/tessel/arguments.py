"""Checks of the arguments tessel's `mindspore.parallel`-style functions take (the checkpoint API,
AutoParallel's settings): each raises TypeError
for a value of the wrong type and ValueError for one out of range, naming the function and the
argument, before anything is read or written."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def integer(func: str, name: str, value: Any, low: int) -> int:
    """`value`, an int (not a bool) of at least `low`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{func}: {name} must be an int, found {type(value).__name__}")
    if value < low:
        raise ValueError(f"{func}: {name} must be at least {low}, found {value}")
    return value


def flag(func: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{func}: {name} must be True or False, found {value!r}")
    return value


def file_prefix(func: str, name: str, value: Any) -> str:
    """`value`, the start of a file name: no directory part (it would write elsewhere)."""
    if not isinstance(value, str):
        raise TypeError(f"{func}: {name} must be a str, found {type(value).__name__}")
    if "/" in value or "\\" in value or "\0" in value or value in (".", ".."):
        raise ValueError(f"{func}: {name} must be a file name's start, found {value!r}")
    return value


def optional_callable(func: str, name: str, value: Any) -> Callable | None:
    if value is not None and not callable(value):
        raise TypeError(f"{func}: {name} must be a function or None, found {type(value).__name__}")
    return value


def prefixes(func: str, name: str, value: Any) -> tuple[str, ...]:
    """`value`, None, one str or a sequence of them, as a tuple."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(f"{func}: {name} must be a str or a list of str, found {value!r}")
