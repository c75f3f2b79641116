"""What every process point is, apart from what it runs: the model formats (`Framework`) and
the `ProcessPoint` base. FlowNode and the model runners need only these; process_points.py
builds the kinds of process point on them (and makes FlowNodes of models)."""

from __future__ import annotations

import enum
import itertools

_ids = itertools.count()


class Framework(enum.Enum):
    """Model formats. tessel runs PYTORCH (.pt2 ExportedProgram) and TESSEL (offline model)."""

    TENSORFLOW = "tensorflow"
    ONNX = "onnx"
    MINDSPORE = "mindspore"
    PYTORCH = "pytorch"
    TESSEL = "tessel"


class ProcessPoint:
    """Base: a named unit of work a FlowNode runs."""

    def __init__(self, name: str | None, compile_config_path: str | None = None) -> None:
        self.name = name or f"{type(self).__name__}_{next(_ids)}"
        self.compile_config_path = compile_config_path or None

    def check_runs_in_node(self, node: str) -> None:
        """Raise unless a FlowNode (named `node`) can run this process point itself: only the
        kinds that say so can."""
        raise TypeError(f"FlowNode {node!r}: not a process point: {self!r}")
