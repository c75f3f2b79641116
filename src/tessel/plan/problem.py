"""The planner's optimisation problem: one-hot decisions with linear and pairwise costs under
per-device memory rows, and its solution. Both solvers (`ilp`, `dp`) read and answer it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False)
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
    # where the solver asked for handed the problem to another method: why, and to which
    fallback: str = ""


class InfeasibleError(RuntimeError):
    """No choice fits the memory budget."""
