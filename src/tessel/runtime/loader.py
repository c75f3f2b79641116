"""Load one rank of an offline model: its program and its weights, on a device."""

from __future__ import annotations

import torch
from torch import fx

from tessel.dtypes import torch_dtype
from tessel.lower.program import decode
from tessel.package.format import CONSTANT_PREFIX, Package, PackageError


def load_rank(
    package: Package, rank: int, device: torch.device, groups: dict[tuple[int, ...], str]
) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """The rank's program and its weight inputs in program order."""
    programs, weights = load_programs(package, rank, device, groups)
    return programs[1 if package.manifest.generation is not None else None], weights


BACKWARD = "backward"  # a training pipeline stage's backward pass, among a rank's programs


def load_programs(
    package: Package, rank: int, device: torch.device, groups: dict[tuple[int, ...], str]
) -> tuple[dict[int | str | None, fx.GraphModule], list[torch.Tensor]]:
    """The rank's programs and its weight inputs in program order, its members read once: its
    program under None (a training pipeline stage's backward pass beside it, under
    `BACKWARD`), or a generation package's gears by prompt length (1: decode) and its one-row
    prefill gears under `row_gear(length)`."""
    sub = package.submodel(rank)
    tensors = package.weights(sub)
    constants = {
        k.removeprefix(CONSTANT_PREFIX): v
        for k, v in tensors.items()
        if k.startswith(CONSTANT_PREFIX)
    }
    state = _state(package, rank, device)
    missing = [name for name in sub.weight_order if name not in tensors and name not in state]
    if missing:
        raise PackageError(
            package.path, f"rank {rank} needs weights its members do not hold: {missing[:5]}"
        )
    weights = [
        state[name] if name in state else tensors[name].to(device) for name in sub.weight_order
    ]
    main = 1 if package.manifest.generation is not None else None
    members: dict[int | str | None, str] = {**sub.gears, main: sub.program}
    members.update({row_gear(n): member for n, member in sub.row_gears.items()})
    if sub.passes is not None:
        members[BACKWARD] = sub.passes.backward
    programs = {
        key: _program(package, rank, member, constants, device, groups, _taken(package, rank, key))
        for key, member in members.items()
    }
    return programs, weights


_ROW_GEAR = "row_"


def row_gear(length: int) -> str:
    """The key of the one-row prefill gear of `length` tokens among a rank's programs."""
    return f"{_ROW_GEAR}{length}"


def _taken(package: Package, rank: int, key: int | str | None) -> int:
    """What the program `key` of `rank` takes beside its weights and the model's inputs: a
    one-row prefill gear the row it writes, a training pipeline stage's pass what other passes
    hand it."""
    if isinstance(key, str) and key.startswith(_ROW_GEAR):
        return 1
    passes = package.submodel(rank).passes
    if passes is None:
        return 0
    return passes.taken("B" if key == BACKWARD else "F", package.manifest.mesh.stage_of(rank))


def _state(package: Package, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The state `rank` holds (a generation package's cache), zero: never stored."""
    sub = package.submodel(rank)
    gears = package.manifest.generation
    if not sub.state:
        return {}
    dtypes = {x.name: torch_dtype(x.dtype) for x in gears.state}  # every name: the manifest
    return {
        name: torch.zeros(shape, dtype=dtypes[name], device=device)
        for name, shape in sub.state_shapes().items()
    }


def _program(
    package: Package,
    rank: int,
    member: str,
    constants: dict[str, torch.Tensor],
    device: torch.device,
    groups: dict[tuple[int, ...], str],
    taken: int = 0,
) -> fx.GraphModule:
    """One program member of `rank`, checked to take its weights, the model's inputs and
    `taken` more (a training pipeline stage's pass: what other passes hand it)."""
    sub = package.submodel(rank)
    program = package.json(member)
    takes = len(sub.weight_order) + len(package.manifest.inputs) + taken
    if isinstance(program, dict) and isinstance(program.get("nodes"), list):
        found = sum(isinstance(n, dict) and n.get("op") == "input" for n in program["nodes"])
        if found != takes:
            raise PackageError(
                package.path,
                f"the program {member} of rank {rank} takes {found} inputs; its weights and the "
                f"model's inputs are {takes - taken}"
                + (f", and it takes {taken} more" if taken else ""),
            )
    return decode(program, constants, device, groups)
