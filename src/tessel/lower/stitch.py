"""Lower one layer of a run of identical layers, and stitch copies of it in for the rest.

Tracing a rank's program runs every node of the captured graph through DTensor, so its cost
grows with depth. Identical layers that the plan places alike lower to the same local program,
so for each run of at least three of them only the first two are traced: the first takes
whatever layout the layers before it leave, the second is lowered as every later layer is. The
later layers are then copies of the second's traced nodes, wired to their own weights and to the
layer before them.

Every value a copy reads must have the layout and local shape the second layer read; where one
does not, or the second layer's program reaches anything but its inputs, `StitchError` is raised
and the rank is traced layer by layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.distributed.tensor import DTensor

from tessel._torch import local_tensor, proxy_node, traced_graph_length, tree_leaves
from tessel.capture.layers import MIN_LAYERS
from tessel.capture.stamp import marker_op
from tessel.plan import Plan
from tessel.plan.layers import identical_layers


class StitchError(RuntimeError):
    """The copies cannot be shown to equal a traced layer; the rank is traced whole instead."""


SKIPPED_VALUE = marker_op("skipped_value")  # (tensor, 0, stand-in number)


@dataclass
class _Run:
    """A run of identical, contiguous layers: `layers[1]` is traced and copied for the rest."""

    layers: list[list[fx.Node]]
    external: list[list[fx.Node]]  # per layer, the values it reads from outside, in one order
    span: tuple[int, int] = (0, 0)  # traced-graph positions of layers[1]'s program


@dataclass
class Stitcher:
    """Decides which layers a rank's trace skips, and stitches their copies in afterwards.

    `lower_rank` calls `start` with its values and weight inputs, asks `skips(n)` for each
    captured node, calls `before`/`after` around each node it runs, reads skipped values through
    `stand_in`, calls `record(env)` at the end of the trace and `stitch(graph)` on the traced
    graph.
    """

    runs: list[_Run]
    plan: Plan
    skipped: dict[fx.Node, tuple[_Run, int]] = field(default_factory=dict)  # node -> run, layer
    position: dict[fx.Node, int] = field(default_factory=dict)  # node -> position in its layer
    stand_ins: list[tuple[fx.Node, fx.Node]] = field(default_factory=list)  # traced, captured
    env: dict = field(default_factory=dict)
    raw: dict[fx.Node, torch.Tensor] = field(default_factory=dict)  # weight -> local tensor
    raw_of: dict[fx.Node, fx.Node] = field(default_factory=dict)  # weight -> traced input
    traced_of: dict[fx.Node, fx.Node] = field(default_factory=dict)  # captured -> traced

    @classmethod
    def for_plan(cls, graph: fx.Graph, plan: Plan) -> Stitcher:
        order = {n: i for i, n in enumerate(graph.nodes)}
        runs = []
        for group in identical_layers(graph):
            for pieces in _passes(group, order):
                for layers in _contiguous_runs(pieces, order):
                    if len(layers) >= MIN_LAYERS and _placed_alike(layers, plan):
                        runs.append(_Run(layers, [_external(layer) for layer in layers]))
        runs.sort(key=lambda run: order[run.layers[0][0]])  # a later run may read an earlier one
        stitcher = cls(runs, plan)
        for run in runs:
            for k, layer in enumerate(run.layers):
                for i, n in enumerate(layer):
                    stitcher.position[n] = i
                    if k >= 2:
                        stitcher.skipped[n] = (run, k)
        return stitcher

    def start(self, env: dict, raw: dict[fx.Node, torch.Tensor]) -> None:
        """While the trace is live: the values being traced and each weight's traced input."""
        self.env = env
        self.raw = raw
        self.raw_of = {n: _node_of(t) for n, t in raw.items()}

    def skips(self, n: fx.Node) -> bool:
        return n in self.skipped

    def before(self, n: fx.Node) -> None:
        for run in self.runs:
            if n is run.layers[1][0]:
                # values of skipped layers it reads (a backward layer reads its forward's)
                # are stood in for before its program starts, so they are its inputs
                for a in run.external[1]:
                    if a in self.skipped:
                        self.env[a]
                run.span = (_traced_length(), run.span[1])

    def after(self, n: fx.Node) -> None:
        for run in self.runs:
            if n is run.layers[1][-1]:
                run.span = (run.span[0], _traced_length())

    def stand_in(self, n: fx.Node) -> Any:
        """The value of a skipped node, read after its layers: a marked copy of the traced one."""
        run, _ = self.skipped[n]
        value = self.env[run.layers[1][self.position[n]]]
        if not isinstance(value, DTensor):
            if any(isinstance(x, torch.Tensor) for x in tree_leaves(value)):
                raise StitchError(f"{n.name} of a skipped layer is read as a tensor collection")
            return value
        local = SKIPPED_VALUE(local_tensor(value), 0, len(self.stand_ins))
        stand_in = DTensor.from_local(local, value.device_mesh, value.placements, run_check=False)
        self.stand_ins.append((_node_of(local_tensor(stand_in)), n))  # from_local adds a view
        return stand_in

    def record(self, env: dict) -> None:
        """While the trace is live: which traced node holds each captured value."""
        self.traced_of = {
            n: _node_of(local_tensor(v)) for n, v in env.items() if isinstance(v, DTensor)
        }

    def stitch(self, graph: fx.Graph) -> None:
        """Put a copy of the traced layer in for each skipped layer, then drop the stand-ins."""
        nodes = list(graph.nodes)
        value_of: dict[fx.Node, fx.Node] = {}  # captured node of a skipped layer -> its copy
        for run in self.runs:
            start, end = run.span
            if end >= len(nodes):
                raise StitchError("the traced layer ends the program")
            program = nodes[start:end]
            inputs = self._inputs(run, program)
            for k in range(2, len(run.layers)):
                wiring = self._wiring(run, k, inputs, value_of)
                copy = _copy(graph, program, wiring, before=nodes[end])
                for q, t in zip(run.layers[k], run.layers[1]):
                    node = self.traced_of.get(t)
                    if node in copy:
                        value_of[q] = copy[node]
                    elif node in wiring:
                        value_of[q] = wiring[node]
        for traced, q in self.stand_ins:
            if q not in value_of:
                raise StitchError(f"no copy computes {q.name}")
            traced.replace_all_uses_with(value_of[q])
            while traced.op == "call_function" and not traced.users:
                source = traced.all_input_nodes[0]
                graph.erase_node(traced)
                if traced.target is SKIPPED_VALUE:
                    break
                traced = source

    def _inputs(self, run: _Run, program: list[fx.Node]) -> dict[fx.Node, tuple[bool, list]]:
        """The traced layer's inputs: traced node -> (is a raw weight input, the positions in
        `external` it stands for)."""
        inside = set(program)
        inputs: dict[fx.Node, tuple[bool, list[int]]] = {}
        for i, a in enumerate(run.external[1]):
            for raw, node in ((True, self.raw_of.get(a)), (False, self.traced_of.get(a))):
                if node is not None and node not in inside:
                    inputs.setdefault(node, (raw, []))[1].append(i)
        for n in program:
            for a in n.all_input_nodes:
                if a not in inside and a not in inputs and a.op != "get_attr":
                    raise StitchError(f"the traced layer's {n.name} reads {a.name} from outside")
        return inputs

    def _wiring(
        self, run: _Run, k: int, inputs: dict[fx.Node, tuple[bool, list]], value_of: dict
    ) -> dict[fx.Node, fx.Node]:
        """For layer k's copy: each input of the traced layer -> the traced node to read."""
        for model, given in zip(run.external[1], run.external[k]):
            if (
                model not in self.traced_of
                and model not in self.raw_of
                and not _same_value(self.env.get(model), self.env.get(given))
            ):
                raise StitchError(f"{given.name} differs from the traced layer's {model.name}")
        wiring = {}
        for node, (raw, slots) in inputs.items():
            model = run.external[1][slots[0]]
            if raw:
                found = {self._raw_input(run.external[k][i], model) for i in slots}
            else:
                like = self.env[model]
                found = {self._traced_value(run.external[k][i], like, value_of) for i in slots}
            if len(found) != 1:
                raise StitchError(
                    f"layer {k} reads several values where the traced layer reads one"
                )
            wiring[node] = found.pop()
        return wiring

    def _raw_input(self, q: fx.Node, model: fx.Node) -> fx.Node:
        """Layer k's own weight input, checked to be shaped and placed like the traced layer's."""
        if q not in self.raw or self.raw[q].shape != self.raw[model].shape:
            raise StitchError(f"{q.name} is not a weight shaped like {model.name}")
        if self.raw[q].dtype != self.raw[model].dtype:
            raise StitchError(f"{q.name} has another dtype than {model.name}")
        if self.plan.out_placements(q) != self.plan.out_placements(model):
            raise StitchError(f"{q.name} is placed unlike {model.name}")
        return self.raw_of[q]

    def _traced_value(self, q: fx.Node, like: DTensor, value_of: dict) -> fx.Node:
        """The traced node holding captured value `q`, checked to be laid out like `like`."""
        if q in self.skipped:
            run, _ = self.skipped[q]
            value = self.env[run.layers[1][self.position[q]]]
            node = value_of.get(q)
        else:
            value = self.env.get(q)
            node = self.traced_of.get(q)
        if node is None or not isinstance(value, DTensor):
            raise StitchError(f"{q.name} has no traced value")
        if (
            tuple(value.placements) != tuple(like.placements)
            or local_tensor(value).shape != local_tensor(like).shape
            or value.dtype != like.dtype
        ):
            raise StitchError(f"{q.name} is laid out unlike the traced layer's input")
        return node


