"""Lowering: ranks may share one traced program only where tracing each would give that program."""

from __future__ import annotations

import math
import operator
from types import SimpleNamespace

import pytest
import torch
from tests.conftest import small_gpt2, small_llama, token_ids
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from tessel.builder.lowering import plan_and_lower
from tessel.capture import capture
from tessel.config.cluster import local_cluster
from tessel.config.parallel_option import ParallelOption
from tessel.lower.outputs import gather_outputs
from tessel.lower.trace import fake_world, lower_rank

N = 4


def _by_position(rp) -> tuple[list, dict]:
    """A rank's program and local shapes with each node named by its position: the names a
    trace gives are not part of what the program computes."""
    nodes = rp.program["nodes"]
    names = {n["name"]: f"node{i}" for i, n in enumerate(nodes) if "name" in n}

    def rename(a):
        if isinstance(a, dict):
            if "$node" in a:
                return {"$node": names[a["$node"]]}
            return {k: names[v] if k == "name" else rename(v) for k, v in a.items()}
        if isinstance(a, list):
            return [rename(v) for v in a]
        return a

    return rename(nodes), {names.get(k, k): v for k, v in rp.shapes.items()}


@pytest.mark.parametrize("make", [small_llama, small_gpt2], ids=["llama", "gpt2"])
def test_every_rank_gets_the_program_tracing_it_alone_gives(make):
    captured = capture(make(), (token_ids(),))
    plan, programs = plan_and_lower(captured, local_cluster(N, "cpu"))
    assert len(programs) == N
    for rank, got in enumerate(programs):
        alone = gather_outputs(lower_rank(captured, plan, rank), rank, plan.mesh_shape)
        assert _by_position(got) == _by_position(alone), f"rank {rank}"
        assert got.constants.keys() == alone.constants.keys()


def test_middle_ranks_whose_offsets_grow_by_rank_equal_their_own_trace():
    # a training step of a vocabulary-parallel GPT-2: each rank's embedding rows start at its
    # own offset, so the middle ranks' programs come from the first and last ones
    from tests.conftest import hf_gpt2

    from tessel.capture import capture_training
    from tessel.capture.training import GradientOutputs, gradient_outputs, mark_gradients
    from tessel.plan import has_rule

    model = hf_gpt2(2, 64, 4, 8192)
    ids = token_ids(batch=4, vocab=8192)
    captured = capture_training(model, (), {"input_ids": ids, "labels": ids}, keep=has_rule)
    graph = captured.program.graph_module.graph
    mark_gradients(graph, GradientOutputs(gradient_outputs(graph).names, 4.0))
    plan, programs = plan_and_lower(captured, local_cluster(N, "cpu"), reuse_layers=False)
    first_names = [n.get("name") for n in programs[0].program["nodes"]]
    offsets = set()
    for rank, got in enumerate(programs):
        alone = lower_rank(captured, plan, rank, stitch=False)
        assert _by_position(got) == _by_position(alone), f"rank {rank}"
        offsets.add(str(_by_position(got)[0]))
        if 0 < rank < N - 1:  # derived, not traced: rank 0's names
            assert [n.get("name") for n in got.program["nodes"]] == first_names
    assert len(offsets) == N  # every rank's program is its own


def test_a_rank_trace_does_not_see_the_rank_traced_before_it():
    """DTensor caches sharding decisions under meshes that compare equal for every rank; a cached
    decision must not carry one rank's mesh coordinate into another rank's program."""

    def chunk_taken(rank: int) -> list[int]:
        with fake_world(rank, (2,)) as mesh:

            def f(y: torch.Tensor) -> torch.Tensor:
                b = DTensor.from_local(y, mesh, [Replicate()], run_check=False)
                return (b * 2).redistribute(mesh, [Shard(0)]).to_local()

            gm = make_fx(f, tracing_mode="fake")(torch.zeros(4, 4))
        gm.graph.eliminate_dead_code()
        return [n.args[1] for n in gm.graph.nodes if n.target is operator.getitem]

    assert chunk_taken(0) == [0]
    assert chunk_taken(1) == [1]
    assert chunk_taken(0) == [0]


