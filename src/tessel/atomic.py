"""Write a file under a temporary name beside it, then rename it into place.

A reader sees the old file or the whole new one, never a part; a crash after the rename keeps
the new data (it is synced before the rename, and the directory after it); a failure before the
rename removes the temporary and leaves the old file as it was.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

# errors of file systems that cannot sync a file or a directory: nothing to do there
_CANNOT_SYNC = (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES)


def _sync(path: str | os.PathLike, directory: bool = False) -> None:
    """fsync a written file (or a directory's entries) by name."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if directory:
            return  # a directory that cannot be opened (not POSIX): nothing to sync
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _CANNOT_SYNC:
            raise
    finally:
        os.close(fd)


def file_mode(target: str | os.PathLike) -> int:
    """The mode a file published at `target` gets: the mode of the file it replaces, else an
    ordinary new file's (0666 less the umask), never the owner-only mode of a temporary."""
    with contextlib.suppress(OSError):
        return os.stat(target).st_mode & 0o7777
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def replace_atomically(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path beside `path` (ending in `suffix`) to write the new file to.

    When the block ends without error the temporary is synced and renamed over `path` with the
    mode `file_mode` gives, and the directory synced; when it raises (or the sync or rename
    fails) the temporary is removed and `path` is left as it was. Missing parent directories
    are made first, as `mkdir -p` makes them.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _sync(tmp)
        os.chmod(tmp, file_mode(target))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _sync(target.parent, directory=True)
