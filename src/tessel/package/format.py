"""The offline model: one file holding a manifest, a program and weights per rank, and layouts.

The file is a zip archive (stored, not compressed) of JSON and safetensors members; the manifest
records a SHA-256 for every member. Nothing in it is pickled, and reading it runs no code.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import struct
import zipfile
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO, Union

from tessel.atomic import replace_atomically
from tessel.package.manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    READABLE_VERSIONS,
    Manifest,
    PackageError,
    Submodel,
    valid_member_name,
)
from tessel.package.streams import read_into, skip
from tessel.sharding.geometry import piece

if TYPE_CHECKING:
    import torch

__all__ = [
    "CONSTANT_PREFIX",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "READABLE_VERSIONS",
    "SUFFIX",
    "Manifest",
    "Member",
    "Package",
    "PackageError",
    "parse_json",
    "write_package",
]

SUFFIX = ".tessel"
CONSTANT_PREFIX = "__constant__."  # weights-file keys of constants a traced program holds
_MAX_MANIFEST = 64 << 20  # a manifest is JSON of a few KiB to a few MiB


Member = Union[bytes, Mapping[str, "torch.Tensor"]]  # raw bytes, or tensors stored as safetensors


class _WriteBack:
    """Sends a package to disk while it is written, and drops what is on disk from the cache.

    A package is as big as the model's weights. Left in the page cache it takes that much fresh
    memory, which on some machines (VMs whose memory is handed out lazily) costs more than the
    disk write itself. Writing back every STEP bytes bounds what a save holds in the cache, and
    the file is on disk before it is renamed into place.
    """

    STEP = 128 << 20

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.done = raw, 0

    def poll(self) -> None:
        if self.raw.tell() - self.done >= self.STEP:
            self.finish()

    def finish(self) -> None:
        position = self.raw.tell()
        self.raw.flush()
        fd = self.raw.fileno()
        try:
            (os.fdatasync if hasattr(os, "fdatasync") else os.fsync)(fd)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: this file system cannot sync; nothing to do
                raise
        if hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):  # advice only
                os.posix_fadvise(fd, 0, position, os.POSIX_FADV_DONTNEED)
        self.done = position


class _HashingWriter:
    """A write-only stream that hashes what passes through it.

    The hash runs on a second thread, beside the zip's CRC and the write on this one (all three
    release the GIL), so hashing adds little to the time a package takes to write.
    """

    _PIECE = 8 << 20

    def __init__(self, out: IO[bytes], hasher: ThreadPoolExecutor, write_back: _WriteBack) -> None:
        self.out, self.sha, self.hasher = out, hashlib.sha256(), hasher
        self.write_back = write_back
        self.pending: list[Future] = []

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), self._PIECE):
            piece = view[start : start + self._PIECE]
            self.pending.append(self.hasher.submit(self.sha.update, piece))
            self.out.write(piece)
            self.write_back.poll()
        return len(view)

    def hexdigest(self) -> str:
        for f in self.pending:
            f.result()
        return self.sha.hexdigest()


def write_package(
    path: str | Path, manifest: Manifest | Mapping[str, Any], members: Mapping[str, Member]
) -> Path:
    """Write atomically: a temporary file in the same folder, on disk, then renamed.

    Tensor members stream into the archive as safetensors, hashed on the way; the manifest,
    which records every member's SHA-256, is written last. The manifest is checked against the
    members first, so a package that would be refused on load is never written.
    """
    if not isinstance(manifest, Manifest):
        manifest = Manifest.from_json(dict(manifest), "manifest to write", members)
    bad = [n for n in members if not valid_member_name(n) or n == MANIFEST]
    if bad:
        raise PackageError(path, f"invalid member names {bad}")
    missing = sorted(manifest.member_names() - set(members))
    if missing:
        raise PackageError(path, f"the manifest names members that are not written: {missing}")
    path = Path(path)
    if path.suffix != SUFFIX:
        path = path.with_name(path.name + SUFFIX)
    files: dict[str, str] = {}
    with replace_atomically(path) as tmp, open(tmp, "wb") as raw:
        write_back = _WriteBack(raw)
        with (
            zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED) as zf,
            ThreadPoolExecutor(1, thread_name_prefix="tessel-sha") as hasher,
        ):
            for name, data in members.items():
                with zf.open(name, "w", force_zip64=True) as member:
                    out = _HashingWriter(member, hasher, write_back)
                    if isinstance(data, bytes):
                        out.write(data)
                    else:
                        from tessel.package.safetensors_io import write_safetensors

                        write_safetensors(out, data)
                files[name] = out.hexdigest()
            zf.writestr(
                MANIFEST,
                json.dumps(manifest.with_files(files).to_json(), indent=1, sort_keys=True),
            )
        write_back.finish()
    return path


def parse_json(data: bytes | bytearray, source: Any, what: str) -> Any:
    """Strict JSON: no NaN or Infinity literals; any parse failure is a `PackageError`."""

    def refuse(literal: str) -> Any:
        raise ValueError(f"{literal} is not a JSON number")

    try:
        return json.loads(data, parse_constant=refuse)
    except (ValueError, RecursionError) as exc:  # bad UTF-8, syntax, huge integers, deep nesting
        raise PackageError(source, f"{what} is not valid JSON ({exc})") from None


_LOCAL_HEADER = struct.Struct("<4s2xHH8xIIHH")  # signature, flags, method, sizes, name, extra
_END = struct.Struct("<4s4xHHIIH")  # signature, entries, entries, cd size, cd offset, comment
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_ZIP64_END = struct.Struct("<4sQ")  # signature, size of the rest of the record


def _directory_bounds(path: Path, f: BinaryIO) -> tuple[int, int]:
    """Where the zip directory starts and ends; refuses bytes after the end record and comments.

    A package ends with the zip end record (after the zip64 end records where sizes need them).
    """
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - _END.size))
    tail = f.read(_END.size)
    if len(tail) < _END.size or tail[:4] != b"PK\x05\x06" or tail[-2:] != b"\0\0":
        f.seek(max(0, size - (1 << 16)))
        found = f.read().rfind(b"PK\x05\x06")
        if found >= 0:
            after = min(size, 1 << 16) - found - _END.size
            raise PackageError(
                path, f"{after} bytes follow the end of the zip archive: not a tessel package"
            )
        raise PackageError(path, "not a tessel offline model, or truncated (no zip end record)")
    _, _, _, cd_size, cd_offset, _ = _END.unpack(tail)
    cd_end = size - _END.size
    f.seek(max(0, cd_end - _ZIP64_LOCATOR.size))
    locator = f.read(_ZIP64_LOCATOR.size)
    if cd_end >= _ZIP64_LOCATOR.size and locator[:4] == b"PK\x06\x07":
        record = _ZIP64_LOCATOR.unpack(locator)[2]
        f.seek(record)
        head = f.read(56)
        if len(head) < 56 or head[:4] != b"PK\x06\x06":
            raise PackageError(path, "the zip64 end record is damaged")
        if record + 12 + _ZIP64_END.unpack(head[:12])[1] != cd_end - _ZIP64_LOCATOR.size:
            raise PackageError(path, "bytes lie between the zip64 end records")
        cd_size, cd_offset = struct.unpack("<QQ", head[40:56])
        cd_end = record
    if cd_offset + cd_size != cd_end:
        raise PackageError(
            path, "the zip directory is not where its end record says: bytes were added or removed"
        )
    return cd_offset, cd_end


def _check_members(path: Path, f: BinaryIO, infos: list[zipfile.ZipInfo], cd_offset: int) -> None:
    """Refuse anything a package that tessel writes never holds, before any member is read.

    A package is members laid end to end from the first byte, then the zip directory: no bytes
    before or between them, each member stored (not compressed, not encrypted) and named once by
    a plain relative path. The layout bounds every member's size by the file's, so no claimed
    size can make a reader allocate more than the file holds.
    """
    names = [i.filename for i in infos]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise PackageError(path, f"the archive holds members named twice: {twice}")
    expected = 0
    for info in sorted(infos, key=lambda i: i.header_offset):
        name = info.filename
        if not valid_member_name(name):
            raise PackageError(path, f"member name {name!r} is not a plain relative path")
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
            raise PackageError(path, f"member {name!r} is compressed; packages are stored")
        if info.flag_bits & 0x9:  # bit 0: encrypted, bit 3: sizes in a trailing descriptor
            raise PackageError(path, f"member {name!r} is encrypted or streamed")
        if info.header_offset != expected:
            raise PackageError(
                path, f"member {name!r} starts at byte {info.header_offset}, expected {expected}"
            )
        f.seek(info.header_offset)
        header = f.read(_LOCAL_HEADER.size)
        if len(header) < _LOCAL_HEADER.size:
            raise PackageError(path, f"member {name!r} lies past the end of the file")
        sig, _, method, _, _, name_len, extra_len = _LOCAL_HEADER.unpack(header)
        if sig != b"PK\x03\x04" or f.read(name_len) != name.encode() or method != 0:
            raise PackageError(path, f"member {name!r}: local header disagrees with the directory")
        expected = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len + info.file_size
        if expected > cd_offset:
            raise PackageError(
                path, f"member {name!r} claims {info.file_size} bytes, more than the file holds"
            )
    if expected != cd_offset:
        raise PackageError(path, "bytes lie between the last member and the zip directory")


class _Members:
    """What a loader reads of a package, whether from a file or still in memory: subclasses
    give `path`, `manifest` and `tensors(name)`."""

    path: str | Path
    manifest: Manifest

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """A safetensors member's tensors, by name."""
        raise NotImplementedError

    def weights(self, submodel: Submodel) -> dict[str, torch.Tensor]:
        """All tensors a submodel loads (see `submodel_weights`)."""
        return submodel_weights(self.path, submodel, self.tensors)

    @property
    def world_size(self) -> int:
        return self.manifest.world_size

    def submodel(self, rank: int) -> Submodel:
        return self.manifest.submodel(rank)


