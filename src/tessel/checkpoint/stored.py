"""A Hugging Face checkpoint directory as tensors read on demand, a box at a time.

`save_pretrained` writes `model.safetensors`, or shards named by `model.safetensors.index.json`
(its `weight_map`: tensor name -> file). `StoredWeights` reads only the headers; each
`StoredTensor` is a box of one stored tensor (`narrow` makes a smaller box without reading) whose
bytes are read by `detach()` straight into a new tensor, so a build that packs every rank's
slices one after another holds one slice at a time, never the model.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from tessel.checkpoint.errors import CheckpointError
from tessel.checkpoint.st_io import Piece, TensorLoc, fill, read_header
from tessel.dtypes import torch_dtype

INDEX = "model.safetensors.index.json"


class StoredTensor:
    """A box of a stored tensor: shape and dtype at once, bytes on `detach()`."""

    device = torch.device("cpu")

    def __init__(self, loc: TensorLoc, name: str, box: tuple[tuple[int, int], ...] | None = None):
        self.loc = loc
        self.name = name
        self.box = box if box is not None else tuple((0, n) for n in loc.shape)
        self.shape = torch.Size(b - a for a, b in self.box)
        self.dtype = torch_dtype(loc.dtype)

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.loc.itemsize

    def narrow(self, dim: int, start: int, length: int) -> StoredTensor:
        box = list(self.box)
        lo = box[dim][0] + start
        box[dim] = (lo, lo + length)
        return StoredTensor(self.loc, self.name, tuple(box))

    def contiguous(self) -> StoredTensor:
        return self  # a box is read into a new contiguous tensor

    def detach(self) -> torch.Tensor:
        """The box's values, read from the file now."""
        out = torch.empty(self.shape, dtype=self.dtype)
        whole = tuple((0, n) for n in self.shape)
        fd = os.open(self.loc.path, os.O_RDONLY)
        try:
            fill(out, Piece(self.loc, self.box, whole), fd, self.name)
        finally:
            os.close(fd)
        return out

    def __repr__(self) -> str:
        return f"StoredTensor({self.name!r}, box={self.box}, dtype={self.dtype})"


class StoredWeights:
    """The tensors of a checkpoint directory (or one safetensors file), by name."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        files = self._files()
        self.locs: dict[str, TensorLoc] = {}
        for file in files:
            locs, _ = read_header(file)
            for name, loc in locs.items():
                if name in self.locs:
                    raise CheckpointError(
                        str(file), name, f"is stored twice (also in {self.locs[name].path})"
                    )
                self.locs[name] = loc
        self._tensors: dict[str, StoredTensor] = {}

    def _files(self) -> list[Path]:
        if self.path.is_file():
            return [self.path]
        if not self.path.is_dir():
            raise CheckpointError(str(self.path), None, "is neither a directory nor a file")
        index = self.path / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(
                    str(index), "weight_map", f"expected an object of name -> file ({exc})"
                ) from None
            out = []
            for name in files:
                file = self.path / str(name)
                if file.parent != self.path or not file.is_file():
                    raise CheckpointError(
                        str(index), "weight_map", f"names a missing file {name!r}"
                    )
                out.append(file)
            return out
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                str(self.path), None, f"holds no {INDEX} and no .safetensors files"
            )
        return files

    def __contains__(self, name: str) -> bool:
        return name in self.locs

    def tensor(self, name: str) -> StoredTensor:
        """The whole stored tensor `name` (the same object each time, so ties stay ties)."""
        if name not in self._tensors:
            self._tensors[name] = StoredTensor(self.locs[name], name)
        return self._tensors[name]

    def nbytes(self) -> int:
        return sum(loc.nbytes for loc in self.locs.values())
