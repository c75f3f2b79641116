"""Execute file jobs: stream each output safetensors file, one parameter at a time, atomically.

For every output file the header is written first (all shapes are known from the plan), then each
tensor's bytes at its offset. A tensor whose pieces are long contiguous runs is copied file to file
by the kernel (``copy_file_range``); otherwise one buffer the size of that output slice is filled
from the source regions and written. So peak memory is about the largest output slice.

All outputs are written under a staging directory and moved into place only when every file is
complete. A destination that does not exist yet is staged whole as a hidden sibling and renamed
in one step; into an existing one the files are moved one by one, keeping each file they replace
until all are in, so a failure restores it. On any error (or Ctrl-C) the destination is left as it
was. Sources are only ever opened read-only.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import shutil
import signal
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tessel.package.safetensors_io import build_header
from tessel.parallel.errors import CheckpointError
from tessel.parallel.plan import FileJob, OutParam
from tessel.parallel.st_io import (
    DIRECT_RUN_BYTES,
    copy_range,
    direct_runs,
    fill,
    release_scratch,
    scratch,
    write_all,
)

MAX_DIRECT_RUNS = 4096


class _Fds:
    """Read-only file descriptors of the source files one job touches."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}

    def get(self, path: str) -> int:
        fd = self.fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise CheckpointError(path, None, "source file disappeared") from None
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            self.fds[path] = fd
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _write_param(op: OutParam, out_fd: int, offset: int, fds: _Fds) -> None:
    runs = [direct_runs(p, op.shape) for p in op.pieces]
    n_runs = sum(len(s) for s, _, _ in runs)
    if runs and n_runs <= MAX_DIRECT_RUNS and all(nb >= DIRECT_RUN_BYTES for _, _, nb in runs):
        for p, (s, d, nb) in zip(op.pieces, runs, strict=False):
            fd = fds.get(p.loc.path)
            for so, do in zip(s.tolist(), d.tolist(), strict=False):
                copy_range(fd, out_fd, so, offset + do, nb, p.loc.path, op.name)
        return
    buf = scratch(op.shape, getattr(torch, op.dtype))
    for p in op.pieces:
        fill(buf, p, fds.get(p.loc.path), op.name)
    if buf.numel():
        write_all(out_fd, buf.view(-1).view(torch.uint8).numpy(), offset)


def run_job(job: FileJob, staging: str) -> int:
    """Write one output file under ``staging``; returns the bytes of tensor data written."""
    path = Path(staging) / job.rel_path
    path.parent.mkdir(parents=True, exist_ok=True)
    head, offsets = build_header([(o.name, o.dtype, o.shape) for o in job.params], job.metadata)
    total = len(head) + sum(nb for _, nb in offsets.values())
    fds = _Fds()
    out_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(out_fd, head, 0)
        os.ftruncate(out_fd, total)
        for op in job.params:
            _write_param(op, out_fd, offsets[op.name][0], fds)
    finally:
        os.close(out_fd)
        fds.close()
        release_scratch()
    return total - len(head)


def _worker_init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and terminates us
    torch.set_num_threads(1)
    if sys.platform.startswith("linux"):  # die with the parent even if it is killed outright
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _run_job_star(args: tuple[FileJob, str]) -> tuple[str, int]:
    job, staging = args
    return job.rel_path, run_job(job, staging)


class _RestoreError(CheckpointError):
    """Publishing failed and some replaced files could not be put back (their backups are kept)."""


def _check_forbidden(jobs: Sequence[FileJob], dst: Path, forbidden: Sequence[str]) -> None:
    bad = {os.path.realpath(f) for f in forbidden}
    for j in jobs:
        if os.path.realpath(dst / j.rel_path) in bad:
            raise CheckpointError(
                str(dst / j.rel_path), None, "output would overwrite a source file"
            )


