"""The device mesh from the cluster config and the policy: axis sizes, links, CANN's EF1012."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tests.conftest import hf_llama, small_llama, token_ids

import tessel
from tessel.capture import capture
from tessel.config import ClusterConfig, ConfigError, cluster_from_dict
from tessel.config.cluster import local_cluster_dict
from tessel.config.mesh import parallel_dims
from tessel.config.parallel_option import parallel_option_from_dict
from tessel.demo import tight_cluster, weight_bytes
from tessel.package.manifest import Mesh
from tessel.package.plan_report import ShapeWeighed
from tessel.plan import has_rule
from tessel.report import format_plan


def two_nodes(devices_per_node: int = 4, memory: int | None = None) -> ClusterConfig:
    """Two nodes of devices (of `memory` bytes where given) linked by HCCS 392Gb, the nodes by
    RDMA 25Gb."""
    data = local_cluster_dict(devices_per_node)
    if memory is not None:
        data["item_def"][0]["memory"] = f"[DDR:{memory}B]"
    first = data["cluster"][0]["cluster_nodes"][0]
    second = {**first, "node_id": 1, "ipaddr": "127.0.0.2", "is_local": False}
    data["cluster"][0]["cluster_nodes"].append(second)
    data["cluster"][0]["nodes_topology"] = {
        "type": "star",
        "protocol": "RDMA:25Gb",
        "topos": [{"plane_id": 0, "devices": [0, 1]}],
    }
    data["node_def"] = [{"node_type": "LOCAL", "item_topology": [{"links_mode": "HCCS:392Gb"}]}]
    return cluster_from_dict(data, "two_nodes.json")


def policy(**sizes: int):
    inner = {}
    if "tp" in sizes:
        inner["tensor_parallel_option"] = {"tensor_parallel_size": sizes["tp"]}
    if "dp" in sizes:
        inner["data_parallel_option"] = {"data_parallel_size": sizes["dp"]}
    if "pp" in sizes:
        inner["pipeline_parallel_option"] = {"pipe_stage_num": sizes["pp"]}
    return parallel_option_from_dict({"graph_parallel_option": inner}, "policy.json")


def test_a_policy_that_sets_nothing_is_one_tensor_parallel_axis():
    dims = parallel_dims(two_nodes(), policy())
    assert dims.shape == (1, 1, 8) and dims.world_size == 8
    assert dims.groups("tp") == [tuple(range(8))]


def test_tensor_parallel_over_nodes_of_devices_is_meshed_nodes_by_devices():
    from tessel.builder.mesh_choice import first_devices
    from tessel.config.mesh import MeshAxis, tensor_axes

    cluster = two_nodes()
    assert tensor_axes(cluster) == (
        MeshAxis("tp_node", 2, cluster.network_bandwidth),
        MeshAxis("tp", 4, cluster.link_bandwidth),
    )
    # within one node, or over nodes of one device each: one axis on the slowest link
    assert tensor_axes(first_devices(cluster, 4)) == (MeshAxis("tp", 4, cluster.link_bandwidth),)
    single = two_nodes(1)
    assert tensor_axes(single) == (MeshAxis("tp", 2, single.network_bandwidth),)


def test_tensor_parallel_stays_in_a_node_and_data_parallel_crosses():
    cluster = two_nodes()
    dims = parallel_dims(cluster, policy(tp=4, dp=2))
    assert dims.shape == (1, 2, 4)
    assert dims.groups("tp") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert dims.groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert dims.axis("tp").bandwidth == cluster.link_bandwidth
    assert dims.axis("dp").bandwidth == cluster.network_bandwidth
    assert dims.coordinate(6) == {"pp": 0, "dp": 1, "tp": 2}


def test_stages_are_the_outermost_axis():
    dims = parallel_dims(two_nodes(), policy(tp=4, pp=2))
    assert dims.shape == (2, 1, 4)
    assert dims.groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert dims.coordinate(5) == {"pp": 1, "dp": 0, "tp": 1}


@pytest.mark.parametrize(
    "sizes, words",
    [
        ({"tp": 4, "dp": 4}, "tensor_parallel_size 4 x data_parallel_size 4 is 16 but the cluster"),
        ({"tp": 3}, "tensor_parallel_size: is 3 but the cluster config has 8 devices"),
        ({"dp": 2, "pp": 2}, "data_parallel_size 2 x pipe_stage_num 2 is 4"),
        ({"pp": 3}, "pipe_stage_num: is 3, which does not divide the cluster's 8 devices"),
    ],
)
def test_sizes_that_break_ef1012_are_refused(sizes, words):
    with pytest.raises(ConfigError, match="policy.json: graph_parallel_option") as err:
        parallel_dims(two_nodes(), policy(**sizes))
    assert words in str(err.value)


def test_a_mesh_the_hierarchy_cannot_hold_is_refused():
    with pytest.raises(ConfigError, match="nodes hold 3 devices each") as err:
        parallel_dims(two_nodes(3), policy(tp=2, dp=3))
    assert "tensor_parallel_option.tensor_parallel_size" in str(err.value)


def test_data_parallel_needs_a_batch_it_can_split():
    torch.manual_seed(0)
    with pytest.raises(ConfigError, match="first dimensions are .'2'.; data parallelism needs"):
        tessel.build(small_llama(), (token_ids(2),), cluster=3, policy=policy(dp=3))


def _cluster_of(devices: int, memory: int | None = None) -> ClusterConfig:
    data = local_cluster_dict(devices)
    if memory is not None:
        data["item_def"][0]["memory"] = f"[DDR:{memory}B]"
    return cluster_from_dict(data, "cluster.json")


@pytest.mark.parametrize("tight", [False, True], ids=["default-memory", "tight-memory"])
def test_data_parallel_replicas_of_a_tensor_parallel_plan_equal_eager(tight):
    """dp 2 x tp 2: each replica takes half the batch on its two devices, sharded as the plan
    says; rank 0 returns the whole batch."""
    torch.manual_seed(0)
    model = small_llama()
    ids = token_ids(4)
    memory = None
    if tight:
        half = capture(model, (ids[:2],), keep=has_rule)
        memory = tight_cluster(half, 2)["item_def"][0]["memory"]
        memory = int(memory.removeprefix("[DDR:").removesuffix("B]"))
    built = tessel.build(model, (ids,), cluster=_cluster_of(4, memory), policy=policy(tp=2, dp=2))
    manifest = built.manifest
    assert manifest.plan.verify.max_relative_diff <= 1e-4
    assert manifest.mesh == Mesh((2, 2), ("dp", "tp"))
    groups = {g for s in manifest.submodels for g in s.comm_groups}
    assert (0, 2) in groups  # replica 1's first rank sends its rows to rank 0
    assert (1, 3) not in groups  # the other ranks' copies of the outputs stay put
    if tight:
        assert {(0, 1), (2, 3)} <= groups  # each replica's tensor-parallel collectives
        assert max(r.weight_bytes for r in manifest.plan.ranks) < weight_bytes(half)
    assert manifest.inputs[0].shape == (4, 16)
    assert manifest.outputs[0].shape == (4, 16, 256)
    # the build ran every rank in process against eager; a Session runs such a package across
    # processes and nodes in tests/test_runtime.py


def test_three_replicas_on_three_devices():
    torch.manual_seed(0)
    built = tessel.build(small_llama(), (token_ids(3),), cluster=3, policy=policy(dp=3))
    assert built.manifest.plan.verify.max_relative_diff <= 1e-4
    assert built.manifest.mesh.shape == (3, 1)


def _tensor_parallel_inside_nodes(choice: ShapeWeighed) -> bool:
    """Whether a weighed shape keeps its tensor-parallel groups inside one node."""
    return "tp_node" not in choice.dim_names


def _keeps_the_slow_link_quiet(choices: tuple[ShapeWeighed, ...]) -> None:
    """The chosen shape moves no more bytes between nodes than the fastest shape keeping
    tensor parallelism inside the nodes, or is 10% faster by estimate and says so."""
    timed = [c for c in choices if c.estimated_time_s is not None]
    (chosen,) = [c for c in choices if c.chosen]
    quiet = min(
        (c for c in timed if _tensor_parallel_inside_nodes(c)), key=lambda c: c.estimated_time_s
    )
    if chosen.internode_bytes > quiet.internode_bytes:
        assert chosen.estimated_time_s <= 0.9 * quiet.estimated_time_s
        assert "faster by estimate" in chosen.preferred
    else:
        fastest = min(c.estimated_time_s for c in timed)
        assert chosen.estimated_time_s == fastest or "between nodes" in chosen.preferred


def test_auto_weighs_the_shapes_the_nodes_allow_and_takes_the_fastest():
    torch.manual_seed(0)
    model = small_llama()
    built = tessel.build(model, (token_ids(4),), cluster=two_nodes(2), policy=policy())
    manifest = built.manifest
    choices = manifest.plan.mesh_choices
    # pp x dp x tp, where tp over both nodes is meshed as tp_node x tp
    shapes = [(1, 2, 2), (2, 2), (4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]
    assert [c.shape for c in choices] == shapes
    assert choices[0].dim_names == ("dp", "tp_node", "tp")
    timed = [c for c in choices if c.estimated_time_s is not None]
    assert [c.shape for c in timed] == shapes[:2]
    # stages are weighed only where nothing without them fits
    assert all("without pipeline stages fits" in c.set_aside for c in choices[3:])
    # replicas move only their outputs between the nodes: the rows of the replicas on the
    # other node (tensor parallelism over both nodes moves its collectives, where it has any)
    logits = 4 * 16 * 256 * 4
    assert choices[1].internode_bytes == logits / 2  # dp 2: one replica of 2 rows away
    # no plan of dp 4, with its gather, can beat dp 2's: not even captured
    assert choices[2].set_aside.startswith("slower than dp 2 x tp 2")
    assert choices[2].least_time_s >= choices[1].estimated_time_s
    _keeps_the_slow_link_quiet(choices)
    (chosen,) = [c for c in choices if c.chosen]
    # the manifest's mesh leaves out a data-parallel axis of one replica
    kept = [(n, s) for n, s in zip(chosen.dim_names, chosen.shape) if (n, s) != ("dp", 1)]
    assert list(zip(manifest.mesh.dim_names, manifest.mesh.shape)) == kept
    assert manifest.plan.verify.max_relative_diff <= 1e-4
    text = format_plan(manifest)
    assert "mesh shapes weighed" in text and "between nodes" in text


def test_auto_on_two_tight_nodes_fits_where_a_replica_fits_and_equals_eager():
    """Two nodes of two devices, too small for whole weights (a replica's least memory on
    two, and the outputs rank 0 gathers): a shape is set aside only where its plan does not
    fit, and the shape built is the plan weighed, fitting its devices."""
    from tessel.builder.mesh_choice import gathered_bytes

    torch.manual_seed(0)
    model = small_llama()
    ids = token_ids(4)
    half = capture(model, (ids[:2],), keep=has_rule)
    memory = tight_cluster(half, 2)["item_def"][0]["memory"]
    memory = int(memory.removeprefix("[DDR:").removesuffix("B]")) + gathered_bytes(half, 2)
    built = tessel.build(model, (ids,), cluster=two_nodes(2, memory), policy=policy())
    plan = built.manifest.plan
    choices = {c.shape: c for c in plan.mesh_choices}
    assert choices[(2, 2)].estimated_time_s is not None  # dp 2 x tp 2: a replica per node fits
    assert choices[(4, 1)].set_aside  # whole weights on every device do not
    _keeps_the_slow_link_quiet(plan.mesh_choices)
    assert all(r.peak_bytes <= memory for r in plan.ranks)
    assert plan.verify.max_relative_diff <= 1e-4


def test_a_shape_that_cannot_beat_one_weighed_is_set_aside_as_slower_and_the_choice_stands(
    monkeypatch,
):
    """A shape whose least time (every operator at its least share, before it is captured) or
    whose fastest plan (memory aside) is no faster than the shape it must beat is not searched
    further; weighing every shape in full chooses the same, and times each shape set aside at
    least as slow as its bound said. Every shape's bound is below its estimate."""
    from tessel.builder import mesh_choice as mc

    torch.manual_seed(0)
    model, ids = small_llama(), token_ids(4)
    captures, bounds = [], {}
    capture, least = mc.capture, mc._least_seconds

    def counted(*args, **kwargs):
        captures.append(args[1])
        return capture(*args, **kwargs)

    def recorded(whole, shape, cluster):
        bounds[shape.entry.text] = least(whole, shape, cluster)
        return bounds[shape.entry.text]

    monkeypatch.setattr(mc, "capture", counted)
    monkeypatch.setattr(mc, "_least_seconds", recorded)

    def choose():
        captures.clear()
        return mc.choose_mesh(
            model, (ids,), {}, two_nodes(2), policy(), reuse_layers=True, time_limit=60
        )

    bounded = choose()
    bounded_captures = len(captures)
    monkeypatch.setattr(mc, "_rival", lambda *args: None)
    full = choose()
    assert bounded.dims == full.dims
    assert bounded_captures < len(captures)  # a shape set aside by its bound is not captured
    slower = [e.set_aside.startswith("slower than") for e in bounded.weighed if e.set_aside]
    assert any(slower)
    for b, f in zip(bounded.weighed, full.weighed):
        if f.estimated_time_s is not None and b.text in bounds:
            assert bounds[b.text] <= f.estimated_time_s
        if b.set_aside and b.set_aside.startswith("slower than"):
            rival = next(e for e in bounded.weighed if e.text in b.set_aside)
            least_or_fastest = b.least_time_s or b.estimated_time_s
            assert rival.estimated_time_s <= least_or_fastest <= f.estimated_time_s
            assert not f.chosen
        else:
            assert (b.estimated_time_s, b.set_aside) == (f.estimated_time_s, f.set_aside)