def _copy(
    graph: fx.Graph, program: list[fx.Node], wiring: dict[fx.Node, fx.Node], before: fx.Node
) -> dict[fx.Node, fx.Node]:
    """Copy `program` in front of `before`, its inputs read through `wiring`."""
    copy: dict[fx.Node, fx.Node] = {}

    def read(x: fx.Node) -> fx.Node:
        return copy[x] if x in copy else wiring.get(x, x)

    with graph.inserting_before(before):
        for n in program:
            copy[n] = graph.node_copy(n, read)
    return copy


def _same_value(a: Any, b: Any) -> bool:
    if any(isinstance(x, torch.Tensor) for x in tree_leaves((a, b))):
        return False
    return type(a) is type(b) and a == b


def _traced_length() -> int:
    length = traced_graph_length()
    if length is None:
        raise StitchError("layers can be stitched only while a program is traced")
    return length


def _node_of(t: torch.Tensor) -> fx.Node:
    node = proxy_node(t)
    if node is None:
        raise StitchError("layers can be stitched only while a program is traced")
    return node


def _passes(group: list[list[fx.Node]], order: dict) -> list[list[list[fx.Node]]]:
    """Identical layers, each cut where other nodes run inside it: a training graph runs a
    layer's forward nodes in one place and its backward nodes in another, the layers'
    backward in reverse. Where every layer is cut alike, one list of pieces per pass (in graph
    order); otherwise the layers whole."""
    cuts = []
    for layer in group:
        pieces = [[layer[0]]]
        for a, b in zip(layer, layer[1:]):
            if order[b] == order[a] + 1:
                pieces[-1].append(b)
            else:
                pieces.append([b])
        cuts.append(pieces)
    shapes = {tuple(len(p) for p in pieces) for pieces in cuts}
    if len(cuts[0]) == 1 or len(shapes) != 1:
        return [group]
    return [
        sorted((pieces[j] for pieces in cuts), key=lambda piece: order[piece[0]])
        for j in range(len(cuts[0]))
    ]


def _contiguous_runs(group: list[list[fx.Node]], order: dict) -> list[list[list[fx.Node]]]:
    """Split a group of identical layers where anything else runs between two of them."""
    runs: list[list[list[fx.Node]]] = []
    for layer in group:
        span = range(order[layer[0]], order[layer[-1]] + 1)
        if len(span) != len(layer):
            runs.append([])  # something else runs inside this layer
            continue
        if runs and runs[-1] and order[runs[-1][-1][-1]] + 1 == span.start:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return [r for r in runs if r]


def _placed_alike(layers: list[list[fx.Node]], plan: Plan) -> bool:
    for nodes in zip(*layers):
        kinds = {plan.choices[n].kind for n in nodes}
        if len(kinds) > 1 or not all(plan.strategy(n) == plan.strategy(nodes[0]) for n in nodes):
            return False
    return True


def _external(layer: list[fx.Node]) -> list[fx.Node]:
    inside = set(layer)
    return [a for n in layer for a in n.all_input_nodes if a not in inside]
