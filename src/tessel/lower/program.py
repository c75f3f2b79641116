"""A rank's program as plain JSON: a list of ATen and collective calls, loaded without pickle.

A program may call only the operators on tessel's list (`tessel.lower.operators`): pure
computations and functional collectives, none that reads or writes files or writes into its
arguments. Writes are checked besides, from each operator's schema: were an in-place operator
listed, it could write only into tensors the program made itself, never into an input (a weight)
or a view of one. Every program is checked when it is built and again when it is loaded, so a
program file can name what to compute but never run code of its own or change a weight.
"""

from __future__ import annotations

import json
import keyword
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from tessel._torch import C10D_FUNCTIONAL, OpOverload, group_ranks
from tessel.dtypes import dtype_name, torch_dtype
from tessel.errors import TesselError
from tessel.lower.operators import ALLOWED

FORMAT = "tessel.program/1"
_NODE_KINDS = ("input", "constant", "call", "output")
_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}  # what `repr` gives non-finite
_VALUE_KEYS = ("$node", "$dtype", "$device", "$layout", "$memory_format", "$float", "$group")
# operators whose result shares its argument's storage though their schema does not say so
_UNANNOTATED_VIEWS = {"aten._unsafe_view.default"}


class ProgramError(TesselError, ValueError):
    """A program that calls what tessel does not allow, or is not well formed."""


@dataclass(frozen=True)
class OutputLayout:
    """How a forward output is spread over the mesh once partial sums are reduced: its whole
    shape and dtype, per mesh axis the dimension sharded along it (None: replicated), and
    whether the shard each rank holds is contiguous."""

    shape: tuple[int, ...]
    dtype: str
    shards: tuple[int | None, ...]
    contiguous: bool = True

    def to_json(self) -> dict:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "shards": list(self.shards),
            "contiguous": self.contiguous,
        }

    @classmethod
    def from_json(cls, data: dict) -> OutputLayout:
        return cls(
            tuple(data["shape"]), data["dtype"], tuple(data["shards"]), bool(data["contiguous"])
        )


@dataclass
class RankProgram:
    """One rank's lowered program (JSON), the constants it uses and its local tensor shapes,
    with the bytes its device holds: weights, and at the program's peak."""

    program: dict
    constants: dict[str, torch.Tensor]
    shapes: dict[str, tuple[list[int], str]]
    weight_bytes: int = 0
    peak_bytes: int = 0
    # a forward's outputs, returned as each rank's shards until `gather_outputs` brings them
    # to rank 0 (None: outputs are returned as they are)
    output_layouts: list[OutputLayout | None] | None = None


def op_name(target: Any) -> str:
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[1]}.{target._overloadname}"
    raise ProgramError(f"cannot serialise call target {target!r}")


def _resolve(name: str) -> Any:
    """The operator an allowed name stands for; only names on the list are ever looked up."""
    if name == "getitem":
        return operator.getitem
    if name not in ALLOWED:
        raise ProgramError(f"unknown operator {name!r} in program")
    ns, packet, overload = name.split(".")
    op = getattr(getattr(getattr(torch.ops, ns), packet, None), overload, None)
    if not isinstance(op, OpOverload):
        raise ProgramError(f"operator {name!r} does not exist in this torch ({torch.__version__})")
    return op


