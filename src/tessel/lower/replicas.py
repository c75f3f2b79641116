"""Data-parallel replicas of tensor-parallel programs.

On a `dp x tp` mesh the model is planned and lowered once for the `tp` devices of one replica,
on a `1/dp` share of the batch. Replica `d` runs the same programs with three changes, made here
to the lowered programs themselves, so the runtime needs nothing new:
- each batched input is sliced to the replica's rows (every rank receives the whole batch);
- each collective runs over that replica's ranks (`d * tp + t` for tensor-parallel rank `t`);
- each output is all-gathered over the data-parallel group of its rank, in replica order, so
  rank 0 returns the whole batch as the single-device model does.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from tessel.errors import TesselError
from tessel.lower.trace import RankProgram

_SLICE = "aten.slice.Tensor"
_GATHER = "_c10d_functional.all_gather_into_tensor.default"
_WAIT = "_c10d_functional.wait_tensor.default"


class ReplicaError(TesselError, ValueError):
    """A model whose inputs or outputs cannot be split over data-parallel replicas."""


def replicate(
    programs: list[RankProgram], dp: int, user_inputs: int, batch: int
) -> list[RankProgram]:
    """The programs of every rank of a `dp x tp` mesh (rank `d * tp + t`), from the programs of
    the `tp` ranks of one replica, lowered for `batch` rows (the replica's share)."""
    tp = len(programs)
    return [
        _replica(programs[t], d, t, dp, tp, user_inputs, batch)
        for d in range(dp)
        for t in range(tp)
    ]


def _replica(
    rp: RankProgram, d: int, t: int, dp: int, tp: int, user_inputs: int, batch: int
) -> RankProgram:
    program = copy.deepcopy(rp.program)
    nodes = program["nodes"]
    shapes = dict(rp.shapes)
    inputs = [i for i, n in enumerate(nodes) if n["op"] == "input"]
    renamed: dict[str, str] = {}
    sliced = []
    for i in inputs[len(inputs) - user_inputs :]:
        name = nodes[i]["name"]
        shape, dtype = shapes[name]
        if not shape or shape[0] != batch:
            raise ReplicaError(
                f"model input {name!r} of shape {shape} has no batch dimension of {batch} rows "
                "first; data parallelism splits every input along its first dimension"
            )
        new = f"{name}__replica"
        renamed[name] = new
        shapes[new] = ([batch, *shape[1:]], dtype)
        sliced.append(_call(new, _SLICE, [{"$node": name}, 0, d * batch, (d + 1) * batch, 1]))
    at = inputs[-1] + 1 if inputs else 0
    body = [_renamed(n, renamed) for n in nodes[at:]]
    for n in body:
        _regroup(n, d * tp)
    output = body[-1]
    gathers = []
    group = {"$group": [r * tp + t for r in range(dp)]}

    def gathered(value: Any) -> Any:
        if isinstance(value, list):
            return [gathered(v) for v in value]
        if isinstance(value, dict) and "$node" in value:
            name = value["$node"]
            if f"{name}__replicas" in shapes:  # an output returned twice is gathered once
                return {"$node": f"{name}__replicas"}
            shape, dtype = shapes[name]
            if not shape or shape[0] != batch:
                raise ReplicaError(
                    f"model output {name!r} of shape {shape} has no batch dimension of {batch} "
                    "rows first; data parallelism gathers every output along its first dimension"
                )
            ag, wait = f"{name}__gather", f"{name}__replicas"
            shapes[ag] = shapes[wait] = ([dp * batch, *shape[1:]], dtype)
            gathers.append(_call(ag, _GATHER, [value, dp, group]))
            gathers.append(_call(wait, _WAIT, [{"$node": ag}]))
            return {"$node": wait}
        return value

    output["args"] = gathered(output["args"])
    program["nodes"] = nodes[:at] + sliced + body[:-1] + gathers + [output]
    return replace(rp, program=program, shapes=shapes)


def _call(name: str, target: str, args: list) -> dict:
    return {"op": "call", "name": name, "target": target, "args": args, "kwargs": {}}


def _renamed(node: dict, names: dict[str, str]) -> dict:
    def sub(value: Any) -> Any:
        if isinstance(value, list):
            return [sub(v) for v in value]
        if isinstance(value, dict):
            if "$node" in value and value["$node"] in names:
                return {"$node": names[value["$node"]]}
            return {k: sub(v) for k, v in value.items()}
        return value

    return sub(node)


def _regroup(node: dict, offset: int) -> None:
    """Move every collective group of `node` by `offset` ranks (to another replica's ranks)."""

    def sub(value: Any) -> Any:
        if isinstance(value, list):
            return [sub(v) for v in value]
        if isinstance(value, dict):
            if "$group" in value:
                return {"$group": [r + offset for r in value["$group"]]}
            return {k: sub(v) for k, v in value.items()}
        return value

    for key in ("args", "kwargs"):
        if key in node:
            node[key] = sub(node[key])
