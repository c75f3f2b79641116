"""The pipeline schedule runner on real ranks: every pass runs in the schedule's order, each
gets the tensors its micro-batch's previous pass made (forward) or the gradients its next
stage made (backward), across ranks and between stages one rank holds.

The stages are a known chain: stage `s` maps `x` to `x * (s + 2) + k` for micro-batch `k`, and
hands on `k` itself as an integer tensor, which gets no gradient back; the last stage's
gradient is all ones. So what each pass receives is known in closed form, and a tensor that
went to the wrong stage or micro-batch shows. A second pipeline of three stages hands tensors
past a neighbour and a weight once per step (`_SKIPS`), with its receives posted when read or
all at the step's start.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests.conftest import start_ranks

from tessel.runtime.pipeline_runner import Boundary, PipelineRunner, handoffs_between
from tessel.schedules import Handoff, pipeline_order

SHAPE = (2, 3)
WORLD = 3


class _Chain:
    """The known chain of the module docstring; it records what every pass was given."""

    def __init__(self, stages: int) -> None:
        self.stages = stages
        self.given: dict[str, list[float]] = {}

    def forward(self, stage: int, k: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if stage == 0:
            x = torch.full(SHAPE, float(k + 1))
        else:
            x, index = inputs
            assert index.dtype == torch.int64 and int(index) == k, (stage, k, int(index))
        self.given[f"{stage}F{k}"] = x.flatten().tolist()
        if stage == self.stages - 1:
            return []
        return [x * (stage + 2) + k, torch.tensor(k)]

    def backward(self, stage: int, k: int, gradients: list[torch.Tensor]) -> list[torch.Tensor]:
        g = torch.ones(SHAPE) if stage == self.stages - 1 else gradients[0]
        if stage < self.stages - 1:
            assert len(gradients) == 1  # none for the integer tensor
        self.given[f"{stage}B{k}"] = g.flatten().tolist()
        return [] if stage == 0 else [g * (stage + 2)]


# three stages whose passes hand tensors past a neighbour, back from a forward pass to a later
# stage's backward pass, and a weight of stage 0 that stage 2 reads, handed over once per step
_SKIPS = [
    Handoff(("F", 0), ("F", 1), (1,), "float32"),  # a = k + 1
    Handoff(("F", 0), ("F", 2), (1,), "float32"),  # s = 10 (k + 1)
    Handoff(("F", 0), ("F", 2), (1,), "float32", once=True),  # w = 7 + k: sent for k = 0 alone
    Handoff(("F", 1), ("F", 2), (1,), "float32"),  # b = 2 a
    Handoff(("F", 2), ("B", 1), (1,), "float32"),  # g = b + s + w
    Handoff(("B", 2), ("B", 0), (1,), "float32"),  # h = k + 100
    Handoff(("B", 1), ("B", 0), (1,), "float32"),  # 3 g
]


class _Skips:
    """The passes of `_SKIPS`; it records what every pass was given."""

    def __init__(self) -> None:
        self.given: dict[str, list[float]] = {}

    def _made(self, name: str, k: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        self.given[name] = [float(x) for x in inputs]

        def one(v: float) -> torch.Tensor:
            return torch.tensor([float(v)])

        if name.startswith("0F"):
            return [one(k + 1), one(10 * (k + 1)), one(7 + k)]
        if name.startswith("1F"):
            return [2 * inputs[0]]
        if name.startswith("2F"):
            return [sum(inputs)]
        if name.startswith("2B"):
            return [one(k + 100)]
        if name.startswith("1B"):
            return [3 * inputs[0]]
        return []

    def forward(self, stage: int, k: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._made(f"{stage}F{k}", k, inputs)

    def backward(self, stage: int, k: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._made(f"{stage}B{k}", k, inputs)


def _expected_skips(micro_batches: int) -> dict[str, list[float]]:
    want = {}
    for k in range(micro_batches):
        g = 12 * (k + 1) + 7  # the weight as the first micro-batch handed it: 7
        want.update({f"0F{k}": [], f"1F{k}": [k + 1], f"2F{k}": [10 * (k + 1), 7, 2 * (k + 1)],
                     f"2B{k}": [], f"1B{k}": [g], f"0B{k}": [k + 100, 3 * g]})  # fmt: skip
    return want


def _expected(stages: int, micro_batches: int) -> dict[str, list[float]]:
    want = {}
    for k in range(micro_batches):
        x = float(k + 1)
        for s in range(stages):
            want[f"{s}F{k}"] = [x] * 6
            x = x * (s + 2) + k
        g = 1.0
        for s in reversed(range(stages)):
            want[f"{s}B{k}"] = [g] * 6
            g *= s + 2
    return want


def _run(rank: int, world: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world
    )
    boundary = Boundary((torch.empty(SHAPE, device="meta"), torch.empty((), dtype=torch.int64)))
    alone = [dist.new_group([r]) for r in range(world)]  # each rank its own pipeline
    pair = dist.new_group([0, 1])  # two ranks, each holding stages the other sends both ways
    out: dict = {}
    for name, schedule, ranks, stages, micro in (
        ("1f1b", "1f1b", 3, 3, 4),
        ("gpipe", "gpipe", 3, 3, 3),
        ("interleaved", "1f1b", 3, 6, 6),
        ("looped", "gpipe", 3, 6, 4),
        ("one_rank", "1f1b", 1, 3, 2),
        ("pair_interleaved", "1f1b", 2, 4, 4),
        ("pair_looped", "gpipe", 2, 6, 2),
    ):
        if ranks == 2 and rank == 2:
            continue
        group = {1: alone[rank], 2: pair, 3: None}[ranks]
        mine = 0 if ranks == 1 else rank
        actions = pipeline_order(schedule, ranks, stages, micro)[mine]
        runner = PipelineRunner(
            actions, stages, micro, handoffs_between([boundary] * (stages - 1), stages), lambda s, n=ranks: s % n,
            group, torch.device("cpu"),
        )  # fmt: skip
        chain = _Chain(stages)
        runner.step(chain)
        out[name] = {
            "ran": [str(a) for a in runner.ran],
            "order": [str(a) for a in actions],
            "given": chain.given,
        }
    for ahead in (False, True):
        actions = pipeline_order("1f1b", WORLD, WORLD, 3)[rank]
        runner = PipelineRunner(
            actions, WORLD, 3, _SKIPS, lambda s: s, None, torch.device("cpu"), receive_ahead=ahead
        )
        skips = _Skips()
        for _ in range(2):  # a second step: messages of one step never meet the other's
            runner.step(skips)
        out[f"skips_ahead{ahead}"] = {"ran": [str(a) for a in runner.ran],
                                      "order": [str(a) for a in actions], "given": skips.given}  # fmt: skip
    Path(folder, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("runner")
    start_ranks(_run, (WORLD, str(folder)), WORLD)
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize(
    "name, stages, micro",
    [
        ("1f1b", 3, 4),
        ("gpipe", 3, 3),
        ("interleaved", 6, 6),
        ("looped", 6, 4),
        ("one_rank", 3, 2),
        ("pair_interleaved", 4, 4),
        ("pair_looped", 6, 2),
    ],
)
def test_each_pass_runs_in_order_on_what_its_micro_batch_made(runs, name, stages, micro):
    want = _expected(stages, micro)
    seen: dict[str, list[float]] = {}
    for rank in runs:
        if name not in rank:
            continue
        got = rank[name]
        assert got["ran"] == got["order"]
        seen.update(got["given"])
    if name == "one_rank":  # every rank ran the whole pipeline alone
        assert all(r[name]["given"] == want for r in runs)
    assert seen == want


@pytest.mark.parametrize("ahead", [False, True], ids=["received_when_read", "received_ahead"])
def test_handoffs_skip_stages_and_a_weight_is_handed_over_once(runs, ahead):
    seen: dict[str, list[float]] = {}
    for rank in runs:
        got = rank[f"skips_ahead{ahead}"]
        assert got["ran"] == got["order"]
        seen.update(got["given"])
    assert seen == _expected_skips(3)


def test_a_runner_refuses_boundaries_that_do_not_join_its_stages():
    with pytest.raises(ValueError, match="3 stages have 2 boundaries, found 1"):
        handoffs_between([Boundary(())], 3)
