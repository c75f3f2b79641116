"""What a device holds while a plan runs: its weight shards and its live activations.

A value costs memory from the node that allocates it to the last node that reads it or any view
of it. Views (`view`, `t`, `permute`, `split`, ...) allocate nothing: they extend the life of the
storage they alias. Each value is counted at the size the plan gives it on one device: a shard
holds its slice (the largest slice, where shards are uneven), Replicate and Partial the whole
tensor.
"""

from __future__ import annotations

import functools
import math
import operator
from collections import Counter
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Union

import numpy as np
import torch
from torch import fx
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from tessel._torch import C10D_FUNCTIONAL, redistribute_steps, tree_leaves
from tessel.capture.grouped_queries import repeat_edges, repeat_left_unread
from tessel.capture.training import gradient_outputs, state_outputs
from tessel.plan.candidates import NodeChoices
from tessel.plan.problem import MemoryRow, pairwise
from tessel.sharding.gather import gather_steps, partial_to_shards, shard_placements

if TYPE_CHECKING:
    from tessel._torch import DTensorSpec

# ops that hand back (a view of) their argument though their schema does not say so
_UNANNOTATED_VIEWS = {
    torch.ops.aten._unsafe_view.default,
    getattr(torch.ops, C10D_FUNCTIONAL).wait_tensor.default,
}


def is_view(node: fx.Node) -> bool:
    """Whether `node` returns (a view of) its first argument: no new storage. The copy of keys
    and values that grouped-query attention repeats is counted as one: the lowering folds it
    away wherever the plan moves nothing on its way (`_unfolded_repeats` counts the others)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return is_view(node.args[0]) if isinstance(node.args[0], fx.Node) else False
    if node.target in _UNANNOTATED_VIEWS or repeat_left_unread(node):
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    return schema.returns[0].alias_info is not None  # a view, or an in-place op's own argument


def local_bytes(
    val: torch.Tensor,
    placements: tuple[Placement, ...] | None,
    mesh_shape: tuple[int, ...],
    at: tuple[int, ...] | None = None,
) -> int:
    """Bytes of the piece of `val` one device holds under `placements`: the largest piece, or
    that of the device at mesh coordinates `at`."""
    return math.prod(_local_shape(val, placements, mesh_shape, at)) * val.element_size()


def _local_shape(
    val: torch.Tensor,
    placements: Sequence[Placement] | None,
    mesh_shape: tuple[int, ...],
    at: tuple[int, ...] | None = None,
) -> list[int]:
    """The shape of the piece of `val` one device holds (as `local_bytes` counts it)."""
    shape = list(val.shape)
    for i, (p, n) in enumerate(zip(placements or (), mesh_shape)):
        if isinstance(p, Shard):
            chunk = -(-shape[p.dim] // n)  # torch.chunk: the first pieces are the largest
            shape[p.dim] = chunk if at is None else max(0, min(chunk, shape[p.dim] - at[i] * chunk))
    return shape


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


def _peak_steps(live: list[Storage], also: AbstractSet[int]) -> list[int]:
    """The steps at which memory can peak.

    Memory can peak only just before something is freed, so a step where a storage dies is
    taken. What is alive there holds what is alive at the next death step, unless something
    was born in between, so only death steps after a birth are kept. Steps in `also` (where a
    node allocates buffers of its own) are always kept.
    """
    births = sorted(s.born for s in live)
    deaths = {s.dies for s in live}
    out: list[int] = []
    i, born_since = 0, False
    for t in sorted(deaths | set(also)):
        while i < len(births) and births[i] <= t:
            born_since, i = True, i + 1
        if t in also or (t in deaths and (born_since or not out)):
            out.append(t)
        if t in deaths:
            born_since = False
    return out


def sweep(
    live: list[Storage], also: AbstractSet[int]
) -> Iterator[tuple[int, list[Storage], list[Storage]]]:
    """Each step memory can peak at, with the storages born and freed since the step before:
    the sets alive at those steps as changes, so a sum over them is kept in time linear in the
    storages rather than in the steps times the storages alive at each."""
    by_birth = sorted(live, key=lambda s: s.born)
    by_death = sorted(live, key=lambda s: s.dies)
    i = j = 0
    for t in _peak_steps(live, also):
        started, stopped = [], []
        while i < len(by_birth) and by_birth[i].born <= t:
            started.append(by_birth[i])
            i += 1
        while j < len(by_death) and by_death[j].dies < t:
            stopped.append(by_death[j])
            j += 1
        yield t, started, stopped


@dataclass(frozen=True)
class Steps:
    """What of a graph's memory no plan changes: its nodes in order, every storage's live
    range, each view's last step (through views of it) and the last step the storage it
    aliases is read apart from it (`_read_apart`). Built once per graph and weights, it serves
    every count of that graph's memory."""

    nodes: list[fx.Node]
    live: list[Storage]
    lives: dict[fx.Node, int]
    read_apart: dict[fx.Node, int]
    views: frozenset[fx.Node]
    # the copies of repeated keys and values counted as views (`repeat_left_unread`); each
    # one's step, and its expand's: a move into either leaves the copy made (`_unfolded_repeats`)
    repeats: frozenset[fx.Node] = frozenset()
    copied_at: dict[fx.Node, int] = field(default_factory=dict)
    position: dict[fx.Node, int] = field(default_factory=dict)

    @classmethod
    def of(cls, graph: fx.Graph, weights: frozenset[str]) -> Steps:
        nodes = list(graph.nodes)
        position = {n: i for i, n in enumerate(nodes)}
        views = frozenset(n for n in nodes if is_view(n))
        last = len(nodes) - 1
        lives: dict[fx.Node, int] = {}
        for n in reversed(nodes):
            end = max((last if u.op == "output" else position[u] for u in n.users), default=0)
            for u in n.users:
                # a view aliases its first input alone: an op writing `n` into another tensor
                # in place (the cache's index_put_) holds that tensor, not `n`
                if u in views and u.args and u.args[0] is n:
                    end = max(end, lives[u])
            lives[n] = max(end, position[n])
        read_apart = _read_apart(nodes, position, weights)
        repeats = frozenset(n for n in views if repeat_left_unread(n))
        copied_at = {n: position[r] for r in repeats for n in (r, r.args[0])}
        live = storages(graph, set(weights))
        return cls(nodes, live, lives, read_apart, views, repeats, copied_at, position)


