"""The O1 solver by itself: exact on small problems, a valid choice when its tables are capped,
and memory priced as O2 prices it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessel.plan import dp, ilp
from tessel.plan.ilp import MemoryRow, Problem


def _objective(problem: Problem, choice: dict) -> float:
    return sum(float(c[choice[v]]) for v, c in problem.linear.items()) + sum(
        float(m[choice[a], choice[b]]) for (a, b), m in problem.pairs.items()
    )


@st.composite
def problems(draw, memory: bool = False):
    n = draw(st.integers(1, 6))
    sizes = {f"d{i}": draw(st.integers(1, 3)) for i in range(n)}
    names = list(sizes)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    linear = {v: rng.uniform(0, 10, k) for v, k in sizes.items()}
    pairs = {}
    for a, b in itertools.combinations(names, 2):
        if draw(st.booleans()):
            pairs[(a, b)] = rng.uniform(0, 10, (sizes[a], sizes[b]))
    rows, budget = [], None
    if memory:
        rows = [
            MemoryRow(linear={v: rng.uniform(0, 5, sizes[v]) for v in names})
            for _ in range(draw(st.integers(1, 3)))
        ]
        budget = float(draw(st.integers(3, 5 * n)))
    return Problem(sizes, linear, pairs, rows, budget)


def _brute_force(problem: Problem):
    names = list(problem.sizes)
    best = None
    for ks in itertools.product(*(range(problem.sizes[v]) for v in names)):
        choice = dict(zip(names, ks))
        if any(r.bytes_for(choice) > (problem.memory_budget or 0) for r in problem.memory):
            continue
        cost = _objective(problem, choice)
        if best is None or cost < best:
            best = cost
    return best


@given(problems())
@settings(derandomize=True, max_examples=100, deadline=None)
def test_elimination_finds_the_optimum(problem):
    solution = dp.solve(problem)
    assert solution.objective == pytest.approx(_brute_force(problem))
    assert solution.objective == pytest.approx(_objective(problem, solution.choice))


@given(problems())
@settings(derandomize=True, max_examples=50, deadline=None)
def test_capped_tables_still_give_a_valid_choice(problem):
    saved = dp.MAX_TABLE
    dp.MAX_TABLE = 2  # every bucket split into parts
    try:
        solution = dp.solve(problem)
    finally:
        dp.MAX_TABLE = saved
    assert set(solution.choice) == set(problem.sizes)
    assert all(0 <= solution.choice[v] < k for v, k in problem.sizes.items())
    assert solution.objective >= _brute_force(problem) - 1e-9


@given(problems(memory=True))
@settings(derandomize=True, max_examples=50, deadline=None)
def test_memory_is_priced_like_o2(problem):
    best = _brute_force(problem)
    try:
        o2 = ilp.solve(problem)
    except ilp.InfeasibleError:
        assert best is None
        return
    o1 = dp.solve(problem)
    for row in problem.memory:
        assert row.bytes_for(o1.choice) <= problem.memory_budget * (1 + 1e-9)
    assert best is not None and o1.objective >= best - 1e-9
    # the same pricing loop; both answers fit, and neither is far from the optimum here
    assert o1.objective <= max(o2.objective, best) * 1.05 + 1e-9
