"""The greedy repair of a choice that breaks memory rows: what it returns fits, its last pass
never raises the cost, and each step removes excess bytes where they cost least."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.plan.test_ilp import _choices, _cost, _fits, _problem_strategy

from tessel.plan.problem import FORBIDDEN, MemoryRow, Problem
from tessel.plan.repair import Neighbourhood


@settings(derandomize=True, max_examples=150, deadline=None)
@given(_problem_strategy(min_rows=1), st.randoms(use_true_random=False))
def test_a_repaired_choice_fits_and_improving_one_never_costs_more(problem, random):
    start = {v: random.randrange(k) for v, k in problem.sizes.items()}
    neighbourhood = Neighbourhood(problem)
    repaired = neighbourhood.repair(start)
    if repaired is not None:
        assert set(repaired) == set(problem.sizes)
        assert _fits(problem, repaired)
    fitting = [c for c in _choices(problem) if _fits(problem, c)]
    if fitting:
        choice = fitting[random.randrange(len(fitting))]
        held = np.array([row.bytes_for(choice) for row in problem.memory])
        improved = neighbourhood.improve(dict(choice), held)
        assert _fits(problem, improved)
        assert _cost(problem, improved) <= _cost(problem, choice) + 1e-9
        # what `improve` kept of the bytes each row holds is what the rows say
        assert held.tolist() == pytest.approx([row.bytes_for(improved) for row in problem.memory])


def test_the_repair_removes_bytes_where_they_cost_least_and_keeps_the_rest():
    # a and b each hold 4 bytes at strategy 0 and 1 at strategy 1; a's smaller strategy costs
    # 3, b's costs 1: a budget of 5 takes b's, c (on no row) keeps its cheapest strategy
    sizes = {"a": 2, "b": 2, "c": 2}
    linear = {"a": np.array([0.0, 3.0]), "b": np.array([0.0, 1.0]), "c": np.array([0.0, 2.0])}
    row = MemoryRow({"a": np.array([4.0, 1.0]), "b": np.array([4.0, 1.0])})
    problem = Problem(sizes, linear, {}, [row], 5.0)
    assert Neighbourhood(problem).repair({"a": 0, "b": 0, "c": 1}) == {"a": 0, "b": 1, "c": 0}


def test_a_choice_no_single_change_can_mend_is_left_to_the_solver():
    # the row needs a and b moved together (a pair buffer of 9 bytes unless both take 1)
    pair = np.array([[9.0, 9.0], [9.0, 0.0]])
    problem = Problem({"a": 2, "b": 2}, {}, {}, [MemoryRow({}, {("a", "b"): pair})], 4.0)
    assert Neighbourhood(problem).repair({"a": 0, "b": 0}) is None


def test_the_repair_never_steps_onto_a_forbidden_strategy():
    # b's cheap step leaves the row over; only a's forbidden strategy would then fit it
    linear = {"a": np.array([0.0, FORBIDDEN]), "b": np.array([0.0, 10.0])}
    row = MemoryRow({"a": np.array([2e9, 0.0]), "b": np.array([1e9, 5e8])})
    problem = Problem({"a": 2, "b": 2}, linear, {}, [row], 1.2e9)
    assert Neighbourhood(problem).repair({"a": 0, "b": 0}) is None
