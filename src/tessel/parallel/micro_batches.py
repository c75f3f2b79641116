"""A network run on micro-batches of its inputs: GradAccumulation, MicroBatchInterleaved.

Each cuts every tensor input into equal slices along dim 0 and sums the network's outputs over
them, as MindSpore's do (where the batch is split over the ranks, each rank cuts its own rows;
AutoParallel orders a batch every rank holds whole, "full_batch", so that micro-batch i is its
slice i):
`GradAccumulation` (a step's gradients accumulated over `micro_size` micro-batches) and
`MicroBatchInterleaved` (slices whose communication and computation can overlap). Parameter names are the wrapped network's (`network.` prefixed, as a submodule).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from tessel._torch import tree_flatten, tree_unflatten


def _count(owner: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {name} must be an int, found {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{owner}: {name} must be > 0, found {value}")
    return value


class _MicroBatches(torch.nn.Module):
    def __init__(self, network: torch.nn.Module, slices: int, name: str) -> None:
        super().__init__()
        owner = type(self).__name__
        if not isinstance(network, torch.nn.Module):
            raise TypeError(
                f"{owner}: network must be a torch.nn.Module, found {type(network).__name__}"
            )
        self.network = network
        self.slices = _count(owner, name, slices)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        owner = type(self).__name__
        leaves, spec = tree_flatten((args, kwargs))
        for x in leaves:
            rows = _rows(x) if isinstance(x, torch.Tensor) else None
            if rows is not None and (rows.dim() == 0 or rows.shape[0] % self.slices):
                raise ValueError(
                    f"{owner}: an input of shape {tuple(rows.shape)} (on this rank) does not "
                    f"cut into {self.slices} equal slices along dim 0"
                )
        slices = [_cut(x, self.slices) if isinstance(x, torch.Tensor) else None for x in leaves]
        total = None
        for i in range(self.slices):
            part = [x if cut is None else cut[i] for x, cut in zip(leaves, slices)]
            a, k = tree_unflatten(part, spec)
            out = _tensor_output(self.network(*a, **k), owner)
            total = out if total is None else total + out
        return total


def _rows(x: torch.Tensor) -> torch.Tensor:
    """The rows of `x` this rank cuts: its own where its rows are split over the ranks."""
    return x.to_local() if _split_by_rows(x) else x


def _split_by_rows(x: torch.Tensor) -> bool:
    return isinstance(x, DTensor) and x.placements == (Shard(0),)


def _cut(x: torch.Tensor, slices: int) -> list[torch.Tensor]:
    """`x` in `slices` dim-0 slices. Rows split over the ranks (a data-parallel input) are cut
    on each rank, as each rank cuts its own batch: slice i holds every rank's i-th part."""
    if not _split_by_rows(x):
        return list(x.chunk(slices))
    shape = torch.Size((x.shape[0] // slices, *x.shape[1:]))
    return [
        DTensor.from_local(
            part, x.device_mesh, x.placements, run_check=False, shape=shape, stride=part.stride()
        )
        for part in x.to_local().chunk(slices)
    ]


def _tensor_output(out: Any, owner: str) -> torch.Tensor:
    """The network's output as a tensor: itself, or a `transformers` output's `.loss`."""
    if not isinstance(out, torch.Tensor):
        out = getattr(out, "loss", None)
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"{owner}: the network must return a tensor (or an output with .loss), found "
            f"{type(out).__name__}"
        )
    return out


def micro_batch_count(network: torch.nn.Module) -> int:
    """How many micro-batches the wrappers at the top of `network` cut its inputs into (nested
    ones multiply); 1 without any."""
    count = 1
    while isinstance(network, _MicroBatches):
        count *= network.slices
        network = network.network
    return count


def regroup_rows(x: torch.Tensor, outer: int, inner: int) -> torch.Tensor:
    """`x` with its rows taken as `outer` groups of `inner` equal blocks, regrouped as `inner`
    groups of `outer` blocks: block j of group i becomes block i of group j.

    With the whole batch's rows, `regroup_rows(x, micro, parts)` puts them in the order in
    which `parts` ranks (or replicas), each cutting its own rows into `micro` micro-batches,
    run the whole batch's micro-batches in order: micro-batch i is the whole batch's slice i,
    its rows split over the parts. `regroup_rows(x, parts, micro)` undoes it."""
    return x.reshape(outer, inner, -1, *x.shape[1:]).transpose(0, 1).reshape(x.shape)


class GradAccumulation(_MicroBatches):
    """`network` run on `micro_size` dim-0 slices of its inputs, its outputs summed: one
    backward accumulates the gradients of every micro-batch.

    Args:
        network: The network, returning its loss.
        micro_size: The micro-batches each call's rows are cut into.
    """

    def __init__(self, network: torch.nn.Module, micro_size: int) -> None:
        super().__init__(network, micro_size, "micro_size")


class MicroBatchInterleaved(_MicroBatches):
    """`network` run on `interleave_num` dim-0 slices of its inputs, its outputs summed.

    Args:
        network: The network.
        interleave_num: The slices each call's rows are cut into.
    """

    def __init__(self, network: torch.nn.Module, interleave_num: int = 2) -> None:
        super().__init__(network, interleave_num, "interleave_num")
