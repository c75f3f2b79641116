"""Lowering: a run of identical layers traced once and stitched gives the program tracing every
layer gives, on replicated and on sharded weights; where stitching fails, every layer is traced."""

from __future__ import annotations

import logging

import pytest
import torch
from tests.conftest import hf_gpt2, hf_llama, token_ids
from torch import fx, nn
from torch.distributed.tensor import Shard

import tessel.lower.trace as trace_mod
from tessel.builder.lowering import plan_and_lower
from tessel.capture import capture
from tessel.config.cluster import cluster_from_dict, local_cluster, local_cluster_dict
from tessel.lower.stitch import Stitcher, StitchError, _contiguous_runs
from tessel.lower.trace import _trace, lower_rank, weight_inputs
from tessel.plan import has_rule
from tessel.plan.planner import least_memory_plan

FALLBACK = "tracing every layer"
TRACE_LOG = "tessel.lower.trace"
LAYERS = 4


def tiny_gpt2() -> nn.Module:
    return hf_gpt2(layers=LAYERS, vocab=128)


def tiny_llama() -> nn.Module:
    return hf_llama(layers=LAYERS, kv_heads=2, vocab=128)


MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama}


@pytest.fixture(scope="module", params=list(MODELS))
def captured(request):
    """(model, captured) as a build captures it, once per model for the whole file."""
    model = MODELS[request.param]()
    inputs = {"input_ids": token_ids(seq=8, vocab=128), "use_cache": False}
    return model, capture(model, inputs, keep=has_rule)


def tight_cluster(model: nn.Module, captured, world: int):
    """Devices that hold the activations, the vectors and 60% of the matrices: replicated
    weights cannot fit, so the planner must shard some."""
    params = list(model.parameters())
    matrices = sum(p.numel() * p.element_size() for p in params if p.dim() >= 2)
    vectors = sum(p.numel() * p.element_size() for p in params if p.dim() < 2)
    vectors += sum(b.numel() * b.element_size() for b in model.buffers())
    peak, held = least_memory_plan(captured, world)
    act = peak - held
    data = local_cluster_dict(world)
    data["item_def"][0]["memory"] = f"[DDR:{int(act + 0.6 * matrices + vectors)}B]"
    cluster = cluster_from_dict(data, "tight.json")
    assert cluster.devices[0].memory_bytes < act + matrices + vectors
    return cluster


def sharded_weights(captured, plan) -> list[str]:
    placeholders = {n.name: n for n in captured.program.graph.nodes if n.op == "placeholder"}
    return [
        fqn
        for name, fqn in weight_inputs(captured, plan)
        if any(isinstance(p, Shard) for p in plan.out_placements(placeholders[name]))
    ]


def canonical(rank_program) -> tuple:
    """Program nodes, constants and local shapes, with every node name replaced by the index of
    the node defining it (input names kept: they are the program's interface)."""
    nodes = rank_program.program["nodes"]
    index = {n["name"]: i for i, n in enumerate(nodes) if "name" in n}

    def sub(a):
        if isinstance(a, dict):
            if set(a) == {"$node"}:
                return {"$node": index[a["$node"]]}
            return {k: sub(v) for k, v in a.items()}
        if isinstance(a, list):
            return [sub(x) for x in a]
        return a

    program = [
        {k: sub(v) for k, v in n.items() if k != "name" or n["op"] == "input"} for n in nodes
    ]
    constants = sorted((index[k], v) for k, v in rank_program.constants.items())
    shapes = sorted((index[k], v) for k, v in rank_program.shapes.items())
    return rank_program.program["format"], program, constants, shapes


def assert_same_program(got, want) -> None:
    got_format, got_nodes, got_constants, got_shapes = canonical(got)
    want_format, want_nodes, want_constants, want_shapes = canonical(want)
    assert got_format == want_format
    assert len(got_nodes) == len(want_nodes)
    for i, (a, b) in enumerate(zip(got_nodes, want_nodes)):
        assert a == b, f"node {i}"
    assert [i for i, _ in got_constants] == [i for i, _ in want_constants]
    for (i, a), (_, b) in zip(got_constants, want_constants):
        assert a.dtype == b.dtype and torch.equal(a, b), f"constant of node {i}"
    assert got_shapes == want_shapes


