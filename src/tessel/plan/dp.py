"""The O1 solver: dynamic programming over the decision graph, by variable elimination.

The decisions (one per node, shared by identical layers) and the resharding costs between them
form a chain of layers with short segments between them: a graph of small tree-width. The
solver eliminates one decision at a time, the one whose elimination makes the smallest table
(min-size order): the decision's cost tables are added up over it and its neighbours, and the
minimum over its strategies is a new table over the neighbours, MindSpore's `dynamic_programming`
search mode in the form of bucket elimination. Exact while every table stays below
`MAX_TABLE` entries; past that a bucket is split into parts minimised apart (mini-buckets), a
lower bound whose choices are then read back exactly. Choices are read back in reverse order,
each decision taking its best strategy given the decisions eliminated after it.

Memory is priced into the costs exactly as the O2 solver prices it (see `ilp.solve`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tessel.plan.ilp import MemoryRow, Problem, Solution, solve_with

MAX_TABLE = 1 << 22  # entries of the largest table built whole (32 MiB of float64)


@dataclass
class _Factor:
    scope: tuple[object, ...]  # decisions, one array axis each
    table: np.ndarray

    def at(self, choice: dict[object, int], free: object, size: int) -> np.ndarray:
        """This factor's costs over `free`'s strategies, every other decision as `choice` has it."""
        index = tuple(slice(None) if v == free else choice[v] for v in self.scope)
        values = self.table[index]
        return values if free in self.scope else np.full(size, float(values))


def solve(problem: Problem, time_limit: float = 60.0) -> Solution:
    """The cheapest choice whose every memory row fits, found by dynamic programming."""
    return solve_with(problem, _solve_priced, time_limit)


def _solve_priced(problem: Problem, prices: dict[MemoryRow, float], time_limit: float) -> Solution:
    del time_limit  # elimination is a fixed amount of work
    per_budget = 1.0 / max(problem.memory_budget or 1.0, 1.0)
    linear = {v: np.zeros(k) for v, k in problem.sizes.items()}
    for v, costs in problem.linear.items():
        linear[v] += costs
    pairs: dict[tuple, np.ndarray] = {k: np.array(m, dtype=float) for k, m in problem.pairs.items()}
    for row, price in prices.items():
        weight = price * per_budget
        for v, b in row.linear.items():
            linear[v] += weight * b
        for key, m in row.pairs.items():
            pairs[key] = pairs.get(key, 0.0) + weight * m
    factors = [_Factor((v,), t) for v, t in linear.items()]
    for (a, b), m in pairs.items():
        if a == b:  # a decision paired with itself: its diagonal is a cost of its own
            factors.append(_Factor((a,), np.diag(m).copy()))
        else:
            factors.append(_Factor((a, b), m))
    choice = _eliminate(problem.sizes, factors)
    objective = sum(float(problem.linear[v][choice[v]]) for v in problem.linear) + sum(
        float(m[choice[a], choice[b]]) for (a, b), m in problem.pairs.items()
    )
    status = f"dynamic programming over {len(problem.sizes)} decisions"
    return Solution(choice, objective, status, sum(problem.sizes.values()), 0)


def _eliminate(
    sizes: dict[object, int], factors: list[_Factor], order: list[object] | None = None
) -> dict[object, int]:
    """Eliminate every decision; then read the choices back, last eliminated first.

    `order`, where given and not empty, is the elimination order to follow; where empty, it is
    filled with the order taken (which depends on the factors' scopes alone, not their
    costs, so problems of one structure can share it)."""
    alive: dict[int, _Factor] = dict(enumerate(factors))
    touching: dict[object, set[int]] = {v: set() for v in sizes}
    for i, f in alive.items():
        for v in f.scope:
            touching[v].add(i)
    buckets: list[tuple[object, list[_Factor]]] = []
    left = set(sizes)
    order_key = {v: i for i, v in enumerate(sizes)}  # ties broken in a fixed order
    next_id = len(factors)
    given = iter(order) if order else None
    while left:
        if given is not None:
            v = next(given)
        else:
            v = min(left, key=lambda u: (_table_size(u, touching, alive, sizes), order_key[u]))
            if order is not None:
                order.append(v)
        left.remove(v)
        bucket = []
        for i in sorted(touching[v]):
            f = alive.pop(i)
            bucket.append(f)
            for u in f.scope:
                touching[u].discard(i)
        buckets.append((v, bucket))
        for part in _parts(v, bucket, sizes):
            new = _minimise(v, part, sizes)
            if not new.scope:
                continue
            alive[next_id] = new
            for u in new.scope:
                touching[u].add(next_id)
            next_id += 1
    choice: dict[object, int] = {}
    for v, bucket in reversed(buckets):
        k = sizes[v]
        total = np.zeros(k)
        for f in bucket:
            total = total + f.at(choice, v, k)
        choice[v] = int(np.argmin(total))
    return choice


def _table_size(v: object, touching: dict, alive: dict, sizes: dict) -> int:
    scope = {u for i in touching[v] if i in alive for u in alive[i].scope}
    return math.prod(sizes[u] for u in scope)


def _parts(v: object, bucket: list[_Factor], sizes: dict) -> list[list[_Factor]]:
    """The bucket whole where its table is small enough; else parts that each are."""
    scope = {u for f in bucket for u in f.scope}
    if math.prod(sizes[u] for u in scope) <= MAX_TABLE:
        return [bucket]
    parts: list[tuple[set, list[_Factor]]] = []
    for f in sorted(bucket, key=lambda f: -f.table.size):
        for part_scope, part in parts:
            joined = part_scope | set(f.scope)
            if math.prod(sizes[u] for u in joined) <= MAX_TABLE:
                part_scope |= set(f.scope)
                part.append(f)
                break
        else:
            parts.append((set(f.scope), [f]))
    return [part for _, part in parts]


def _minimise(v: object, factors: list[_Factor], sizes: dict) -> _Factor:
    """The sum of `factors`, minimised over `v`: a table over the rest of their scope."""
    scope = tuple(dict.fromkeys(u for f in factors for u in f.scope if u != v)) + (v,)
    axis = {u: i for i, u in enumerate(scope)}
    total = np.zeros([sizes[u] for u in scope])
    for f in factors:
        order = sorted(range(len(f.scope)), key=lambda i: axis[f.scope[i]])
        table = np.transpose(f.table, order)
        shape = [1] * len(scope)
        for i in order:
            shape[axis[f.scope[i]]] = sizes[f.scope[i]]
        total = total + table.reshape(shape)
    return _Factor(scope[:-1], total.min(axis=-1))