def check(program: Any) -> None:
    """Refuse a program that is not well formed, calls an operator not on the list, or writes
    into an input (a weight) or a view of one; raises `ProgramError` naming the node and op."""
    if not isinstance(program, dict) or program.get("format") != FORMAT:
        found = program.get("format") if isinstance(program, dict) else type(program).__name__
        raise ProgramError(f"unknown program format {found!r}; expected {FORMAT}")
    nodes = program.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise ProgramError("program has no list of nodes")
    state = program.get("state", [])
    if not isinstance(state, list) or not all(isinstance(n, str) for n in state):
        raise ProgramError(f"program's state is not a list of input names: {state!r}")
    defined: set[str] = set()
    inputs: dict[str, str] = {}  # inputs, constants and views of them -> the input: read-only
    for i, node in enumerate(nodes):
        if not isinstance(node, dict) or node.get("op") not in _NODE_KINDS:
            raise ProgramError(f"program node {i} is not one of {', '.join(_NODE_KINDS)}")
        kind = node["op"]
        if kind == "output":
            if i != len(nodes) - 1:
                raise ProgramError(f"program node {i} is an output before the last node")
            _check_value(node.get("args"), defined, f"output node {i}")
            given = {n["name"] for n in nodes[:i] if n.get("op") == "input"}
            if not set(state) <= given:
                raise ProgramError(
                    f"program's state names {sorted(set(state) - given)}, not its inputs"
                )
            return
        name = node.get("name")
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise ProgramError(f"program node {i} has an invalid name {name!r}")
        if name in defined:
            raise ProgramError(f"program node {name!r} is defined twice")
        if kind == "call":
            root = _check_call(node, defined, inputs)
            if root is not None:
                inputs[name] = root
        elif name not in state:  # state, and only state, is written in place
            inputs[name] = name
        defined.add(name)
    raise ProgramError("program has no output node")


def _check_call(node: dict, defined: set[str], inputs: dict[str, str]) -> str | None:
    """Check one call; returns the input its result may share storage with, if any."""
    name, target = node["name"], node.get("target")
    args, kwargs = node.get("args"), node.get("kwargs")
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise ProgramError(f"program node {name!r} needs a list of args and a dict of kwargs")
    where = f"program node {name!r}"
    _check_value(args, defined, where)
    for value in kwargs.values():
        _check_value(value, defined, where)
    if target == "getitem":
        if len(args) != 2 or not _is_node(args[0]) or type(args[1]) is not int or kwargs:
            raise ProgramError(f"{where}: getitem takes a node and an index")
        return inputs.get(args[0]["$node"])
    if not isinstance(target, str) or target not in ALLOWED:
        raise ProgramError(
            f"{where} calls {target!r}, which is not on tessel's list of operators "
            "(tessel/lower/operators.py)"
        )
    schema = _resolve(target)._schema
    params = schema.arguments
    if len(args) > len(params):
        raise ProgramError(f"{where}: {target} takes at most {len(params)} arguments")
    by_name = {p.name: p for p in params[len(args) :]}  # those not already passed by position
    for key in kwargs:
        if key not in by_name:
            raise ProgramError(f"{where}: {target} has no keyword argument {key!r} left to pass")
    passed = [*zip(params, args), *((by_name[k], v) for k, v in kwargs.items())]
    aliased = None
    for param, value in passed:
        touched = sorted(inputs[n] for n in _node_names(value) if n in inputs)
        if param.alias_info is not None and param.alias_info.is_write and touched:
            raise ProgramError(
                f"{where}: {target} writes into its argument {param.name!r}, which is "
                f"the program input {touched[0]!r} or a view of it"
            )
        if touched and (param.alias_info is not None or target in _UNANNOTATED_VIEWS):
            aliased = touched[0]
    # a result shares an argument's storage only where the schema says so (views, in-place)
    views = target in _UNANNOTATED_VIEWS or any(r.alias_info is not None for r in schema.returns)
    return aliased if views else None


def _is_node(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("$node"), str)


def _node_names(value: Any) -> set[str]:
    if _is_node(value):
        return {value["$node"]}
    if isinstance(value, list):
        return set().union(*(_node_names(v) for v in value)) if value else set()
    return set()


