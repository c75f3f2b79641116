"""Every rank's program on a `pp x dp x tp` mesh: the layers cut over the stages, then each
rank's program made from one stage-replica's tensor-parallel programs (`lower.stages`), each
checked to fit its device."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from tessel.capture import CapturedModel
from tessel.config.cluster import ClusterConfig
from tessel.config.errors import ConfigError
from tessel.config.mesh import POLICY_KEYS, ParallelDims
from tessel.lower.outputs import program_bytes
from tessel.lower.program import tensor_bytes
from tessel.lower.replicas import replica_programs
from tessel.lower.stages import Split, StagedProgram, StageError, stage_programs
from tessel.lower.trace import RankProgram, weight_inputs
from tessel.lower.training_stages import training_stage_programs
from tessel.package.plan_report import StageLine
from tessel.plan import Plan, cost
from tessel.plan.stages import (
    StageAssignError,
    StageAssignment,
    StageMemoryError,
    plan_stages,
)
from tessel.schedules import pipeline_order
from tessel.units import two_sizes

PP_KEY = f"graph_parallel_option.{POLICY_KEYS['pp']}"


def default_micro_batches(pp: int, rows: int) -> int:
    """With no count given: the most micro-batches up to the stage count that split `rows`."""
    return max(m for m in range(1, pp + 1) if rows % m == 0)


def more_memory(cluster: ClusterConfig, times: float) -> ClusterConfig:
    """`cluster` with `times` the memory per device: one stage's devices planned for the whole
    model hold about `1/times` of its weights once it is cut into `times` stages."""
    nodes = tuple(
        replace(
            node,
            devices=tuple(
                replace(d, memory_bytes=int(d.memory_bytes * times)) for d in node.devices
            ),
        )
        for node in cluster.nodes
    )
    return replace(cluster, nodes=nodes)


def build_stages(
    captured: CapturedModel,
    plan: Plan,
    programs: list[RankProgram],
    cluster: ClusterConfig,
    dims: ParallelDims,
    micro_batches: int,
) -> tuple[list[StagedProgram], StageAssignment | None]:
    """Every rank's program on the `pp x dp x tp` mesh, in rank order, and the layers per stage
    (None with one stage): its lowered `programs` cut by `plan`'s stages (`stage_planner`).

    Raises `StageMemoryError` where a stage's program needs more than its device's memory.
    """
    weights = weight_inputs(captured, plan)
    assignment = None
    weight_stage = {fqn: 0 for _, fqn in weights}
    if dims.size("pp") > 1:
        assignment = _stages_of(plan)
        weight_stage = assignment.weight_stage
    split = _split(captured, dims, micro_batches)
    staged = stage_programs(
        programs,
        [fqn for _, fqn in weights],
        weight_stage,
        len(captured.example_inputs),
        split,
    )
    _measure(staged, cluster, dims, assignment)
    return staged, assignment


def build_gear_stages(
    captured: CapturedModel,
    plan: Plan,
    programs: list[RankProgram],
    cluster: ClusterConfig,
    dims: ParallelDims,
    batch_inputs: Sequence[int],
) -> tuple[list[StagedProgram], StageAssignment]:
    """Every rank's program of a generation gear on the `pp x dp x tp` mesh, in rank order,
    and the layers per stage: one replica's lowered `programs` cut by `plan`'s stages, each
    stage holding its layers' cache and every rank ending with the logits (`lower.stages`),
    then copied to every replica, which reads its rows of the inputs at `batch_inputs`
    (`lower.replicas`)."""
    assignment = _stages_of(plan)
    weights = weight_inputs(captured, plan)
    pp, dp, tp = dims.size("pp"), dims.size("dp"), dims.size("tp")
    rows = captured.example_inputs[0].shape[0]
    one = stage_programs(
        programs,
        [fqn for _, fqn in weights],
        assignment.weight_stage,
        len(captured.example_inputs),
        Split(pp, 1, tp, 1, rows),
        gear=True,
    )
    staged = one
    if dp > 1:
        made = replica_programs(
            [sp.program for sp in one], dp, rows, len(captured.example_inputs), batch_inputs, tp
        )
        staged = [
            replace(one[(r // (dp * tp)) * tp + r % tp], program=rp) for r, rp in enumerate(made)
        ]
    # a gear runs the whole batch at once: no micro-batches to spread it
    _measure(
        staged, cluster, dims, assignment, "more stages, more tensor parallelism or a smaller cache"
    )
    return staged, assignment


def build_training_stages(
    captured: CapturedModel,
    plan: Plan,
    programs: list[RankProgram],
    cluster: ClusterConfig,
    dims: ParallelDims,
    gradients: tuple[str, ...],
    micro_batches: int,
    source: str,
) -> tuple[list[StagedProgram], dict[str, int], StageAssignment]:
    """Every rank's program of a training step on the `pp x dp x tp` mesh, in rank order,
    each weight's stage and the layers of each stage: `plan`'s stages (`stage_planner`) cut out
    of its lowered `programs`. A weight's other names (tied embeddings) belong to its stage:
    the stages that read it there receive it, so one rank holds and updates it."""
    assignment = _stages_of(plan)
    weights = weight_inputs(captured, plan)
    state = {**captured.program.state_dict, **captured.program.constants}
    stage = dict(assignment.weight_stage)
    owner: dict[int, str] = {}  # a tensor's trained name, or its first
    for _, fqn in weights:
        key = id(state[fqn])
        if key not in owner or (fqn in gradients and owner[key] not in gradients):
            owner[key] = fqn
    for _, fqn in weights:
        stage[fqn] = stage[owner[id(state[fqn])]]
    split = _split(captured, dims, micro_batches)
    try:
        staged = training_stage_programs(
            programs,
            [fqn for _, fqn in weights],
            stage,
            gradients,
            len(captured.example_inputs),
            split,
        )
    except StageError as exc:
        raise ConfigError(source, PP_KEY, f"the training step cannot be cut: {exc}") from None
    _measure(staged, cluster, dims, assignment, micro_batches=micro_batches)
    return staged, stage, assignment


def _split(captured: CapturedModel, dims: ParallelDims, micro_batches: int) -> Split:
    """The mesh's cut of the work, micro-batches of the rows the programs were lowered for."""
    rows = captured.example_inputs[0].shape[0] if captured.example_inputs else 1
    return Split(dims.size("pp"), dims.size("dp"), dims.size("tp"), micro_batches, rows)


