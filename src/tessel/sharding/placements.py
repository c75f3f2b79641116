"""Which box of a tensor each rank holds under DTensor placements on a device mesh.

A box is one ``(start, stop)`` per tensor dim in whole-tensor coordinates. Each mesh dim whose
placement is ``Shard(d)`` cuts dim ``d`` of the box it is given, outer mesh dims first, as
DTensor lays shards out; Replicate and Partial leave the box whole. Lowering the weights,
packing them and reading them back all take their slices from `rank_box`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from tessel.sharding.geometry import Box, chunk_range, mesh_coordinate


def shard_chunks(
    placements: Sequence[Placement], mesh_shape: Sequence[int], rank: int
) -> list[tuple[int, int, int]]:
    """(dim, count, index) of each cut, outer mesh dim first, that takes `rank`'s shard out of
    the whole tensor."""
    return [
        (p.dim, n, c)
        for p, n, c in zip(placements, mesh_shape, mesh_coordinate(rank, mesh_shape))
        if isinstance(p, Shard)
    ]


def rank_box(
    shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int], rank: int
) -> Box:
    """The box of a tensor of `shape` that `rank` holds."""
    box = [(0, size) for size in shape]
    for dim, count, index in shard_chunks(placements, mesh_shape, rank):
        start, stop = box[dim]
        lo, hi = chunk_range(stop - start, count, index)
        box[dim] = (start + lo, start + hi)
    return tuple(box)


def local_shard(
    tensor: torch.Tensor, placements: Sequence[Placement], mesh_shape: Sequence[int], rank: int
) -> torch.Tensor:
    """The part of `tensor` that `rank` holds, contiguous."""
    out = tensor
    for dim, (start, stop) in enumerate(rank_box(tensor.shape, placements, mesh_shape, rank)):
        if (start, stop) != (0, tensor.shape[dim]):
            out = out.narrow(dim, start, stop - start)
    return out.contiguous()


def local_shard_shape(
    shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int], rank: int
) -> tuple[int, ...]:
    """The shape of `rank`'s shard, without touching data."""
    return tuple(b - a for a, b in rank_box(shape, placements, mesh_shape, rank))


def unnested(src: Sequence[Placement], dst: Sequence[Placement]) -> tuple[Placement, ...]:
    """The placements a move from `src` to `dst` passes through first.

    A tensor dim sharded over several mesh axes is cut outer axis first, so an axis's shard can
    only be undone once every later axis that shards the same dim is gathered: changing an
    axis gathers those inner axes too (DTensor cuts them again afterwards where `dst` keeps
    them). `src` itself where no such axis exists.
    """
    out = list(src)
    for m, (a, b) in enumerate(zip(src, dst)):
        if isinstance(a, Shard) and a != b:
            for k in range(m + 1, len(src)):
                if src[k] == a:
                    out[k] = Replicate()
    return tuple(out)


def placement_str(p: Placement) -> str:
    """`S(d)`, `R` or `P`: a placement as layouts and `tessel inspect` write it."""
    if isinstance(p, Shard):
        return f"S({p.dim})"
    name = type(p).__name__
    return {"Replicate": "R", "Partial": "P"}.get(name, name)


def placement_from_str(text: str) -> Placement:
    """The placement `placement_str` wrote: `S(d)` or `R` (a stored weight is never Partial)."""
    if text == "R":
        return Replicate()
    if text.startswith("S(") and text.endswith(")") and text[2:-1].isdigit():
        return Shard(int(text[2:-1]))
    raise ValueError(f"not a stored weight's placement: {text!r} (allowed: 'R', 'S(<dim>)')")
