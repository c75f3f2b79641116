"""Every operator the suites' `transformers` families call once lowered is on tessel's list.

A program calling an operator off the list (`tessel.lower.operators`) is refused as it is
lowered, so a family whose graph keeps one (XGLM's detached position table: `aten.detach`)
cannot be built at any device count. Each family of the differential suite, and each training
step of the training suite, is captured once and rank 0's program on 2 devices is lowered:
that program is what `tessel.lower.program.check` reads (DTensor's own ops and the collectives
included), and every operator it calls must be on the list. Rank 1's program differs from
rank 0's in offsets and groups, not in the operators it calls.
"""

from __future__ import annotations

import pytest
import torch
from tests.training.test_training import MODELS as TRAINED
from tests.training.test_training import _batches

from tessel.capture import CapturedModel, capture, capture_training
from tessel.config.cluster import local_cluster
from tessel.config.parallel_option import ParallelOption
from tessel.lower.operators import ALLOWED
from tessel.lower.program import ProgramError
from tessel.lower.trace import NotAsPlanned, lower_rank
from tessel.plan import has_rule
from tessel.plan.planner import make_plan

from .zoo import FAMILIES

DEVICES = 2


def _called(captured: CapturedModel) -> set[str]:
    """The operators rank 0's lowered program calls, or the words refusing one off the list."""
    cluster = local_cluster(DEVICES)
    try:
        try:
            program = lower_rank(captured, make_plan(captured, cluster, ParallelOption()), 0)
        except NotAsPlanned:  # the build's loop: the strategies DTensor cannot run dropped
            from tessel.builder.lowering import plan_and_lower

            program = plan_and_lower(captured, cluster)[1][0]
    except ProgramError as exc:
        return {str(exc)}
    return {n["target"] for n in program.program["nodes"] if n.get("op") == "call"}


def _unlisted(called: set[str]) -> list[str]:
    return sorted(called - ALLOWED - {"getitem"})


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_familys_lowered_program_calls_only_listed_operators(family):
    spec = FAMILIES[family]
    captured = capture(spec.make(), spec.inputs(1), keep=has_rule)
    assert _unlisted(_called(captured)) == []


@pytest.mark.parametrize("model", list(TRAINED))
def test_a_training_steps_lowered_program_calls_only_listed_operators(model):
    """The training suite's models captured as training steps: forward, loss and backward."""
    torch.manual_seed(0)
    captured = capture_training(TRAINED[model](), (), _batches(1)[0], keep=has_rule)
    assert _unlisted(_called(captured)) == []
