"""Assign consecutive layers to pipeline stages, balanced by estimated time under memory.

The model's stacks of indexed layers (`model.layers.0`, `model.layers.1`, ...; an encoder's and
then a decoder's) make one chain of layers in the order the program runs them, cut into `pp`
runs of consecutive layers. What comes before the first layer (embeddings) joins the first
stage, what comes between layers the next layer's stage, and what comes after the last (final
norm, head) the last stage. A dynamic programme over the chain and the stage boundaries (the
inter-operator pass of Alpa, on a chain) picks the cut whose slowest stage is fastest, among the
cuts where every stage's weights fit its devices.
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import fx

from tessel.capture import CapturedModel
from tessel.capture.layers import layer_of
from tessel.config.cluster import ClusterConfig
from tessel.errors import TesselError
from tessel.plan import cost
from tessel.plan.candidates import node_seconds
from tessel.plan.errors import PlanError
from tessel.sharding.placements import local_shard_shape
from tessel.units import two_sizes

if TYPE_CHECKING:
    from tessel.plan.planner import Plan

_INDEX = re.compile(r"\.(\d+)\.")


class StageAssignError(TesselError, ValueError):
    """The model cannot be cut into the asked number of pipeline stages; `needed` is set where
    only memory is short (the bytes per device the best cut would need)."""

    def __init__(self, message: str, needed: int | None = None) -> None:
        super().__init__(message)
        self.needed = needed


class StageMemoryError(PlanError):
    """A stage's program (or the best cut's weights) needs more than its device holds;
    `planned`, where known, is the peak per device of the plan whose stages overflow."""

    def __init__(self, message: str, needed: int, limit: int, planned: int | None = None) -> None:
        super().__init__(message)
        self.needed, self.limit, self.planned = needed, limit, planned


@dataclass
class StageAssignment:
    """Per stage, its layers (`(stack, index)`: `("model.layers.*", 3)`), estimated seconds and
    weight bytes per device; and each weight's stage."""

    layers: list[list[tuple[str, int]]]
    seconds: list[float]
    weight_bytes: list[int]
    weight_stage: dict[str, int]
    boundary_bytes: list[int]  # per stage, the bytes of the value its last layer leaves (0: last)

    def pipelined_seconds(self, micro_batches: int, send_seconds: list[float]) -> float:
        """A run's estimate: the first micro-batch passes every stage (each then sending its
        activations on), each later one adds the slowest stage's time."""
        per_stage = [t + send for t, send in zip(self.seconds, send_seconds)]
        return sum(per_stage) + (micro_batches - 1) * max(per_stage)

    def calibrate(self, whole: float) -> None:
        """Scale the stages' seconds to sum to `whole`, the plan's estimate for one micro-batch
        (which prices the sharded work and its collectives; the cut only needs their ratio)."""
        total = sum(self.seconds)
        if total > 0:
            self.seconds = [s * whole / total for s in self.seconds]

    def span(self, stage: int, stacks: bool = True) -> str:
        """Stage `stage`'s layers as ranges, each of one stack: "model.layers.0-3", or with
        several stacks "model.encoder.block.0-5, model.decoder.block.0"; without `stacks`, the
        indices alone ("0-3") where the model has one stack."""
        runs: list[list[tuple[str, int]]] = []
        for layer in self.layers[stage]:
            if runs and runs[-1][-1][0] == layer[0]:
                runs[-1].append(layer)
            else:
                runs.append([layer])
        one = len({stack for layers in self.layers for stack, _ in layers}) == 1
        return ", ".join(
            f"{run[0][1]}-{run[-1][1]}"
            if one and not stacks
            else f"{run[0][0].removesuffix('.*')}.{run[0][1]}-{run[-1][1]}"
            for run in runs
        )

    def to_json(self) -> list[dict]:
        return [
            {
                "stage": s,
                "layers": self.span(s),
                "estimated_time_s": self.seconds[s],
                "weight_bytes": self.weight_bytes[s],
            }
            for s, ls in enumerate(self.layers)
        ]


