"""Programs run on gloo take each reduce-scatter as the all-reduce gloo performs for it, and
compute the same rows on every rank of the group."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import fx

from tessel._torch import C10D_FUNCTIONAL
from tessel.runtime.gloo import reduce_scatters_as_all_reduces

_COLLECTIVE = getattr(torch.ops, C10D_FUNCTIONAL)


def _program(group: str) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    scattered = graph.call_function(_COLLECTIVE.reduce_scatter_tensor.default, (x, "sum", 2, group))
    later = graph.call_function(torch.ops.aten.mul.Tensor, (x, 3.0))  # work between the two
    mine = graph.call_function(_COLLECTIVE.wait_tensor.default, (scattered,))
    graph.output((graph.call_function(torch.ops.aten.add.Tensor, (mine, 1.0)), later))
    return fx.GraphModule(torch.nn.Module(), graph)


def _rank(rank: int, store: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        group = dist.group.WORLD.group_name
        x = torch.arange(24, dtype=torch.float32).reshape(6, 4) * (rank + 1)
        program = _program(group)
        want = [t.clone() for t in program(x)]
        assert reduce_scatters_as_all_reduces(program, rank, {(0, 1): group}) == 1
        targets = {n.target for n in program.graph.nodes}
        got = program(x)
        results[rank] = (
            _COLLECTIVE.reduce_scatter_tensor.default in targets,
            [torch.equal(g, w) for g, w in zip(got, want)],
            got[0].is_contiguous() and got[0].untyped_storage().nbytes() == got[0].nbytes,
            got[0].tolist(),
        )
    finally:
        dist.destroy_process_group()


def test_a_reduce_scatter_on_gloo_becomes_an_all_reduce_and_each_rank_keeps_its_rows(tmp_path):
    results = mp.Manager().dict()
    mp.start_processes(
        _rank, args=(os.fspath(tmp_path / "store"), results), nprocs=2, start_method="spawn"
    )
    whole = (torch.arange(24, dtype=torch.float32).reshape(6, 4) * 3 + 1).tolist()
    for rank in (0, 1):
        still_scatters, same, own_storage, rows = results[rank]
        assert not still_scatters
        assert same == [True, True]
        assert own_storage  # its rows in a buffer of their own, not a view keeping the sum alive
        assert rows == whole[3 * rank : 3 * rank + 3]
