"""Choose a placement for every node: candidates, costs, the ILP, and an explainable plan."""

from __future__ import annotations

import logging
import math
import operator
import os
import time
from collections import defaultdict
from collections.abc import Set as AbstractSet
from dataclasses import asdict, dataclass, field
from typing import cast

import numpy as np
import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh

from tessel._torch import detached_mesh, tree_leaves
from tessel.capture import CapturedModel
from tessel.capture.layers import layer_of
from tessel.capture.training import placed_like, read_state, state_outputs
from tessel.config.cluster import ClusterConfig
from tessel.config.generation import CONV, RECURRENT
from tessel.config.mesh import MeshAxis, tensor_axes
from tessel.config.parallel_option import ParallelOption
from tessel.plan import cost, dp, ilp
from tessel.plan.candidates import (
    DROPPED,
    NodeChoices,
    enumerate_candidates,
    node_flops,
    node_seconds,
)
from tessel.plan.errors import LeastMemory, PlanError, PlanOutOfTime, PlanSlower
from tessel.plan.ilp import MIP_GAP, least_memory, least_memory_search
from tessel.plan.layers import template_map
from tessel.plan.memory import Footprint, MemoryModel, footprint
from tessel.plan.problem import (
    FORBIDDEN,
    InfeasibleError,
    OutOfTimeError,
    Problem,
    Solution,
    pairwise,
)
from tessel.plan.stages import StageAssignment
from tessel.plan.strategies import NodeStrategy, Partial, Replicate, Shard
from tessel.units import human_bytes, two_sizes

log = logging.getLogger(__name__)


SOLVERS = {"O2": ilp.solve, "O1": dp.solve}  # opt_level -> solver
METHODS = {"O2": "integer program (HiGHS)", "O1": "dynamic programming"}
# Past this many columns each integer program takes HiGHS seconds, and pricing memory needs
# tens of them: O2 solves such problems (on meshes of two axes, where a pointwise op has dozens
# of strategies) by dynamic programming, which hands a problem too wide for its tables back to
# the integer program under its time limit (see dp.py); a problem too wide for those tables
# stays with the integer program from the start.
ILP_MAX_VARIABLES = 20_000


@dataclass
class Plan:
    """A chosen strategy for every node of the captured graph on a device mesh."""

    mesh_shape: tuple[int, ...]
    mesh_names: tuple[str, ...]  # the axes of the mesh, outermost first (see tensor_axes)
    choices: dict[fx.Node, NodeChoices]
    choice: dict[fx.Node, int]  # decision owner -> strategy index
    param_targets: dict[str, str]  # placeholder name -> parameter FQN
    estimated_time: float
    timings: dict[str, float] = field(default_factory=dict)
    solver: dict[str, object] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)  # predicted bytes per device
    replanned: list[dict[str, str]] = field(default_factory=list)  # strategies lowering dropped
    # what the solver weighed, kept so the plan can say why it replicates a weight (plan/why.py)
    problem: Problem | None = field(default=None, repr=False)
    memory_model: MemoryModel | None = field(default=None, repr=False)
    fixed: frozenset[str] = frozenset()  # FQNs of the weights the policy places
    # the layers of each pipeline stage, cut under this plan before it is lowered (None: one)
    stages: StageAssignment | None = None

    def strategy(self, node: fx.Node) -> NodeStrategy:
        c = self.choices[node]
        return c.strategies[self.choice[c.owner or node]]

    def out_placements(self, node: fx.Node) -> tuple:
        c = self.choices[node]
        spec = c.out_spec(self.choice[c.owner or node])
        return tuple(spec.placements) if spec is not None else ()

    def param_placements(self) -> dict[str, tuple]:
        return {
            fqn: self.out_placements(n)
            for n in self.choices
            if (fqn := self.param_targets.get(n.name)) is not None
        }

    def fallbacks(self) -> list[tuple[str, str, str]]:
        seen = {}
        for n, c in self.choices.items():
            if c.kind == "fallback" and (c.owner is None or c.owner is n):
                seen[n.name] = (n.name, str(n.target), c.reason)
        return list(seen.values())


def mesh_for(shape: int | tuple[int, ...], names: tuple[str, ...] | None = None) -> DeviceMesh:
    """A mesh of `shape` (ranks row-major) for planning; it needs no process group."""
    shape = (shape,) if isinstance(shape, int) else shape
    return detached_mesh(torch.arange(math.prod(shape)).reshape(shape), names)


