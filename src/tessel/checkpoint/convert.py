"""Execute file jobs: stream each output safetensors file, one parameter at a time, atomically.

For every output file the header is written first (all shapes are known from the plan), then each
tensor's bytes at its offset. A tensor whose pieces are long contiguous runs is copied file to file
by the kernel (``copy_file_range``); otherwise one buffer the size of that output slice is filled
from the source regions and written. So peak memory is about the largest output slice.

Outputs are published with ``tessel.checkpoint.publish``: a tree is built whole beside the
destination and swapped in at once, replacing the checkpoint there whole (``identity`` names its
files), a single file is written under a temporary name and renamed, so an error (a full disk),
Ctrl-C or kill at any moment leaves the old output or the complete new one. A destination that
is not empty is written only when asked (``overwrite``), and never one that is, lies inside or
holds the source. Sources are only ever opened read-only.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import traceback
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

import torch

from tessel.checkpoint.errors import CheckpointError
from tessel.checkpoint.fill import FileJob, OutParam
from tessel.checkpoint.identity import ID_KEY, new_checkpoint_id
from tessel.checkpoint.publish import StagedTree, pause_point, staged_file, sync_file
from tessel.checkpoint.st_io import (
    DIRECT_RUN_BYTES,
    copy_range,
    direct_runs,
    fill,
    release_scratch,
    scratch,
    write_all,
)
from tessel.dtypes import torch_dtype
from tessel.errors import TesselError
from tessel.forked import die_with_parent
from tessel.package.safetensors_io import build_header

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
    buf = scratch(op.shape, torch_dtype(op.dtype))
    for p in op.pieces:
        fill(buf, p, fds.get(p.loc.path), op.name)
    if buf.numel():
        write_all(out_fd, buf.view(-1).view(torch.uint8).numpy(), offset)


def write_file(job: FileJob, path: str | os.PathLike) -> int:
    """Write one job's safetensors file at ``path`` and sync it; returns the tensor bytes."""
    head, offsets = build_header([(o.name, o.dtype, o.shape) for o in job.params], job.metadata)
    total = len(head) + sum(nb for _, nb in offsets.values())
    fds = _Fds()
    out_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(out_fd, head, 0)
        os.ftruncate(out_fd, total)
        for op in job.params:
            _write_param(op, out_fd, offsets[op.name][0], fds)
        sync_file(out_fd)  # on disk before the tree holding it is published
    finally:
        os.close(out_fd)
        fds.close()
        release_scratch()
    return total - len(head)


def run_job(job: FileJob, staging: str) -> int:
    """Write one output file under ``staging``; returns the bytes of tensor data written."""
    path = Path(staging) / job.rel_path
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_file(job, path)


def _worker_init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    torch.set_num_threads(1)
    die_with_parent(signal.SIGTERM)  # even if the parent is killed outright


def _writer(jobs: Sequence[FileJob], staging: str, next_job, conn) -> None:
    """A writer process: take the next unwritten job until none is left; report each file's
    bytes, or the error that stopped it, on ``conn`` (its own pipe, so no lock is shared with
    the parent and killing a writer can never block it)."""
    _worker_init()
    try:
        while True:
            with next_job.get_lock():
                i = next_job.value
                next_job.value = i + 1
            if i >= len(jobs):
                break
            conn.send(("done", run_job(jobs[i], staging)))
    except BaseException as e:
        conn.send(("error", _error_report(e)))
    finally:
        conn.close()


def _error_report(e: BaseException) -> tuple:
    """An exception as plain data (tessel's errors do not survive pickling as they are)."""
    if isinstance(e, TesselError):
        return ("tessel", str(e))
    if isinstance(e, OSError):
        return ("os", e.errno, e.strerror, e.filename)
    return ("other", "".join(traceback.format_exception(e)))


