"""Typed, range-checked access to parsed JSON, shared by every input format tessel reads.

Each read checks the type (an integer is a JSON integer: not a boolean, a float or a string of
digits), the range and, for strings, that they hold no NUL or control characters. Each object
refuses keys it does not know and suggests the closest known one. Every error names the file, the
key path (`cluster[0].cluster_nodes[1].port`), what was found and what is allowed, on one line.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any, overload

from tessel.config.errors import ConfigError

# The largest id (node, item, device, stage, plane, rank): CANN and MindSpore store ids as int32.
MAX_ID = 2**31 - 1
# The longest string tessel reads (a path is at most PATH_MAX bytes on Linux).
MAX_STRING = 4096

ErrorFactory = Callable[[Any, "str | None", str], ConfigError]

_MISSING: Any = object()
_TYPE_NAMES = {
    bool: "a boolean",
    int: "an integer",
    str: "a string",
    list: "a list",
    dict: "an object",
}
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.\-/:@~+]+")
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def key_text(key: str) -> str:
    """A key as it appears in a key path: plain names as they are, anything else quoted, so a
    path never spans lines or hides characters."""
    return key if _PLAIN_KEY.fullmatch(key) else repr(key)


def describe(value: Any) -> str:
    """What was found, for an error message: its JSON type and a short rendering of it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int):
        text = str(value) if value.bit_length() < 200 else f"an integer of {len(str(value))} digits"
        return f"number {text}"
    if isinstance(value, float):
        return f"number {value!r}"
    if isinstance(value, str):
        text = repr(value)
        return f"string {text if len(text) <= 60 else text[:50] + '...' + text[-6:]}"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return "an object"


def int_value(value: Any, lo: int, hi: int, fail: Callable[[str], Exception]) -> int:
    """`value` if it is a JSON integer in lo..hi; otherwise `fail(message)` is raised."""
    if type(value) is not int:
        raise fail(f"expected an integer in {lo}..{hi}, found {describe(value)}")
    if not lo <= value <= hi:
        raise fail(f"found {describe(value)}; allowed: {lo}..{hi}")
    return value


def str_value(value: Any, fail: Callable[[str], Exception]) -> str:
    """`value` if it is a non-empty string without NUL or control characters or surrounding
    spaces, at most MAX_STRING long."""
    if not isinstance(value, str):
        raise fail(f"expected a string, found {describe(value)}")
    if not value.strip():
        raise fail(f"expected a non-empty string, found {describe(value)}")
    if value != value.strip():
        # Names are matched exactly against each other: a stray space is always a mistake.
        raise fail(f"found {describe(value)}; leading or trailing spaces are not allowed")
    if _CONTROL.search(value):
        raise fail(f"found {describe(value)}; control characters (such as NUL) are not allowed")
    if len(value) > MAX_STRING:
        raise fail(f"found a string of {len(value)} characters; at most {MAX_STRING} allowed")
    return value


def is_ip(text: str, network: bool = False) -> bool:
    """Whether `text` is an IPv4/IPv6 address (or, with `network`, a subnet like 10.0.0.0/24)."""
    try:
        if network and "/" in text:
            ipaddress.ip_network(text, strict=False)
        else:
            ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def is_hostname(text: str) -> bool:
    """Whether `text` is a DNS host name (RFC 1123). A dotted name whose last label is all digits
    is a malformed IPv4 address, not a host name."""
    labels = text[:-1].split(".") if text.endswith(".") else text.split(".")
    return (
        0 < len(text) <= 253
        and all(_HOST_LABEL.fullmatch(label) for label in labels)
        and not labels[-1].isdigit()
    )


