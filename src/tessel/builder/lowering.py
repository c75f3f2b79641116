"""Plan, then lower every rank exactly as planned: the step the inference build and the
training build both take."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace

import torch

from tessel.capture import CapturedModel
from tessel.config.cluster import ClusterConfig
from tessel.config.parallel_option import ParallelOption
from tessel.lower.in_parallel import lower_ranks
from tessel.lower.outputs import gather_outputs, measured
from tessel.lower.program import matched_names, move_groups, rank_interpolation
from tessel.lower.trace import LoweringError, NotAsPlanned, RankProgram, lower_rank, weight_inputs
from tessel.plan import Plan, PlanError, make_plan
from tessel.plan.strategies import describe_strategy, strategy_key
from tessel.progress import phase
from tessel.sharding.geometry import mesh_coordinate, mesh_rank
from tessel.sharding.placements import local_shard_shape

log = logging.getLogger(__name__)


MAX_REPLANS = 25


def plan_and_lower(
    captured: CapturedModel,
    cluster: ClusterConfig,
    policy: ParallelOption | None = None,
    *,
    time_limit: float = 60.0,
    reuse_layers: bool = True,
    timings: dict[str, float] | None = None,
    reserve: int = 0,
    first: Plan | None = None,
    lowered: list[RankProgram] | None = None,
) -> tuple[Plan, list[RankProgram]]:
    """Plan for `cluster`, then lower every rank exactly as planned.

    Where DTensor cannot run a node the way the plan places it, that strategy is dropped from
    the node's candidates and the model is planned again, so the program always is the plan;
    each such re-plan is recorded in the plan for `tessel inspect`. Where a lowered program
    would hold more than its device's memory (buffers the memory model does not see), the
    model is planned again with that much kept free; `reserve` bytes are kept free from the
    start (what the caller adds to the programs afterwards). `first` is a plan already made
    for this cluster, policy and reserve (the one `auto` weighed): it is lowered as it is, or,
    with `lowered`, its programs are those (the ones this function returned with it).
    """
    policy = policy or ParallelOption()
    timings = {} if timings is None else timings
    world = cluster.world_size
    banned: dict[str, set] = {}
    replanned: list[dict[str, str]] = list(first.replanned) if lowered and first else []
    device_bytes = min(d.memory_bytes for d in cluster.devices)
    # bytes to keep free: `fits_below` too few (a program overflowed), `too_many` leaves no plan
    fits_below, too_many = 0, None
    for _ in range(MAX_REPLANS + 1):
        try:
            if first is not None:
                plan, first = first, None
            else:
                with phase(
                    f"planning {len(captured.program.graph.nodes)} nodes on {world} devices"
                ):
                    plan = make_plan(
                        captured, cluster, policy, time_limit, banned=banned, reserve=reserve
                    )
        except PlanError:
            if reserve <= fits_below + 1:
                raise
            too_many = reserve
            reserve = (fits_below + too_many) // 2
            continue
        for step in ("strategies", "solve"):
            timings[step] = timings.get(step, 0.0) + plan.timings.get(step, 0.0)
        t = time.perf_counter()
        try:
            if lowered is not None:
                programs, lowered = lowered, None
            else:
                with phase(f"lowering the program of each of {world} ranks"):
                    programs = _lower_all(captured, plan, world, reuse_layers)
        except NotAsPlanned as exc:
            before = {owner: set(keys) for owner, keys in banned.items()}
            for node, strategy, reason in exc.failures:
                owner = (plan.choices[node].owner or node).name
                key = strategy_key(strategy)
                if key in before.get(owner, set()):
                    raise LoweringError(f"{exc} (that strategy was dropped already)") from exc
                if key in banned.get(owner, set()):
                    continue
                banned.setdefault(owner, set()).add(key)
                replanned.append(
                    {
                        "node": node.name,
                        "op": str(node.target),
                        "strategy": describe_strategy(strategy),
                        "reason": reason,
                    }
                )
                log.info("re-planning %s without %s: %s", owner, key, reason)
            continue
        finally:
            timings["lower"] = timings.get("lower", 0.0) + time.perf_counter() - t
        worst = max(p.peak_bytes for p in programs)
        if worst > device_bytes:
            # keep free what the programs hold beyond what the memory model counted, and plan
            # again. The next plan's programs may hold a different excess, so the reserve goes
            # halfway there (at least past the overflow), and back down where it leaves no plan
            fits_below = reserve
            excess = worst - plan.memory["peak_bytes"]
            reserve += max(worst - device_bytes, (excess - reserve) // 2)
            if too_many is not None:
                reserve = min(reserve, (fits_below + too_many) // 2)
            if reserve <= fits_below:
                reserve = fits_below + 1
            replanned.append(
                {
                    "node": "(memory)",
                    "op": "",
                    "strategy": f"keep {reserve} bytes free",
                    "reason": f"a lowered program holds {worst} bytes at its peak, more than "
                    f"the {device_bytes} bytes of its device",
                }
            )
            log.info("re-planning with %d bytes kept free: a program needs %d", reserve, worst)
            continue
        plan.replanned = replanned
        return plan, programs
    raise LoweringError(
        f"the plan still cannot be lowered after {MAX_REPLANS} re-plans; last: {replanned[-1]}"
    )


def _lower_all(
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
    from (see `_lower_all`)."""

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