@dataclass
class Footprint:
    """The memory rows of a plan's ILP: what one device holds at each moment memory can peak.

    `fixed` is what every device holds whatever the plan chooses (weights with one placement);
    each row holds, per decision, the bytes its strategies add at one moment (weights
    included), and per producer-consumer pair the buffer a resharding between them allocates.
    """

    rows: list[MemoryRow]
    weights: dict[fx.Node, np.ndarray]
    fixed: int
    # the rows of a rank that receives none of a forward's outputs (every rank but 0)
    other_rows: list[MemoryRow] = field(default_factory=list)

    def weight_bytes(self, choice: dict[fx.Node, int]) -> int:
        return self.fixed + int(sum(b[choice[v]] for v, b in self.weights.items()))

    def frugal_choice(self) -> dict[fx.Node, int]:
        """Each decision's strategy holding the fewest bytes summed over every moment: one
        concrete plan, found without a search, whose peak bounds the least from above."""
        totals: dict[fx.Node, np.ndarray] = {}
        for row in self.rows:
            for v, b in row.linear.items():
                totals[v] = totals[v] + b if v in totals else b
        return {v: int(np.argmin(b)) for v, b in totals.items()}

    def peak_bytes(self, choice: dict[fx.Node, int], rank_0: bool = True) -> int:
        """The most one device holds at once under `choice`, weights included: rank 0's, or
        (`rank_0=False`) that of a rank the outputs are not gathered to."""
        rows = self.rows if rank_0 or not self.other_rows else self.other_rows
        weights = sum(b[choice[v]] for v, b in self.weights.items())
        return self.fixed + int(max((r.bytes_for(choice) for r in rows), default=weights))


@dataclass(frozen=True)
class Held:
    """What a device holds under one choice of every decision."""

    weight_bytes: int
    peak_bytes: int  # rank 0's, the outputs gathered to it
    other_ranks_peak_bytes: int  # a rank no output is gathered to
    # each rank's: where a dim splits unevenly, the last ranks hold smaller weight shards
    rank_peak_bytes: tuple[int, ...] = ()


class MemoryModel:
    """Each device's bytes under the planner's choices.

    The solver's rows (`footprint`: every decision's every strategy, every resharding pair's
    buffers) cost more to build than most solves; they are built only when a solve needs them,
    where the fastest plan does not fit. One choice's figures (`held`) cost a sweep of the
    graph with each node cut to the strategy it takes.
    """

    def __init__(
        self,
        graph: fx.Graph,
        choices: dict[fx.Node, NodeChoices],
        weight_tensors: dict[str, torch.Tensor],
        mesh_shape: tuple[int, ...],
        like: dict[int, fx.Node] | None = None,
        limit: int | None = None,
    ) -> None:
        self._args = (graph, choices, weight_tensors, mesh_shape, like)
        self._steps = Steps.of(graph, frozenset(weight_tensors))
        self._weights = held_weights(graph, choices, weight_tensors)
        marks = gradient_outputs(graph)  # a training step holds optimizer state per weight
        self._held_per_weight = marks.held_factor if marks is not None else 1.0
        self._footprint: Footprint | None = None
        self._held: dict[tuple, Held] = {}
        self.limit = limit  # the bytes a device may hold (None: no limit)

    @property
    def footprint(self) -> Footprint:
        """The memory rows of every choice, built on first use."""
        if self._footprint is None:
            self._footprint = footprint(*self._args, steps=self._steps)
        return self._footprint

    def held(self, choice: dict[fx.Node, int]) -> Held:
        """Weights and peaks per device under `choice` (decision owner -> strategy index)."""
        key = tuple(choice.items())
        if key not in self._held:
            self._held[key] = self._count(choice)
        return self._held[key]

    def _count(self, choice: dict[fx.Node, int]) -> Held:
        graph, choices, weight_tensors, mesh_shape, like = self._args
        if self._footprint is None:
            taken = {
                n: replace(c, strategies=[c.strategies[choice[c.owner or n]]])
                for n, c in choices.items()
            }
            held = footprint(graph, taken, weight_tensors, mesh_shape, like, self._steps)
            index = dict.fromkeys(choice, 0)
        else:
            held, index = self._footprint, choice
        peak, other = held.peak_bytes(index), held.peak_bytes(index, rank_0=False)
        return Held(
            held.weight_bytes(index),
            peak,
            other,
            tuple(
                (peak if r == 0 else other) - self._weights_short_of_largest(choice, r)
                for r in range(math.prod(mesh_shape))
            ),
        )

    def _weights_short_of_largest(self, choice: dict[fx.Node, int], rank: int) -> int:
        """The weight bytes `rank` holds less than the largest shards `held` counts: torch.chunk
        leaves the last pieces of an uneven dim smaller (or empty). Weights are held
        throughout, so they lower every moment of the rank's memory alike."""
        _, choices, _, mesh_shape, _ = self._args
        at = tuple(int(c) for c in np.unravel_index(rank, mesh_shape))
        if not any(at):
            return 0
        short = 0
        for v, n in self._weights:
            placements = _placements(choices[v].strategies[choice[v]].output_at(None))
            val = n.meta["val"]
            short += local_bytes(val, placements, mesh_shape) - local_bytes(
                val, placements, mesh_shape, at
            )
        return int(short * self._held_per_weight)

    def weight_floor(self) -> int:
        """The fewest weight bytes any choice leaves a device: every weight at its smallest
        shard. Weights are held for the whole run, so no plan holds less at its peak."""
        _, choices, _, mesh_shape, _ = self._args
        least = 0
        for v, n in self._weights:
            val = n.meta["val"]
            least += min(
                local_bytes(val, _placements(s.output_at(None)), mesh_shape)
                for s in choices[v].strategies
            )
        return int(least * self._held_per_weight)

    def fits(self, choice: dict[fx.Node, int]) -> bool:
        """Whether every device's peak under `choice` is within `limit`."""
        return self.limit is None or self.held(choice).peak_bytes <= self.limit

    def budget(self) -> float:
        """The solver's memory budget: `limit` less what every plan holds (`footprint.fixed`)."""
        return float((self.limit or 0) - self.footprint.fixed)