def _check_value(value: Any, defined: set[str], where: str, depth: int = 0) -> None:
    """An argument is JSON of known forms: plain values, lists, and one-key `$` objects."""
    if depth > 8:
        raise ProgramError(f"{where}: arguments nest too deep")
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ProgramError(f"{where}: non-finite float {value!r} outside a $float")
        return
    if isinstance(value, list):
        for v in value:
            _check_value(v, defined, where, depth + 1)
        return
    if isinstance(value, dict) and len(value) == 1:
        (key, inner), ok = next(iter(value.items())), False
        if key == "$node":
            ok = isinstance(inner, str) and inner in defined
            if isinstance(inner, str) and not ok:
                raise ProgramError(f"{where}: node {inner!r} is used before it is defined")
        elif key == "$float":
            ok = isinstance(inner, str) and inner in _FLOATS
        elif key == "$group":
            ok = isinstance(inner, list) and all(type(r) is int and r >= 0 for r in inner)
        elif key in _VALUE_KEYS:
            ok = isinstance(inner, str)
        if ok:
            return
    raise ProgramError(f"{where}: unknown value {str(value)[:80]!r} in program")


def _group_ranks(name: str) -> list[int]:
    return group_ranks(name)


def encode(
    gm: fx.GraphModule,
    group_ranks: Callable[[str], list[int]] = _group_ranks,
    state: Sequence[str] = (),
) -> tuple[dict, dict]:
    """The JSON form of a traced local program and its constants; each collective's group is
    recorded as its rank list, `group_ranks(group_name)` (by default, from the process groups
    of the world it was traced in). `state` names the inputs the program writes in place (a
    generation step's cache), which the program lists as its state."""
    nodes = []
    constants = {}

    def enc(a: Any, collective: bool = False) -> Any:
        if isinstance(a, fx.Node):
            return {"$node": a.name}
        if isinstance(a, (list, tuple)):
            return [enc(x, collective) for x in a]
        if isinstance(a, torch.dtype):
            return {"$dtype": dtype_name(a)}
        if isinstance(a, torch.device):
            return {"$device": a.type}
        if isinstance(a, torch.layout):
            return {"$layout": str(a).removeprefix("torch.")}
        if isinstance(a, torch.memory_format):
            return {"$memory_format": str(a).removeprefix("torch.")}
        if isinstance(a, float) and not math.isfinite(a):
            return {"$float": repr(a)}
        if collective and isinstance(a, str):
            return {"$group": list(group_ranks(a))}
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        raise ProgramError(f"cannot serialise argument {a!r} of type {type(a).__name__}")

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            nodes.append({"op": "input", "name": n.name})
        elif n.op == "get_attr":
            constants[n.name] = getattr(gm, n.target)
            nodes.append({"op": "constant", "name": n.name})
        elif n.op == "call_function":
            target = op_name(n.target)
            groups = _group_arguments(n.target) if target.startswith(C10D_FUNCTIONAL) else set()
            nodes.append(
                {
                    "op": "call",
                    "name": n.name,
                    "target": target,
                    "args": [enc(a, i in groups) for i, a in enumerate(n.args)],
                    "kwargs": {k: enc(v, k in groups) for k, v in n.kwargs.items()},
                }
            )
        elif n.op == "output":
            nodes.append({"op": "output", "args": enc(n.args[0], False)})
        else:
            raise ProgramError(f"cannot serialise node kind {n.op}")
    program: dict[str, Any] = {"format": FORMAT, "nodes": nodes}
    if state:
        program["state"] = list(state)
    check(program)  # what a loader would refuse is refused here, when the model is built
    return program, constants


def _group_arguments(op: Any) -> set[int | str]:
    """Where a collective takes its group: the position and the name of `group_name`."""
    if not isinstance(op, OpOverload):
        return set()
    return {
        key
        for i, arg in enumerate(op._schema.arguments)
        if arg.name == "group_name"
        for key in (i, arg.name)
    }


def move_groups(program: dict, rank_map: Callable[[int], int]) -> dict:
    """`program` with every collective group's ranks mapped by `rank_map` (each group's ranks
    kept in ascending order, as process groups list them)."""

    def move(a: Any) -> Any:
        if isinstance(a, dict):
            if "$group" in a:
                return {"$group": sorted(rank_map(r) for r in a["$group"])}
            return {k: move(v) for k, v in a.items()}
        if isinstance(a, list):
            return [move(v) for v in a]
        return a

    return {**program, "nodes": move(program["nodes"])}