@pytest.mark.parametrize("family", ["gpt2", "mixtral", "mamba"])
def test_no_plan_of_a_shape_beats_its_least_time(family, monkeypatch):
    """The bound that sets a shape aside before its capture is below the planner's estimate
    of every shape it bounds, for dense, expert and recurrent models."""
    from tests.differential.zoo import FAMILIES

    from tessel.builder import mesh_choice as mc

    zoo = FAMILIES[family]
    model, inputs = zoo.make(), zoo.inputs(4)
    bounds = {}
    least = mc._least_seconds

    def recorded(whole, shape, cluster):
        bounds[shape.entry.text] = least(whole, shape, cluster)
        return bounds[shape.entry.text]

    monkeypatch.setattr(mc, "_least_seconds", recorded)
    monkeypatch.setattr(mc, "_rival", lambda *args: None)  # every shape weighed in full
    choice = mc.choose_mesh(
        model, inputs, {}, two_nodes(2), policy(), reuse_layers=True, time_limit=60
    )
    timed = [e for e in choice.weighed if e.estimated_time_s is not None]
    assert len(timed) == 3 and all(e.text in bounds for e in timed)
    for e in timed:
        assert 0 < bounds[e.text] <= e.estimated_time_s, e.text


def test_a_faster_shape_over_the_slow_link_must_be_ten_percent_faster():
    from tessel.builder.mesh_choice import Weighed, _prefer_quiet_links

    cluster = two_nodes(2)
    over, inside = parallel_dims(cluster, policy(tp=4)), parallel_dims(cluster, policy(dp=2, tp=2))
    over_shape = dict(shape=(1, 2, 2), dim_names=("dp", "tp_node", "tp"))
    inside_shape = dict(shape=(2, 2), dim_names=("dp", "tp"))
    for over_time, wanted in ((0.95, "inside"), (0.85, "over")):
        spans = ShapeWeighed(**over_shape, estimated_time_s=over_time, internode_bytes=10.0)
        stays = ShapeWeighed(**inside_shape, estimated_time_s=1.0, internode_bytes=1.0)
        fitting = [Weighed(spans, over, None, 1, None), Weighed(stays, inside, None, 1, None)]
        chosen, rival = _prefer_quiet_links(fitting, cluster)
        assert chosen.entry is (spans if wanted == "over" else stays)
        assert chosen.entry.preferred
        # a shape chosen over the quieter one by its margin is to be confirmed as lowered
        assert rival == (fitting[1] if wanted == "over" else None)
    # the fastest moving no more between nodes is chosen without a word
    spans = ShapeWeighed(**over_shape, estimated_time_s=0.5, internode_bytes=1.0)
    stays = ShapeWeighed(**inside_shape, estimated_time_s=1.0, internode_bytes=1.0)
    chosen, rival = _prefer_quiet_links(
        [Weighed(spans, over, None, 1, None), Weighed(stays, inside, None, 1, None)], cluster
    )
    assert chosen.entry is spans and spans.preferred is None and rival is None