def held_weights(
    graph: fx.Graph, choices: dict[fx.Node, NodeChoices], weight_tensors: dict[str, torch.Tensor]
) -> list[tuple[fx.Node, fx.Node]]:
    """(decision owner, placeholder) of each weight a device holds: one tensor under two names
    (tied weights) is held once."""
    out, seen = [], set()
    for n in graph.nodes:
        if n.op != "placeholder" or n.name not in weight_tensors:
            continue
        v = choices[n].owner or n
        if (v, id(weight_tensors[n.name])) not in seen:
            seen.add((v, id(weight_tensors[n.name])))
            out.append((v, n))
    return out


def footprint(
    graph: fx.Graph,
    choices: dict[fx.Node, NodeChoices],
    weight_tensors: dict[str, torch.Tensor],
    mesh_shape: tuple[int, ...],
    like: dict[int, fx.Node] | None = None,
    steps: Steps | None = None,
) -> Footprint:
    """Memory rows for the ILP. `weight_tensors` maps each weight placeholder to its tensor: one
    tensor under two names (tied weights) is held once. A training graph's weights are held
    with their optimizer state beside them, and its gradients are outputs placed like their
    weights (`like`: output index -> weight placeholder). `steps` is the graph's `Steps`,
    where the caller keeps them."""
    steps = steps or Steps.of(graph, frozenset(weight_tensors))
    marks = gradient_outputs(graph)
    held_per_weight = marks.held_factor if marks is not None else 1.0

    def owner(n: fx.Node) -> fx.Node:
        return choices[n].owner or n

    known: dict[tuple[fx.Node, fx.Node, int | None], np.ndarray] = {}

    def sizes(v: fx.Node, n: fx.Node, val: torch.Tensor, index: int | None) -> np.ndarray:
        """Bytes of `n`'s value (output `index`) per strategy of its owner `v`, computed
        once: a value is counted in every moment it lives through."""
        key = (v, n, index)
        if key not in known:
            known[key] = np.array(
                [
                    local_bytes(val, _placements(s.output_at(index)), mesh_shape)
                    for s in choices[v].strategies
                ],
                dtype=float,
            )
        return known[key]

    fixed = 0
    weights: dict[fx.Node, np.ndarray] = {}
    for v, n in held_weights(graph, choices, weight_tensors):
        bytes_per_strategy = sizes(v, n, n.meta["val"], None) * held_per_weight
        if len(bytes_per_strategy) == 1:
            fixed += int(bytes_per_strategy[0])
        else:
            weights[v] = weights.get(v, 0) + bytes_per_strategy

    # a forward's outputs are gathered to rank 0; a training or generation step's are not
    forward = marks is None and not state_outputs(graph)
    buffers = _resharding_buffers(steps, choices, mesh_shape, like or {}, forward)
    buffers += _unfolded_repeats(steps, choices, mesh_shape)
    by_start = sorted(buffers, key=lambda b: b.start)
    by_end = sorted(buffers, key=lambda b: b.end)
    now = _HeldNow(weights)

    def storage(s: Storage, sign: int) -> None:
        if s.node in choices:
            v = owner(s.node)
            now.change(v, sizes(v, s.node, s.value, s.index), sign)

    def buffer(b: _Buffer, sign: int) -> None:
        vp, vc = b.pair
        if vp is vc:
            now.change(vp, np.diag(b.bytes), sign)
        else:
            now.change(b.pair, b.bytes, sign)

    rows: dict[frozenset, MemoryRow] = {}  # rank 0's, the ILP's
    others: dict[frozenset, MemoryRow] = {}  # those of a rank no output is gathered to

    def take_row(into: dict[frozenset, MemoryRow]) -> frozenset:
        key = now.key()
        if key not in into:
            into[key] = rows.get(key) or others.get(key) or now.row()
        return key

    i = j = 0
    for t, started, stopped in sweep(steps.live, {b.start for b in buffers}):
        for s in started:
            storage(s, 1)
        to_rank_0, to_others = [], []
        while i < len(by_start) and by_start[i].start <= t:
            if by_start[i].rank_0_only:
                to_rank_0.append(by_start[i])
            elif by_start[i].others_only:
                to_others.append(by_start[i])
            else:
                buffer(by_start[i], 1)
            i += 1
        for s in stopped:
            storage(s, -1)
        while j < len(by_end) and by_end[j].end < t:
            if not by_end[j].others_only:
                buffer(by_end[j], -1)
            j += 1
        if to_rank_0 or to_others:  # the outputs' step: rank 0 holds more than the others
            for b in to_others:
                buffer(b, 1)
            take_row(others)
            for b in to_others:
                buffer(b, -1)
            for b in to_rank_0:
                buffer(b, 1)
        key = take_row(rows)
        if not (to_rank_0 or to_others):
            others[key] = rows[key]
    return Footprint(list(rows.values()), weights, fixed, list(others.values()))