def make_plan(
    captured: CapturedModel,
    cluster: ClusterConfig,
    option: ParallelOption,
    time_limit: float = 60.0,
    banned: dict[str, set[str]] | None = None,
    reserve: int = 0,
    slower_than: float | None = None,
    explain: bool = True,
) -> Plan:
    """Solve for the placement of every node on the mesh of the cluster's devices (one
    tensor-parallel group, meshed by `tensor_axes`: one axis, or nodes x devices).

    `banned` drops strategies, per node name, that lowering cannot run (see `strategy_key`);
    `reserve` keeps that many bytes of each device free of what the memory model counts;
    `slower_than` (seconds per run) raises `PlanSlower` where the fastest plan, memory aside,
    takes at least that long, before any search for a plan that fits. Without `explain`, a
    model that does not fit gets a short `PlanError`, not the search for the least memory a
    plan needs that says by how much (for callers that only ask whether a plan fits).
    """
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    graph = captured.program.graph_module.graph
    axes = tensor_axes(cluster)
    mesh = mesh_for(tuple(a.size for a in axes), tuple(a.name for a in axes))
    fixed = dict(option.fixed_placements)
    param_targets, weight_tensors, families, choices = _candidates(captured, mesh, banned, fixed)
    timings["strategies"] = time.perf_counter() - t0

    t1, searching = time.perf_counter(), ilp.cpu_seconds()
    like = placed_like(graph, param_targets)
    state = set(like.values()) if state_outputs(graph) else set()
    problem = _problem(graph, choices, cluster, mesh, axes, like, state)
    device_bytes = min(d.memory_bytes for d in cluster.devices)
    method = option.opt_level
    switched = ""
    # only where elimination can afford the problem: otherwise it would hand it straight back
    if (
        method == "O2"
        and dp.affordable(problem)
        and (columns := ilp.variable_count(problem)) > ILP_MAX_VARIABLES
    ):
        method = "O1"
        switched = (
            f"the integer program would have {columns:,} columns (more than "
            f"{ILP_MAX_VARIABLES:,}): solved by dynamic programming"
        )
    # the fastest plan first, without memory rows: where it fits, it is the answer, and the
    # rows (the costliest part of a problem to build) are never built
    memory = MemoryModel(
        graph, choices, weight_tensors, tuple(mesh.shape), like, limit=device_bytes - reserve
    )
    try:
        solution = SOLVERS[method](problem, time_limit)
    except OutOfTimeError as exc:
        raise PlanOutOfTime(
            f"the planner found no plan at all in its time ({exc}); give build() a longer "
            "time_limit"
        ) from None
    except InfeasibleError as exc:  # memory is not priced yet: moves alone rule every plan out
        raise PlanError(
            f"no plan of this model on a mesh of {list(mesh.shape)} devices avoids a strategy "
            "or a move no plan may take (state written in place moved, partial values "
            f"combined with others, or strategies the lowering refused): {exc}"
        ) from None
    if slower_than is not None and solution.objective >= slower_than:
        raise PlanSlower(
            f"its fastest plan, memory aside, is estimated at {1e3 * solution.objective:.3f} "
            f"ms per run, not under {1e3 * slower_than:.3f} ms",
            solution.objective,
        )
    try:
        held = memory.held(solution.choice)
        if held.peak_bytes > device_bytes - reserve:
            if not state:  # (a cache too large gets the largest batch that fits, below)
                _weights_fit(memory, device_bytes, reserve, cluster, tuple(mesh.shape))
            problem.memory, problem.memory_budget = memory.footprint.rows, memory.budget()
            left = max(1.0, time_limit - (ilp.cpu_seconds() - searching))
            solution = SOLVERS[method](problem, left, fastest=solution)
            held = memory.held(solution.choice)
    except OutOfTimeError as exc:
        raise PlanOutOfTime(
            f"the planner found no plan that fits the devices' memory in its time ({exc}); "
            "give build() a longer time_limit"
        ) from None
    except InfeasibleError:
        if not explain:
            raise PlanError(
                f"no plan fits devices of {human_bytes(device_bytes - reserve)}"
            ) from None
        problem.memory, problem.memory_budget = memory.footprint.rows, memory.budget()
        raise _does_not_fit(
            problem, memory.footprint, choices, cluster, device_bytes, time_limit, reserve, state
        ) from None
    timings["solve"] = time.perf_counter() - t1
    layers = {f: len(ix) for f, ix in families.items()}
    return Plan(
        mesh_shape=tuple(mesh.shape),
        mesh_names=tuple(a.name for a in axes),
        choices=choices,
        choice=solution.choice,
        param_targets=param_targets,
        estimated_time=solution.objective,
        timings=timings,
        solver={
            "opt_level": option.opt_level,
            "method": METHODS["O2"] if solution.fallback else METHODS[method],
            "variables": solution.num_variables,
            "constraints": solution.num_constraints,
            "status": solution.status,
            "fallback": "; then ".join(
                s for s in (switched, solution.fallback, _clock_note(solution, time_limit)) if s
            ),
            "decisions": len(problem.sizes),
            "repeated_layers": layers,
        },
        memory={"device_bytes": device_bytes, **asdict(held)},
        problem=problem,
        memory_model=memory,
        fixed=frozenset(fixed),
    )


