"""`tessel.build`: a model, a cluster and a policy become one offline model."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import Replicate

from tessel import __version__ as tessel_version
from tessel._torch import is_fake, tree_leaves
from tessel.builder.mesh_choice import (
    batch_rows,
    choose_mesh,
    first_devices,
    gather_seconds,
    gathered_bytes,
    replica_batch,
    wants_choice,
)
from tessel.builder.stages import (
    StageMemoryError,
    build_stages,
    default_micro_batches,
    more_memory,
    send_seconds,
)
from tessel.builder.training import build_training
from tessel.builder.verify import check_against_eager, worth_checking
from tessel.builder.weights import streamed_weights
from tessel.capture import CapturedModel, capture
from tessel.capture.export import split_inputs
from tessel.capture.held import check_weights_present
from tessel.config.cluster import (
    ClusterConfig,
    cluster_from_dict,
    local_cluster,
    read_cluster_config,
)
from tessel.config.errors import ConfigError
from tessel.config.mesh import POLICY_KEYS, parallel_dims
from tessel.config.parallel_option import ParallelOption, read_parallel_option
from tessel.log_levels import torch_kept_quiet
from tessel.lower.in_parallel import lower_ranks
from tessel.lower.outputs import gather_outputs, measured
from tessel.lower.program import (
    collectives,
    groups_in,
    matched_names,
    move_groups,
    rank_interpolation,
)
from tessel.lower.stages import StagedProgram
from tessel.lower.trace import (
    LoweringError,
    NotAsPlanned,
    RankProgram,
    lower_rank,
    weight_inputs,
)
from tessel.package.format import (
    CONSTANT_PREFIX,
    FORMAT,
    FORMAT_VERSION,
    BuiltPackage,
    Manifest,
    Member,
    write_package,
)
from tessel.plan import Plan, PlanError, has_rule, make_plan
from tessel.plan.planner import layer_name, run_seconds
from tessel.plan.strategies import describe_strategy, strategy_key
from tessel.plan.why import replicated_weights
from tessel.plan.why import summary as why_summary
from tessel.progress import phase
from tessel.sharding.geometry import mesh_coordinate, mesh_rank
from tessel.sharding.placements import local_shard, local_shard_shape, placement_str, shard_chunks
from tessel.summary import build_summary

log = logging.getLogger(__name__)


@dataclass
class BuiltModel:
    """An offline model held in memory until `save` writes it."""

    manifest: Manifest
    members: dict[str, Member]  # bytes, or tensors that `save` streams as safetensors
    timings: dict[str, float] = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        t = time.perf_counter()
        with phase(f"writing {path}"):
            out = write_package(path, self.manifest, self.members)
        self.timings["save"] = time.perf_counter() - t
        self.manifest = replace(self.manifest, timings=dict(self.timings))  # for the report
        return out

    def __repr__(self) -> str:
        return build_summary(self.manifest)


def save(model: BuiltModel, path: str | Path) -> Path:
    """Write an offline model to `path` (the `.tessel` suffix is added if missing)."""
    return model.save(path)


@contextlib.contextmanager
def _cycle_collection_paused() -> Iterator[None]:
    """Python's collector of reference cycles paused while a build runs.

    A build makes millions of objects that live as long as it does (graph nodes, fake tensors,
    DTensor specs); every full collection walks all of them and frees little (a tenth of the
    training build of a 32-layer GPT-2 went to them). What cycles a build leaves behind are
    collected after it, as usual.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@_cycle_collection_paused()
