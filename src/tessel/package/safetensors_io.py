"""Safetensors headers, a streaming writer and a zero-copy reader, for models and checkpoints.

`safetensors` reads files and writes whole files or bytes; it has no writer onto an open stream
(a zip member here), and both `safetensors.torch.save` and `load` on bytes copy every tensor.
Writing the header and then each tensor's bytes straight to the stream costs one pass over the
data; reading tensors as views of the one buffer a member was read into keeps a rank's weights
in memory once, not twice. The header is JSON (no pickle) and is checked before any view is made.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tessel.dtypes import dtype_name, torch_dtype
from tessel.package.streams import Digest, Stream, read_into, skip

# safetensors dtype codes <-> torch dtypes
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}
TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}


def build_header(
    entries: Sequence[tuple[str, str, Sequence[int]]], metadata: dict[str, str] | None
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """Safetensors header bytes for ``(name, dtype name, shape)`` entries in the given order.

    Returns the header (length prefix included, padded to 8 bytes) and each entry's
    ``(absolute offset, nbytes)`` in the file.
    """
    hdr: dict[str, object] = {}
    if metadata:
        hdr["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    pos = 0
    rel: dict[str, tuple[int, int]] = {}
    for name, dt, shape in entries:
        tdt = torch_dtype(dt)
        nb = math.prod(shape) * tdt.itemsize
        hdr[name] = {
            "dtype": TORCH_TO_ST[tdt],
            "shape": list(shape),
            "data_offsets": [pos, pos + nb],
        }
        rel[name] = (pos, nb)
        pos += nb
    js = json.dumps(hdr, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    head = struct.pack("<Q", len(js)) + js
    return head, {n: (len(head) + o, nb) for n, (o, nb) in rel.items()}


class Writable(Protocol):
    """A stream that takes bytes: an open file, a zip member, a hashing writer."""

    def write(self, data: bytes | memoryview, /) -> int: ...


def write_safetensors(out: Writable, tensors: Mapping[str, torch.Tensor]) -> int:
    """Write `tensors` as one safetensors file onto the stream `out`; returns the bytes written."""
    if any(t.device.type != "cpu" for t in tensors.values()):
        tensors = {k: t.cpu() for k, t in tensors.items()}
    entries = [(k, dtype_name(t.dtype), tuple(t.shape)) for k, t in tensors.items()]
    head, _ = build_header(entries, None)
    out.write(head)
    size = len(head)
    for t in tensors.values():
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        out.write(data.data)  # the array's bytes as a memoryview, not copied
        size += data.nbytes
    return size


MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFormatError(ValueError):
    """A header that is not valid safetensors; `name` is the tensor at fault, if any."""

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors header: dtype, shape, and its bytes' absolute offsets."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def header_length(head: bytes, size: int) -> int:
    """The JSON header's length from the 8-byte prefix, checked against the file size."""
    if len(head) < 8:
        raise SafetensorsFormatError(f"is truncated: {size} bytes, no header")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER or 8 + n > size:
        raise SafetensorsFormatError(
            f"is truncated or not safetensors: header length {n}, file size {size}"
        )
    return n


def parse_header(raw: bytes, size: int) -> tuple[list[Entry], dict[str, str]]:
    """Check the JSON header (`raw`, after the 8-byte prefix) of a file of `size` bytes."""
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SafetensorsFormatError(f"has a corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise SafetensorsFormatError("has a corrupt safetensors header (not an object)")
    meta = header.pop("__metadata__", None) or {}
    start = 8 + len(raw)
    entries = []
    for name, info in header.items():
        try:
            code, shape, (b, e) = info["dtype"], info["shape"], info["data_offsets"]
            shape = tuple(int(d) for d in shape)
            b, e = int(b), int(e)
        except (KeyError, TypeError, ValueError):
            raise SafetensorsFormatError("has a corrupt header entry", name) from None
        if code not in ST_DTYPES:
            raise SafetensorsFormatError(f"has dtype {code!r}, which tessel cannot read", name)
        dtype = ST_DTYPES[code]
        nbytes = math.prod(shape) * dtype.itemsize
        if e - b != nbytes or b < 0 or min(shape, default=0) < 0:
            dt = dtype_name(dtype)
            raise SafetensorsFormatError(
                f"header says {e - b} bytes for shape {list(shape)} {dt}", name
            )
        if start + e > size:
            raise SafetensorsFormatError(
                f"is truncated: data ends at byte {start + e} but the file has {size}", name
            )
        entries.append(Entry(name, dtype, shape, start + b, start + e))
    return entries, {str(k): str(v) for k, v in meta.items()}


def read_tensors(stream: Stream, size: int, digest: Digest) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file of `size` bytes that `stream` is at, each read
    straight from the file into memory of its own (never a buffer of the whole file that the
    tensors view); `digest` takes every byte read, the whole file's where this returns.

    A tensor of its own is also what a matrix product reads fastest: on CPU, products over
    views into one buffer of the file ran 10-15% slower than over the same values copied."""
    prefix = bytearray(8)
    read_into(stream, memoryview(prefix)[: min(8, size)], digest)
    n = header_length(bytes(prefix[: min(8, size)]), size)
    raw = bytearray(n)
    read_into(stream, memoryview(raw), digest)
    entries, _ = parse_header(bytes(raw), size)
    at, out = 8 + n, {}
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.begin < at and e.end > e.begin:
            raise SafetensorsFormatError(
                f"overlaps the tensor before it: its bytes {e.begin} to {e.end}, the one "
                f"before ends at {at}",
                e.name,
            )
        skip(stream, e.begin - at, digest)
        tensor = torch.empty(e.shape, dtype=e.dtype)
        if tensor.numel():
            read_into(stream, tensor.reshape(-1).view(torch.uint8).numpy().data, digest)
        out[e.name] = tensor
        at = max(at, e.end)
    skip(stream, size - at, digest)
    return out