def _weights_fit(
    memory: MemoryModel,
    device_bytes: int,
    reserve: int,
    cluster: ClusterConfig,
    mesh_shape: tuple[int, ...],
) -> None:
    """Refuses at once a mesh whose devices cannot hold the weights alone, each cut as finely
    as its strategies allow: no plan fits there, and the search for the least memory would
    spend its time showing so."""
    floor = memory.weight_floor()
    if floor + reserve <= device_bytes:
        return
    needs, has = two_sizes(floor + reserve, device_bytes)
    kept = f" ({needs} with the {human_bytes(reserve)} kept free)" if reserve else ""
    raise PlanError(
        f"the model does not fit: its weights alone, each cut as finely as a mesh of "
        f"{list(mesh_shape)} devices allows, hold {human_bytes(floor) if reserve else needs} "
        f"per device{kept}, but the smallest device in {cluster.source} has {has}; the devices "
        f"need more than {needs}, or the mesh more devices",
        LeastMemory(floor + reserve, floor, 0, device_bytes),
    )


def _clock_note(solution: Solution, time_limit: float) -> str:
    """What the plan owes to the clock: a search cut short by its time limit depends on the
    machine's speed, so the plan says so rather than differ silently from a faster build's."""
    if not solution.stopped_by_clock:
        return ""
    return (
        f"the search stopped at its time limit ({time_limit:g} s) before its own end: a faster "
        "machine, or a longer time_limit, may find a cheaper plan"
    )


def _candidates(
    captured: CapturedModel,
    mesh: DeviceMesh,
    banned: dict[str, set[str]] | None = None,
    fixed: dict[str, tuple[str, ...]] | None = None,
) -> tuple[dict[str, str], dict[str, torch.Tensor], dict[str, list[int]], dict]:
    """Each node's candidate strategies on `mesh`, identical layers and tied weights sharing
    one decision, weights whose placement is `fixed` (by FQN) with that one. Returns the weight
    FQNs, the weight tensors (both by placeholder name), the repeated layer families and the
    candidates."""
    ep = captured.program
    graph = ep.graph_module.graph
    param_targets = _weight_targets(ep)
    # the planner places the weights and the state (a generation step's cache), written here
    # or only read: every gear places a gear's state alike
    written = set(state_outputs(graph)) | set(read_state(graph))
    params = {
        s.arg.name
        for s in ep.graph_signature.input_specs
        if s.kind.name == "PARAMETER" or (s.kind.name == "BUFFER" and s.target in written)
    }
    state = {**ep.state_dict, **ep.constants}
    weight_tensors = {name: state[fqn] for name, fqn in param_targets.items() if fqn in state}
    templates, families = template_map(graph)
    _map_layer_params(templates, params, graph)
    _map_tied_weights(templates, graph, weight_tensors)
    fixed = fixed or {}
    unknown = sorted(set(fixed) - set(param_targets.values()))
    if unknown:
        raise PlanError(f"placements are given for weights the model does not have: {unknown[:5]}")
    by_placeholder = {name: fixed[fqn] for name, fqn in param_targets.items() if fqn in fixed}
    # identical layers share their first one's decision: a placement given for a weight of any
    # of them places that weight in all of them, and two different ones are refused
    for node, template in templates.items():
        if node.op != "placeholder" or template is node or node.name not in by_placeholder:
            continue
        wanted, given = by_placeholder[node.name], by_placeholder.get(template.name)
        if given is not None and given != wanted:
            raise PlanError(
                f"{param_targets[node.name]} is placed {list(wanted)} and the same weight of "
                f"an identical layer, {param_targets[template.name]}, {list(given)}: identical "
                "layers are placed alike"
            )
        by_placeholder[template.name] = wanted
    choices = enumerate_candidates(graph, mesh, params, templates, banned, by_placeholder)
    state = {n: fqn for n, fqn in param_targets.items() if fqn in written}
    _state_as_written(graph, choices, state)
    return param_targets, weight_tensors, families, choices


