"""Work run in a forked child of this process.

A forked child sees this process's memory as it was (copy-on-write): a model, a captured graph,
a plan, a user's classes defined anywhere (inside a function, in `__main__`, in a notebook),
with nothing pickled and no script imported again. It holds only the thread that forked it, so
it runs torch on one thread (an OpenMP team the parent had would wait for ever for threads the
child does not have), leaves Ctrl-C to the parent, dies with the parent, and leaves by
`os._exit` (the parent's exit handlers and open connections are not its to run or close). The
work reports back through files; the parent reaps the child on every path, errors and Ctrl-C
included (`Child` as a context manager).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
from collections.abc import Callable
from types import TracebackType

import torch

_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """Have the kernel send `signum` to this process when its parent dies, so a child never
    outlives a parent that was killed outright (Linux's PR_SET_PDEATHSIG). Elsewhere, or where
    libc cannot be loaded, nothing is set: a caller that must not outlive its parent there also
    watches `os.getppid()`. The signal follows the parent's thread that started this process:
    it comes when that thread ends, not only when the whole parent does."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signum)


class Child:
    """`work()` running in a forked child (see the module docstring). Its exit status is 0
    if `work` returned, 1 if it raised."""

    def __init__(self, work: Callable[[], None]) -> None:
        self.pid = os.fork()
        if self.pid == 0:
            status = 1
            try:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                torch.set_num_threads(1)
                die_with_parent()
                work()
                status = 0
            finally:
                os._exit(status)
        self.exit_code: int | None = None

    def wait(self, timeout: float | None = None) -> int | None:
        """The child's exit code once it has exited (minus the signal that ended it), or None
        if it is still running after `timeout` seconds (None: wait as long as it runs)."""
        if self.exit_code is None:
            exited = os.pidfd_open(self.pid)
            try:
                ready, _, _ = select.select([exited], [], [], timeout)
            finally:
                os.close(exited)
            if not ready:
                return None
            _, status = os.waitpid(self.pid, 0)
            self.exit_code = os.waitstatus_to_exitcode(status)
        return self.exit_code

    def stop(self) -> None:
        """Kill the child if it is still running, and reap it."""
        if self.exit_code is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            _, status = os.waitpid(self.pid, 0)
            self.exit_code = os.waitstatus_to_exitcode(status)
        if self.exit_code is None:
            self.exit_code = -signal.SIGKILL

    def __enter__(self) -> Child:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()


def signal_name(number: int) -> str:
    """A signal's name (`SIGKILL`), or its number where this platform has no name for it."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def ended_how(exit_code: int) -> str:
    """How a child with `exit_code` ended, in words."""
    if exit_code < 0:
        return f"was killed by {signal_name(-exit_code)}"
    return f"exited with status {exit_code}"
