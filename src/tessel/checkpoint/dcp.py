"""Read torch.distributed.checkpoint (DCP) directories without executing pickled code.

Choice: DCP's ``.metadata`` file *is* a pickle, and ``FileSystemReader.read_metadata`` calls plain
``pickle.load`` on it, which can run arbitrary code from a crafted file. tessel instead uses a
restricted ``pickle.Unpickler`` whose ``find_class`` only resolves an explicit allowlist: the DCP
metadata dataclasses, ``_StorageInfo``, ``torch.Size``, torch dtypes, ``torch.serialization.
_get_layout`` (a name-to-layout lookup), ``collections.OrderedDict`` and ``pathlib`` paths. Any other
global raises an error, so nothing outside that list can be constructed or called.

Tensor data in ``.distcp`` files (default TORCH_SAVE format) is one ``torch.save`` zip archive per
chunk, stored uncompressed. tessel reads the zip directory to find the raw storage bytes and reads
the archive's small ``data.pkl`` with a second restricted unpickler that only records the
``_rebuild_tensor_v2`` arguments (storage key, offset, size, stride) instead of building a tensor.
Chunks must be stored contiguously (DCP writes them that way); anything else is reported.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessel._torch import dcp_storage_info_class, serialization_get_layout
from tessel.checkpoint.errors import CheckpointError
from tessel.checkpoint.st_io import TensorLoc
from tessel.checkpoint.strategy import checked_dtype_name
from tessel.dtypes import dtype_name, torch_dtype

_DTYPE_NAMES = {dtype_name(d) for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.uint16, torch.uint32, torch.uint64, torch.complex64, torch.complex128,
)}  # fmt: skip

_META_CLASSES = {
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "TensorProperties",
    "ChunkStorageMetadata",
    "MetadataIndex",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the classes a DCP .metadata file legitimately contains."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" and name in _META_CLASSES:
            import torch.distributed.checkpoint.metadata as m

            return getattr(m, name)
        if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
            return dcp_storage_info_class()
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and name in _DTYPE_NAMES:
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return serialization_get_layout()
        if module == "collections" and name == "OrderedDict":
            import collections

            return collections.OrderedDict
        if module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "Path"):
            import pathlib

            return getattr(pathlib, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def read_dcp_metadata(dcp_dir: str | os.PathLike) -> Any:
    """The ``Metadata`` object of a DCP directory, read with the restricted unpickler."""
    path = Path(dcp_dir) / ".metadata"
    if not path.is_file():
        raise CheckpointError(str(dcp_dir), None, "has no .metadata file (not a DCP checkpoint)")
    try:
        with open(path, "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise CheckpointError(str(path), None, f"cannot be read as DCP metadata: {e}") from None
    if not hasattr(meta, "state_dict_metadata") or not hasattr(meta, "storage_data"):
        raise CheckpointError(str(path), None, "does not hold a DCP Metadata object")
    return meta


@dataclass
class _StorageRef:
    key: str
    dtype: str


@dataclass
class _TensorRecord:
    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _record_tensor(storage, storage_offset, size, stride, *args):
    return _TensorRecord(storage, int(storage_offset), tuple(size), tuple(stride))


_STORAGE_DTYPES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}


class _TensorPickleReader(pickle.Unpickler):
    """Reads a torch.save ``data.pkl`` for one tensor, recording where its bytes are."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _record_tensor
        if module == "collections" and name == "OrderedDict":
            import collections

            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if module == "torch" and name in _DTYPE_NAMES:
            return str(name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a DCP tensor")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        dt = pid[1]
        if not isinstance(dt, str):
            raise pickle.UnpicklingError(f"unexpected storage type {dt!r}")
        return _StorageRef(str(pid[2]), dt)


class _Window(io.RawIOBase):
    """A read-only, seekable window ``[start, start+length)`` of a file (for zipfile)."""

    def __init__(self, f, start: int, length: int) -> None:
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, off: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, base + off)
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        if n == 0:
            return 0
        data = os.pread(self.f.fileno(), n, self.start + self.pos)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


def locate_chunk(path: str, offset: int, length: int, fqn: str) -> TensorLoc:
    """Find the raw bytes of a tensor that DCP stored with torch.save at ``[offset, +length)``."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise CheckpointError(path, fqn, "DCP data file does not exist") from None
    if offset + length > size:
        raise CheckpointError(
            path, fqn, f"is truncated: chunk ends at byte {offset + length}, file has {size}"
        )
    with open(path, "rb") as f:
        try:
            z = zipfile.ZipFile(_Window(f, offset, length))
            infos = {i.filename.split("/", 1)[-1]: i for i in z.infolist()}
            pkl = z.read(infos["data.pkl"])
        except (zipfile.BadZipFile, KeyError, OSError) as e:
            raise CheckpointError(path, fqn, f"chunk is not a torch.save archive: {e}") from None
        try:
            rec = _TensorPickleReader(io.BytesIO(pkl)).load()
        except (pickle.UnpicklingError, EOFError, TypeError, ValueError) as e:
            raise CheckpointError(path, fqn, f"chunk metadata is not a plain tensor: {e}") from None
        if not isinstance(rec, _TensorRecord):
            raise CheckpointError(path, fqn, "chunk does not hold a single tensor")
        info = infos.get(f"data/{rec.storage.key}")
        if info is None or info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(path, fqn, "chunk storage is missing or compressed")
        f.seek(offset + info.header_offset)
        hdr = f.read(30)
        if len(hdr) < 30 or hdr[:4] != b"PK\x03\x04":
            raise CheckpointError(path, fqn, "chunk has a corrupt zip entry")
        name_len, extra_len = struct.unpack("<HH", hdr[26:30])
        data_off = offset + info.header_offset + 30 + name_len + extra_len
    dt = checked_dtype_name(rec.storage.dtype)
    shape = rec.size
    contiguous = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        contiguous[i] = contiguous[i + 1] * shape[i + 1]
    if any(s > 1 and st != c for s, st, c in zip(shape, rec.stride, contiguous, strict=False)):
        raise CheckpointError(path, fqn, f"chunk is stored with strides {rec.stride}")
    isz = torch.empty((), dtype=torch_dtype(dt)).element_size()
    loc = TensorLoc(path, data_off + rec.offset * isz, dt, shape)
    if rec.offset * isz + loc.nbytes > info.file_size:
        raise CheckpointError(path, fqn, "chunk storage is smaller than its tensor")
    return loc
