"""Graph building blocks: FlowData (graph inputs), FlowNode (compute) and FlowOutput (edges)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from tessel.dataflow.process_point_base import ProcessPoint

_order = itertools.count()
_names = itertools.count()

ENQUEUE_POLICIES = ("FIFO", "OVERWRITE")


class FlowData:
    """An input of a FlowGraph; feed values for it with `FlowGraph.feed({data: value})`."""

    def __init__(self, data_cls: Any = None, schema: Any = None, name: str | None = None) -> None:
        self.order = next(_order)
        self.name = name or f"FlowData_{self.order}"
        self.data_cls = data_cls
        self.schema = schema

    def __repr__(self) -> str:
        return f"FlowData({self.name!r})"


@dataclass(frozen=True, eq=False)
class FlowOutput:
    """Output `index` of `node`: what a node call returns and what a graph outputs."""

    node: FlowNode
    index: int

    def __repr__(self) -> str:
        return f"FlowOutput({self.node.name!r}, {self.index})"


Source = FlowData | FlowOutput


class FlowNode:
    """A compute node with `input_num` inputs and `output_num` outputs, backed by one process point."""

    def __init__(self, input_num: int, output_num: int, name: str | None = None) -> None:
        if input_num < 0 or output_num < 1:
            raise ValueError(f"FlowNode: needs input_num >= 0 and output_num >= 1 ({name})")
        self.order = next(_order)
        self.name = name or f"FlowNode_{next(_names)}"
        self.alias: str | None = None
        self.input_num = input_num
        self.output_num = output_num
        self.pp: ProcessPoint | None = None
        self.input_map: dict[int, int] = {}
        self.output_map: dict[int, int] = {}
        self.input_attrs: dict[int, list[Any]] = {}
        self.attrs: dict[str, Any] = {}
        self.balance_scatter = False
        self.balance_gather = False
        self.inputs: list[Source | None] = [None] * input_num

    def __repr__(self) -> str:
        return f"FlowNode({self.name!r})"

    @property
    def deploy_name(self) -> str:
        """The name a deploy file uses for this node: its alias if set, else its name."""
        return self.alias or self.name

    def add_process_point(self, pp: ProcessPoint) -> FlowNode:
        """Attach the node's single process point; inputs and outputs map in order by default."""
        if self.pp is not None:
            raise ValueError(f"FlowNode {self.name!r}: already has process point {self.pp.name!r}")
        if not isinstance(pp, ProcessPoint):
            raise TypeError(f"FlowNode {self.name!r}: not a process point: {pp!r}")
        pp.check_runs_in_node(self.name)
        self.pp = pp
        return self

    def map_input(
        self, node_input_index: int, pp: ProcessPoint, pp_input_index: int, input_attrs=None
    ) -> FlowNode:
        """Feed node input `node_input_index` to input `pp_input_index` of the process point."""
        self._check_pp(pp)
        if not 0 <= node_input_index < self.input_num:
            raise IndexError(f"FlowNode {self.name!r}: input {node_input_index} out of range")
        self.input_map[node_input_index] = pp_input_index
        if input_attrs:
            raise NotImplementedError(
                f"FlowNode {self.name!r}: input attributes (TimeBatch, CountBatch) are not "
                "supported by tessel.dataflow yet"
            )
        return self

    def map_output(
        self, node_output_index: int, pp: ProcessPoint, pp_output_index: int
    ) -> FlowNode:
        """Take node output `node_output_index` from output `pp_output_index` of the process point."""
        self._check_pp(pp)
        if not 0 <= node_output_index < self.output_num:
            raise IndexError(f"FlowNode {self.name!r}: output {node_output_index} out of range")
        self.output_map[node_output_index] = pp_output_index
        return self

    def _check_pp(self, pp: ProcessPoint) -> None:
        if self.pp is None:
            self.add_process_point(pp)
        elif pp is not self.pp:
            raise ValueError(f"FlowNode {self.name!r}: {pp.name!r} is not its process point")

    def set_attr(self, attr_name: str, attr_value: Any) -> FlowNode:
        """Flow attributes: `_flow_attr_depth` (queue depth, >= 2) and `_flow_attr_enqueue_policy`."""
        if attr_name == "_flow_attr_depth" and (not isinstance(attr_value, int) or attr_value < 2):
            raise ValueError(f"FlowNode {self.name!r}: _flow_attr_depth must be an int >= 2")
        if attr_name == "_flow_attr_enqueue_policy" and attr_value not in ENQUEUE_POLICIES:
            raise ValueError(
                f"FlowNode {self.name!r}: enqueue policy must be one of FIFO, OVERWRITE"
            )
        if attr_name == "_flow_attr_enqueue_policy" and attr_value == "OVERWRITE":
            raise NotImplementedError(
                f"FlowNode {self.name!r}: OVERWRITE queues are not supported; tessel's are FIFO"
            )
        self.attrs[attr_name] = attr_value
        return self

    def set_balance_scatter(self) -> FlowNode:
        """Send this node's outputs to the least-loaded instance of each (one-input) consumer."""
        if self.balance_gather:
            raise ValueError(f"FlowNode {self.name!r}: balance scatter and gather are exclusive")
        self.balance_scatter = True
        return self

    def set_balance_gather(self) -> FlowNode:
        """Mark this node as where a balanced (scattered) region comes back together.

        tessel aligns every node's inputs by transaction id, gather or not, so the outputs of a
        balance-scatter's instances always meet here per transaction, complete and in order. The
        flag is checked, as in CANN: FlowGraph refuses a gather node with no balance-scatter
        node upstream of it.
        """
        if self.balance_scatter:
            raise ValueError(f"FlowNode {self.name!r}: balance scatter and gather are exclusive")
        self.balance_gather = True
        return self

    def set_alias(self, name: str) -> FlowNode:
        """Another name for the node, usable in deploy files."""
        self.alias = name
        return self

    def _connect(self, indexes: list[int], inputs: tuple[Any, ...]) -> None:
        if len(inputs) != len(indexes):
            raise ValueError(
                f"FlowNode {self.name!r}: called with {len(inputs)} inputs, expected {len(indexes)}"
            )
        for i, src in zip(indexes, inputs, strict=True):
            if not isinstance(src, FlowData | FlowOutput):
                raise TypeError(
                    f"FlowNode {self.name!r}: input {i} must be a FlowData or a node output, "
                    f"found {type(src).__name__}"
                )
            if self.inputs[i] is not None:
                raise ValueError(f"FlowNode {self.name!r}: input {i} is already connected")
            self.inputs[i] = src

    def _outputs(self, indexes: list[int]) -> FlowOutput | tuple[FlowOutput, ...]:
        outs = tuple(FlowOutput(self, i) for i in indexes)
        return outs[0] if len(outs) == 1 else outs

    def __call__(self, *inputs: Source) -> FlowOutput | tuple[FlowOutput, ...]:
        """Connect the inputs; returns the node's output (or a tuple when it has several)."""
        if self.pp is None:
            raise ValueError(f"FlowNode {self.name!r}: add a process point before calling it")
        self._connect(list(range(self.input_num)), inputs)
        return self._outputs(list(range(self.output_num)))
