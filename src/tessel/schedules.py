"""Pipeline schedules: the order in which each pipeline rank runs its stages' forward and
backward passes over the micro-batches.

One schedule serves both ways tessel trains in stages: a training package's stages (their passes
cut by `lower.training_stages`) and `tessel.parallel`'s `Pipeline` scripts (`parallel.pipeline`)
run in this order on the one runner, `runtime.pipeline_runner`. The
orders are torch's own (`Schedule1F1B`, `ScheduleGPipe`, `ScheduleInterleaved1F1B`,
`ScheduleLoopedBFS`) without their idle slots, so a run lays its micro-batches out as torch's
schedule of the same name would.

A pass hands later passes of the same micro-batch the tensors they read (`Handoff`): the next
stage's activations and the previous stage's gradients, and, where a stage reads what another
stage made or holds, that too.

Stages are placed looped: with `ranks` pipeline ranks and `stages` stages, rank r holds
stages r, r + ranks, r + 2 ranks, ... . With one stage per rank, "1f1b" runs a few forward
passes, then alternates one forward and one backward pass, holding at most `ranks - r`
micro-batches' activations; "gpipe" runs every forward pass, then every backward pass. With
several stages per rank, "1f1b" is interleaved 1F1B (depth first) and "gpipe" is looped
breadth-first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SCHEDULES = ("1f1b", "gpipe")

Phase = Literal["F", "B"]


@dataclass(frozen=True)
class Action:
    """One stage's forward ("F") or backward ("B") pass over one micro-batch."""

    phase: Phase
    stage: int
    micro_batch: int

    def __str__(self) -> str:  # torch's notation: 1F0 is stage 1's forward of micro-batch 0
        return f"{self.stage}{self.phase}{self.micro_batch}"


@dataclass(frozen=True)
class Handoff:
    """A tensor that one pass hands a later pass of the same micro-batch, as its shape and
    dtype name. `once`: the same tensor for every micro-batch (a weight another stage reads),
    handed over by the first micro-batch's passes alone and kept by the receiver for the step."""

    sender: tuple[Phase, int]  # (phase, stage)
    receiver: tuple[Phase, int]
    shape: tuple[int, ...]
    dtype: str
    once: bool = False

    def to_json(self) -> dict:
        return {
            "sender": list(self.sender),
            "receiver": list(self.receiver),
            "shape": list(self.shape),
            "dtype": self.dtype,
            "once": self.once,
        }


def pipeline_order(
    schedule: str, ranks: int, stages: int, micro_batches: int
) -> list[list[Action]]:
    """Each pipeline rank's actions in the order it runs them, rank by rank."""
    if schedule not in SCHEDULES:
        raise ValueError(f"a pipeline schedule is one of {list(SCHEDULES)}, found {schedule!r}")
    for name, value in (("ranks", ranks), ("stages", stages), ("micro_batches", micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"pipeline_order: {name} must be an int >= 1, found {value!r}")
    if stages % ranks:
        raise ValueError(
            f"pipeline_order: {stages} stages do not loop evenly over {ranks} pipeline ranks"
        )
    per_rank = stages // ranks
    if per_rank == 1:
        one = _one_f_one_b if schedule == "1f1b" else _gpipe
        return [one(ranks, r, micro_batches) for r in range(ranks)]
    if schedule == "gpipe":
        return [_looped_bfs(ranks, per_rank, r, micro_batches) for r in range(ranks)]
    rounds = max(1, micro_batches // ranks)
    if micro_batches % rounds:
        raise ValueError(
            f"interleaved 1F1B runs the micro-batches in rounds of {ranks} or more, and "
            f"{micro_batches} micro-batches do not make {rounds} equal rounds"
        )
    return [
        _interleaved(ranks, per_rank, r, micro_batches, micro_batches // rounds)
        for r in range(ranks)
    ]


def _one_f_one_b(ranks: int, rank: int, micro_batches: int) -> list[Action]:
    warm = min(ranks - 1 - rank, micro_batches)
    order = [Action("F", rank, k) for k in range(warm)]
    forward, backward = warm, 0
    while forward < micro_batches:
        order += [Action("F", rank, forward), Action("B", rank, backward)]
        forward, backward = forward + 1, backward + 1
    return order + [Action("B", rank, k) for k in range(backward, micro_batches)]


def _gpipe(ranks: int, rank: int, micro_batches: int) -> list[Action]:
    forward = [Action("F", rank, k) for k in range(micro_batches)]
    return forward + [Action("B", rank, k) for k in range(micro_batches)]


def _looped_bfs(ranks: int, per_rank: int, rank: int, micro_batches: int) -> list[Action]:
    held = [rank + i * ranks for i in range(per_rank)]
    forward = [Action("F", s, k) for s in held for k in range(micro_batches)]
    backward = [Action("B", s, k) for s in reversed(held) for k in reversed(range(micro_batches))]
    return forward + backward


def _interleaved(
    ranks: int, per_rank: int, rank: int, micro_batches: int, per_round: int
) -> list[Action]:
    """Interleaved 1F1B: forward passes walk the rank's stages a round of micro-batches at a
    time, first to last, and backward passes walk them last to first."""
    total = per_rank * micro_batches
    warm = min((per_rank - 1) * per_round + 2 * (ranks - 1 - rank), total)

    def forward_stage(op: int) -> int:
        return (op // per_round) % per_rank * ranks + rank

    def backward_stage(op: int) -> int:
        return (per_rank - 1 - ((op - warm) // per_round) % per_rank) * ranks + rank

    next_forward: dict[int, int] = {}
    next_backward: dict[int, int] = {}

    def take(phase: Phase, stage: int, counters: dict[int, int]) -> Action:
        k = counters.get(stage, 0)
        counters[stage] = k + 1
        return Action(phase, stage, k)

    order: list[Action] = []
    for op in range(total + warm):
        if op < total:
            order.append(take("F", forward_stage(op), next_forward))
        if op >= warm:
            order.append(take("B", backward_stage(op), next_backward))
    return order
