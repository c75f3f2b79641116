"""Test helpers: an independent reference slicer and tiny checkpoint builders."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tessel.checkpoint.strategy import ParamLayout, Strategy, write_strategy
from tessel.parallel import Layout, save_strategy_file, shard_checkpoint


def _piece(t: torch.Tensor, k: int, dim: int, i: int) -> torch.Tensor:
    """Piece ``i`` of ``t`` cut into ``k`` along ``dim`` as torch.chunk cuts (empty past the end)."""
    pieces = t.chunk(k, dim=dim)
    return pieces[i] if i < len(pieces) else t.narrow(dim, t.shape[dim], 0)


def ref_slice(full: torch.Tensor, p: ParamLayout, index: int) -> torch.Tensor:
    """The slice device ``index`` holds, by nested chunking (outer axis first), not boxes.py."""
    coord = np.unravel_index(index, p.dev_matrix) if p.dev_matrix else ()
    n = len(p.dev_matrix)
    t = full
    for d, axes in enumerate(p.tensor_map):
        for a in axes:
            m = n - 1 - a
            t = _piece(t, p.dev_matrix[m], d, int(coord[m]))
    if p.opt_shard_size:
        t = _piece(t, p.opt_shard_size, 0, (index // p.opt_shard_step) % p.opt_shard_size)
    return t


def ref_rank_slices(full: dict[str, torch.Tensor], st: Strategy, rank: int) -> dict:
    out = {}
    for name in st.params_of_rank(rank):
        out[name] = ref_slice(full[name], st.params[name], st.holders(name)[rank])
    return out


def make_full(shapes: dict[str, tuple], seed: int = 0, dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, (n, s) in enumerate(shapes.items()):
        t = torch.randn(s, generator=g)
        out[n] = t.to(torch.bfloat16 if (dtype is None and i % 2) else (dtype or torch.float32))
    return out


def write_full(full: dict, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in full.items()}, str(directory / "model.safetensors"))
    return directory


def write_sharded(full: dict, st: Strategy, root: Path, name: str = "A") -> tuple[Path, Path]:
    """Write the full tensors as a distributed checkpoint of ``st``; returns (dir, strategy)."""
    hf = write_full(full, root / f"{name}_hf")
    sfile = root / f"{name}.json"
    write_strategy(st, sfile)
    shard_checkpoint(hf, root / name, sfile)
    return root / name, sfile


def load_rank(d: Path, rank: int, prefix: str = "checkpoint_") -> dict:
    return load_file(str(d / f"rank_{rank}" / f"{prefix}{rank}.safetensors"))


_ID = re.compile(rb'"tessel_checkpoint":"[0-9a-f]{32}"')


def blank_id(raw: bytes) -> bytes:
    """A safetensors file's bytes with the checkpoint id it records (made anew by every write)
    blanked, so two writes of the same tensors compare equal."""
    return _ID.sub(b'"tessel_checkpoint":"' + b"0" * 32 + b'"', raw, count=1)


def files_bytes(d: Path) -> dict[str, bytes]:
    """Every file under ``d`` by relative path, checkpoint ids blanked (``blank_id``)."""
    return {
        str(p.relative_to(d)): blank_id(p.read_bytes()) for p in sorted(d.rglob("*")) if p.is_file()
    }


def checkpoint_ids(d: Path) -> dict[str, str | None]:
    """The checkpoint id each safetensors file under ``d`` records (None: none), by path."""
    from tessel.checkpoint.st_io import read_header

    return {
        str(p.relative_to(d)): read_header(p)[1].get("tessel_checkpoint")
        for p in sorted(d.rglob("*.safetensors"))
    }


def metadata(path: Path) -> dict[str, str]:
    """A safetensors file's metadata, to write it again with its tensors edited."""
    from tessel.checkpoint.st_io import read_header

    return read_header(path)[1]


def prod(xs) -> int:
    return math.prod(xs)


# a small model's parameters, as the destination and publishing tests write them
SMALL_SHAPES = {"emb": (16, 8), "qkv": (24, 8), "out": (8, 24), "norm": (8,)}


def small_strategy(path: Path, dp: int, tp: int) -> Path:
    """`SMALL_SHAPES` laid out over `dp` x `tp` ranks (embedding and qkv by rows, out by
    columns, the norm replicated), saved at `path`."""
    lay = Layout((dp, tp), ("dp", "tp"))
    save_strategy_file(path, {
        "emb": (lay("tp", "None"), SMALL_SHAPES["emb"], "float32"),
        "qkv": (lay("tp", "None"), SMALL_SHAPES["qkv"], "float32"),
        "out": (lay("None", "tp"), SMALL_SHAPES["out"], "float32"),
        "norm": (lay("None"), SMALL_SHAPES["norm"], "float32"),
    })  # fmt: skip
    return path
