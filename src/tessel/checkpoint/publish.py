"""Publish checkpoint outputs so that a kill at any moment leaves the old output or the new one.

A tree (a destination directory) is built whole in a hidden sibling directory and then swapped
with the destination in one step: ``renameat2(RENAME_EXCHANGE)`` on Linux (``renamex_np`` with
``RENAME_SWAP`` on macOS) exchanges two directories atomically, so a reader, a crash or a
``kill -9`` sees either the complete old tree or the complete new one, and the destination stays
an ordinary directory. The new tree replaces the old one's checkpoint whole: of the old
destination's entries, those the new output does not hold are carried into the new tree first
(as hard links: no data is copied) only where their names are not a checkpoint's own
(``identity.is_checkpoint_name``: rank directories, strategy, shards, index, config), so a
tokenizer beside the checkpoint is kept and a stale ``rank_3`` of an older checkpoint is not.
The displaced old tree is deleted afterwards.

Where the file system cannot exchange two directories (NFS, many FUSE file systems), nothing can
replace a non-empty directory in one step: the old destination is renamed aside and the new one
renamed in. Between those two renames the destination is missing while the old tree lies
complete under a hidden name (``aside_copy`` finds it, so readers can say where); the next run
that writes this destination puts it back.

A single file is written under a temporary name in its own directory, synced, then renamed over
the target with ``os.replace``.

Hidden siblings are named ``.{name}.tessel-{kind}-{tag}``: ``new`` a tree being built (or, after
a killed swap, the displaced old tree), ``old`` a destination moved aside by the fallback, ``del``
a displaced tree being deleted, ``tmp`` a single file being written. A live run holds an
``flock`` on its own ``new``/``tmp`` entry, so the next run tells the leftovers of a killed run
(whose lock it can take) from the work of a live one and removes only those. Swapping, and
clearing leftovers, happen under an ``flock`` on the parent directory, so two runs never swap
one destination at the same time and a cleanup never sees a swap half done. A run that fails
(a full disk, an error, Ctrl-C) removes its own staging before it returns; a killed run's is
removed by the next run that writes the destination.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import stat
import sys
import time
import uuid
from collections.abc import Collection, Iterator
from pathlib import Path

from tessel.atomic import replace_atomically
from tessel.checkpoint.errors import CheckpointError
from tessel.checkpoint.identity import is_checkpoint_name

try:
    import fcntl
except ImportError:  # pragma: no cover - not a POSIX system: no locking
    fcntl = None  # type: ignore[assignment]

# Test hook: when TESSEL_TEST_PAUSE_AT names a point that a run reaches, the run creates the
# file TESSEL_TEST_PAUSE_MARKER and waits there forever, so a test can kill it at that moment.
PAUSE_ENV = "TESSEL_TEST_PAUSE_AT"
PAUSE_MARKER_ENV = "TESSEL_TEST_PAUSE_MARKER"

_KINDS = ("new", "old", "del", "tmp")


def pause_point(name: str) -> None:
    """Test hook: stop here (and say so with a marker file) if ``TESSEL_TEST_PAUSE_AT`` is
    ``name``. Costs one environment lookup otherwise."""
    if os.environ.get(PAUSE_ENV) != name:
        return
    marker = os.environ.get(PAUSE_MARKER_ENV)
    if marker:  # published whole, so a watcher never reads it empty
        with replace_atomically(marker) as aside:
            aside.write_text(str(os.getpid()))
    while True:
        time.sleep(3600)


# ---------------------------------------------------------------------------------------------
# syncing and locking


def _sync_fd(fd: int) -> None:
    """fsync, ignoring file systems that cannot sync (EINVAL) or sync directories."""
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES):
            raise


def sync_file(fd: int) -> None:
    """Put a written file's data on disk before it is renamed into place."""
    try:
        (os.fdatasync if hasattr(os, "fdatasync") else os.fsync)(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):  # this file system cannot sync
            raise