@dataclass(frozen=True)
class _Buffer:
    """A copy that resharding an input makes: which (producer, consumer) strategy pairs make
    it, its bytes for each pair, and the steps it lives."""

    pair: tuple[fx.Node, fx.Node]
    bytes: np.ndarray
    start: int
    end: int
    rank_0_only: bool = False  # a forward's output, gathered to rank 0
    others_only: bool = False  # what the other ranks hold as they send it


def _resharding_buffers(
    steps: Steps,
    choices: dict[fx.Node, NodeChoices],
    mesh_shape: tuple[int, ...],
    like: dict[int, fx.Node],
    forward: bool = False,
) -> list[_Buffer]:
    """The buffers that moving nodes' inputs to their placements allocates.

    An input whose producer's placement differs from the one the consumer takes is copied (a
    gather, a reduction, a slice): the copy, at the consumer's placement, lives while the
    consumer runs, or, where the consumer is a view, as long as the view does (the moved value
    alone: the copies made on the way to it are freed as the move ends). At the end a
    forward's outputs are gathered to rank 0 (`gathered_output_bytes`); a training step's are
    gathered whole, or placed like their weights.

    A view that moves its input reads the copy, not the storage its input aliases: that
    storage (or an earlier move's copy) is no longer kept alive by the view and views of it.
    `storages` keeps it alive through them whatever the plan, so from the step after the move
    to the view's last step, where nothing else reads it, a buffer of negative bytes (the
    input's, for the pairs that move it) takes it away again. Weights are held throughout,
    and nothing is taken away from them.
    """
    lives, read_apart = steps.lives, steps.read_apart
    # the step each value holding storage of its own (no view, no tuple part) is last read
    dies = {s.node: s.dies for s in steps.live if s.index is None}
    others = range(1, math.prod(mesh_shape))
    whole = tuple(Replicate() for _ in mesh_shape)
    out: list[_Buffer] = []
    matrices: dict[tuple, np.ndarray] = {}
    moved: dict[tuple, tuple[float, float, float]] = {}

    def counted(val: torch.Tensor, like_val: tuple, s: tuple | None, d: tuple | None) -> tuple:
        key = (like_val, s, d)
        if key not in moved:
            moved[key] = _move_bytes(val, s, d, mesh_shape)
        return moved[key]

    for t, n in enumerate(steps.nodes):
        if n.op == "output":
            leaves = [a for a in tree_leaves(n.args[0]) if isinstance(a, fx.Node)]
            for i, a in enumerate(leaves):
                weight = like.get(i)
                if weight is None or a not in choices or weight not in choices:
                    continue
                val = a.meta.get("val")
                if not isinstance(val, torch.Tensor):
                    continue  # nothing is moved
                vp, vw = choices[a].owner or a, choices[weight].owner or weight
                src = [
                    _placements(s.output_at(choices[a].out_index)) for s in choices[vp].strategies
                ]
                dst = [
                    _placements(choices[weight].out_spec(k))
                    for k in range(len(choices[vw].strategies))
                ]
                to_weight = [[_buffer_bytes(val, s, d, mesh_shape) for d in dst] for s in src]
                if np.any(to_weight):
                    out.append(_Buffer((vp, vw), np.array(to_weight), t, t))
            if forward:  # a forward's outputs are gathered to rank 0, never all-gathered
                for a in leaves:
                    p, val = choices.get(a), a.meta.get("val")
                    if (
                        p is None
                        or p.kind in ("const", "drop")
                        or not isinstance(val, torch.Tensor)
                    ):
                        continue
                    vp = p.owner or a
                    src = [_placements(s.output_at(p.out_index)) for s in choices[vp].strategies]
                    sizes = [gathered_output_bytes(val, s, mesh_shape) for s in src]
                    if any(sizes):
                        out.append(_Buffer((vp, vp), np.diag(sizes), t, t, rank_0_only=True))
                    sent = [
                        max(
                            (gathered_output_bytes(val, s, mesh_shape, r) for r in others),
                            default=0.0,
                        )
                        for s in src
                    ]
                    if any(sent):
                        out.append(_Buffer((vp, vp), np.diag(sent), t, t, others_only=True))
                continue
            # (input, its index among the consumer's inputs, or the placements it must take)
            edges: list[tuple[fx.Node, int | None, tuple[Placement, ...] | None]]
            edges = [(a, None, whole) for i, a in enumerate(leaves) if i not in like]
            vc, end = None, t
        else:
            c = choices.get(n)
            if c is None or c.kind not in ("op", "fallback"):
                continue
            vc = c.owner or n
            edges = [(a, j, None) for j, a in enumerate(c.args)]
            end = lives[n] if n in steps.views else t
            if n in steps.copied_at:  # moved into a repeat: the copy is made, and read last
                end = steps.copied_at[n]
        for a, j, fixed_dst in edges:
            p, val = choices.get(a), a.meta.get("val")
            if p is None or p.kind in ("const", "drop") or not isinstance(val, torch.Tensor):
                continue
            vp = p.owner or a
            src = [_placements(s.output_at(p.out_index)) for s in choices[vp].strategies]
            if fixed_dst is not None:  # an output: a buffer of the producer's choice alone
                sizes = [_buffer_bytes(val, s, fixed_dst, mesh_shape) for s in src]
                if any(sizes):
                    out.append(_Buffer((vp, vp), np.diag(sizes), t, end))
                continue
            assert j is not None and vc is not None  # an op's input: the op, its input index
            dst = [
                _placements(s.inputs[j]) if j < len(s.inputs) else None
                for s in choices[vc].strategies
            ]
            # identical layers repeat the same shapes and strategies: each matrix made once,
            # and strategies repeat placements: each move counted once (`pairwise`)
            like_val = (tuple(val.shape), tuple(val.stride()), val.element_size())
            key = (like_val, tuple(src), tuple(dst))
            if key not in matrices:
                moves = pairwise(src, dst, functools.partial(counted, val, like_val))
                matrices[key] = moves.reshape(len(src), len(dst), 3)
            m = matrices[key]
            if not np.any(m[..., 0]):
                continue
            if end == t:
                # the move runs before the op writes its output: the op's step holds the
                # larger of the move's peak and the moved value beside that output. Summed
                # over several moved inputs this bounds their moves run one after another.
                made = _output_bytes(n, choices[n].out_index, choices[vc], mesh_shape)
                if made is None:
                    out.append(_Buffer((vp, vc), m[..., 0], t, t))
                    continue
                held = np.zeros(len(src))
                if dies.get(a) == t and choices[n].args.count(a) == 1:
                    # read by nothing after this op: freed once moved
                    held = np.array([local_bytes(val, s, mesh_shape) for s in src], dtype=float)
                moment = np.maximum(m[..., 1] + made, held[:, None] + m[..., 0])
                after = moment - held[:, None] - made
                out.append(_Buffer((vp, vc), np.where(m[..., 0] > 0, after, 0.0), t, t))
                continue
            # a view reads the moved value later; the copies made on the way are freed now
            peak = m[..., 0]
            apart = read_apart.get(n) if a is n.args[0] else None
            if apart is not None and apart < end:  # its input is freed once moved
                held = np.array([local_bytes(val, s, mesh_shape) for s in src], dtype=float)
                moves = m[..., 0] > 0
                if apart == t:
                    # read by nothing else: freed as soon as the move's first copy is made
                    peak = np.where(moves, np.maximum(peak, held[:, None] + m[..., 2]), 0.0)
                freed = np.where(moves, -held[:, None], 0.0)
                out.append(_Buffer((vp, vc), freed, apart if apart == t else apart + 1, end))
            if np.any(peak - m[..., 1]):
                out.append(_Buffer((vp, vc), peak - m[..., 1], t, t))
            out.append(_Buffer((vp, vc), m[..., 1], t, end))
    return out


