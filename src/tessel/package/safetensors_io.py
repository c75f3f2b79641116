"""Safetensors headers and a streaming writer, shared by offline models and checkpoints.

`safetensors` reads files and writes whole files or bytes; it has no writer onto an open stream
(a zip member here), and `safetensors.torch.save` to bytes copies every tensor twice. Writing the
header and then each tensor's bytes straight to the stream costs one pass over the data. Files
written here are read back with the `safetensors` library itself.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from typing import BinaryIO

import torch

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
        tdt = getattr(torch, dt)
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


def write_safetensors(out: BinaryIO, tensors: Mapping[str, torch.Tensor]) -> int:
    """Write `tensors` as one safetensors file onto the stream `out`; returns the bytes written."""
    if any(t.device.type != "cpu" for t in tensors.values()):
        tensors = {k: t.cpu() for k, t in tensors.items()}
    entries = [(k, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in tensors.items()]
    head, _ = build_header(entries, None)
    out.write(head)
    size = len(head)
    for t in tensors.values():
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        out.write(memoryview(data))
        size += data.nbytes
    return size