def test_a_shape_preferred_over_the_slow_link_keeps_its_margin_once_lowered(monkeypatch):
    """Where the planner's estimates let a shape moving more bytes between the nodes win by the
    margin, both shapes are lowered, priced as lowered, and the margin must hold there too:
    the winner's programs are the ones the build packs."""
    from tessel.builder import mesh_choice as mc
    from tessel.lower.estimate import program_seconds
    from tessel.plan import make_plan

    torch.manual_seed(0)
    model, ids, cluster = small_llama(), token_ids(4), two_nodes(1)
    whole, half = capture(model, (ids,), keep=has_rule), capture(model, (ids[:2],), keep=has_rule)
    over, inside = parallel_dims(cluster, policy(tp=2)), parallel_dims(cluster, policy(dp=2))
    plans = (
        make_plan(whole, cluster, policy()),
        make_plan(half, mc.first_devices(cluster, 1), policy(), reserve=mc.gathered_bytes(half, 2)),
    )

    def confirm(margin: float):
        monkeypatch.setattr(mc, "SLOW_LINK_MARGIN", margin)
        # the planner's estimates give the shape over the slow link twice the speed
        over_entry = ShapeWeighed((1, 2), ("dp", "tp_node"), 0.5, internode_bytes=10.0)
        inside_entry = ShapeWeighed((2, 1), ("dp", "tp"), 1.0, internode_bytes=1.0)
        fast = mc.Weighed(over_entry, over, whole, 1, plans[0])
        quiet = mc.Weighed(inside_entry, inside, half, 1, plans[1])
        assert mc._prefer_quiet_links([fast, quiet], cluster) == (fast, quiet)
        chosen, programs = mc._confirmed_after_lowering(fast, quiet, cluster, policy(), 60, True)
        devices = mc.first_devices(cluster, chosen.dims.size("tp"))
        assert len(programs) == chosen.dims.size("tp")
        seconds = max(program_seconds(rp, r, devices) for r, rp in enumerate(programs))
        gathered = mc.gather_seconds(chosen.captured, chosen.dims, cluster)
        assert chosen.entry.lowered_time_s == pytest.approx(seconds + gathered)
        return chosen, fast.entry, quiet.entry

    chosen, fast, quiet = confirm(-1.0)  # any gain keeps the planner's choice
    assert chosen.entry is fast and "as lowered" in fast.preferred
    gain = 1 - fast.lowered_time_s / quiet.lowered_time_s
    chosen, fast, quiet = confirm(gain + 0.01)  # a margin the lowered programs miss
    assert chosen.entry is quiet and fast.preferred is None
    assert "faster as lowered" in quiet.preferred and "faster by the planner" in quiet.preferred
    text = format_plan_of_choices([fast, replace(quiet, chosen=True)])
    assert f"{1e3 * quiet.lowered_time_s:.3f} ms as lowered" in text

    # a shape that cannot be lowered is set aside, and says nothing of being preferred
    from tessel.lower.trace import LoweringError

    real = mc.plan_and_lower

    def fails_over_the_nodes(captured, *args, **kwargs):
        if captured is whole:
            raise LoweringError("no rule")
        return real(captured, *args, **kwargs)

    monkeypatch.setattr(mc, "plan_and_lower", fails_over_the_nodes)
    chosen, fast, quiet = confirm(-1.0)
    assert chosen.entry is quiet and "could not be lowered: no rule" in fast.set_aside
    assert fast.preferred is None


