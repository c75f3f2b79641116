"""The CPU workers' block cache (`cpu_cache.cpp`): a torch CPU allocator that reuses the memory
of large freed blocks, never holding more than its high-water mark of memory in use.

A worker that returns every large block when it is freed holds exactly what its program does,
but faults in and zeroes fresh pages for every activation of every step; glibc's own policy
reuses them but fragments its heap, holding up to twice as much. The cache gets both: a step
asks for the same sizes every time, so its memory comes back (kept as ranges of addresses that
a request of any size is cut from and a freed block joins), and its bound keeps the total at
the program's own peak.

torch exposes no CPU allocator hook to Python, so the cache is a small C++ library against
torch's c10, compiled on first use (`tessel.runtime.native`). Without a compiler, workers fall
back to returning each block, and a warning says so once.
"""

from __future__ import annotations

import ctypes
import functools
import logging

from tessel.runtime import native

log = logging.getLogger(__name__)

STATS = ("used_bytes", "kept_bytes", "bound_bytes", "hits", "misses", "dropped", "joins")


@functools.cache
def library() -> str | None:
    """The compiled cache for this torch, built on first use; None (with a warning, once) where
    it cannot be built: not Linux, no C++ compiler, or no torch headers."""
    return native.load(
        "cpu_cache",
        "tessel_cpu_cache_stats",
        against_torch=True,
        log=log,
        without="CPU workers run without their block cache; each step then maps fresh memory "
        "for its activations, which is slower",
    )


_installed: ctypes.CDLL | None = None


def install(path: str) -> None:
    """Make the cache at `path` this process's CPU allocator (before its large tensors are
    made: blocks allocated earlier are freed by the allocator that made them)."""
    global _installed
    _installed = ctypes.CDLL(path)
    _installed.tessel_install_cpu_cache()


def release() -> None:
    """Return the installed cache's kept blocks to the system, and bound it by what is in use
    now (a model was unloaded: the next one's peak is its own)."""
    if _installed is not None:
        _installed.tessel_release_cpu_cache()


def counts() -> dict[str, int]:
    """The installed cache's counts in this process, as `cpu_cache_<name>`: bytes in use, kept,
    and the bound, and how many requests a kept range served (hits), fresh blocks served
    (misses), kept ranges (or parts) were dropped to keep the bound, and requests were served
    by joining the pages of several kept ranges (joins). Empty where no cache is installed."""
    if _installed is None:
        return {}
    out = (ctypes.c_size_t * len(STATS))()
    _installed.tessel_cpu_cache_stats(out)
    return {f"cpu_cache_{name}": value for name, value in zip(STATS, out)}
