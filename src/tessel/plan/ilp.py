"""The O2 solver: an integer linear program over one-hot strategy choices, solved by HiGHS.

x[v, k] = 1 when decision v takes strategy k. A cost or a memory charge that depends on two
decisions (resharding between a producer and a consumer, the buffer a resharding allocates) is
linearised with edge variables over the distinct (source, target) pairs, whose marginals equal
the x's (Alpa's formulation, compressed so identical rows and columns share a variable).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from tessel.plan.problem import (
    FORBIDDEN,
    InfeasibleError,
    MemoryRow,
    OutOfTimeError,
    Problem,
    Solution,
)
from tessel.plan.repair import Neighbourhood

log = logging.getLogger(__name__)

# a plan within this fraction of the best one is good enough: the last fraction of a percent
# costs HiGHS most of its time on memory-tight problems, and the cost model is not that exact
MIP_GAP = 0.01
# how far above the dual bound a fit found only by greedy repair may cost before memory is
# priced again with the integer program
BOUND_GAP = 0.05


def _groups(matrix: np.ndarray) -> list[list[int]]:
    """Indices of identical rows."""
    seen: dict[bytes, list[int]] = {}
    for i, row in enumerate(matrix):
        seen.setdefault(np.round(row, 15).tobytes(), []).append(i)
    return list(seen.values())


class _Model:
    """The constraint matrix shared by both objectives: one-hot rows, edge variables, memory."""

    def __init__(self, problem: Problem, rows: list[MemoryRow] | None = None) -> None:
        """`rows`: the memory rows the program will hold (their pairs need edge variables)."""
        self.problem = problem
        self.offset: dict[object, int] = {}
        n = 0
        for v, k in problem.sizes.items():
            self.offset[v] = n
            n += k
        self.n = n
        self.cost = np.zeros(n)
        self.closed: list[int] = []  # columns of forbidden strategies and pairs: held at 0
        for v, costs in problem.linear.items():
            self._charge(self.offset[v], costs)
        self.extra: list[float] = []  # cost of each edge variable, in column order past n
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self._matrix = None  # the rows above as a sparse matrix, made at the first run
        self._entries: dict[MemoryRow, tuple[np.ndarray, np.ndarray]] = {}
        for v, k in problem.sizes.items():
            self.add_row([(self.offset[v] + i, 1.0) for i in range(k)], 1.0, 1.0)
        memory_pairs: dict[tuple, list[np.ndarray]] = {}
        for row in problem.memory if rows is None else rows:
            for key, m in row.pairs.items():
                memory_pairs.setdefault(key, []).append(m)
        # per pair: the edge-variable coefficient for any (k_a, k_b) matrix over the pair
        self.edge: dict[tuple, tuple[list[list[int]], list[list[int]], int]] = {}
        # in a fixed order, so equal-cost solutions are broken alike from run to run
        for key in [*problem.pairs, *(k for k in memory_pairs if k not in problem.pairs)]:
            self._pair(key, problem.pairs.get(key), memory_pairs.get(key, []))

    def _charge(self, start: int, costs: np.ndarray) -> None:
        """Add `costs` to the strategy columns from `start`, closing the forbidden ones."""
        costs = np.asarray(costs, dtype=float)
        forbidden = costs >= FORBIDDEN
        self.closed += [start + int(i) for i in np.flatnonzero(forbidden)]
        self.cost[start : start + len(costs)] += np.where(forbidden, 0.0, costs)

    def upper(self, extra: int = 0) -> np.ndarray:
        """The columns' upper bounds (and `extra` unbounded columns after them): 1, and 0 for
        the closed ones."""
        bound = np.concatenate([np.ones(self.width), np.full(extra, np.inf)])
        bound[self.closed] = 0.0
        return bound

    def add_row(self, entries: list[tuple[int, float]], low: float, high: float) -> int:
        self._matrix = None
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
                self._charge(self.offset[b], cost[0])
                return
            if len(cgroups) == 1:
                self._charge(self.offset[a], cost[:, 0])
                return
        stacked = np.concatenate([cost, *memory], axis=1)
        rgroups = _groups(stacked)
        cgroups = _groups(np.concatenate([cost.T, *(m.T for m in memory)], axis=1))
        base = self.n + len(self.extra)
        for rg in rgroups:
            for cg in cgroups:
                value = float(cost[rg[0], cg[0]])
                if value >= FORBIDDEN:
                    self.closed.append(self.n + len(self.extra))
                    value = 0.0
                self.extra.append(value)
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

    def memory_columns(self, row: MemoryRow) -> tuple[np.ndarray, np.ndarray]:
        """`memory_entries(row)` as arrays of columns and bytes, made once per row."""
        if row not in self._entries:
            entries = self.memory_entries(row)
            self._entries[row] = (
                np.array([col for col, _ in entries], dtype=np.int64),
                np.array([v for _, v in entries], dtype=float),
            )
        return self._entries[row]

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

    def _program(self, c: np.ndarray, upper: np.ndarray) -> tuple[LinearConstraint, Bounds]:
        """The rows and the columns' bounds of the program with objective `c`."""
        if self._matrix is None or self._matrix.shape != (len(self.lo), len(c)):
            shape = (len(self.lo), len(c))
            self._matrix = coo_matrix((self.vals, (self.rows, self.cols)), shape=shape).tocsr()
        rows = LinearConstraint(self._matrix, np.asarray(self.lo), np.asarray(self.hi))
        return rows, Bounds(np.zeros(len(c)), upper)

    def run(
        self,
        c: np.ndarray,
        integral: int,
        upper: np.ndarray,
        time_limit: float,
        gap: float = MIP_GAP,
    ):
        """Solve within `time_limit`; where the limit passes before any answer (a slow or busy
        machine), the time is doubled until one is found, up to `_LIMIT_GROWTH` times the
        limit: the limit bounds the search for better plans, never the finding of one."""
        constraints, bounds = self._program(c, upper)
        integrality = np.concatenate([np.ones(integral), np.zeros(len(c) - integral)])
        limit = time_limit
        while True:
            result = milp(
                c,
                constraints=constraints,
                integrality=integrality,
                bounds=bounds,
                options={"time_limit": limit, "disp": False, "mip_rel_gap": gap},
            )
            if (
                result.x is not None
                or result.status != _OUT_OF_TIME
                or limit >= _LIMIT_GROWTH * time_limit
            ):
                break
            limit *= 2
            log.info("no plan within %.1f s; searching for %.1f s", limit / 2, limit)
        if result.x is None:
            if result.status == _OUT_OF_TIME:
                raise OutOfTimeError(
                    f"no answer within {limit:g} s, {_LIMIT_GROWTH} times the time limit"
                )
            raise InfeasibleError(result.message)
        return result

    def relaxed(self, c: np.ndarray, integral: int, upper: np.ndarray, time_limit: float):
        """The linear relaxation's answer where its first `integral` columns came out whole
        (else None). Such an answer is the integer program's own optimum, proven by the
        relaxation's bound, and the relaxation alone costs HiGHS far less than a branch-and-
        bound search that would return to the same vertex."""
        constraints, bounds = self._program(c, upper)
        result = milp(
            c,
            constraints=constraints,
            bounds=bounds,
            options={"time_limit": time_limit, "disp": False},
        )
        if result.status != _OPTIMAL or result.x is None:
            return None
        head = result.x[:integral]
        if np.abs(head - np.round(head)).max(initial=0.0) > _WHOLE:
            return None
        return result

    def choice(self, x: np.ndarray) -> dict[object, int]:
        return {
            v: int(np.argmax(x[self.offset[v] : self.offset[v] + k]))
            for v, k in self.problem.sizes.items()
        }


