"""Checkpoint sources: where every stored slice of every parameter lies.

A source answers, per parameter: full shape, dtype, and the distinct stored chunks (boxes), each
with the holders (ranks or files) that have a copy. Three kinds:

* ``RankSource``: per-rank safetensors files + a strategy file (tessel's and MindSpore's layout);
* ``DCPSource``: a torch.distributed.checkpoint directory (chunks from its metadata);
* ``FullSource``: full tensors in safetensors files (a Hugging Face directory or unified output).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from tessel.checkpoint.boxes import Box, check_tiling, device_box, distinct_boxes, slice_shape
from tessel.checkpoint.errors import CheckpointError
from tessel.checkpoint.identity import check_strategy, common_id
from tessel.checkpoint.publish import aside_copy
from tessel.checkpoint.st_io import TensorLoc, read_header
from tessel.checkpoint.strategy import ParamLayout, Strategy

Holder = int | str


@dataclass
class Chunk:
    box: Box
    holders: list[Holder]


class Source:
    """Interface: names(), info(name) -> (shape, dtype), chunks(name), loc(name, chunk, holder)."""

    label = "source"
    kind = "source"
    checkpoint_id: str | None = None  # the id its files record (see identity), if they do

    def names(self) -> list[str]:
        raise NotImplementedError

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        raise NotImplementedError

    def chunks(self, name: str) -> list[Chunk]:
        raise NotImplementedError

    def loc(self, name: str, chunk: Chunk, holder: Holder) -> TensorLoc:
        raise NotImplementedError

    def holder_files(self) -> list[str]:
        return []


class _HeaderCache:
    """Each file's header, read once: its tensors and its metadata."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[dict[str, TensorLoc], dict[str, str]]] = {}

    def get(self, path: str) -> dict[str, TensorLoc]:
        return self.read(path)[0]

    def meta(self, path: str) -> dict[str, str]:
        return self.read(path)[1]

    def read(self, path: str) -> tuple[dict[str, TensorLoc], dict[str, str]]:
        if path not in self._cache:
            self._cache[path] = read_header(path)
        return self._cache[path]


def _missing(directory: str | os.PathLike, what: str) -> CheckpointError:
    """A checkpoint directory that does not exist, saying where an interrupted write on a file
    system without an atomic exchange left its old tree, if one did."""
    aside = aside_copy(directory)
    if aside is None:
        return CheckpointError(str(directory), None, f"{what} does not exist")
    return CheckpointError(
        str(directory), None, f"{what} does not exist: a write interrupted between its two "
        f"renames left the old checkpoint complete at {aside}; the next tessel run writing "
        "this directory puts it back (or move it back by hand)",
    )  # fmt: skip


def _rank_num(name: str) -> int | None:
    m = re.fullmatch(r"rank_(\d+)", name)
    return int(m.group(1)) if m else None


def find_rank_files(src_dir: str | os.PathLike) -> dict[int, str]:
    """``{rank: file}`` for ``src_dir/rank_{r}/*.safetensors`` (the last file in name order)."""
    src = Path(src_dir)
    if not src.is_dir():
        raise _missing(src_dir, "checkpoint directory")
    out: dict[int, str] = {}
    for d in sorted(src.iterdir()):
        r = _rank_num(d.name)
        if r is None or not d.is_dir():
            continue
        files = sorted(d.glob("*.safetensors"), key=_natural_key)
        if files:
            out[r] = str(files[-1])
    return out


