"""The CPU workers' block cache (`cpu_cache.cpp`): a torch CPU allocator that reuses large
freed blocks by size, never holding more than its high-water mark of blocks in use.

A worker that returns every large block when it is freed holds exactly what its program does,
but faults in and zeroes fresh pages for every activation of every step; glibc's own policy
reuses them but fragments its heap, holding up to twice as much. The cache gets both: a step
asks for the same sizes every time, so its blocks come back, and its bound keeps the total at
the program's own peak.

torch exposes no CPU allocator hook to Python, so the cache is a small C++ library against
torch's c10, compiled with the system's C++ compiler on first use and kept in the user's cache
directory (`TESSEL_CACHE_DIR`, or `$XDG_CACHE_HOME/tessel`) with its SHA-256 beside it; a
library that no longer matches its digest is built again before anything maps it. Without a
compiler, workers fall back to returning each block, and a warning says so once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tessel.atomic import replace_atomically

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_cache.cpp")
STATS = ("used_bytes", "kept_bytes", "bound_bytes", "hits", "misses", "dropped")


def cache_dir() -> Path:
    """Where compiled libraries are kept between runs."""
    if os.environ.get("TESSEL_CACHE_DIR"):
        return Path(os.environ["TESSEL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tessel"


@functools.cache
def library() -> str | None:
    """The compiled cache for this torch, built on first use; None (with a warning, once) where
    it cannot be built: not Linux, no C++ compiler, or no torch headers."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        path = _build()
        ctypes.CDLL(str(path)).tessel_cpu_cache_stats  # noqa: B018 - it links and has its symbols
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        log.warning(
            "tessel: CPU workers run without their block cache (%s); each step then maps "
            "fresh memory for its activations, which is slower. Install a C++ compiler (or set "
            "CXX) to build it.",
            _reason(exc),
        )
        return None
    return str(path)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        stderr = (exc.stderr or b"").decode(errors="replace").strip().splitlines()
        return f"{exc.cmd[0]} failed: {stderr[-1] if stderr else f'exit {exc.returncode}'}"
    return str(exc)


def _build() -> Path:
    # $CXX may carry a launcher or flags ("ccache g++"), as make's does
    compiler = shlex.split(os.environ.get("CXX", ""))
    if not compiler:
        found = shutil.which("c++") or shutil.which("g++")
        if found is None:
            raise OSError("no C++ compiler found (c++, g++ or $CXX)")
        compiler = [found]
    root = Path(torch.__file__).parent
    if not (root / "include" / "c10" / "core" / "Allocator.h").exists():
        raise OSError(f"torch at {root} has no C++ headers")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, torch.__version__.encode(), *map(str.encode, compiler), bytes(root)])
    ).hexdigest()[:16]
    target = cache_dir() / f"cpu_cache-{key}.so"
    digest = target.with_name(target.name + ".sha256")
    if target.exists():
        if digest.exists() and digest.read_text().strip() == _sha256(target):
            return target
        # a library that is not the one built here (corrupt, truncated, replaced) would kill
        # the process that maps it: it is built again
        log.warning(
            "tessel: %s does not match the digest kept beside it; building it again", target
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    # built under a temporary name and published in one step: sessions may build at once
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=".cpu_cache-", suffix=".so")
    os.close(fd)
    try:
        subprocess.run(
            [
                *compiler,
                "-O2",
                "-shared",
                "-fPIC",
                "-std=c++17",
                f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
                f"-I{root / 'include'}",
                str(SOURCE),
                f"-L{root / 'lib'}",
                "-lc10",
                f"-Wl,-rpath,{root / 'lib'}",
                "-o",
                partial,
            ],
            check=True,
            capture_output=True,
            timeout=300,
        )
        with replace_atomically(digest) as tmp:
            tmp.write_text(_sha256(Path(partial)))
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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
    and the bound, and how many requests kept blocks served (hits), fresh blocks served
    (misses), and blocks dropped to keep the bound. Empty where no cache is installed."""
    if _installed is None:
        return {}
    out = (ctypes.c_size_t * len(STATS))()
    _installed.tessel_cpu_cache_stats(out)
    return {f"cpu_cache_{name}": value for name, value in zip(STATS, out)}
