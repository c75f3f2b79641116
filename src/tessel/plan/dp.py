"""The O1 solver: dynamic programming over the decision graph, by variable elimination.

The decisions (one per node, shared by identical layers) and the resharding costs between them
form a chain of layers with short segments between them: a graph of small tree-width. The
solver eliminates one decision at a time, the one whose elimination makes the smallest table
(min-size order): the decision's cost tables are added up over it and its neighbours, and the
minimum over its strategies is a new table over the neighbours, MindSpore's `dynamic_programming`
search mode in the form of bucket elimination. A decision with one strategy is a constant: it is
folded into its neighbours' tables before anything is eliminated, so it never widens a table.
Choices are read back in reverse order, each decision taking its best strategy given the
decisions eliminated after it.

The order is chosen from the tables' scopes alone, before any table is built, and with it the
cost of the elimination is known: its widest table (entries and axes) and the entries of all its
tables together. Where that is more than `MAX_TABLE`, `MAX_AXES` or `MAX_WORK`, the problem goes
to the integer program (`ilp.solve`, HiGHS under its time limit, memory priced its way) instead,
and the solution says so.

Memory is priced into the costs exactly as the O2 solver prices it (see `ilp.solve`); where
that finds a plan only by repairing one far above the bound pricing gives, memory is priced
again with the integer program (`ilp.solve_with`).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from tessel.plan import ilp
from tessel.plan.ilp import solve_with
from tessel.plan.problem import FORBIDDEN, InfeasibleError, MemoryRow, Problem, Solution

MAX_TABLE = 1 << 22  # entries of the largest table built whole (32 MiB of float64)
MAX_AXES = 32  # decisions one table spans (numpy's arrays have at most 64 axes)
MAX_WORK = 1 << 28  # entries of every table of one elimination together (seconds of numpy)


@dataclass
class _Factor:
    scope: tuple[object, ...]  # decisions, one array axis each
    table: np.ndarray

    def at(self, choice: dict[object, int], free: object, size: int) -> np.ndarray:
        """This factor's costs over `free`'s strategies, every other decision as `choice` has it."""
        index = tuple(slice(None) if v == free else choice[v] for v in self.scope)
        values = self.table[index]
        return values if free in self.scope else np.full(size, float(values))


@dataclass(frozen=True)
class Width:
    """What eliminating in one order costs: its widest table, in entries and in axes, and the
    entries of all its tables together."""

    entries: int
    axes: int
    work: int

    def affordable(self) -> bool:
        return self.entries <= MAX_TABLE and self.axes <= MAX_AXES and self.work <= MAX_WORK

    def describe(self) -> str:
        return (
            f"its widest table would span {self.axes} decisions and {self.entries:,} entries, "
            f"{self.work:,} entries in all (limits: {MAX_AXES} decisions, {MAX_TABLE:,} entries, "
            f"{MAX_WORK:,} in all)"
        )


def solve(problem: Problem, time_limit: float = 60.0, fastest: Solution | None = None) -> Solution:
    """The cheapest choice whose every memory row fits, found by dynamic programming; past the
    width elimination can afford, by the integer program under `time_limit` (said in the
    solution's `fallback`). The width depends on the problem's structure alone (which decisions
    share a cost), never on its costs, so it is weighed once, before any solve."""
    width = _width(problem)
    if not width.affordable():
        solution = ilp.solve(problem, time_limit, fastest)
        solution.fallback = "; then ".join(
            s
            for s in (
                f"dynamic programming would cost too much ({width.describe()}): solved by the "
                f"integer program (HiGHS, time limit {time_limit:g} s)",
                solution.fallback,
            )
            if s
        )
        return solution
    return solve_with(problem, _solve_priced, time_limit, fastest)


def affordable(problem: Problem) -> bool:
    """Whether dynamic programming can afford `problem` (see `solve`)."""
    return _width(problem).affordable()


def _closed(costs: np.ndarray) -> np.ndarray:
    """`costs` with every `FORBIDDEN` entry infinite: no memory price outweighs it."""
    costs = np.array(costs, dtype=float)
    costs[costs >= FORBIDDEN] = np.inf
    return costs


def _width(problem: Problem) -> Width:
    """What eliminating `problem`'s decisions costs, in the order `_eliminate` takes."""
    free = {v: k for v, k in problem.sizes.items() if k > 1}
    given: list[tuple[object, ...]] = [(v,) for v in problem.sizes]
    given += [(a,) if a == b else (a, b) for a, b in problem.pairs]
    scopes = [s for s in (tuple(v for v in scope if v in free) for scope in given) if s]
    return elimination_order(free, scopes)[1]


def _solve_priced(problem: Problem, prices: dict[MemoryRow, float], time_limit: float) -> Solution:
    per_budget = 1.0 / max(problem.memory_budget or 1.0, 1.0)
    linear = {v: np.zeros(k) for v, k in problem.sizes.items()}
    for v, costs in problem.linear.items():
        linear[v] += _closed(costs)
    pairs: dict[tuple, np.ndarray] = {k: _closed(m) for k, m in problem.pairs.items()}
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
    if problem.takes_forbidden(choice):  # the cheapest choice is infinite: there is none
        raise InfeasibleError("every choice takes a strategy or a move no plan may take")
    status = f"dynamic programming over {len(problem.sizes)} decisions"
    return Solution(choice, problem.cost_of(choice), status, sum(problem.sizes.values()), 0)


def elimination_order(
    sizes: dict[object, int], scopes: list[tuple[object, ...]]
) -> tuple[list[object], Width]:
    """The order to eliminate the decisions of `sizes` in, each step the decision whose table
    would be smallest (ties in `sizes`' order), and what that order costs. `scopes` are the
    tables' decisions; a decision with one strategy should not be among them (see
    `_fold_constants`)."""
    neighbours: dict[object, set[object]] = {v: set() for v in sizes}
    for scope in scopes:
        for v in scope:
            neighbours[v].update(u for u in scope if u != v)
    rank = {v: i for i, v in enumerate(sizes)}

    def table(v: object) -> int:
        return sizes[v] * math.prod(sizes[u] for u in neighbours[v])

    heap = [(table(v), rank[v], v) for v in sizes]
    heapq.heapify(heap)
    order: list[object] = []
    entries = axes = work = 0
    done: set[object] = set()
    while heap:
        size, _, v = heapq.heappop(heap)
        if v in done or size != table(v):
            continue  # eliminated, or its table has grown since this entry
        done.add(v)
        order.append(v)
        near = neighbours.pop(v)
        entries, axes, work = max(entries, size), max(axes, len(near) + 1), work + size
        for u in near:
            neighbours[u].discard(v)
            neighbours[u].update(near - {u})
        for u in near:
            heapq.heappush(heap, (table(u), rank[u], u))
    return order, Width(entries, axes, work)


def _fold_constants(sizes: dict[object, int], factors: list[_Factor]) -> list[_Factor]:
    """`factors` with every decision of one strategy fixed to it: off their scopes, so a
    decision joined to many others by constants never makes them one table. Factors left with
    no decision are dropped (a constant cost changes no choice)."""
    folded = []
    for f in factors:
        if all(sizes[v] > 1 for v in f.scope):
            folded.append(f)
            continue
        index = tuple(0 if sizes[v] == 1 else slice(None) for v in f.scope)
        scope = tuple(v for v in f.scope if sizes[v] > 1)
        if scope:
            folded.append(_Factor(scope, np.asarray(f.table[index])))
    return folded


def _eliminate(
    sizes: dict[object, int],
    factors: list[_Factor],
    order: list[object] | None = None,
) -> dict[object, int]:
    """Eliminate every decision; then read the choices back, last eliminated first.

    `order`, where given and not empty, is the elimination order to follow; where empty, it is
    filled with the order taken (which depends on the factors' scopes alone, not their
    costs, so problems of one structure can share it). A bucket whose table would be past the
    limits is split into parts minimised apart (mini-buckets: a lower bound whose choices are
    then read back); `solve` hands such problems to the integer program before they get here."""
    choice = {v: 0 for v, k in sizes.items() if k == 1}
    factors = _fold_constants(sizes, factors)
    free = {v: k for v, k in sizes.items() if k > 1}
    if order:
        steps = list(order)
    else:
        steps, _ = elimination_order(free, [f.scope for f in factors])
        if order is not None:
            order.extend(steps)
    alive: dict[int, _Factor] = dict(enumerate(factors))
    touching: dict[object, set[int]] = {v: set() for v in free}
    for i, f in alive.items():
        for v in f.scope:
            touching[v].add(i)
    buckets: list[tuple[object, list[_Factor]]] = []
    next_id = len(factors)
    for v in steps:
        bucket = []
        for i in sorted(touching[v]):
            f = alive.pop(i)
            bucket.append(f)
            for u in f.scope:
                touching[u].discard(i)
        buckets.append((v, bucket))
        for part in _parts(v, bucket, free):
            new = _minimise(v, part, free)
            if not new.scope:
                continue
            alive[next_id] = new
            for u in new.scope:
                touching[u].add(next_id)
            next_id += 1
    for v, bucket in reversed(buckets):
        k = free[v]
        total = np.zeros(k)
        for f in bucket:
            total = total + f.at(choice, v, k)
        choice[v] = int(np.argmin(total))
    return choice


def _fits(scope: set, sizes: dict) -> bool:
    return len(scope) <= MAX_AXES and math.prod(sizes[u] for u in scope) <= MAX_TABLE


def _parts(v: object, bucket: list[_Factor], sizes: dict) -> list[list[_Factor]]:
    """The bucket whole where its table is small enough, in entries and in axes; else parts
    that each are."""
    if _fits({u for f in bucket for u in f.scope}, sizes):
        return [bucket]
    parts: list[tuple[set, list[_Factor]]] = []
    for f in sorted(bucket, key=lambda f: -f.table.size):
        for part_scope, part in parts:
            if _fits(part_scope | set(f.scope), sizes):
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
