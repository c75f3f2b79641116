"""Candidate strategies from DTensor's rules and tessel's own: matmul's column-parallel,
row-parallel and replicated strategies, even shards of weights and inputs, the attention rule,
and the names strategies are reported and banned by."""

from __future__ import annotations

import pytest
import torch

from tessel._torch import detached_mesh
from tessel.plan.planner import mesh_for
from tessel.plan.strategies import (
    DTensorSpec,
    NodeStrategy,
    Partial,
    Replicate,
    Shard,
    as_op_strategy,
    describe_strategy,
    has_rule,
    op_strategies,
    placement_strategies,
    strategy_key,
    tensor_meta,
)

MESH = mesh_for(2)
GRID = detached_mesh(torch.arange(4).reshape(2, 2))  # a 2 x 2 mesh
SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _any_placement(t: torch.Tensor):
    """An argument that may arrive in any even placement (what a producer can offer)."""
    return as_op_strategy([s.output for s in placement_strategies(MESH, t)], MESH, tensor_meta(t))


def _replicated(t: torch.Tensor):
    return as_op_strategy([None], MESH, tensor_meta(t))


def _placements(strategy: NodeStrategy):
    out = strategy.output
    ins = tuple(tuple(s.placements) if s is not None else None for s in strategy.inputs)
    return ins, tuple(out.placements)


def test_mm_offers_column_parallel_row_parallel_and_replicated():
    a, b, out = torch.empty(8, 32), torch.empty(32, 16), torch.empty(8, 16)
    found = op_strategies(torch.ops.aten.mm.default, (_any_placement(a), _any_placement(b)), {},
                          out, MESH)  # fmt: skip
    got = {_placements(s) for s in found}
    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    # replicated: every device computes the whole product
    assert (((R,), (R,)), (R,)) in got
    # column-parallel: the weight's columns split, the output split the same way
    assert (((R,), (S1,)), (S1,)) in got
    # row-parallel: the contracted dim split on both sides, the output a partial sum
    assert (((S1,), (S0,)), (Partial(),)) in got
    # batch (row) split of the left side
    assert (((S0,), (R,)), (S0,)) in got
    # every strategy names a spec per input and one output spec with the output's metadata
    for s in found:
        assert len(s.inputs) == 2
        assert s.output.tensor_meta.shape == out.shape
    assert len(got) == len(found)  # no duplicates


def test_placement_strategies_shard_every_dim_with_rows_to_split():
    """Shards follow torch.chunk, so a dim that does not divide is split unevenly; a dim of one
    row has nothing to split."""
    got = lambda t, **kw: [  # noqa: E731
        tuple(s.output.placements) for s in placement_strategies(MESH, t, **kw)
    ]
    assert got(torch.empty(4, 6)) == [(Replicate(),), (Shard(0),), (Shard(1),)]
    assert got(torch.empty(3, 5)) == [(Replicate(),), (Shard(0),), (Shard(1),)]  # 2 + 1, 3 + 2
    assert got(torch.empty(1, 4)) == [(Replicate(),), (Shard(1),)]
    assert got(torch.empty(4, 6), replicate_only=True) == [(Replicate(),)]
    # a weight or an input has no producer: no input specs; the meta is the tensor's
    (s, *_) = placement_strategies(MESH, torch.empty(3, 5, dtype=torch.float16))
    assert s.inputs == ()
    assert s.output.tensor_meta.dtype == torch.float16


def test_placement_strategies_on_a_2d_mesh_stop_where_a_shard_has_one_row():
    got = [tuple(s.output.placements) for s in placement_strategies(GRID, torch.empty(2, 3))]
    # dim 0 has 2 rows: split once, each device has one row; split again there is nothing left
    assert (Shard(0), Replicate()) in got and (Replicate(), Shard(0)) in got
    assert (Shard(0), Shard(0)) not in got
    assert (Shard(1), Shard(1)) in got  # 3 rows: 2 + 1, then 1 + 1
    assert (Shard(0), Shard(1)) in got and (Shard(1), Shard(0)) in got


def test_has_rule():
    assert has_rule(torch.ops.aten.mm.default)
    assert has_rule(torch.ops.aten.add.Tensor)
    assert has_rule(SDPA)  # tessel's own local rule
    assert not has_rule(torch.ops.aten.searchsorted.Tensor)
    assert not has_rule(torch.ops.aten.nonzero.default)


def test_an_op_without_a_rule_has_no_strategies():
    x = torch.empty(4, 8)
    found = op_strategies(
        torch.ops.aten.searchsorted.Tensor, (_replicated(x), _replicated(x)), {}, x, MESH
    )
    assert found is None


def _attention(q_shape, mask_shape=None):
    q = torch.empty(q_shape)
    args = [_replicated(q)] * 3
    if mask_shape is not None:
        args.append(_replicated(torch.empty(mask_shape, dtype=torch.bool)))
    return [describe_strategy(s) for s in op_strategies(SDPA, tuple(args), {}, q, MESH)]


