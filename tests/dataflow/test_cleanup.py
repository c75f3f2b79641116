"""No worker outlives its program: on Ctrl-C (atexit finalize) or when the parent is killed."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from tests.conftest import ctrl_c_as_in_a_terminal, signal_state

SCRIPT = textwrap.dedent(
    """
    import time
    import tessel.dataflow as df

    @df.pyflow
    def ident(x):
        return x

    df.init({})
    x = df.FlowData()
    g = df.FlowGraph([ident.fnode()(ident.fnode()(x))])
    g.feed({x: 1})
    g.fetch()
    print(" ".join(map(str, g.worker_pids())), flush=True)
    time.sleep(120)
    """
)


def _gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    left = pids
    while time.monotonic() < deadline:
        left = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not left:
            return []
        time.sleep(0.1)
    return left


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill"])
def test_workers_end_with_their_program(tmp_path, sig):
    script = tmp_path / "prog.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_as_in_a_terminal,
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        state = signal_state(proc.pid)  # SIGINT is bit 2 (0x2): neither blocked nor ignored
        proc.send_signal(sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no exit 30 s after {sig!r}; its signal state: {state}") from None
        assert _gone(pids) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