def test_a_scalar_an_operator_takes_as_a_tensor_is_made_where_it_is_used():
    """Tracing lifts `tensor(0.5)` (as DTensor's vocabulary mask writes zeros) into a constant
    and a fresh copy of it; the program makes the fresh tensor instead and holds no constant the
    captured graph did not have (the planner's memory model counts only those)."""
    from tessel.capture.portable import fresh_scalars
    from tessel.plan.memory import program_peak_bytes

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[y < 0] = torch.tensor(0.5)
        return y

    gm = make_fx(f, tracing_mode="fake")(torch.zeros(4, 3))
    assert program_peak_bytes(gm.graph, set())[0] == 4  # the lifted constant
    assert fresh_scalars(gm) == 1
    gm.recompile()
    assert not [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert program_peak_bytes(gm.graph, set())[0] == 0
    x = torch.tensor([[-1.0, 2.0, -3.0]] * 4)
    assert torch.equal(gm(x), f(x))


def test_capture_takes_the_public_export_when_the_one_trace_path_fails(monkeypatch):
    import torch.export._trace as trace

    from tessel.plan import has_rule

    public = trace._export  # torch.export.export calls it with pre_dispatch=True
    failed = []

    def broken(*args, **kwargs):
        if not kwargs.get("pre_dispatch", True):
            failed.append(True)
            raise RuntimeError("private API moved")
        return public(*args, **kwargs)

    monkeypatch.setattr(trace, "_export", broken)
    model = small_llama(layers=1)
    ids = token_ids()
    captured = capture(model, (ids,), keep=has_rule)
    targets = {str(n.target) for n in captured.program.graph.nodes if n.op == "call_function"}
    assert failed  # the one-trace path was tried first
    assert "aten.scaled_dot_product_attention.default" in targets
    assert captured.program.module()(ids).shape == model(ids).shape


def test_a_masked_partial_value_is_reduced_once_for_all_its_consumers():
    """A vocabulary-sharded embedding's output is a masked partial sum whose mask is spent by its
    first reduction; a second consumer that wants it whole must get the reduced value, not a
    second reduction of the spent mask."""
    from tessel.lower.trace import _lookup, _Values

    graph = torch.fx.Graph()
    emb = graph.call_function(torch.ops.aten.embedding.default, ())
    whole = SimpleNamespace(placements=[Replicate()])  # what `_lookup` reads of a target
    with fake_world(0, (2,)) as mesh:
        weight = DTensor.from_local(torch.randn(4, 3), mesh, [Shard(0)], run_check=False)
        ids = DTensor.from_local(torch.tensor([[0, 5, 7]]), mesh, [Replicate()], run_check=False)
        masked = torch.ops.aten.embedding.default(weight, ids)
        assert masked.placements[0].is_partial()
        env = _Values({}, None)
        env[emb] = masked
        (first,) = _lookup((emb,), env, [whole], mesh)
        (second,) = _lookup((emb,), env, [whole], mesh)
    assert first.placements == second.placements == (Replicate(),)
    assert torch.equal(first.to_local(), second.to_local())


def test_a_shard_moved_across_uneven_shards_is_dense_and_counted_so():
    """Tokens 16 over 3 devices (6, 6, 4) moved to shards of the hidden dim: DTensor pads the
    token shards, gathers them and cuts the padding off with a view, which leaves gaps between
    a batch's rows. The lowering hands the op a dense shard of the same global shape (a view
    joining batch and tokens then runs), and the memory model counts that copy."""
    from tessel.lower.trace import _lookup, _Values
    from tessel.plan.memory import _move_bytes

    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    node.meta["val"] = torch.empty(2, 16, 6)
    hidden = SimpleNamespace(placements=[Shard(2)])
    with fake_world(1, (3,)) as mesh:
        tokens = DTensor.from_local(
            torch.randn(2, 6, 6),
            mesh,
            [Shard(1)],
            run_check=False,
            shape=(2, 16, 6),
            stride=(96, 6, 1),
        )
        env = _Values({}, None)
        env[node] = tokens
        (moved,) = _lookup((node,), env, [hidden], mesh)
        local = moved.to_local()
        assert moved.shape == (2, 16, 6) and moved.placements == (Shard(2),)
        assert local.shape == (2, 16, 2) and local.is_contiguous()
        assert local.view(32, 2).shape == (32, 2)
    peak, last, _ = _move_bytes(node.meta["val"], (Shard(1),), (Shard(2),), (3,))
    assert last == 2 * 16 * 2 * 4  # the dense copy outlives the padded buffer
    assert peak >= last + 2 * 18 * 2 * 4  # made from the padded buffer, both held at once


def test_a_whole_value_takes_the_layout_the_captured_graph_gave_it():
    from tessel.lower.trace import _laid_out

    captured = torch.empty(1, 4, 16, 16).transpose(1, 2)  # strides (1024, 16, 256, 1)
    gathered = torch.arange(1024.0).reshape(1, 16, 4, 16)  # contiguous: (1024, 64, 16, 1)
    remade = _laid_out(gathered, captured)
    assert remade.stride() == captured.stride()
    assert torch.equal(remade, gathered)
    assert _laid_out(captured, captured) is captured
    overlapping = torch.zeros(4, 1).expand(4, 3)  # not dense: left as it is
    assert _laid_out(torch.zeros(4, 3), overlapping).stride() == (3, 1)


def _gpt2_with_uneven_logits(vocab: int = 1001):
    """A GPT-2 whose logits are its largest tensor, on 4 devices that hold too little for its
    embedding whole, and a vocabulary 4 does not divide."""
    from tessel.config.cluster import cluster_from_dict
    from tessel.demo import tight_cluster
    from tessel.plan import has_rule

    ids = token_ids(4, 16, vocab)
    captured = capture(small_gpt2(vocab=vocab), (ids,), keep=has_rule)
    return captured, cluster_from_dict(tight_cluster(captured, N), "tight.json")


def _gathers(rp) -> list[dict]:
    return [
        n
        for n in rp.program["nodes"]
        if n.get("target") == "_c10d_functional.all_to_all_single.default"
    ]


def test_outputs_reach_rank_0_once_and_no_other_rank_holds_them_whole():
    vocab = 1001  # 251, 251, 251 and 248 columns of the logits per rank
    captured, cluster = _gpt2_with_uneven_logits(vocab)
    # the tied embedding split by vocabulary rows, so the logits are split by their columns
    by_vocab = ParallelOption(fixed_placements=(("lm.transformer.wte.weight", ("S(0)",)),))
    plan, programs = plan_and_lower(captured, cluster, by_vocab)
    whole = [4, 16, vocab]
    logits = 4 * 16 * vocab * 4
    out = programs[0].program["nodes"][-1]["args"][0]["$node"]
    assert list(programs[0].shapes[out][0]) == whole
    for rank, rp in enumerate(programs):
        (gather,) = _gathers(rp)  # one collective, into one buffer, with no padding
        into, sent = gather["args"][1], gather["args"][2]
        assert sent == [[251, 251, 251, 248][rank], 0, 0, 0]
        assert into == ([251, 251, 251, 248] if rank == 0 else [0, 0, 0, 0])
        held = rp.peak_bytes - rp.weight_bytes
        if rank == 0:
            # the whole logits once, beside a shard and its copy on the way out: never twice
            assert logits <= held < 1.5 * logits, (held, logits)
        else:
            assert all(math.prod(shape) < math.prod(whole) for shape, _ in rp.shapes.values())
            assert held < logits, (rank, held, logits)
    # the planner counts what the lowered programs hold: rank 0's with the outputs, and a peak
    # for the other ranks, without them, that bounds theirs
    assert plan.memory["peak_bytes"] == pytest.approx(programs[0].peak_bytes, rel=0.05)
    others = plan.memory["other_ranks_peak_bytes"]
    assert others < plan.memory["peak_bytes"] - logits // 2
    assert all(rp.peak_bytes <= others for rp in programs[1:])


def test_devices_too_small_for_the_logits_twice_take_the_model():
    """Devices that hold rank 0's weights and the logits once, but not twice: the all-gather
    and copy of the logits this replaces could not run on them."""
    from tessel.config.cluster import cluster_from_dict, local_cluster_dict
    from tessel.plan.planner import least_memory_plan

    vocab = 1001
    captured, _ = _gpt2_with_uneven_logits(vocab)
    logits = 4 * 16 * vocab * 4
    peak, weights = least_memory_plan(captured, N)
    data = local_cluster_dict(N)
    device = peak + logits // 8
    data["item_def"][0]["memory"] = f"[DDR:{device}B]"
    assert device < weights + 2 * logits
    plan, programs = plan_and_lower(captured, cluster_from_dict(data, "tight.json"))
    assert max(p.peak_bytes for p in programs) <= device
    assert len(_gathers(programs[0])) == 1


@pytest.mark.parametrize("rows, collectives", [(12, 1), (10, 2)])
def test_a_move_over_two_axes_is_one_collective_where_that_is_exact(rows, collectives):
    """Gathering a tensor sharded over both axes of a 3 x 2 mesh is one all-gather over the
    joined group where its rows divide by 6; 10 rows split 2,2,2,2,1,1 per axis but 2,2,2,2,2,0
    joined, so they are gathered one axis at a time."""
    from torch.distributed.tensor.debug import CommDebugMode

    with fake_world(0, (3, 2), ("tp_node", "tp")) as mesh:
        local = torch.ones(2, 4)  # rank 0's shard either way
        x = DTensor.from_local(local, mesh, [Shard(0), Shard(0)], run_check=False,
                               shape=torch.Size([rows, 4]), stride=(4, 1))  # fmt: skip
        with CommDebugMode() as comms:
            whole = x.redistribute(mesh, [Replicate(), Replicate()])
    assert comms.get_total_counts() == collectives
    assert whole.to_local().shape == (rows, 4)


def test_a_lowered_program_is_priced_by_its_calls_and_its_collectives_links():
    """`program_seconds` prices each call with the planner's formulas: the collectives' time
    has a term in 1 / bandwidth of their link (a rank alone has none), the rest does not."""
    from dataclasses import replace

    from tessel.config.cluster import cluster_from_dict
    from tessel.demo import tight_cluster
    from tessel.lower.estimate import program_seconds

    captured = capture(small_llama(layers=1), (token_ids(),))
    for world in (1, 2):  # devices too small for the whole weights: the plan shards them
        cluster = cluster_from_dict(tight_cluster(captured, world), "tight.json")
        plan, programs = plan_and_lower(captured, cluster)

        for rank, rp in enumerate(programs):
            slower, base, quicker = (
                program_seconds(rp, rank, replace(cluster, link_bandwidth=b * scale))
                for b in [cluster.link_bandwidth]
                for scale in (0.5, 1, 2)
            )
            if world == 1:
                assert slower == base == quicker > 0
                assert not [
                    n for n in programs[0].program["nodes"] if "c10d" in n.get("target", "")
                ]
            else:  # T(b) = C + B / b
                assert slower - base == pytest.approx(2 * (base - quicker)) and base > quicker


def test_a_program_read_as_typed_nodes_writes_back_the_same_json():
    """The passes that edit programs (stage cuts, output gathers) read them as typed nodes:
    read and written back unchanged, a program is the same JSON, byte for byte."""
    import json

    from tessel.lower.nodes import ProgramNodes

    captured = capture(small_llama(), (token_ids(),))
    _, programs = plan_and_lower(captured, local_cluster(2, "cpu"))
    for rp in programs:
        nodes = ProgramNodes.read(rp.program)
        again = nodes.program([*nodes.nodes, nodes.output])
        assert json.dumps(again) == json.dumps(rp.program)
        assert len(nodes.calls) + len(nodes.inputs) + len(nodes.constants) == len(nodes.nodes)
        # every call is read by the calls its readers list, and by no other
        for n in nodes.calls:
            for reader in nodes.readers[n.name]:
                assert n.name in next(m for m in nodes.calls if m.name == reader).reads


def test_a_program_node_is_read_only_in_its_kind_s_form():
    from tessel.lower.nodes import Node, call, ref
    from tessel.lower.program import ProgramError

    for bad in (
        {"op": "call", "name": "x", "target": "aten.add.Tensor", "args": []},  # no kwargs
        {"op": "input", "name": "x", "target": "aten.add.Tensor"},
        {"op": "loop", "name": "x"},
        {"name": "x"},
    ):
        with pytest.raises(ProgramError, match="not well formed"):
            Node.read(bad)
    # renamed: the nodes it reads and, given ranks, its collective groups moved
    n = call("s", "_c10d_functional.broadcast.default", [ref("a"), 0, {"$group": [1, 0]}])
    moved = n.renamed("s_mb1", {"a": "a_mb1"}, lambda r: r + 4)
    assert moved.name == "s_mb1" and moved.reads == ("a_mb1",)
    assert moved.args[2] == {"$group": [4, 5]}
    assert n.args[0] == ref("a")  # the node it came from is unchanged


def test_a_moved_value_is_laid_out_as_captured_whatever_the_strides_of_its_size_1_dims() -> None:
    """A value the captured graph held with dims nested (0, 1, 4, 2) and size-1 dims of any
    stride, arriving nested otherwise, as the input of a view: it is remade as captured, so the view
    runs (Mamba-2's chunked scan at 3 devices, GraniteMoE-hybrid)."""
    from tessel.lower.trace import _laid_out

    shape = (2, 8, 256, 1, 16, 1)
    captured = torch.empty_strided(shape, (32768, 4096, 1, 256, 256, 1))
    arrived = torch.empty_strided(shape, (32768, 16, 128, 32768, 1, 1))
    arrived.copy_(torch.randn(shape))
    with pytest.raises(RuntimeError):
        arrived.view(16, 256, 16)
    laid = _laid_out(arrived, captured, viewed=True)
    assert torch.equal(laid, arrived)
    assert torch.equal(laid.view(16, 256, 16), arrived.reshape(16, 256, 16))
