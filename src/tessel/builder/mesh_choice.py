"""Choosing the mesh's shape where the policy leaves it to tessel (`auto`, no sizes given).

On a cluster of several nodes, the shapes weighed are `pp x dp x tp` for every stage count and
data-parallel size that divide the device count, that the nodes can hold (a group within one
node or across whole nodes) and that the example batch can be split for. Each is planned (one
micro-batch of one replica's share of the batch on `tp` devices, under the devices' memory, a
stage holding its part of the weights) and priced by the planner's estimated time (pipelined
over the stages, their sends on the link between them) plus the gather of the outputs over the
replicas, on the link that axis crosses. The memory check that sets a shape aside is the one
the build makes, and the plan weighed is the plan the build lowers (`MeshChoice.plan`). A
shape whose fastest plan, memory aside, is no faster than a shape already weighed that it
must beat (below) is set aside as slower, without the search for a plan that fits its memory:
whether it fits cannot change the choice. Shapes without stages are weighed in the order of a
bound no plan of theirs beats (each operator at its least share of the work, from the capture
of the whole batch), and one whose bound is no faster than the shape it must beat is set aside
before it is captured.

The fastest shape that fits is chosen, with one exception: the slow link between nodes. Where
it moves more bytes between nodes than the fastest shape that keeps tensor parallelism inside
the nodes, it must be estimated at least `SLOW_LINK_MARGIN` faster, or that shape is chosen
instead: the estimate of traffic over a shared network is the least certain term of the cost
model. Where the planner's estimates grant the margin, both shapes are lowered and their
programs priced as lowered (`tessel.lower.estimate`), and the margin must hold there too. Every
shape weighed, its bytes between nodes, both estimates where taken, and why one was set aside
or preferred, go into the plan for `inspect`. Shapes with pipeline stages are weighed only where no shape
without them fits: a stage-replica does the same work as a replica holding every layer, plus
the time its micro-batches wait while the stages fill and drain.

A training step planned by `tessel.parallel.AutoParallel` weighs `dp x tp` shapes alike on one
node too (`choose_data_parallel`): each replica's program on its share of the batch, plus the
all-reduce of its gradients over the replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from tessel._torch import tree_leaves, tree_map
from tessel.builder.lowering import plan_and_lower
from tessel.builder.stages import default_micro_batches, more_memory, pipeline_estimate
from tessel.capture import CapturedModel, capture, capture_training
from tessel.capture.training import GradientOutputs, gradient_outputs, mark_gradients
from tessel.config.cluster import ClusterConfig
from tessel.config.errors import ConfigError
from tessel.config.mesh import ParallelDims, axis_groups, parallel_dims, tensor_axes
from tessel.config.parallel_option import ParallelOption
from tessel.lower.estimate import program_seconds
from tessel.lower.program import RankProgram
from tessel.lower.trace import LoweringError
from tessel.package.plan_report import ShapeWeighed
from tessel.plan import PlanError, PlanOutOfTime, PlanSlower, cost, has_rule, make_plan
from tessel.plan.planner import Plan, least_seconds
from tessel.plan.traffic import sent_bytes
from tessel.progress import phase

# how much faster (by estimate) a shape moving more bytes between nodes must be to be chosen
SLOW_LINK_MARGIN = 0.10


@dataclass
class MeshChoice:
    """The shape chosen, its capture (one replica's share of the batch), and what was weighed."""

    dims: ParallelDims
    captured: CapturedModel
    weighed: list[ShapeWeighed]
    micro_batches: int = 1
    plan: Plan | None = None  # the plan weighed for the chosen shape: the build lowers it
    programs: list[RankProgram] | None = None  # that plan's programs, where already lowered


class Weighed(NamedTuple):
    """A shape that fits: its line in the plan's report, its mesh, capture and plan."""

    entry: ShapeWeighed
    dims: ParallelDims
    captured: CapturedModel
    micro_batches: int
    plan: Plan


class _Shape(NamedTuple):
    """A shape to weigh: its line in the report, its mesh, one replica's devices, its
    micro-batches, the inputs of one micro-batch of one replica, and the time no plan of it
    beats, where known (`_least_seconds`)."""

    entry: ShapeWeighed
    dims: ParallelDims
    devices: ClusterConfig
    micro: int
    inputs: tuple[tuple, dict]
    least: float | None = None


def _least_seconds(whole: CapturedModel, shape: _Shape, cluster: ClusterConfig) -> float:
    """What no plan of `shape` (without stages) beats, from the capture of the whole batch:
    its replica's share of the work at its least (`least_seconds`) and the gather of the
    replicas' outputs (each at least its share of the whole batch's)."""
    dp = shape.dims.size("dp")
    gather = _gather_seconds(output_bytes(whole) / dp, shape.dims, cluster)
    return least_seconds(whole, shape.devices, 1 / dp) + gather


def wants_choice(cluster: ClusterConfig, policy: ParallelOption, model: Any) -> bool:
    """Whether tessel chooses the shape: `auto`, no size in the policy, several nodes."""
    sizes = (policy.tensor_parallel_size, policy.data_parallel_size, policy.pipe_stage_num)
    return (
        policy.auto
        and all(s is None for s in sizes)
        and len(cluster.nodes) > 1
        and not isinstance(model, CapturedModel)
    )


def choose_mesh(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    cluster: ClusterConfig,
    policy: ParallelOption,
    *,
    reuse_layers: bool,
    time_limit: float,
) -> MeshChoice:
    """Weigh every `pp x dp x tp` shape of `cluster` and return the fastest that fits."""
    world = cluster.world_size
    rows = batch_rows(args, kwargs)
    weighed: list[ShapeWeighed] = []
    fitting: list[Weighed] = []
    captures: dict[int, CapturedModel] = {}  # by the parts the example batch is split into
    shapes = [
        (pp, dp, world // (pp * dp))
        for pp in range(1, world + 1)
        if world % pp == 0
        for dp in range(1, world // pp + 1)
        if (world // pp) % dp == 0
    ]
    todo: list[_Shape] = []
    for pp, dp, tp in shapes:
        devices = first_devices(cluster, tp)
        outer = [("pp", pp), ("dp", dp)] if pp > 1 else [("dp", dp)]
        axes = [*outer, *((a.name, a.size) for a in tensor_axes(devices))]
        entry = ShapeWeighed(tuple(size for _, size in axes), tuple(name for name, _ in axes))
        weighed.append(entry)
        sized = replace(policy, tensor_parallel_size=tp, data_parallel_size=dp, pipe_stage_num=pp)
        micro = default_micro_batches(pp, rows // dp) if pp > 1 and rows % dp == 0 else 1
        try:
            dims = parallel_dims(cluster, sized)
            parts = dp * micro
            inputs = (
                replica_batch(args, kwargs, dp, policy.source, micro)
                if parts > 1
                else (args, kwargs)
            )
        except ConfigError as exc:
            entry.set_aside = exc.detail
            continue
        todo.append(_Shape(entry, dims, devices, micro, inputs))

    def captured_for(shape: _Shape) -> CapturedModel:
        parts = shape.dims.size("dp") * shape.micro
        if parts not in captures:  # shapes that split the batch alike share one capture
            a, k = shape.inputs
            captures[parts] = capture(model, a, k, keep=has_rule, reuse_layers=reuse_layers)
        return captures[parts]

    # shapes without stages, the likeliest first: a shape no plan of which could beat the one
    # it must beat is set aside before it is captured
    flat = [t for t in todo if t.dims.size("pp") == 1]
    one_replica = next((t for t in flat if t.dims.size("dp") == 1), None)
    if len(flat) > 1 and one_replica is not None:
        whole = captured_for(one_replica)
        bounded = (t._replace(least=_least_seconds(whole, t, cluster)) for t in flat)
        flat = sorted(bounded, key=lambda t: t.least)
    for shape in flat + [t for t in todo if t.dims.size("pp") > 1]:
        entry, dims, devices, micro = shape.entry, shape.dims, shape.devices, shape.micro
        pp = dims.size("pp")
        if pp > 1 and fitting:
            # (1, pp * dp, tp) does the same work without the stages' fill and drain
            entry.set_aside = (
                "not weighed: a shape without pipeline stages fits, and stages only add the "
                "time micro-batches wait to fill and drain them"
            )
            continue
        rival = None if pp > 1 else _rival(fitting, dims, cluster)
        least = shape.least
        if rival is not None and least is not None and least >= rival.entry.estimated_time_s:
            entry.least_time_s = least
            entry.set_aside = (
                f"slower than {rival.entry.text} ({1e3 * rival.entry.estimated_time_s:.3f} ms) "
                f"whether it fits or not: no plan of it takes less than {1e3 * least:.3f} ms "
                f"per run (every operator at its least share of the work, gathering the "
                f"replicas' outputs, no other communication)"
            )
            continue
        captured = captured_for(shape)
        gather = gather_seconds(captured, dims, cluster, micro)
        try:
            # the build's own first plan for this shape: its memory, its reserve
            plan = make_plan(
                captured,
                more_memory(devices, pp) if pp > 1 else devices,
                policy,
                time_limit,
                reserve=gathered_bytes(captured, dims.size("dp"), micro),
                slower_than=None if rival is None else rival.entry.estimated_time_s - gather,
            )
            seconds = plan.estimated_time
            if pp > 1:
                entry.micro_batches = micro
                seconds = pipeline_estimate(captured, plan, cluster, dims, micro)
        except PlanSlower as exc:  # (only a rival it cannot beat has been weighed)
            entry.estimated_time_s = exc.seconds + gather
            gathers = (
                f", and gathering the replicas' outputs {1e3 * gather:.3f} ms" if gather else ""
            )
            entry.set_aside = (
                f"slower than {rival.entry.text} ({1e3 * rival.entry.estimated_time_s:.3f} ms) "
                f"whether it fits or not: its fastest plan, memory aside, takes "
                f"{1e3 * exc.seconds:.3f} ms per run{gathers}"
            )
            continue
        except PlanOutOfTime as exc:  # whether it fits is not known
            entry.set_aside = f"not planned within the time limit: {exc}"
            continue
        except PlanError as exc:
            entry.set_aside = f"does not fit the devices' memory: {exc}"
            continue
        except ConfigError as exc:  # more stages than layers
            entry.set_aside = exc.detail
            continue
        entry.estimated_time_s = seconds + gather
        entry.internode_bytes = internode_bytes(plan, captured, dims, cluster, micro)
        fitting.append(Weighed(entry, dims, captured, micro, plan))
    if not fitting:
        reasons = "; ".join(f"{list(e.shape)}: {e.set_aside}" for e in weighed)
        raise PlanError(f"no mesh shape of this cluster fits the model ({reasons})")
    chosen, rival = _prefer_quiet_links(fitting, cluster)
    programs = None
    if rival is not None:
        chosen, programs = _confirmed_after_lowering(
            chosen, rival, cluster, policy, time_limit, reuse_layers
        )
    for entry in weighed:
        entry.chosen = entry is chosen.entry
    return MeshChoice(
        chosen.dims, chosen.captured, weighed, chosen.micro_batches, chosen.plan, programs
    )


def _rival(fitting: list[Weighed], dims: ParallelDims, cluster: ClusterConfig) -> Weighed | None:
    """The shape weighed so far that `dims` must beat to be chosen: the fastest of all where
    its tensor axes cross nodes (the choice is the fastest shape or the fastest quiet one),
    the fastest keeping tensor parallelism inside the nodes where it does too."""
    crosses = _tensor_axes_cross_nodes(dims, cluster)
    rivals = [
        f
        for f in fitting
        if f.dims.size("pp") == 1 and (crosses or not _tensor_axes_cross_nodes(f.dims, cluster))
    ]
    return min(rivals, key=lambda f: f.entry.estimated_time_s, default=None)


def _prefer_quiet_links(
    fitting: list[Weighed], cluster: ClusterConfig
) -> tuple[Weighed, Weighed | None]:
    """The fastest shape, unless it moves more bytes between nodes than the fastest shape
    keeping tensor parallelism inside the nodes and is not `SLOW_LINK_MARGIN` faster; and,
    where it is chosen over that quieter shape by its margin, the quieter shape (else None)."""
    fastest = min(fitting, key=lambda f: f.entry.estimated_time_s)
    inside = [f for f in fitting if not _tensor_axes_cross_nodes(f.dims, cluster)]
    if not inside or len(cluster.nodes) < 2:
        return fastest, None
    quiet = min(inside, key=lambda f: f.entry.estimated_time_s)
    fast, calm = fastest.entry, quiet.entry
    if fast is calm or fast.internode_bytes <= calm.internode_bytes:
        return fastest, None
    gain = 1 - fast.estimated_time_s / calm.estimated_time_s
    if gain >= SLOW_LINK_MARGIN:
        fast.preferred = (
            f"is {100 * gain:.0f}% faster by estimate than the fastest shape keeping tensor "
            f"parallelism inside the nodes, though it moves more bytes between them"
        )
        return fastest, quiet
    calm.preferred = (
        f"moves {_mib(calm.internode_bytes)} between nodes per run against "
        f"{_mib(fast.internode_bytes)} for {fast.text}, which is estimated only "
        f"{100 * gain:.0f}% faster (less than {100 * SLOW_LINK_MARGIN:.0f}%)"
    )
    return quiet, None


def _confirmed_after_lowering(
    fast: Weighed,
    quiet: Weighed,
    cluster: ClusterConfig,
    policy: ParallelOption,
    time_limit: float,
    reuse_layers: bool,
) -> tuple[Weighed, list[RankProgram] | None]:
    """`fast`, chosen over `quiet` by the planner's estimates though it moves more bytes
    between nodes, where its lowered programs keep the margin too; `quiet` otherwise. Each is
    lowered as the build would lower it and timed as `lowered_time_s` in its entry; the winner's
    programs come back for the build to use. Shapes with pipeline stages keep the planner's
    verdict (their stage programs are cut after lowering)."""
    if fast.dims.size("pp") > 1 or quiet.dims.size("pp") > 1:
        fast.entry.preferred += " (pipeline stages: not estimated after lowering)"
        return fast, None
    lowered: dict[int, tuple[Weighed, list[RankProgram]]] = {}
    for i, shape in enumerate((fast, quiet)):
        devices = first_devices(cluster, shape.dims.size("tp"))
        try:
            with phase(f"lowering {shape.entry.text} to estimate it as lowered"):
                plan, programs = plan_and_lower(
                    shape.captured,
                    devices,
                    policy,
                    time_limit=time_limit,
                    reuse_layers=reuse_layers,
                    reserve=gathered_bytes(shape.captured, shape.dims.size("dp")),
                    first=shape.plan,
                )
        except (PlanError, LoweringError) as exc:
            shape.entry.lowered_time_s = None
            shape.entry.set_aside = f"could not be lowered: {exc}"
            shape.entry.preferred = None
            continue
        seconds = max(program_seconds(rp, r, devices) for r, rp in enumerate(programs))
        shape.entry.lowered_time_s = seconds + gather_seconds(shape.captured, shape.dims, cluster)
        lowered[i] = shape._replace(plan=plan), programs
    if len(lowered) < 2:  # the one that lowers
        return next(iter(lowered.values()), (fast, None))
    gain = 1 - fast.entry.lowered_time_s / quiet.entry.lowered_time_s
    if gain >= SLOW_LINK_MARGIN:
        fast.entry.preferred += f", and {100 * gain:.0f}% faster as lowered"
        return lowered[0]
    fast.entry.preferred = None
    planned = 1 - fast.entry.estimated_time_s / quiet.entry.estimated_time_s
    quiet.entry.preferred = (
        f"moves {_mib(quiet.entry.internode_bytes)} between nodes per run against "
        f"{_mib(fast.entry.internode_bytes)} for {fast.entry.text}, which is "
        f"estimated {100 * planned:.0f}% faster by the planner but only {100 * gain:.0f}% "
        f"faster as lowered (less than {100 * SLOW_LINK_MARGIN:.0f}%)"
    )
    return lowered[1]


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _spans_nodes(cluster: ClusterConfig, groups: list[tuple[int, ...]]) -> bool:
    """Whether any of these rank groups holds devices of more than one node."""
    return any(len({cluster.devices[r].node_id for r in g}) > 1 for g in groups)


def _tensor_axes_cross_nodes(dims: ParallelDims, cluster: ClusterConfig) -> bool:
    return _spans_nodes(cluster, dims.groups("tp"))


def internode_bytes(
    plan: Plan, captured: CapturedModel, dims: ParallelDims, cluster: ClusterConfig, micro: int
) -> float:
    """Bytes one run moves between nodes: what every device sends over a tensor axis whose
    groups span nodes (the plan's collectives, per micro-batch), and the outputs of the
    replicas away from rank 0's node gathered to it. A pipeline's sends between stages are
    not counted (shapes with stages are weighed only where none without them fits)."""
    graph = captured.program.graph_module.graph
    devices = first_devices(cluster, dims.size("tp"))  # the devices the plan was made for
    crossing = {
        name
        for d, name in enumerate(plan.mesh_names)
        if _spans_nodes(devices, axis_groups(tuple(plan.mesh_shape), d))
    }
    per_device = sent_bytes(plan, graph)
    total = sum(b for name, b in per_device.items() if name in crossing) * dims.world_size * micro
    if dims.size("dp") > 1:
        head = cluster.devices[0].node_id
        away = sum(cluster.devices[r].node_id != head for r in dims.groups("dp")[0])
        total += away * output_bytes(captured) * micro
    return float(total)


def batch_rows(args: tuple, kwargs: dict) -> int:
    """The example batch's rows: the first dimension of its first tensor input."""
    first = next(
        (x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.dim()), None
    )
    return first.shape[0] if first is not None else 1


def output_bytes(captured: CapturedModel) -> int:
    """Bytes of the outputs of the captured model (one micro-batch of one replica)."""
    out = captured.program.graph_module.graph.output_node()
    return sum(
        v.numel() * v.element_size()
        for a in tree_leaves(out.args[0])
        if isinstance(a, torch.fx.Node) and isinstance((v := a.meta.get("val")), torch.Tensor)
    )


def gathered_bytes(captured: CapturedModel, dp: int, micro_batches: int = 1) -> int:
    """What rank 0 holds beyond its own program (which holds one micro-batch's outputs) to put
    a run's outputs together: its micro-batches' outputs and the batch they are joined into,
    then, with replicas, that batch beside the buffer every replica's rows are gathered into."""
    if dp * micro_batches == 1:
        return 0
    once = output_bytes(captured)
    if dp == 1:
        return (2 * micro_batches - 1) * once
    return ((1 + dp) * micro_batches - 1) * once


def gather_seconds(
    captured: CapturedModel, dims: ParallelDims, cluster: ClusterConfig, micro_batches: int = 1
) -> float:
    """The time rank 0 takes to receive every other replica's outputs (captured for one
    micro-batch of one replica) over the dp axis's link, one replica after another."""
    return _gather_seconds(output_bytes(captured) * micro_batches, dims, cluster)


def _gather_seconds(replica_bytes: float, dims: ParallelDims, cluster: ClusterConfig) -> float:
    dp = dims.size("dp")
    if dp == 1:
        return 0.0
    link = cost.Links(dims.axis("dp").bandwidth, cluster.soc.link_latency)
    return (dp - 1) * (replica_bytes / link.bandwidth + link.latency)


def replica_batch(
    args: tuple,
    kwargs: dict,
    dp: int,
    source: str,
    micro_batches: int = 1,
    global_batch: int | None = None,
) -> tuple[tuple, dict]:
    """One micro-batch of the first replica's share of the example batch: every tensor input
    split along its first dimension, which `dp * micro_batches` must divide. With
    `global_batch` (the policy's `global_batch_size`) that many rows make the batch a run takes,
    of which the example must hold at least one micro-batch."""
    tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    batches = {x.shape[0] if x.dim() else None for x in tensors}
    parts = dp * micro_batches
    if global_batch is not None and len(batches) == 1 and None not in batches:
        example = next(iter(batches))
        if global_batch % parts or example < global_batch // parts:
            raise ConfigError(
                source,
                "graph_parallel_option.global_batch_size",
                f"is {global_batch}: it must split into {parts} equal parts (data_parallel_size "
                f"{dp} x micro_batch_num {micro_batches}) and the example batch, of {example} "
                f"rows, must hold one of them ({global_batch // parts} rows)",
            )
        batches = {global_batch}
    if len(batches) != 1 or None in batches or next(iter(batches)) % parts:
        found = sorted(map(str, batches))
        if micro_batches > 1:
            raise ConfigError(
                source,
                "graph_parallel_option.pipeline_parallel_option.micro_batch_num",
                f"is {micro_batches}, but the example inputs' first dimensions are {found}; "
                f"micro-batches need one batch dimension first in every input, divisible by "
                f"{parts} (micro_batch_num x data_parallel_size)",
            )
        raise ConfigError(
            source,
            "graph_parallel_option.data_parallel_option.data_parallel_size",
            f"is {dp}, but the example inputs' first dimensions are {found}; "
            f"data parallelism needs one batch dimension first in every input, divisible by {dp}",
        )
    rows = next(iter(batches)) // parts

    def share(x: Any) -> Any:
        return x[:rows] if isinstance(x, torch.Tensor) else x

    return tuple(tree_map(share, list(args))), {k: tree_map(share, v) for k, v in kwargs.items()}


def first_devices(cluster: ClusterConfig, count: int) -> ClusterConfig:
    """The cluster cut to its first `count` devices (one data-parallel replica's)."""
    nodes, left = [], count
    for node in cluster.nodes:
        if left <= 0:
            break
        nodes.append(replace(node, devices=node.devices[:left]))
        left -= len(nodes[-1].devices)
    return replace(cluster, nodes=tuple(nodes))


def choose_data_parallel(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    cluster: ClusterConfig,
    policy: ParallelOption,
    time_limit: float,
    held_factor: float,
    captures: dict[int, tuple[tuple, dict, CapturedModel]] | None = None,
) -> tuple[int, list[dict[str, Any]]]:
    """The data-parallel size of the fastest `dp x tp` shape of a training step that fits, and
    what was weighed: each shape's replica program is planned on its share of the batch and
    timed with the all-reduce of its gradients over the replicas. `captures`, where given,
    receives each weighed size's replica inputs and captured step, for the build to reuse.

    The most replicas are weighed first: their programs, on the fewest devices each, are the
    quickest to plan, and a size whose fastest plan, memory aside, is no faster than the best
    weighed before it is set aside without being fitted to memory (so an exact tie there keeps
    the larger size; of two fitted sizes equally fast, the smaller wins)."""
    world = cluster.world_size
    rows = batch_rows(args, kwargs)
    weighed: list[dict[str, Any]] = []
    best: tuple[float, int] | None = None
    for dp in (d for d in range(world, 0, -1) if world % d == 0):
        entry: dict[str, Any] = {"data_parallel": dp, "tensor_parallel": world // dp}
        weighed.append(entry)
        if rows % dp:
            entry["set_aside"] = f"the batch of {rows} rows does not split into {dp} replicas"
            continue
        devices = first_devices(cluster, world // dp)
        a, k = replica_batch(args, kwargs, dp, policy.source) if dp > 1 else (args, kwargs)
        captured = capture_training(model, a, k, keep=has_rule)
        if captures is not None:
            captures[dp] = (a, k, captured)
        graph = captured.program.graph_module.graph
        names = gradient_outputs(graph).names
        mark_gradients(graph, GradientOutputs(names, held_factor))
        try:
            # a size whose fastest plan, memory aside, is no faster than the best one weighed
            # cannot win (memory and the gradients' exchange only add): it is not fitted
            plan = make_plan(
                captured,
                devices,
                policy,
                time_limit,
                slower_than=None if best is None else best[0],
                explain=False,
            )
        except PlanSlower as exc:
            assert best is not None  # (only a rival it cannot beat raises it)
            entry["estimated_time_s"] = exc.seconds
            entry["set_aside"] = (
                f"slower than dp {best[1]} ({1e3 * best[0]:.3f} ms) whether it fits or not: "
                f"its fastest plan, memory aside, takes {1e3 * exc.seconds:.3f} ms per run"
            )
            continue
        except PlanOutOfTime:
            entry["set_aside"] = "not planned within the time limit"
            continue
        except PlanError:
            entry["set_aside"] = "does not fit the devices' memory"
            continue
        seconds = plan.estimated_time
        if dp > 1:
            sized = replace(policy, data_parallel_size=dp, tensor_parallel_size=world // dp)
            dims = parallel_dims(cluster, sized)
            link = cost.Links(dims.axis("dp").bandwidth, cluster.soc.link_latency)
            # gradients are placed like their weights; the plan's weight bytes also hold each
            # weight's optimizer states (`held_factor` in all), which are not exchanged
            gradient_bytes = plan.memory["weight_bytes"] / held_factor
            seconds += cost.all_reduce_time(gradient_bytes, dp, link)
        entry["estimated_time_s"] = seconds
        if best is None or seconds <= best[0]:
            best = (seconds, dp)
    if best is None:
        reasons = "; ".join(f"dp {e['data_parallel']}: {e.get('set_aside')}" for e in weighed)
        raise PlanError(f"no data-parallel size fits the training step ({reasons})")
    weighed.reverse()  # by data-parallel size, smallest first
    for entry in weighed:
        entry["chosen"] = entry["data_parallel"] == best[1]
    return best[1], weighed