def _state_as_written(
    graph: fx.Graph, choices: dict[fx.Node, NodeChoices], state: dict[str, str]
) -> None:
    """Each state placeholder (placeholder name to FQN in `state`) keeps only the placements
    in which its in-place writers can take it: placed otherwise, the write would land in a
    copy. A recurrent layer's states are split only by rows or channels (dims 0 and 1): each
    channel's state is its own, where a cut of the convolution's window or of the state size
    would move or sum states across ranks every step."""
    for n in graph.nodes:
        if n.op != "placeholder" or n.name not in state or n not in choices:
            continue
        owner = choices[n].owner or n
        options = choices[owner]
        if state[n.name].startswith((CONV, RECURRENT)):
            by_channels = [
                s
                for s in options.strategies
                if all(
                    not isinstance(p, Shard) or p.dim <= 1
                    for p in _placements(s.output_at(None)) or ()
                )
            ]
            options.strategies[:] = by_channels or options.strategies
        for writer in n.users:
            if writer not in choices or not writes_into(writer, 0) or writer.args[0] is not n:
                continue
            taken = {
                _placements(s.inputs[0])
                for s in choices[choices[writer].owner or writer].strategies
            }
            kept = [s for s in options.strategies if _placements(s.output_at(None)) in taken]
            if not kept:
                raise PlanError(
                    f"the state {n.name} has no placement in which {writer.name} "
                    f"({writer.target}) can write into it"
                )
            options.strategies[:] = kept


def _does_not_fit(
    problem: Problem,
    held: Footprint,
    choices: dict[fx.Node, NodeChoices],
    cluster: ClusterConfig,
    device_bytes: int,
    time_limit: float,
    reserve: int = 0,
    state: AbstractSet[fx.Node] = frozenset(),
) -> PlanError:
    """Why no plan fits: the least memory any plan needs, and what it is made of (`state`: the
    placeholders of state among the weights). `reserve` is what lowered programs were found to
    need beyond the memory model's count. Where the search for the least stops at its time
    limit without ruling out a plan that fits, the error says that instead: the model may fit."""
    found = least_memory_search(problem, time_limit)
    if (held.fixed + found.bytes + reserve) * (1 - MIP_GAP) <= device_bytes:
        # the device is within the solver's gap of that plan: the least itself says whether
        # (and by how much) it falls short
        found = least_memory_search(problem, time_limit, gap=0.0)
    choice = cast("dict[fx.Node, int]", found.choice)  # the planner's decisions are graph nodes
    need = held.fixed + int(math.ceil(found.bytes)) + reserve
    if not found.proven and held.fixed + reserve + found.bound <= device_bytes:
        best, has = two_sizes(need, device_bytes)
        return PlanOutOfTime(
            f"the planner found no plan that fits the devices' memory in its time "
            f"({time_limit:g} s), nor showed that none does: the plan needing least memory it "
            f"found holds {best} per device against the {has} of the smallest device in "
            f"{cluster.source}, and a plan holding as little as "
            f"{human_bytes(held.fixed + reserve + found.bound)} is not ruled out; give build() "
            "a longer time_limit"
        )
    weights = held.weight_bytes(choice)
    owners = {_owner(choices, n) for n in state if n in choices}
    state_bytes = int(sum(b[choice[v]] for v, b in held.weights.items() if v in owners))
    needs, has = two_sizes(need, device_bytes)  # digits enough that the two differ
    message = (
        f"the model does not fit: the plan that needs the least memory holds {needs} "
        f"per device at its peak ({human_bytes(weights)} of weights, "
        f"{human_bytes(max(0, need - weights))} of activations and buffers), but the smallest "
        f"device in {cluster.source} has {has}; devices of at least {needs} would fit"
    )
    whole = sorted(
        (
            n
            for n, c in choices.items()
            if c.kind == "param" and (c.owner is None or c.owner is n) and len(c.strategies) == 1
        ),
        key=lambda n: -cost.nbytes(n.meta.get("val")),
    )
    if whole:
        names = ", ".join(
            f"{n.name} {list(n.meta['val'].shape)} ({human_bytes(cost.nbytes(n.meta['val']))})"
            for n in whole[:5]
        )
        message += (
            f". {len(whole)} weight(s) have no dimension that splits {cluster.world_size} ways "
            f"and stay whole on every device: {names}"
        )
    return PlanError(message, LeastMemory(need, weights, state_bytes, device_bytes))


