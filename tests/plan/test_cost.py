"""The cost model, value by value: alpha-beta ring collectives, the collective each placement
change needs, resharding time, shard factors, flops and the compute roofline.

Expected values are worked out by hand in each test from the textbook formulas, so a change to
a formula shows up as a wrong number, not as a changed snapshot.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from tessel.config.cluster import local_cluster
from tessel.plan import cost

# 1 GB/s links with 10 us per step: volumes and latencies give round numbers
LINKS = cost.Links(bandwidth=1e9, latency=1e-5)
SLOW = cost.Links(bandwidth=1e8, latency=1e-3)
MB4 = 4e6  # a 4 MB tensor


def test_ring_all_reduce_sends_twice_n_minus_one_over_n():
    # 2(n-1) steps of alpha, and 2(n-1)/n of the buffer over the link
    assert cost.all_reduce_time(MB4, 4, LINKS) == pytest.approx(6 * 1e-5 + 1.5 * 4e-3)
    assert cost.all_reduce_time(MB4, 2, LINKS) == pytest.approx(2 * 1e-5 + 1.0 * 4e-3)
    assert cost.all_reduce_time(MB4, 4, SLOW) == pytest.approx(6 * 1e-3 + 1.5 * 4e-2)


def test_an_all_reduce_in_one_pass_meets_as_often_as_an_all_gather():
    # CPU workers of one machine reduce where they meet: the steps of one all-gather, the
    # ring's volume
    one_pass = cost.Links(bandwidth=1e9, latency=1e-5, one_pass=True)
    assert cost.all_reduce_time(MB4, 4, one_pass) == pytest.approx(3 * 1e-5 + 1.5 * 4e-3)
    assert cost.all_reduce_time(4, 4, one_pass) == pytest.approx(
        cost.all_gather_time(4, 4, one_pass), rel=1e-3
    )
    assert cost.all_reduce_time(MB4, 1, one_pass) == 0.0


def test_cpu_workers_sum_a_row_wise_matmul_rather_than_hold_its_weight_whole(monkeypatch):
    # one token through an MLP on 2 CPU devices: summing the row-wise matmul's partial
    # results meets once, as gathering its input for a replicated weight does, and reads half
    # of the weight
    from tessel.capture import capture
    from tessel.config.parallel_option import ParallelOption
    from tessel.plan import has_rule, make_plan

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(1024, 2048, bias=False),
        torch.nn.ReLU(),
        torch.nn.Linear(2048, 1024, bias=False),
    )
    captured = capture(mlp, (torch.randn(1, 1024),), keep=has_rule)
    plan = make_plan(captured, local_cluster(2), ParallelOption())
    placements = plan.param_placements()
    assert placements["0.weight"] == (Shard(0),), placements
    assert placements["2.weight"] == (Shard(1),), placements


def test_ring_all_gather_and_reduce_scatter_send_n_minus_one_over_n():
    assert cost.all_gather_time(MB4, 4, LINKS) == pytest.approx(3 * 1e-5 + 0.75 * 4e-3)
    assert cost.all_gather_time(MB4, 8, LINKS) == pytest.approx(7 * 1e-5 + 0.875 * 4e-3)
    # a reduce-scatter moves the same volume in the same number of steps
    assert cost.reduce_scatter_time(MB4, 4, LINKS) == pytest.approx(3 * 1e-5 + 0.75 * 4e-3)
    # an all-reduce is a reduce-scatter followed by an all-gather
    assert cost.all_reduce_time(MB4, 4, LINKS) == pytest.approx(
        cost.reduce_scatter_time(MB4, 4, LINKS) + cost.all_gather_time(MB4, 4, LINKS)
    )


def test_all_to_all_exchanges_a_share_of_each_rank_s_part():
    # each rank holds 1 MB of the 4 MB and sends 3/4 of it
    assert cost.all_to_all_time(MB4, 4, LINKS) == pytest.approx(3 * 1e-5 + 0.75 * 1e-3)


@pytest.mark.parametrize(
    "collective",
    [cost.all_reduce_time, cost.all_gather_time, cost.reduce_scatter_time, cost.all_to_all_time],
)
@pytest.mark.parametrize("n", [0, 1])
def test_a_collective_over_one_device_is_free(collective, n):
    assert collective(MB4, n, LINKS) == 0.0


def test_links_of_a_cluster_take_its_bandwidth_and_its_soc_s_latency():
    cluster = local_cluster(2, "cpu")
    links = cost.Links.of(cluster)
    soc = cluster.soc
    assert links == cost.Links(cluster.bandwidth([0, 1]), soc.link_latency, True, soc.op_overhead)
    # a GPU's collectives run as rings
    gpu = local_cluster(2, "H100")
    assert not cost.Links.of(gpu).one_pass
    assert cost.Links.of(cluster, [0]).bandwidth == cluster.bandwidth([0])


R, S0, S1, P, AVG = Replicate(), Shard(0), Shard(1), Partial(), Partial("avg")

TRANSITIONS = [
    (R, R, None),
    (R, S0, "local"),  # each rank slices its own copy
    (R, P, "local"),  # keep one copy, zero the others
    (S0, S0, None),
    (S0, R, "all_gather"),
    (S0, S1, "all_gather"),  # gathered whole, then sliced (DTensor on CPU meshes)
    (S0, P, "all_gather"),  # through Replicate
    (P, P, None),
    (P, R, "all_reduce"),
    (P, S0, "reduce_scatter"),
    (P, S1, "reduce_scatter"),
    (P, AVG, "all_reduce"),  # another reduction: reduce, then hold as the new partial
]


@pytest.mark.parametrize("src,dst,expected", TRANSITIONS)
def test_transition_for_every_pair_of_placements(src, dst, expected):
    assert cost.transition(src, dst) == expected


def test_transition_table_covers_every_pair_of_kinds():
    kinds = {(type(a), type(b)) for a, b, _ in TRANSITIONS}
    assert kinds == {
        (a, b) for a in (Replicate, Shard, Partial) for b in (Replicate, Shard, Partial)
    }


def test_redistribute_time_on_a_1d_mesh():
    mesh = (4,)
    t = cost.redistribute_time
    assert t((S0,), (R,), MB4, mesh, [LINKS]) == pytest.approx(3 * 1e-5 + 0.75 * 4e-3)
    assert t((P,), (R,), MB4, mesh, [LINKS]) == pytest.approx(6 * 1e-5 + 1.5 * 4e-3)
    assert t((P,), (S0,), MB4, mesh, [LINKS]) == pytest.approx(3 * 1e-5 + 0.75 * 4e-3)
    assert t((R,), (S1,), MB4, mesh, [LINKS]) == 0.0
    # a local slice sends nothing and costs one operator each rank runs
    sliced = cost.Links(bandwidth=1e9, latency=1e-5, local_op=2e-6)
    assert t((R,), (S1,), MB4, mesh, [sliced]) == pytest.approx(2e-6)
    assert t((R,), (S1,), MB4, (1,), [sliced]) == 0.0
    assert t((S0,), (S0,), MB4, mesh, [LINKS]) == 0.0
    # the links of the mesh dimension are the ones used
    assert t((S0,), (R,), MB4, mesh, [SLOW]) == pytest.approx(3 * 1e-3 + 0.75 * 4e-2)


def test_redistribute_time_on_a_2d_mesh_moves_what_the_other_dims_leave():
    # mesh 2 x 4: dim 0 keeps the tensor sharded in two, so the all-reduce over dim 1 moves 2 MB
    mesh = (2, 4)
    got = cost.redistribute_time((S0, P), (S0, R), MB4, mesh, [SLOW, LINKS])
    assert got == pytest.approx(6 * 1e-5 + 1.5 * 2e-3)
    # both dims change: a gather of the whole over dim 0 (n=2, the other dim Partial: whole),
    # and an all-reduce of half of it (dim 0 is a shard in the source) over dim 1
    got = cost.redistribute_time((S0, P), (R, R), MB4, mesh, [SLOW, LINKS])
    gather = 1 * 1e-3 + 0.5 * MB4 / 1e8
    reduce = 6 * 1e-5 + 1.5 * 2e6 / 1e9
    assert got == pytest.approx(gather + reduce)


def test_largest_share_counts_shards_and_the_longest_uneven_shard():
    assert cost.largest_share(None, (4,)) == 1
    assert cost.largest_share((R,), (4,)) == 1
    assert cost.largest_share((S1,), (4,)) == 1 / 4
    assert cost.largest_share((P,), (4,)) == 1  # a partial sum is whole on every device
    assert cost.largest_share((S0, R), (2, 4)) == 1 / 2
    assert cost.largest_share((R, S0), (2, 4)) == 1 / 4
    assert cost.largest_share((P, S1), (2, 4)) == 1 / 4
    # torch.chunk's cut: 10 rows over 4 devices is 3, 3, 3, 1; 8 heads over 6 is 2, 2, 2, 2
    assert cost.largest_share((S0,), (4,), (10, 5)) == 3 / 10
    assert cost.largest_share((S1,), (6,), (3, 8)) == 2 / 8
    assert cost.largest_share((S0,), (4,), (8, 5)) == 1 / 4
    # a dim split on two mesh axes: 10 -> 5 -> 3 rows
    assert cost.largest_share((S0, S0), (2, 2), (10,)) == 3 / 10


def test_an_ops_work_splits_where_an_operand_is_sharded():
    x, w = (64, 256), (256, 512)
    # a matmul of shards split on the summed dim: half the work on each device, a Partial out
    assert cost.work_share([((S1,), x), ((S0,), w)], ((P,), (64, 512)), (2,)) == 1 / 2
    # column parallel: the weight's columns split, the output's too
    assert cost.work_share([((R,), x), ((S1,), w)], ((S1,), (64, 512)), (2,)) == 1 / 2
    # a Partial operand is whole on every device: each does all of the work
    assert cost.work_share([((R,), x), ((P,), w)], ((P,), (64, 512)), (2,)) == 1
    assert cost.work_share([((P,), x)], ((P,), x), (4,)) == 1
    # an op that makes its own slice of a replicated input, and one with no inputs
    assert cost.work_share([((R,), x)], ((S0,), x), (4,)) == 1 / 4
    assert cost.work_share([], ((S0,), (10,)), (4,)) == 3 / 10
    assert cost.work_share([((R,), x)], None, (4,)) == 1


def test_nbytes_of_tensors_and_tuples():
    assert cost.nbytes(torch.empty(3, 5)) == 60
    assert cost.nbytes(torch.empty(3, 5, dtype=torch.bfloat16)) == 30
    assert cost.nbytes((torch.empty(2), [torch.empty(4, dtype=torch.int64)])) == 8 + 32
    assert cost.nbytes(7) == 0
    assert cost.nbytes(None) == 0


def test_flops_of_matmuls_are_two_m_n_k():
    a, b, out = torch.empty(8, 32), torch.empty(32, 16), torch.empty(8, 16)
    assert cost.flops("aten.mm.default", out, [a, b]) == 2 * 8 * 16 * 32
    assert cost.flops("mm", out, [a, b]) == 2 * 8 * 16 * 32
    # addmm's bias comes first and does not change k
    assert cost.flops("aten.addmm.default", out, [torch.empty(16), a, b]) == 2 * 8 * 16 * 32
    bout = torch.empty(4, 8, 16)
    bmm = cost.flops("aten.bmm.default", bout, [torch.empty(4, 8, 32), torch.empty(4, 32, 16)])
    assert bmm == 2 * 4 * 8 * 16 * 32


def test_flops_of_attention_count_every_query_key_pair():
    """Attention as the matmuls of its math: scores = q @ k^T, then scores @ v; the backward
    recomputes the scores and does four more (the gradients of v, the scores, q and k)."""
    b, h, lq, lk, d = 2, 4, 16, 24, 8
    q, k, v = torch.empty(b, h, lq, d), torch.empty(b, h, lk, d), torch.empty(b, h, lk, d)
    out, scores = torch.empty(b, h, lq, d), torch.empty(b * h, lq, lk)
    one = cost.flops("aten.bmm.default", scores, [q.view(-1, lq, d), torch.empty(b * h, d, lk)])
    assert one == cost.flops("aten.bmm.default", out.view(-1, lq, d), [scores, v.view(-1, lk, d)])
    forward = cost.flops("aten.scaled_dot_product_attention.default", out, [q, k, v])
    assert forward == 2 * one
    # the CPU kernel also returns the log-sum-exp
    cpu = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert cost.flops(cpu, (out, torch.empty(b, h, lq)), [q, k, v]) == forward
    backward = cost.flops(
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
        (q, k, v),
        [out, q, k, v, out, torch.empty(b, h, lq)],
    )
    assert backward == 5 * one
    assert forward > 10 * out.numel()  # far more than one per output element


def test_an_optimizer_step_costs_a_dispatch_per_operation_and_passes_over_its_bytes():
    dispatch = 1e-6
    # AdamW: 9 operations per weight and one per state; SGD without momentum: one
    assert cost.update_time("AdamW", 2, 10, 0, 1e9, dispatch) == pytest.approx(10 * 11 * dispatch)
    assert cost.update_time("SGD", 0, 10, 0, 1e9, dispatch) == pytest.approx(10 * dispatch)
    # SGD reads the weight and its gradient and writes the weight; each state is read and written
    assert cost.update_time("SGD", 0, 0, 1e9, 1e9, 0) == pytest.approx(3.0)
    assert cost.update_time("SGD", 1, 0, 1e9, 1e9, 0) == pytest.approx(5.0)
    assert cost.update_time("Adam", 2, 1, 1e6, 1e9, dispatch) < cost.update_time(
        "AdamW", 2, 1, 1e6, 1e9, dispatch
    )


def test_flops_of_other_ops_are_one_per_output_element():
    x = torch.empty(6, 7)
    assert cost.flops("aten.add.Tensor", x, [x, x]) == 42
    assert cost.flops("aten.relu.default", x, [x]) == 42
    # a matmul name with no matrix argument is counted as elementwise
    assert cost.flops("aten.mm.default", x, [torch.empty(3)]) == 42
    assert cost.flops("aten.split.Tensor", (x, x), [x]) == 0.0
    assert cost.flops("aten.sym_size.int", 3, [x]) == 0.0


def test_compute_time_is_the_slower_of_arithmetic_and_memory():
    # compute-bound: 2e12 flops at 1e12 flop/s = 2 s; 1 MB at 1 GB/s = 1 ms
    assert cost.compute_time(2e12, 1e6, 1e12, 1e9) == pytest.approx(2.0)
    # memory-bound: 1e6 flops = 1 us; 3 GB at 1 GB/s = 3 s
    assert cost.compute_time(1e6, 3e9, 1e12, 1e9) == pytest.approx(3.0)
    # balanced
    assert cost.compute_time(1e12, 1e9, 1e12, 1e9) == pytest.approx(1.0)


def test_gathers_of_uneven_shards_move_padded_shards():
    t = cost.redistribute_time
    even = t((S0,), (R,), 1200, (4,), [LINKS], shape=(12, 25))
    assert t((S0,), (R,), 1000, (4,), [LINKS], shape=(10, 25)) == pytest.approx(even)
    assert t((P,), (S1,), 1000, (4,), [LINKS], shape=(10, 25)) == pytest.approx(
        cost.reduce_scatter_time(1000 * 28 / 25, 4, LINKS)
    )
    # an all-reduce moves the whole tensor whatever its shape; without a shape, no padding
    assert t((P,), (R,), 1000, (4,), [LINKS], shape=(10, 25)) == t((P,), (R,), 1000, (4,), [LINKS])
    assert t((S0,), (R,), 1000, (4,), [LINKS]) == cost.all_gather_time(1000, 4, LINKS)


def test_each_device_pays_for_dispatching_every_operator_and_a_run_for_its_session():
    # dispatching is the same for every strategy of a node: at one choice, it moves the
    # estimate by what the planned operators cost, and by one operator per local slice
    from dataclasses import replace

    from tests.conftest import small_llama, token_ids

    from tessel.capture import capture
    from tessel.config.parallel_option import ParallelOption
    from tessel.plan import has_rule, make_plan
    from tessel.plan.planner import device_rates, run_seconds

    captured = capture(small_llama(), (token_ids(),), keep=has_rule)
    cluster = local_cluster(2)

    def with_soc(**figures: float):
        return replace(cluster, soc=replace(cluster.soc, **figures))

    quiet = make_plan(captured, with_soc(op_overhead=0.0), ParallelOption())
    dispatched = make_plan(captured, with_soc(op_overhead=1e-3), ParallelOption())
    planned = [n for n, c in quiet.choices.items() if c.kind in ("op", "fallback", "factory")]
    views = sum(cost.is_view(str(n.target)) for n in planned)
    ops = len(planned) - views
    assert ops > 20 and views > 10
    # each operator once per device, however small its shard, at its share of the host's
    # cores; a view for a share of that, as it runs no kernel
    choice = dispatched.choice
    extra = dispatched.problem.cost_of(choice) - quiet.problem.cost_of(choice)
    per_op = device_rates(with_soc(op_overhead=1e-3))[2]
    assert extra == pytest.approx(
        (ops + cost.VIEW_DISPATCH * views + len(local_slices(dispatched))) * per_op
    )
    assert dispatched.estimated_time == pytest.approx(dispatched.problem.cost_of(choice))
    # a run: the session's own cost, then rank 0 broadcasts its word and the input to rank 1
    none = with_soc(run_overhead=0.0)
    assert run_seconds(captured, none) == pytest.approx(
        2 * cluster.soc.link_latency + token_ids().numel() * 8 / cluster.bandwidth([0, 1])
    )
    assert run_seconds(captured, with_soc(run_overhead=0.5)) - run_seconds(
        captured, none
    ) == pytest.approx(0.5)


@pytest.mark.parametrize("cores", [1, 2, 4, 8])
def test_cpu_devices_run_at_their_share_of_the_cores_and_slower_where_they_outnumber_them(
    monkeypatch, cores
):
    from dataclasses import replace

    from tessel.plan.planner import device_rates

    monkeypatch.setattr("os.cpu_count", lambda: cores)
    cluster = local_cluster(4, "cpu")
    cluster = replace(cluster, soc=replace(cluster.soc, shared_core_slowdown=1.5))
    soc = cluster.soc
    share = min(1.0, cores / 4) / (1.5 if cores < 4 else 1.0)
    peak, bandwidth, overhead = device_rates(cluster)
    assert peak == pytest.approx(soc.peak_flops * share)
    assert bandwidth == pytest.approx(soc.memory_bandwidth * share)
    assert overhead == pytest.approx(soc.op_overhead / share)
    # a GPU's devices do not share a host's cores
    gpu = replace(cluster, soc=replace(soc, device_type="cuda"))
    assert device_rates(gpu) == (soc.peak_flops, soc.memory_bandwidth, soc.op_overhead)


@pytest.mark.parametrize("rows", [4, 4096])
def test_a_view_moves_no_bytes_and_costs_a_share_of_a_dispatch(rows):
    # a view returns its input's storage: whatever the tensor's size, it costs its dispatch
    from torch.fx.experimental.proxy_tensor import make_fx

    from tessel.plan.candidates import node_seconds

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.unsqueeze(0)[:, 1:] * 2).view(-1)

    graph = make_fx(f)(torch.randn(rows, 64)).graph
    calls = {str(n.target): n for n in graph.nodes if n.op == "call_function"}
    assert [cost.is_view(name) for name in calls] == [True, True, False, True]
    assert not cost.is_view("aten.copy_.default")  # writes through the storage it returns
    seconds = {name: node_seconds(n, 1e9, 1e9, 1e-6) for name, n in calls.items()}
    assert (
        seconds["aten.unsqueeze.default"]
        == seconds["aten.view.default"]
        == pytest.approx(cost.VIEW_DISPATCH * 1e-6)
    )
    # the multiply reads and writes every element, at 1 GB/s, and is dispatched whole
    assert seconds["aten.mul.Tensor"] == pytest.approx(2 * 4 * (rows - 1) * 64 / 1e9 + 1e-6)


def test_a_replicated_weight_is_read_whole_however_the_rows_are_split(monkeypatch):
    # a decode step's matmul: 4 rows through a 64 MiB weight on 4 devices. Splitting the rows
    # leaves each device reading the whole weight, so the plan splits the weight instead
    from tessel.capture import capture
    from tessel.config.parallel_option import ParallelOption
    from tessel.plan import has_rule, make_plan
    from tessel.plan.planner import device_rates

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    captured = capture(
        torch.nn.Linear(4096, 4096, bias=False), (torch.randn(4, 4096),), keep=has_rule
    )
    cluster = local_cluster(4)
    plan = make_plan(captured, cluster, ParallelOption())
    (matmul,) = [n for n, c in plan.choices.items() if c.kind == "op" and "mm" in str(n.target)]
    rows, weight = plan.strategy(matmul).inputs  # the weight, transposed
    assert isinstance(weight.placements[0], Shard) and isinstance(rows.placements[0], Replicate)
    rows_split = [
        k
        for k, s in enumerate(plan.choices[matmul].strategies)
        if s.inputs[0].placements == (Shard(0),) and s.inputs[1].placements == (Replicate(),)
    ]
    assert len(rows_split) == 1
    bandwidth = device_rates(cluster)[1]
    for k in rows_split:
        assert plan.problem.linear[matmul][k] >= 4096 * 4096 * 4 / bandwidth


def test_a_lookup_reads_its_rows_and_an_indexed_write_its_values_not_the_whole_tensor():
    # an embedding of 3 tokens reads 3 rows of its table, and a KV cache's new slot is
    # written in place without reading the cache: neither costs the big tensor's bytes
    from torch.fx.experimental.proxy_tensor import make_fx

    from tessel.plan.candidates import node_seconds

    def f(table: torch.Tensor, ids: torch.Tensor, cache: torch.Tensor, new: torch.Tensor):
        cache.index_put_((torch.tensor([5]),), new)
        return torch.nn.functional.embedding(ids, table), cache.sum()

    graph = make_fx(f)(
        torch.randn(1000, 64), torch.tensor([1, 2, 3]), torch.zeros(64, 32), torch.ones(1, 32)
    ).graph
    calls = {str(n.target): n for n in graph.nodes if n.op == "call_function"}
    seconds = {name: node_seconds(n, 1e30, 1.0, 0.0) for name, n in calls.items()}
    # at 1 byte/s: the rows read and written, and the ids
    assert seconds["aten.embedding.default"] == 2 * 3 * 64 * 4 + 3 * 8
    # the values read and written, and the index
    assert seconds["aten.index_put_.default"] == 2 * 32 * 4 + 8
    # a reduction still reads all of what it reduces
    assert seconds["aten.sum.default"] == 64 * 32 * 4 + 4


def test_an_embedding_that_fits_is_replicated_rather_than_gathered_after_each_lookup():
    # a decode step looks up one token: sharding the table saves no reading, only memory,
    # and would gather the looked-up row over the devices every step
    from tessel.capture import capture
    from tessel.config.parallel_option import ParallelOption
    from tessel.plan import has_rule, make_plan

    captured = capture(torch.nn.Embedding(32000, 1024), (torch.tensor([[7]]),), keep=has_rule)
    plan = make_plan(captured, local_cluster(2), ParallelOption())
    (lookup,) = [n for n, c in plan.choices.items() if "embedding" in str(n.target)]
    table = plan.strategy(lookup).inputs[0]
    assert table.placements == (Replicate(),)


def local_slices(plan) -> list[tuple[str, str]]:
    """The edges (producer, consumer) of `plan` where a replicated value is cut to a shard or
    zeroed to a partial one by its consumer."""
    from tessel.plan.planner import _placements

    found = []
    for node in plan.choices:
        taken = plan.strategy(node).inputs
        for j, arg in enumerate(node.args):
            if not isinstance(arg, torch.fx.Node) or arg not in plan.choices or j >= len(taken):
                continue
            src, dst = plan.out_placements(arg), _placements(taken[j])
            if src and dst and any(cost.transition(a, b) == "local" for a, b in zip(src, dst)):
                found.append((arg.name, node.name))
    return found


def test_a_weight_stored_whole_and_sliced_every_run_costs_more_than_storing_its_shard():
    # with memory to spare, the two would tie but for the slice each run makes: the operator
    # that breaks the tie, so a plan never holds more than it needs for nothing
    from tests.conftest import hf_llama

    import tessel
    from tessel.capture.generation import capture_gear
    from tessel.config.parallel_option import ParallelOption
    from tessel.plan import has_rule, make_plan

    gen = tessel.Generation(max_batch_size=1, max_seq_len=32, prefill_lengths=(8,))
    gear = capture_gear(hf_llama(2, 512, 8, 8, 1000).eval(), gen, 1, keep=has_rule)
    gate = "model.model.layers.0.mlp.gate_proj.weight"  # the gear holds the model as `model`
    cluster = local_cluster(4)

    def placed(*placements: str):
        return make_plan(gear, cluster, ParallelOption(fixed_placements=((gate, placements),)))

    whole, shard = placed("R"), placed("S(0)")
    assert local_slices(whole) and not local_slices(shard)
    assert whole.estimated_time > shard.estimated_time
    free = make_plan(gear, cluster, ParallelOption())
    assert free.param_placements()[gate] == (Shard(0),)
    assert not local_slices(free)
