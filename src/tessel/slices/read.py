"""Pre-sliced models: one `.pt2` per rank, each a rank's local program with its collectives as
`torch.ops._c10d_functional` calls naming their group, checked against the relation config.

Each slice is read as data (`tessel.capture.pt2`: no pickle, no code), decomposed to
core ATen, and encoded as a tessel program whose groups are the relation config's rank lists, so
only the operators on tessel's list can run. Before anything is packed, the slices must agree:
every collective names a group that `comm_group` declares and that holds the slice's rank; the
ranks of a group issue the same collectives in the same order (kind, reduce op, shape, dtype), so a
mismatch fails the build instead of hanging the run; all slices take the same inputs.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessel._torch import C10D_FUNCTIONAL, OpOverload, tree_leaves
from tessel.capture.pt2 import RefusedArchiveError, load_pt2
from tessel.config.errors import ConfigError
from tessel.dtypes import dtype_name
from tessel.lower.operators import ALLOWED
from tessel.lower.program import ProgramError, encode, node_shapes, op_name
from tessel.slices.relation import ModelRelation, SliceEntry

log = logging.getLogger(__name__)

_WEIGHT_KINDS = ("PARAMETER", "BUFFER", "CONSTANT_TENSOR")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Slice:
    """One rank's slice, read and checked: its program (JSON), weights and interface."""

    entry: SliceEntry
    path: Path
    program: dict
    weights: dict[str, torch.Tensor]  # in the order the program takes them
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    # kind, group, shape, dtype, reduce op ("" for collectives that reduce nothing)
    collectives: list[tuple[str, tuple[int, ...], tuple, str, str]]
    shapes: dict[str, tuple[list[int], str]]  # node -> shape, dtype (bytes per collective)


def read_slices(
    directory: str | Path,
    relation: ModelRelation,
    cluster_ranks: dict[int, int],
    option: str = "--shard_model_dir",
) -> list[Slice]:
    """Every slice the relation config deploys, in its rank order, checked as the module says.

    `cluster_ranks` maps each slice rank to the rank of its device in the cluster: groups are
    recorded in cluster ranks, the ranks the workers' process groups use."""
    folder = Path(directory)
    if not folder.is_dir():
        raise ConfigError(option, None, f"{str(folder)!r} is not a directory")
    named = {s.submodel_name for s in relation.slices}
    for extra in sorted(p.name for p in folder.glob("*.pt2") if p.name not in named):
        log.warning(
            "%s: %s is not named in %s's deploy_config and is ignored",
            folder,
            extra,
            relation.source,
        )
    for name, ranks in relation.groups.items():
        moved = [cluster_ranks[r] for r in ranks]
        if moved != sorted(moved):
            raise relation.error(
                "comm_group",
                f"group {name!r} holds ranks {list(ranks)}, deployed on the cluster's ranks "
                f"{moved}; a group's ranks must keep their order on the cluster (its collectives "
                "put the ranks' parts together in that order): deploy them in the same order",
            )
    slices = [_read_one(folder, entry, relation, cluster_ranks) for entry in relation.slices]
    _check_inputs_agree(slices)
    _check_collectives_agree(slices, relation, cluster_ranks)
    return slices


def _read_one(
    folder: Path, entry: SliceEntry, relation: ModelRelation, cluster_ranks: dict[int, int]
) -> Slice:
    path = folder / entry.submodel_name
    if not path.is_file():
        raise relation.error(
            entry.key_path,
            f"{entry.submodel_name!r} is not in the slice directory {str(folder)!r} "
            f"(found: {sorted(p.name for p in folder.iterdir())[:8]})",
        )
    try:
        ep = load_pt2(path)
    except RefusedArchiveError as exc:
        raise ConfigError(path, None, str(exc)) from None
    signature = ep.graph_signature
    mutated = [s.target for s in signature.output_specs if s.kind.name != "USER_OUTPUT"]
    if mutated:
        raise ConfigError(
            path, None, f"writes into {mutated}; a slice may not change its weights or inputs"
        )
    if not _all_listed(ep.graph_module):  # a slice traced to ATen already is taken as it is
        try:
            ep = ep.run_decompositions()
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(path, None, f"cannot be decomposed to core ATen ({exc})") from None
    signature = ep.graph_signature
    gm = ep.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    weights: dict[str, torch.Tensor] = {}
    inputs: list[TensorInfo] = []
    tensors = {**ep.state_dict, **ep.constants}
    for node, spec in zip(placeholders, signature.input_specs):
        if spec.kind.name in _WEIGHT_KINDS:
            weights[spec.target] = tensors[spec.target]
        elif spec.kind.name == "USER_INPUT":
            inputs.append(_info(node.name, node.meta.get("val"), path))
        else:
            raise ConfigError(path, None, f"takes a {spec.kind.name.lower()} input {node.name!r}")
    group_of = _group_lookup(path, entry, relation, cluster_ranks)
    try:
        program, constants = encode(gm, group_of)
    except ProgramError as exc:
        raise ConfigError(path, None, str(exc)) from None
    if constants:
        raise ConfigError(path, None, f"holds constants outside its signature: {sorted(constants)}")
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = [
        _info(f"output {i}", getattr(a, "meta", {}).get("val"), path)
        for i, a in enumerate(tree_leaves(output.args[0]))
    ]
    return Slice(
        entry,
        path,
        program,
        weights,
        inputs,
        outputs,
        _collectives(gm, group_of),
        node_shapes(gm),
    )