def _measure(
    staged: list[StagedProgram],
    cluster: ClusterConfig,
    dims: ParallelDims,
    assignment: StageAssignment | None,
    remedies: str = "more stages, more micro-batches or more tensor parallelism",
    micro_batches: int = 1,
) -> None:
    """Record each rank's weight and peak bytes in its program (a training stage's over its
    passes of one step, `micro_batches` of them each way); raise `StageMemoryError` where a
    peak is more than the rank's device holds, advising `remedies`."""
    measured: dict[tuple, tuple[int, int]] = {}
    for rank, sp in enumerate(staged):
        # replicas after the first run the same program over other ranks
        coordinate = dims.coordinate(rank)
        key = (sp.stage, coordinate["tp"], coordinate["dp"] == 0)
        if key not in measured and sp.passes is not None:
            measured[key] = _passes_bytes(sp, dims.size("pp"), micro_batches)
        elif key not in measured:
            measured[key] = program_bytes(sp.program, len(sp.weights))
        held, peak = measured[key]
        sp.program = replace(sp.program, weight_bytes=held, peak_bytes=peak)
        if peak > cluster.devices[rank].memory_bytes:
            where = f"rank {rank}"
            if assignment is not None:
                layers = assignment.span(sp.stage, stacks=False)
                where = f"pipeline stage {sp.stage} (layers {layers}) on {where}"
            holds, has = two_sizes(peak, cluster.devices[rank].memory_bytes)
            raise StageMemoryError(
                f"{where} holds {holds} at its peak, more than the device's {has}; use {remedies}",
                peak,
                cluster.devices[rank].memory_bytes,
            )


