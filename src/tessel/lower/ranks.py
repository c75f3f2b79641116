"""Every rank's program from as few traces as the plan allows: ranks whose programs cannot
differ share one, moved to their place on the mesh; then a forward's outputs are brought to
rank 0 in each program and its peak measured with them."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import torch

from tessel.capture import CapturedModel
from tessel.lower.in_parallel import lower_ranks
from tessel.lower.outputs import gather_outputs, measured
from tessel.lower.program import RankProgram, matched_names, move_groups, rank_interpolation
from tessel.lower.trace import lower_rank, weight_inputs
from tessel.plan import Plan
from tessel.sharding.geometry import mesh_coordinate, mesh_rank
from tessel.sharding.placements import local_shard_shape

log = logging.getLogger(__name__)


def lower_every_rank(
    captured: CapturedModel, plan: Plan, world: int, reuse_layers: bool = True
) -> list[RankProgram]:
    """One program per rank; ranks whose programs cannot differ share one trace.

    A rank's program depends on its mesh coordinate through the size of its chunks (uneven
    splits leave the last ranks short), through offsets that grow with the coordinate (where a
    vocabulary shard starts), and through the groups of its collectives, which on a mesh of
    several axes are the ranks beside it on each axis. So when every rank holds weight chunks of
    one shape and the last rank's trace is the first's with its groups moved along the mesh,
    every rank runs the first's program with its groups moved to it; otherwise each rank is
    traced on its own. A forward's outputs are then gathered to rank 0 in each rank's program
    (`gather_outputs`: rank 0's departs from the others' there) and its peak measured with them.
    """
    shared = _lower_shards(captured, plan, world, reuse_layers)
    count = len(weight_inputs(captured, plan))
    # ranks whose shards' programs are one program share its gathers' measure, where those
    # gathers have one shape: their peaks are one
    peaks: dict[tuple, int] = {}
    out = []
    for rank, (rp, source) in enumerate(shared):
        rp = gather_outputs(rp, rank, plan.mesh_shape)
        tail = tuple(
            (n["target"], json.dumps(rp.shapes.get(n["name"])))
            for n in rp.program["nodes"][len(shared[rank][0].program["nodes"]) - 1 : -1]
        )
        key = (source, tail)
        if key not in peaks:
            peaks[key] = measured(rp, count).peak_bytes if tail else rp.peak_bytes
        out.append(replace(rp, peak_bytes=peaks[key]))
    return out


def _lower_shards(
    captured: CapturedModel, plan: Plan, world: int, reuse_layers: bool
) -> list[tuple[RankProgram, int]]:
    """Each rank's program returning its outputs' shards, and the rank whose trace it is made
    from (see `lower_every_rank`)."""

    def lower(rank: int) -> RankProgram:
        return lower_rank(captured, plan, rank, stitch=reuse_layers)

    if world == 1:
        return [(lower(0), 0)]
    first, last = lower_ranks(lower, [0, world - 1])
    if _even_weight_shards(captured, plan, world):
        if _same_program(_moved(first, plan.mesh_shape, world - 1), last):
            moved = [(_moved(first, plan.mesh_shape, r), 0) for r in range(1, world - 1)]
            return [(first, 0), *moved, (last, world - 1)]
        between = _interpolated(first, last, plan.mesh_shape, world)
        if between is not None:
            return [(first, 0), *((b, 0) for b in between), (last, world - 1)]
    log.info("rank programs differ; tracing each of the %d ranks", world)
    middle = lower_ranks(lower, range(1, world - 1))
    return [(first, 0), *((p, r) for r, p in enumerate(middle, 1)), (last, world - 1)]


def _interpolated(
    first: RankProgram, last: RankProgram, mesh_shape: tuple[int, ...], world: int
) -> list[RankProgram] | None:
    """The programs of ranks 1 .. world - 2 of a 1-D mesh whose first and last programs
    differ only in integers growing by a step per rank (`rank_interpolation`), with the same
    local shapes and constants; None otherwise."""
    if len(mesh_shape) != 1 or first.constants.keys() != last.constants.keys():
        return None
    if not all(torch.equal(first.constants[k], last.constants[k]) for k in first.constants):
        return None
    program = rank_interpolation(first.program, last.program, world)
    if program is None or len(first.shapes) != len(last.shapes):
        return None
    names = matched_names(first.program, last.program)
    if any(first.shapes.get(names.get(n, n)) != v for n, v in last.shapes.items()):
        return None
    return [replace(first, program=program(r)) for r in range(1, world - 1)]


def _moved(program: RankProgram, mesh_shape: tuple[int, ...], rank: int) -> RankProgram:
    """Rank 0's `program` as `rank` runs it: each group shifted on the mesh by `rank`'s
    coordinate (rank 0's group along some axes becomes `rank`'s group along the same axes)."""
    if rank == 0 or len(mesh_shape) == 1:  # on one axis every group is the whole mesh
        return program
    shift = mesh_coordinate(rank, mesh_shape)

    def rank_map(q: int) -> int:
        moved = [(c + s) % n for c, s, n in zip(mesh_coordinate(q, mesh_shape), shift, mesh_shape)]
        return mesh_rank(moved, mesh_shape)

    return replace(program, program=move_groups(program.program, rank_map))


def _even_weight_shards(captured: CapturedModel, plan: Plan, world: int) -> bool:
    ep = captured.program
    state = {**ep.state_dict, **ep.constants}
    placeholders = {n.name: n for n in ep.graph_module.graph.nodes if n.op == "placeholder"}
    for ph, fqn in weight_inputs(captured, plan):
        placements = plan.out_placements(placeholders[ph])
        shapes = {
            local_shard_shape(state[fqn].shape, placements, plan.mesh_shape, r)
            for r in range(world)
        }
        if len(shapes) > 1:
            return False
    return True


def _same_program(a: RankProgram, b: RankProgram) -> bool:
    return (
        a.program == b.program
        and a.constants.keys() == b.constants.keys()
        and all(torch.equal(a.constants[k], b.constants[k]) for k in a.constants)
    )
