"""The O2 solver against brute force: the cheapest one-hot choice, pairwise (resharding) costs,
the compressed edge variables, memory rows under a budget, infeasibility and least memory."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessel.plan.ilp import least_memory, solve
from tessel.plan.problem import FORBIDDEN, InfeasibleError, MemoryRow, Problem


def _cost(problem: Problem, choice: dict) -> float:
    total = sum(float(c[choice[v]]) for v, c in problem.linear.items())
    return total + sum(float(m[choice[a], choice[b]]) for (a, b), m in problem.pairs.items())


def _choices(problem: Problem):
    names = list(problem.sizes)
    for ks in itertools.product(*(range(problem.sizes[v]) for v in names)):
        yield dict(zip(names, ks))


def _fits(problem: Problem, choice: dict) -> bool:
    if problem.memory_budget is None:
        return True
    return all(row.bytes_for(choice) <= problem.memory_budget for row in problem.memory)


def _brute_force(problem: Problem) -> float | None:
    """The least cost over every choice that fits (None: none fits)."""
    costs = [_cost(problem, c) for c in _choices(problem) if _fits(problem, c)]
    return min(costs) if costs else None


def test_solve_picks_the_cheapest_strategy_of_each_decision():
    problem = Problem(
        sizes={"a": 3, "b": 2},
        linear={"a": np.array([5.0, 1.0, 3.0]), "b": np.array([2.0, 7.0])},
        pairs={},
    )
    solution = solve(problem)
    assert solution.choice == {"a": 1, "b": 0}
    assert solution.objective == pytest.approx(3.0)
    assert solution.num_variables == 5  # no pairs: no edge variables


def test_a_resharding_cost_changes_the_choice():
    # alone, a prefers 0 and b prefers 1; moving a's 0 into b's 1 costs 10, so the cheapest
    # plan is (0, 0) at 1 + 3 = 4, not (0, 1) at 1 + 2 + 10 = 13 nor (1, 1) at 4 + 2 = 6
    linear = {"a": np.array([1.0, 4.0]), "b": np.array([3.0, 2.0])}
    assert solve(Problem({"a": 2, "b": 2}, linear, {})).choice == {"a": 0, "b": 1}
    pairs = {("a", "b"): np.array([[0.0, 10.0], [10.0, 0.0]])}
    solution = solve(Problem({"a": 2, "b": 2}, linear, pairs))
    assert solution.choice == {"a": 0, "b": 0}
    assert solution.objective == pytest.approx(4.0)


def test_a_forbidden_pair_keeps_the_costs_of_microseconds_apart():
    """Moving state into its writer is FORBIDDEN: closed, never a coefficient a million times
    the others that would leave the real costs (microseconds apart) below HiGHS's tolerance."""
    chain = [f"op{i}" for i in range(40)]
    sizes = {"state": 2, **{v: 2 for v in chain}}
    linear = {v: np.array([5e-6, 1e-6]) for v in chain}  # each op's strategy 1 is cheaper
    pairs = {
        # state placed 0 forbids the first op's strategy 1; neighbours move at 2 us
        ("state", chain[0]): np.array([[0.0, FORBIDDEN], [0.0, 0.0]]),
        **{(a, b): np.array([[0.0, 2e-6], [2e-6, 0.0]]) for a, b in zip(chain, chain[1:])},
    }
    solution = solve(Problem(sizes, linear, pairs))
    assert solution.choice == {"state": 1, **{v: 1 for v in chain}}
    assert solution.objective == pytest.approx(40e-6)
    # a pair whose forbidden strategy depends on one side closes that strategy
    one_side = {("state", chain[0]): np.array([[0.0, FORBIDDEN]] * 2)}
    solution = solve(Problem(sizes, linear, one_side))
    assert solution.choice[chain[0]] == 0


def test_a_pair_cost_that_depends_on_one_side_needs_no_edge_variables():
    # identical rows: the cost depends on b alone and folds into b's linear cost
    pairs = {("a", "b"): np.array([[1.0, 5.0], [1.0, 5.0], [1.0, 5.0]])}
    solution = solve(Problem({"a": 3, "b": 2}, {"a": np.array([0.0, 1.0, 2.0])}, pairs))
    assert solution.num_variables == 5
    assert solution.choice == {"a": 0, "b": 0}
    assert solution.objective == pytest.approx(1.0)