def _unfolded_repeats(
    steps: Steps, choices: dict[fx.Node, NodeChoices], mesh_shape: tuple[int, ...]
) -> list[_Buffer]:
    """The copies of repeated keys and values that a plan keeps (see `repeat_edges`).

    `is_view` counts such a copy as holding nothing, as the lowering folds it away. Where the
    plan moves the value on its way from the unrepeated keys or values to the attention, the
    rank's program holds the copy: from where it is made to its last reader where the move
    comes before it, to the move where the move comes after. It is counted, at its local size,
    for each pair of strategies that moves the value on one of those edges: twice where a plan
    moves it twice, which no cheapest plan does.
    """
    out: list[_Buffer] = []
    for clone in steps.repeats:
        born = steps.copied_at[clone]
        for a, c in repeat_edges(clone):
            p, q = choices.get(a), choices.get(c)
            if p is None or q is None or p.kind in ("const", "drop") or a not in q.args:
                continue
            j = q.args.index(a)
            vp, vc = p.owner or a, q.owner or c
            src = [_placements(s.output_at(p.out_index)) for s in choices[vp].strategies]
            dst = [_placements(s.inputs[j]) if j < len(s.inputs) else None for s in q.strategies]
            if c in steps.copied_at:  # moved into the expand or the copy: the copy's shape
                size = [
                    local_bytes(c.meta["val"], _placements(q.out_spec(k)), mesh_shape)
                    for k in range(len(dst))
                ]
                moved = [[size[k] * (s != d) for k, d in enumerate(dst)] for s in src]
                dies = steps.lives[clone]
            else:  # moved out of a view of the copy: its elements
                size = [local_bytes(a.meta["val"], s, mesh_shape) for s in src]
                moved = [[size[i] * (s != d) for d in dst] for i, s in enumerate(src)]
                dies = steps.position[c]
            if np.any(moved):
                out.append(_Buffer((vp, vc), np.array(moved, dtype=float), born, dies))
    return out


def _output_bytes(
    n: fx.Node, index: int | None, owner: NodeChoices, mesh_shape: tuple[int, ...]
) -> np.ndarray | None:
    """Bytes of `n`'s output (`index` of its owner's) per strategy of its owner's decision;
    None where it is not one tensor."""
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return np.array(
        [local_bytes(val, _placements(s.output_at(index)), mesh_shape) for s in owner.strategies],
        dtype=float,
    )


def _read_apart(
    nodes: list[fx.Node], position: dict[fx.Node, int], weights: frozenset[str]
) -> dict[fx.Node, int]:
    """For each view of an activation, the last step at which the storage it aliases is read
    other than by the view and views of it (at least the view's own step, which reads it)."""
    last = len(nodes) - 1
    root: dict[fx.Node, fx.Node] = {}
    members: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:  # the storages as `storages` finds them; weights and their views held
        if is_view(n):
            base = n.args[0]
            if not isinstance(base, fx.Node) or base not in root:
                continue
            root[n] = root[base]
        elif n.op == "call_function" or (n.op == "placeholder" and n.name not in weights):
            root[n] = n
        else:
            continue
        members.setdefault(root[n], []).append(n)
    # the last step each alias is read at: a view's own step reads what it views
    read = {
        n: max((last if u.op == "output" else position[u] for u in n.users), default=position[n])
        for n in root
    }
    out: dict[fx.Node, int] = {}
    for tree in members.values():
        if len(tree) == 1:
            continue
        for u in tree[1:]:
            under = {u}  # u and the views of it (a view comes after what it views)
            for n in tree[1:]:
                if n.args[0] in under:
                    under.add(n)
            out[u] = max([position[u], *(read[n] for n in tree if n not in under)])
    return out