def matched_names(first: dict, last: dict) -> dict[str, str]:
    """Node names of `last` -> those of `first`, the programs' nodes matched by position."""
    return {
        b["name"]: a["name"]
        for a, b in zip(first["nodes"], last["nodes"])
        if "name" in a and "name" in b
    }


def rank_interpolation(first: dict, last: dict, world: int) -> Callable[[int], dict] | None:
    """The programs of the ranks between `first` (rank 0's) and `last` (rank `world - 1`'s) of
    a 1-D mesh, where the two differ only in integers that grow by a whole step per rank: where
    a rank's chunk of an evenly sharded tensor starts, which piece of a split it takes. Returns
    None where they differ otherwise (then each rank is traced). Node names may differ: they
    are matched by position and rank 0's are kept."""
    nodes_a, nodes_b = first["nodes"], last["nodes"]
    rest = {k: v for k, v in first.items() if k != "nodes"}
    if (
        len(nodes_a) != len(nodes_b)
        or world < 3
        or rest != {k: v for k, v in last.items() if k != "nodes"}
    ):
        return None
    names = matched_names(first, last)
    grows: list[tuple[tuple, int, int]] = []  # (where, rank 0's value, step per rank)

    def walk(a: Any, b: Any, where: tuple) -> bool:
        if isinstance(a, dict) and isinstance(b, dict):
            if "$node" in a:
                return "$node" in b and names.get(b["$node"], b["$node"]) == a["$node"]
            if a.keys() != b.keys():
                return False
            return all(k == "name" or walk(a[k], b[k], (*where, k)) for k in a)
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(
                walk(x, y, (*where, i)) for i, (x, y) in enumerate(zip(a, b))
            )
        if type(a) is int and type(b) is int and a != b:
            step, rest = divmod(b - a, world - 1)
            grows.append((where, a, step))
            return rest == 0
        return type(a) is type(b) and a == b

    if not all(walk(a, b, (i,)) for i, (a, b) in enumerate(zip(nodes_a, nodes_b))):
        return None

    def program(rank: int) -> dict:
        nodes = json.loads(json.dumps(nodes_a))
        for where, value, step in grows:
            holder = nodes
            for key in where[:-1]:
                holder = holder[key]
            holder[where[-1]] = value + step * rank
        return {**first, "nodes": nodes}

    return program


def groups_in(program: dict) -> list[list[int]]:
    """Every distinct collective group the program uses, in first-use order."""
    found: list[list[int]] = []

    def walk(a: Any) -> None:
        if isinstance(a, dict):
            if "$group" in a and a["$group"] not in found:
                found.append(a["$group"])
            for v in a.values():
                walk(v)
        elif isinstance(a, list):
            for v in a:
                walk(v)

    walk(program["nodes"])
    return found


def node_refs(value: Any) -> list[str]:
    """The node names a node's arguments read, in order (`{"$node": name}` at any depth)."""
    if isinstance(value, dict):
        if "$node" in value:
            return [value["$node"]]
        return [name for v in value.values() for name in node_refs(v)]
    if isinstance(value, list):
        return [name for v in value for name in node_refs(v)]
    return []


def tensor_bytes(shape: list[int], dtype: str) -> int:
    """Bytes of a tensor of `shape` and `dtype` (a name as programs write it)."""
    return math.prod(shape) * torch_dtype(dtype).itemsize


def group_of(node: dict) -> list[int] | None:
    """The ranks of a collective call's group (None where it names none)."""
    return next((a["$group"] for a in node["args"] if isinstance(a, dict) and "$group" in a), None)


