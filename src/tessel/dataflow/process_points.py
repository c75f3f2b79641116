"""Process points: what a FlowNode runs. A Python UDF, a model, or a nested flow graph."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessel.config.jsonfile import load_json
from tessel.dataflow.nodes import FlowNode
from tessel.dataflow.process_point_base import Framework, ProcessPoint
from tessel.dataflow.runners import model_io_counts, model_target_kind

if TYPE_CHECKING:
    from tessel.dataflow.graph import FlowGraph


@dataclass
class FuncSpec:
    """One processing function of a UDF: which node inputs it takes, which outputs it fills."""

    method: str | None  # attribute of the UDF object; None: the object itself is called
    inputs: list[int]
    outputs: list[int]


@dataclass
class UdfSpec:
    """How a worker builds and calls a UDF: the target, its constructor args and its functions."""

    target: Any
    init_args: tuple = ()
    init_kwargs: dict = field(default_factory=dict)
    functions: list[FuncSpec] = field(default_factory=list)


class FuncProcessPoint(ProcessPoint):
    """A Python UDF (`py_func`): a function, or a class instantiated once per node instance.

    A class is built with no arguments; if it has `init_flow_func(params)` that is called with a
    MetaParams holding the `set_init_param` values. It is then called per transaction through
    `__call__`, else a method named `proc`, with the node's inputs; it returns one value or a
    tuple of values (one per output).
    """

    def __init__(
        self,
        compile_config_path: str | None = None,
        name: str | None = None,
        py_func: Any = None,
        workspace_dir: str | None = None,
        *,
        resources: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(name, compile_config_path)
        if py_func is None:
            raise ValueError(
                f"FuncProcessPoint {self.name!r}: py_func is required; tessel runs Python UDFs only "
                "(C++ UDF projects built from compile_config_path are not supported)"
            )
        if inspect.isclass(py_func) and not (
            _defines_call(py_func) or hasattr(py_func, "proc") or _has_pyflow_methods(py_func)
        ):
            raise TypeError(
                f"FuncProcessPoint {self.name!r}: class {py_func.__qualname__} needs __call__ "
                "or a proc method to run per transaction"
            )
        if not inspect.isclass(py_func) and not callable(py_func):
            raise TypeError(f"FuncProcessPoint {self.name!r}: py_func must be callable")
        self.py_func = py_func
        self.workspace_dir = workspace_dir
        self.init_params: dict[str, Any] = {}
        self.invoked: dict[str, GraphProcessPoint | FlowGraphProcessPoint] = {}
        self.resources: dict[str, Any] = dict(resources or {})
        self.udf = UdfSpec(py_func)
        if compile_config_path:
            cfg = load_json(compile_config_path)
            for r in cfg.get("running_resources_info", []) if isinstance(cfg, dict) else []:
                if isinstance(r, dict) and r.get("type") in ("cpu", "memory"):
                    key = "num_cpus" if r["type"] == "cpu" else "memory"
                    self.resources.setdefault(key, r.get("num"))

    def set_init_param(self, attr_name: str, attr_value: Any) -> FuncProcessPoint:
        """An init parameter the UDF reads in `init_flow_func(params)`."""
        if not isinstance(attr_name, str) or not attr_name:
            raise ValueError("set_init_param: attr_name must be a non-empty string")
        self.init_params[attr_name] = attr_value
        return self

    def add_invoked_closure(
        self, graph_key: str, pp: GraphProcessPoint | FlowGraphProcessPoint
    ) -> FuncProcessPoint:
        """Give the UDF a model or flow graph it can run with `run_context.run_flow_model(key,..)`."""
        if not isinstance(pp, GraphProcessPoint | FlowGraphProcessPoint):
            raise TypeError(
                f"add_invoked_closure({graph_key!r}): expected GraphProcessPoint or "
                f"FlowGraphProcessPoint, found {type(pp).__name__}"
            )
        if graph_key in self.invoked:
            raise ValueError(f"add_invoked_closure: key {graph_key!r} is already used")
        self.invoked[graph_key] = pp
        return self

    def check_runs_in_node(self, node: str) -> None:
        """A FlowNode runs this kind of process point itself."""

    def default_functions(self, input_num: int, output_num: int) -> list[FuncSpec]:
        if self.udf.functions:
            return self.udf.functions
        method = None
        if inspect.isclass(self.py_func) and not _defines_call(self.py_func):
            method = "proc"
        return [FuncSpec(method, list(range(input_num)), list(range(output_num)))]


def _has_pyflow_methods(cls: type) -> bool:
    return any(hasattr(f, "__tessel_dataflow_method__") for f in vars(cls).values())


def _defines_call(cls: type) -> bool:
    return any("__call__" in vars(k) for k in cls.__mro__ if k is not object)


class GraphProcessPoint(ProcessPoint):
    """A model: a `.pt2` ExportedProgram (Framework.PYTORCH) or a tessel offline model."""

    def __init__(
        self,
        framework: Framework | str,
        graph_file: str,
        load_params: dict[str, str] | None = None,
        compile_config_path: str | None = "",
        name: str | None = None,
    ) -> None:
        super().__init__(name, compile_config_path)
        fw = Framework(framework.lower()) if isinstance(framework, str) else framework
        if fw not in (Framework.PYTORCH, Framework.TESSEL):
            raise ValueError(
                f"GraphProcessPoint {self.name!r}: framework {fw.name} is not supported; tessel "
                "runs Framework.PYTORCH (.pt2 from torch.export.save) and Framework.TESSEL models"
            )
        self.framework = fw
        self.graph_file = str(graph_file)
        if not Path(self.graph_file).exists():
            raise FileNotFoundError(f"GraphProcessPoint {self.name!r}: {self.graph_file} not found")
        self.load_params = dict(load_params or {})
        self._target: str | None | bool = False

    def check_runs_in_node(self, node: str) -> None:
        """A FlowNode runs this kind of process point itself."""

    def target_device_type(self) -> str | None:
        """The device kind the model was built for (cpu/cuda/npu), None when it does not say."""
        if self._target is False:
            self._target = model_target_kind(self)
        return self._target  # type: ignore[return-value]

    def fnode(
        self, input_num: int | None = None, output_num: int | None = None, name: str | None = None
    ) -> FlowNode:
        """A FlowNode running this model, inputs and outputs mapped in order; counts default to
        the model's own (a .pt2's user inputs and outputs)."""
        if input_num is None or output_num is None:
            n_in, n_out = model_io_counts(self)
            input_num = n_in if input_num is None else input_num
            output_num = n_out if output_num is None else output_num

        node = FlowNode(input_num, output_num, name=name or self.name)
        node.add_process_point(self)
        return node


class FlowGraphProcessPoint(ProcessPoint):
    """A nested flow graph, run by a UDF that was given it with `add_invoked_closure`."""

    def __init__(
        self, flow_graph: FlowGraph, compile_config_path: str | None = "", name: str | None = None
    ) -> None:
        super().__init__(name or getattr(flow_graph, "name", None), compile_config_path)
        self.flow_graph = flow_graph

    def check_runs_in_node(self, node: str) -> None:
        """A nested flow graph runs only inside the UDF it was given to."""
        raise ValueError(
            f"FlowNode {node!r}: a FlowGraphProcessPoint runs only as an invoked closure "
            "of a FuncProcessPoint (add_invoked_closure)"
        )