@torch_kept_quiet()
def build(
    model: torch.nn.Module | torch.export.ExportedProgram,
    example_inputs: Any = None,
    *,
    cluster: ClusterConfig | str | Path | dict | int | None = None,
    policy: ParallelOption | str | Path | None = None,
    soc_version: str = "cpu",
    graph_parallel: bool = True,
    example_kwargs: dict | None = None,
    time_limit: float = 60.0,
    reuse_layers: bool = True,
    verify: bool | None = None,
    weights: str | Path | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    param_dtype: torch.dtype | str | None = None,
) -> BuiltModel:
    """Build an offline model for `cluster`.

    With `graph_parallel` the planner shards every node over the cluster's devices (ATC's
    algorithm-based partitioning, `--enable_graph_parallel`); without it the whole model is
    deployed to every device and runs are load-balanced over the replicas. `reuse_layers=False` traces every layer of a
    stack of identical layers, in capture and in lowering, instead of tracing one and copying it.
    With `verify` the built model runs on the example inputs in this process and must agree with
    the eager model, or `VerifyError` is raised and nothing is returned; it costs one forward pass
    of the model plus one of every device's share. By default (None) the check runs where the
    cost model puts it below what the build took, and the plan says when it was skipped.

    With `weights` (a checkpoint directory as `save_pretrained` writes it, or a safetensors
    file), `model` may hold its parameters on the meta device (`tessel.empty_weights()`): it is
    captured and planned from shapes alone, and each rank's slices are read from the checkpoint
    as the package is written, so the build never holds the model. There is then no eager model
    to check against (`verify` must not be true).

    With `optimizer` (torch.optim SGD, Adam or AdamW over the model's parameters), the package
    holds a training step instead: the model's forward must return a scalar loss, and each
    `Session.run_graph` runs forward, backward and the optimizer's update, returning the loss
    (see `tessel.builder.training`). `param_dtype` (torch.bfloat16) makes the step compute in
    bf16 over fp32 master weights, optimizer states and gradient exchange, as FSDP2's
    `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)` does; by
    default the step computes in the dtype of the model's parameters (fp32 or bf16).
    """
    timings: dict[str, float] = {}
    stored = None
    if weights is not None:
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(
                "weights", None, "streams into an nn.Module (its parameters on the meta device)"
            )
        if verify:
            raise ConfigError(
                "verify", None, "needs the model's weights in memory; they are streamed here"
            )
        stored = streamed_weights(model, weights)
        verify = False
    elif isinstance(model, torch.nn.Module):
        check_weights_present(model)
    cluster = cluster_config(cluster, soc_version)
    if isinstance(policy, (str, Path)):
        policy = read_parallel_option(policy, cluster.world_size)
    policy = policy or ParallelOption()
    if param_dtype is not None and optimizer is None:
        raise ConfigError("build()", "param_dtype", "is taken with optimizer= (a training step)")
    if optimizer is not None:
        if weights is not None or verify or not graph_parallel:
            given = "weights" if weights is not None else "verify" if verify else "graph_parallel"
            raise ConfigError("build()", given, "is not taken with optimizer= (a training step)")
        manifest, members, timings = build_training(
            model,
            example_inputs,
            example_kwargs,
            optimizer,
            cluster,
            policy,
            soc_version,
            time_limit,
            param_dtype,
        )
        manifest["timings"] = timings
        return BuiltModel(
            Manifest.from_json(manifest, "the built model", members), members, timings
        )
    if policy.training_keys:
        raise ConfigError(
            policy.source,
            f"graph_parallel_option.{policy.training_keys[0]}",
            "is a training setting: build a training step (tessel.build(..., optimizer=opt), or "
            "a --model function returning (module, example_inputs, optimizer)), or remove it",
        )
    dims = parallel_dims(cluster, policy)
    dp, pp = dims.size("dp"), dims.size("pp")
    for axis, size in (("dp", dp), ("pp", pp)):
        if size > 1 and (not graph_parallel or isinstance(model, CapturedModel)):
            key = POLICY_KEYS[axis]
            raise ConfigError(
                policy.source,
                f"graph_parallel_option.{key}",
                f"is {size}: {'data parallelism' if axis == 'dp' else 'pipeline stages'} need "
                "graph_parallel and the model itself (not a captured model), whose example batch "
                "it splits",
            )
    micro_batches = 1

    t = time.perf_counter()
    whole_batch, weighed, weighed_plan = None, None, None
    if isinstance(model, CapturedModel):
        captured = model
    else:
        args, kwargs = split_inputs(example_inputs, example_kwargs)
        if graph_parallel and wants_choice(cluster, policy, model):
            with phase("weighing the mesh shapes the cluster allows"):
                choice = choose_mesh(
                    model,
                    args,
                    kwargs,
                    cluster,
                    policy,
                    reuse_layers=reuse_layers,
                    time_limit=time_limit,
                )
            dims, captured, weighed = choice.dims, choice.captured, choice.weighed
            weighed_plan = choice.plan
            dp, pp, micro_batches = dims.size("dp"), dims.size("pp"), choice.micro_batches
        else:
            if pp > 1:
                micro_batches = policy.micro_batch_num or default_micro_batches(
                    pp, batch_rows(args, kwargs) // dp
                )
            parts = dp * micro_batches
            split = (
                replica_batch(args, kwargs, dp, policy.source, micro_batches)
                if parts > 1
                else (args, kwargs)
            )
            with phase("capturing the model"):
                captured = capture(model, *split, keep=has_rule, reuse_layers=reuse_layers)
        if dp * micro_batches > 1:
            whole_batch = args, kwargs
    timings["capture"] = time.perf_counter() - t

    plan_cluster = cluster if graph_parallel else local_cluster(1, soc_version)
    if dp * pp > 1:
        plan_cluster = first_devices(cluster, dims.size("tp"))
    staged, stages = None, None
    # a stage holds about 1/pp of the weights: the model is planned on its devices with pp
    # times their memory, then less where a stage overflows its devices (bisecting between
    # the most memory that overflows and the least that leaves no plan)
    scale, overflows, no_plan, tries = float(pp), None, 1.0, 0
    reserve = gathered_bytes(captured, dp, micro_batches)  # rank 0 puts the outputs together
    while True:
        first, weighed_plan = weighed_plan, None  # a second try plans anew
        try:
            plan, programs = plan_and_lower(
                captured,
                more_memory(plan_cluster, scale) if pp > 1 else plan_cluster,
                policy,
                time_limit=time_limit,
                reuse_layers=reuse_layers,
                timings=timings,
                reserve=reserve,
                first=first,
            )
        except PlanError:
            if overflows is None or overflows - scale < 0.02:
                raise
            no_plan, scale = scale, (scale + overflows) / 2
            continue
        if pp * dp == 1:
            break
        t = time.perf_counter()
        try:
            with phase("making every rank's stage program"):
                staged, stages = build_stages(
                    captured, plan, programs, cluster, dims, micro_batches, policy.source
                )
        except StageMemoryError as exc:
            if pp == 1:  # rank 0 also holds the other replicas' outputs: keep that free
                tries += 1
                if tries > 3:
                    raise
                reserve += exc.needed - exc.limit
                continue
            if scale - no_plan < 0.02:
                raise
            overflows = scale
            scale = max((scale + no_plan) / 2, min(scale * 0.9, scale * exc.limit / exc.needed))
            log.info("a stage overflows its devices: planning with %.2fx their memory", scale)
            continue
        finally:
            timings["stages"] = timings.get("stages", 0.0) + time.perf_counter() - t
        programs = [sp.program for sp in staged]
        break
    t = time.perf_counter()
    with phase("packing"):
        manifest, members = _pack(
            captured,
            plan,
            programs,
            cluster,
            soc_version,
            graph_parallel,
            dp,
            staged=staged,
            pp=pp,
            micro_batches=micro_batches,
            stored=stored,
        )
    if stored is not None:
        manifest["plan"]["verify"] = {
            "skipped": f"weights streamed from {weights}: the build never held the model"
        }
    if stages is not None:
        manifest["plan"]["stages"] = [
            {**entry, "ranks": [r for r, sp in enumerate(staged) if sp.stage == entry["stage"]]}
            for entry in stages.to_json()
        ]
        # what the stages' programs hold, not the whole model the planner weighed on pp x memory
        manifest["plan"]["memory"] = {
            "weight_bytes": max(rp.weight_bytes for rp in programs),
            "peak_bytes": max(rp.peak_bytes for rp in programs),
            "device_bytes": min(d.memory_bytes for d in cluster.devices),
        }
        manifest["plan"]["micro_batches"] = micro_batches
        manifest["plan"]["estimated_time_s"] = stages.pipelined_seconds(
            micro_batches, send_seconds(staged, dims, cluster, micro_batches)
        )
    if dp > 1:  # the replicas run at once; then their outputs are gathered
        manifest["plan"]["estimated_time_s"] += gather_seconds(
            captured, dims, cluster, micro_batches
        )
    # what a run costs beside its programs: the session's pipe to rank 0, rank 0's broadcasts
    manifest["plan"]["estimated_time_s"] += run_seconds(captured, cluster)
    if weighed is not None:
        manifest["plan"]["mesh_choices"] = weighed
    timings["pack"] = time.perf_counter() - t
    if verify is not False and captured.source is not None:  # streamed weights: verify False
        skipped = (
            None
            if verify
            else worth_checking(captured, sum(timings.values()) / (dp * micro_batches))
        )
        if skipped is None:
            t = time.perf_counter()
            package = BuiltPackage(
                Manifest.from_json(manifest, "the built model", members), members
            )
            if whole_batch is None:
                inputs, expected = captured.example_inputs, captured.eager_outputs()
            else:
                inputs = [x for x in tree_leaves(whole_batch) if isinstance(x, torch.Tensor)]
                with torch.no_grad():
                    out = captured.source(*whole_batch[0], **whole_batch[1])
                expected = [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
            with phase("checking the built model against the eager one"):
                manifest["plan"]["verify"] = check_against_eager(package, inputs, expected)
            timings["verify"] = time.perf_counter() - t
        else:
            log.info("not checked against the eager model: %s", skipped)
            manifest["plan"]["verify"] = {"skipped": skipped}
    manifest["timings"] = timings
    # checked as a loader checks it, so a model that would be refused is never saved
    return BuiltModel(Manifest.from_json(manifest, "the built model", members), members, timings)


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
) -> tuple[Plan, list[RankProgram]]:
    """Plan for `cluster`, then lower every rank exactly as planned.

    Where DTensor cannot run a node the way the plan places it, that strategy is dropped from
    the node's candidates and the model is planned again, so the program always is the plan;
    each such re-plan is recorded in the plan for `tessel inspect`. Where a lowered program
    would hold more than its device's memory (buffers the memory model does not see), the
    model is planned again with that much kept free; `reserve` bytes are kept free from the
    start (what the caller adds to the programs afterwards). `first` is a plan already made
    for this cluster, policy and reserve (the one `auto` weighed): it is lowered as it is.
    """
    policy = policy or ParallelOption()
    timings = {} if timings is None else timings
    world = cluster.world_size
    banned: dict[str, set] = {}
    replanned: list[dict[str, str]] = []
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


