"""Plan quality: when replicated weights do not fit, shard them as well as Megatron does."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from tests.conftest import small_llama, token_ids

import tessel
from tessel.capture import capture
from tessel.config.cluster import cluster_from_dict, local_cluster, local_cluster_dict
from tessel.config.parallel_option import ParallelOption
from tessel.package.manifest import Manifest
from tessel.package.plan_report import Fallback
from tessel.plan import PlanError, has_rule, make_plan
from tessel.plan.planner import least_memory_plan
from tessel.units import human_bytes, two_sizes

N = 4
BATCH, SEQ, HIDDEN = 2, 32, 128


def _tight_build(layers: int):
    model = small_llama(layers=layers, hidden=HIDDEN, heads=4)
    ids = token_ids(BATCH, SEQ)
    captured = capture(model, (ids,), keep=has_rule)
    params = list(model.parameters())
    matrices = sum(p.numel() * 4 for p in params if p.dim() >= 2)
    vectors = sum(p.numel() * 4 for p in params if p.dim() < 2)
    vectors += sum(b.numel() * b.element_size() for b in model.buffers())
    peak, held = least_memory_plan(captured, 1)
    act = peak - held  # activations as one device holds them
    data = local_cluster_dict(N)
    budget = act + matrices / N + vectors + 4096
    data["item_def"][0]["memory"] = f"[DDR:{budget}B]"
    cluster = cluster_from_dict(data, "tight.json")
    assert cluster.devices[0].memory_bytes < act + matrices  # replicated weights cannot fit
    built = tessel.build(captured, cluster=cluster)
    return built, matrices, vectors


def _ring_volume(manifest: Manifest) -> int:
    """Bytes a rank sends, up to the common (n-1)/n factor: an all-reduce is a reduce-scatter
    plus an all-gather of the same tensor, so it counts twice."""
    ranks = manifest.plan.ranks
    return max(
        sum(c.bytes * (2 if c.kind == "all_reduce" else 1) for c in r.collectives) for r in ranks
    )


def test_tight_memory_shards_weights_and_communicates_no_more_than_megatron():
    two, matrices2, vectors2 = _tight_build(2)
    four, matrices4, vectors4 = _tight_build(4)
    for built, matrices, vectors in ((two, matrices2, vectors2), (four, matrices4, vectors4)):
        memory = built.manifest.plan.memory
        assert memory.peak_bytes <= memory.device_bytes
        for r in built.manifest.plan.ranks:
            assert r.weight_bytes < matrices + vectors, r  # some weights are sharded
    # Megatron: two all-reduces of batch x seq x hidden per layer (fp32), a vocabulary-sharded
    # embedding's all-reduce, and the vocabulary-sharded logits gathered at the end
    activation = BATCH * SEQ * HIDDEN * 4
    logits = BATCH * SEQ * 256 * 4
    for built, layers in ((two, 2), (four, 4)):
        megatron = layers * 2 * 2 * activation + 2 * activation + logits
        assert 0 < _ring_volume(built.manifest) <= megatron, layers
    # the layers share decisions: 4 layers need no more decisions than 2
    assert four.manifest.plan.solver.decisions == two.manifest.plan.solver.decisions


def test_impossible_memory_is_a_clear_error():
    model = small_llama(layers=1)
    ids = token_ids()
    data = local_cluster_dict(2)
    data["item_def"][0]["memory"] = "[DDR:1KB]"
    with pytest.raises(PlanError, match="does not fit"):
        make_plan(capture(model, (ids,)), cluster_from_dict(data, "tiny.json"), ParallelOption())


def test_devices_too_small_for_the_weights_alone_are_refused_without_a_search(monkeypatch):
    """Devices that cannot hold even every weight cut as finely as the mesh allows are refused
    at once (`auto` weighs such shapes too): no search for the least memory runs."""
    from tessel.demo import weight_bytes
    from tessel.plan import planner

    def searched(*args, **kwargs):
        raise AssertionError("the least-memory search ran")

    captured = capture(small_llama(layers=1), (token_ids(),), keep=has_rule)
    half = weight_bytes(captured) // 2  # no piece of a weight on 2 devices is smaller than half
    data = local_cluster_dict(2)
    data["item_def"][0]["memory"] = f"[DDR:{half - 1}B]"
    monkeypatch.setattr(planner, "least_memory_search", searched)
    with pytest.raises(PlanError) as refused:
        make_plan(captured, cluster_from_dict(data, "small.json"), ParallelOption())
    found = re.search(
        r"its weights alone, each cut as finely as a mesh of \[2\] devices allows, hold (.+?) "
        r"per device, but the smallest device in small.json has (.+?); the devices need more",
        str(refused.value),
    )
    assert found, str(refused.value)
    assert found[1] != found[2]
    monkeypatch.undo()  # with room for the weights, the search says what the plan needs
    data["item_def"][0]["memory"] = f"[DDR:{half + 1024}B]"
    with pytest.raises(PlanError, match="devices of at least .* would fit"):
        make_plan(captured, cluster_from_dict(data, "small.json"), ParallelOption())


def test_the_plan_says_which_solver_solved_it_and_why(monkeypatch):
    from tessel.plan import dp, planner

    captured = capture(small_llama(layers=1), (token_ids(),), keep=has_rule)
    plan = make_plan(captured, local_cluster(2), ParallelOption())
    assert plan.solver["method"] == "integer program (HiGHS)"
    assert plan.solver["fallback"] == ""
    # O2's program past its columns goes to O1 where elimination can afford it
    monkeypatch.setattr(planner, "ILP_MAX_VARIABLES", 0)
    plan = make_plan(captured, local_cluster(2), ParallelOption())
    assert plan.solver["fallback"].startswith("the integer program would have ")
    assert plan.solver["fallback"].endswith("columns (more than 0): solved by dynamic programming")
    assert plan.solver["method"] == "dynamic programming"
    # and stays with the integer program where it cannot (never handed there and back)
    monkeypatch.setattr(dp, "MAX_TABLE", 2)
    plan = make_plan(captured, local_cluster(2), ParallelOption())
    assert (plan.solver["method"], plan.solver["fallback"]) == ("integer program (HiGHS)", "")
    # O1 asked for past its width: the integer program, said so
    plan = make_plan(captured, local_cluster(2), ParallelOption(opt_level="O1"))
    fallback = plan.solver["fallback"]
    assert fallback.startswith("dynamic programming would cost too much")
    assert fallback.endswith("solved by the integer program (HiGHS, time limit 60 s)")
    assert plan.solver["method"] == "integer program (HiGHS)"


def test_a_plan_ruled_out_by_moves_alone_is_not_called_a_memory_failure(monkeypatch):
    """Where no plan avoids a forbidden move before memory is even priced, the error says so,
    never "does not fit" (more memory would not help)."""
    from tessel.plan import planner

    captured = capture(small_llama(layers=1), (token_ids(),), keep=has_rule)
    monkeypatch.setattr(planner, "_partials_clash", lambda src, dst: True)  # every move
    with pytest.raises(PlanError) as err:
        make_plan(captured, local_cluster(2), ParallelOption())
    assert "avoids a strategy or a move no plan may take" in str(err.value)
    assert "does not fit" not in str(err.value) and err.value.least is None


def test_a_plan_the_clock_cut_short_says_so(monkeypatch):
    """A search that ends at its time limit depends on the machine's speed: the plan says so
    (HiGHS's answers marked as out of time here, so the test does not hang on the clock), and
    a solver that finds nothing in its time is not called infeasible."""
    from tessel.plan import ilp

    captured = capture(small_llama(layers=1), (token_ids(),), keep=has_rule)
    real = ilp.milp

    def out_of_time(*args, **kwargs):
        result = real(*args, **kwargs)
        result.status = 1  # scipy's "a limit was reached", the answer kept
        return result

    monkeypatch.setattr(ilp, "milp", out_of_time)
    plan = make_plan(captured, local_cluster(2), ParallelOption(), time_limit=7)
    assert "the search stopped at its time limit (7 s)" in plan.solver["fallback"]

    def nothing(*args, **kwargs):
        result = real(*args, **kwargs)
        result.status, result.x = 1, None  # out of time before any answer
        return result

    monkeypatch.setattr(ilp, "milp", nothing)
    with pytest.raises(PlanError, match="found no plan at all in its time .*longer time_limit"):
        make_plan(captured, local_cluster(2), ParallelOption(), time_limit=0.01)


def test_a_refusal_by_a_byte_gives_two_different_sizes():
    captured = capture(small_llama(layers=1), (token_ids(),), keep=has_rule)
    need, _ = least_memory_plan(captured, 2, gap=0.0)
    data = local_cluster_dict(2)
    data["item_def"][0]["memory"] = f"[DDR:{need - 1}B]"  # one byte short
    with pytest.raises(PlanError) as refused:
        make_plan(captured, cluster_from_dict(data, "close.json"), ParallelOption())
    found = re.search(
        r"holds (.+?) per device.* has (.+?); devices of at least (.+?) would fit",
        str(refused.value),
    )
    assert found, str(refused.value)
    holds, has, at_least = found.groups()
    assert human_bytes(need) == human_bytes(need - 1)  # two decimals read alike
    assert holds != has and at_least == holds
    assert (holds, has) == two_sizes(need, need - 1)


def test_a_search_for_least_memory_the_clock_stopped_never_says_the_model_does_not_fit(
    monkeypatch,
):
    """Where no plan that fits was found and the search for the least memory stopped at its
    time limit with its bound below the devices, whether the model fits is not known: the
    error says the time ran out (a longer time limit may find a plan), not "does not fit"."""
    from tessel.plan import PlanOutOfTime, ilp

    captured = capture(small_llama(layers=1), (token_ids(),), keep=has_rule)
    need, _ = least_memory_plan(captured, 2, gap=0.0)
    data = local_cluster_dict(2)
    data["item_def"][0]["memory"] = f"[DDR:{need - 1}B]"  # one byte short: nothing fits
    cluster = cluster_from_dict(data, "close.json")
    real = ilp.milp

    def stopped(c, *args, **kwargs):
        result = real(c, *args, **kwargs)
        if c[-1] == 1.0 and not np.any(c[:-1]):  # a search for the least memory
            result.status, result.mip_dual_bound = 1, 0.0  # stopped by the clock, unproven
        return result

    monkeypatch.setattr(ilp, "milp", stopped)
    with pytest.raises(PlanOutOfTime, match="nor showed that none does.*longer time_limit") as cut:
        make_plan(captured, cluster, ParallelOption())
    assert "does not fit" not in str(cut.value) and cut.value.least is None
    monkeypatch.setattr(ilp, "milp", real)  # the search ends on its own: it does not fit
    with pytest.raises(PlanError, match="does not fit") as proven:
        make_plan(captured, cluster, ParallelOption())
    assert not isinstance(proven.value, PlanOutOfTime) and proven.value.least is not None


def test_plan_explains_layers_and_reports_no_fallback_for_a_llama():
    model = small_llama(layers=2)
    built = tessel.build(model, (token_ids(),), cluster=2)
    plan = built.manifest.plan
    assert plan.fallbacks == ()  # every op of a Llama has a sharding rule
    assert plan.fallback_ops == {}
    assert "lm.model.layers.0" in plan.layers and "lm.model.layers.1" in plan.layers
    assert plan.estimated_time_s > 0


class _Bucketed(torch.nn.Module):
    """A linear layer whose output is multiplied by its bucket index: `searchsorted` has no
    DTensor sharding rule, so the planner replicates it and reports it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("edges", torch.linspace(-1, 1, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h * torch.searchsorted(self.edges, h.contiguous())


def test_plan_reports_an_op_without_a_rule_as_a_fallback():
    torch.manual_seed(0)
    model = _Bucketed().eval()
    x = torch.randn(4, 8)
    built = tessel.build(model, (x,), cluster=2)  # verified against the eager model
    plan = built.manifest.plan
    assert plan.fallbacks == (
        Fallback("searchsorted", "aten.searchsorted.Tensor", "no DTensor sharding rule"),
    )
    assert plan.fallback_ops == {"aten.searchsorted.Tensor": 1}


class _SumOfAll(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        # an empty dim list sums every dim; DTensor's rule keeps the input's Shard for it
        return torch.ops.aten.sum.dim_IntList(h, []) * h


def test_a_strategy_sharding_a_dim_its_value_lacks_is_not_planned():
    torch.manual_seed(0)
    built = tessel.build(_SumOfAll().eval(), (torch.randn(4, 8),), cluster=2)  # checks eager
    assert built.manifest.plan.fallbacks == ()


def test_a_program_over_its_device_is_planned_again_keeping_memory_free(monkeypatch):
    """A lowered program that holds more than its device (buffers the memory model does not
    see) makes the planner keep memory free and plan again; the plan says so."""
    from dataclasses import replace

    from tessel.builder import lowering
    from tessel.config.cluster import local_cluster

    torch.manual_seed(0)
    captured = capture(small_llama(), (token_ids(),), keep=has_rule)
    cluster = local_cluster(2)
    device = cluster.devices[0].memory_bytes
    lower_all, calls = lowering.lower_every_rank, []

    def first_program_overflows(*args, **kwargs):
        programs = lower_all(*args, **kwargs)
        calls.append(len(programs))
        if len(calls) == 1:
            programs = [replace(p, peak_bytes=device + 1000) for p in programs]
        return programs

    monkeypatch.setattr(lowering, "lower_every_rank", first_program_overflows)
    plan, _ = lowering.plan_and_lower(captured, cluster)
    assert len(calls) == 2
    (memory,) = [r for r in plan.replanned if r["node"] == "(memory)"]
    kept = int(memory["strategy"].removeprefix("keep ").removesuffix(" bytes free"))
    assert 1000 <= kept <= device  # past the overflow, at most all the program holds


def test_fixed_placements_are_kept_and_the_rest_planned_around_them():
    model = small_llama(layers=2, hidden=HIDDEN, heads=4)
    captured = capture(model, (token_ids(BATCH, SEQ),), keep=has_rule)
    cluster = cluster_from_dict(local_cluster_dict(N), "c.json")
    down = "lm.model.layers.0.mlp.down_proj.weight"
    plan = make_plan(captured, cluster, ParallelOption(fixed_placements=((down, ("S(0)",)),)))
    placed = {fqn: tuple(map(str, p)) for fqn, p in plan.param_placements().items()}
    assert placed[down] == ("S(0)",)
    # identical layers are placed alike: the second layer's weight follows the first's
    assert placed["lm.model.layers.1.mlp.down_proj.weight"] == ("S(0)",)
    free = make_plan(captured, cluster, ParallelOption())
    assert tuple(map(str, free.param_placements()[down])) != ("S(0)",)  # the pin changed it


@pytest.mark.parametrize(
    "fixed, match",
    [
        ((("lm.model.layers.0.mlp.nope", ("R",)),), "weights the model does not have"),
        ((("lm.model.layers.0.mlp.down_proj.weight", ("S(2)",)),), "is not one of the mesh's"),
        (
            (
                ("lm.model.layers.0.mlp.down_proj.weight", ("S(0)",)),
                ("lm.model.layers.1.mlp.down_proj.weight", ("S(1)",)),
            ),
            "identical layers are placed alike",
        ),
    ],
)
def test_fixed_placements_the_planner_cannot_keep_are_refused(fixed, match):
    model = small_llama(layers=2, hidden=HIDDEN, heads=4)
    captured = capture(model, (token_ids(BATCH, SEQ),), keep=has_rule)
    cluster = cluster_from_dict(local_cluster_dict(N), "c.json")
    with pytest.raises(PlanError, match=match):
        make_plan(captured, cluster, ParallelOption(fixed_placements=fixed))


def test_why_a_weight_is_replicated_is_the_planners_own_estimate():
    """Each replicated weight's estimate is the best plan sharding it, re-solved around it with
    the rest as chosen: never below what a global re-solve finds, on a Llama equal to it
    within the solver's gap. Buffers and weights the policy places say so."""
    from torch.distributed.tensor import Shard

    from tessel.plan import ilp
    from tessel.plan.problem import Problem
    from tessel.plan.why import replicated_weights, summary

    captured = capture(small_llama(layers=1), (token_ids(),), keep=has_rule)
    cluster = cluster_from_dict(local_cluster_dict(2), "c.json")
    norm = "lm.model.norm.weight"
    plan = make_plan(captured, cluster, ParallelOption(fixed_placements=((norm, ("R",)),)))
    why = replicated_weights(plan)
    assert why[norm].reason == "fixed"
    assert why["lm.model.rotary_emb.inv_freq"].reason == "buffer"
    timed = {fqn: r for fqn, r in why.items() if r.reason == "faster"}
    assert len(timed) >= 5
    placeholders = {n.name: n for n in plan.choices}
    gap = ilp.MIP_GAP * plan.estimated_time
    for fqn in (
        "lm.model.layers.0.mlp.up_proj.weight",
        "lm.model.layers.0.self_attn.o_proj.weight",
    ):
        r = timed[fqn]
        assert r.slower_s > 0 and r.sharded_fits and any(p.startswith("S(") for p in r.sharded)
        # the same problem solved whole with that weight kept off replicas
        (name,) = [n for n, f in plan.param_targets.items() if f == fqn]
        owner = plan.choices[placeholders[name]].owner or placeholders[name]
        problem = plan.problem
        strategies = plan.choices[owner].strategies
        off = np.array(
            [0.0 if isinstance(s.output.placements[0], Shard) else 1.0 for s in strategies]
        )
        linear = dict(problem.linear)
        linear[owner] = linear.get(owner, np.zeros(len(strategies))) + off
        forced = Problem(
            problem.sizes, linear, problem.pairs, problem.memory, problem.memory_budget
        )
        best = ilp.solve(forced).objective - plan.estimated_time
        assert best - gap <= r.slower_s <= best + gap, (fqn, r.slower_s, best)
    line = summary(plan, why, len(plan.param_targets))
    assert line is not None and line.startswith("tensor parallel over 2 devices: ")
    assert f"{len(why)} of {len(plan.param_targets)} weights replicated" in line


def test_a_caller_that_only_asks_whether_a_plan_fits_is_not_told_by_how_much(monkeypatch):
    """`explain=False` (the fitting loops' bisections, the decode gear tried first): a model
    that does not fit is refused at once, without the least-memory searches that say by how
    much; without it the same model gets the full refusal."""
    from tessel.plan import planner

    captured = capture(small_llama(layers=1), (token_ids(),), keep=has_rule)
    need, _ = least_memory_plan(captured, 2, gap=0.0)
    data = local_cluster_dict(2)
    data["item_def"][0]["memory"] = f"[DDR:{need - 1}B]"  # one byte short: nothing fits
    cluster = cluster_from_dict(data, "close.json")
    real = planner.least_memory_search
    searches = []

    def counted(*args, **kwargs):
        searches.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "least_memory_search", counted)
    with pytest.raises(PlanError, match="no plan fits devices of") as asked:
        make_plan(captured, cluster, ParallelOption(), explain=False)
    assert asked.value.least is None and searches == []
    with pytest.raises(PlanError, match="does not fit") as explained:
        make_plan(captured, cluster, ParallelOption())
    assert explained.value.least is not None and searches
