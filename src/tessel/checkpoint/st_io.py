"""Low-level safetensors I/O: validated header reads, region reads and a streaming writer.

Why not ``safe_open(...).get_slice``: it maps the whole file, and every page touched stays in the
process's RSS until the handle is dropped. Reading a region with ``os.preadv`` straight into the
destination buffer (or ``os.copy_file_range`` file to file, when the region is made of long
contiguous runs) needs no intermediate copy and keeps RSS at the destination slice. The header is
JSON (no pickle); it is checked against the file size so truncated files are caught up front.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tessel.checkpoint.errors import CheckpointError
from tessel.checkpoint.strategy import checked_dtype_name
from tessel.dtypes import torch_dtype
from tessel.package.safetensors_io import (
    SafetensorsFormatError,
    header_length,
    parse_header,
)

Box = tuple[tuple[int, int], ...]
DIRECT_RUN_BYTES = 1 << 20  # runs this long are copied file to file by the kernel
PREAD_RUN_BYTES = 64 << 10  # runs this long are read one by one; shorter ones via mmap
BLOCK_BYTES = 64 << 20


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name such as "bfloat16"."""
    return torch_dtype(dtype).itemsize


@dataclass(frozen=True)
class TensorLoc:
    """Where one stored tensor (or DCP chunk) lies: file, absolute byte offset, dtype, shape."""

    path: str
    offset: int
    dtype: str  # canonical name, e.g. "float32"
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorLoc], dict[str, str]]:
    """Parse and check a safetensors header; returns ``({name: TensorLoc}, __metadata__)``."""
    path = str(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = header_length(f.read(8), size)
            entries, meta = parse_header(f.read(n), size)
    except FileNotFoundError:
        raise CheckpointError(path, None, "file does not exist") from None
    except IsADirectoryError:
        raise CheckpointError(path, None, "is a directory, expected a safetensors file") from None
    except SafetensorsFormatError as e:
        raise CheckpointError(path, e.name, str(e)) from None
    locs = {e.name: TensorLoc(path, e.begin, checked_dtype_name(e.dtype), e.shape) for e in entries}
    return locs, meta


def _runs(region: Box, src_shape: Sequence[int], dst_region: Box, dst_shape: Sequence[int]):
    """Split a region into runs contiguous in both the source and destination arrays.

    Returns ``(k, run_elems)``: dims ``k+1..`` are whole in both, so each run covers dim ``k``'s
    extent times the trailing sizes.
    """
    nd = len(src_shape)
    k = nd - 1
    while k > 0:
        lo, hi = region[k]
        dlo, dhi = dst_region[k]
        if lo == 0 and hi == src_shape[k] and dlo == 0 and dhi == dst_shape[k]:
            k -= 1
        else:
            break
    run = (region[k][1] - region[k][0]) * math.prod(src_shape[k + 1 :]) if nd else 1
    return k, run


def _run_offsets(region: Box, shape: Sequence[int], k: int) -> np.ndarray:
    """Element offsets (row-major in ``shape``) of the start of every run of ``region``."""
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    offs = np.array([region[k][0] * strides[k]], dtype=np.int64) if shape else np.zeros(1, np.int64)
    for i in range(k - 1, -1, -1):
        lo, hi = region[i]
        offs = (np.arange(lo, hi, dtype=np.int64) * strides[i])[:, None] + offs[None, :]
        offs = offs.reshape(-1)
    return offs


def _pread_exact(fd: int, buf: memoryview, offset: int, path: str, name: str) -> None:
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n <= 0:
            raise CheckpointError(path, name, f"is truncated: short read at byte {offset + got}")
        got += n


IOV_MAX = 1024


def will_need(fd: int, start: int, end: int) -> None:
    """Ask the kernel to read ``[start, end)`` ahead in large requests (strided reads of a
    cold file would otherwise become one small disk read per run)."""
    if hasattr(os, "posix_fadvise") and end > start:
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)


def _read_runs(fd: int, mv: memoryview, s: list, d: list, nb: int, path: str, name: str) -> None:
    """Read runs of ``nb`` bytes at file offsets ``s`` into ``mv`` at ``d``.

    Runs that follow each other in the file are read with one ``preadv`` into many buffers
    (e.g. a whole source slice scattered into every row of a wider destination slice).
    """
    i, n = 0, len(s)
    while i < n:
        j = i + 1
        while j < n and j - i < IOV_MAX and s[j] == s[j - 1] + nb:
            j += 1
        if j - i == 1:
            _pread_exact(fd, mv[d[i] : d[i] + nb], s[i], path, name)
        else:
            bufs = [mv[x : x + nb] for x in d[i:j]]
            got = os.preadv(fd, bufs, s[i])
            if got != nb * (j - i):  # short read: finish run by run
                for x, y in zip(s[i:j], d[i:j], strict=True):
                    _pread_exact(fd, mv[y : y + nb], x, path, name)
        i = j


