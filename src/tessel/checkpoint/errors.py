"""Error types of tessel.checkpoint, exported by tessel.parallel: all are ConfigError, so the
CLI prints them cleanly."""

from __future__ import annotations

from tessel.config.errors import ConfigError


class LayoutError(ConfigError):
    """A Layout or tensor map that breaks MindSpore's rules."""

    def __init__(self, key: str | None, message: str) -> None:
        super().__init__("Layout", key, message)


class LayoutTypeError(LayoutError, TypeError):
    """A Layout argument of the wrong type (also a TypeError, as in MindSpore)."""


class CheckpointError(ConfigError):
    """A checkpoint file or directory that is missing, corrupt or disagrees with its strategy."""


class StrategyError(ConfigError):
    """A strategy file that cannot be read or is inconsistent."""


class NotExpressibleError(ConfigError):
    """A sharding that the other representation (DTensor or Layout) cannot express."""
