"""A network run on micro-batches of its inputs: GradAccumulation, MicroBatchInterleaved.

Each cuts every tensor input into equal slices along dim 0 and sums the network's outputs over
them, as MindSpore's do: `GradAccumulation` (a step's gradients accumulated over `micro_size`
micro-batches) and `MicroBatchInterleaved` (slices whose communication and computation can
overlap). Parameter names are the wrapped network's (`network.` prefixed, as a submodule).
"""

from __future__ import annotations

from typing import Any

import torch

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
            if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] % self.slices):
                raise ValueError(
                    f"{owner}: an input of shape {tuple(x.shape)} does not cut into "
                    f"{self.slices} equal slices along dim 0"
                )
        slices = [x.chunk(self.slices) if isinstance(x, torch.Tensor) else None for x in leaves]
        total = None
        for i in range(self.slices):
            part = [x if cut is None else cut[i] for x, cut in zip(leaves, slices)]
            a, k = tree_unflatten(part, spec)
            out = _tensor_output(self.network(*a, **k), owner)
            total = out if total is None else total + out
        return total


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


class GradAccumulation(_MicroBatches):
    """`network` run on `micro_size` dim-0 slices of its inputs, its outputs summed: one
    backward accumulates the gradients of every micro-batch."""

    def __init__(self, network: torch.nn.Module, micro_size: int) -> None:
        super().__init__(network, micro_size, "micro_size")


class MicroBatchInterleaved(_MicroBatches):
    """`network` run on `interleave_num` dim-0 slices of its inputs, its outputs summed."""

    def __init__(self, network: torch.nn.Module, interleave_num: int = 2) -> None:
        super().__init__(network, interleave_num, "interleave_num")
