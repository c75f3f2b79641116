"""Typed access to parsed JSON with errors that name the file and the key path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tessel.config.errors import ConfigError

_MISSING = object()
_TYPE_NAMES = {
    bool: "a boolean",
    int: "an integer",
    str: "a string",
    list: "a list",
    dict: "an object",
}


class Fields:
    """A JSON object at `key_path` inside `source`."""

    def __init__(self, obj: Any, source: str | Path | None, key_path: str = "") -> None:
        self.source = source
        self.key_path = key_path
        if not isinstance(obj, dict):
            raise self.error(f"expected an object, found {_describe(obj)}")
        self.obj = obj

    def path(self, key: str | int) -> str:
        if isinstance(key, int):
            return f"{self.key_path}[{key}]"
        return f"{self.key_path}.{key}" if self.key_path else key

    def error(self, message: str, key: str | int | None = None) -> ConfigError:
        return ConfigError(
            self.source, self.path(key) if key is not None else self.key_path or None, message
        )

    def has(self, key: str) -> bool:
        return key in self.obj

    def get(self, key: str, kind: type, default: Any = _MISSING) -> Any:
        if key not in self.obj:
            if default is _MISSING:
                raise self.error(f"required key is missing (expected {_TYPE_NAMES[kind]})", key)
            return default
        value = self.obj[key]
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            raise self.error(f"expected {_TYPE_NAMES[kind]}, found {_describe(value)}", key)
        return value

    def child(self, key: str, default: Any = _MISSING) -> Fields | None:
        value = self.get(key, dict, default)
        return None if value is None else Fields(value, self.source, self.path(key))

    def children(self, key: str, default: Any = _MISSING) -> list[Fields]:
        items = self.get(key, list, default)
        if items is None:
            return []
        return [Fields(v, self.source, f"{self.path(key)}[{i}]") for i, v in enumerate(items)]

    def check_keys(self, allowed: set[str], not_built: dict[str, str] | None = None) -> None:
        for key in self.obj:
            if not_built and key in not_built:
                raise self.error(not_built[key], key)
            if key not in allowed:
                raise self.error(
                    f"unknown key; allowed keys here: {', '.join(sorted(allowed))}", key
                )


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"number {value}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, list):
        return "a list"
    return "an object"