def collectives(
    program: dict, shapes: dict[str, tuple[list[int], str]] | None = None
) -> list[dict]:
    """The collectives of a program: kind, group and bytes moved per call (from input shapes)."""
    out = []
    for node in program["nodes"]:
        if node.get("op") != "call" or not node["target"].startswith(C10D_FUNCTIONAL):
            continue
        kind = node["target"].split(".")[1]
        if kind == "wait_tensor":
            continue
        group = group_of(node)
        entry = {"kind": kind, "group": group, "node": node["name"]}
        if shapes is not None:
            src = node["args"][0]
            if isinstance(src, dict) and src.get("$node") in shapes:
                size = tensor_bytes(*shapes[src["$node"]])
                # bytes of the whole tensor the collective moves (a gather's input is one shard)
                entry["bytes"] = size * len(group or [1]) if kind.startswith("all_gather") else size
        out.append(entry)
    return out


def node_shapes(gm: fx.GraphModule) -> dict[str, tuple[list[int], str]]:
    """Local shape and dtype of every tensor node of a traced program."""
    shapes = {}
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            shapes[n.name] = (list(val.shape), dtype_name(val.dtype))
    return shapes


def decode(
    program: dict,
    constants: dict[str, torch.Tensor],
    device: torch.device,
    group_name: dict[tuple[int, ...], str] | None = None,
) -> fx.GraphModule:
    """Rebuild a runnable GraphModule; collective groups are looked up in `group_name`.

    The program is checked first (see `check`), so nothing off the operator list is looked up and
    no input is written into.
    """
    root, graph = decode_graph(program, constants, device, group_name)
    return fx.GraphModule(root, graph)


def decode_graph(
    program: dict,
    constants: dict[str, torch.Tensor],
    device: torch.device,
    group_name: dict[tuple[int, ...], str] | None = None,
) -> tuple[torch.nn.Module, fx.Graph]:
    """The checked program as a graph (one node per program node, in order) and the module
    holding its constants: what `decode` compiles, for reading without running."""
    check(program)
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    root = torch.nn.Module()

    def dec(a: Any) -> Any:
        if isinstance(a, list):
            return [dec(x) for x in a]
        if isinstance(a, dict):
            if "$node" in a:
                if a["$node"] not in env:
                    raise ProgramError(f"node {a['$node']!r} used before it is defined")
                return env[a["$node"]]
            if "$dtype" in a:
                return _attr(torch, a["$dtype"], torch.dtype)
            if "$device" in a:
                return device
            if "$layout" in a:
                return _attr(torch, a["$layout"], torch.layout)
            if "$memory_format" in a:
                return _attr(torch, a["$memory_format"], torch.memory_format)
            if "$float" in a:
                return _FLOATS[a["$float"]]
            if "$group" in a:
                key = tuple(a["$group"])
                if group_name is None or key not in group_name:
                    raise ProgramError(f"program needs a process group over ranks {list(key)}")
                return group_name[key]
            raise ProgramError(f"unknown value {a!r} in program")
        return a

    for node in program["nodes"]:
        kind = node.get("op")
        if kind == "input":
            env[node["name"]] = graph.placeholder(node["name"])
        elif kind == "constant":
            name = node["name"]
            if name not in constants:
                raise ProgramError(f"constant {name!r} missing from the weights")
            if hasattr(root, name):
                raise ProgramError(f"constant {name!r} has a reserved name")
            root.register_buffer(name, constants[name].to(device))
            env[name] = graph.get_attr(name)
        elif kind == "call":
            if device.type != "cpu" and node["target"].endswith("_for_cpu.default"):
                raise ProgramError(
                    f"program node {node['name']!r} calls the CPU-only kernel {node['target']}, "
                    f"which cannot run on {device.type}; rebuild the model with "
                    f"--soc_version naming a {device.type} device"
                )
            target = _resolve(node["target"])
            args = tuple(dec(node["args"]))
            kwargs = {k: dec(v) for k, v in node["kwargs"].items()}
            env[node["name"]] = graph.call_function(target, args, kwargs)
        elif kind == "output":
            graph.output(dec(node["args"]))
        else:
            raise ProgramError(f"unknown node kind {kind!r} in program")
    return root, graph


def _attr(module: Any, name: str, kind: type) -> Any:
    value = getattr(module, name, None)
    if not isinstance(value, kind):
        raise ProgramError(f"unknown {kind.__name__} {name!r} in program")
    return value
