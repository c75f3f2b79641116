"""Pipeline schedules: every order runs each pass once, never stalls, holds few micro-batches,
and lays the passes out as torch's schedule of the same name."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

from tessel.schedules import Action, pipeline_order

SHAPES = [(p, v, m) for p in range(1, 6) for v in (1, 2, 3) for m in range(1, 11)]


def torch_order(
    schedule: str, ranks: int, per_rank: int, micro_batches: int, rank: int
) -> list[str]:
    """Rank `rank`'s forward and backward passes as torch's schedule lays them out (its idle
    slots and gradient reductions left out), read from the schedule's own plan of the order."""
    if per_rank == 1:
        cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        ops = cls._get_pipeline_order(
            SimpleNamespace(_num_stages=ranks, _n_microbatches=micro_batches)
        )[rank]
    elif schedule == "gpipe":
        state = SimpleNamespace(
            pp_group_size=ranks, _stages=[None] * per_rank, _n_microbatches=micro_batches
        )
        ops = ScheduleLoopedBFS._calculate_single_rank_operations(state, rank)
    else:
        rounds = max(1, micro_batches // ranks)
        state = SimpleNamespace(
            pp_group_size=ranks, n_local_stages=per_rank, _n_microbatches=micro_batches,
            number_of_rounds=rounds, microbatches_per_round=micro_batches // rounds,
        )  # fmt: skip
        ops = ScheduleInterleaved1F1B._calculate_single_rank_operations(state, rank)
    return [str(a) for a in ops if a is not None and a.computation_type.value in "FB"]


def check_order(order: Sequence[Sequence[Action]], stages: int, micro_batches: int) -> None:
    """Raise ValueError unless `order` runs each stage's forward and backward pass of every
    micro-batch once, and the ranks, each running its actions in turn, all finish: a forward
    pass waits for the stage before's, a backward pass for the stage after's (the last
    stage's for its own forward pass)."""
    every = {Action(p, s, k) for p in "FB" for s in range(stages) for k in range(micro_batches)}
    listed = [a for actions in order for a in actions]
    if len(listed) != len(every) or set(listed) != every:
        raise ValueError("a pipeline order must run every stage's F and B of each micro-batch once")
    done: set[Action] = set()
    place = [0] * len(order)

    def ready(a: Action) -> bool:
        if a.phase == "F":
            return a.stage == 0 or Action("F", a.stage - 1, a.micro_batch) in done
        after = a.stage + 1 if a.stage < stages - 1 else a.stage
        return Action("F" if after == a.stage else "B", after, a.micro_batch) in done

    progressed = True
    while progressed:
        progressed = False
        for r, actions in enumerate(order):
            while place[r] < len(actions) and ready(actions[place[r]]):
                done.add(actions[place[r]])
                place[r] += 1
                progressed = True
    stuck = [
        f"rank {r} at {actions[place[r]]}"
        for r, actions in enumerate(order)
        if place[r] < len(actions)
    ]
    if stuck:
        raise ValueError(f"the pipeline ranks wait on each other: {', '.join(stuck)}")


def held_micro_batches(actions: Sequence[Action], stage: int) -> int:
    """The most micro-batches whose activations `stage` holds at once under `actions`."""
    held = peak = 0
    for a in actions:
        if a.stage == stage:
            held += 1 if a.phase == "F" else -1
            peak = max(peak, held)
    return peak


def _valid(schedule: str, p: int, v: int, m: int) -> bool:
    if schedule == "1f1b" and v > 1:
        return m % max(1, m // p) == 0
    return True


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_every_order_runs_each_pass_once_and_the_ranks_never_wait_on_each_other(schedule):
    for p, v, m in SHAPES:
        if not _valid(schedule, p, v, m):
            continue
        order = pipeline_order(schedule, p, p * v, m)
        assert len(order) == p
        check_order(order, p * v, m)
        for r, actions in enumerate(order):
            assert {a.stage for a in actions} == set(range(r, p * v, p))
            for a in actions:
                if a.phase == "B":
                    assert actions.index(Action("F", a.stage, a.micro_batch)) < actions.index(a)


def test_one_f_one_b_holds_at_most_the_stages_after_it():
    for p, _, m in SHAPES:
        order = pipeline_order("1f1b", p, p, m)
        for s in range(p):
            assert held_micro_batches(order[s], s) == min(p - s, m)
        # GPipe holds every micro-batch
        assert held_micro_batches(pipeline_order("gpipe", p, p, m)[0], 0) == m


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_orders_are_torchs(schedule):
    for p, v, m in SHAPES:
        if not _valid(schedule, p, v, m) or (schedule == "1f1b" and v == 1 and m < p):
            continue
        order = pipeline_order(schedule, p, p * v, m)
        # torch's plan of Schedule1F1B skips the last rank's first micro-batch (its runtime
        # does not follow that plan): the last rank is compared where the plan is whole
        ranks = range(p - 1) if schedule == "1f1b" and v == 1 else range(p)
        for r in ranks:
            assert [str(a) for a in order[r]] == torch_order(schedule, p, v, m, r), (p, v, m, r)
    last = pipeline_order("1f1b", 3, 3, 4)[2]
    assert [str(a) for a in last] == ["2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3"]


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="one of \\['1f1b', 'gpipe'\\], found 'zb'"):
        pipeline_order("zb", 2, 2, 4)
    with pytest.raises(ValueError, match="micro_batches must be an int >= 1, found 0"):
        pipeline_order("1f1b", 2, 2, 0)
    with pytest.raises(ValueError, match="5 stages do not loop evenly over 2"):
        pipeline_order("1f1b", 2, 5, 4)
    with pytest.raises(ValueError, match="7 micro-batches do not make 3 equal rounds"):
        pipeline_order("1f1b", 2, 4, 7)
    with pytest.raises(ValueError, match="wait on each other: rank 0 at 0B0"):
        check_order(
            [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 1, 0), Action("B", 1, 0)]], 2, 1
        )
    with pytest.raises(ValueError, match="once"):
        check_order([[Action("F", 0, 0)]], 1, 1)