def _sync_dir(path: str | os.PathLike) -> None:
    """Put a directory's entries (names created or renamed in it) on disk."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # cannot open directories (e.g. not POSIX): nothing to sync
    try:
        _sync_fd(fd)
    finally:
        os.close(fd)


def _sync_dirs(root: Path) -> None:
    """Sync every directory of a tree, deepest first (files are synced when written)."""
    for d, _, _ in sorted(os.walk(root), key=lambda t: -len(t[0])):
        _sync_dir(d)


@contextlib.contextmanager
def _locked_dir(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on directory ``path`` (waits for other tessel runs).

    Where the file system offers no ``flock`` the block runs unlocked: runs that write one
    destination at the same moment are then not kept apart.
    """
    fd = _hold_lock(path, wait=True)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # closing releases the lock


def _hold_lock(path: Path, wait: bool = False) -> int | None:
    """Open ``path`` and take an exclusive ``flock`` on it; the fd holds it until closed.
    None where this system or file system cannot lock it."""
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _in_use(path: Path) -> bool:
    """Whether a live run may hold ``path``: True unless its lock can be taken (a killed run
    holds none) or it is gone. Where locks do not work nothing is taken for a leftover."""
    if fcntl is None:
        return True
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by a live run, or this file system cannot tell
        return True
    finally:
        os.close(fd)
    return False


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


# ---------------------------------------------------------------------------------------------
# leftovers of killed runs


def _sibling(target: Path, kind: str, tag: str) -> Path:
    return target.parent / f".{target.name}.tessel-{kind}-{tag}"


def _leftovers(target: Path) -> list[tuple[str, str, Path]]:
    """Hidden siblings of ``target`` made by tessel runs: ``(kind, tag, path)``."""
    pattern = re.compile(
        rf"\.{re.escape(target.name)}\.tessel-({'|'.join(_KINDS)})-([0-9a-f]{{12}})"
    )
    out = []
    try:
        with os.scandir(target.parent) as entries:
            for e in entries:
                m = pattern.fullmatch(e.name)
                if m:
                    out.append((m.group(1), m.group(2), Path(e.path)))
    except OSError:  # cannot list the directory: no leftovers to see
        return []
    return sorted(out, key=lambda t: t[2].name)


def _recover(target: Path) -> list[Path]:
    """Mend what killed runs left beside ``target``; returns the leftovers to delete.

    Call with the parent directory locked. A destination that a killed fallback swap moved
    aside (``old``) is put back if nothing took its place. Leftovers still locked by a live run
    are left alone; the others are renamed to ``del`` names (so no later recovery mistakes them
    for a destination to restore) and returned, to be deleted once the lock is released.
    """
    found = _leftovers(target)
    if not os.path.lexists(target):
        for kind, _, path in found:
            if kind == "old":
                found = [f for f in found if f[2] != path]
                try:
                    os.rename(path, target)
                except OSError as e:
                    raise CheckpointError(
                        str(target), None, f"is missing and could not be put back from "
                        f"{path} ({e}), where an interrupted run moved it; move it back by hand",
                    ) from None  # fmt: skip
                break
    doomed = []
    for kind, tag, path in found:
        if kind in ("new", "tmp") and _in_use(path):
            continue
        if kind != "del":
            gone = _sibling(target, "del", tag)
            try:
                os.rename(path, gone)
            except OSError:
                continue
            path = gone
        doomed.append(path)
    return doomed


def _resolve(target: str | os.PathLike) -> Path:
    """Absolute path of an output; a symlink is followed, so the tree it points to is replaced."""
    path = Path(os.path.abspath(target))
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    if not path.name or path.parent == path:
        raise CheckpointError(str(target), None, "cannot be the destination of an output")
    return path


# ---------------------------------------------------------------------------------------------
# atomic exchange of two directories


