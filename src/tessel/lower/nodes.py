"""A rank's program as typed nodes, for the passes that edit programs: the cuts into pipeline
stages (`lower.stages`, `lower.training_stages`) and the gathers of outputs (`lower.outputs`).

The JSON program (`lower.program`) is what a package stores and a loader checks. A pass reads
it into `ProgramNodes` once, makes new `Node`s (renamed per micro-batch, moved to other ranks,
or new calls), and writes a JSON program back with `ProgramNodes.program`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from tessel.lower.program import ProgramError, node_refs

INPUT, CONSTANT, CALL, OUTPUT = "input", "constant", "call", "output"
_CLONE = "aten.clone.default"
_KEYS = {
    INPUT: ("op", "name"),
    CONSTANT: ("op", "name"),
    CALL: ("op", "name", "target", "args", "kwargs"),
    OUTPUT: ("op", "args"),
}


def ref(name: str) -> dict[str, str]:
    """An argument reading the node `name`."""
    return {"$node": name}


@dataclass(frozen=True)
class Node:
    """One program node: an input (a weight or a model input), a constant, a call of an
    operator on the list, or the output (its `args` the values returned)."""

    op: str
    name: str = ""
    target: str = ""
    args: Any = field(default_factory=list)
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, spec: Mapping[str, Any]) -> Node:
        op = spec.get("op")
        if not isinstance(op, str) or op not in _KEYS or set(spec) != set(_KEYS[op]):
            raise ProgramError(f"program node {spec.get('name', '')!r} is not well formed")
        return cls(op, spec.get("name", ""), spec.get("target", ""), spec.get("args", []),
                   spec.get("kwargs", {}))  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in _KEYS[self.op]}

    @cached_property
    def reads(self) -> tuple[str, ...]:
        """The nodes this one reads, in argument order (a name once per reading)."""
        return tuple(node_refs([self.args, self.kwargs]))

    def renamed(
        self,
        name: str,
        names: Mapping[str, str],
        ranks: Callable[[int], int] | None = None,
    ) -> Node:
        """This node as `name`, reading `names[a]` for each node `a` it reads (where given)
        and, given `ranks`, with its collective groups' ranks moved by it."""
        return replace(
            self,
            name=name,
            args=renamed(self.args, names, ranks),
            kwargs=renamed(self.kwargs, names, ranks),
        )


def call(name: str, target: str, args: list, kwargs: Mapping[str, Any] | None = None) -> Node:
    return Node(CALL, name, target, args, dict(kwargs or {}))


def contiguous_copy(name: str, value: str) -> Node:
    """A call copying the node `value` into contiguous memory (what a collective sends)."""
    return call(
        name, _CLONE, [ref(value)], {"memory_format": {"$memory_format": "contiguous_format"}}
    )


def output(args: Any) -> Node:
    return Node(OUTPUT, args=args)


def renamed(value: Any, names: Mapping[str, str], ranks: Callable[[int], int] | None = None) -> Any:
    """`value` (a node's arguments) with node names renamed and, given `ranks`, collective
    groups moved."""
    if isinstance(value, list):
        return [renamed(v, names, ranks) for v in value]
    if isinstance(value, dict):
        if "$node" in value:
            return ref(names.get(value["$node"], value["$node"]))
        if "$group" in value and ranks is not None:
            return {"$group": sorted(ranks(r) for r in value["$group"])}
        return {k: renamed(v, names, ranks) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class ProgramNodes:
    """A JSON program read as typed nodes: every node before the output, in program order,
    then the output."""

    nodes: tuple[Node, ...]
    output: Node
    header: Mapping[str, Any]  # the program's keys besides its nodes (its format)

    @classmethod
    def read(cls, program: Mapping[str, Any]) -> ProgramNodes:
        nodes = [Node.read(n) for n in program["nodes"]]
        if not nodes or nodes[-1].op != OUTPUT:
            raise ProgramError("program has no output node")
        header = {k: v for k, v in program.items() if k != "nodes"}
        return cls(tuple(nodes[:-1]), nodes[-1], header)

    @cached_property
    def inputs(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.op == INPUT)

    @cached_property
    def constants(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.op == CONSTANT)

    @cached_property
    def calls(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.op == CALL)

    @cached_property
    def readers(self) -> dict[str, list[str]]:
        """Each call -> the calls that read it, in program order."""
        out: dict[str, list[str]] = {n.name: [] for n in self.calls}
        for n in self.calls:
            for a in n.reads:
                if a in out:
                    out[a].append(n.name)
        return out

    def program(self, nodes: Sequence[Node]) -> dict[str, Any]:
        """A JSON program of this one's format made of `nodes` (the output last)."""
        return {**self.header, "nodes": [n.to_json() for n in nodes]}