def format_plan_of_choices(choices: list[ShapeWeighed]) -> str:
    """The `inspect` lines of a plan weighing `choices`."""
    from tessel.report import mesh_choice_lines

    return "\n".join(mesh_choice_lines(choices))


def test_auto_sets_aside_shapes_the_batch_cannot_split():
    torch.manual_seed(0)
    built = tessel.build(small_llama(), (token_ids(2),), cluster=two_nodes(2), policy=policy())
    choices = {c.shape: c for c in built.manifest.plan.mesh_choices}
    assert "divisible by 4" in choices[(4, 1)].set_aside


def test_the_data_parallel_choice_prices_exchanging_gradients_not_optimizer_states():
    from tessel.builder.mesh_choice import choose_data_parallel
    from tessel.config.cluster import local_cluster
    from tessel.config.parallel_option import ParallelOption

    model = hf_llama().train()
    ids = token_ids(4)
    estimates = {}
    for held in (1.0, 3.0):  # weights alone; weights with Adam's two moments beside them
        _, weighed = choose_data_parallel(
            model,
            (),
            {"input_ids": ids, "labels": ids},
            local_cluster(2),
            ParallelOption(),
            30.0,
            held_factor=held,
        )
        estimates[held] = {e["data_parallel"]: e["estimated_time_s"] for e in weighed}
    # the replicas all-reduce their gradients, placed like the weights; the states stay put
    assert estimates[1.0] == pytest.approx(estimates[3.0], rel=1e-9)
    assert estimates[3.0][2] > 0
