"""A FlowGraph flattened for executors: nodes in topological order, edges by name and index."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tessel.dataflow.nodes import FlowData, FlowNode, FlowOutput
from tessel.dataflow.process_points import (
    FlowGraphProcessPoint,
    FuncProcessPoint,
    FuncSpec,
    GraphProcessPoint,
    ProcessPoint,
)

DEFAULT_DEPTH = 8


@dataclass
class NodeSpec:
    """One node: what it runs, where its inputs come from, how its pp's I/O maps to the node's."""

    name: str
    deploy_name: str
    kind: str  # "func" | "model"
    n_in: int
    n_out: int
    sources: list[tuple]  # per input: ("data", data_index) | ("node", node_name, output_index)
    pp: ProcessPoint
    functions: list[FuncSpec]
    scatter: bool = False
    gather: bool = False
    depth: int = DEFAULT_DEPTH
    invoked: dict[str, Any] = field(default_factory=dict)


@dataclass
class GraphSpec:
    name: str
    datas: list[FlowData]
    nodes: list[NodeSpec]
    outputs: list[tuple[str, int]]

    def node(self, name: str) -> NodeSpec:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def consumers(self, src: tuple) -> list[tuple[str, int]]:
        """Every (node, input index) fed by `src` (("data", k) or ("node", name, out))."""
        return [(n.name, i) for n in self.nodes for i, s in enumerate(n.sources) if s == src]

    @property
    def has_joins(self) -> bool:
        return any(n.n_in > 1 for n in self.nodes)


def _functions(node: FlowNode) -> list[FuncSpec]:
    pp = node.pp
    if isinstance(pp, FuncProcessPoint) and pp.udf.functions:
        return pp.udf.functions
    if node.input_map or node.output_map:
        n_pp_in = max(node.input_map.values(), default=-1) + 1
        n_pp_in = max(n_pp_in, node.input_num) if not node.input_map else n_pp_in
        ins = [-1] * n_pp_in
        for i in range(node.input_num):
            j = node.input_map.get(i, i)
            if j < len(ins):
                ins[j] = i
        outs_by_pp: dict[int, int] = {}
        for i in range(node.output_num):
            outs_by_pp[node.output_map.get(i, i)] = i
        n_pp_out = max(outs_by_pp) + 1
        outs = [outs_by_pp.get(j, -1) for j in range(n_pp_out)]
        if -1 in ins:
            raise ValueError(
                f"FlowNode {node.name!r}: process point input {ins.index(-1)} unmapped"
            )
        method = None
        if isinstance(pp, FuncProcessPoint):
            method = pp.default_functions(node.input_num, node.output_num)[0].method
        return [FuncSpec(method, ins, outs)]
    if isinstance(pp, FuncProcessPoint):
        return pp.default_functions(node.input_num, node.output_num)
    return [FuncSpec(None, list(range(node.input_num)), list(range(node.output_num)))]


def _upstream(node: FlowNode) -> list[FlowNode]:
    """Every node whose outputs reach `node`, directly or through other nodes."""
    seen: dict[int, FlowNode] = {}
    stack = [s.node for s in node.inputs if isinstance(s, FlowOutput)]
    while stack:
        n = stack.pop()
        if id(n) not in seen:
            seen[id(n)] = n
            stack.extend(s.node for s in n.inputs if isinstance(s, FlowOutput))
    return list(seen.values())


def _check_gathers(order: list[FlowNode], name: str) -> None:
    """A balance-gather node closes a balanced region, so a balance-scatter node must open it."""
    for n in order:
        if n.balance_gather and not any(u.balance_scatter for u in _upstream(n)):
            raise ValueError(
                f"FlowGraph {name!r}: node {n.name!r} is set as a balance gather but no "
                "balance-scatter node is upstream of it; call set_balance_scatter() on the node "
                "whose outputs its inputs come from, or drop set_balance_gather()"
            )


def build_spec(outputs: list[FlowOutput], name: str) -> GraphSpec:
    """Walk back from the outputs; check every node is wired; order nodes topologically."""
    if not outputs:
        raise ValueError(f"FlowGraph {name!r}: needs at least one output")
    for o in outputs:
        if not isinstance(o, FlowOutput):
            raise TypeError(f"FlowGraph {name!r}: outputs must be node outputs, found {o!r}")
    order: list[FlowNode] = []
    datas: dict[int, FlowData] = {}
    state: dict[int, int] = {}

    def visit(node: FlowNode) -> None:
        if state.get(id(node)) == 2:
            return
        if state.get(id(node)) == 1:
            raise ValueError(f"FlowGraph {name!r}: cycle through node {node.name!r}")
        state[id(node)] = 1
        if node.pp is None:
            raise ValueError(f"FlowGraph {name!r}: node {node.name!r} has no process point")
        for i, src in enumerate(node.inputs):
            if src is None:
                raise ValueError(
                    f"FlowGraph {name!r}: input {i} of node {node.name!r} is unconnected"
                )
            if isinstance(src, FlowData):
                datas[id(src)] = src
            else:
                visit(src.node)
        state[id(node)] = 2
        order.append(node)

    for o in outputs:
        visit(o.node)
    if not datas:
        raise ValueError(f"FlowGraph {name!r}: has no FlowData input")
    _check_gathers(order, name)
    data_list = sorted(datas.values(), key=lambda d: d.order)
    data_index = {id(d): k for k, d in enumerate(data_list)}
    names: dict[str, FlowNode] = {}
    for n in order:
        for key in {n.name, n.deploy_name}:
            other = names.get(key)
            if other is not None and other is not n:
                raise ValueError(f"FlowGraph {name!r}: two nodes are named {key!r}")
            names[key] = n
    specs = []
    for n in order:
        sources = [
            ("data", data_index[id(s)])
            if isinstance(s, FlowData)
            else ("node", s.node.name, s.index)
            for s in n.inputs
        ]
        kind = "model" if isinstance(n.pp, GraphProcessPoint) else "func"
        invoked = dict(n.pp.invoked) if isinstance(n.pp, FuncProcessPoint) else {}
        for key, pp in invoked.items():
            if not isinstance(pp, GraphProcessPoint | FlowGraphProcessPoint):
                raise TypeError(f"node {n.name!r}: invoked closure {key!r} is not runnable")
        specs.append(
            NodeSpec(
                name=n.name,
                deploy_name=n.deploy_name,
                kind=kind,
                n_in=n.input_num,
                n_out=n.output_num,
                sources=sources,
                pp=n.pp,
                functions=_functions(n),
                scatter=n.balance_scatter,
                gather=n.balance_gather,
                depth=int(n.attrs.get("_flow_attr_depth", DEFAULT_DEPTH)),
                invoked=invoked,
            )
        )
    outs = [(o.node.name, o.index) for o in outputs]
    return GraphSpec(name, data_list, specs, outs)