def _exchange_fn():
    """The platform's atomic exchange of two paths as ``f(a: bytes, b: bytes) -> (rc, errno)``."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover
        return None
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        fn = libc.renameat2
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        at_fdcwd, rename_exchange = -100, 2
        return lambda a, b: fn(at_fdcwd, a, at_fdcwd, b, rename_exchange)
    if sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        fn = libc.renamex_np
        fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint]
        rename_swap = 2
        return lambda a, b: fn(a, b, rename_swap)
    return None


_EXCHANGE = _exchange_fn()
# errors meaning "this kernel or file system cannot exchange": use the two-rename fallback
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP}


def exchange(a: Path, b: Path) -> bool:
    """Swap directories ``a`` and ``b`` atomically; False if this system cannot (nothing done)."""
    if _EXCHANGE is None:
        return False
    if _EXCHANGE(os.fsencode(a), os.fsencode(b)) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), str(b))


# ---------------------------------------------------------------------------------------------
# carrying the old destination's other entries into the new tree


def _carry_over(old: Path, new: Path, keep: Collection[str]) -> None:
    """Give ``new`` each entry of ``old`` that it lacks and that is not a checkpoint's own (or
    is named in ``keep``), whole: files as hard links (a copy where the file system has none),
    symlinks as symlinks, directories with everything in them. An entry ``new`` holds is
    replaced whole by it, never merged."""
    with os.scandir(old) as entries:
        for e in entries:
            if os.path.lexists(new / e.name):
                continue  # replaced by the new output
            if is_checkpoint_name(e.name) and e.name not in keep:
                continue  # a file of the old checkpoint: the new one replaces it
            _link_entry(e, new / e.name)


def _link_entry(e: os.DirEntry, there: Path) -> None:
    """Make ``there`` a copy of entry ``e`` that shares its files' data (hard links)."""
    if e.is_dir(follow_symlinks=False):
        there.mkdir()
        with os.scandir(e.path) as inner:
            for f in inner:
                _link_entry(f, there / f.name)
        shutil.copystat(e.path, there, follow_symlinks=False)
    elif e.is_symlink():
        os.symlink(os.readlink(e.path), there)
    elif e.is_file(follow_symlinks=False):
        try:
            os.link(e.path, there, follow_symlinks=False)
        except OSError:  # no hard links here (or not allowed): copy
            shutil.copy2(e.path, there, follow_symlinks=False)
    else:
        raise CheckpointError(
            e.path, None, "is not a file, directory or symlink, so it cannot be kept "
            "when the new output replaces the directory; nothing was changed",
        )  # fmt: skip


def aside_copy(target: str | os.PathLike) -> Path | None:
    """Where a run killed between the two renames of the fallback left ``target``'s old tree
    complete (a hidden ``old`` sibling), or None."""
    path = Path(os.path.abspath(target))
    if not path.name:
        return None
    found = [p for kind, _, p in _leftovers(path) if kind == "old"]
    return found[0] if found else None


# ---------------------------------------------------------------------------------------------
# the public pieces


