"""The O2 solver: an integer linear program over one-hot strategy choices, solved by HiGHS.

x[v, k] = 1 when decision v takes strategy k. A resharding cost between two decisions is
linearised with edge variables over the distinct (source, target) layouts, whose marginals
equal the x's (Alpa's formulation, compressed so identical rows and columns share a variable).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

log = logging.getLogger(__name__)


MemoryRow = dict[object, np.ndarray]  # decision -> bytes per device for each of its strategies


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


def _groups(vectors: np.ndarray) -> list[list[int]]:
    """Indices of identical rows."""
    seen: dict[bytes, list[int]] = {}
    for i, row in enumerate(vectors):
        seen.setdefault(np.round(row, 15).tobytes(), []).append(i)
    return list(seen.values())


def solve(problem: Problem, time_limit: float = 60.0) -> Solution:
    offset: dict[object, int] = {}
    n = 0
    for v, k in problem.sizes.items():
        offset[v] = n
        n += k
    c = np.zeros(n)
    for v, costs in problem.linear.items():
        c[offset[v] : offset[v] + len(costs)] += costs

    rows, cols, vals, lo, hi = [], [], [], [], []
    row = 0

    def add_row(entries: list[tuple[int, float]], low: float, high: float) -> None:
        nonlocal row
        for col, val in entries:
            rows.append(row)
            cols.append(col)
            vals.append(val)
        lo.append(low)
        hi.append(high)
        row += 1

    for v, k in problem.sizes.items():
        add_row([(offset[v] + i, 1.0) for i in range(k)], 1.0, 1.0)

    extra_costs: list[float] = []
    for (a, b), matrix in problem.pairs.items():
        if not np.any(matrix):
            continue
        rgroups = _groups(matrix)
        cgroups = _groups(matrix.T)
        if len(rgroups) == 1:
            c[offset[b] : offset[b] + matrix.shape[1]] += matrix[0]
            continue
        if len(cgroups) == 1:
            c[offset[a] : offset[a] + matrix.shape[0]] += matrix[:, 0]
            continue
        base = n + len(extra_costs)
        for rg in rgroups:
            for cg in cgroups:
                extra_costs.append(float(matrix[rg[0], cg[0]]))
        width = len(cgroups)
        for gi, rg in enumerate(rgroups):
            entries = [(base + gi * width + gj, 1.0) for gj in range(width)]
            entries += [(offset[a] + k, -1.0) for k in rg]
            add_row(entries, 0.0, 0.0)
        for gj, cg in enumerate(cgroups):
            entries = [(base + gi * width + gj, 1.0) for gi in range(len(rgroups))]
            entries += [(offset[b] + k, -1.0) for k in cg]
            add_row(entries, 0.0, 0.0)

    total = n + len(extra_costs)
    c = np.concatenate([c, np.asarray(extra_costs)])
    if problem.memory_budget is not None:
        for memory_row in problem.memory:
            entries = []
            for v, mem in memory_row.items():
                entries += [(offset[v] + i, float(m)) for i, m in enumerate(mem) if m]
            add_row(entries, -np.inf, problem.memory_budget)

    a = coo_matrix((vals, (rows, cols)), shape=(row, total)).tocsr()
    integrality = np.concatenate([np.ones(n), np.zeros(total - n)])
    result = milp(
        c,
        constraints=LinearConstraint(a, np.asarray(lo), np.asarray(hi)),
        integrality=integrality,
        bounds=Bounds(0, 1),
        options={"time_limit": time_limit, "disp": False},
    )
    if result.x is None:
        raise InfeasibleError(result.message)
    choice = {
        v: int(np.argmax(result.x[offset[v] : offset[v] + k])) for v, k in problem.sizes.items()
    }
    log.info("ILP: %d variables, %d constraints, %s", total, row, result.message)
    return Solution(choice, float(result.fun), result.message, total, row)


def least_memory(problem: Problem, time_limit: float = 60.0) -> tuple[float, dict[object, int]]:
    """The smallest per-device memory any choice needs, and a choice that needs it.

    Minimises the largest memory row (a continuous variable bounds every row), costs aside.
    """
    offset: dict[object, int] = {}
    n = 0
    for v, k in problem.sizes.items():
        offset[v] = n
        n += k
    peak = n  # the bound's column
    rows, cols, vals, lo, hi = [], [], [], [], []
    for r, (v, k) in enumerate(problem.sizes.items()):
        rows += [r] * k
        cols += list(range(offset[v], offset[v] + k))
        vals += [1.0] * k
        lo.append(1.0)
        hi.append(1.0)
    for memory_row in problem.memory:
        r = len(lo)
        for v, mem in memory_row.items():
            for i, m in enumerate(mem):
                if m:
                    rows.append(r)
                    cols.append(offset[v] + i)
                    vals.append(float(m))
        rows.append(r)
        cols.append(peak)
        vals.append(-1.0)
        lo.append(-np.inf)
        hi.append(0.0)
    c = np.zeros(n + 1)
    c[peak] = 1.0
    a = coo_matrix((vals, (rows, cols)), shape=(len(lo), n + 1)).tocsr()
    result = milp(
        c,
        constraints=LinearConstraint(a, np.asarray(lo), np.asarray(hi)),
        integrality=np.concatenate([np.ones(n), [0]]),
        bounds=Bounds(np.zeros(n + 1), np.concatenate([np.ones(n), [np.inf]])),
        options={"time_limit": time_limit, "disp": False},
    )
    if result.x is None:
        raise InfeasibleError(result.message)
    choice = {
        v: int(np.argmax(result.x[offset[v] : offset[v] + k])) for v, k in problem.sizes.items()
    }
    return float(result.x[peak]), choice