def test_identical_rows_and_columns_share_edge_variables():
    # rows 0 and 2 are the same and columns 1 and 2 are the same: 2 x 2 edge variables
    m = np.array([[0.0, 3.0, 3.0], [1.0, 0.0, 0.0], [0.0, 3.0, 3.0]])
    solution = solve(Problem({"a": 3, "b": 3}, {}, {("a", "b"): m}))
    assert solution.num_variables == 3 + 3 + 4
    assert solution.objective == pytest.approx(0.0)


def _problem_strategy(min_rows: int = 0):
    """Small problems whose matrices repeat rows and columns (what compression merges)."""

    @st.composite
    def build(draw):
        n = draw(st.integers(2, 4))
        names = [f"v{i}" for i in range(n)]
        sizes = {v: draw(st.integers(1, 3)) for v in names}
        small = st.integers(0, 3).map(float)
        linear = {
            v: np.array(draw(st.lists(small, min_size=k, max_size=k))) for v, k in sizes.items()
        }

        def matrix(a, b, values):
            # rows drawn from a pool of two rows, columns alike: repeats are common
            pool = [draw(st.lists(values, min_size=sizes[b], max_size=sizes[b])) for _ in "ab"]
            rows = [pool[draw(st.integers(0, 1))] for _ in range(sizes[a])]
            m = np.array(rows, dtype=float)
            if draw(st.booleans()) and sizes[b] > 1:
                m[:, -1] = m[:, 0]  # a repeated column
            return m

        edges = [(a, b) for a, b in itertools.combinations(names, 2) if draw(st.booleans())]
        pairs = {e: matrix(*e, st.integers(0, 5).map(float)) for e in edges}
        memory = []
        for _ in range(draw(st.integers(min_rows, 3))):
            row = MemoryRow()
            for v in names:
                if draw(st.booleans()):
                    row.linear[v] = np.array(
                        draw(st.lists(st.integers(0, 8).map(float), min_size=sizes[v],
                                      max_size=sizes[v]))
                    )  # fmt: skip
            for e in itertools.combinations(names, 2):
                if draw(st.integers(0, 2)) == 0:
                    row.pairs[e] = matrix(*e, st.integers(0, 8).map(float))
            memory.append(row)
        budget = float(draw(st.integers(0, 30))) if memory else None
        return Problem(sizes, linear, pairs, memory, budget)

    return build()


@settings(derandomize=True, max_examples=150, deadline=None)
@given(_problem_strategy())
def test_solve_finds_the_brute_force_optimum(problem):
    best = _brute_force(problem)
    if best is None:
        with pytest.raises(InfeasibleError):
            solve(problem)
        return
    solution = solve(problem)
    assert set(solution.choice) == set(problem.sizes)
    assert _fits(problem, solution.choice)
    assert _cost(problem, solution.choice) == pytest.approx(best)
    assert solution.objective == pytest.approx(best, abs=1e-6)


def test_memory_rows_with_pair_terms_hold_the_budget():
    # the cheapest choice (0, 0) allocates a 6-byte buffer between a and b; the budget of 5
    # forces the next cheapest that fits
    sizes = {"a": 2, "b": 2}
    linear = {"a": np.array([0.0, 1.0]), "b": np.array([0.0, 2.0])}
    row = MemoryRow(
        linear={"a": np.array([1.0, 2.0])},
        pairs={("a", "b"): np.array([[5.0, 0.0], [0.0, 0.0]])},
    )
    unlimited = solve(Problem(sizes, linear, {}, [row], None))
    assert unlimited.choice == {"a": 0, "b": 0}
    assert row.bytes_for(unlimited.choice) == 6.0
    tight = solve(Problem(sizes, linear, {}, [row], 5.0))
    # (0, 1): 1 + 0 bytes, cost 2; (1, 0): 2 + 0 bytes, cost 1
    assert tight.choice == {"a": 1, "b": 0}
    assert tight.objective == pytest.approx(1.0)
    assert row.bytes_for(tight.choice) <= 5.0


def test_every_row_is_held_to_the_budget():
    sizes = {"a": 2, "b": 2}
    linear = {"a": np.array([0.0, 1.0]), "b": np.array([0.0, 1.0])}
    rows = [MemoryRow({"a": np.array([4.0, 1.0])}), MemoryRow({"b": np.array([4.0, 1.0])})]
    assert solve(Problem(sizes, linear, {}, rows, 4.0)).choice == {"a": 0, "b": 0}
    assert solve(Problem(sizes, linear, {}, rows, 3.0)).choice == {"a": 1, "b": 1}


