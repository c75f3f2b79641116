"""Programs as the gloo backend runs them: each reduce-scatter and each all-gather becomes one
all-reduce, which gloo runs in place on the tensor it is given.

gloo has no reduce-scatter of its own. torch's gloo backend clones the input, all-reduces the
clone, and copies this rank's rows out when the collective is waited on (a `LambdaWork` around
the all-reduce). Workers running a program's functional reduce-scatters through that path for
thousands of steps died with glibc's "malloc(): unaligned tcache chunk detected", each time in
a reduce-scatter's own allocations (an 8-layer Llama decoding at 2 ranks died after 9 to 11
requests of 128 steps); written as an all-reduce and a slice, the same 40 requests ran clean.
The bytes moved are the same, and so is the memory: the whole sum lives only until this rank's
rows are copied out of it, as gloo's clone did.

torch 2.13's gloo all-gather (`allgather_into_tensor_coalesced`) died the same way, about one
test module in eleven under load: a gloo worker thread found tensor values written into its
heap's free list while allocating the gathered buffer (the last logits of a decode step, a few
hundred bytes a rank). An all-gather is therefore written as an all-reduce too: each rank places
its rows in a zero-filled buffer of the whole, and the sum of those buffers is the gather,
exactly (adding zeros changes no value). It moves twice the bytes of a gather.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import fx

from tessel._torch import C10D_FUNCTIONAL
from tessel.lower.program import ProgramError

_COLLECTIVE = getattr(torch.ops, C10D_FUNCTIONAL)
_REDUCE_SCATTER = _COLLECTIVE.reduce_scatter_tensor.default
_ALL_GATHER = _COLLECTIVE.all_gather_into_tensor.default
_ALL_REDUCE = _COLLECTIVE.all_reduce.default
_WAIT = _COLLECTIVE.wait_tensor.default


def collectives_as_all_reduces(
    program: fx.GraphModule, rank: int, groups: dict[tuple[int, ...], str]
) -> int:
    """Rewrite `program`'s reduce-scatters and all-gathers for gloo, in place; returns how many
    it rewrote.

    `groups` names each group of ranks; rank `rank` holds the rows at its position in the
    group's sorted ranks, as torch numbers a group's members.
    """
    position = {name: sorted(ranks).index(rank) for ranks, name in groups.items() if rank in ranks}
    graph = program.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    rewritten = 0
    for node in list(graph.nodes):
        if node.target is _REDUCE_SCATTER:
            source, op, size, name = node.args
            with graph.inserting_before(node):
                summed = graph.call_function(_ALL_REDUCE, (source, op, name))

            def rows(whole: fx.Node, size: int = size, name: str = name) -> fx.Node:
                parts = graph.call_function(torch.ops.aten.chunk.default, (whole, size))
                view = graph.call_function(operator.getitem, (parts, position[name]))
                # its rows in a buffer of their own, not a view keeping the whole sum alive
                return graph.call_function(torch.ops.aten.clone.default, (view,))

            _replace_waits(graph, order, node, summed, rows)
        elif node.target is _ALL_GATHER:
            source, size, name = node.args
            with graph.inserting_before(node):
                nothing = graph.call_function(torch.ops.aten.zeros_like.default, (source,))
                placed = [nothing] * size
                placed[position[name]] = source
                whole = graph.call_function(torch.ops.aten.cat.default, (placed, 0))
                summed = graph.call_function(_ALL_REDUCE, (whole, "sum", name))
            _replace_waits(graph, order, node, summed, lambda gathered: gathered)
        else:
            continue
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        program.recompile()
    return rewritten


def _replace_waits(
    graph: fx.Graph,
    order: dict[fx.Node, int],
    node: fx.Node,
    summed: fx.Node,
    result: Callable[[fx.Node], fx.Node],
) -> None:
    """Wait on `summed` where `node` was first waited on, and give every wait's readers
    `result(waited)` instead."""
    waits = [user for user in node.users if user.target is _WAIT]
    if len(waits) != len(node.users) or not waits:
        raise ProgramError(f"{node.name} is read before it is waited on")
    first = min(waits, key=order.__getitem__)
    with graph.inserting_before(first):
        value = result(graph.call_function(_WAIT, (summed,)))
    for wait in waits:
        wait.replace_all_uses_with(value)
        graph.erase_node(wait)
