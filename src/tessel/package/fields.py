"""Typed reading of a package's JSON: each accessor checks a value's type and range and names
its key path when wrong, so nothing a package says is used unchecked."""

from __future__ import annotations

import builtins
import math
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from tessel.errors import TesselError

# member names: plain relative paths of safe characters; no "..", no absolute paths, no "\"
_MEMBER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*")


class PackageError(TesselError, ValueError):
    """A package that cannot be used: missing, truncated, altered, or of an unknown version."""

    def __init__(self, path: Any, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = str(path)


def valid_member_name(name: str) -> bool:
    """Whether `name` may name a package member (a relative path without `..` or `\\`)."""
    return (
        isinstance(name, str)
        and len(name) <= 255
        and _MEMBER.fullmatch(name) is not None
        and ".." not in name.split("/")
    )


class Field:
    """A JSON value at a key path; its accessors check the type and name the path when wrong."""

    def __init__(self, value: Any, key: str, source: str) -> None:
        self.value, self.key, self.source = value, key, source

    def fail(self, message: str) -> PackageError:
        where = f"manifest {self.key}" if self.key else "manifest"
        return PackageError(self.source, f"{where}: {message}")

    def _found(self) -> str:
        text = repr(self.value)
        return text if len(text) <= 60 else text[:57] + "..."

    def _expect(self, what: str) -> PackageError:
        return self.fail(f"expected {what}, found {self._found()}")

    def get(self, key: str, optional: bool = False) -> Field:
        obj = self.obj()
        path = f"{self.key}.{key}" if self.key else key
        if key not in obj:
            if optional:
                return Field(None, path, self.source)
            raise self.fail(f"has no {key!r}")
        return Field(obj[key], path, self.source)

    def obj(self) -> dict:
        if not isinstance(self.value, dict):
            raise self._expect("an object")
        return self.value

    def only(self, keys: Iterable[str]) -> Field:
        """This object, refused if it has a key outside `keys`: the format is closed, so a
        field this tessel does not know is an error, never silently dropped."""
        keys = tuple(keys)
        unknown = sorted(set(self.obj()) - set(keys), key=str)
        if unknown:
            raise self.fail(f"unknown key {unknown[0]!r}; known: {', '.join(sorted(keys))}")
        return self

    def items(self) -> Iterator[tuple[str, Field]]:
        for k, v in self.obj().items():
            yield k, Field(v, f"{self.key}[{k!r}]", self.source)

    def list(self) -> list[Field]:
        if not isinstance(self.value, (list, tuple)):  # tuples: a manifest built in memory
            raise self._expect("a list")
        return [Field(v, f"{self.key}[{i}]", self.source) for i, v in enumerate(self.value)]

    def str(self, choices: Iterable[str] | None = None) -> str:
        if not isinstance(self.value, str):
            raise self._expect("a string")
        if choices is not None:
            allowed = tuple(choices)
            if self.value not in allowed:
                raise self.fail(f"found {self._found()}; allowed: {', '.join(allowed)}")
        return self.value

    def int(self, low: int | None = 0, high: int | None = None) -> int:
        # bool is an int in Python but never a count or an index in a manifest
        if not isinstance(self.value, int) or isinstance(self.value, bool):
            raise self._expect("an integer")
        if low is not None and self.value < low:
            raise self.fail(f"found {self.value}; the least allowed is {low}")
        if high is not None and self.value > high:
            raise self.fail(f"found {self.value}; the most allowed is {high}")
        return self.value

    def flag(self) -> bool:
        if not isinstance(self.value, bool):
            raise self._expect("true or false")
        return self.value

    def number(self) -> float:
        ok = isinstance(self.value, (int, float)) and not isinstance(self.value, bool)
        if not ok or not math.isfinite(self.value):
            raise self._expect("a finite number")
        return float(self.value)

    # builtins.str: in this class body `str` names the method above
    def member(self, members: frozenset[builtins.str]) -> builtins.str:
        name = self.str()
        if not valid_member_name(name):
            raise self.fail(f"{name!r} is not a valid member name")
        if name not in members:
            raise self.fail(f"names the member {name!r}, which the package does not hold")
        return name

    def optional(self, read: Callable[[Field], Any]) -> Any:
        return None if self.value is None else read(self)