def _map_tied_weights(
    templates: dict[fx.Node, fx.Node], graph: fx.Graph, weight_tensors: dict[str, torch.Tensor]
) -> None:
    """One tensor under several names (tied embeddings) is one weight: one decision, held once."""
    first: dict[int, fx.Node] = {}
    for n in graph.nodes:
        if n.op != "placeholder" or n.name not in weight_tensors:
            continue
        key = id(weight_tensors[n.name])
        if key not in first:
            first[key] = n
        elif n not in templates:
            rep = templates.get(first[key], first[key])
            templates[n] = rep
            templates.setdefault(rep, rep)


def _weight_targets(ep: torch.export.ExportedProgram) -> dict[str, str]:
    """Placeholder name -> FQN of every weight, buffer and constant the program takes."""
    return {
        s.arg.name: s.target
        for s in ep.graph_signature.input_specs
        if s.kind.name in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR") and s.target is not None
    }


def _map_layer_params(
    templates: dict[fx.Node, fx.Node], weight_names: set[str], graph: fx.Graph
) -> None:
    """Weights of repeated layers share one weight decision: weights read at the same place by
    nodes that share a decision are tied, and each tied set takes the decision of its first
    placeholder in graph order (the one whose decision is made first)."""
    parent: dict[fx.Node, fx.Node] = {}

    def root(x: fx.Node) -> fx.Node:
        while parent.get(x, x) is not x:
            x = parent[x]
        return x

    for n, t in templates.items():
        if n is t:
            continue
        for a, b in zip(_flat_nodes(n), _flat_nodes(t)):
            if (
                a.op == "placeholder"
                and b.op == "placeholder"
                and a.name in weight_names
                and b.name in weight_names
                and a is not b
                and a.meta["val"].shape == b.meta["val"].shape
                and a.meta["val"].dtype == b.meta["val"].dtype
            ):
                ra, rb = root(a), root(b)
                if ra is not rb:
                    parent[ra] = rb
    tied = set(parent) | set(parent.values())
    first: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        if n in tied:
            first.setdefault(root(n), n)
    for n in tied:
        templates[n] = first[root(n)]


def _flat_nodes(n: fx.Node) -> list[fx.Node]:
    from tessel.plan.candidates import tensor_args

    return tensor_args(n)


def _partials_clash(src: tuple, dst: tuple) -> bool:
    """A value partial by one reduction cannot be moved to partial by another: DTensor has no
    such move, so the planner never offers it."""
    return any(
        isinstance(a, Partial) and isinstance(b, Partial) and a.reduce_op != b.reduce_op
        for a, b in zip(src, dst)
    )


def _owner(choices: dict[fx.Node, NodeChoices], n: fx.Node) -> fx.Node:
    return choices[n].owner or n


def host_share(cluster: ClusterConfig) -> float:
    """The part of one host's cores a CPU device of `cluster` computes with: its devices share
    the cores of their node (this machine's count stands in for theirs)."""
    per_node = max(len(n.devices) for n in cluster.nodes)
    return min(1.0, (os.cpu_count() or 1) / per_node)


