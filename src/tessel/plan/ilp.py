"""The O2 solver: an integer linear program over one-hot strategy choices, solved by HiGHS.

x[v, k] = 1 when decision v takes strategy k. A cost or a memory charge that depends on two
decisions (resharding between a producer and a consumer, the buffer a resharding allocates) is
linearised with edge variables over the distinct (source, target) pairs, whose marginals equal
the x's (Alpa's formulation, compressed so identical rows and columns share a variable).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

log = logging.getLogger(__name__)


@dataclass
class MemoryRow:
    """What one device holds at one moment: bytes per strategy of single decisions, and bytes
    per (k_a, k_b) of decision pairs (a buffer that exists only for some combinations)."""

    linear: dict[object, np.ndarray] = field(default_factory=dict)
    pairs: dict[tuple[object, object], np.ndarray] = field(default_factory=dict)

    def bytes_for(self, choice: dict[object, int]) -> float:
        total = sum(float(b[choice[v]]) for v, b in self.linear.items())
        return total + sum(float(m[choice[a], choice[b]]) for (a, b), m in self.pairs.items())


@dataclass
class Problem:
    """One-hot decisions with linear and pairwise costs, under per-device memory limits.

    Each memory row is what one device holds at one moment (its weights plus the activations
    alive then); every row must stay within `memory_budget`.
    """

    sizes: dict[object, int]  # decision -> number of strategies
    linear: dict[object, np.ndarray]  # decision -> cost per strategy
    pairs: dict[tuple[object, object], np.ndarray]  # (a, b) -> cost[k_a, k_b]
    memory: list[MemoryRow] = field(default_factory=list)
    memory_budget: float | None = None


@dataclass
class Solution:
    choice: dict[object, int]
    objective: float
    status: str
    num_variables: int
    num_constraints: int


class InfeasibleError(RuntimeError):
    pass


def _groups(matrix: np.ndarray) -> list[list[int]]:
    """Indices of identical rows."""
    seen: dict[bytes, list[int]] = {}
    for i, row in enumerate(matrix):
        seen.setdefault(np.round(row, 15).tobytes(), []).append(i)
    return list(seen.values())


class _Model:
    """The constraint matrix shared by both objectives: one-hot rows, edge variables, memory."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.offset: dict[object, int] = {}
        n = 0
        for v, k in problem.sizes.items():
            self.offset[v] = n
            n += k
        self.n = n
        self.cost = np.zeros(n)
        for v, costs in problem.linear.items():
            self.cost[self.offset[v] : self.offset[v] + len(costs)] += costs
        self.extra: list[float] = []  # cost of each edge variable, in column order past n
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        for v, k in problem.sizes.items():
            self.add_row([(self.offset[v] + i, 1.0) for i in range(k)], 1.0, 1.0)
        memory_pairs: dict[tuple, list[np.ndarray]] = {}
        for row in problem.memory:
            for key, m in row.pairs.items():
                memory_pairs.setdefault(key, []).append(m)
        # per pair: the edge-variable coefficient for any (k_a, k_b) matrix over the pair
        self.edge: dict[tuple, tuple[list[list[int]], list[list[int]], int]] = {}
        # in a fixed order, so equal-cost solutions are broken alike from run to run
        for key in [*problem.pairs, *(k for k in memory_pairs if k not in problem.pairs)]:
            self._pair(key, problem.pairs.get(key), memory_pairs.get(key, []))

    def add_row(self, entries: list[tuple[int, float]], low: float, high: float) -> int:
        r = len(self.lo)
        for col, val in entries:
            self.rows.append(r)
            self.cols.append(col)
            self.vals.append(val)
        self.lo.append(low)
        self.hi.append(high)
        return r

    def _pair(self, key: tuple, cost: np.ndarray | None, memory: list[np.ndarray]) -> None:
        a, b = key
        shape = (self.problem.sizes[a], self.problem.sizes[b])
        cost = np.zeros(shape) if cost is None else np.asarray(cost, dtype=float)
        memory = [m for m in memory if np.any(m)]
        if not np.any(cost) and not memory:
            return
        if not memory:  # a cost that depends on one side alone needs no edge variables
            rgroups, cgroups = _groups(cost), _groups(cost.T)
            if len(rgroups) == 1:
                self.cost[self.offset[b] : self.offset[b] + shape[1]] += cost[0]
                return
            if len(cgroups) == 1:
                self.cost[self.offset[a] : self.offset[a] + shape[0]] += cost[:, 0]
                return
        stacked = np.concatenate([cost, *memory], axis=1)
        rgroups = _groups(stacked)
        cgroups = _groups(np.concatenate([cost.T, *(m.T for m in memory)], axis=1))
        base = self.n + len(self.extra)
        for rg in rgroups:
            for cg in cgroups:
                self.extra.append(float(cost[rg[0], cg[0]]))
        width = len(cgroups)
        for gi, rg in enumerate(rgroups):
            entries = [(base + gi * width + gj, 1.0) for gj in range(width)]
            entries += [(self.offset[a] + k, -1.0) for k in rg]
            self.add_row(entries, 0.0, 0.0)
        for gj, cg in enumerate(cgroups):
            entries = [(base + gi * width + gj, 1.0) for gi in range(len(rgroups))]
            entries += [(self.offset[b] + k, -1.0) for k in cg]
            self.add_row(entries, 0.0, 0.0)
        self.edge[key] = (rgroups, cgroups, base)

    def memory_entries(self, row: MemoryRow) -> list[tuple[int, float]]:
        entries = []
        for v, mem in row.linear.items():
            entries += [(self.offset[v] + i, float(m)) for i, m in enumerate(mem) if m]
        for key, m in row.pairs.items():
            if key not in self.edge:
                continue  # all zero
            rgroups, cgroups, base = self.edge[key]
            width = len(cgroups)
            for gi, rg in enumerate(rgroups):
                for gj, cg in enumerate(cgroups):
                    value = float(m[rg[0], cg[0]])
                    if value:
                        entries.append((base + gi * width + gj, value))
        return entries

    @property
    def width(self) -> int:
        return self.n + len(self.extra)

    def run(self, c: np.ndarray, integral: int, upper: np.ndarray, time_limit: float):
        a = coo_matrix((self.vals, (self.rows, self.cols)), shape=(len(self.lo), len(c))).tocsr()
        integrality = np.concatenate([np.ones(integral), np.zeros(len(c) - integral)])
        result = milp(
            c,
            constraints=LinearConstraint(a, np.asarray(self.lo), np.asarray(self.hi)),
            integrality=integrality,
            bounds=Bounds(np.zeros(len(c)), upper),
            options={"time_limit": time_limit, "disp": False},
        )
        if result.x is None:
            raise InfeasibleError(result.message)
        return result

    def choice(self, x: np.ndarray) -> dict[object, int]:
        return {
            v: int(np.argmax(x[self.offset[v] : self.offset[v] + k]))
            for v, k in self.problem.sizes.items()
        }


