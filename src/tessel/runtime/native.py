"""The CPU workers' small native libraries, compiled from the C++ sources beside this file with
the system's C++ compiler on first use.

Each is kept in the user's cache directory (`TESSEL_CACHE_DIR`, or `$XDG_CACHE_HOME/tessel`)
under a name keyed by its source, the compiler and torch, with its SHA-256 beside it; a library
that no longer matches its digest is built again before anything maps it. Sessions may build at
once: a library is built under a temporary name and published in one step.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from tessel.atomic import replace_atomically

HERE = Path(__file__).parent


def cache_dir() -> Path:
    """Where compiled libraries are kept between runs."""
    if os.environ.get("TESSEL_CACHE_DIR"):
        return Path(os.environ["TESSEL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tessel"


def build(name: str, *, against_torch: bool, log: logging.Logger) -> Path:
    """The compiled `<name>.cpp`, built now where no good copy is cached; raises OSError or
    SubprocessError where it cannot be built. `against_torch` compiles against torch's headers
    and links its c10; without it the library depends on the C++ runtime only."""
    compiler = _compiler()
    source = HERE / f"{name}.cpp"
    flags = ["-O2", "-shared", "-fPIC", "-std=c++17"]
    root = Path(torch.__file__).parent
    if against_torch:
        if not (root / "include" / "c10" / "core" / "Allocator.h").exists():
            raise OSError(f"torch at {root} has no C++ headers")
        flags += [
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
            f"-I{root / 'include'}",
        ]
    links = [f"-L{root / 'lib'}", "-lc10", f"-Wl,-rpath,{root / 'lib'}"] if against_torch else []
    key = hashlib.sha256(
        b"\0".join([source.read_bytes(), torch.__version__.encode(), *map(str.encode, compiler)])
        + (bytes(root) if against_torch else b"")
    ).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    digest = target.with_name(target.name + ".sha256")
    if target.exists():
        if digest.exists() and digest.read_text().strip() == _sha256(target):
            return target
        # a library that is not the one built here (corrupt, truncated, replaced) would kill
        # the process that maps it: it is built again
        log.warning(
            "tessel: %s does not match the digest kept beside it; building it again", target
        )
    with replace_atomically(target, suffix=".so") as partial:
        subprocess.run(
            [*compiler, *flags, str(source), *links, "-o", str(partial)],
            check=True,
            capture_output=True,
            timeout=300,
        )
        with replace_atomically(digest) as tmp:
            tmp.write_text(_sha256(partial))
    return target


def load(
    name: str, symbol: str, *, against_torch: bool, log: logging.Logger, without: str
) -> str | None:
    """The path of the compiled `<name>.cpp`, checked to link and export `symbol`; None, with
    a warning that names the cause and then says `without` (what runs instead), where it cannot
    be built: not Linux, no C++ compiler, or no torch headers."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        path = build(name, against_torch=against_torch, log=log)
        getattr(ctypes.CDLL(str(path)), symbol)
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        log.warning(
            "tessel: %s (%s). Install a C++ compiler (or set CXX) to build it.",
            without,
            reason(exc),
        )
        return None
    return str(path)


def reason(exc: BaseException) -> str:
    """Why a build failed, in one line."""
    if isinstance(exc, subprocess.CalledProcessError):
        stderr = (exc.stderr or b"").decode(errors="replace").strip().splitlines()
        return f"{exc.cmd[0]} failed: {stderr[-1] if stderr else f'exit {exc.returncode}'}"
    return str(exc)


def _compiler() -> list[str]:
    # $CXX may carry a launcher or flags ("ccache g++"), as make's does
    compiler = shlex.split(os.environ.get("CXX", ""))
    if compiler:
        return compiler
    found = shutil.which("c++") or shutil.which("g++")
    if found is None:
        raise OSError("no C++ compiler found (c++, g++ or $CXX)")
    return [found]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
