"""Repairing a choice that breaks memory rows by changing one decision at a time.

The priced solves of `ilp.solve_with` often end a few percent over the budget on one or two
rows, where raising those rows' prices far enough to move the answer takes many more solves.
A greedy repair turns such an answer into one that fits: each step takes the change of one
decision that removes the most excess bytes per unit of cost added, and a last pass takes
every change that lowers the cost while every row still fits. What it finds is an upper
bound the solver keeps only where it beats the answers of the prices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessel.plan.problem import FORBIDDEN, Problem


@dataclass
class _Term:
    """One decision's part of a cost or a memory row: its own bytes or cost per strategy, or
    a matrix over it and another decision (`first`: this decision indexes the rows)."""

    linear: np.ndarray | None
    pairs: list[tuple[np.ndarray, object, bool]]

    def forbidden(self, choice: dict[object, int], v: object, k: int) -> bool:
        """Whether strategy `k` of `v` takes an entry priced `FORBIDDEN`, the rest as `choice`."""
        if self.linear is not None and self.linear[k] >= FORBIDDEN:
            return True
        for m, other, first in self.pairs:
            if other == v:
                entry = m[k, k]
            else:
                entry = m[k, choice[other]] if first else m[choice[other], k]
            if entry >= FORBIDDEN:
                return True
        return False

    def value(self, choice: dict[object, int], v: object, k: int) -> float:
        total = 0.0 if self.linear is None else float(self.linear[k])
        for m, other, first in self.pairs:
            if other == v:  # the decision paired with itself
                total += float(m[k, k])
            elif first:
                total += float(m[k, choice[other]])
            else:
                total += float(m[choice[other], k])
        return total


def _terms(linear: dict, pairs: dict) -> dict[object, _Term]:
    terms: dict[object, _Term] = {}

    def term(v: object) -> _Term:
        return terms.setdefault(v, _Term(None, []))

    for v, values in linear.items():
        term(v).linear = np.asarray(values, dtype=float)
    for (a, b), m in pairs.items():
        m = np.asarray(m, dtype=float)
        term(a).pairs.append((m, b, True))
        if a != b:
            term(b).pairs.append((m, a, False))
    return terms


class Neighbourhood:
    """The cost and memory rows of `problem` seen one decision at a time."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.budget = (problem.memory_budget or 0.0) * (1 + 1e-9)
        self.cost = _terms(problem.linear, problem.pairs)
        self.rows: dict[object, list[tuple[int, _Term]]] = {v: [] for v in problem.sizes}
        for i, row in enumerate(problem.memory):
            for v, term in _terms(row.linear, row.pairs).items():
                self.rows[v].append((i, term))

    def _allowed(self, choice: dict[object, int], v: object, k: int) -> bool:
        """Whether setting `v` to `k` keeps `choice` off every forbidden entry."""
        term = self.cost.get(v)
        return term is None or not term.forbidden(choice, v, k)

    def _change(self, choice: dict[object, int], v: object, k: int) -> tuple[float, list]:
        """The cost added and each touched row's bytes added by setting `v` to `k`."""
        old = choice[v]
        term = self.cost.get(v)
        cost = 0.0 if term is None else term.value(choice, v, k) - term.value(choice, v, old)
        rows = [(i, t.value(choice, v, k) - t.value(choice, v, old)) for i, t in self.rows[v]]
        return cost, rows

    def repair(self, choice: dict[object, int]) -> dict[object, int] | None:
        """A choice near `choice` whose every row fits, or None where greedy steps find none."""
        choice = dict(choice)
        held = np.array([row.bytes_for(choice) for row in self.problem.memory])
        for _ in range(len(choice) * 4):
            broken = {i for i in np.flatnonzero(held > self.budget)}
            if not broken:
                return self.improve(choice, held)
            best: tuple[float, object, int] | None = None
            for v, n in self.problem.sizes.items():
                if n == 1 or not any(i in broken for i, _ in self.rows[v]):
                    continue
                for k in range(n):
                    if k == choice[v] or not self._allowed(choice, v, k):
                        continue
                    cost, rows = self._change(choice, v, k)
                    excess = sum(
                        max(0.0, held[i] + d - self.budget) - max(0.0, held[i] - self.budget)
                        for i, d in rows
                    )
                    if excess < 0 and (best is None or cost / -excess < best[0]):
                        best = (cost / -excess, v, k)
            if best is None:
                return None
            self._apply(choice, held, best[1], best[2])
        return None

    def improve(self, choice: dict[object, int], held: np.ndarray) -> dict[object, int]:
        """`choice` after every one-decision change that lowers the cost and keeps each row
        within the budget, taken best first per decision until none is left."""
        for _ in range(len(choice)):
            changed = False
            for v, n in self.problem.sizes.items():
                best: tuple[float, int] | None = None
                for k in range(n):
                    if k == choice[v] or not self._allowed(choice, v, k):
                        continue
                    cost, rows = self._change(choice, v, k)
                    if cost < -1e-12 * (1 + abs(cost)) and all(
                        held[i] + d <= self.budget for i, d in rows
                    ):
                        if best is None or cost < best[0]:
                            best = (cost, k)
                if best is not None:
                    self._apply(choice, held, v, best[1])
                    changed = True
            if not changed:
                break
        return choice

    def _apply(self, choice: dict[object, int], held: np.ndarray, v: object, k: int) -> None:
        _, rows = self._change(choice, v, k)
        for i, d in rows:
            held[i] += d
        choice[v] = k