def _passes_bytes(sp: StagedProgram, pp: int, micro_batches: int) -> tuple[int, int]:
    """(weight bytes, peak bytes) of a training stage's rank over one step, its passes run in
    1F1B order as the runtime runs them (`runtime.pipeline_runner` with receives posted ahead):
    every receive of the step posted at its start and held until its pass, what a forward pass
    saves held until its backward pass, each pass holding its inputs throughout, the gradients
    summed over the micro-batches held for the step, and each pass's sends freed after it."""
    passes = sp.passes
    assert passes is not None
    s = sp.stage
    forward, backward = sp.program, passes.backward

    def input_bytes(rp: RankProgram) -> list[int]:
        names = [n["name"] for n in rp.program["nodes"] if n["op"] == "input"]
        return [tensor_bytes(*rp.shapes[n]) for n in names]

    f_in, b_in = input_bytes(forward), input_bytes(backward)
    held_weights = sum(f_in[: len(sp.weights)])
    taken = {
        phase: [h for h in passes.handoffs if h.receiver == (phase, s)] for phase in ("F", "B")
    }
    once = {
        p: sum(tensor_bytes(list(h.shape), h.dtype) for h in hs if h.once)
        for p, hs in taken.items()
    }
    each = {
        p: sum(tensor_bytes(list(h.shape), h.dtype) for h in hs if not h.once)
        for p, hs in taken.items()
    }
    saved = sum(b_in[len(b_in) - passes.saved :]) if passes.saved else 0
    returned = [a["$node"] for a in backward.program["nodes"][-1]["args"]]
    sent_back = sum(1 for h in passes.handoffs if h.sender == ("B", s))
    gradients = returned[sent_back : len(returned) - (passes.loss == ("B", s))]
    summed = sum(tensor_bytes(*backward.shapes[g]) for g in gradients)
    peak_of = {
        "F": program_bytes(forward, len(f_in))[1],
        "B": program_bytes(backward, len(b_in))[1],
    }
    actions = pipeline_order("1f1b", pp, pp, micro_batches)[s]
    pending = sum(each[a.phase] for a in actions)  # receives posted, not yet taken
    kept = once["F"] + once["B"]
    outstanding = peak = 0  # micro-batches whose saved tensors are held
    for a in actions:
        pending -= each[a.phase]
        if a.phase == "B":
            outstanding -= 1
        others = kept - once[a.phase] + summed + outstanding * saved + pending
        peak = max(peak, peak_of[a.phase] + others)
        if a.phase == "F":
            outstanding += 1
    return held_weights, peak


def stage_planner(
    captured: CapturedModel, cluster: ClusterConfig, dims: ParallelDims, source: str
) -> Callable[[Plan], StageAssignment]:
    """The planner's layers per stage of the mesh, decided for each plan before it is lowered
    (`plan_and_lower`'s `stages`). A model whose layers cannot be divided so is refused
    naming the policy `source`; where the best division's weights overflow a device,
    `StageMemoryError` says by how much."""

    def planned(plan: Plan) -> StageAssignment:
        try:
            return plan_stages(captured, plan, cluster, dims.size("pp"))
        except StageAssignError as exc:
            raise ConfigError(source, PP_KEY, str(exc)) from None

    return planned


def _stages_of(plan: Plan) -> StageAssignment:
    if plan.stages is None:
        raise ValueError("the plan was lowered without its stages (plan_and_lower's stages)")
    return plan.stages


def pipeline_estimate(
    captured: CapturedModel,
    plan: Plan,
    cluster: ClusterConfig,
    dims: ParallelDims,
    micro_batches: int,
    source: str = "policy",
) -> float:
    """A run's estimated seconds on the stages, before any program is lowered: each boundary
    sends the whole value its last layer leaves (its shard may be less). The plan keeps its
    stages, cut here where it has none yet."""
    if plan.stages is None:
        plan.stages = stage_planner(captured, cluster, dims, source)(plan)
    assignment = plan.stages
    link = cost.Links(dims.axis("pp").bandwidth, cluster.soc.link_latency)
    sends = [b / link.bandwidth + link.latency if b else 0.0 for b in assignment.boundary_bytes]
    return assignment.pipelined_seconds(micro_batches, sends)


def send_seconds(
    staged: list[StagedProgram], dims: ParallelDims, cluster: ClusterConfig, micro_batches: int
) -> list[float]:
    """Per stage, the seconds one micro-batch's activations take to reach the later stages
    over the pipeline axis's link (every rank of a stage sends its own shard at once)."""
    link = cost.Links(dims.axis("pp").bandwidth, cluster.soc.link_latency)
    out = [0.0] * dims.size("pp")
    for sp in staged:
        if sp.sent_bytes:
            per_batch = sp.sent_bytes / micro_batches
            out[sp.stage] = max(out[sp.stage], per_batch / link.bandwidth + link.latency)
    return out


def stage_lines(stages: StageAssignment, staged: list) -> tuple[StageLine, ...]:
    """The stages as the plan's report lists them, each with the ranks that run it."""
    return tuple(
        StageLine(
            **entry, ranks=tuple(r for r, sp in enumerate(staged) if sp.stage == entry["stage"])
        )
        for entry in stages.to_json()
    )
