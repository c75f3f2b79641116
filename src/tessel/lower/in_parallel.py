"""Lower several ranks at once, on the cores the build may use.

Tracing a rank's program is single-threaded Python, and the ranks a build traces are
independent of one another, so on Linux each rank past the first is traced in a forked child
(copy-on-write: it sees the captured model and the plan without copying them) while this
process traces the first. A child hands its program back through a safetensors file: tensors
and JSON, nothing that runs code. A child that fails is not trusted to say why: its rank is
traced again here, so the error raised is the one a serial build raises.

A forked child holds only the thread that forked it (`tessel.forked`), so children are forked
only from a process with no other Python thread; one that still does not finish long after this
process traced its own rank is stopped and its rank traced here. Every child is reaped before
`lower_ranks` returns or raises.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tessel.forked import Child
from tessel.lower.outputs import OutputLayout
from tessel.lower.trace import RankProgram

log = logging.getLogger(__name__)

# how long a child may take beyond this process's own trace, as a multiple of it plus a floor
PATIENCE_FACTOR, PATIENCE_FLOOR_S = 4.0, 60.0


def lower_ranks(lower: Callable[[int], RankProgram], ranks: Sequence[int]) -> list[RankProgram]:
    """`lower(rank)` for every rank, in order; ranks past the first in forked children, as
    many at a time as there are spare cores."""
    ranks = list(ranks)
    spare = _spare_cores()
    if spare == 0 or len(ranks) < 2:
        return [lower(r) for r in ranks]
    done: dict[int, RankProgram | None] = {}
    running: list[tuple[Child, int, str]] = []  # (child, rank, file), oldest first
    waiting = ranks[1:]
    try:
        while waiting and len(running) < spare:
            running.append(_start(lower, waiting.pop(0)))
        start = time.perf_counter()
        done[ranks[0]] = lower(ranks[0])
        patience = PATIENCE_FLOOR_S + PATIENCE_FACTOR * (time.perf_counter() - start)
        while running:
            child, rank, path = running.pop(0)
            done[rank] = _finish(child, rank, path, patience)
            if waiting:
                running.append(_start(lower, waiting.pop(0)))
    finally:
        for child, _, path in running:
            _stop(child, path)
    return [done.get(r) or lower(r) for r in ranks]


def _spare_cores() -> int:
    """Cores beyond this process's own, where forking is safe: on Linux, from a process whose
    only Python thread is this one (another thread may hold a lock the child then waits on for
    ever: DTensor's sharding cache, a stream's buffer)."""
    if not sys.platform.startswith("linux") or threading.active_count() > 1:
        return 0
    return len(os.sched_getaffinity(0)) - 1


def _start(lower: Callable[[int], RankProgram], rank: int) -> tuple[Child, int, str]:
    fd, path = tempfile.mkstemp(prefix=f"tessel-rank{rank}-", suffix=".safetensors")
    os.close(fd)
    return Child(lambda: _write(lower(rank), path)), rank, path


def _finish(child: Child, rank: int, path: str, patience: float) -> RankProgram | None:
    """The child's program, once it has exited; None if it failed or took `patience` seconds
    more (it is then stopped)."""
    exit_code = child.wait(patience)
    if exit_code is None:
        log.warning("rank %d: its forked trace did not finish; tracing it here", rank)
        _stop(child, path)
        return None
    try:
        return _read(path) if exit_code == 0 else None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _stop(child: Child, path: str) -> None:
    child.stop()
    with contextlib.suppress(OSError):
        os.unlink(path)


def _write(program: RankProgram, path: str) -> None:
    tensors = {k: v.detach().contiguous().clone() for k, v in program.constants.items()}
    about = {
        "program": program.program,
        "shapes": program.shapes,
        "weight_bytes": program.weight_bytes,
        "peak_bytes": program.peak_bytes,
        "output_layouts": None
        if program.output_layouts is None
        else [x if x is None else x.to_json() for x in program.output_layouts],
    }
    save_file(tensors, path, metadata={"rank_program": json.dumps(about)})


def _read(path: str) -> RankProgram:
    with safe_open(path, "pt") as f:
        about = json.loads(f.metadata()["rank_program"])
    return RankProgram(
        about["program"],
        load_file(path),
        {k: tuple(v) for k, v in about["shapes"].items()},
        about["weight_bytes"],
        about["peak_bytes"],
        None
        if about.get("output_layouts") is None
        else [x if x is None else OutputLayout.from_json(x) for x in about["output_layouts"]],
    )