def _raise_report(report: tuple) -> NoReturn:
    kind, *rest = report
    if kind == "tessel":
        raise CheckpointError(None, None, rest[0])
    if kind == "os":
        raise OSError(*rest)
    raise RuntimeError(f"a checkpoint writer process failed:\n{rest[0]}")


def _write_in_processes(
    order: Sequence[FileJob], staging: Path, process_num: int, finished: Callable[[int], None]
) -> None:
    """Write the jobs with ``process_num`` writer processes, each taking the next job in order.

    A writer that dies (killed, out of memory) is reported as an error rather than waited for;
    on any error or Ctrl-C every writer is stopped before this returns.
    """
    ctx = mp.get_context("fork" if os.name == "posix" else "spawn")
    next_job = ctx.Value("q", 0)
    writers: dict = {}  # the read end of each writer's pipe -> its process
    try:
        for _ in range(min(process_num, len(order))):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_writer, args=(order, str(staging), next_job, send))
            proc.daemon = True
            proc.start()
            send.close()
            writers[recv] = proc
        while writers:
            for conn in mp_connection.wait(list(writers)):
                try:
                    kind, value = conn.recv()
                except EOFError:  # the writer is gone: done, or died
                    proc = writers.pop(conn)
                    conn.close()
                    proc.join()
                    if proc.exitcode:
                        raise CheckpointError(
                            None, None, f"a checkpoint writer process died (exit code "
                            f"{proc.exitcode}); nothing was written to the destination",
                        ) from None  # fmt: skip
                    continue
                if kind == "error":
                    _raise_report(value)
                finished(value)
    finally:
        for conn, proc in writers.items():
            conn.close()
            proc.terminate()
        for proc in writers.values():
            proc.join(10)
            if proc.exitcode is None:
                proc.kill()
                proc.join()


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
    done = 0

    def finished(n: int) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(n)
        pause_point(f"written-{done}")

    if process_num <= 1 or len(jobs) <= 1:
        for j in jobs:
            finished(run_job(j, str(staging)))
        return
    order = sorted(jobs, key=lambda j: -j.nbytes)  # largest first balances best
    _write_in_processes(order, staging, process_num, finished)


