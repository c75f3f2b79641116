"""Lowering ranks in forked children: the programs are the ones this process lowers, a child
that fails has its rank lowered here (so its error is the serial build's), and no child is
left behind, whichever side fails."""

from __future__ import annotations

import os
import threading

import psutil
import pytest
import torch
from tests.conftest import small_llama, token_ids

import tessel.lower.in_parallel as in_parallel
from tessel.capture import capture
from tessel.config.cluster import local_cluster
from tessel.config.parallel_option import ParallelOption
from tessel.lower.in_parallel import lower_ranks
from tessel.lower.trace import RankProgram, lower_rank
from tessel.plan import has_rule, make_plan

SPARE_CORES = in_parallel._spare_cores


@pytest.fixture(autouse=True)
def spare_cores(monkeypatch):
    """Two children at a time, whatever this machine has."""
    monkeypatch.setattr(in_parallel, "_spare_cores", lambda: 2)


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children()}


def _by_pid(rank: int) -> RankProgram:
    """A program that says which process lowered it."""
    constants = {"c": torch.arange(rank + 1, dtype=torch.float32)}
    return RankProgram({"rank": rank, "pid": os.getpid()}, constants, {"x": ([rank], "f32")}, rank)


def test_ranks_past_the_first_are_lowered_in_children_and_come_back_whole():
    got = lower_ranks(_by_pid, [4, 0, 2, 1, 3])
    assert [p.program["rank"] for p in got] == [4, 0, 2, 1, 3]
    assert got[0].program["pid"] == os.getpid()
    others = {p.program["pid"] for p in got[1:]}
    assert os.getpid() not in others and len(others) == 4  # one child per rank
    for p in got:
        rank = p.program["rank"]
        assert torch.equal(p.constants["c"], torch.arange(rank + 1, dtype=torch.float32))
        assert p.shapes == {"x": ([rank], "f32")} and p.weight_bytes == rank


def test_a_failing_child_has_its_rank_lowered_here():
    parent = os.getpid()

    def only_here(rank: int) -> RankProgram:
        if os.getpid() != parent:
            raise RuntimeError("a child's failure")
        return _by_pid(rank)

    got = lower_ranks(only_here, [0, 1, 2])
    assert [p.program["pid"] for p in got] == [parent] * 3


def test_the_error_is_the_one_lowering_here_raises_and_no_child_is_left():
    def fails_at_two(rank: int) -> RankProgram:
        if rank == 2:
            raise ValueError("rank 2 cannot be lowered")
        return _by_pid(rank)

    before = _children()
    with pytest.raises(ValueError, match="rank 2 cannot be lowered"):
        lower_ranks(fails_at_two, [0, 1, 2])
    assert _children() == before


def test_children_are_stopped_when_this_process_fails_first():
    before, started = _children(), set()

    def slow_children(rank: int) -> RankProgram:
        if rank == 0:
            started.update(_children() - before)
            raise KeyboardInterrupt  # as Ctrl-C arrives while this process lowers its rank
        os.pause()  # until stopped
        return _by_pid(rank)

    with pytest.raises(KeyboardInterrupt):
        lower_ranks(slow_children, [0, 1, 2])
    assert len(started) == 2
    assert _children() == before


def test_a_child_that_never_finishes_is_stopped_and_its_rank_lowered_here(monkeypatch):
    # a child stuck on a lock another thread held at the fork: after the patience it is
    # stopped, and its rank lowered here
    monkeypatch.setattr(in_parallel, "PATIENCE_FLOOR_S", 0.0)
    monkeypatch.setattr(in_parallel, "PATIENCE_FACTOR", 0.0)
    parent, before = os.getpid(), _children()

    def stuck_in_children(rank: int) -> RankProgram:
        if os.getpid() != parent:
            os.pause()
        return _by_pid(rank)

    got = lower_ranks(stuck_in_children, [0, 1])
    assert [p.program["pid"] for p in got] == [parent, parent]
    assert _children() == before


def test_one_core_lowers_every_rank_here(monkeypatch):
    monkeypatch.setattr(in_parallel, "_spare_cores", lambda: 0)
    assert {p.program["pid"] for p in lower_ranks(_by_pid, [0, 1, 2])} == {os.getpid()}


def test_a_traced_program_from_a_child_equals_the_one_traced_here():
    # three ranks of a Llama with uneven shards (the last rank's differ)
    captured = capture(small_llama(), (token_ids(),), keep=has_rule)
    plan = make_plan(captured, local_cluster(3), ParallelOption())
    here = [lower_rank(captured, plan, r) for r in range(3)]
    forked = lower_ranks(lambda r: lower_rank(captured, plan, r), range(3))
    for a, b in zip(here, forked):
        assert a.program == b.program and a.shapes == b.shapes
        assert (a.weight_bytes, a.peak_bytes) == (b.weight_bytes, b.peak_bytes)
        assert a.constants.keys() == b.constants.keys()
        for k in a.constants:
            assert torch.equal(a.constants[k], b.constants[k])


def test_a_child_runs_torch_after_this_process_ran_it_on_several_threads():
    # the OpenMP team this process started is not in the child: the child must not wait for it
    torch.ones(1 << 22).mul_(2)  # big enough to run on every intra-op thread

    def big_copy(rank: int) -> RankProgram:
        torch.ones(1 << 22).t().contiguous().clone().add_(1)
        return _by_pid(rank)

    got = lower_ranks(big_copy, [0, 1])
    assert got[1].program["pid"] != os.getpid()  # the child finished on its own


def test_no_child_is_forked_while_another_thread_runs():
    # the other thread might hold a lock at the fork that the child would wait on for ever
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert SPARE_CORES() == 0
    finally:
        release.set()
        other.join()
    if threading.active_count() == 1:  # not under a test runner's own threads
        assert SPARE_CORES() == len(os.sched_getaffinity(0)) - 1
