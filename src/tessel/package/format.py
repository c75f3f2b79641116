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
import tempfile
import zipfile
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from tessel.errors import TesselError
from tessel.package.safetensors_io import (
    SafetensorsFormatError,
    tensors_from_buffer,
    write_safetensors,
)

FORMAT = "tessel.offline_model"
FORMAT_VERSION = 2  # 2: a submodel may name tied weights, stored once (see Package.weights)
READABLE_VERSIONS = (1, 2)
SUFFIX = ".tessel"
MANIFEST = "manifest.json"
CONSTANT_PREFIX = "__constant__."  # weights-file keys of constants a traced program holds
_READ_CHUNK = 16 << 20  # a member is read in pieces this big (each read makes a temporary)


class PackageError(TesselError, ValueError):
    """A package that cannot be used: missing, truncated, altered, or of an unknown version."""

    def __init__(self, path: str | Path, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = str(path)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


Member = bytes | Mapping[str, torch.Tensor]  # raw bytes, or tensors stored as safetensors


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

    def __init__(self, out: BinaryIO, hasher: ThreadPoolExecutor, write_back: _WriteBack) -> None:
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


def write_package(path: str | Path, manifest: dict, members: Mapping[str, Member]) -> Path:
    """Write atomically: a temporary file in the same folder, on disk, then renamed.

    Tensor members stream into the archive as safetensors, hashed on the way; the manifest,
    which records every member's SHA-256, is written last.
    """
    path = Path(path)
    if path.suffix != SUFFIX:
        path = path.with_name(path.name + SUFFIX)
    path.parent.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as raw:
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
                            write_safetensors(out, data)
                    files[name] = out.hexdigest()
                zf.writestr(
                    MANIFEST, json.dumps({**manifest, "files": files}, indent=1, sort_keys=True)
                )
            write_back.finish()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@dataclass
class Package:
    """An opened offline model; members are verified against their checksums when read."""

    path: Path
    manifest: dict

    @classmethod
    def open(cls, path: str | Path) -> Package:
        path = Path(path)
        if not path.is_file():
            raise PackageError(path, "file not found")
        try:
            with zipfile.ZipFile(path) as zf:
                raw = zf.read(MANIFEST)
        except (zipfile.BadZipFile, KeyError, OSError, EOFError) as exc:
            raise PackageError(path, f"not a tessel offline model, or truncated ({exc})") from exc
        try:
            manifest = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise PackageError(path, f"manifest is not valid JSON ({exc})") from exc
        if manifest.get("format") != FORMAT:
            raise PackageError(
                path, f"not a tessel offline model (format {manifest.get('format')!r})"
            )
        version = manifest.get("format_version")
        if version not in READABLE_VERSIONS:
            raise PackageError(
                path,
                f"format version {version!r} is not supported; this tessel reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))} (rebuild the model with this tessel)",
            )
        return cls(path, manifest)

    def read(self, name: str) -> bytes:
        return bytes(self._read_checked(name))

    def _read_checked(self, name: str) -> bytearray:
        """A member's bytes, read into one buffer and checked against the manifest's SHA-256."""
        expected = self.manifest.get("files", {}).get(name)
        if expected is None:
            raise PackageError(self.path, f"member {name!r} is not listed in the manifest")
        try:
            with zipfile.ZipFile(self.path) as zf, zf.open(name) as member:
                data = bytearray(zf.getinfo(name).file_size)
                view, got = memoryview(data), 0
                while got < len(data):
                    n = member.readinto(view[got : got + _READ_CHUNK])
                    if not n:
                        raise EOFError(f"member ends after {got} of {len(data)} bytes")
                    got += n
        except (zipfile.BadZipFile, KeyError, OSError, EOFError) as exc:
            raise PackageError(self.path, f"member {name!r} cannot be read ({exc})") from exc
        if _sha(data) != expected:
            raise PackageError(
                self.path, f"member {name!r} fails its checksum: the file was altered"
            )
        return data

    def verify(self) -> None:
        """Read every member and check its checksum."""
        for name in self.manifest.get("files", {}):
            self.read(name)

    def json(self, name: str) -> Any:
        return json.loads(self.read(name))

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """A safetensors member's tensors, as views of the one buffer it was read into."""
        data = self._read_checked(name)
        try:
            return tensors_from_buffer(data)
        except SafetensorsFormatError as exc:
            where = f"tensor {exc.name!r} of " if exc.name else ""
            raise PackageError(
                self.path, f"{where}member {name!r} is not valid safetensors: {exc}"
            ) from exc

    def weights(self, submodel: dict) -> dict[str, torch.Tensor]:
        """All tensors a submodel loads: shared replicated weights plus its own shards.

        A tied weight (one tensor under two names, like GPT-2's embedding and output layer) is
        stored once; the submodel's `tied` entries say which name to read and which chunks of
        it this rank holds, so the second name is a view where the chunk is contiguous.
        """
        out: dict[str, torch.Tensor] = {}
        for name in submodel["weights"]:
            out.update(self.tensors(name))
        for name, tie in submodel.get("tied", {}).items():
            if tie.get("source") not in out:
                raise PackageError(
                    self.path, f"tied weight {name!r} names a missing source {tie.get('source')!r}"
                )
            tensor = out[tie["source"]]
            for dim, count, index in tie.get("chunks", []):
                tensor = tensor.chunk(count, dim)[index]
            out[name] = tensor.contiguous()
        return out

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    def submodel(self, rank: int) -> dict:
        return self.manifest["submodels"][rank]


def read_manifest_bytes(data: bytes) -> dict:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return json.loads(zf.read(MANIFEST))
