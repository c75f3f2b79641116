"""A package's manifest and members from a plan and its rank programs: what the inference
build and the training build both write."""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections import Counter, defaultdict
from dataclasses import asdict

import torch
from torch.distributed.tensor import Replicate, Shard

from tessel._torch import is_fake, tree_leaves
from tessel._version import __version__ as tessel_version
from tessel.capture import CapturedModel
from tessel.config.cluster import ClusterConfig
from tessel.config.errors import ConfigError
from tessel.dtypes import dtype_name
from tessel.lower.program import collectives, groups_in
from tessel.lower.stages import StagedProgram
from tessel.lower.trace import RankProgram, weight_inputs
from tessel.package.format import CONSTANT_PREFIX, FORMAT_VERSION, Member
from tessel.package.manifest import Manifest, Mesh, Passes, Submodel, TensorSpec, Tie
from tessel.package.plan_report import (
    CollectiveLine,
    Fallback,
    MemoryLine,
    PlanReport,
    RankLine,
    Replan,
    SolverLine,
    WhyReplicated,
)
from tessel.plan import Plan
from tessel.plan.planner import layer_name
from tessel.plan.why import replicated_weights
from tessel.plan.why import summary as why_summary
from tessel.sharding.placements import local_shard, placement_str, rank_box, shard_chunks

log = logging.getLogger(__name__)