def cpu_seconds() -> float:
    """The clock the searches' time limits read: this process's CPU time, not the wall clock,
    so a machine busy with other work (other builds, a test's workers) stops a search where an
    idle one does, and finds the same plan."""
    return time.process_time()


def variable_count(problem: Problem) -> int:
    """The columns of the program for `problem` before memory is priced: one per strategy and
    one per distinct (source, target) pair of every edge."""
    return _Model(problem, []).width


def solve(problem: Problem, time_limit: float = 60.0, fastest: Solution | None = None) -> Solution:
    """The cheapest choice whose every memory row fits `memory_budget` (see `solve_with`)."""
    return solve_with(problem, solve_priced, time_limit, fastest)


PricedSolver = Callable[[Problem, dict[MemoryRow, float], float], Solution]


def solve_with(
    problem: Problem,
    priced: PricedSolver,
    time_limit: float = 60.0,
    fastest: Solution | None = None,
) -> Solution:
    """The cheapest choice whose every memory row fits `memory_budget`; `priced` solves the
    problem without memory rows, each priced row's bytes charged at its price.

    First without the memory rows: where that answer fits, it is the best. Otherwise memory is
    priced into the objective (a Lagrangian relaxation): each row an answer broke costs its
    bytes, in units of the budget, times a price of its own; a broken row's price rises and a
    row with room's price falls, and the cheapest answer that fits every row is kept. Each of
    these programs has no memory rows, so HiGHS solves it as fast as the first (memory rows in
    the program make it hard: its relaxation drifts far from the integers). An answer a few
    rows over the budget is also repaired greedily (`repair`), which often fits long before
    the prices climb far enough. Where nothing fits, the memory rows go into the program
    itself, lazily. `fastest` is the answer without memory rows, where the caller has it.

    Every priced answer bounds the best fitting cost from below (its priced cost less the
    prices times the budget: Lagrangian duality). A priced answer that fits is the cheapest
    under its prices; a repaired one only fits. Where `priced` is not the integer program and
    the cheapest fit found is a repaired one more than `BOUND_GAP` above the highest bound,
    memory is priced again with the integer program (its answers break ties otherwise), and the
    cheaper answer is kept.
    """
    try:
        return _solve_with(problem, priced, time_limit, fastest)
    finally:
        problem.solver_cache.clear()  # a plan keeps its problem; not the programs made for it


