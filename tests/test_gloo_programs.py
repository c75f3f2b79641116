"""Programs run on gloo take each reduce-scatter and each all-gather as one all-reduce, and
compute the same values on every rank of the group as the collectives they replace."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tests.conftest import start_ranks
from torch import fx

from tessel._torch import C10D_FUNCTIONAL
from tessel.runtime.gloo import collectives_as_all_reduces

_COLLECTIVE = getattr(torch.ops, C10D_FUNCTIONAL)
_WORLD = 3  # odd, so no rank's rows sit at the middle by accident


def _program(group: str) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    ids = graph.placeholder("ids")
    scattered = graph.call_function(
        _COLLECTIVE.reduce_scatter_tensor.default, (x, "sum", _WORLD, group)
    )
    gathered = graph.call_function(_COLLECTIVE.all_gather_into_tensor.default, (x, _WORLD, group))
    gathered_ids = graph.call_function(
        _COLLECTIVE.all_gather_into_tensor.default, (ids, _WORLD, group)
    )
    later = graph.call_function(torch.ops.aten.mul.Tensor, (x, 3.0))  # work between the two
    mine = graph.call_function(_COLLECTIVE.wait_tensor.default, (scattered,))
    whole = graph.call_function(_COLLECTIVE.wait_tensor.default, (gathered,))
    whole_ids = graph.call_function(_COLLECTIVE.wait_tensor.default, (gathered_ids,))
    graph.output(
        (graph.call_function(torch.ops.aten.add.Tensor, (mine, 1.0)), later, whole, whole_ids)
    )
    return fx.GraphModule(torch.nn.Module(), graph)


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.arange(36, dtype=torch.float32).reshape(9, 4) * (rank + 1) - 7.5
    x[0, 0] = float("inf") if rank == 1 else x[0, 0]
    return x, torch.tensor([[rank, -rank, 2**40 + rank]])


def _rank(rank: int, store: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=_WORLD)
    try:
        group = dist.group.WORLD.group_name
        program = _program(group)
        assert collectives_as_all_reduces(program, rank, {(0, 1, 2): group}) == 3
        targets = {n.target for n in program.graph.nodes}
        got = program(*_inputs(rank))
        results[rank] = (
            {_COLLECTIVE.reduce_scatter_tensor.default, _COLLECTIVE.all_gather_into_tensor.default}
            & targets,
            [(g.tolist(), g.dtype) for g in got],
            got[0].is_contiguous() and got[0].untyped_storage().nbytes() == got[0].nbytes,
        )
    finally:
        dist.destroy_process_group()


def test_reduce_scatters_and_all_gathers_on_gloo_become_all_reduces_with_the_same_values(tmp_path):
    results = mp.Manager().dict()
    start_ranks(_rank, (os.fspath(tmp_path / "store"), results), _WORLD)
    inputs = [_inputs(rank) for rank in range(_WORLD)]
    summed = sum(x for x, _ in inputs)
    for rank in range(_WORLD):
        still_there, got, own_storage = results[rank]
        x, _ = inputs[rank]
        assert not still_there
        assert got == [
            ((summed[3 * rank : 3 * rank + 3] + 1).tolist(), torch.float32),
            ((x * 3.0).tolist(), torch.float32),
            (torch.cat([x for x, _ in inputs]).tolist(), torch.float32),
            (torch.cat([ids for _, ids in inputs]).tolist(), torch.int64),
        ]
        assert own_storage  # its rows in a buffer of their own, not a view keeping the sum alive
