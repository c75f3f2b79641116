"""forked.die_with_parent: the signal the kernel sends a child when its parent dies."""

from __future__ import annotations

import ctypes
import signal
import sys

import pytest

from tessel.forked import Child, die_with_parent

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's"
)

_PR_GET_PDEATHSIG = 2


def _death_signal() -> int:
    """This process's parent-death signal as the kernel holds it (0: none)."""
    out = ctypes.c_int(-1)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(_PR_GET_PDEATHSIG, ctypes.byref(out)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_GET_PDEATHSIG) failed")
    return out.value


@pytest.mark.parametrize("signum", [None, signal.SIGTERM])
def test_a_child_gets_the_signal_asked_for(tmp_path, signum):
    """A forked child dies by SIGKILL with its parent; a caller may ask for another signal."""
    seen = tmp_path / "signal"

    def work() -> None:
        if signum is not None:
            die_with_parent(signum)
        seen.write_text(str(_death_signal()))

    with Child(work) as child:
        assert child.wait() == 0
    assert int(seen.read_text()) == (signal.SIGKILL if signum is None else signum)


def test_nothing_is_set_off_linux(tmp_path):
    """Elsewhere the kernel is not asked: the signal the child had stays."""
    seen = tmp_path / "signal"

    def work() -> None:
        sys.platform = "darwin"
        die_with_parent(signal.SIGTERM)
        seen.write_text(str(_death_signal()))

    with Child(work) as child:
        assert child.wait() == 0
    assert int(seen.read_text()) == signal.SIGKILL