def _solve_with(
    problem: Problem, priced: PricedSolver, time_limit: float, fastest: Solution | None
) -> Solution:
    start = cpu_seconds()
    second_look = priced is not solve_priced
    budget = problem.memory_budget
    best = fastest or priced(problem, {}, time_limit)
    if budget is None or _fits(problem, best.choice):
        return best
    bound, greedy = best.objective, False
    prices: dict[int, float] = {}  # by row index
    # rows by their place in the problem, so prices are set and summed in one order every run
    rows = dict(enumerate(problem.memory))
    index = {id(r): k for k, r in rows.items()}
    first = 1e-2 * best.objective or 1e-9  # seconds of run time per budget-full of memory
    fitting: Solution | None = None
    since_better = 0
    neighbourhood = Neighbourhood(problem)
    tried: set[tuple[int, ...]] = set()
    last: tuple[int, ...] = ()
    clock = False  # whether the clock, not the search, ended a step
    for step in range(_PRICE_STEPS):
        if cpu_seconds() - start > time_limit / 2:  # the rest for what follows
            clock = True
            break
        # (before any price, the program is the one `best` answers)
        candidate = (
            priced(problem, {rows[k]: v for k, v in prices.items()}, time_limit) if prices else best
        )
        clock |= candidate.stopped_by_clock
        if second_look:  # the bound is read only to decide on a second look
            bound = max(bound, _dual_bound(problem, candidate, prices, rows))
        broken = sorted(index[id(r)] for r in _broken(problem, candidate.choice))
        log.debug(
            "prices %d: cost %.4g, %d rows broken, %.2f s",
            step,
            candidate.objective,
            len(broken),
            cpu_seconds() - start,
        )
        fits = not broken
        # a few rows over: worth a greedy repair, where it could beat the best fit so far (a
        # repair only adds cost) and this answer was not repaired before
        key = tuple(candidate.choice.values())
        if (
            0 < len(broken) <= _ROWS_PER_ROUND
            and (fitting is None or candidate.objective < fitting.objective)
            and key not in tried
        ):
            tried.add(key)
            repaired = _repaired(problem, neighbourhood, candidate)
            if repaired is not None:
                candidate, fits = repaired, True
        if fits and (fitting is None or candidate.objective < fitting.objective):
            log.debug("fits: cost %.6g", candidate.objective)
            fitting, since_better = candidate, 0
            greedy = bool(broken)  # fits by repair, not by its prices
        else:
            since_better += 1
        if fitting is not None and (
            since_better >= 6 or fitting.objective <= best.objective * (1 + MIP_GAP)
        ):
            break
        # until an answer fits, prices only rise (falling prices make the answers cycle);
        # then they move gently, towards the cheapest answer that fits
        up, down = (2.0, 1.0) if fitting is None else (1.5, 0.85)
        if key == last:  # the prices did not move the answer: raise them faster
            up *= up
        last = key
        for k in broken:
            prices[k] = prices.get(k, first / up) * up
        for k in sorted(set(prices) - set(broken)):
            prices[k] *= down
    left = time_limit - (cpu_seconds() - start)
    if fitting is not None:
        log.info("memory priced on %d rows; %d problems solved", len(prices), step + 1)
        fitting.stopped_by_clock |= clock
        if not second_look or not greedy or fitting.objective <= bound * (1 + BOUND_GAP):
            return fitting
        log.info(
            "the repaired fit costs %.4g, %.0f%% above the bound %.4g: pricing with the "
            "integer program too",
            fitting.objective,
            100 * (fitting.objective / bound - 1),
            bound,
        )
        try:
            other = solve_with(problem, solve_priced, max(left, 1.0))
        except InfeasibleError:  # nothing better within the time left: the fit stands
            return fitting
        other.stopped_by_clock |= clock
        if other.objective >= fitting.objective:
            return fitting
        other.fallback = (
            f"pricing memory found a plan only by repairing one, "
            f"{100 * (fitting.objective / bound - 1):.0f}% above the bound on the best: "
            f"priced again with the integer program (HiGHS)"
        )
        return other
    # no prices made an answer fit: the memory rows go into the integer program itself
    try:
        constrained = _solve_constrained(problem, left)
        constrained.stopped_by_clock |= clock
        return constrained
    except InfeasibleError as exc:
        # HiGHS found no answer in its time; where the plan needing least memory fits, it is
        # an answer, if not the cheapest (a plan that fits is never refused as not fitting)
        least, choice = least_memory(problem, max(left, 1.0))
        if not _fits(problem, choice):  # the least a plan can hold does not fit: none does
            raise InfeasibleError(
                f"{exc}; the plan needing least memory holds {least:.4g} of {budget:.4g} bytes"
            ) from None
        return Solution(
            choice,
            problem.cost_of(choice),
            f"{exc}; the plan needing least memory ({least:.4g} of {budget:.4g} bytes)",
            sum(problem.sizes.values()),
            len(problem.memory),
            stopped_by_clock=True,
            fallback="no cheaper plan that fits was found within the time limit: the plan "
            "needing least memory is used",
        )


