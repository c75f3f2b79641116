"""Which part of a dimension a device holds.

A dimension split `count` ways is cut as torch.chunk cuts it, and as DTensor's Shard does:
every piece but the last holds ceil(size / count) rows, so where `count` does not divide the
size the last pieces are shorter or empty. Every stage that slices a tensor (lowering the
weights, loading a package, converting a checkpoint) cuts with these two functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the package reader uses this module without importing torch
    import torch

# a region of a tensor: one (start, stop) per dim, in whole-tensor coordinates
Box = tuple[tuple[int, int], ...]


def chunk_range(size: int, count: int, index: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` that piece ``index`` of ``count`` holds of ``size`` rows."""
    if not 0 <= index < count:
        raise IndexError(f"piece {index} of {count}")
    length = -(-size // count)
    start = min(index * length, size)
    return start, min(start + length, size)


def mesh_coordinate(rank: int, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major coordinate of `rank` in a mesh of `mesh_shape` (the last axis fastest)."""
    coord = []
    for n in reversed(mesh_shape):
        coord.append(rank % n)
        rank //= n
    return tuple(reversed(coord))


def mesh_rank(coordinate: Sequence[int], mesh_shape: Sequence[int]) -> int:
    """The rank at `coordinate` of a mesh of `mesh_shape` (row-major, as `mesh_coordinate`)."""
    rank = 0
    for c, n in zip(coordinate, mesh_shape):
        rank = rank * n + c
    return rank


def piece(tensor: torch.Tensor, dim: int, count: int, index: int) -> torch.Tensor:
    """Piece ``index`` of ``tensor`` cut ``count`` ways along ``dim`` (a view; maybe empty)."""
    start, stop = chunk_range(tensor.shape[dim], count, index)
    return tensor.narrow(dim, start, stop - start)