@dataclass
class Package(_Members):
    """An opened offline model; members are verified against their checksums when read."""

    path: Path
    manifest: Manifest
    # SHA-256 of the manifest, which lists every member's SHA-256: the package's identity
    digest: str = ""

    @classmethod
    def open(cls, path: str | Path) -> Package:
        """Open and check a package: its zip layout and its manifest; no member is read yet."""
        path = Path(path)
        if not path.is_file():
            raise PackageError(path, "file not found")
        try:
            with open(path, "rb") as f:
                cd_offset, _ = _directory_bounds(path, f)
                with zipfile.ZipFile(f) as zf:
                    infos = zf.infolist()
                    _check_members(path, f, infos, cd_offset)
                    info = zf.getinfo(MANIFEST)
                    if info.file_size > _MAX_MANIFEST:
                        raise PackageError(path, f"manifest of {info.file_size} bytes is too big")
                    raw = zf.read(MANIFEST)
        except (zipfile.BadZipFile, KeyError, OSError, EOFError, ValueError) as exc:
            if isinstance(exc, PackageError):
                raise
            raise PackageError(path, f"not a tessel offline model, or truncated ({exc})") from exc
        manifest = Manifest.from_json(parse_json(raw, path, "manifest"), path)
        held = {i.filename for i in infos} - {MANIFEST}
        if held != set(manifest.files):
            extra, missing = sorted(held - set(manifest.files)), sorted(set(manifest.files) - held)
            raise PackageError(
                path,
                "the archive's members differ from the manifest's list"
                + (f"; not listed: {extra}" if extra else "")
                + (f"; missing: {missing}" if missing else ""),
            )
        return cls(path, manifest, hashlib.sha256(raw).hexdigest())

    def read(self, name: str) -> bytes:
        return bytes(self._read_checked(name))

    def _read_checked(self, name: str) -> bytearray:
        """A member's bytes, read into one buffer and checked against the manifest's SHA-256.

        Members are stored, so the bytes are read from the file straight into the buffer, with
        no temporary copy beside them."""
        digest = hashlib.sha256()
        with self._reading(name) as (f, size):
            data = bytearray(size)
            read_into(f, memoryview(data), digest)
        self._check(name, digest)
        return data

    @contextlib.contextmanager
    def _reading(self, name: str) -> Iterator[tuple[io.FileIO, int]]:
        """The package file at the start of member `name`'s bytes, and their count; a member
        that cannot be read raises `PackageError`."""
        if name not in self.manifest.files:
            raise PackageError(self.path, f"member {name!r} is not listed in the manifest")
        try:
            with open(self.path, "rb", buffering=0) as f:
                with zipfile.ZipFile(f) as zf:
                    info = zf.getinfo(name)
                size = info.file_size
                if size > self.path.stat().st_size:  # the file changed since it was opened
                    raise EOFError(f"member claims {size} bytes, more than the file holds")
                f.seek(info.header_offset)
                header = f.read(_LOCAL_HEADER.size)
                if len(header) < _LOCAL_HEADER.size:
                    raise EOFError("the member's header lies past the end of the file")
                sig, _, method, _, _, name_len, extra_len = _LOCAL_HEADER.unpack(header)
                if sig != b"PK\x03\x04" or method != zipfile.ZIP_STORED:
                    raise ValueError("its local header disagrees with the directory")
                f.seek(info.header_offset + _LOCAL_HEADER.size + name_len + extra_len)
                yield f, size
        except (zipfile.BadZipFile, KeyError, OSError, EOFError, ValueError) as exc:
            raise PackageError(self.path, f"member {name!r} cannot be read ({exc})") from exc

    def _check(self, name: str, digest: Any) -> None:
        if digest.hexdigest() != self.manifest.files[name]:
            raise PackageError(
                self.path, f"member {name!r} fails its checksum: the file was altered"
            )

    def verify(self) -> None:
        """Read every member and check its checksum."""
        for name in self.manifest.files:
            self.read(name)

    def json(self, name: str) -> Any:
        """A JSON member, checked and parsed (strictly: see `parse_json`)."""
        return parse_json(self.read(name), self.path, f"member {name!r}")

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """A safetensors member's tensors, each read into memory of its own, once the whole
        member is checked against its checksum."""
        from tessel.package.safetensors_io import SafetensorsFormatError, read_tensors

        digest = hashlib.sha256()
        failure = None
        with self._reading(name) as (f, size):
            start = f.tell()
            try:
                tensors = read_tensors(f, size, digest)
            except SafetensorsFormatError as exc:  # the checksum's word comes first
                failure = exc
                skip(f, start + size - f.tell(), digest)
        self._check(name, digest)
        if failure is not None:
            where = f"tensor {failure.name!r} of " if failure.name else ""
            raise PackageError(
                self.path, f"{where}member {name!r} is not valid safetensors: {failure}"
            ) from failure
        return tensors


