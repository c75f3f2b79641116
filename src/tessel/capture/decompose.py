"""Decompose the few calls of a captured program that must be, each where it stands.

A capture keeps whole every op the planner can shard and decomposes the rest (a floor
division, a library's custom op). `ExportedProgram.run_decompositions` does that by tracing the
whole model a second time, which on a deep model costs as much as the capture itself, to
rewrite a handful of nodes. Here each such call is traced alone instead: its decomposition runs
on the fake tensors its inputs hold, and the nodes that makes take its place in the graph.

Where a piece cannot be shown to stand in for the call (a decomposition that writes into a
tensor, reads a constant it made, or a call whose outputs are read other than one by one),
nothing is changed and the caller re-traces the whole program.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from tessel._torch import OpOverload, fake_mode_of

# what a node made in a call's place keeps of the call's own metadata: the layer it belongs to
_KEPT_META = ("nn_module_stack", "torch_fn", "stack_trace")


def decompose_in_place(gm: fx.GraphModule, table: Mapping[Any, Callable]) -> bool:
    """Replace every call in `gm` of an op in `table` that reads a graph value by that op's
    decomposition, traced on the call's own inputs (decomposing recursively by `table`).

    Returns False, with `gm` untouched, where some call cannot be replaced so; the caller then
    decomposes the whole program its own way."""
    graph = gm.graph
    calls = [
        n
        for n in graph.nodes
        if n.op == "call_function" and n.target in table and n.all_input_nodes
    ]
    pieces = []
    for call in calls:
        piece = _traced(call, table)
        if piece is None:
            return False
        pieces.append((call, piece))
    for call, piece in pieces:
        _splice(graph, call, piece)
    graph.lint()
    gm.recompile()
    return True


def _traced(call: fx.Node, table: Mapping[Any, Callable]) -> fx.GraphModule | None:
    """`call`'s decomposition as a graph of its inputs, or None where it cannot stand in."""
    inputs = call.all_input_nodes
    values = [n.meta.get("val") for n in inputs]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return None
    if any(u.op != "call_function" for u in call.users):
        return None  # read by the output itself: the signature names it
    if not isinstance(call.meta.get("val"), torch.Tensor) and any(
        u.target is not operator.getitem for u in call.users
    ):
        return None
    mode = fake_mode_of(values)
    if mode is None:
        return None

    def run(*tensors: torch.Tensor) -> Any:
        value = dict(zip(inputs, tensors))
        args, kwargs = fx.node.map_arg((call.args, call.kwargs), value.__getitem__)
        return call.target(*args, **kwargs)

    try:
        with mode:
            piece = make_fx(run, decomposition_table=dict(table))(*values)
    except Exception:  # noqa: BLE001 - any doubt: the whole program is re-traced
        return None
    for n in piece.graph.nodes:
        if n.op in ("get_attr", "call_module", "call_method"):
            return None
        if n.op == "call_function" and (
            n.target in table or (isinstance(n.target, OpOverload) and n.target._schema.is_mutable)
        ):
            return None
    return piece


def _splice(graph: fx.Graph, call: fx.Node, piece: fx.GraphModule) -> None:
    """Put `piece`'s nodes before `call`, its inputs read from `call`'s, and read its outputs
    where `call`'s were read."""
    made: dict[fx.Node, Any] = dict(
        zip((n for n in piece.graph.nodes if n.op == "placeholder"), call.all_input_nodes)
    )
    result: Any = None
    with graph.inserting_before(call):
        for n in piece.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                result = fx.node.map_arg(n.args[0], made.__getitem__)
                break
            copy = graph.node_copy(n, made.__getitem__)
            copy.meta.update({k: call.meta[k] for k in _KEPT_META if k in call.meta})
            made[n] = copy
    if isinstance(result, fx.Node):
        call.replace_all_uses_with(result)
    else:
        for user in list(call.users):
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    graph.erase_node(call)