@pytest.fixture
def run_node_counter(monkeypatch):
    """Counts the captured nodes a trace runs through DTensor."""
    counts = [0]
    real = trace_mod._run_node

    def counting(*args, **kwargs):
        counts[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(trace_mod, "_run_node", counting)
    return counts


# a covering set: each family meets both device counts and both memories (their product
# doubled the time and found nothing the pairs do not)
@pytest.mark.parametrize("world, tight", [(2, True), (4, False)], ids=["2-tight", "4-default"])
def test_stitched_rank_equals_tracing_every_layer(captured, world, tight, run_node_counter, caplog):
    caplog.set_level(logging.INFO, logger=TRACE_LOG)
    model, cap = captured
    cluster = tight_cluster(model, cap, world) if tight else local_cluster(world, "cpu")
    plan, _ = plan_and_lower(cap, cluster)
    if tight:  # the stitched layers read sharded weights and activations
        assert sharded_weights(cap, plan)
    stitcher = Stitcher.for_plan(cap.program.graph, plan)
    assert [len(run.layers) for run in stitcher.runs] == [LAYERS]
    skipped = len(stitcher.skipped)
    assert skipped == sum(len(layer) for layer in stitcher.runs[0].layers[2:]) > 0

    for rank in (0, world - 1):
        run_node_counter[0] = 0
        got = lower_rank(cap, plan, rank)
        stitched_runs = run_node_counter[0]
        run_node_counter[0] = 0
        want = _trace(cap, plan, rank, None)
        # layers 2.. were not traced, and no fallback traced them either
        assert stitched_runs == run_node_counter[0] - skipped, f"rank {rank}"
        assert_same_program(got, want)
    assert not [r for r in caplog.records if FALLBACK in r.getMessage()]


def test_stitched_capture_and_traced_capture_lower_alike(captured):
    """Both speed-ups together give what neither gives: stamped capture + stitched lowering
    equals the full capture traced layer by layer."""
    model, cap = captured
    inputs = {"input_ids": token_ids(seq=8, vocab=128), "use_cache": False}
    full = capture(model, inputs, keep=has_rule, reuse_layers=False)
    world = 4
    plan, _ = plan_and_lower(cap, tight_cluster(model, cap, world))
    plan_full, _ = plan_and_lower(full, tight_cluster(model, full, world))
    rank = world - 1
    assert_same_program(lower_rank(cap, plan, rank), _trace(full, plan_full, rank, None))


@pytest.mark.parametrize("where", ["stitch", "stand_in"])
def test_stitch_error_traces_every_layer(captured, where, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=TRACE_LOG)
    model, cap = captured
    world = 2
    plan, _ = plan_and_lower(cap, tight_cluster(model, cap, world))
    rank = world - 1
    want = _trace(cap, plan, rank, None)
    raised = []

    def fail(self, *args, **kwargs):
        raised.append(where)
        raise StitchError("x")

    # "stitch" fails after the trace, "stand_in" in the middle of it (inside make_fx)
    monkeypatch.setattr(Stitcher, where, fail)
    got = lower_rank(cap, plan, rank)
    assert raised == [where]
    (message,) = [r.getMessage() for r in caplog.records if r.name == TRACE_LOG]
    assert FALLBACK in message and "(x)" in message
    assert got.program == want.program
    assert_same_program(got, want)


# --- _contiguous_runs ------------------------------------------------------------------------


def _layers_graph(spec: str) -> tuple[dict[str, list[fx.Node]], dict]:
    """A graph from `spec`: a letter per node, nodes of a layer share its letter; '.' is a node of
    no layer. Returns each layer's nodes and the graph order."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    layers: dict[str, list[fx.Node]] = {}
    for ch in spec:
        x = graph.call_function(torch.relu, (x,))
        if ch != ".":
            layers.setdefault(ch, []).append(x)
    graph.output(x)
    return layers, {n: i for i, n in enumerate(graph.nodes)}


def _names(runs, layers) -> list[str]:
    by_first = {nodes[0]: name for name, nodes in layers.items()}
    return ["".join(by_first[layer[0]] for layer in run) for run in runs]


@pytest.mark.parametrize(
    "graph, runs",
    [
        ("aabb.ccdd", ["ab", "cd"]),  # a foreign node between layers splits the run
        (".aabbccdd.", ["abcd"]),  # adjacent layers stay together
        ("aab.bccdd", ["a", "cd"]),  # a layer with a foreign node inside is dropped
        ("aabbxxccdd", ["ab", "cd"]),  # x is a layer, but not one of this group
    ],
)
def test_contiguous_runs(graph, runs):
    layers, order = _layers_graph(graph)
    group = [layers[k] for k in "abcd"]
    assert _names(_contiguous_runs(group, order), layers) == runs