def cluster_config(cluster: Any, soc_version: str) -> ClusterConfig:
    """The cluster `build` takes (a config file, its JSON, a ClusterConfig, a device count or
    None: 4 local devices) as a ClusterConfig."""
    if cluster is None:
        return local_cluster(4, soc_version)
    if isinstance(cluster, ClusterConfig):
        return cluster
    if isinstance(cluster, int) and not isinstance(cluster, bool):
        if cluster < 1:
            raise ConfigError("build()", "cluster", f"is {cluster} devices; give at least 1")
        return local_cluster(cluster, soc_version)
    if isinstance(cluster, (str, Path)):
        return read_cluster_config(cluster, soc_version)
    if isinstance(cluster, dict):
        return cluster_from_dict(cluster, "the cluster argument", soc_version)
    raise ConfigError(
        "build()",
        "cluster",
        f"is a {type(cluster).__name__}; give a cluster config file, its parsed JSON (a dict), "
        "a ClusterConfig or a device count",
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


def _pack(
    captured: CapturedModel,
    plan: Plan,
    programs: list[RankProgram],
    cluster: ClusterConfig,
    soc_version: str,
    graph_parallel: bool,
    dp: int = 1,
    staged: list[StagedProgram] | None = None,
    pp: int = 1,
    micro_batches: int = 1,
    stored: dict | None = None,
) -> tuple[dict, dict[str, Member]]:
    """The manifest and members of a package: `programs` holds one program per rank of the
    cluster; with `dp` replicas, rank `r` holds the weights of tensor-parallel rank `r % tp`.
    With pipeline stages, `staged` holds each rank's program, stage and the weights it takes.
    `stored` gives the weights' values where the captured model holds fake tensors."""
    ep = captured.program
    tp = math.prod(plan.mesh_shape)
    state = {**ep.state_dict, **ep.constants}
    if stored is not None:
        state.update({fqn: stored[fqn] for fqn in state if fqn in stored})
    weights = weight_inputs(captured, plan)
    placeholders = {n.name: n for n in ep.graph_module.graph.nodes if n.op == "placeholder"}
    members: dict[str, Member] = {}
    program_member: dict[int, str] = {}
    submodels = []
    ranks_report = []
    placements = {fqn: plan.out_placements(placeholders[ph]) for ph, fqn in weights}
    whole = {
        fqn
        for _, fqn in weights
        if not graph_parallel or all(isinstance(p, Replicate) for p in placements[fqn])
    }
    for rank, device in enumerate(cluster.devices):
        mesh_rank = rank % tp if graph_parallel else 0
        if staged is not None:
            rp, takes = staged[rank].program, set(staged[rank].weights)
            where = f"stage_{staged[rank].stage}_" if pp > 1 else ""
        else:
            rp, takes, where = programs[rank if graph_parallel else 0], None, ""
        order = [fqn for _, fqn in weights if takes is None or fqn in takes]
        mine = [(ph, fqn) for ph, fqn in weights if fqn in order]
        tied = _tied_weights(mine, state, whole, placements)
        replicated = sorted(set(order) & whole - tied.keys())
        key = id(rp)
        if key not in program_member:
            name = f"programs/program_{len(program_member)}.json"
            members[name] = json.dumps(rp.program).encode()
            program_member[key] = name
        weight_members = []
        if replicated:  # stored once per stage, shared by its ranks
            name = f"weights/{where}replicated.safetensors"
            members.setdefault(name, {fqn: state[fqn] for fqn in replicated})
            weight_members.append(name)
        shards = {
            fqn: local_shard(state[fqn], placements[fqn], plan.mesh_shape, mesh_rank)
            for fqn in order
            if fqn not in whole and fqn not in tied
        }
        for cname, value in rp.constants.items():
            if stored is not None and is_fake(value):
                raise ConfigError(
                    "weights",
                    None,
                    f"rank {rank}'s program holds a constant {cname!r} computed from the "
                    "weights at build time, which streamed weights cannot give",
                )
            shards[f"{CONSTANT_PREFIX}{cname}"] = value
        if shards:
            name = f"weights/{where}rank_{mesh_rank}.safetensors"  # replicas share one member
            members.setdefault(name, shards)
            weight_members.append(name)
        ties = {
            fqn: {
                "source": source,
                "chunks": shard_chunks(placements[fqn], plan.mesh_shape, mesh_rank)
                if source in whole
                else [],  # placed alike: this rank's chunk of the source is the whole answer
            }
            for fqn, source in tied.items()
        }
        colls = collectives(rp.program, rp.shapes)
        submodels.append(
            {
                "rank": rank,
                "logical_device": device.logical_id,
                "node_id": device.node_id,
                "device_id": device.device_id,
                "program": program_member[key],
                "weights": weight_members,
                "weight_order": order,
                "tied": ties,
                "comm_groups": groups_in(rp.program) if graph_parallel else [],
            }
        )
        ranks_report.append(
            {
                "rank": rank,
                "logical_device": device.logical_id,
                "weight_bytes": rp.weight_bytes,
                "peak_bytes": rp.peak_bytes,
                "collectives": [
                    {"kind": c["kind"], "group": c["group"], "bytes": c.get("bytes", 0)}
                    for c in colls
                ],
            }
        )
    out_node = next(n for n in ep.graph_module.graph.nodes if n.op == "output")
    outputs = [
        {
            "shape": [v.shape[0] * dp * micro_batches, *v.shape[1:]] if v.dim() else [],
            "dtype": str(v.dtype).removeprefix("torch."),
        }
        for a in tree_leaves(out_node.args[0])
        if hasattr(a, "meta") and isinstance((v := a.meta.get("val")), torch.Tensor)
    ]
    if len(captured.output_names) == len(outputs):
        for spec, name in zip(outputs, captured.output_names):
            spec["name"] = name
    mesh_shape, dim_names = list(plan.mesh_shape), list(plan.mesh_names)
    if dp > 1:  # weights are replicated over the replicas
        mesh_shape, dim_names = [dp, *mesh_shape], ["dp", *dim_names]
    layouts = {
        fqn: {
            "shape": list(state[fqn].shape),
            "dtype": str(state[fqn].dtype).removeprefix("torch."),
            "mesh_shape": mesh_shape,
            "placements": ["R"] * (dp > 1)
            + [placement_str(p) for p in plan.out_placements(placeholders[ph])],
        }
        for ph, fqn in weights
    }
    members["layouts.json"] = json.dumps(layouts, indent=1).encode()
    if pp > 1:  # each weight is held by the ranks of the stages that read it
        mesh_shape, dim_names = [pp, dp, *plan.mesh_shape], ["pp", "dp", *plan.mesh_names]
    members["strategy.json"] = json.dumps(
        _strategy_file(plan, placeholders, weights, state, dp)
    ).encode()
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tessel_version": tessel_version,
        "torch_version": torch.__version__,
        "mode": "partitioned" if graph_parallel else "replicated",
        "soc_version": soc_version,
        "device_type": cluster.soc.device_type,
        "backend": cluster.soc.backend,
        "world_size": cluster.world_size,
        "cluster": cluster.raw,
        "mesh": {"shape": mesh_shape, "dim_names": dim_names},
        "inputs": [
            _input_spec(n, x, dp * micro_batches)
            for n, x in zip(captured.input_names, captured.example_inputs)
        ],
        "outputs": outputs,
        "submodels": submodels,
        "layouts": "layouts.json",
        "strategy": "strategy.json",
        "plan": _explain(plan, layouts, ranks_report),
    }
    return manifest, members