def _dual_bound(
    problem: Problem, answer: Solution, prices: dict[int, float], rows: dict[int, MemoryRow]
) -> float:
    """A lower bound on the cost of any choice that fits, from the cheapest `answer` under
    `prices` (per budget-full of each row's bytes): its priced cost less each price times one
    budget. The priced solve is exact within `MIP_GAP`, and the bound allows for that."""
    budget = max(problem.memory_budget or 1.0, 1.0)
    priced = answer.objective + sum(
        price * rows[k].bytes_for(answer.choice) / budget for k, price in prices.items()
    )
    return priced / (1 + MIP_GAP) - sum(prices.values())


def _repaired(problem: Problem, neighbourhood: Neighbourhood, near: Solution) -> Solution | None:
    """`near` changed one decision at a time until every row fits (None where that fails)."""
    choice = neighbourhood.repair(near.choice)
    if choice is None:
        return None
    return Solution(
        choice,
        problem.cost_of(choice),
        f"{near.status}; repaired to fit memory",
        near.num_variables,
        near.num_constraints,
        near.fallback,
    )


def _fits(problem: Problem, choice: dict[object, int]) -> bool:
    return not _broken(problem, choice)


def _broken(problem: Problem, choice: dict[object, int]) -> list[MemoryRow]:
    budget = problem.memory_budget or 0.0
    broken = [r for r in problem.memory if r.bytes_for(choice) > budget * (1 + 1e-9)]
    return sorted(broken, key=lambda r: -r.bytes_for(choice))


def solve_priced(problem: Problem, prices: dict[MemoryRow, float], time_limit: float) -> Solution:
    """The cheapest choice when each priced row costs its price per budget-full of bytes."""
    model = _priced_model(problem, tuple(prices))
    c = np.concatenate([model.cost, np.asarray(model.extra)])
    per_budget = 1.0 / max(problem.memory_budget or 1.0, 1.0)
    for row, price in prices.items():
        cols, vals = model.memory_columns(row)
        np.add.at(c, cols, price * per_budget * vals)  # entry by entry, as a loop adds
    scale = float(np.abs(c).max()) or 1.0  # the cheapest plans differ by microseconds
    # relaxed first until a relaxation of this problem comes out fractional (placements
    # priced by time alone mostly relax whole, and the prices of one search move little from
    # step to step), so a relaxation that splits strategies wastes its time once at most
    result = None
    if not problem.solver_cache.get("fractional", False):
        result = model.relaxed(c / scale, model.n, model.upper(), time_limit)
        problem.solver_cache["fractional"] = result is None
    if result is None:
        result = model.run(c / scale, model.n, model.upper(), time_limit)
    choice = model.choice(result.x)
    cost = np.concatenate([model.cost, np.asarray(model.extra)]) @ result.x
    return Solution(
        choice,
        float(cost),
        result.message,
        model.width,
        len(model.lo),
        stopped_by_clock=result.status == _OUT_OF_TIME,
    )