def submodel_weights(
    where: str | Path, submodel: Submodel, tensors: Callable[[str], dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """All tensors a submodel loads: shared replicated weights plus its own shards.

    A tied weight (one tensor under two names, like GPT-2's embedding and output layer) is
    stored once; the submodel's `tied` entries say which name to read and which chunks of it
    this rank holds, so the second name is a view where the chunk is contiguous.
    """
    out: dict[str, torch.Tensor] = {}
    for name in submodel.weights:
        out.update(tensors(name))
    for name, tie in submodel.tied.items():
        if tie.source not in out:
            raise PackageError(where, f"tied weight {name!r} names a missing source {tie.source!r}")
        tensor = out[tie.source]
        for dim, count, index in tie.chunks:
            if dim >= tensor.dim():
                raise PackageError(
                    where, f"tied weight {name!r} is chunked along a missing dim {dim}"
                )
            if not 0 <= index < count:
                raise PackageError(where, f"tied weight {name!r} names chunk {index} of {count}")
            tensor = piece(tensor, dim, count, index)
        out[name] = tensor.contiguous()
    return out


class BuiltPackage(_Members):
    """A package still in memory (its manifest and members), read the way a file is read."""

    path = "<built model>"

    def __init__(self, manifest: Manifest, members: Mapping[str, Member]) -> None:
        self.manifest = manifest
        self.members = members

    def json(self, name: str) -> Any:
        data = self.members[name]
        if not isinstance(data, bytes):
            raise PackageError(self.path, f"member {name!r} is not a JSON member")
        return parse_json(data, self.path, f"member {name!r}")

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        data = self.members[name]
        if isinstance(data, bytes):
            raise PackageError(self.path, f"member {name!r} is not a tensor member")
        return dict(data)
