"""A rank's training program rewritten for its step: gradients handed over as soon as they are
made, and sharded weights gathered just before they are read.

Both rewrites insert calls to the step's own functions into the loaded program (nothing read
from the package runs): `hand_over_gradients` calls `take(unit, *gradients)` right after the last
gradient of a unit is computed, so the unit's exchange over the data-parallel replicas starts
while the backward pass goes on and the program frees each gradient once taken;
`gather_weights` calls `gather(i)` before the first node of each run of nodes that read a
unit's weights (a gather, in program order), reads the weights as views of what it returns,
and so holds a gathered unit only while its nodes run: once in the forward pass, once again
in the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import fx

aten = torch.ops.aten

# ops that only view or cast a weight: a run of nodes reading the weight repeats them on its
# own gathered copy, so the forward pass's copy is not kept alive for the backward pass
_WEIGHT_VIEWS = {
    aten.t.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.permute.default,
    aten.transpose.int,
    aten.expand.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.slice.Tensor,
    aten.select.int,
    aten.alias.default,
    aten.detach.default,
    aten._to_copy.default,
    aten.clone.default,
}


def hand_over_gradients(
    gm: fx.GraphModule,
    units: list[list[int]],
    take: Callable[..., None],
    first: int = 1,
    count: int | None = None,
) -> None:
    """Call `take(u, *gradients)` after the last gradient of unit `u` (`units[u]`: indices of
    the `count` gradients, the program's outputs from `first` on, every one after it where not
    given) is made, and return the other outputs alone (a step's program: the loss)."""
    graph = gm.graph
    out = graph.output_node()
    outputs = list(out.args[0])
    count = len(outputs) - first if count is None else count
    order = {n: i for i, n in enumerate(graph.nodes)}
    first_call = next((n for n in graph.nodes if n.op not in ("placeholder", "get_attr")), out)
    for u, members in enumerate(units):
        grads = [outputs[first + i] for i in members]
        made = [g for g in grads if isinstance(g, fx.Node)]
        last = max(made, key=order.__getitem__, default=None)
        if last is None or last.op in ("placeholder", "get_attr"):
            where = graph.inserting_before(first_call)
        else:
            where = graph.inserting_after(last)
        with where:
            graph.call_function(take, (u, *grads))
    out.args = (tuple(outputs[:first] + outputs[first + count :]),)
    graph.lint()
    gm.recompile()


def made_order(gm: fx.GraphModule) -> list[int]:
    """The program's gradient outputs (indices of the outputs after the loss) in the order its
    nodes make them; those it passes through from an input come first."""
    graph = gm.graph
    outputs = list(graph.output_node().args[0])[1:]
    order = {n: i for i, n in enumerate(graph.nodes)}

    def made_at(i: int) -> int:
        g = outputs[i]
        return order[g] if isinstance(g, fx.Node) else -1

    return sorted(range(len(outputs)), key=made_at)


def gather_weights(
    gm: fx.GraphModule,
    inputs: Mapping[int, tuple[int, str]],
    gather: Callable[[int], torch.Tensor],
    view: Callable[[torch.Tensor, str], torch.Tensor],
) -> list[int]:
    """Read the program's weight inputs from gathered units (`inputs`: input position ->
    (unit, weight name)): `gather(i)` returns the i-th gather's unit, `view(gathered, name)`
    a weight in it. Returns the unit of each gather, in program order."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    weights = {placeholders[i]: unit for i, (unit, _) in inputs.items()}
    names = {placeholders[i]: name for i, (_, name) in inputs.items()}
    # values that only view or cast one weight, as their weight's unit
    derived: dict[fx.Node, int] = dict(weights)
    for n in graph.nodes:
        if n.op == "call_function" and n.target in _WEIGHT_VIEWS and n.args:
            source = n.args[0]
            others = [a for a in n.all_input_nodes if a is not source]
            if source in derived and not others:
                derived[n] = derived[source]

    # runs: a unit's run goes on until a node reads another unit's weights
    gathers: list[int] = []
    current: dict[int, int] = {}  # unit -> its open run (an index into gathers)
    interrupted: set[int] = set()
    reads: list[tuple[fx.Node, fx.Node, int]] = []  # (reader, value read, gather)
    for n in list(graph.nodes):
        if n in derived:
            continue
        read = [a for a in n.all_input_nodes if a in derived]
        units = {derived[a] for a in read}
        if not units:
            continue
        interrupted |= current.keys() - units
        for u in sorted(units):
            if u not in current or u in interrupted:
                current[u] = len(gathers)
                gathers.append(u)
                interrupted.discard(u)
        reads += [(n, a, current[derived[a]]) for a in read]

    # each run's gather before its first reader; its weights and their views made there
    made: dict[tuple[fx.Node, int], fx.Node] = {}
    gathered: dict[int, fx.Node] = {}

    def value(a: fx.Node, g: int, before: fx.Node) -> fx.Node:
        if (a, g) in made:
            return made[(a, g)]
        if a in weights:
            if g not in gathered:
                with graph.inserting_before(before):
                    gathered[g] = graph.call_function(gather, (g,))
            with graph.inserting_before(before):
                made[(a, g)] = graph.call_function(view, (gathered[g], names[a]))
        else:
            source = value(a.args[0], g, before)
            with graph.inserting_before(before):
                made[(a, g)] = graph.node_copy(a, lambda x: source if x is a.args[0] else x)
        return made[(a, g)]

    for reader, a, g in reads:
        reader.replace_input_with(a, value(a, g, reader))
    for n in reversed(list(graph.nodes)):
        if n in derived and n not in weights and not n.users:
            graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return gathers
