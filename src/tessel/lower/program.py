"""A rank's program as plain JSON: a list of ATen and collective calls, loaded without pickle.

Only operators from an allow-list of namespaces are resolved when loading, so a program file can
name what to compute but never run code of its own.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch import fx

from tessel._torch import OpOverload, group_ranks
from tessel.errors import TesselError

FORMAT = "tessel.program/1"
_NAMESPACES = {"aten", "_c10d_functional", "prims"}
_COLLECTIVES = "_c10d_functional"


class ProgramError(TesselError, ValueError):
    pass


def _op_name(target: Any) -> str:
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, OpOverload):
        ns = target.namespace
        if ns not in _NAMESPACES:
            raise ProgramError(
                f"operator {target} is outside the supported namespaces {_NAMESPACES}"
            )
        return f"{ns}.{target._schema.name.split('::')[1]}.{target._overloadname}"
    raise ProgramError(f"cannot serialise call target {target!r}")


def _resolve(name: str) -> Any:
    if name == "getitem":
        return operator.getitem
    parts = name.split(".")
    if len(parts) != 3 or parts[0] not in _NAMESPACES:
        raise ProgramError(f"unknown operator {name!r} in program")
    packet = getattr(getattr(torch.ops, parts[0]), parts[1], None)
    op = getattr(packet, parts[2], None) if packet is not None else None
    if not isinstance(op, OpOverload):
        raise ProgramError(f"unknown operator {name!r} in program")
    return op


def _group_ranks(name: str) -> list[int]:
    return group_ranks(name)


def encode(gm: fx.GraphModule) -> dict:
    """The JSON form of a traced local program (collective groups recorded as rank lists)."""
    nodes = []
    constants = {}

    def enc(a: Any, collective: bool) -> Any:
        if isinstance(a, fx.Node):
            return {"$node": a.name}
        if isinstance(a, (list, tuple)):
            return [enc(x, collective) for x in a]
        if isinstance(a, torch.dtype):
            return {"$dtype": str(a).removeprefix("torch.")}
        if isinstance(a, torch.device):
            return {"$device": a.type}
        if isinstance(a, torch.layout):
            return {"$layout": str(a).removeprefix("torch.")}
        if isinstance(a, torch.memory_format):
            return {"$memory_format": str(a).removeprefix("torch.")}
        if isinstance(a, float) and not math.isfinite(a):
            return {"$float": repr(a)}
        if collective and isinstance(a, str) and a.isdigit():
            return {"$group": _group_ranks(a)}
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
            target = _op_name(n.target)
            collective = target.startswith(_COLLECTIVES)
            nodes.append(
                {
                    "op": "call",
                    "name": n.name,
                    "target": target,
                    "args": enc(list(n.args), collective),
                    "kwargs": {k: enc(v, collective) for k, v in n.kwargs.items()},
                }
            )
        elif n.op == "output":
            nodes.append({"op": "output", "args": enc(n.args[0], False)})
        else:
            raise ProgramError(f"cannot serialise node kind {n.op}")
    return {"format": FORMAT, "nodes": nodes}, constants


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


def collectives(
    program: dict, shapes: dict[str, tuple[list[int], str]] | None = None
) -> list[dict]:
    """The collectives of a program: kind, group and bytes moved per call (from input shapes)."""
    out = []
    for node in program["nodes"]:
        if node.get("op") != "call" or not node["target"].startswith(_COLLECTIVES):
            continue
        kind = node["target"].split(".")[1]
        if kind == "wait_tensor":
            continue
        group = next(
            (a["$group"] for a in node["args"] if isinstance(a, dict) and "$group" in a), None
        )
        entry = {"kind": kind, "group": group, "node": node["name"]}
        if shapes is not None:
            src = node["args"][0]
            if isinstance(src, dict) and src.get("$node") in shapes:
                shape, dtype = shapes[src["$node"]]
                size = (
                    math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
                )
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
            shapes[n.name] = (list(val.shape), str(val.dtype).removeprefix("torch."))
    return shapes


def decode(
    program: dict,
    constants: dict[str, torch.Tensor],
    device: torch.device,
    group_name: dict[tuple[int, ...], str] | None = None,
) -> fx.GraphModule:
    """Rebuild a runnable GraphModule; collective groups are looked up in `group_name`."""
    if program.get("format") != FORMAT:
        raise ProgramError(f"unknown program format {program.get('format')!r}; expected {FORMAT}")
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
                return float(a["$float"])
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
    return fx.GraphModule(root, graph)


def _attr(module: Any, name: str, kind: type) -> Any:
    value = getattr(module, name, None)
    if not isinstance(value, kind):
        raise ProgramError(f"unknown {kind.__name__} {name!r} in program")
    return value