@dataclass
class Piece:
    """Copy ``src_region`` (local to the stored chunk) into ``dst_region`` of the output slice."""

    loc: TensorLoc
    src_region: Box
    dst_region: Box


def direct_runs(piece: Piece, dst_shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray, int]:
    """Byte offsets (source-absolute, destination-relative) and byte length of each run."""
    k, run = _runs(piece.src_region, piece.loc.shape, piece.dst_region, dst_shape)
    isz = piece.loc.itemsize
    s = _run_offsets(piece.src_region, piece.loc.shape, k) * isz + piece.loc.offset
    d = _run_offsets(piece.dst_region, dst_shape, k) * isz
    return s, d, run * isz


def fill(buf: torch.Tensor, piece: Piece, fd: int, name: str) -> None:
    """Read ``piece`` from the open source file ``fd`` into ``buf`` (the whole output slice)."""
    loc = piece.loc
    isz = loc.itemsize
    shape = tuple(buf.shape)
    k, run = _runs(piece.src_region, loc.shape, piece.dst_region, shape)
    raw = buf.view(-1).view(torch.uint8).numpy() if buf.numel() else None
    if raw is None:
        return
    mv = memoryview(raw)
    nb = run * isz
    s = _run_offsets(piece.src_region, loc.shape, k) * isz + loc.offset
    groups = 1 + int(np.count_nonzero(np.diff(s) != nb)) if len(s) > 1 else 1
    if nb >= PREAD_RUN_BYTES or len(loc.shape) <= 1 or groups * 64 <= len(s):
        # long runs, or runs that follow each other in the file: preadv straight into buf
        d = _run_offsets(piece.dst_region, shape, k) * isz
        if len(s) > 1:
            will_need(fd, int(s[0]), int(s[-1]) + nb)
        _read_runs(fd, mv, s.tolist(), d.tolist(), nb, loc.path, name)
        return
    # short scattered runs (a narrow column strip): map the rows they lie in, a bounded block
    # at a time, and copy the sub-box; only pages holding wanted bytes are read, and each
    # mapping is dropped before the next, so RSS stays at one block
    row_elems = math.prod(loc.shape[1:])
    row_bytes = row_elems * isz
    r0, r1 = piece.src_region[0]
    rows_per = max(1, BLOCK_BYTES // max(1, row_bytes))
    npdt = _INT_OF_SIZE[isz]
    dst_np = raw.view(npdt).reshape(shape)[tuple(slice(a, b) for a, b in piece.dst_region)]
    tail = tuple(slice(a, b) for a, b in piece.src_region[1:])
    gran = mmap.ALLOCATIONGRANULARITY
    for r in range(r0, r1, rows_per):
        re = min(r1, r + rows_per)
        start = loc.offset + r * row_bytes
        base = start // gran * gran
        m = mmap.mmap(fd, start - base + (re - r) * row_bytes, prot=mmap.PROT_READ, offset=base)
        try:
            if hasattr(m, "madvise"):
                m.madvise(mmap.MADV_SEQUENTIAL)
            src = np.frombuffer(m, dtype=npdt, count=(re - r) * row_elems, offset=start - base)
            np.copyto(
                dst_np[r - r0 : re - r0], src.reshape(re - r, *loc.shape[1:])[(slice(None), *tail)]
            )
            del src
        finally:
            m.close()


_INT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


_SCRATCH: dict[int, torch.Tensor] = {}


def scratch(shape: Sequence[int], dtype: torch.dtype, slot: int = 0) -> torch.Tensor:
    """A reusable uninitialised buffer (grow-only), so big slices do not re-fault fresh pages."""
    nbytes = math.prod(shape) * dtype.itemsize
    buf = _SCRATCH.get(slot)
    if buf is None or buf.numel() < nbytes:
        _SCRATCH.pop(slot, None)
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        _SCRATCH[slot] = buf
    return buf[:nbytes].view(dtype).view(tuple(shape))


def release_scratch() -> None:
    _SCRATCH.clear()


def copy_range(src_fd: int, dst_fd: int, src_off: int, dst_off: int, n: int, path: str, name: str):
    """Copy ``n`` bytes file to file in the kernel (falls back to pread/pwrite)."""
    while n > 0:
        try:
            got = os.copy_file_range(src_fd, dst_fd, n, src_off, dst_off)
        except OSError:
            got = -1
        if got <= 0:
            data = os.pread(src_fd, min(n, BLOCK_BYTES), src_off)
            if not data:
                raise CheckpointError(path, name, f"is truncated: short read at byte {src_off}")
            got = os.pwrite(dst_fd, data, dst_off)
        src_off += got
        dst_off += got
        n -= got


def write_all(fd: int, data, offset: int) -> None:
    mv = memoryview(data).cast("B")
    done = 0
    while done < len(mv):
        done += os.pwrite(fd, mv[done:], offset + done)