def test_a_budget_no_choice_fits_is_infeasible():
    row = MemoryRow({"a": np.array([4.0, 3.0])}, {("a", "b"): np.array([[0.0, 1.0], [1.0, 1.0]])})
    linear = {"a": np.array([0.0, 1.0]), "b": np.array([0.0, 1.0])}
    problem = Problem({"a": 2, "b": 2}, linear, {}, [row], 3.5)
    assert _brute_force(problem) is None
    with pytest.raises(InfeasibleError):
        solve(problem)
    problem.memory_budget = 4.0
    assert solve(problem).choice == {"a": 0, "b": 0}


def test_least_memory_of_a_hand_made_problem():
    # choices and their rows' bytes (row 1, row 2): (0,0) 9/3, (0,1) 4/8, (1,0) 7/3, (1,1) 2/8
    rows = [
        MemoryRow({"a": np.array([4.0, 2.0])}, {("a", "b"): np.array([[5.0, 0.0], [5.0, 0.0]])}),
        MemoryRow({"b": np.array([1.0, 6.0])}, {("a", "b"): np.array([[2.0, 2.0], [2.0, 2.0]])}),
    ]
    least, choice = least_memory(Problem({"a": 2, "b": 2}, {"a": np.array([0.0, 9.0])}, {}, rows))
    assert least == pytest.approx(7.0)  # (1, 0): max(2 + 5, 1 + 2); costs play no part
    assert choice == {"a": 1, "b": 0}


@settings(derandomize=True, max_examples=100, deadline=None)
@given(_problem_strategy(min_rows=1))
def test_least_memory_is_the_brute_force_minimum_of_the_largest_row(problem):
    least, choice = least_memory(problem)
    truth = min(max(r.bytes_for(c) for r in problem.memory) for c in _choices(problem))
    assert least == pytest.approx(truth, abs=1e-6)
    assert max(r.bytes_for(choice) for r in problem.memory) == pytest.approx(truth, abs=1e-6)


def test_pairwise_computes_each_distinct_pair_once_and_fills_every_cell():
    from tessel.plan.problem import pairwise

    calls = []

    def f(s, d):
        calls.append((s, d))
        return (10 * s + d, -d)

    m = pairwise([1, 2, 1], [3, 3, 4], f)
    assert sorted(calls) == [(1, 3), (1, 4), (2, 3), (2, 4)]
    assert m.shape == (3, 3, 2)
    assert m[..., 0].tolist() == [[13, 13, 14], [23, 23, 24], [13, 13, 14]]
    assert m[2, 2].tolist() == [14, -4]
    assert pairwise([None, 1], [2], lambda s, d: 0.0 if s is None else s + d).tolist() == [[0], [3]]


@settings(derandomize=True, max_examples=100, deadline=None)
@given(_problem_strategy(min_rows=1))
def test_constrained_rounds_past_their_time_limit_still_end_in_the_optimum(problem):
    # with no time left every broken row goes into the program at once: still the optimum
    from tessel.plan.ilp import _solve_constrained

    best = _brute_force(problem)
    if best is None:
        with pytest.raises(InfeasibleError):
            _solve_constrained(problem, 0.0)
        return
    solution = _solve_constrained(problem, 0.0)
    assert _fits(problem, solution.choice)
    assert _cost(problem, solution.choice) == pytest.approx(best)


def test_a_fit_is_never_refused_when_the_integer_program_runs_out_of_time(monkeypatch):
    """Where no priced answer fits and HiGHS, given the memory rows, finds nothing in its time
    (a loaded machine), the plan needing least memory is the answer where it fits: never a
    refusal saying the model does not fit. Where even it does not fit, the refusal stands."""
    from tessel.plan import ilp

    def out_of_time(problem, time_limit):
        raise InfeasibleError("time limit reached")

    monkeypatch.setattr(ilp, "_solve_constrained", out_of_time)
    monkeypatch.setattr(ilp, "_PRICE_STEPS", 1)  # pricing gives up at once
    monkeypatch.setattr(ilp, "_ROWS_PER_ROUND", 0)  # and repairs nothing
    sizes = {"a": 2, "b": 2}
    linear = {"a": np.array([0.0, 1.0]), "b": np.array([0.0, 1.0])}
    rows = [MemoryRow({"a": np.array([4.0, 1.0])}), MemoryRow({"b": np.array([4.0, 1.0])})]
    solution = solve(Problem(sizes, linear, {}, rows, 3.0))
    assert solution.choice == {"a": 1, "b": 1}
    assert solution.objective == pytest.approx(2.0)
    assert "least memory" in solution.fallback
    with pytest.raises(InfeasibleError):
        solve(Problem(sizes, linear, {}, rows, 0.5))


