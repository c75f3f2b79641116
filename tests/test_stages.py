"""Pipeline stages: layers cut over the stages, activations sent between them, micro-batches."""

from __future__ import annotations

import itertools
import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import small_gpt2, small_llama, token_ids

import tessel
from tessel.capture import capture
from tessel.config import ConfigError, cluster_from_dict
from tessel.config.cluster import local_cluster_dict
from tessel.config.parallel_option import parallel_option_from_dict
from tessel.demo import tight_cluster
from tessel.package.format import BuiltPackage
from tessel.package.manifest import Mesh
from tessel.plan import PlanError, has_rule
from tessel.plan.stages import _cut, _least_heaviest
from tessel.report import format_plan, inspect_json
from tessel.runtime.inprocess import run_in_process


def policy(pp: int, tp: int = 1, dp: int = 1, micro: int | None = None):
    inner: dict = {
        "tensor_parallel_option": {"tensor_parallel_size": tp},
        "pipeline_parallel_option": {"pipe_stage_num": pp},
    }
    if micro is not None:
        inner["pipeline_parallel_option"]["micro_batch_num"] = micro
    if dp > 1:
        inner["data_parallel_option"] = {"data_parallel_size": dp}
    return parallel_option_from_dict({"graph_parallel_option": inner}, "policy.json")


def cluster(devices: int, memory: str | None = None):
    data = local_cluster_dict(devices)
    if memory is not None:
        data["item_def"][0]["memory"] = memory
    return cluster_from_dict(data, "cluster.json")


def _layers_of(names: list[str]) -> set[int]:
    return {int(n.split(".")[3]) for n in names if ".layers." in n or ".h." in n}


# (family, pp, tp, dp, micro-batches, tight memory): even and odd stage counts, stages with
# tensor parallelism on devices too small for a stage's replicated weights, replicas of a pipeline
CASES = [
    ("llama", 2, 2, 1, 2, True),
    ("gpt2", 3, 1, 1, 1, False),
    ("gpt2", 2, 2, 1, 4, True),
    ("llama", 2, 1, 2, 2, False),
]