def _all_listed(gm: torch.fx.GraphModule) -> bool:
    """Whether every operator the graph calls is on tessel's list."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is not operator.getitem:
            if not isinstance(n.target, OpOverload) or op_name(n.target) not in ALLOWED:
                return False
    return True


def _info(name: str, value: Any, path: Path) -> TensorInfo:
    if not isinstance(value, torch.Tensor):
        raise ConfigError(path, None, f"{name} is not a tensor (found {type(value).__name__})")
    shape = tuple(value.shape)
    if not all(isinstance(d, int) for d in shape):
        raise ConfigError(path, None, f"{name} has a dynamic shape {shape}; slices are static")
    return TensorInfo(name, shape, value.dtype)


def _group_lookup(
    path: Path, entry: SliceEntry, relation: ModelRelation, cluster_ranks: dict[int, int]
):
    def ranks(name: str) -> list[int]:
        if name not in relation.groups:
            raise ConfigError(
                path,
                None,
                f"a collective names group {name!r}, which {relation.source}'s comm_group does "
                f"not declare (declared: {sorted(relation.groups)})",
            )
        members = relation.groups[name]
        if entry.rank not in members:
            raise ConfigError(
                path,
                None,
                f"is rank {entry.rank}, but its collective's group {name!r} holds ranks "
                f"{list(members)}",
            )
        return [cluster_ranks[r] for r in members]

    return ranks


def _collectives(gm: torch.fx.GraphModule, group_of) -> list[tuple]:
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or not str(n.target).startswith(C10D_FUNCTIONAL):
            continue
        kind = str(n.target).split(".")[1]
        if kind == "wait_tensor":
            continue
        group = _argument(n, "group_name")
        value = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
        dtype = dtype_name(value.dtype) if isinstance(value, torch.Tensor) else ""
        reduce_op = str(_argument(n, "reduce_op") or "")
        out.append((kind, tuple(group_of(group)) if group else (), shape, dtype, reduce_op))
    return out


def _argument(node: torch.fx.Node, name: str) -> Any:
    """The value `node` passes for its operator's argument `name` (None: not passed)."""
    if not isinstance(node.target, OpOverload):
        return None
    for i, argument in enumerate(node.target._schema.arguments):
        if argument.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name)
    return None


def _check_inputs_agree(slices: list[Slice]) -> None:
    first = slices[0]
    want = [(i.shape, i.dtype) for i in first.inputs]
    for s in slices[1:]:
        got = [(i.shape, i.dtype) for i in s.inputs]
        if got != want:
            raise ConfigError(
                s.path,
                None,
                f"takes inputs {_show(got)}, but {first.path.name} (rank {first.entry.rank}) "
                f"takes {_show(want)}; every slice takes the model's inputs alike",
            )


def _show(items: list[tuple]) -> str:
    return "[" + ", ".join(f"{dtype_name(d)}{list(s)}" for s, d in items) + "]"


def _check_collectives_agree(
    slices: list[Slice], relation: ModelRelation, cluster_ranks: dict[int, int]
) -> None:
    """The ranks of each group issue the same collectives in the same order."""
    by_rank = {s.entry.rank: s for s in slices}
    for name, ranks in relation.groups.items():
        group = tuple(cluster_ranks[r] for r in ranks)
        calls = {r: [c for c in by_rank[r].collectives if c[1] == group] for r in ranks}
        first = ranks[0]
        for r in ranks[1:]:
            a, b = calls[first], calls[r]
            for i in range(max(len(a), len(b))):
                ca = a[i] if i < len(a) else None
                cb = b[i] if i < len(b) else None
                if ca is None or cb is None or ca[0] != cb[0] or ca[2:] != cb[2:]:
                    raise ConfigError(
                        by_rank[r].path,
                        None,
                        f"collective {i} in group {name!r} is {_call(cb)}, but "
                        f"{by_rank[first].path.name} (rank {first}) issues {_call(ca)}; the "
                        "ranks of a group must issue the same collectives in the same order "
                        "(the run would hang or mix tensors)",
                    )


def _call(c: tuple | None) -> str:
    if c is None:
        return "nothing (its collectives end earlier)"
    kind, _, shape, dtype, reduce_op = c
    return f"{kind}{f' ({reduce_op})' if reduce_op else ''} of {dtype}{list(shape)}"
