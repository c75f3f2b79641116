"""The `--log` levels the command line and the build options accept (no torch needed)."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

from tessel.config.errors import ConfigError

LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "null": None,
}

# loggers whose records below an error are about tessel's choices: torch's internals, and
# transformers' note that a model's kernel falls back to its PyTorch code (the code tessel
# captures, whatever kernels are installed)
QUIET_LOGGERS = ("torch", "transformers.integrations.hub_kernels")


def log_level(value: str, source: str = "--log") -> int | None:
    """The logging level `value` names (None: no logging); a `ConfigError` for other words."""
    if value not in LOG_LEVELS:
        raise ConfigError(source, None, f"found {value!r}; allowed: {'|'.join(LOG_LEVELS)}")
    return LOG_LEVELS[value]


def keep_torch_quiet(level: int | None) -> None:
    """Below `debug`, torch's own log records and Python warnings stay out of the user's log.

    torch warns about its internals (gloo's missing all-to-all, sequential gathers over mesh
    axes) from every process that meets them; they are about tessel's choices, not the user's
    model, and tessel reports what matters in its own words. At `debug` they show as torch
    writes them. The same for the other `QUIET_LOGGERS`.
    """
    if level is not None and level <= logging.DEBUG:
        return
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for package in ("torch", "tessel"):
        warnings.filterwarnings("ignore", module=rf"{package}(\.|$)")
    # torch's own pytree deprecation, raised where a copy of an exported program reaches
    # copyreg (a module of Python's, so the filters above do not catch it)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)`")


@contextlib.contextmanager
def torch_kept_quiet() -> Iterator[None]:
    """`keep_torch_quiet` at tessel's own level for the length of a block (a build from
    Python), then the process's settings as they were."""
    saved = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    with warnings.catch_warnings():
        keep_torch_quiet(logging.getLogger("tessel").getEffectiveLevel())
        try:
            yield
        finally:
            for name, level in saved.items():
                logging.getLogger(name).setLevel(level)