def _tied_weights(
    weights: list[tuple[str, str]], state: dict, whole: set[str], placements: dict
) -> dict[str, str]:
    """Weights stored under another name: one tensor under several names (tied embeddings) is
    stored once, under a name every rank holds whole, or else under one placed alike."""
    names: dict[int, list[str]] = defaultdict(list)
    for _, fqn in weights:
        names[id(state[fqn])].append(fqn)
    tied = {}
    for group in names.values():
        source = next((n for n in group if n in whole), group[0])
        for n in group:
            if n != source and (source in whole or placements[n] == placements[source]):
                tied[n] = source
    return tied


def _nbytes(tensor: torch.Tensor, placements: tuple, plan: Plan, rank: int) -> int:
    """Bytes of `rank`'s shard of `tensor` (the whole tensor for no placements)."""
    shape = local_shard_shape(tensor.shape, placements, plan.mesh_shape, rank)
    return math.prod(shape) * tensor.element_size()


def _strategy_file(plan: Plan, placeholders: dict, weights: list, state: dict, dp: int = 1) -> dict:
    """The weights' layouts as a tessel strategy file, for `tessel ckpt` to shard checkpoints into."""
    from tessel.checkpoint.dtensor import layout_from_dtensor
    from tessel.checkpoint.strategy import Strategy, param_from_layout

    params = {}
    for ph, fqn in weights:
        tensor = state[fqn]
        mesh, placements = plan.mesh_shape, plan.out_placements(placeholders[ph])
        names = list(plan.mesh_names)
        if dp > 1:
            mesh, placements, names = (dp, *mesh), (Replicate(), *placements), ["dp", *names]
        layout = layout_from_dtensor(mesh, placements, tensor.dim(), names)
        params[fqn] = param_from_layout(fqn, layout, tuple(tensor.shape), tensor.dtype)
    return Strategy(params, "package").to_json()