def _write_small(path: Path, data: bytes) -> None:
    """Write a small file (an index) into a staged tree, synced like the tensor files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, data, 0)
        sync_file(fd)
    finally:
        os.close(fd)


def check_destination(
    dst: str | os.PathLike,
    sources: Sequence[str | os.PathLike] = (),
    overwrite: bool = False,
    keep: Collection[str] = (),
) -> None:
    """Refuse a destination directory that is, lies inside or holds one of ``sources`` (the
    output replaces the destination's checkpoint files, which would be the source's), and,
    unless ``overwrite``, one that holds any entry not named in ``keep`` (the other parts of a
    checkpoint written in parts): a checkpoint directory never holds two checkpoints."""
    path = Path(os.path.realpath(dst))
    for source in sources:
        src = Path(os.path.realpath(source))
        if path == src:
            what = "is the source"
        elif src in path.parents:
            what = "lies inside the source"
        elif path in src.parents:
            what = "holds the source"
        else:
            continue
        raise CheckpointError(
            str(dst), None, f"{what} {source}: the output replaces the checkpoint files of "
            "its destination, so write it to a directory apart from the source",
        )  # fmt: skip
    if overwrite:
        return
    try:
        names = sorted(os.listdir(path))
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise CheckpointError(str(dst), None, "exists and is not a directory") from None
    except OSError as e:
        raise CheckpointError(str(dst), None, f"cannot be listed: {e.strerror or e}") from None
    found = [n for n in names if n not in keep]
    if found:
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise CheckpointError(
            str(dst), None, f"is not empty (it holds {shown}); write to a new or empty "
            "directory, or give --overwrite (overwrite=True in Python) to replace the "
            "checkpoint there: its rank directories, strategy, shards, index and config "
            "files are replaced whole and files of other names are kept",
        )  # fmt: skip


def execute(
    jobs: Sequence[FileJob],
    dst_dir: str | os.PathLike,
    process_num: int = 1,
    progress: Callable[[int], None] | None = None,
    forbidden: Sequence[str] = (),
    extra_files: Mapping[str, bytes] | None = None,
    *,
    overwrite: bool = False,
    sources: Sequence[str | os.PathLike] = (),
    keep: Collection[str] = (),
    checkpoint_id: str | None = None,
) -> list[str]:
    """Write all jobs (and ``extra_files``, ``{relative path: bytes}``) as the checkpoint in
    ``dst_dir``; returns the paths of the jobs' files.

    ``check_destination`` is applied first (``sources``, ``overwrite``, ``keep``). The tree is
    built whole beside ``dst_dir`` and swapped in at once (see ``publish``), so a failure (a
    full disk), Ctrl-C or kill at any moment leaves the old ``dst_dir`` or the new one. The new
    checkpoint replaces the old one whole; entries of other names are kept (see ``identity``).
    Every file records ``checkpoint_id`` (a new id by default) in its metadata. ``forbidden``
    lists source files that must never be overwritten.
    """
    check_destination(dst_dir, sources, overwrite, keep)
    tree = StagedTree(dst_dir, keep=keep)
    _check_forbidden(jobs, tree.dst, forbidden)
    ident = checkpoint_id or new_checkpoint_id()
    jobs = [replace(j, metadata={**j.metadata, ID_KEY: ident}) for j in jobs]
    made = _make_dirs(tree.dst.parent)
    ok = False
    try:
        with tree:
            pause_point("staged")
            _write_jobs(jobs, tree.path, process_num, progress)
            for rel, data in (extra_files or {}).items():
                _write_small(tree.path / rel, data)
            tree.publish()
        ok = True
    except OSError as e:  # a full disk, a file system gone read-only, ...
        where = f" ({e.filename})" if e.filename else ""
        state = (
            "the new checkpoint is in place" if tree.published else "the destination is unchanged"
        )
        raise CheckpointError(
            str(tree.dst), None, f"could not be written: {e.strerror or e}{where}; {state}"
        ) from None
    finally:
        if not ok:
            _remove_empty_dirs(made)
    return [str(Path(dst_dir) / j.rel_path) for j in jobs]


def execute_file(job: FileJob, path: str | os.PathLike, forbidden: Sequence[str] = ()) -> str:
    """Write one job's file at ``path`` (its ``rel_path`` is ignored) all-or-nothing: under a
    temporary name beside it, synced, then renamed over ``path``. ``forbidden`` lists the
    source files: ``path`` may be none of them nor lie beside one (a second file in a source
    rank's directory is taken for that rank's)."""
    target = Path(path)
    real = Path(os.path.realpath(target))
    for f in forbidden:
        source = Path(os.path.realpath(f))
        if real == source:
            raise CheckpointError(str(target), None, "output would overwrite a source file")
        if real.parent == source.parent:
            raise CheckpointError(
                str(target), None, f"lies beside the source file {f}, in the source "
                "checkpoint's directory: write it to a directory apart from the source",
            )  # fmt: skip
    made = _make_dirs(target.parent)
    ok = False
    try:
        with staged_file(target) as tmp:
            write_file(job, tmp)
        ok = True
    except OSError as e:  # a full disk, a file system gone read-only, ...
        where = f" ({e.filename})" if e.filename else ""
        raise CheckpointError(
            str(target), None, f"could not be written: {e.strerror or e}{where}; the file is "
            "unchanged",
        ) from None  # fmt: skip
    finally:
        if not ok:
            _remove_empty_dirs(made)
    return str(target)


def nbytes_of(jobs: Sequence[FileJob]) -> int:
    return sum(j.nbytes for j in jobs)


def shape_bytes(shape: Sequence[int], dtype: str) -> int:
    return math.prod(shape) * torch_dtype(dtype).itemsize