def test_a_busy_machines_wall_clock_leaves_the_answer_as_it_is(monkeypatch):
    """The searches' time limits count this process's CPU seconds: a wall clock that runs far
    ahead of them (a machine busy with other builds, or a test's workers) stops no search
    early, so the plan is the one an idle machine finds, and does not say it owes the clock."""
    import time

    sizes = {"a": 2, "b": 2}
    linear = {"a": np.array([0.0, 1.0]), "b": np.array([0.0, 1.0])}
    rows = [MemoryRow({"a": np.array([4.0, 1.0])}), MemoryRow({"b": np.array([4.0, 1.0])})]
    idle = solve(Problem(sizes, linear, {}, rows, 3.0), time_limit=10.0)
    wall = itertools.count(0.0, 1000.0)  # each reading 1000 s past the last
    monkeypatch.setattr(time, "perf_counter", lambda: next(wall))
    monkeypatch.setattr(time, "monotonic", lambda: next(wall))
    busy = solve(Problem(sizes, linear, {}, rows, 3.0), time_limit=10.0)
    assert busy.choice == idle.choice == {"a": 1, "b": 1}
    assert not busy.stopped_by_clock and not idle.stopped_by_clock


def _integer_searches(monkeypatch) -> list[bool]:
    """Records, per HiGHS call the O2 solver makes, whether it was an integer search."""
    from tessel.plan import ilp

    calls: list[bool] = []
    real = ilp.milp

    def counted(c, **kwargs):
        integrality = kwargs.get("integrality")
        calls.append(integrality is not None and bool(np.any(integrality)))
        return real(c, **kwargs)

    monkeypatch.setattr(ilp, "milp", counted)
    return calls


def test_a_relaxation_that_comes_out_whole_is_the_answer_without_a_search(monkeypatch):
    # a chain whose pair costs favour agreeing: its relaxation's optimum is a whole choice
    agree = np.array([[0.0, 3.0], [3.0, 0.0]])
    problem = Problem(
        {"a": 2, "b": 2, "c": 2},
        {"a": np.array([1.0, 2.0]), "b": np.array([2.0, 1.5]), "c": np.array([1.0, 1.0])},
        {("a", "b"): agree, ("b", "c"): agree},
    )
    calls = _integer_searches(monkeypatch)
    solution = solve(problem)
    assert calls == [False]  # the relaxation alone
    assert solution.objective == pytest.approx(_brute_force(problem))


def test_a_fractional_relaxation_falls_back_to_the_integer_search(monkeypatch):
    # three decisions that each pay for agreeing with the others: the relaxation splits every
    # one in halves and pays nothing, while any whole choice has two that agree
    equal = np.eye(2)
    problem = Problem(
        {"a": 2, "b": 2, "c": 2},
        {v: np.zeros(2) for v in "abc"},
        {("a", "b"): equal, ("b", "c"): equal, ("a", "c"): equal},
    )
    calls = _integer_searches(monkeypatch)
    solution = solve(problem)
    assert calls == [False, True]
    assert solution.objective == pytest.approx(1.0) == _brute_force(problem)


def test_a_problem_whose_relaxation_splits_once_is_searched_from_then_on(monkeypatch):
    """While memory is priced, each program is relaxed first until a relaxation comes out
    fractional; every later program of the problem goes straight to the integer search."""
    # three decisions that each pay for agreeing with the others (the relaxation splits them
    # in halves) and a memory row the fastest choice breaks
    equal = np.eye(2)
    sizes = {"a": 2, "b": 2, "c": 2}
    linear = {"a": np.array([0.0, 0.1]), "b": np.zeros(2), "c": np.zeros(2)}
    row = MemoryRow(linear={"a": np.array([3.0, 1.0])})
    pairs = {("a", "b"): equal, ("b", "c"): equal, ("a", "c"): equal}
    problem = Problem(sizes, linear, pairs, [row], 2.0)
    calls = _integer_searches(monkeypatch)
    solution = solve(problem)
    assert solution.objective == pytest.approx(_brute_force(problem))
    assert True in calls
    first = calls.index(True)
    assert calls[first - 1] is False  # the relaxation that split
    assert len(calls) > first + 1 and all(calls[first:])
