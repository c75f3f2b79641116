"""Assign consecutive layers to pipeline stages, balanced by estimated time under memory.

The model's longest stack of indexed layers (`model.layers.0`, `model.layers.1`, ...) is cut
into `pp` runs of consecutive layers. What comes before the stack (embeddings) joins the first
stage and what comes after (final norm, head) the last. A dynamic programme over the layer chain
and the stage boundaries (the inter-operator pass of Alpa, on a chain) picks the cut whose
slowest stage is fastest, among the cuts where every stage's weights fit its devices.
"""

from __future__ import annotations

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

_LAYER = re.compile(r"^(.*)\.(\d+)\.")


class StageAssignError(TesselError, ValueError):
    """The model cannot be cut into the asked number of pipeline stages; `needed` is set where
    only memory is short (the bytes per device the best cut would need)."""

    def __init__(self, message: str, needed: int | None = None) -> None:
        super().__init__(message)
        self.needed = needed


class StageMemoryError(PlanError):
    """A stage's program (or the best cut's weights) needs more than its device holds."""

    def __init__(self, message: str, needed: int, limit: int) -> None:
        super().__init__(message)
        self.needed, self.limit = needed, limit


@dataclass
class StageAssignment:
    """Per stage, its layer indices (of `family`), estimated seconds and weight bytes per device;
    and each weight's stage."""

    family: str
    layers: list[list[int]]
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

    def to_json(self) -> list[dict]:
        return [
            {
                "stage": s,
                "layers": f"{self.family.removesuffix('.*')}.{ls[0]}-{ls[-1]}",
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
            raise StageMemoryError(str(exc), exc.needed, device_bytes) from None
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
    layer_nodes: dict[str, dict[int, list[fx.Node]]] = {}
    for n in nodes:
        key = layer_of(n)
        if key is not None:
            layer_nodes.setdefault(key[0], {}).setdefault(key[1], []).append(n)
    if not layer_nodes:
        raise StageAssignError(
            f"is {pp}, but the model has no stack of indexed layers "
            "(such as model.layers.0, model.layers.1, ...) to cut into stages"
        )
    family, by_index = max(layer_nodes.items(), key=lambda kv: len(kv[1]))
    indices = sorted(by_index)
    if pp > len(indices):
        raise StageAssignError(
            f"is {pp}, more than the model's {len(indices)} layers "
            f"({family}); use at most {len(indices)} stages"
        )
    soc = cluster.soc
    in_layer = {n for ns in by_index.values() for n in ns}
    order = {n: i for i, n in enumerate(nodes)}
    first_layer = min(order[n] for n in in_layer)

    def seconds(ns: list[fx.Node]) -> float:
        return sum(node_seconds(n, soc.peak_flops, soc.memory_bandwidth) for n in ns)

    prefix = family.removesuffix(".*")
    weight_layer: dict[str, int | str] = {}
    for fqn in weights:
        m = _LAYER.match(fqn)
        if m and m.group(1) == prefix and int(m.group(2)) in by_index:
            weight_layer[fqn] = int(m.group(2))
    held = {
        fqn: int(t.numel() * t.element_size() * placements_share.get(fqn, 1.0))
        for fqn, t in weights.items()
    }
    # a weight outside the layers goes with its first reader: its layer where that reader is
    # in one (a generation step's cache of keys and values, read and written by its layer's
    # attention), else before the layers or after them
    for fqn in weights:
        if fqn in weight_layer:
            continue
        node = weight_nodes.get(fqn)
        users = node.users if node is not None else {}
        readers = sorted((u for u in users if u in order), key=order.__getitem__)
        held_by = layer_of(readers[0]) if readers else None
        if held_by is not None and held_by[0] == family and held_by[1] in by_index:
            weight_layer[fqn] = held_by[1]
        else:
            first = order[readers[0]] if readers else -1
            weight_layer[fqn] = "before" if first < first_layer else "after"

    outside = [n for n in nodes if n not in in_layer]
    before = seconds([n for n in outside if order[n] < first_layer])
    after = seconds([n for n in outside if order[n] > first_layer])
    layer_s = [seconds(by_index[i]) for i in indices]
    layer_b = [sum(b for f, b in held.items() if weight_layer[f] == i) for i in indices]
    before_b = sum(b for f, b in held.items() if weight_layer[f] == "before")
    after_b = sum(b for f, b in held.items() if weight_layer[f] == "after")

    cuts = _cut(layer_s, layer_b, pp, (before, before_b), (after, after_b), device_bytes)
    if cuts is None:
        need = int((sum(layer_b) + before_b + after_b) / pp)
        has, needs = two_sizes(device_bytes, need)
        raise StageAssignError(
            f"is {pp}, but the model's layers cannot be cut into {pp} stages whose weights "
            f"each fit one device's {has} (about {needs} per stage at best); use more stages "
            "or more tensor parallelism",
            needed=need,
        )
    stages = [[indices[i] for i in range(a, b)] for a, b in cuts]
    stage_of_layer = {i: s for s, ls in enumerate(stages) for i in ls}
    weight_stage = {
        fqn: stage_of_layer[where] if isinstance(where, int) else 0 if where == "before" else pp - 1
        for fqn, where in weight_layer.items()
    }
    secs = [sum(layer_s[i] for i in range(a, b)) for a, b in cuts]
    byts = [sum(layer_b[i] for i in range(a, b)) for a, b in cuts]
    secs[0] += before
    byts[0] += before_b
    secs[-1] += after
    byts[-1] += after_b
    boundary = [cost.nbytes(by_index[ls[-1]][-1].meta.get("val")) for ls in stages[:-1]] + [0]
    return StageAssignment(family, stages, secs, byts, weight_stage, boundary)


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