def _make_dirs(path: Path) -> list[Path]:
    """``mkdir -p path``; returns the directories it created, outermost first (for cleanup)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
    return list(reversed(missing))


def _remove_empty_dirs(dirs: Sequence[Path]) -> None:
    """Remove directories this run created, innermost first, if they are (again) empty."""
    for d in reversed(dirs):
        try:
            d.rmdir()
        except OSError:
            pass


def _write_jobs(
    jobs: Sequence[FileJob],
    staging: Path,
    process_num: int,
    progress: Callable[[int], None] | None,
) -> None:
    """Write every job's file under ``staging``, in this process or in a pool of workers."""
    if process_num <= 1 or len(jobs) <= 1:
        for j in jobs:
            n = run_job(j, str(staging))
            if progress:
                progress(n)
        return
    ctx = mp.get_context("fork" if os.name == "posix" else "spawn")
    pool = ctx.Pool(min(process_num, len(jobs)), initializer=_worker_init)
    try:
        order = sorted(jobs, key=lambda j: -j.nbytes)  # largest first balances best
        for _, n in pool.imap_unordered(_run_job_star, [(j, str(staging)) for j in order]):
            if progress:
                progress(n)
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def _publish_dir(staging: Path, dst: Path) -> None:
    """Move a complete staged output directory to ``dst`` (which did not exist) in one rename."""
    try:
        os.rename(staging, dst)
    except OSError as e:
        raise CheckpointError(
            str(dst), None, f"could not move the finished output into place ({e}); nothing written"
        ) from None


def _keep_old(final: Path, backup: Path) -> None:
    """Keep the file about to be replaced: a hard link (``final`` stays in place), else a move."""
    backup.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(final, backup)
    except OSError:
        os.replace(final, backup)


def _publish_files(jobs: Sequence[FileJob], staging: Path, dst: Path) -> None:
    """Move staged files into an existing ``dst`` one by one; on any failure put it back as it was.

    Each file that would be overwritten is first kept under ``staging/.replaced``; a failure
    restores those, removes the new files and the directories made for them.
    """
    backups = staging / ".replaced"
    placed: list[tuple[Path, Path | None]] = []  # (final, kept original or None if it was new)
    made: list[Path] = []
    try:
        for j in jobs:
            final = dst / j.rel_path
            made += _make_dirs(final.parent)
            backup = None
            if final.exists() or final.is_symlink():
                backup = backups / j.rel_path
                _keep_old(final, backup)
            placed.append((final, backup))
            os.replace(staging / j.rel_path, final)
    except BaseException as e:
        _roll_back(placed, made, dst, backups, e)
        raise


def _roll_back(
    placed: Sequence[tuple[Path, Path | None]],
    made: Sequence[Path],
    dst: Path,
    backups: Path,
    cause: BaseException,
) -> None:
    """Undo ``_publish_files``; raise ``_RestoreError`` naming what could not be restored."""
    failed = []
    for final, backup in reversed(placed):
        try:
            if backup is not None:
                os.replace(backup, final)
            else:
                final.unlink(missing_ok=True)
        except OSError as e:
            failed.append(f"{final} (original kept at {backup}: {e})" if backup else f"{final}")
    _remove_empty_dirs(made)
    if failed:
        raise _RestoreError(
            str(dst),
            None,
            f"moving the new files into place failed ({cause!r}) and these could not be "
            f"restored: {failed}; the replaced originals are kept under {backups}",
        ) from cause


def execute(
    jobs: Sequence[FileJob],
    dst_dir: str | os.PathLike,
    process_num: int = 1,
    progress: Callable[[int], None] | None = None,
    forbidden: Sequence[str] = (),
) -> list[str]:
    """Write all jobs into ``dst_dir`` all-or-nothing; returns the output paths.

    A new ``dst_dir`` is staged whole as a hidden sibling and renamed into place in one step. In
    an existing one, files are staged inside it and moved in one by one, and a failure restores
    every file already replaced. ``forbidden`` lists source files that must never be overwritten.
    """
    dst = Path(dst_dir)
    _check_forbidden(jobs, dst, forbidden)
    fresh = not dst.exists()
    made = _make_dirs(dst.parent) if fresh else []
    tag = uuid.uuid4().hex[:12]
    if fresh:
        staging = dst.parent / f".{dst.name}.tessel-staging-{tag}"
    else:
        dst.mkdir(exist_ok=True)  # a clear FileExistsError if dst is a file
        staging = dst / f".tessel-staging-{tag}"
    staging.mkdir()
    ok = keep_staging = False
    try:
        _write_jobs(jobs, staging, process_num, progress)
        if fresh:
            _publish_dir(staging, dst)
        else:
            _publish_files(jobs, staging, dst)
        ok = True
        return [str(dst / j.rel_path) for j in jobs]
    except _RestoreError:
        keep_staging = True  # it holds the originals that could not be put back
        raise
    finally:
        if not keep_staging:
            shutil.rmtree(staging, ignore_errors=True)
        if not ok:
            _remove_empty_dirs(made)


def nbytes_of(jobs: Sequence[FileJob]) -> int:
    return sum(j.nbytes for j in jobs)


def shape_bytes(shape: Sequence[int], dtype: str) -> int:
    return math.prod(shape) * getattr(torch, dtype).itemsize