def gathered_output_bytes(
    val: torch.Tensor,
    src: tuple[Placement, ...] | None,
    mesh_shape: tuple[int, ...],
    rank: int = 0,
) -> float:
    """What `rank` holds, beyond the output's own value, while a forward's output of `src`
    placements is brought whole to rank 0 (`tessel.lower.outputs`): a partial sum's scattered
    shard, then at each gather it takes part in what it sends (the shard, or the previous
    gather's buffer; a copy of it with the gathered dimension first where that is not the
    first or the buffer was permuted, its original freed once copied) and the buffer it
    receives into (empty on all but the first rank of the gather's group)."""
    if src is None:
        return 0.0
    shards = partial_to_shards(val.shape, src, mesh_shape)
    now = list(shards)
    shard = before = local_bytes(val, shard_placements(shards), mesh_shape)
    held = float(shard) if any(p.is_partial() for p in src) else 0.0
    contiguous = True
    for step in gather_steps(val.shape, shards, mesh_shape, rank):
        now[step.axis] = None
        after = local_bytes(val, shard_placements(tuple(now)), mesh_shape) if step.me == 0 else 0
        sent = max(before, after) if step.dim != 0 or not contiguous else after
        held = max(held, before + sent - shard)  # the shard itself is counted apart
        before, contiguous = after, step.dim == 0
    return held


def _buffer_bytes(
    val: torch.Tensor,
    src: tuple[Placement, ...] | None,
    dst: tuple[Placement, ...] | None,
    mesh_shape: tuple[int, ...],
) -> float:
    """Bytes a device allocates to move `val` from `src` to `dst` placements (`_move_bytes`)."""
    return _move_bytes(val, src, dst, mesh_shape)[0]


def _move_bytes(
    val: torch.Tensor,
    src: tuple[Placement, ...] | None,
    dst: tuple[Placement, ...] | None,
    mesh_shape: tuple[int, ...],
) -> tuple[float, float, float]:
    """The most bytes a device holds at once, its source aside, to move `val` from `src` to
    `dst` placements; those of the last allocation alone: the moved value, which outlives the
    move where a view of it is read later, while the copies made on the way are freed as the
    move goes on (each once the next is made from it); and what is made while the source is
    still read (a collective's first copy; a local reduction's whole peak).

    The move takes DTensor's steps (`_steps`), each counted as DTensor runs it on a CPU mesh
    (`_gathered`, `_all_to_all`, `_reduce_scattered`; a local step, a slice, a sum or a
    partition, makes one value of the size it leaves).
    """
    if src is None or dst is None or src == dst:
        return 0.0, 0.0, 0.0
    made: list[float] = []  # the move's allocations, in order, each made from the one before
    also = 0.0  # more held at once than two allocations: a reduce-scatter joining views
    here = list(src)
    dense = True  # whether the value in hand (the last allocation's view) is contiguous
    steps = _steps(val, src, dst, mesh_shape)
    for step in steps:
        hand = "source" if not made else "view" if dense else "strided"
        if step.kind == "all_gather":
            moved, dense = _gathered(val, here, step.dim, step.axes, mesh_shape, hand)
        elif step.kind == "all_to_all":
            moved, dense = _all_to_all(
                val, here, step.dim, step.to_dim, step.axes[0], mesh_shape, hand
            )
        elif step.kind == "reduce_scatter":
            value = made[-1] if made else 0.0  # the source is counted apart
            moved, held = _reduce_scattered(
                val, here, step.to_dim, step.axes, mesh_shape, value, dense
            )
            also, dense = max(also, held), True
        for m in step.axes:
            here[m] = step.to
        if step.kind == "local":  # a slice (always a copy), a sum or a partition of the value
            moved, dense = [local_bytes(val, tuple(here), mesh_shape)], True
        made += moved
    relaid = bool(made) and _relaid(val)
    if relaid and any(isinstance(p, Shard) for p in src):
        # a collective's result is contiguous: the shard it sends is made so first
        made.insert(0, local_bytes(val, src, mesh_shape))
    if made and (not dense or relaid and all(isinstance(p, Replicate) for p in dst)):
        # a result with gaps (padding cut off by a view) is copied dense, and a replicated
        # result into the captured layout (lower/trace._without_gaps, _laid_out)
        made.append(local_bytes(val, dst, mesh_shape))
    if not made:
        return 0.0, 0.0, 0.0
    # each allocation is freed once the next is made from it: two are held at once at most
    peak = max(also, *(a + b for a, b in zip([0.0, *made], made)))
    # a collective's first copy (the padded or contiguous shard, or the gathered buffer) is
    # all that reads the source; a reduce-scatter's rearranging reads it longer: the whole peak
    first = made[0] if steps[0].kind != "reduce_scatter" else peak
    return float(peak), float(made[-1]), float(first)