def pack(
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
    written: frozenset[str] = frozenset(),
) -> tuple[Manifest, dict[str, Member]]:
    """The manifest and members of a package: `programs` holds one program per rank of the
    cluster; with `dp` replicas, rank `r` holds the weights of tensor-parallel rank `r % tp`.
    With pipeline stages, `staged` holds each rank's program, stage and the weights it takes.
    `stored` gives the weights' values where the captured model holds fake tensors. `written`
    names the state the programs write in place (a generation step's cache): never stored, each
    rank's part declared by its box; with replicas, each holds rows of its own (the state's
    rows sharded over `dp`)."""
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
    mesh_shape, dim_names = list(plan.mesh_shape), list(plan.mesh_names)
    if dp > 1:  # weights are replicated over the replicas, state sharded by rows
        mesh_shape, dim_names = [dp, *mesh_shape], ["dp", *dim_names]
    over_dp = [Shard(0)] * (dp > 1)
    global_shape = {
        fqn: (state[fqn].shape[0] * dp, *state[fqn].shape[1:])
        if fqn in written
        else tuple(state[fqn].shape)
        for _, fqn in weights
    }
    for rank, device in enumerate(cluster.devices):
        mesh_rank = rank % tp if graph_parallel else 0
        replica_rank = rank % (dp * tp)  # its place on its stage's `dp x tp` mesh
        if staged is not None:
            rp, takes = staged[rank].program, set(staged[rank].weights)
            where = f"stage_{staged[rank].stage}_" if pp > 1 else ""
        else:
            rp, takes, where = programs[rank if graph_parallel else 0], None, ""
        order = [fqn for _, fqn in weights if takes is None or fqn in takes]
        mine = [(ph, fqn) for ph, fqn in weights if fqn in order]
        tied = _tied_weights(mine, state, whole, placements)
        replicated = sorted(set(order) & whole - tied.keys() - written)
        passes = staged[rank].passes if staged is not None else None
        programs_of_rank = [rp] if passes is None else [rp, passes.backward]
        for each in programs_of_rank:
            if id(each) not in program_member:
                name = f"programs/program_{len(program_member)}.json"
                members[name] = json.dumps(each.program).encode()
                program_member[id(each)] = name
        key = id(rp)
        weight_members = []
        if replicated:  # stored once per stage, shared by its ranks
            name = f"weights/{where}replicated.safetensors"
            members.setdefault(name, {fqn: state[fqn] for fqn in replicated})
            weight_members.append(name)
        shards = {
            fqn: local_shard(state[fqn], placements[fqn], plan.mesh_shape, mesh_rank)
            for fqn in order
            if fqn not in whole and fqn not in tied and fqn not in written
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
            fqn: Tie(
                source,
                tuple(shard_chunks(placements[fqn], plan.mesh_shape, mesh_rank))
                if source in whole
                else (),  # placed alike: this rank's chunk of the source is the whole answer
            )
            for fqn, source in tied.items()
        }
        submodels.append(
            Submodel(
                rank=rank,
                logical_device=device.logical_id,
                node_id=device.node_id,
                device_id=device.device_id,
                program=program_member[key],
                weights=tuple(weight_members),
                weight_order=tuple(order),
                tied=ties,
                comm_groups=tuple(
                    dict.fromkeys(tuple(g) for p in programs_of_rank for g in groups_in(p.program))
                )
                if graph_parallel
                else (),
                state={
                    fqn: rank_box(
                        global_shape[fqn], [*over_dp, *placements[fqn]], mesh_shape, replica_rank
                    )
                    for fqn in order
                    if fqn in written
                },
                passes=None
                if passes is None
                else Passes(
                    program_member[id(passes.backward)],
                    passes.handoffs,
                    passes.saved,
                    passes.loss,
                ),
            )
        )
        ranks_report.append(
            RankLine(
                rank=rank,
                logical_device=device.logical_id,
                weight_bytes=rp.weight_bytes,
                peak_bytes=rp.peak_bytes,
                collectives=tuple(
                    line for p in programs_of_rank for line in collective_lines(p.program, p.shapes)
                ),
            )
        )
    out_node = next(n for n in ep.graph_module.graph.nodes if n.op == "output")
    values = [
        v
        for a in tree_leaves(out_node.args[0])
        if hasattr(a, "meta") and isinstance((v := a.meta.get("val")), torch.Tensor)
    ]
    names = captured.output_names if len(captured.output_names) == len(values) else ()
    outputs = tuple(
        TensorSpec(
            (v.shape[0] * dp * micro_batches, *v.shape[1:]) if v.dim() else (),
            dtype_name(v.dtype),
            name,
        )
        for v, name in itertools.zip_longest(values, names)
    )
    layouts = {
        fqn: {
            "shape": list(global_shape[fqn]),
            "dtype": dtype_name(state[fqn].dtype),
            "mesh_shape": mesh_shape,
            "placements": [("S(0)" if fqn in written else "R")] * (dp > 1)
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
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        tessel_version=tessel_version,
        torch_version=torch.__version__,
        mode="partitioned" if graph_parallel else "replicated",
        soc_version=soc_version,
        device_type=cluster.soc.device_type,
        backend=cluster.soc.backend,
        world_size=cluster.world_size,
        cluster=cluster.raw,
        mesh=Mesh(tuple(mesh_shape), tuple(dim_names)),
        inputs=tuple(
            input_spec(n, x, dp * micro_batches)
            for n, x in zip(captured.input_names, captured.example_inputs)
        ),
        outputs=outputs,
        submodels=tuple(submodels),
        layouts="layouts.json",
        strategy="strategy.json",
        plan=_explain(plan, layouts, ranks_report),
    )
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


def input_spec(name: str, x: torch.Tensor, dp: int = 1) -> TensorSpec:
    """An input as the package takes it: with `dp` replicas, `dp` times the rows of `x`."""
    shape = (x.shape[0] * dp, *x.shape[1:]) if dp > 1 else tuple(x.shape)
    high = None
    if not x.dtype.is_floating_point and x.dtype != torch.bool and x.numel():
        high = int(x.max()) + 1  # `tessel run` draws random inputs below this bound
    return TensorSpec(shape, dtype_name(x.dtype), name, high)


def collective_lines(program: dict, shapes: dict) -> tuple[CollectiveLine, ...]:
    """A rank program's collectives as the plan's report lists them."""
    return tuple(
        CollectiveLine(c["kind"], tuple(c["group"]), c.get("bytes", 0))
        for c in collectives(program, shapes)
    )


def _explain(plan: Plan, layouts: dict, ranks: list[RankLine]) -> PlanReport:
    """What `tessel inspect` shows: placements per layer, collectives and memory per rank."""
    layers: dict[str, dict[str, tuple[str, ...]]] = defaultdict(dict)
    for n in plan.choices:
        fqn = plan.param_targets.get(n.name)
        if fqn is None or fqn not in layouts:
            continue
        users = [u for u in n.users if layer_name(u)]
        layer = layer_name(users[0]) if users else ""
        layers[layer or "(outside layers)"][fqn] = tuple(layouts[fqn]["placements"])
    fallbacks = Counter(target for _, target, _ in plan.fallbacks())
    replicated = replicated_weights(plan)  # why, for weights replicated on tp axes
    line = why_summary(plan, replicated, len(layouts))
    if line:
        log.info("%s", line)
    return PlanReport(
        estimated_time_s=plan.estimated_time,
        solver=SolverLine(**plan.solver) if plan.solver else None,
        memory=MemoryLine(**plan.memory),
        layers=dict(layers),
        fallbacks=tuple(Fallback(n, t, r) for n, t, r in plan.fallbacks()),
        fallback_ops=dict(fallbacks),
        replanned=tuple(Replan(**r) for r in plan.replanned),
        replicated={
            fqn: WhyReplicated(**asdict(r)) for fqn, r in replicated.items() if fqn in layouts
        },
        ranks=tuple(ranks),
    )