def plan_stages(
    captured: CapturedModel, plan: Plan, cluster: ClusterConfig, pp: int
) -> StageAssignment:
    """The layers of each of `pp` stages under `plan`, the seconds of each scaled to the plan's
    estimate, every stage's weights (their shards under the plan) fitting the devices of
    `cluster`. Raises `StageMemoryError` where the best cut's weights do not fit, and
    `StageAssignError` where the layers cannot be cut so."""
    ep = captured.program
    state = {**ep.state_dict, **ep.constants}
    placeholders = {n.name: n for n in ep.graph_module.graph.nodes if n.op == "placeholder"}
    device_bytes = min(d.memory_bytes for d in cluster.devices)
    share = {}
    for ph, fqn in plan.param_targets.items():
        t = state[fqn]
        local = local_shard_shape(
            t.shape, plan.out_placements(placeholders[ph]), plan.mesh_shape, 0
        )
        share[fqn] = math.prod(local) / max(1, t.numel())
    try:
        assignment = assign_stages(
            ep.graph_module.graph,
            {fqn: state[fqn] for fqn in plan.param_targets.values()},
            {fqn: placeholders[ph] for ph, fqn in plan.param_targets.items()},
            share,
            pp,
            cluster,
            device_bytes,
        )
    except StageAssignError as exc:
        if exc.needed is not None:
            planned = plan.memory.get("peak_bytes")
            raise StageMemoryError(str(exc), exc.needed, device_bytes, planned) from None
        raise
    assignment.calibrate(plan.estimated_time)
    return assignment


def assign_stages(
    graph: fx.Graph,
    weights: dict[str, torch.Tensor],
    weight_nodes: dict[str, fx.Node],
    placements_share: dict[str, float],
    pp: int,
    cluster: ClusterConfig,
    device_bytes: int,
) -> StageAssignment:
    """Cut the layer chain of `graph` into `pp` stages.

    `weights` maps each weight's name to its tensor, `weight_nodes` to its placeholder and
    `placements_share` to the part of it one device holds under the plan; `device_bytes` is what
    one device may hold.
    """
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    order = {n: i for i, n in enumerate(nodes)}
    by_layer: dict[tuple[str, int], list[fx.Node]] = {}
    for n in nodes:
        key = layer_of(n)
        if key is not None:
            by_layer.setdefault(key, []).append(n)
    if not by_layer:
        raise StageAssignError(
            f"is {pp}, but the model has no stack of indexed layers "
            "(such as model.layers.0, model.layers.1, ...) to cut into stages"
        )
    # every stack's layers, in the order the program reaches them
    chain = sorted(by_layer, key=lambda key: order[by_layer[key][0]])
    if pp > len(chain):
        stacks = ", ".join(dict.fromkeys(stack for stack, _ in chain))
        raise StageAssignError(
            f"is {pp}, more than the model's {len(chain)} layers ({stacks}); use at most "
            f"{len(chain)} stages"
        )
    soc = cluster.soc
    in_layer = {n for ns in by_layer.values() for n in ns}
    starts = [order[by_layer[key][0]] for key in chain]  # rising
    position = {key: i for i, key in enumerate(chain)}

    def seconds(ns: list[fx.Node]) -> float:
        return sum(node_seconds(n, soc.peak_flops, soc.memory_bandwidth) for n in ns)

    def following(at: int) -> int | str:
        """Where a weight first read at node order `at`, outside every layer, is held: before
        the chain, with the next layer after it, or after the chain."""
        if at < starts[0]:
            return "before"
        later = bisect.bisect_right(starts, at)
        return later if later < len(chain) else "after"

    weight_layer: dict[str, int | str] = {}  # a weight's place in the chain
    for fqn in weights:
        for m in _INDEX.finditer(fqn):  # model.decoder.block.1.layer.0.k: decoder.block's 1
            key = (fqn[: m.start()] + ".*", int(m.group(1)))
            if key in position:
                weight_layer[fqn] = position[key]
                break
    held = {
        fqn: int(t.numel() * t.element_size() * placements_share.get(fqn, 1.0))
        for fqn, t in weights.items()
    }
    # a weight outside the layers goes with its first reader: its layer where that reader is
    # in one (a generation step's cache of keys and values, read and written by its layer's
    # attention), else the next layer after it; a state that no node reads, only fills in
    # place for a later call (the prompt's mask), and a weight this program does not read,
    # are held by the first stage, where a call's inputs arrive
    for fqn in weights:
        if fqn in weight_layer:
            continue
        node = weight_nodes.get(fqn)
        users = node.users if node is not None else {}
        readers = sorted(
            (u for u in users if u in order and not _fills(u, node)), key=order.__getitem__
        )
        if not readers:
            weight_layer[fqn] = "before"
            continue
        held_by = layer_of(readers[0])
        if held_by is not None and held_by in position:
            weight_layer[fqn] = position[held_by]
        else:
            weight_layer[fqn] = following(order[readers[0]])

    outside = [n for n in nodes if n not in in_layer]
    before = seconds([n for n in outside if order[n] < starts[0]])
    after = seconds([n for n in outside if order[n] > starts[0]])
    layer_s = [seconds(by_layer[key]) for key in chain]
    layer_b = [sum(b for f, b in held.items() if weight_layer[f] == i) for i in range(len(chain))]
    before_b = sum(b for f, b in held.items() if weight_layer[f] == "before")
    after_b = sum(b for f, b in held.items() if weight_layer[f] == "after")

    cuts = _cut(layer_s, layer_b, pp, (before, before_b), (after, after_b), device_bytes)
    if cuts is None:
        need = _least_heaviest(layer_b, pp, before_b, after_b)
        has, needs = two_sizes(device_bytes, need)
        raise StageAssignError(
            f"is {pp}, but the model's layers cannot be cut into {pp} stages whose weights "
            f"each fit one device's {has} (the heaviest stage of the evenest cut holds "
            f"{needs}); use more stages or more tensor parallelism",
            needed=need,
        )
    stage_of = {i: s for s, (a, b) in enumerate(cuts) for i in range(a, b)}
    weight_stage = {
        fqn: stage_of[where] if isinstance(where, int) else 0 if where == "before" else pp - 1
        for fqn, where in weight_layer.items()
    }
    secs = [sum(layer_s[a:b]) for a, b in cuts]
    byts = [sum(layer_b[a:b]) for a, b in cuts]
    secs[0] += before
    byts[0] += before_b
    secs[-1] += after
    byts[-1] += after_b
    boundary = [cost.nbytes(by_layer[chain[b - 1]][-1].meta.get("val")) for _, b in cuts[:-1]]
    layers = [chain[a:b] for a, b in cuts]
    return StageAssignment(layers, secs, byts, weight_stage, [*boundary, 0])