@pytest.mark.parametrize(
    "shape,expected",
    [
        ((2, 4, 8, 4), ["R, R, R -> R", "S(0), S(0), S(0) -> S(0)", "S(1), S(1), S(1) -> S(1)"]),
        # 3 heads split 2 + 1, never within a head; batch 3 splits 2 + 1
        ((2, 3, 8, 4), ["R, R, R -> R", "S(0), S(0), S(0) -> S(0)", "S(1), S(1), S(1) -> S(1)"]),
        ((3, 4, 8, 4), ["R, R, R -> R", "S(0), S(0), S(0) -> S(0)", "S(1), S(1), S(1) -> S(1)"]),
        ((1, 1, 8, 4), ["R, R, R -> R"]),
    ],
)
def test_attention_shards_batch_or_whole_heads(shape, expected):
    assert _attention(shape) == expected


def test_attention_replicates_a_mask_broadcast_over_the_split_dim():
    # a mask of one head follows a batch split but stays whole under a head split
    assert _attention((2, 4, 8, 4), (2, 1, 8, 8)) == [
        "R, R, R, R -> R",
        "S(0), S(0), S(0), S(0) -> S(0)",
        "S(1), S(1), S(1), R -> S(1)",
    ]
    assert _attention((2, 4, 8, 4), (1, 1, 8, 8))[1] == "S(0), S(0), S(0), R -> S(0)"


def test_describe_strategy_and_strategy_key():
    mesh = MESH
    meta = tensor_meta(torch.empty(4, 4))
    spec = lambda *p: DTensorSpec(mesh, p, meta)  # noqa: E731
    mm = NodeStrategy(spec(Partial()), (spec(Shard(1)), spec(Shard(0))))
    assert describe_strategy(mm) == "S(1), S(0) -> P(sum)"
    assert strategy_key(mm) == "S(1), S(0) -> P(sum)"
    weight = NodeStrategy(spec(Shard(0)), ())
    assert describe_strategy(weight) == " -> S(0)"
    split = NodeStrategy((spec(Shard(0)), None), (spec(Shard(0)), None))
    assert describe_strategy(split) == "S(0), - -> (S(0), -)"
    assert split.output_at(0) is split.output[0] and split.output_at(1) is None
    assert mm.output_at(None) is mm.output and mm.output_at(3) is mm.output
    two_d = NodeStrategy(
        DTensorSpec(GRID, (Shard(0), Partial()), meta),
        (DTensorSpec(GRID, (Replicate(), Shard(1)), meta),),
    )
    assert describe_strategy(two_d) == "R/S(1) -> S(0)/P(sum)"


def test_strategy_keys_are_stable_across_plannings():
    a, b, out = torch.empty(8, 32), torch.empty(32, 16), torch.empty(8, 16)

    def keys():
        args = (_any_placement(a), _any_placement(b))
        return [strategy_key(s) for s in op_strategies(torch.ops.aten.mm.default, args, {}, out,
                                                       mesh_for(2))]  # fmt: skip

    first = keys()
    assert first == keys()
    assert "R, S(1) -> S(1)" in first
    assert len(set(first)) == len(first)


def test_attention_shards_heads_only_where_keys_have_as_many_heads():
    """Grouped keys and values (fewer heads than the queries) cannot follow a head split: each
    device would hold query heads whose key head is elsewhere."""
    q, kv = torch.empty(2, 4, 8, 4), torch.empty(2, 2, 8, 4)
    args = (_replicated(q), _replicated(kv), _replicated(kv))
    got = [describe_strategy(s) for s in op_strategies(SDPA, args, {}, q, MESH)]
    assert got == ["R, R, R -> R", "S(0), S(0), S(0) -> S(0)"]


CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_ATTENTION_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _cpu_attention(q_shape, kv_heads=None, mask_shape=None, backward=False):
    b, h, s, e = q_shape
    q, kv = torch.empty(q_shape), torch.empty(b, kv_heads or h, s, e)
    lse = torch.empty(b, h, s)
    kwargs = {}
    if mask_shape is not None:
        kwargs["attn_mask"] = _replicated(torch.empty(mask_shape))
    if backward:  # grad_out, q, k, v, out, logsumexp -> grads of q, k, v
        op, tensors, out = CPU_ATTENTION_BACKWARD, (q, q, kv, kv, q, lse), (q, kv, kv)
    else:  # q, k, v -> out, logsumexp
        op, tensors, out = CPU_ATTENTION, (q, kv, kv), (q, lse)
    args = (*(_replicated(t) for t in tensors), 0.0, True)
    return [describe_strategy(s) for s in op_strategies(op, args, kwargs, out, MESH)]