@pytest.mark.parametrize(("family", "pp", "tp", "dp", "micro", "tight"), CASES)
def test_pipeline_stages_equal_eager(family, pp, tp, dp, micro, tight):
    torch.manual_seed(0)
    model = (small_llama if family == "llama" else small_gpt2)(layers=4)
    ids = token_ids(batch=4)
    memory = None
    if tight:  # half again what the whole model needs over all the devices
        rows = ids[: 4 // (dp * micro)]
        least = tight_cluster(capture(model, (rows,), keep=has_rule), pp * tp)["item_def"][0]
        memory = f"[DDR:{int(1.5 * int(least['memory'].removeprefix('[DDR:')[:-2]))}B]"
    built = tessel.build(
        model,
        (ids,),
        cluster=cluster(pp * tp * dp, memory),
        policy=policy(pp, tp, dp, micro),
        verify=True,
    )
    manifest = built.manifest
    assert manifest.plan.verify.max_relative_diff <= 1e-4
    assert manifest.mesh == Mesh((pp, dp, tp), ("pp", "dp", "tp"))
    stages = manifest.plan.stages
    assert [s.stage for s in stages] == list(range(pp))
    assert manifest.plan.micro_batches == micro
    # each stage's ranks take only the weights of their own layers (and the stage's ends)
    held = [_layers_of(sub.weight_order) for sub in manifest.submodels]
    for s, stage in enumerate(stages):
        for r in stage.ranks:
            assert held[r] and all(r // (dp * tp) == s for r in stage.ranks)
        others = set().union(*(held[r] for r in range(len(held)) if r not in stage.ranks))
        assert not held[stage.ranks[0]] & others
    if tight:  # a stage's devices share its layers' weights
        device = manifest.plan.memory.device_bytes
        ranks = inspect_json(manifest)["ranks"]
        assert max(r["peak_bytes"] for r in ranks) <= device
        assert all(any(c["axis"] == "tp" for c in r["collectives"]) for r in ranks)
    # other inputs than the example, through every rank in process
    x = token_ids(batch=4, seed=7)
    package = BuiltPackage(built.manifest, built.members)
    (out,) = run_in_process(package, [x])
    with torch.no_grad():
        assert (out - model(x)).abs().max().item() <= 1e-4


def test_stages_show_in_inspect():
    torch.manual_seed(0)
    built = tessel.build(
        small_llama(layers=4), (token_ids(batch=4),), cluster=4, policy=policy(2, tp=2, micro=2)
    )
    data = inspect_json(built.manifest)
    assert [s["ranks"] for s in data["stages"]] == [[0, 1], [2, 3]]
    sends = [c for c in data["ranks"][0]["collectives"] if c["axis"] == "pp"]
    assert sends and all(c["kind"] == "broadcast" and len(c["group"]) == 2 for c in sends)
    text = format_plan(built.manifest)
    assert "stage 0: lm.model.layers.0-1 on ranks 0, 1" in text
    assert "stage 1: lm.model.layers.2-3 on ranks 2, 3" in text


def test_an_encoder_decoder_is_cut_along_its_encoder_then_its_decoder():
    """T5's stages cut one chain: the encoder's 2 layers, then the decoder's 2, so 3 stages
    take an encoder layer, the other beside a decoder layer, and the last decoder layer; the
    built package equals eager (the build's check) and runs so."""
    from tests.differential.zoo import FAMILIES

    t5 = FAMILIES["t5"]
    model, inputs = t5.make(), t5.inputs(4)
    built = tessel.build(model, inputs, cluster=3, policy=policy(3))
    stages = built.manifest.plan.stages
    assert [line.layers for line in stages] == [
        "model.encoder.block.0-0",
        "model.encoder.block.1-1, model.decoder.block.0-0",
        "model.decoder.block.1-1",
    ]
    assert built.manifest.plan.verify.max_relative_diff <= 1e-4
    others = t5.inputs(4, seed=3)
    (out,) = run_in_process(BuiltPackage(built.manifest, built.members), list(others))
    with torch.no_grad():
        assert (out - model(*others)).abs().max().item() <= 1e-4


def test_more_stages_than_layers_is_refused():
    torch.manual_seed(0)
    with pytest.raises(ConfigError, match="pipe_stage_num: is 3, more than the model's 2 layers"):
        tessel.build(small_llama(layers=2), (token_ids(batch=3),), cluster=3, policy=policy(3))


def test_devices_too_small_for_the_stages_are_named_with_their_own_memory():
    """A pipeline is planned whole on one stage's devices with pp times their memory; a
    refusal still speaks of the devices as they are: about 1/pp of the least plan per device
    against each device's own bytes, never the multiplied figure."""
    torch.manual_seed(0)
    model, ids = small_llama(layers=4), token_ids(batch=2)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    small = weights // 4  # half of what each of 2 stages holds
    with pytest.raises(PlanError) as err:
        tessel.build(model, (ids,), cluster=cluster(2, f"[DDR:{small}B]"), policy=policy(2))
    message = str(err.value)
    assert message.startswith("the model does not fit 2 pipeline stages"), message
    has = re.search(r"the smallest device in cluster\.json has ([\d.]+) KiB", message)
    assert has and float(has.group(1)) * 1024 == pytest.approx(small, rel=1e-3), message
    about = re.search(r"about ([\d.]+) KiB per device for each of 2 stages", message)
    assert about and weights / 2 <= float(about.group(1)) * 1024 < weights, message


def test_micro_batches_must_divide_the_batch():
    torch.manual_seed(0)
    with pytest.raises(ConfigError, match="micro_batch_num: is 3, but the example inputs'"):
        tessel.build(
            small_llama(layers=2), (token_ids(batch=4),), cluster=2, policy=policy(2, micro=3)
        )


def test_micro_batches_without_stages_are_refused(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text(
        json.dumps({"graph_parallel_option": {"pipeline_parallel_option": {"micro_batch_num": 2}}})
    )
    with pytest.raises(ConfigError, match="micro_batch_num"):
        tessel.build(small_llama(layers=2), (token_ids(),), cluster=2, policy=str(path))


def _best_by_brute_force(seconds, held, pp, before, after, limit):
    n = len(seconds)
    best = None
    for bounds in itertools.combinations(range(1, n), pp - 1):
        edges = [0, *bounds, n]
        worst = 0.0
        for k in range(pp):
            a, b = edges[k], edges[k + 1]
            t, m = sum(seconds[a:b]), sum(held[a:b])
            if k == 0:
                t, m = t + before[0], m + before[1]
            if k == pp - 1:
                t, m = t + after[0], m + after[1]
            worst = max(worst, t if m <= limit else float("inf"))
        if best is None or worst < best:
            best = worst
    return best


@given(
    layers=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=7),
    pp=st.integers(1, 4),
    limit=st.integers(5, 40),
)
@settings(derandomize=True, max_examples=100, deadline=None)
def test_the_stage_cut_is_the_best_contiguous_cut(layers, pp, limit):
    """The dynamic programme finds a cut whose slowest stage is no slower than any other cut's,
    among those whose stages fit the memory limit, or says none fits."""
    if pp > len(layers):
        return
    seconds = [float(s) for s, _ in layers]
    held = [b for _, b in layers]
    before, after = (2.0, 3), (1.0, 2)
    cuts = _cut(seconds, held, pp, before, after, limit)
    best = _best_by_brute_force(seconds, held, pp, before, after, limit)
    if best == float("inf"):
        assert cuts is None
        return
    assert cuts is not None and len(cuts) == pp
    assert cuts[0][0] == 0 and cuts[-1][1] == len(layers)
    assert all(a < b for a, b in cuts) and all(x[1] == y[0] for x, y in zip(cuts, cuts[1:]))
    worst = 0.0
    for k, (a, b) in enumerate(cuts):
        t, m = sum(seconds[a:b]), sum(held[a:b])
        if k == 0:
            t, m = t + before[0], m + before[1]
        if k == pp - 1:
            t, m = t + after[0], m + after[1]
        assert m <= limit
        worst = max(worst, t)
    assert worst == pytest.approx(best)


@given(
    held=st.lists(st.integers(0, 9), min_size=1, max_size=7),
    pp=st.integers(1, 4),
    before=st.integers(0, 5),
    after=st.integers(0, 5),
)
@settings(derandomize=True, max_examples=100, deadline=None)
def test_the_least_heaviest_stage_is_the_least_memory_any_cut_fits(held, pp, before, after):
    """What a refused cut says a device lacks: the weights of the heaviest stage of the cut
    that makes it least, the least device memory at which the cut is found."""
    if pp > len(held):
        return
    seconds = [1.0] * len(held)
    heaviest = _least_heaviest(held, pp, before, after)
    assert _cut(seconds, held, pp, (0.0, before), (0.0, after), heaviest) is not None
    assert _cut(seconds, held, pp, (0.0, before), (0.0, after), heaviest - 1) is None


def test_a_pipeline_priced_before_lowering_pays_for_its_bubble():
    """What auto weighs a pipeline shape by: one micro-batch's work through every stage, then
    the slowest stage per further micro-batch, and the sends between them."""
    from tessel.builder.mesh_choice import first_devices, replica_batch
    from tessel.builder.stages import more_memory, pipeline_estimate
    from tessel.config.mesh import parallel_dims
    from tessel.plan import make_plan

    torch.manual_seed(0)
    model = small_llama(layers=4)
    args, kwargs = replica_batch((token_ids(batch=4),), {}, 1, "policy.json", 2)
    captured = capture(model, args, kwargs, keep=has_rule)
    whole = cluster(4)
    dims = parallel_dims(whole, policy(2, tp=2))
    plan = make_plan(captured, more_memory(first_devices(whole, 2), 2), policy(2, tp=2))
    one = pipeline_estimate(captured, plan, whole, dims, 1)
    two = pipeline_estimate(captured, plan, whole, dims, 2)
    assert plan.estimated_time < one < two < 2 * one


def test_the_planner_cuts_the_stages_before_the_plan_is_lowered(monkeypatch):
    """One pass down: each plan's stages are cut (plan.stages) before any rank is lowered, so
    a cut whose weights overflow the devices is refused without lowering a rank."""
    import tessel.builder.lowering as lowering
    from tessel.builder.lowering import plan_and_lower
    from tessel.builder.mesh_choice import first_devices
    from tessel.builder.stages import more_memory, stage_planner
    from tessel.config.mesh import parallel_dims
    from tessel.plan.stages import StageMemoryError

    captured = capture(small_llama(layers=4), (token_ids(batch=2),), keep=has_rule)
    lowered_with = []
    real = lowering.lower_every_rank

    def lower(captured, plan, world, reuse):
        lowered_with.append(plan.stages)
        return real(captured, plan, world, reuse)

    monkeypatch.setattr(lowering, "lower_every_rank", lower)
    whole = cluster(4)
    dims = parallel_dims(whole, policy(2, tp=2))
    plan, _ = plan_and_lower(
        captured,
        more_memory(first_devices(whole, 2), 2),
        policy(2, tp=2),
        stages=stage_planner(captured, whole, dims, "policy.json"),
    )
    assert lowered_with == [plan.stages] and plan.stages is not None
    assert [len(layers) for layers in plan.stages.layers] == [2, 2]
    # devices that hold less than half the weights of a stage: refused at the cut
    weights = sum(p.numel() * p.element_size() for p in small_llama(layers=4).parameters())
    small = cluster(4, f"[DDR:{weights // 8}B]")
    lowered_with.clear()
    with pytest.raises(StageMemoryError):
        plan_and_lower(
            captured,
            more_memory(first_devices(whole, 2), 2),
            policy(2, tp=2),
            stages=stage_planner(captured, small, dims, "policy.json"),
        )
    assert lowered_with == []