class StagedTree:
    """A new output tree built beside ``dst`` and swapped in whole by ``publish()``.

    The old destination's entries that the new tree lacks are kept, except a checkpoint's own
    (``identity.is_checkpoint_name``) not named in ``keep`` (the other parts of a checkpoint
    written in parts). Use as a context manager: entering clears leftovers of killed runs and makes the (hidden,
    locked) staging directory ``path``; leaving without ``publish()`` removes it, so an error or
    Ctrl-C leaves ``dst`` as it was. With ``parents``, entering also makes the directories
    above ``dst`` that are missing, and leaving without ``publish()`` removes those again.
    """

    def __init__(
        self, dst: str | os.PathLike, parents: bool = False, keep: Collection[str] = ()
    ) -> None:
        self.dst = _resolve(dst)
        self._parents = parents
        self._keep = frozenset(keep)
        self._made: list[Path] = []
        if self.dst.exists() and not self.dst.is_dir():
            raise CheckpointError(str(self.dst), None, "exists and is not a directory")
        if os.path.ismount(self.dst):
            raise CheckpointError(
                str(self.dst), None, "is a mount point, which cannot be replaced in one step; "
                "write to a directory inside it",
            )  # fmt: skip
        self.tag = uuid.uuid4().hex[:12]
        self.path = _sibling(self.dst, "new", self.tag)
        self._lock: int | None = None
        self._published = False

    def __enter__(self) -> StagedTree:
        if self._parents:
            self._made = _make_parents(self.dst)
        with _locked_dir(self.dst.parent):
            doomed = _recover(self.dst)
            try:
                self.path.mkdir()
            except OSError as e:
                self._remove_made()
                raise CheckpointError(
                    str(self.dst), None, f"cannot build the output beside it ({e}); the output "
                    "replaces the whole directory in one step, which needs write access to the "
                    "directory holding it",
                ) from None  # fmt: skip
            self._lock = _hold_lock(self.path)
        for p in doomed:
            _remove(p)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._published:
            _remove(self.path)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
        if not self._published:
            self._remove_made()

    @property
    def published(self) -> bool:
        """Whether the new tree is in place (the old one displaced)."""
        return self._published

    def _remove_made(self) -> None:
        """Remove the parents this tree made, innermost first, where they are empty."""
        for d in reversed(self._made):
            with contextlib.suppress(OSError):
                d.rmdir()
        self._made = []

    def publish(self) -> None:
        """Swap the complete staged tree in for ``dst`` (atomically where the system can)."""
        with _locked_dir(self.dst.parent):
            pause_point("publish")
            if not os.path.lexists(self.dst):
                _sync_dirs(self.path)
                try:
                    os.rename(self.path, self.dst)
                except OSError as e:
                    raise CheckpointError(
                        str(self.dst), None, f"could not move the finished output into place "
                        f"({e}); nothing written",
                    ) from None  # fmt: skip
                self._published = True
                _sync_dir(self.dst.parent)
                return
            if not self.dst.is_dir():
                raise CheckpointError(str(self.dst), None, "exists and is not a directory")
            _carry_over(self.dst, self.path, self._keep)
            os.chmod(self.path, stat.S_IMODE(self.dst.stat().st_mode))
            _sync_dirs(self.path)
            aside = self._swap()
        pause_point("published")
        _remove(aside)

    def _swap(self) -> Path:
        """Put the staged tree at ``dst``; returns where the displaced old tree now lies."""
        pause_point("swap")
        gone = _sibling(self.dst, "del", self.tag)
        try:
            swapped = exchange(self.path, self.dst)
        except OSError as e:
            raise CheckpointError(
                str(self.dst), None, f"could not swap the new output into place ({e}); "
                "the destination is unchanged",
            ) from None  # fmt: skip
        if swapped:
            self._published = True  # self.path now holds the old tree
            _sync_dir(self.dst.parent)
            pause_point("swapped")
            with contextlib.suppress(OSError):  # else the next run clears it
                os.rename(self.path, gone)
            return gone
        # no atomic exchange here: move the old tree aside, then the new one in
        old = _sibling(self.dst, "old", self.tag)
        try:
            os.rename(self.dst, old)
        except OSError as e:
            raise CheckpointError(
                str(self.dst), None, f"could not move the old output aside ({e}); "
                "the destination is unchanged",
            ) from None  # fmt: skip
        pause_point("fallback-aside")
        try:
            os.rename(self.path, self.dst)
        except OSError as e:
            try:
                os.rename(old, self.dst)
            except OSError:  # the next run that writes this destination puts it back
                raise CheckpointError(
                    str(self.dst), None, f"could not move the new output into place ({e}), "
                    f"nor the old one back; it lies complete at {old}",
                ) from None  # fmt: skip
            raise CheckpointError(
                str(self.dst), None, f"could not move the new output into place ({e}); "
                "the destination is unchanged",
            ) from None  # fmt: skip
        self._published = True
        _sync_dir(self.dst.parent)
        with contextlib.suppress(OSError):
            os.rename(old, gone)
        return gone if gone.exists() else old


def _make_parents(dst: Path) -> list[Path]:
    """Make the missing directories above ``dst``; returns them, outermost first."""
    missing = []
    path = dst.parent
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    made: list[Path] = []
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        except OSError as e:
            for m in reversed(made):
                with contextlib.suppress(OSError):
                    m.rmdir()
            raise CheckpointError(
                str(dst), None, f"cannot make the directory {d} to hold it ({e.strerror or e})"
            ) from None
        made.append(d)
    return made


@contextlib.contextmanager
def staged_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; write the file there. When the block ends
    without error the file is synced and renamed over ``path`` in one step; otherwise it is
    removed and ``path`` is left as it was."""
    target = _resolve(path)
    if target.is_dir():
        raise CheckpointError(str(target), None, "is a directory, expected a file name")
    tmp = _sibling(target, "tmp", uuid.uuid4().hex[:12])
    with _locked_dir(target.parent):
        doomed = _recover(target)
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as e:
            raise CheckpointError(str(target), None, f"cannot write beside it ({e})") from None
        if fcntl is not None:
            with contextlib.suppress(OSError):  # a file system without locks: none held
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    for p in doomed:
        _remove(p)
    try:
        yield tmp
        sync_file(fd)
        pause_point("file-publish")
        os.replace(tmp, target)
        _sync_dir(target.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    finally:
        os.close(fd)
