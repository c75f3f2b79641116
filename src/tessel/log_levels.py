"""The `--log` levels the command line and the build options accept (no torch needed)."""

from __future__ import annotations

import logging

from tessel.config.errors import ConfigError

LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "null": None,
}


def log_level(value: str, source: str = "--log") -> int | None:
    """The logging level `value` names (None: no logging); a `ConfigError` for other words."""
    if value not in LOG_LEVELS:
        raise ConfigError(source, None, f"found {value!r}; allowed: {'|'.join(LOG_LEVELS)}")
    return LOG_LEVELS[value]