def device_rates(cluster: ClusterConfig) -> tuple[float, float, float]:
    """What one device of `cluster` has to run its program with: FLOP/s, memory bytes/s, and
    the seconds it takes to dispatch one operator. CPU devices of one node share its cores
    (this machine's count stands in for theirs): each computes at its share of them and
    dispatches its operators in turn with the rest, slower still where they outnumber the
    cores (`shared_core_slowdown`)."""
    soc = cluster.soc
    peak, bandwidth, overhead = soc.peak_flops, soc.memory_bandwidth, soc.op_overhead
    if soc.device_type == "cpu":
        share = host_share(cluster)
        if share < 1.0:
            share /= soc.shared_core_slowdown
        peak, bandwidth, overhead = peak * share, bandwidth * share, overhead / share
    return peak, bandwidth, overhead


def least_seconds(captured: CapturedModel, cluster: ClusterConfig, rows: float = 1.0) -> float:
    """A time no plan for `cluster` beats, memory aside, of the model `captured` run on `rows`
    of the example's rows (a data-parallel replica's share): every operator planned at the
    least share of its work a device can do (its arithmetic and bytes over all the devices)
    and dispatched on each, and no resharding. An operator's work grows no faster than its
    rows, so a replica does at least `rows` of the example's. Views are left out: a capture on
    fewer rows may have fewer of them (a squeeze of a batch of one)."""
    peak, bandwidth, overhead = device_rates(cluster)
    devices = cluster.world_size
    seconds = 0.0
    for n in captured.program.graph.nodes:
        if n.op != "call_function" or n.target in DROPPED or n.target is operator.getitem:
            continue  # what the planner does not price
        if not cost.is_view(str(n.target)):
            seconds += node_seconds(n, peak, bandwidth) * rows / devices + overhead
    return seconds


def run_seconds(captured: CapturedModel, cluster: ClusterConfig) -> float:
    """What a run costs beside its program: the session hands the inputs to rank 0 and takes
    the outputs back (`run_overhead`), and rank 0 broadcasts its word to run and each input to
    the other ranks."""
    soc = cluster.soc
    seconds = soc.run_overhead
    n = cluster.world_size
    if n > 1:
        specs = captured.program.graph_signature.input_specs
        users = {s.arg.name for s in specs if s.kind.name == "USER_INPUT"}
        sizes = [
            cost.nbytes(p.meta.get("val"))
            for p in captured.program.graph.nodes
            if p.op == "placeholder" and p.name in users
        ]
        links = cost.Links.of(cluster)
        # a broadcast from rank 0 reaches the others one step after another
        seconds += (1 + len(sizes)) * (n - 1) * links.latency + sum(sizes) / links.bandwidth
    return seconds


