"""The base of every error tessel raises on purpose: bad input, a model that cannot be placed,
a package that cannot be used, a worker that failed. The CLI prints any of them as one line."""

from __future__ import annotations

from typing import Any


class TesselError(Exception):
    """An error tessel raises with a message meant for the user; never a bug in tessel.

    Every subclass pickles, whatever its constructor takes, so a worker process can send the
    error it raised: it is rebuilt from its class, its `args` and its attributes, without
    calling `__init__` again (Exception's own pickling calls `cls(*args)`, which fails for
    constructors such as `ConfigError(source, key, message)`).
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args, dict(vars(self)))


def _rebuild(cls: type[TesselError], args: tuple, state: dict[str, Any]) -> TesselError:
    """An error of class `cls` with these `args` and attributes (the inverse of `__reduce__`)."""
    error = cls.__new__(cls, *args)
    error.args = args
    vars(error).update(state)
    return error
