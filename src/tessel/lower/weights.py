"""Slice full weights into each rank's local shard, as DTensor lays them out."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from tessel.sharding import piece


def mesh_coordinate(rank: int, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major coordinate of `rank` in a mesh of `mesh_shape`."""
    coord = []
    for n in reversed(mesh_shape):
        coord.append(rank % n)
        rank //= n
    return tuple(reversed(coord))


def shard_chunks(
    placements: tuple[Placement, ...], mesh_shape: tuple[int, ...], rank: int
) -> list[tuple[int, int, int]]:
    """(dim, count, index) of each `chunk` that cuts `rank`'s shard out of the whole tensor."""
    return [
        (p.dim, n, c)
        for p, n, c in zip(placements, mesh_shape, mesh_coordinate(rank, mesh_shape))
        if isinstance(p, Shard)
    ]


def local_shard(
    tensor: torch.Tensor, placements: tuple[Placement, ...], mesh_shape: tuple[int, ...], rank: int
) -> torch.Tensor:
    """The part of `tensor` that `rank` holds; Replicate and Partial keep the whole tensor."""
    out = tensor
    for dim, count, index in shard_chunks(placements, mesh_shape, rank):
        out = piece(out, dim, count, index)
    return out.contiguous()


def local_shard_shape(
    shape: torch.Size, placements: tuple[Placement, ...], mesh_shape: tuple[int, ...], rank: int
) -> tuple[int, ...]:
    """The shape of `rank`'s shard, without touching data."""
    return tuple(local_shard(torch.empty(shape, device="meta"), placements, mesh_shape, rank).shape)


def placement_str(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    name = type(p).__name__
    return {"Replicate": "R", "Partial": "P"}.get(name, name)