@dataclass(frozen=True)
class _Step:
    """One step of a move over mesh `axes`: a collective (an all-gather, an all-to-all, a
    reduce-scatter, an all-reduce) or a local change of the value (a slice, a partition); the
    dim whose shards it takes (`dim`; -1 where they are not shards) and the placement it
    leaves."""

    kind: str  # "all_gather", "all_to_all", "reduce_scatter" or "local"
    axes: tuple[int, ...]
    dim: int
    to: Placement

    @property
    def to_dim(self) -> int:
        return self.to.dim if isinstance(self.to, Shard) else -1


def _step_kind(a: Placement, b: Placement) -> str:
    if isinstance(a, Shard):
        return "all_gather" if isinstance(b, Replicate) else "all_to_all"
    if isinstance(a, Partial) and isinstance(b, Shard):
        return "reduce_scatter"
    return "local"  # a slice, a partition, or an all-reduce (a new buffer of the same size)


def _steps(val: torch.Tensor, src: tuple, dst: tuple, mesh_shape: tuple[int, ...]) -> list[_Step]:
    """DTensor's steps to move `val` from `src` to `dst`, in its order. Consecutive all-gathers
    or reduce-scatters alike over several axes are one collective over their joined group
    where the dim splits evenly over it (`tessel._torch.merged_moves`)."""
    out: list[_Step] = []
    here = list(src)
    for m, a, b in redistribute_steps(val, src, dst, mesh_shape):
        step = _Step(_step_kind(a, b), (m,), a.dim if isinstance(a, Shard) else -1, b)
        last = out[-1] if out else None
        if last is not None and (last.kind, last.dim, last.to) == (step.kind, step.dim, b):
            axes = tuple(sorted((*last.axes, m)))
            if step.kind in ("local", "all_to_all"):
                merged = False
            else:
                dim = step.dim if step.kind == "all_gather" else step.to_dim
                kept = [Replicate() if k in axes else p for k, p in enumerate(here)]
                joined = math.prod(mesh_shape[k] for k in axes)
                merged = _rows_left(val, kept, dim, mesh_shape) % joined == 0
            if merged:
                step = replace(step, axes=axes)
                out.pop()
        out.append(step)
        here[m] = b
    return out


def _rows_left(val: torch.Tensor, placements: list, dim: int, mesh_shape: tuple[int, ...]) -> int:
    """The rows of `dim` a device holds under `placements` (the largest shard's)."""
    return _local_shape(val, placements, mesh_shape)[dim]


