"""Programs as the gloo backend runs them: each reduce-scatter becomes the all-reduce gloo
performs for it anyway, and the rank takes its own rows in the program.

gloo has no reduce-scatter of its own. torch's gloo backend clones the input, all-reduces the
clone, and copies this rank's rows out when the collective is waited on (a `LambdaWork` around
the all-reduce). Workers running a program's functional reduce-scatters through that path for
thousands of steps died with glibc's "malloc(): unaligned tcache chunk detected", each time in
a reduce-scatter's own allocations (an 8-layer Llama decoding at 2 ranks died after 9 to 11
requests of 128 steps); written as an all-reduce and a slice, the same 40 requests ran clean.
The bytes moved are the same, and so is the memory: the whole sum lives only until this rank's
rows are copied out of it, as gloo's clone did.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from tessel._torch import C10D_FUNCTIONAL
from tessel.lower.program import ProgramError

_COLLECTIVE = getattr(torch.ops, C10D_FUNCTIONAL)
_REDUCE_SCATTER = _COLLECTIVE.reduce_scatter_tensor.default
_WAIT = _COLLECTIVE.wait_tensor.default


def reduce_scatters_as_all_reduces(
    program: fx.GraphModule, rank: int, groups: dict[tuple[int, ...], str]
) -> int:
    """Rewrite `program`'s reduce-scatters for gloo, in place; returns how many it rewrote.

    `groups` names each group of ranks; a group's rank `rank` takes the rows at its position
    in the sorted ranks, as torch numbers a group's members.
    """
    position = {name: sorted(ranks).index(rank) for ranks, name in groups.items() if rank in ranks}
    graph = program.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    rewritten = 0
    for node in list(graph.nodes):
        if node.target is not _REDUCE_SCATTER:
            continue
        source, op, size, name = node.args
        with graph.inserting_before(node):
            summed = graph.call_function(_COLLECTIVE.all_reduce.default, (source, op, name))
        waits = [user for user in node.users if user.target is _WAIT]
        if len(waits) != len(node.users) or not waits:
            raise ProgramError(f"reduce-scatter {node.name} is read before it is waited on")
        first = min(waits, key=order.__getitem__)
        with graph.inserting_before(first):
            whole = graph.call_function(_WAIT, (summed,))
            rows = graph.call_function(torch.ops.aten.chunk.default, (whole, size))
            view = graph.call_function(operator.getitem, (rows, position[name]))
            mine = graph.call_function(torch.ops.aten.clone.default, (view,))
        for wait in waits:
            wait.replace_all_uses_with(mine)
            graph.erase_node(wait)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        program.recompile()
    return rewritten