def test_cpu_flash_attention_shards_rows_or_heads_forward_and_backward():
    """DTensor has no rule for CPU flash attention; tessel's splits rows or whole heads of every
    tensor (the logsumexp too), so a network on DTensors runs it and the planner shards it."""
    assert has_rule(CPU_ATTENTION) and has_rule(CPU_ATTENTION_BACKWARD)
    assert _cpu_attention((2, 4, 8, 4)) == [
        "R, R, R -> (R, R)",
        "S(0), S(0), S(0) -> (S(0), S(0))",
        "S(1), S(1), S(1) -> (S(1), S(1))",
    ]
    assert _cpu_attention((2, 4, 8, 4), backward=True) == [
        "R, R, R, R, R, R -> (R, R, R)",
        "S(0), S(0), S(0), S(0), S(0), S(0) -> (S(0), S(0), S(0))",
        "S(1), S(1), S(1), S(1), S(1), S(1) -> (S(1), S(1), S(1))",
    ]


def test_cpu_flash_attention_splits_grouped_heads_evenly_and_keeps_broadcast_masks_whole():
    # grouped key/value heads: split with the queries' where both halve (each device keeps the
    # key/value heads its query heads read); one key/value head cannot be split
    assert _cpu_attention((2, 4, 8, 4), kv_heads=2)[2] == "S(1), S(1), S(1) -> (S(1), S(1))"
    assert _cpu_attention((2, 4, 8, 4), kv_heads=1) == [
        "R, R, R -> (R, R)",
        "S(0), S(0), S(0) -> (S(0), S(0))",
    ]
    # a mask of one row follows neither split; a mask of every head follows the head split
    assert _cpu_attention((2, 4, 8, 4), mask_shape=(1, 4, 8, 8)) == [
        "R, R, R, R -> (R, R)",
        "S(0), S(0), S(0), R -> (S(0), S(0))",
        "S(1), S(1), S(1), S(1) -> (S(1), S(1))",
    ]
    assert _cpu_attention((2, 4, 8, 4), mask_shape=(2, 1, 8, 8), backward=True)[2] == (
        "S(1), S(1), S(1), S(1), S(1), S(1), R -> (S(1), S(1), S(1))"
    )


@pytest.mark.parametrize("size", [(8, 6), (3,)])
def test_one_output_per_input_placement_the_one_dtensors_dispatch_gives(size):
    # new_zeros may replicate its output or, at its input's shape, follow the input: DTensor's
    # rule offers both, and its dispatch runs one; a plan counting on the other is refused late
    from torch.distributed.tensor import DTensor

    from tessel.lower.trace import fake_world

    x = torch.empty(8, 6)
    found = op_strategies(torch.ops.aten.new_zeros.default, (_any_placement(x), list(size)), {},
                          torch.empty(size), MESH)  # fmt: skip
    outputs: dict = {}
    for s in found:
        ins, out = _placements(s)
        outputs.setdefault(ins, []).append(out)
    assert len(outputs) == 3  # R, S(0) and S(1) inputs
    with fake_world(0, (2,)) as mesh:
        for (placements,), offered in outputs.items():
            local = DTensor.from_local(torch.empty(8, 6), mesh, [Replicate()], run_check=False)
            dispatched = local.redistribute(mesh, placements).new_zeros(size).placements
            assert offered == [tuple(dispatched)], (placements, offered)


def test_every_embedding_strategy_on_a_2d_mesh_runs_in_dtensor_as_offered():
    # DTensor keeps one mask per tensor, so a vocabulary split over both axes (the weight
    # S(0)/S(0), the output masked twice) cannot be made: it is not offered. Every strategy
    # that is offered runs as it says, moving nothing.
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    from tessel._torch import MaskPartial
    from tessel.lower.trace import fake_world

    weight, ids, out = torch.empty(16, 4), torch.zeros(4, 6, dtype=torch.long), torch.empty(4, 6, 4)

    def anywhere(t):
        specs = [s.output for s in placement_strategies(GRID, t)]
        return as_op_strategy(specs, GRID, tensor_meta(t))

    embedding = torch.ops.aten.embedding.default
    found = op_strategies(embedding, (anywhere(weight), anywhere(ids)), {}, out, GRID)
    masked = lambda spec: sum(isinstance(p, MaskPartial) for p in spec.placements)  # noqa: E731
    # the vocabulary split over one axis is offered, over both is not
    assert max(masked(s.single_output()) for s in found) == 1
    with fake_world(0, (2, 2)) as mesh:
        for s in found:
            w_at, ids_at = (tuple(spec.placements) for spec in s.inputs)
            # the lowering hands a replicated index to a lookup that masks it itself
            ids_at = tuple(Replicate() if isinstance(p, MaskPartial) else p for p in ids_at)
            whole = lambda t: DTensor.from_local(t, mesh, [Replicate()] * 2, run_check=False)  # noqa: E731
            w, i = whole(weight).redistribute(mesh, w_at), whole(ids).redistribute(mesh, ids_at)
            with CommDebugMode() as comms:
                got = embedding(w, i)
            assert comms.get_total_counts() == 0, describe_strategy(s)
            assert tuple(map(str, got.placements)) == tuple(map(str, s.single_output().placements))