def _gathered(
    val: torch.Tensor,
    here: list,
    dim: int,
    axes: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    hand: str,
) -> tuple[list[float], bool]:
    """An all-gather of `dim`'s shards over `axes`: its allocations, and whether its result
    is contiguous.

    A shard smaller than the largest is padded to its size first (a copy), the padded shards
    are gathered along the first dim, and a dim with more than one element before it is joined
    along its own (a second buffer of the gathered size); the padding is cut off by a view.
    `hand` is the shard's kind (`_copied_first`)."""
    made: list[float] = []
    whole = [Replicate() if m in axes else p for m, p in enumerate(here)]
    rows = _rows_left(val, whole, dim, mesh_shape)
    n = math.prod(mesh_shape[m] for m in axes)
    padded = -(-rows // n) * n
    if _copied_first(hand, padded != rows):
        made.append(local_bytes(val, tuple(here), mesh_shape))  # padded, or made contiguous
    gathered = local_bytes(val, tuple(whole), mesh_shape) * padded / max(rows, 1)
    made += [gathered] * (2 if _joined(val, here, dim, mesh_shape) else 1)
    return made, padded == rows or not _joined(val, whole, dim, mesh_shape)


def _copied_first(hand: str, uneven: bool) -> bool:
    """Whether a collective copies the shard in hand before it sends it. `hand` is "source"
    (the moved value itself), "view" (a contiguous view of the move's last buffer) or
    "strided" (a view that is not contiguous, which is always copied). A shard smaller than
    the largest is padded (a copy); the device with the largest shard pads nothing, and where
    its shard is a view it holds the buffer before beside the collective's, more than a
    padded copy of the shard would be: a view is counted so, never copied."""
    return hand == "strided" or (hand == "source" and uneven)


def _joined(val: torch.Tensor, here: list, dim: int, mesh_shape: tuple[int, ...]) -> bool:
    """Whether gathering along `dim` joins the pieces with a copy: shards gathered along the
    first dim are one block each of the result only where every dim before `dim` has one
    element."""
    return any(_rows_left(val, here, d, mesh_shape) != 1 for d in range(dim))


def _all_to_all(
    val: torch.Tensor,
    here: list,
    old: int,
    new: int,
    axis: int,
    mesh_shape: tuple[int, ...],
    hand: str,
) -> tuple[list[float], bool]:
    """A shard of dim `old` moved to a shard of dim `new` over one mesh axis, as DTensor runs
    it on a CPU mesh (gloo has no all-to-all): its allocations, and whether its result is
    contiguous. The shard is padded to the largest shard's rows of `old` (`_copied_first`)
    and to whole chunks of `new` (a copy each, where the dim splits unevenly), all-gathered
    along `old` (along the first dim, then joined along `old` where it is another), and its
    chunk of `new` is taken (a view where the chunk is a block of the gathered tensor, else a
    copy); the padding of `old` is cut off by a view."""
    n = mesh_shape[axis]
    shape = _local_shape(
        val, [Replicate() if m == axis else p for m, p in enumerate(here)], mesh_shape
    )
    item = val.element_size()
    chunk_old, chunk_new = -(-shape[old] // n), -(-shape[new] // n)
    made: list[float] = []
    local = list(shape)
    local[old] = chunk_old
    if _copied_first(hand, shape[old] % n != 0):
        made.append(math.prod(local) * item)  # padded to the largest, or made contiguous
    if shape[new] % n:
        local[new] = chunk_new * n
        made.append(math.prod(local) * item)  # `new` padded to whole chunks
    gathered = float(math.prod(local) * item * n)
    made += [gathered] * (2 if _joined(val, here, old, mesh_shape) else 1)
    local[old] *= n
    if any(local[d] != 1 for d in range(new)):
        made.append(gathered / n)  # the chunk made contiguous
    local[new] = chunk_new
    return made, shape[old] % n == 0 or all(local[d] == 1 for d in range(old))


def _reduce_scattered(
    val: torch.Tensor,
    here: list,
    dim: int,
    axes: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    value: float,
    dense: bool,
) -> tuple[list[float], float]:
    """A partial value (of `value` bytes, `dense` where contiguous) reduce-scattered into
    shards of `dim` over `axes`: its allocations, and the most bytes held at once while they
    are made, the value's included. A value that is not contiguous is copied first.

    Where `dim` does not split evenly, the value is cut into chunks of `dim`, each padded to
    one size (copies of those that are not contiguous or are short; the others are views,
    which keep the value alive) and joined again; a dim other than the first is rearranged
    into blocks of the first (another copy); then each device receives its reduced chunk.
    """
    n = math.prod(mesh_shape[m] for m in axes)
    shape = _local_shape(val, here, mesh_shape)
    chunk = -(-shape[dim] // n)
    rest = math.prod(shape) // max(shape[dim], 1) * val.element_size()
    padded = float(chunk * n * rest)  # the joined chunks, whole
    made: list[float] = []
    held = 0.0
    if shape[dim] % n:
        views = dense and all(shape[d] == 1 for d in range(dim))
        if views:  # chunks are views of the value: copies of the short ones alone
            made.append((n - shape[dim] // chunk) * chunk * rest)
        else:
            made.append(padded)  # every chunk copied
        made.append(padded)  # joined
        held = sum(made) + (value if views else 0.0)  # copied chunks free the value
    elif not dense:
        made.append(math.prod(shape) * val.element_size())  # made contiguous
    if dim != 0:
        made.append(padded)  # rearranged into blocks of the first dim
    made.append(padded / n)
    return made, held


def _relaid(val: torch.Tensor) -> bool:
    """Whether `val`'s layout is dense but not contiguous (a transposed value): the lowering
    remakes such a layout with a copy where a collective hands back a contiguous tensor."""
    if val.dim() == 0 or val.stride() == _contiguous_strides(tuple(val.shape)):
        return False
    want = tuple(val.stride())
    order = sorted(range(val.dim()), key=lambda d: (-want[d], d))  # outermost first
    strides = _contiguous_strides(tuple(val.shape[d] for d in order))
    remade = [0] * val.dim()
    for d, stride in zip(order, strides):
        remade[d] = stride
    return tuple(remade) == want


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


# what a device holds bytes for: a decision, or a pair of them (a buffer between the two)
Decision = Union[fx.Node, tuple[fx.Node, fx.Node]]


class _HeldNow:
    """What one device holds at the current moment, kept up to date as values come and go:
    bytes per decision (or decision pair, for a buffer), with how many values make up each.
    Byte counts are whole numbers, so adding and taking away is exact."""

    def __init__(self, weights: dict[fx.Node, np.ndarray]) -> None:
        self.weights = weights
        self.held: dict[Decision, np.ndarray] = dict(weights.items())
        self.makers: Counter[Decision] = Counter()
        self.parts: dict[Decision, bytes] = {v: _key_part(v, b) for v, b in weights.items()}

    def change(self, d: Decision, add: np.ndarray, sign: int) -> None:
        """Add (`sign` 1) or take away (-1) one value's bytes for decision or pair `d`."""
        self.makers[d] += sign
        if self.makers[d]:
            self.held[d] = self.held.get(d, 0) + sign * add
        elif isinstance(d, fx.Node) and d in self.weights:
            self.held[d] = self.weights[d]
        else:
            del self.held[d], self.parts[d]
            return
        self.parts[d] = _key_part(d, self.held[d])

    def key(self) -> frozenset:
        """What identifies the row of this moment: two moments with one key are one row."""
        return frozenset(self.parts.values())

    def row(self) -> MemoryRow:
        linear = {d: b for d, b in self.held.items() if not isinstance(d, tuple)}
        pairs = {d: b for d, b in self.held.items() if isinstance(d, tuple)}
        return MemoryRow(linear, pairs)


def _key_part(d: Decision, held: np.ndarray) -> bytes:
    """One decision's (or pair's) part of a memory row's identity: its name and its bytes."""
    name = b",".join(n.name.encode() for n in d) if isinstance(d, tuple) else d.name.encode()
    return name + b"=" + held.tobytes()


def _placements(spec: DTensorSpec | None) -> tuple[Placement, ...] | None:
    return None if spec is None else tuple(spec.placements)


def program_peak_bytes(
    graph: fx.Graph, weights: set[str], aliases: AbstractSet[str] = frozenset()
) -> tuple[int, int]:
    """(weight bytes, peak bytes) of a traced local program: what the device running it holds.

    `weights` names the placeholders that are weights; constants the program holds count as
    weights too. `aliases` names placeholders that are another input's tensor: held once. The peak adds the most activation bytes alive at once, as the program runs
    node by node and frees each value after its last use.
    """

    def size(val: object) -> int:
        return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0

    held = sum(
        size(n.meta.get("val"))
        for n in graph.nodes
        if (n.op == "placeholder" and n.name in weights) or n.op == "get_attr"
    )
    now = peak = 0
    for _, started, stopped in sweep(storages(graph, weights | aliases), frozenset()):
        now += sum(size(s.value) for s in started) - sum(size(s.value) for s in stopped)
        peak = max(peak, now)
    return held, held + peak
