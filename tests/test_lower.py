"""Lowering: ranks may share one traced program only where tracing each would give that program."""

from __future__ import annotations

import pytest
from tests.conftest import small_gpt2, small_llama, token_ids

from tessel.builder.pipeline import _lower_all
from tessel.capture import capture
from tessel.config.cluster import local_cluster
from tessel.config.parallel_option import ParallelOption
from tessel.lower.trace import lower_rank
from tessel.plan import make_plan

N = 4


@pytest.mark.parametrize("make", [small_llama, small_gpt2], ids=["llama", "gpt2"])
def test_every_rank_gets_the_program_tracing_it_alone_gives(make):
    captured = capture(make(), (token_ids(),))
    plan = make_plan(captured, local_cluster(N, "cpu"), ParallelOption(), 60)
    programs = _lower_all(captured, plan, N)
    assert len(programs) == N
    for rank, got in enumerate(programs):
        alone = lower_rank(captured, plan, rank)
        assert got.program == alone.program, f"rank {rank}"
        assert got.constants.keys() == alone.constants.keys()
