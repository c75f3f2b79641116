"""Load one rank of an offline model: its program and its weights, on a device."""

from __future__ import annotations

import torch
from torch import fx

from tessel.lower.program import decode
from tessel.package.format import CONSTANT_PREFIX, Package


def load_rank(
    package: Package, rank: int, device: torch.device, groups: dict[tuple[int, ...], str]
) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """The rank's program and its weight inputs in program order."""
    sub = package.submodel(rank)
    tensors = package.weights(sub)
    constants = {
        k.removeprefix(CONSTANT_PREFIX): v
        for k, v in tensors.items()
        if k.startswith(CONSTANT_PREFIX)
    }
    weights = [tensors[name].to(device) for name in sub["weight_order"]]
    return decode(package.json(sub["program"]), constants, device, groups), weights