def suggest(key: str, known: Iterable[str]) -> str:
    """`"did you mean 'x'? "` for the closest known key, or nothing when none is close."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


class Fields:
    """A JSON object at `key_path` inside `source`; its readers raise `error(source, key, message)`
    (ConfigError, or the format's own subclass)."""

    def __init__(
        self,
        obj: Any,
        source: str | Path | None,
        key_path: str = "",
        error: ErrorFactory = ConfigError,
    ) -> None:
        self.source = source
        self.key_path = key_path
        self.make_error = error
        if not isinstance(obj, dict):
            raise self.error(f"expected an object, found {describe(obj)}")
        self.obj = obj

    def path(self, key: str | int) -> str:
        """The key path of `key` (a member name or a list index) below this object."""
        if isinstance(key, int):
            return f"{self.key_path}[{key}]"
        return f"{self.key_path}.{key_text(key)}" if self.key_path else key_text(key)

    def error(self, message: str, key: str | int | None = None) -> ConfigError:
        where = self.path(key) if key is not None else self.key_path or None
        return self.make_error(self.source, where, message)

    def error_at(self, path: str) -> Callable[[str], ConfigError]:
        """A `fail(message)` for a value at `path` (a full key path, e.g. `links[2][1]`)."""
        return lambda message: self.make_error(self.source, path, message)

    def at(self, obj: Any, key: str | int, index: int | None = None) -> Fields:
        """The object `obj` found at `key` (and `[index]` in the list there) below this one."""
        path = self.path(key) + (f"[{index}]" if index is not None else "")
        return Fields(obj, self.source, path, self.make_error)

    def has(self, key: str) -> bool:
        return key in self.obj

    def get(self, key: str, kind: type, default: Any = _MISSING) -> Any:
        """The value of `key`, of JSON type `kind`; `default` when absent (required without)."""
        if key not in self.obj:
            if default is _MISSING:
                raise self.error(f"required key is missing (expected {_TYPE_NAMES[kind]})", key)
            return default
        value = self.obj[key]
        if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
            raise self.error(f"expected {_TYPE_NAMES[kind]}, found {describe(value)}", key)
        return value

    def integer(self, key: str, lo: int = 0, hi: int = MAX_ID, default: Any = _MISSING) -> Any:
        """An integer in lo..hi (ids default to 0..MAX_ID)."""
        if key not in self.obj:
            return self.get(key, int, default)
        return int_value(self.obj[key], lo, hi, self.error_at(self.path(key)))

    def boolean(self, key: str, default: Any = _MISSING) -> Any:
        return self.get(key, bool, default)

    def string(
        self,
        key: str,
        default: Any = _MISSING,
        choices: Collection[str] | None = None,
        pattern: re.Pattern[str] | None = None,
        example: str = "",
    ) -> Any:
        """A non-empty string without control characters; one of `choices` (compared without
        case) or matching `pattern` when given. `example` shows a valid value in errors."""
        if key not in self.obj:
            return self.get(key, str, default)
        fail = self.error_at(self.path(key))
        value = str_value(self.obj[key], fail)
        if choices is not None and value.casefold() not in {c.casefold() for c in choices}:
            raise fail(
                f"found {describe(value)}; {suggest(value, choices)}"
                f"allowed: {', '.join(repr(c) for c in choices)}"
            )
        if pattern is not None and not pattern.fullmatch(value):
            raise fail(f"found {describe(value)}; expected a value like {example!r}")
        return value

    @overload
    def child(self, key: str) -> Fields: ...
    @overload
    def child(self, key: str, default: None) -> Fields | None: ...

    def child(self, key: str, default: Any = _MISSING) -> Fields | None:
        """The object at `key`; without `default` it is required, with None it is optional."""
        value = self.get(key, dict, default)
        return None if value is None else self.at(value, key)

    def children(self, key: str, default: Any = _MISSING, nonempty: bool = False) -> list[Fields]:
        """The objects of the list at `key` (with `nonempty`, at least one)."""
        items = self.get(key, list, default)
        if items is None:
            return []
        if nonempty and not items:
            raise self.error("expected at least one entry in the list, found none", key)
        return [self.at(v, key, i) for i, v in enumerate(items)]

    def int_list(
        self,
        key: str,
        lo: int = 0,
        hi: int = MAX_ID,
        default: Any = _MISSING,
        min_len: int = 0,
        unique: bool = False,
    ) -> Any:
        """A list of integers in lo..hi; with `unique`, no value twice."""
        items = self.get(key, list, default)
        if key not in self.obj:
            return items
        if len(items) < min_len:
            raise self.error(f"expected at least {min_len} entries, found {len(items)}", key)
        path = self.path(key)
        out = [int_value(v, lo, hi, self.error_at(f"{path}[{i}]")) for i, v in enumerate(items)]
        if unique:
            dup = next((v for i, v in enumerate(out) if v in out[:i]), None)
            if dup is not None:
                raise self.error(f"lists {dup} twice; each value may appear once", key)
        return out

    def check_keys(self, allowed: Collection[str], not_built: dict[str, str] | None = None) -> None:
        """Refuse keys outside `allowed`, naming the closest allowed key; keys in `not_built`
        are refused with their own message."""
        for key in self.obj:
            if not_built and key in not_built:
                raise self.error(not_built[key], key)
            if key not in allowed:
                raise self.error(
                    f"unknown key; {suggest(key, allowed)}"
                    f"allowed keys here: {', '.join(sorted(allowed))}",
                    key,
                )


class Unique:
    """Remembers values and where they were seen, to refuse a second occurrence of one."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.seen: dict[Any, str] = {}

    def add(self, value: Any, fields: Fields, key: str | int | None) -> None:
        """Record `value` found at `key` of `fields` (None: implied by the object itself)."""
        where = fields.path(key) if key is not None else fields.key_path
        if value in self.seen:
            raise fields.error(
                f"{self.what} {value!r} appears twice (first at {self.seen[value]}); "
                "each must be unique",
                key,
            )
        self.seen[value] = where