def _input_spec(name: str, x: torch.Tensor, dp: int = 1) -> dict:
    """An input as the package takes it: with `dp` replicas, `dp` times the rows of `x`."""
    shape = [x.shape[0] * dp, *x.shape[1:]] if dp > 1 else list(x.shape)
    spec = {"name": name, "shape": shape, "dtype": str(x.dtype).removeprefix("torch.")}
    if not x.dtype.is_floating_point and x.dtype != torch.bool and x.numel():
        spec["high"] = int(x.max()) + 1  # `tessel run` draws random inputs below this bound
    return spec


def _explain(plan: Plan, layouts: dict, ranks: list[dict]) -> dict:
    """What `tessel inspect` shows: placements per layer, collectives and memory per rank."""
    layers: dict[str, dict[str, list[str]]] = defaultdict(dict)
    placeholders = {n.name: n for n in plan.choices}
    for n in plan.choices:
        fqn = plan.param_targets.get(n.name)
        if fqn is None or fqn not in layouts:
            continue
        users = [u for u in n.users if layer_name(u)]
        layer = layer_name(users[0]) if users else ""
        layers[layer or "(outside layers)"][fqn] = layouts[fqn]["placements"]
    del placeholders
    fallbacks = Counter(target for _, target, _ in plan.fallbacks())
    replicated = replicated_weights(plan)  # why, for weights replicated on tp axes
    line = why_summary(plan, replicated, len(layouts))
    if line:
        log.info("%s", line)
    return {
        "estimated_time_s": plan.estimated_time,
        "solver": plan.solver,
        "memory": plan.memory,
        "layers": layers,
        "fallbacks": [{"node": n, "op": t, "reason": r} for n, t, r in plan.fallbacks()],
        "fallback_ops": dict(fallbacks),
        "replanned": plan.replanned,
        "replicated": {fqn: r.to_json() for fqn, r in replicated.items() if fqn in layouts},
        "ranks": ranks,
    }