def _natural_key(p: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


class RankSource(Source):
    """Per-rank safetensors files laid out by a strategy."""

    label = "rank"
    kind = "rank"

    def __init__(self, strategy: Strategy, files: dict[int, str]) -> None:
        self.strategy = strategy
        self.files = dict(files)
        first = next(iter(self.files.values()), None)
        self.label = str(Path(first).parent.parent) if first else strategy.source
        self._headers = _HeaderCache()
        self._resolved: dict[str, ParamLayout] = {}
        self._check_files()

    def _check_files(self) -> None:
        """Refuse files that are not one checkpoint of this strategy, naming the file: a rank
        the strategy does not have, files recording two checkpoints' ids or another strategy's
        digest (see identity), a tensor whose stored slice is not the one the strategy gives its
        rank (what is left to check for files that record no id, MindSpore's)."""
        if not self.files:
            return
        world = self.strategy.world_size
        extra = sorted(r for r in self.files if r >= world)
        if extra:
            raise CheckpointError(
                self.files[extra[0]], None, f"is a file of rank {extra[0]}, but the strategy "
                f"({self.strategy.source}) has {world} ranks (0..{world - 1}): the files are "
                "not one checkpoint of this strategy",
            )  # fmt: skip
        metas = {r: self._headers.meta(f) for r, f in self.files.items()}
        self.checkpoint_id = common_id(self.files, metas)
        check_strategy(self.files, metas, self.strategy)
        holders: dict[str, dict[int, int]] = {}
        for r, path in sorted(self.files.items()):
            for name, loc in self._headers.get(path).items():
                if name not in self.strategy.params:
                    continue
                if name not in holders:
                    holders[name] = self.strategy.holders(name)
                if r not in holders[name]:
                    continue
                p = self.layout(name)
                assert p.shape is not None
                want = slice_shape(device_box(p, holders[name][r], p.shape))
                if (loc.shape, loc.dtype) != (want, p.dtype):
                    raise CheckpointError(
                        path, name, f"is stored as {loc.dtype}{list(loc.shape)}, but the "
                        f"strategy ({self.strategy.source}) gives rank {r} the slice "
                        f"{p.dtype}{list(want)}: the file is not of a checkpoint of this "
                        "strategy",
                    )  # fmt: skip

    def names(self) -> list[str]:
        return list(self.strategy.params)

    def holder_files(self) -> list[str]:
        return list(self.files.values())

    def _file(self, rank: int, name: str) -> str:
        if rank not in self.files:
            raise CheckpointError(
                f"rank_{rank}", name, f"no checkpoint file for source rank {rank}"
            )
        return self.files[rank]

    def layout(self, name: str) -> ParamLayout:
        """The parameter's layout with shape and dtype filled in from the files if needed."""
        if name in self._resolved:
            return self._resolved[name]
        p = self.strategy.params[name]
        if p.shape is None or p.dtype is None:
            holders = self.strategy.holders(name)
            avail = [r for r in holders if r in self.files]
            if not avail:
                raise CheckpointError(
                    self.strategy.source,
                    name,
                    f"shape/dtype are not in the strategy and none of ranks "
                    f"{sorted(holders)[:8]} has a file to take them from",
                )
            r = avail[0]
            path = self.files[r]
            hdr = self._headers.get(path)
            if name not in hdr:
                raise CheckpointError(path, name, "parameter is missing from this rank's file")
            local = hdr[name].shape
            splits = list(p.splits())
            if splits:
                splits[0] *= p.opt_shard_size or 1
            if len(local) != len(splits):
                raise CheckpointError(
                    path,
                    name,
                    f"stored with {len(local)} dims but the strategy's tensor map has "
                    f"{len(splits)}",
                )
            shape = tuple(s * k for s, k in zip(local, splits, strict=False))
            p = replace(p, shape=p.shape or shape, dtype=p.dtype or hdr[name].dtype)
        check_tiling(name, p, self.strategy.source)
        self._resolved[name] = p
        return p

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        p = self.layout(name)
        return p.shape, p.dtype  # type: ignore[return-value]

    def chunks(self, name: str) -> list[Chunk]:
        p = self.layout(name)
        holders = self.strategy.holders(name)
        by_index = {i: [] for i in range(p.device_num)}
        for r, i in sorted(holders.items()):
            by_index[i].append(r)
        out = []
        for box, idxs in distinct_boxes(p, p.shape).items():
            out.append(Chunk(box, sorted(r for i in idxs for r in by_index[i])))
        return out

    def loc(self, name: str, chunk: Chunk, holder: Holder) -> TensorLoc:
        path = self._file(int(holder), name)
        hdr = self._headers.get(path)
        if name not in hdr:
            raise CheckpointError(path, name, "parameter is missing from this rank's file")
        loc = hdr[name]
        p = self.layout(name)
        want = slice_shape(chunk.box)
        if loc.shape != want:
            raise CheckpointError(
                path,
                name,
                f"stored slice has shape {list(loc.shape)} but the strategy "
                f"({self.strategy.source}) gives {list(want)} for rank {holder}",
            )
        if loc.dtype != p.dtype:
            raise CheckpointError(
                path, name, f"stored dtype is {loc.dtype} but the strategy says {p.dtype}"
            )
        return loc


class FullSource(Source):
    """Full (unsharded) tensors in safetensors files, e.g. a Hugging Face model directory."""

    label = "file"
    kind = "full"

    def __init__(self, directory: str | os.PathLike) -> None:
        d = Path(directory)
        if not d.is_dir():
            raise _missing(directory, "directory")
        index = d / "model.safetensors.index.json"
        files: list[Path]
        if index.is_file():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(str(index), "weight_map", f"unreadable index: {e}") from None
            files = sorted({d / f for f in wm.values()})
        else:
            files = sorted(d.glob("*.safetensors"), key=_natural_key)
        if not files:
            raise CheckpointError(str(directory), None, "holds no .safetensors files")
        self.locs: dict[str, TensorLoc] = {}
        metas: dict[str, dict[str, str]] = {}
        for f in files:
            locs, metas[str(f)] = read_header(f)
            for name, loc in locs.items():
                if name in self.locs:
                    raise CheckpointError(
                        str(f), name, f"tensor also appears in {self.locs[name].path}"
                    )
                self.locs[name] = loc
        self.checkpoint_id = common_id({f: f for f in metas}, metas)
        self.directory = str(d)
        self.label = self.directory

    def names(self) -> list[str]:
        return list(self.locs)

    def holder_files(self) -> list[str]:
        return sorted({loc.path for loc in self.locs.values()})

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        loc = self.locs[name]
        return loc.shape, loc.dtype

    def chunks(self, name: str) -> list[Chunk]:
        loc = self.locs[name]
        return [Chunk(tuple((0, s) for s in loc.shape), [loc.path])]

    def loc(self, name: str, chunk: Chunk, holder: Holder) -> TensorLoc:
        return self.locs[name]


class DCPSource(Source):
    """A torch.distributed.checkpoint directory; chunk boxes come from its metadata."""

    label = "dcp"
    kind = "dcp"

    def __init__(self, directory: str | os.PathLike) -> None:
        from tessel.checkpoint.dcp import read_dcp_metadata

        self.directory = str(directory)
        self.label = self.directory
        meta = read_dcp_metadata(directory)
        self._storage: dict[tuple[str, tuple[int, ...]], object] = {}
        for idx, info in (meta.storage_data or {}).items():
            off = tuple(idx.offset) if idx.offset is not None else None
            self._storage[(idx.fqn, off)] = info
        self._meta: dict[str, tuple[tuple[int, ...], str, list]] = {}
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        for fqn, md in meta.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                continue  # non-tensor entries (BytesIO objects) are not parameters
            from tessel.checkpoint.strategy import checked_dtype_name

            shape = tuple(int(s) for s in md.size)
            self._meta[fqn] = (shape, checked_dtype_name(md.properties.dtype), md.chunks)
        self._locs: dict[tuple[str, Box], TensorLoc] = {}
        for f in self.holder_files():  # every rank's data file its metadata names
            if not os.path.isfile(f):
                raise CheckpointError(
                    f, None, f"is named by {Path(self.directory) / '.metadata'} but does not "
                    "exist: the directory does not hold the whole checkpoint",
                )  # fmt: skip

    def names(self) -> list[str]:
        return list(self._meta)

    def holder_files(self) -> list[str]:
        files = set()
        for info in self._storage.values():
            files.add(str(Path(self.directory) / info.relative_path))
        return sorted(files)

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        shape, dt, _ = self._meta[name]
        return shape, dt

    def chunks(self, name: str) -> list[Chunk]:
        shape, _, chunks = self._meta[name]
        out = []
        for c in chunks:
            off = tuple(int(x) for x in c.offsets)
            box = tuple((o, o + int(s)) for o, s in zip(off, c.sizes, strict=False))
            info = self._storage.get((name, off))
            if info is None and not shape:
                info = self._storage.get((name, None))
            if info is None:
                raise CheckpointError(
                    self.directory, name, f"metadata lists chunk at {list(off)} with no storage"
                )
            out.append(Chunk(box, [str(Path(self.directory) / info.relative_path)]))
        return out

    def loc(self, name: str, chunk: Chunk, holder: Holder) -> TensorLoc:
        key = (name, chunk.box)
        if key not in self._locs:
            from tessel.checkpoint.dcp import locate_chunk

            off = tuple(a for a, _ in chunk.box)
            info = self._storage.get((name, off)) or self._storage.get((name, None))
            path = str(holder)
            try:
                with open(path, "rb") as f:
                    f.seek(int(info.offset))
                    magic = f.read(4)
            except FileNotFoundError:
                raise CheckpointError(path, name, "DCP data file does not exist") from None
            if magic == b"PK\x03\x04":  # default TORCH_SAVE format: a zip per chunk
                loc = locate_chunk(path, int(info.offset), int(info.length), name)
            else:  # SAFETENSORS format: each data file is a safetensors file keyed by fqn
                hdr = read_header(path)[0]
                if name not in hdr:
                    raise CheckpointError(
                        path, name, "is neither a torch.save chunk nor in a safetensors file"
                    )
                loc = hdr[name]
            want = slice_shape(chunk.box)
            if loc.shape != want and not (loc.shape == () and want == ()):
                raise CheckpointError(
                    str(holder),
                    name,
                    f"chunk has shape {list(loc.shape)}, metadata says {list(want)}",
                )
            if loc.dtype != self._meta[name][1]:
                raise CheckpointError(
                    str(holder),
                    name,
                    f"chunk dtype {loc.dtype} differs from metadata {self._meta[name][1]}",
                )
            self._locs[key] = loc
        return self._locs[key]


def is_dcp_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / ".metadata").is_file()
