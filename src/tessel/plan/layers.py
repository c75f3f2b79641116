"""Find repeated layers so that identical layers share one set of decision variables (which
layer a node is in: `tessel.capture.layers`)."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import fx

from tessel.capture.layers import layer_of


def _signature(nodes: list[fx.Node]) -> tuple:
    index = {n: i for i, n in enumerate(nodes)}

    def arg_key(a):
        if isinstance(a, fx.Node):
            return ("in", index[a]) if a in index else ("ext",)
        if isinstance(a, (list, tuple)):
            return tuple(arg_key(x) for x in a)
        return repr(a)

    sig = []
    for n in nodes:
        val = n.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        sig.append((n.op, str(n.target), shape, arg_key(n.args), arg_key(tuple(n.kwargs.values()))))
    return tuple(sig)


def identical_layers(graph: fx.Graph) -> list[list[list[fx.Node]]]:
    """Groups of identical layers, each layer its call nodes in graph order, layers in order."""
    layers: dict[tuple[str, int], list[fx.Node]] = defaultdict(list)
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        key = layer_of(n)
        if key is not None:
            layers[key].append(n)
    groups: dict[tuple, list[list[fx.Node]]] = {}
    for (family, _idx), nodes in sorted(layers.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        groups.setdefault((family, _signature(nodes)), []).append(nodes)
    return list(groups.values())


def template_map(graph: fx.Graph) -> tuple[dict[fx.Node, fx.Node], dict[str, list[int]]]:
    """Map every node of a repeated layer to the same-position node of its group's earliest
    layer in graph order.

    Returns the map (template nodes map to themselves; nodes outside layers are absent) and,
    per layer family, the layer indices found.
    """
    mapping: dict[fx.Node, fx.Node] = {}
    families: dict[str, list[int]] = defaultdict(list)
    position = {n: i for i, n in enumerate(graph.nodes)}
    for group in identical_layers(graph):
        for nodes in group:
            key = layer_of(nodes[0])
            assert key is not None  # identical_layers groups only nodes inside a layer
            family, idx = key
            families[family].append(idx)
        # each position's template is its earliest node: a training graph runs the layers'
        # backward passes in reverse, so there the last layer comes first
        for same in zip(*group):
            t = min(same, key=position.__getitem__)
            for n in same:
                mapping[n] = t
    for indices in families.values():
        indices.sort()
    return mapping, dict(families)
