"""Lower several ranks at once, on the cores the build may use.

Tracing a rank's program is single-threaded Python, and the ranks a build traces are
independent of one another, so on Linux each rank past the first is traced in a forked child
(copy-on-write: it sees the captured model and the plan without copying them) while this
process traces the first. A child hands its program back through a safetensors file: tensors
and JSON, nothing that runs code. A child that fails is not trusted to say why: its rank is
traced again here, so the error raised is the one a serial build raises. Children die with
this process, and every one is reaped before `lower_ranks` returns or raises.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence

from safetensors.torch import load_file, save_file

from tessel.lower.trace import RankProgram


def lower_ranks(lower: Callable[[int], RankProgram], ranks: Sequence[int]) -> list[RankProgram]:
    """`lower(rank)` for every rank, in order; ranks past the first in forked children, as
    many at a time as there are spare cores."""
    ranks = list(ranks)
    spare = _spare_cores()
    if spare == 0 or len(ranks) < 2:
        return [lower(r) for r in ranks]
    done: dict[int, RankProgram | None] = {}
    running: list[tuple[int, int, str]] = []  # (pid, rank, file), oldest first
    waiting = ranks[1:]
    try:
        while waiting and len(running) < spare:
            running.append(_start(lower, waiting.pop(0)))
        done[ranks[0]] = lower(ranks[0])
        while running:
            pid, rank, path = running.pop(0)
            done[rank] = _finish(pid, path)
            if waiting:
                running.append(_start(lower, waiting.pop(0)))
    finally:
        for pid, _, path in running:
            _stop(pid, path)
    return [done[r] if done.get(r) is not None else lower(r) for r in ranks]


def _spare_cores() -> int:
    """Cores beyond this process's own, where forking is safe: Linux, the main thread."""
    if (
        not sys.platform.startswith("linux")
        or threading.current_thread() is not threading.main_thread()
    ):
        return 0
    return len(os.sched_getaffinity(0)) - 1


def _start(lower: Callable[[int], RankProgram], rank: int) -> tuple[int, int, str]:
    fd, path = tempfile.mkstemp(prefix=f"tessel-rank{rank}-", suffix=".safetensors")
    os.close(fd)
    pid = os.fork()
    if pid == 0:  # the child: lower, write, and leave without running the parent's exit code
        status = 1
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PDEATHSIG
            _write(lower(rank), path)
            status = 0
        finally:
            os._exit(status)
    return pid, rank, path


def _finish(pid: int, path: str) -> RankProgram | None:
    """The child's program, once it has exited; None if it failed."""
    try:
        _, status = os.waitpid(pid, 0)
        return _read(path) if os.waitstatus_to_exitcode(status) == 0 else None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _stop(pid: int, path: str) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    with contextlib.suppress(OSError):
        os.unlink(path)


def _write(program: RankProgram, path: str) -> None:
    tensors = {k: v.detach().contiguous().clone() for k, v in program.constants.items()}
    about = {
        "program": program.program,
        "shapes": program.shapes,
        "weight_bytes": program.weight_bytes,
        "peak_bytes": program.peak_bytes,
    }
    save_file(tensors, path, metadata={"rank_program": json.dumps(about)})


def _read(path: str) -> RankProgram:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        about = json.loads(f.metadata()["rank_program"])
    return RankProgram(
        about["program"],
        load_file(path),
        {k: tuple(v) for k, v in about["shapes"].items()},
        about["weight_bytes"],
        about["peak_bytes"],
    )
