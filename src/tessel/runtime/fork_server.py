"""Where a session's workers come from: forked from one server process that imported torch and
the worker's code once, instead of each worker starting an interpreter and importing torch on
its own (about 3 s of CPU a worker, most of a small session's start).

The server is multiprocessing's fork server, started by the first session that needs workers
with `tessel.runtime.worker` preloaded. It runs no torch operator, so it holds no thread a fork
could lose, and it exits with this process or at `tessel.finalize()`. A worker forked from it
starts as a spawned one does: it imports the main script again (the same guard applies), takes
this process's environment as it is when the worker starts (`WorkerSpec.environ`: the server's
own is the one it started with), and dies with its parent, which dies with this process.
Workers are spawned where there is no fork server (Windows), and in a process forked from one
that started the server (a DataFlow node's): the server is its parent's, not its to use.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing import forkserver
from multiprocessing.context import BaseContext

_PRELOAD = ["tessel.runtime.worker"]
_owner: int | None = None  # the process that uses the fork server


def worker_context() -> BaseContext:
    """The multiprocessing context a session starts its workers with."""
    global _owner
    if "forkserver" not in mp.get_all_start_methods() or _owner not in (None, os.getpid()):
        return mp.get_context("spawn")
    _owner = os.getpid()
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def stop_fork_server() -> None:
    """Stop the fork server, if this process runs one; the next session starts it again. Every
    worker forked from it dies with it, so only call this once no session holds workers."""
    if _owner != os.getpid():
        return
    # CPython's fork server has a stop method but no public name for it
    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()