def _fills(node: fx.Node, state: fx.Node | None) -> bool:
    """Whether `node` only writes into `state` in place (a copy into it), reading nothing of
    it."""
    return node.target is torch.ops.aten.copy_.default and bool(node.args) and node.args[0] is state


def _least_heaviest(held: list[int], pp: int, before: int, after: int) -> int:
    """The bytes of the heaviest stage in the cut of the layers (`held` bytes each, `before`
    on the first stage and `after` on the last) into `pp` contiguous runs that makes it least:
    the weights one device must hold however the layers are cut. It is `_cut`'s slowest stage
    where each layer's seconds are its bytes and any memory fits."""
    whole = sum(held) + before + after
    cuts = _cut([float(b) for b in held], held, pp, (before, before), (after, after), whole)
    assert cuts is not None  # pp <= len(held): every cut fits the whole
    return max(
        sum(held[a:b]) + (before if k == 0 else 0) + (after if k == pp - 1 else 0)
        for k, (a, b) in enumerate(cuts)
    )


def _cut(
    seconds: list[float],
    held: list[int],
    pp: int,
    before: tuple[float, int],
    after: tuple[float, int],
    limit: int,
) -> list[tuple[int, int]] | None:
    """Contiguous runs [a, b) of the layers, one per stage, with the least slowest stage."""
    n = len(seconds)
    inf = float("inf")
    pre_s, pre_b = [0.0], [0]
    for s, b in zip(seconds, held):
        pre_s.append(pre_s[-1] + s)
        pre_b.append(pre_b[-1] + b)

    def stage(a: int, b: int, k: int) -> float:
        t, m = pre_s[b] - pre_s[a], pre_b[b] - pre_b[a]
        if k == 0:
            t, m = t + before[0], m + before[1]
        if k == pp - 1:
            t, m = t + after[0], m + after[1]
        return t if m <= limit else inf

    # best[k][j]: the least slowest stage placing layers [0, j) on stages 0..k
    best = [[inf] * (n + 1) for _ in range(pp)]
    back = [[0] * (n + 1) for _ in range(pp)]
    for j in range(1, n + 1):
        best[0][j] = stage(0, j, 0)
    for k in range(1, pp):
        for j in range(k + 1, n + 1):
            for i in range(k, j):
                t = max(best[k - 1][i], stage(i, j, k))
                if t < best[k][j]:
                    best[k][j], back[k][j] = t, i
    if best[pp - 1][n] == inf:
        return None
    cuts, j = [], n
    for k in range(pp - 1, -1, -1):
        i = back[k][j] if k else 0
        cuts.append((i, j))
        j = i
    return cuts[::-1]
