"""The planner's optimisation problem: one-hot decisions with linear and pairwise costs under
per-device memory rows, and its solution. Both solvers (`ilp`, `dp`) read and answer it."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

# A decision: the planner's are graph nodes; the solvers take any hashable key.
D = TypeVar("D", bound=Hashable)


# the cost of a combination no plan may take (a move of state into the op that writes it in
# place, a move DTensor has not): the integer program closes its columns outright, so its
# scaled costs keep their resolution; dynamic programming counts it infinite, and the greedy
# repair never steps onto it
FORBIDDEN = 1e6


@dataclass(eq=False)
class MemoryRow(Generic[D]):
    """What one device holds at one moment: bytes per strategy of single decisions, and bytes
    per (k_a, k_b) of decision pairs (a buffer that exists only for some combinations)."""

    linear: dict[D, np.ndarray] = field(default_factory=dict)
    pairs: dict[tuple[D, D], np.ndarray] = field(default_factory=dict)

    def bytes_for(self, choice: dict[D, int]) -> float:
        total = sum(float(b[choice[v]]) for v, b in self.linear.items())
        return total + sum(float(m[choice[a], choice[b]]) for (a, b), m in self.pairs.items())


@dataclass
class Problem(Generic[D]):
    """One-hot decisions with linear and pairwise costs, under per-device memory limits.

    Each memory row is what one device holds at one moment (its weights plus the activations
    alive then); every row must stay within `memory_budget`.
    """

    sizes: dict[D, int]  # decision -> number of strategies
    linear: dict[D, np.ndarray]  # decision -> cost per strategy
    pairs: dict[tuple[D, D], np.ndarray]  # (a, b) -> cost[k_a, k_b]
    memory: list[MemoryRow[D]] = field(default_factory=list)
    memory_budget: float | None = None
    # what a solver made from this problem and may use again on it (not part of the problem)
    solver_cache: dict[str, Any] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def takes_forbidden(self, choice: dict[D, int]) -> bool:
        """Whether `choice` takes a strategy or a pair of strategies priced `FORBIDDEN`."""
        return any(c[choice[v]] >= FORBIDDEN for v, c in self.linear.items()) or any(
            m[choice[a], choice[b]] >= FORBIDDEN for (a, b), m in self.pairs.items()
        )

    def cost_of(self, choice: dict[D, int]) -> float:
        """The cost of `choice`: its strategies' costs and its pairs'."""
        total = sum(float(c[choice[v]]) for v, c in self.linear.items())
        return total + sum(float(m[choice[a], choice[b]]) for (a, b), m in self.pairs.items())


@dataclass
class Solution(Generic[D]):
    choice: dict[D, int]
    objective: float
    status: str
    num_variables: int
    num_constraints: int
    # where the solver asked for handed the problem to another method: why, and to which
    fallback: str = ""
    # the search ended at its time limit, not at its own end: on a faster machine, or with a
    # longer limit, it may find a cheaper plan
    stopped_by_clock: bool = False


class InfeasibleError(RuntimeError):
    """No choice fits the memory budget."""


class OutOfTimeError(InfeasibleError):
    """The solver found no answer at all before its time ran out: whether one exists is not
    known."""


def pairwise(
    src: Sequence[Hashable], dst: Sequence[Hashable], f: Callable[[Any, Any], Any]
) -> np.ndarray:
    """`f(s, d)` for every `s` of `src` and `d` of `dst`, as an array with a row per `s`: each
    distinct pair is computed once (the strategies of a node repeat placements)."""
    rows, row_of = _distinct(src)
    cols, col_of = _distinct(dst)
    table = np.array([[f(s, d) for d in cols] for s in rows], dtype=float)
    table = table.reshape(len(rows), len(cols), *table.shape[2:])
    return table[np.ix_(row_of, col_of)]


def _distinct(items: Sequence[Hashable]) -> tuple[list, list[int]]:
    """The distinct items in first-seen order, and each item's index among them."""
    first: dict = {}
    index = [first.setdefault(x, len(first)) for x in items]
    return list(first), index