def _problem(
    graph: fx.Graph,
    choices: dict[fx.Node, NodeChoices],
    cluster: ClusterConfig,
    mesh: DeviceMesh,
    axes: tuple[MeshAxis, ...],
    like: dict[int, fx.Node] | None = None,
    state: AbstractSet[fx.Node] = frozenset(),
) -> Problem:
    """Each decision's cost: compute, resharding on every edge, and the outputs' moves (`like`:
    output index -> the weight whose placement that output is returned in). State (`state`'s
    placeholders) is written in place, so an op writing into it takes it as it is placed: a
    move there would write into a copy, and is `FORBIDDEN`."""
    like = like or {}
    unmovable = {_owner(choices, n) for n in state if n in choices}
    soc = cluster.soc
    peak, bandwidth, overhead = device_rates(cluster)
    mesh_shape = tuple(mesh.shape)
    links = [cost.Links.in_program(soc, a.bandwidth, overhead) for a in axes]
    sizes: dict[fx.Node, int] = {}
    linear: dict[fx.Node, np.ndarray] = {}
    for n, c in choices.items():
        v = c.owner or n
        sizes[v] = len(choices[v].strategies)

    # compute cost, once per decision, times the nodes that share it
    multiplicity: dict[fx.Node, int] = defaultdict(int)
    for n, c in choices.items():
        if c.kind in ("op", "fallback", "factory"):
            multiplicity[c.owner or n] += 1
        if c.kind == "param":
            multiplicity[c.owner or n] += 1
    for v, count in multiplicity.items():
        c = choices[v]
        if c.kind == "param":
            continue
        name = str(v.target)
        dispatch = cost.dispatch_time(name, overhead)
        if cost.is_view(name):  # no work to share
            linear[v] = np.full(len(c.strategies), count * dispatch)
            continue
        f = node_flops(v)
        # every device dispatches the node whatever its share of the work
        linear[v] = np.array(
            [
                count
                * (
                    cost.compute_time(
                        f * _work_share(s, mesh_shape),
                        _local_bytes(v, c.args, s, mesh_shape),
                        peak,
                        bandwidth,
                    )
                    + dispatch
                )
                for s in c.strategies
            ]
        )

    # resharding on every edge, aggregated over identical layers
    edges: dict[tuple, int] = defaultdict(int)
    for n, c in choices.items():
        if c.kind not in ("op", "fallback"):
            continue
        for j, a in enumerate(c.args):
            if a not in choices or choices[a].kind in ("const", "drop"):
                continue
            val = a.meta.get("val")
            key = (
                _owner(choices, a),
                choices[a].out_index,
                c.owner or n,
                j,
                cost.nbytes(val),
                tuple(val.shape) if isinstance(val, torch.Tensor) else None,
            )
            edges[key] += 1
    pairs: dict[tuple[fx.Node, fx.Node], np.ndarray] = {}
    # strategies repeat placements, and identical layers repeat shapes: each move priced once,
    # its placements numbered (a tuple of placements hashes slowly, and is looked up often)
    priced: dict[tuple, dict[tuple[int, int], float]] = {}
    numbered: dict[tuple | None, int] = {None: -1}
    placements: dict[int, tuple] = {}

    def number(p: tuple | None) -> int:
        if p not in numbered:
            numbered[p] = len(placements)
            placements[len(placements)] = cast(tuple, p)
        return numbered[p]

    def add_moves(vp: fx.Node, src: list, vc: fx.Node, dst: list, b: int, shape, count=1):
        """Price moving a value from each of `vp`'s placements to each of `vc`'s."""
        table = priced.setdefault((b, shape), {})

        def move_time(sp: int, dp: int) -> float:
            if sp < 0 or dp < 0:
                return 0.0
            if (sp, dp) not in table:
                src_p, dst_p = placements[sp], placements[dp]
                table[sp, dp] = (
                    FORBIDDEN
                    if _partials_clash(src_p, dst_p)
                    else cost.redistribute_time(src_p, dst_p, b, mesh_shape, links, shape)
                )
            return table[sp, dp]

        m = count * pairwise([number(p) for p in src], [number(p) for p in dst], move_time)
        if vp is vc:
            linear[vp] = linear.get(vp, np.zeros(sizes[vp])) + np.diag(m)
        else:
            pairs[(vp, vc)] = pairs.get((vp, vc), 0) + m

    for (vp, out_index, vc, j, b, shape), count in edges.items():
        src = [_placements(s.output_at(out_index)) for s in choices[vp].strategies]
        dst = [
            _placements(s.inputs[j]) if j < len(s.inputs) else None for s in choices[vc].strategies
        ]
        if vp in unmovable and writes_into(vc, j):
            pinned = np.array([[0.0 if d in (None, p) else FORBIDDEN for d in dst] for p in src])
            pairs[(vp, vc)] = pairs.get((vp, vc), 0) + pinned
            continue
        add_moves(vp, src, vc, dst, b, shape, count)

    # outputs are returned whole, a gradient placed like its weight
    out_node = next(n for n in graph.nodes if n.op == "output")
    rep = (Replicate(),) * mesh.ndim
    for i, a in enumerate(tree_leaves(out_node.args[0])):
        if not isinstance(a, fx.Node) or a not in choices:
            continue
        c = choices[a]
        v = c.owner or a
        val = a.meta.get("val")
        b = cost.nbytes(val)
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        src = [_placements(s.output_at(c.out_index)) for s in choices[v].strategies]
        weight = like.get(i)
        if weight is None or weight not in choices:
            extra = np.array(
                [
                    0.0
                    if p is None
                    else cost.redistribute_time(p, rep, b, mesh_shape, links, shape)
                    for p in src
                ]
            )
            linear[v] = linear.get(v, np.zeros(sizes[v])) + extra
            continue
        vw = _owner(choices, weight)
        dst = [_placements(choices[weight].out_spec(k)) for k in range(sizes[vw])]
        add_moves(v, src, vw, dst, b, shape)
    return Problem(sizes, linear, dict(pairs))


