"""What tessel is doing while it works: one line per long phase, on a terminal only.

A phase shows `tessel: <what> ...` on standard error while it runs and its time when it ends,
so a build, a session's start or a conversion never sits silent for seconds. Nothing shows
when standard error is not a terminal (logs, pipes, CI), at `--log=error` or quieter, or for a
phase inside another one.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator

_open = 0  # phases running in this process; only the outermost shows


def showing() -> bool:
    """Whether phases show: standard error is a terminal and tessel logs warnings."""
    try:
        terminal = sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False
    return terminal and logging.getLogger("tessel").isEnabledFor(logging.WARNING)


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    """Show `what` while the block runs, then how long it took (or that it failed)."""
    global _open
    show = _open == 0 and showing()
    _open += 1
    start = time.perf_counter()
    if show:
        sys.stderr.write(f"tessel: {what} ...")
        sys.stderr.flush()
    done = False
    try:
        yield
        done = True
    finally:
        _open -= 1
        if show:
            seconds = time.perf_counter() - start
            end = f"{seconds:.1f} s" if done else f"stopped after {seconds:.1f} s"
            sys.stderr.write(f"\r\x1b[Ktessel: {what}: {end}\n")
            sys.stderr.flush()
