"""The O1 solver by itself: exact on small problems, a valid choice when its tables are capped,
and memory priced as O2 prices it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessel.plan import dp, ilp
from tessel.plan.problem import FORBIDDEN, InfeasibleError, MemoryRow, Problem


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


def _factors(problem: Problem) -> list:
    return [dp._Factor((v,), c) for v, c in problem.linear.items()] + [
        dp._Factor(k, m) for k, m in problem.pairs.items()
    ]


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


@pytest.mark.parametrize(
    "cap",
    [
        "MAX_TABLE",  # every bucket split into parts (mini-buckets)
        "MAX_AXES",  # a bucket over three decisions is split into parts
    ],
)
@given(problem=problems())
@settings(derandomize=True, max_examples=50, deadline=None)
def test_capped_buckets_still_give_a_valid_choice(cap, problem):
    saved = getattr(dp, cap)
    setattr(dp, cap, 2)
    try:
        choice = dp._eliminate(problem.sizes, _factors(problem))
    finally:
        setattr(dp, cap, saved)
    assert set(choice) == set(problem.sizes)
    assert all(0 <= choice[v] < k for v, k in problem.sizes.items())
    assert _objective(problem, choice) >= _brute_force(problem) - 1e-9


@given(problems())
@settings(derandomize=True, max_examples=50, deadline=None)
def test_capped_tables_hand_solve_to_the_integer_program(problem):
    saved = dp.MAX_TABLE
    dp.MAX_TABLE = 2
    try:
        solution = dp.solve(problem)
    finally:
        dp.MAX_TABLE = saved
    _, width = dp.elimination_order(
        {v: k for v, k in problem.sizes.items() if k > 1},
        [tuple(v for v in key if problem.sizes[v] > 1) for key in problem.pairs],
    )
    wide = width.entries > 2  # a table of more entries than the cap
    assert ("solved by the integer program" in solution.fallback) == wide
    assert solution.objective == pytest.approx(_brute_force(problem))


@given(problems(memory=True))
@settings(derandomize=True, max_examples=50, deadline=None)
def test_memory_is_priced_like_o2(problem):
    best = _brute_force(problem)
    try:
        o2 = ilp.solve(problem)
    except InfeasibleError:
        assert best is None
        return
    o1 = dp.solve(problem)
    for row in problem.memory:
        assert row.bytes_for(o1.choice) <= problem.memory_budget * (1 + 1e-9)
    assert best is not None and o1.objective >= best - 1e-9
    # the same pricing loop; both answers fit, and neither is far from the optimum here
    assert o1.objective <= max(o2.objective, best) * 1.05 + 1e-9


def test_decisions_of_one_strategy_never_widen_a_table():
    # a decision of one strategy joined to 70 others of one strategy, each of those to a
    # decision of two: its table has one entry, so it goes first, and a table over its
    # neighbours would have 70 axes (numpy allows 64); folded out, each pair stands alone
    rng = np.random.default_rng(7)
    n = 70
    sizes = {"c": 1, **{f"l{i}": 1 for i in range(n)}, **{f"w{i}": 2 for i in range(n)}}
    linear = {v: rng.uniform(0, 10, k) for v, k in sizes.items()}
    pairs = {("c", f"l{i}"): rng.uniform(0, 10, (1, 1)) for i in range(n)}
    pairs |= {(f"l{i}", f"w{i}"): rng.uniform(0, 10, (1, 2)) for i in range(n)}
    problem = Problem(sizes, linear, pairs)
    solution = dp.solve(problem)
    assert solution.fallback == ""
    best = {
        f"w{i}": int(np.argmin(linear[f"w{i}"] + pairs[(f"l{i}", f"w{i}")][0])) for i in range(n)
    }
    assert solution.choice == {**{v: 0 for v, k in sizes.items() if k == 1}, **best}
    assert solution.objective == pytest.approx(_objective(problem, solution.choice))


def test_an_order_past_the_widths_limits_is_said():
    _, width = dp.elimination_order(
        {f"d{i}": 2 for i in range(40)}, [tuple(f"d{i}" for i in range(40))]
    )
    assert width.axes == 40 and width.entries == 2**40
    assert not width.affordable()
    assert "40 decisions" in width.describe()


def test_a_problem_too_wide_for_elimination_goes_to_the_integer_program(monkeypatch):
    # every decision paired with every other: eliminating any of them builds a table over all
    monkeypatch.setattr(dp, "MAX_TABLE", 1 << 6)
    rng = np.random.default_rng(3)
    n = 10
    sizes = {f"d{i}": 2 for i in range(n)}
    linear = {v: rng.uniform(0, 10, 2) for v in sizes}
    pairs = {
        (f"d{i}", f"d{j}"): rng.uniform(0, 10, (2, 2))
        for i, j in itertools.combinations(range(n), 2)
    }
    problem = Problem(sizes, linear, pairs)
    solution = dp.solve(problem)
    assert "solved by the integer program" in solution.fallback
    assert "span 10 decisions and 1,024 entries" in solution.fallback
    assert solution.objective == pytest.approx(_brute_force(problem))


def _forbidden_outweighs_memory() -> Problem:
    """a=2 holds nothing but is forbidden; a=1 fits at a cost half of FORBIDDEN. Priced
    memory makes a=0 dearer than a=2 before it makes it dearer than a=1."""
    linear = {"a": np.array([0.0, 5e5, FORBIDDEN])}
    row = MemoryRow({"a": np.array([2e9, 1.1e9, 0.0])})
    return Problem({"a": 3}, linear, {}, [row], 1.2e9)


@pytest.mark.parametrize("solver", [dp.solve, ilp.solve], ids=["o1", "o2"])
def test_no_memory_price_makes_a_solver_take_a_forbidden_strategy(solver):
    assert solver(_forbidden_outweighs_memory(), time_limit=5.0).choice == {"a": 1}


@pytest.mark.parametrize("solver", [dp.solve, ilp.solve], ids=["o1", "o2"])
def test_where_only_a_forbidden_choice_fits_there_is_no_plan(solver):
    # a=1 would fit, but it is forbidden (b only helps a little)
    linear = {"a": np.array([0.0, FORBIDDEN]), "b": np.array([0.0, 10.0])}
    row = MemoryRow({"a": np.array([2e9, 0.0]), "b": np.array([1e9, 5e8])})
    with pytest.raises(InfeasibleError):
        solver(Problem({"a": 2, "b": 2}, linear, {}, [row], 1.2e9), time_limit=5.0)
