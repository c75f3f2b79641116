"""The one error type for bad input files and arguments."""

from __future__ import annotations

from pathlib import Path

from tessel.errors import TesselError


class ConfigError(TesselError, ValueError):
    """Bad input: names the file (or argument), the key path, what was found and what is allowed."""

    def __init__(self, source: str | Path | None, key: str | None, message: str) -> None:
        self.source = str(source) if source is not None else None
        self.key = key
        self.detail = message
        where = ": ".join(part for part in (self.source, key) if part)
        super().__init__(f"{where}: {message}" if where else message)
