"""How a sharded output reaches rank 0: the gathers each rank takes part in.

An output laid out over the mesh (each mesh axis sharding one of its dimensions, or leaving it
replicated) is brought whole to rank 0 one sharded mesh axis at a time, innermost first: along
each axis the ranks send their rows to the axis's first rank, which receives them into one
buffer in rank order. Shards nest outer axes first (as DTensor lays them out), so undoing the
innermost axis first leaves, on each axis's first rank, the shard of the axes not yet gathered.
The planner's memory model and the lowering both take their gathers from `gather_steps`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from tessel.sharding.geometry import mesh_coordinate, mesh_rank
from tessel.sharding.placements import local_shard_shape

# per mesh axis, the tensor dimension it shards (None: replicated)
Shards = tuple[int | None, ...]


def shard_placements(shards: Shards) -> tuple[Placement, ...]:
    return tuple(Replicate() if d is None else Shard(d) for d in shards)


def partial_to_shards(
    shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> Shards:
    """`placements` as shards: each partial placement becomes a shard of a dimension no other
    mesh axis shards and at least as long as the mesh axis (an even split first, then the
    longest), or replicated where there is none, so reducing it leaves no rank the whole sum."""
    taken = {p.dim for p in placements if isinstance(p, Shard)}
    out: list[int | None] = []
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, Shard):
            out.append(p.dim)
            continue
        if not p.is_partial():
            out.append(None)
            continue
        free = [d for d in range(len(shape)) if d not in taken and shape[d] >= n]
        free.sort(key=lambda d: (shape[d] % n != 0, -shape[d], d))
        out.append(free[0] if free else None)
        if free:
            taken.add(free[0])
    return tuple(out)


@dataclass(frozen=True)
class GatherStep:
    """One gather along mesh axis `axis` of the tensor's dimension `dim`: the group's ranks in
    order, each one's rows, and this rank's place in the group."""

    axis: int
    dim: int
    group: list[int]
    sizes: list[int]
    me: int


def gather_steps(
    shape: Sequence[int], shards: Shards, mesh_shape: Sequence[int], rank: int
) -> list[GatherStep]:
    """The gathers `rank` takes part in for an output of `shape` laid out as `shards`, in
    order, until it has sent its rows. A rank off the first row of a replicated axis holds a
    copy of what that row holds: it takes part in none."""
    coord = mesh_coordinate(rank, mesh_shape)
    if any(d is None and c != 0 for d, c in zip(shards, coord)):
        return []
    now = list(shards)
    out = []
    for axis in reversed(range(len(mesh_shape))):
        dim = now[axis]
        if dim is None:
            continue
        placements = shard_placements(tuple(now))
        group = [
            mesh_rank([*coord[:axis], j, *coord[axis + 1 :]], mesh_shape)
            for j in range(mesh_shape[axis])
        ]
        sizes = [local_shard_shape(shape, placements, mesh_shape, r)[dim] for r in group]
        out.append(GatherStep(axis, dim, group, sizes, coord[axis]))
        now[axis] = None
        if coord[axis] != 0:
            break
    return out
