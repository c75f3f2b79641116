"""What a device holds while a plan runs: its weight shards and its live activations.

A value costs memory from the node that allocates it to the last node that reads it or any view
of it. Views (`view`, `t`, `permute`, `split`, ...) allocate nothing: they extend the life of the
storage they alias. Each value is counted at the size the plan gives it on one device: a shard
holds its slice (the largest slice, where shards are uneven), Replicate and Partial the whole
tensor.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import numpy as np
import torch
from torch import fx
from torch.distributed.tensor import Placement, Shard

from tessel.plan.candidates import NodeChoices

_UNSAFE_VIEWS = {torch.ops.aten._unsafe_view.default}


def is_view(node: fx.Node) -> bool:
    """Whether `node` returns an alias of its first argument (no new storage)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return is_view(node.args[0]) if isinstance(node.args[0], fx.Node) else False
    if node.target in _UNSAFE_VIEWS:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def local_bytes(
    val: torch.Tensor, placements: tuple[Placement, ...] | None, mesh_shape: tuple[int, ...]
) -> int:
    """Bytes of the largest piece of `val` one device holds under `placements`."""
    shape = list(val.shape)
    for p, n in zip(placements or (), mesh_shape):
        if isinstance(p, Shard):
            shape[p.dim] = -(-shape[p.dim] // n)  # torch.chunk: the first pieces are the largest
    return math.prod(shape) * val.element_size()


@dataclass(frozen=True)
class Storage:
    """One allocation: the node (and tuple index) whose value it is, and when it lives."""

    node: fx.Node
    index: int | None  # which output of a tuple-returning node; None for a single output
    born: int
    dies: int

    @property
    def value(self) -> torch.Tensor:
        val = self.node.meta["val"]
        return val if self.index is None else val[self.index]


def storages(graph: fx.Graph, weights: set[str]) -> list[Storage]:
    """Every activation allocation of `graph` with its live range (positions in graph order).

    `weights` names the placeholders that are weights: they are held for the whole run and are
    counted apart. User inputs live from the start; outputs until the end.
    """
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    end = len(nodes) - 1
    base: dict[fx.Node, tuple[fx.Node, int | None] | None] = {}
    for n in nodes:
        if n.op == "placeholder":
            base[n] = None if n.name in weights else (n, None)
        elif n.op != "call_function":
            continue
        elif is_view(n):
            src = n.args[0]
            base[n] = base.get(src) if isinstance(src, fx.Node) else None
        elif n.target is operator.getitem:
            base[n] = (n.args[0], n.args[1])  # an output of a tuple-returning op
        elif isinstance(n.meta.get("val"), torch.Tensor):
            base[n] = (n, None)
    dies: dict[tuple[fx.Node, int | None], int] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            key = base.get(a)
            if key is not None:
                dies[key] = max(dies.get(key, 0), end if n.op == "output" else position[n])
    out = []
    for key in dict.fromkeys(k for k in base.values() if k is not None):
        node, index = key
        val = node.meta.get("val")
        if index is not None:
            val = val[index] if isinstance(val, (tuple, list)) else None
        if not isinstance(val, torch.Tensor):
            continue
        born = 0 if node.op == "placeholder" else position[node]
        out.append(Storage(node, index, born, max(born, dies.get(key, born))))
    return out


def peak_points(live: list[Storage]) -> list[list[Storage]]:
    """The sets of storages alive together at the moments memory can peak.

    Memory can peak only just before something is freed, so a set is taken at each step where a
    storage dies. The set at a death step holds everything alive then; the set at the next
    death step is contained in it unless something was born in between, so only steps after a
    birth are kept.
    """
    by_birth = sorted(live, key=lambda s: s.born)
    moments = sorted({s.dies for s in live})
    out: list[list[Storage]] = []
    alive: list[Storage] = []
    i = 0
    previous = -1
    for t in moments:
        born_since = False
        while i < len(by_birth) and by_birth[i].born <= t:
            alive.append(by_birth[i])
            born_since = born_since or by_birth[i].born > previous
            i += 1
        alive = [s for s in alive if s.dies >= t]
        if born_since or not out:
            out.append(list(alive))
        previous = t
    return out


@dataclass
class Footprint:
    """The memory rows of a plan's ILP: what one device holds at each moment memory can peak.

    `fixed` is what every device holds whatever the plan chooses (weights with one placement);
    each row maps a decision to the bytes its strategies add at one peak moment, weights
    included.
    """

    rows: list[dict[fx.Node, np.ndarray]]
    weights: dict[fx.Node, np.ndarray]
    fixed: int

    def weight_bytes(self, choice: dict[fx.Node, int]) -> int:
        return self.fixed + int(sum(b[choice[v]] for v, b in self.weights.items()))

    def peak_bytes(self, choice: dict[fx.Node, int]) -> int:
        """The most one device holds at once under `choice`, weights included."""
        peaks = [sum(b[choice[v]] for v, b in row.items()) for row in self.rows]
        return self.fixed + int(
            max(peaks, default=sum(b[choice[v]] for v, b in self.weights.items()))
        )


def footprint(
    graph: fx.Graph,
    choices: dict[fx.Node, NodeChoices],
    weight_tensors: dict[str, torch.Tensor],
    mesh_shape: tuple[int, ...],
    with_weights: bool = True,
) -> Footprint:
    """Memory rows for the ILP. `weight_tensors` maps each weight placeholder to its tensor: one
    tensor under two names (tied weights) is held once. Without `with_weights`, the rows hold
    activations alone."""

    def owner(n: fx.Node) -> fx.Node:
        return choices[n].owner or n

    def sizes(v: fx.Node, val: torch.Tensor, index: int | None) -> np.ndarray:
        return np.array(
            [
                local_bytes(val, _placements(s.output_at(index)), mesh_shape)
                for s in choices[v].strategies
            ],
            dtype=float,
        )

    fixed = 0
    weights: dict[fx.Node, np.ndarray] = {}
    held: set[tuple[fx.Node, int]] = set()
    for n in graph.nodes:
        if not with_weights or n.op != "placeholder" or n.name not in weight_tensors:
            continue
        v, tensor = owner(n), weight_tensors[n.name]
        if (v, id(tensor)) in held:
            continue
        held.add((v, id(tensor)))
        bytes_per_strategy = sizes(v, n.meta["val"], None)
        if len(bytes_per_strategy) == 1:
            fixed += int(bytes_per_strategy[0])
        else:
            weights[v] = weights.get(v, 0) + bytes_per_strategy

    rows: dict[bytes, dict[fx.Node, np.ndarray]] = {}
    for moment in peak_points(storages(graph, set(weight_tensors))):
        row: dict[fx.Node, np.ndarray] = dict(weights)
        for s in moment:
            if s.node not in choices:
                continue
            v = owner(s.node)
            row[v] = row.get(v, 0) + sizes(v, s.value, s.index)
        key = b"".join(
            v.name.encode() + b"=" + row[v].tobytes() for v in sorted(row, key=lambda x: x.name)
        )
        rows.setdefault(key, row)
    return Footprint(list(rows.values()), weights, fixed)


def _placements(spec: object) -> tuple[Placement, ...] | None:
    return None if spec is None else tuple(spec.placements)


def program_peak_bytes(graph: fx.Graph, weights: set[str]) -> tuple[int, int]:
    """(weight bytes, peak bytes) of a traced local program: what the device running it holds.

    `weights` names the placeholders that are weights; constants the program holds count as
    weights too. The peak adds the most activation bytes alive at once, as the program runs
    node by node and frees each value after its last use.
    """

    def size(val: object) -> int:
        return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0

    held = sum(
        size(n.meta.get("val"))
        for n in graph.nodes
        if (n.op == "placeholder" and n.name in weights) or n.op == "get_attr"
    )
    moments = peak_points(storages(graph, weights))
    peak = max((sum(size(s.value) for s in moment) for moment in moments), default=0)
    return held, held + peak
