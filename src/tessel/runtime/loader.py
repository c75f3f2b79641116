"""Load one rank of an offline model: its program and its weights, on a device."""

from __future__ import annotations

import torch
from torch import fx

from tessel.lower.program import decode
from tessel.package.format import CONSTANT_PREFIX, Package, PackageError


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
    missing = [name for name in sub.weight_order if name not in tensors]
    if missing:
        raise PackageError(
            package.path, f"rank {rank} needs weights its members do not hold: {missing[:5]}"
        )
    weights = [tensors[name].to(device) for name in sub.weight_order]
    program = package.json(sub.program)
    takes = len(sub.weight_order) + len(package.manifest.inputs)
    if isinstance(program, dict) and isinstance(program.get("nodes"), list):
        found = sum(isinstance(n, dict) and n.get("op") == "input" for n in program["nodes"])
        if found != takes:
            raise PackageError(
                package.path,
                f"the program of rank {rank} takes {found} inputs; its weights and the model's "
                f"inputs are {takes}",
            )
    return decode(program, constants, device, groups), weights