def solve(problem: Problem, time_limit: float = 60.0) -> Solution:
    """The cheapest choice whose every memory row fits `memory_budget`."""
    model = _Model(problem)
    if problem.memory_budget is not None:
        for row in problem.memory:
            model.add_row(model.memory_entries(row), -np.inf, problem.memory_budget)
    c = np.concatenate([model.cost, np.asarray(model.extra)])
    result = model.run(c, model.n, np.ones(model.width), time_limit)
    log.info("ILP: %d variables, %d constraints, %s", model.width, len(model.lo), result.message)
    return Solution(
        model.choice(result.x), float(result.fun), result.message, model.width, len(model.lo)
    )


def least_memory(problem: Problem, time_limit: float = 60.0) -> tuple[float, dict[object, int]]:
    """The smallest per-device memory any choice needs, and a choice that needs it.

    Minimises the largest memory row (a continuous variable bounds every row), costs aside.
    """
    model = _Model(problem)
    peak = model.width  # the bound's column
    for row in problem.memory:
        model.add_row([*model.memory_entries(row), (peak, -1.0)], -np.inf, 0.0)
    c = np.zeros(peak + 1)
    c[peak] = 1.0
    upper = np.concatenate([np.ones(peak), [np.inf]])
    result = model.run(c, model.n, upper, time_limit)
    return float(result.x[peak]), model.choice(result.x)