def _priced_model(problem: Problem, rows: tuple[MemoryRow, ...]) -> _Model:
    """The program of `problem` with edge variables for `rows`. The rows priced only grow
    while memory is priced, so the last one made is kept on the problem and made again only
    when a row joins."""
    kept = problem.solver_cache.get("priced")
    if kept is None or kept[0] != rows:
        kept = problem.solver_cache["priced"] = (rows, _Model(problem, list(rows)))
    return kept[1]


def _solve_constrained(problem: Problem, time_limit: float) -> Solution:
    """Memory rows in the program, added as answers break them, until none is broken.

    The rounds share `time_limit`: each solves within what is left of it (at least a second),
    and once it has passed every broken row goes in at once, so few rounds remain."""
    active: list[MemoryRow] = []
    budget = problem.memory_budget or 0.0
    scale = 1.0 / max(budget, 1.0)  # in units of the budget, so every coefficient is near 1
    deadline = cpu_seconds() + time_limit
    while True:
        left = deadline - cpu_seconds()
        model = _Model(problem, active)
        for row in active:
            entries = [(col, v * scale) for col, v in model.memory_entries(row)]
            model.add_row(entries, -np.inf, budget * scale)
        c = np.concatenate([model.cost, np.asarray(model.extra)])
        c_scale = float(np.abs(c).max()) or 1.0
        result = model.run(c / c_scale, model.n, model.upper(), max(1.0, left))
        choice = model.choice(result.x)
        broken = _broken(problem, choice)
        clock = left <= 0
        if not broken:
            return Solution(
                choice,
                float(result.fun) * c_scale,
                result.message,
                model.width,
                len(model.lo),
                stopped_by_clock=clock or result.status == _OUT_OF_TIME,
            )
        active += broken if left <= 0 else broken[:_ROWS_PER_ROUND]


_LIMIT_GROWTH = 16  # how far past its time limit a solve goes to find any answer
_WHOLE = 1e-6  # how far from 0 or 1 a relaxed column may lie and be read as whole
_OPTIMAL = 0  # scipy's milp status: solved, within the gap asked
_OUT_OF_TIME = 1  # scipy's milp status: a limit reached, with or without an answer
_PRICE_STEPS = 40  # programs solved while looking for the prices of memory
_ROWS_PER_ROUND = 8  # broken memory rows added to the program per round


class Least(NamedTuple):
    """What a search for the least memory found: the per-device bytes of the best choice it
    met, that choice, a bound no choice goes below, and whether the search ended on its own
    (within its gap) rather than at its time limit. Only a proven search says what the least
    is; one the clock stopped says only that it lies between `bound` and `bytes`."""

    bytes: float
    choice: dict[object, int]
    bound: float
    proven: bool


def least_memory(
    problem: Problem, time_limit: float = 60.0, gap: float = MIP_GAP
) -> tuple[float, dict[object, int]]:
    """The smallest per-device memory any choice needs, within `gap` of it (where the search
    ends within `time_limit`), and a choice that needs it (see `least_memory_search`)."""
    found = least_memory_search(problem, time_limit, gap)
    return found.bytes, found.choice


def least_memory_search(problem: Problem, time_limit: float = 60.0, gap: float = MIP_GAP) -> Least:
    """The least per-device memory any choice needs, costs aside, as far as HiGHS gets in
    `time_limit`: it minimises the largest memory row (a continuous variable bounds every
    row), and its dual bound says how far below its best answer the least may lie."""
    model = _Model(problem)
    peak = model.width  # the bound's column
    rows = [model.memory_entries(row) for row in problem.memory]
    # HiGHS loses feasibility with coefficients of a billion bytes; below 1e8 it does
    # best unscaled (scaling small problems slows it several times)
    largest = max((abs(v) for entries in rows for _, v in entries), default=1.0)
    scale = max(1.0, largest / 1e8)
    for entries in rows:
        model.add_row([*((col, v / scale) for col, v in entries), (peak, -1.0)], -np.inf, 0.0)
    c = np.zeros(peak + 1)
    c[peak] = 1.0
    result = model.run(c, model.n, model.upper(extra=1), time_limit, gap)
    least = float(result.x[peak]) * scale
    proven = result.status == _OPTIMAL
    bound = getattr(result, "mip_dual_bound", None)
    if bound is None or not np.isfinite(bound):
        bound = least if proven else 0.0
    return Least(least, model.choice(result.x), min(least, max(0.0, float(bound) * scale)), proven)