def writes_into(node: fx.Node, index: int) -> bool:
    """Whether `node` writes in place into its argument `index`."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or index >= len(schema.arguments):
        return False
    alias = schema.arguments[index].alias_info
    return alias is not None and alias.is_write


def _work_share(s: NodeStrategy, mesh_shape: tuple[int, ...]) -> float:
    """`cost.work_share` of one strategy."""
    inputs = [(_placements(x), _shape(x)) for x in s.inputs if x is not None]
    out = _placements(s.output)
    return cost.work_share(inputs, None if out is None else (out, _shape(s.output)), mesh_shape)


def _local_bytes(
    n: fx.Node, args: list[fx.Node], s: NodeStrategy, mesh_shape: tuple[int, ...]
) -> float:
    """The bytes the busiest device reads and writes running `n` as `s` places it: each
    operand's and output's local part (a replicated weight is read whole on every device, so
    splitting the rows of a matmul does not split the reading of its weight), as
    `cost.moved_bytes` counts them (a lookup reads only its rows of the table)."""
    outputs = n.meta.get("val")
    specs = s.output if isinstance(s.output, tuple) else (s.output,)
    if not isinstance(outputs, (tuple, list)):
        outputs = (outputs,)
    written = sum(
        cost.nbytes(val) * cost.largest_share(_placements(spec), mesh_shape, _shape(spec))
        for val, spec in zip(outputs, specs, strict=False)
    )
    written += sum(cost.nbytes(val) for val in outputs[len(specs) :])
    inputs = s.inputs if len(s.inputs) == len(args) else (None,) * len(args)
    read = [
        cost.nbytes(a.meta.get("val"))
        * cost.largest_share(_placements(spec), mesh_shape, _shape(spec))
        for a, spec in zip(args, inputs, strict=True)
    ]
    return cost.moved_bytes(str(n.target), written, read)


def _shape(spec) -> tuple[int, ...] | None:
    """The global shape of a strategy's (first) output, where its spec records it."""
    if isinstance(spec, tuple):
        spec = next((s for s in spec if s is not None), None)
    meta = getattr(spec, "tensor_meta", None)
    return tuple(meta.shape) if meta is not None else None


def _placements(spec) -> tuple | None:
    if spec is None:
        return None
    if isinstance(spec, tuple):
        spec = next((s for s in spec if s is not None), None)
        if spec is None:
            return None
    return tuple(spec.placements)


# how far above the least memory the sizing plan may be: HiGHS finds that plan in a second
# and may spend many more proving it within 1%, and a device sized by it holds it all the same
SIZING_GAP = 0.05


def least_memory_plan(
    captured: CapturedModel, world: int, gap: float = SIZING_GAP, enough: int | None = None
) -> tuple[int, int]:
    """(peak bytes, weight bytes) per device of a plan on `world` devices that needs the least
    memory (within `gap` of it), costs aside.

    A device holding `share`/N of the weights plus that plan's activations can hold no
    replicated weights; benchmarks, tests and the demo size their devices this way.

    Where `enough` is given, a plan found without a search (each decision's strategy holding
    the fewest bytes) answers instead when its peak is at most `enough`: for a caller asking
    whether some plan fits within it, the search could only lower a peak that fits already.
    """
    graph = captured.program.graph_module.graph
    mesh = mesh_for(world)
    _, weight_tensors, _, choices = _candidates(captured, mesh)
    held = footprint(graph, choices, weight_tensors, (world,))
    # in graph order: a set of nodes iterates by address, and HiGHS's path (and its answer
    # within the gap) follows the column order
    owners = dict.fromkeys(c.owner or n for n, c in choices.items())
    if enough is not None:
        frugal = {v: 0 for v in owners} | held.frugal_choice()
        peak = held.peak_bytes(frugal)
        if peak <= enough:
            return peak, held.weight_bytes(frugal)
    sizes = {v: len(choices[v].strategies) for v in owners}
    least, found = least_memory(Problem(sizes, {}, {}, held.rows), gap=gap)
    choice = cast("dict[fx.Node, int]", found)  # the planner's decisions are graph nodes
    return held.fixed + int(math.ceil(least)), held.weight_bytes(choice)


def layer_name(node: fx.Node) -> str:
    key = layer_of(node)
    return key[0].replace("*", str(key[1])) if key else ""
