"""What runs inside a node instance, whatever the executor: the UDF or model, and its context.

`NodeRuntime` builds the UDF object (or loads the model) on the instance's device, loads the
invoked closures, and maps one transaction's inputs to outputs. Inside a UDF,
`get_run_context()` gives `run_flow_model(key, inputs)` for invoked closures, and
`get_running_instance_id()` / `_num()` / `get_running_device_id()` say where it runs.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from tessel.dataflow.process_points import FlowGraphProcessPoint, FuncProcessPoint
from tessel.dataflow.runners import load_model

if TYPE_CHECKING:
    from tessel.dataflow.placement import GraphPlacement, Instance
    from tessel.dataflow.spec import GraphSpec, NodeSpec


class MetaParams:
    """What `init_flow_func(params)` receives: the node's name, sizes and init params."""

    def __init__(self, name: str, attrs: dict[str, Any], input_num: int, output_num: int) -> None:
        self._name, self._attrs = name, dict(attrs)
        self._in, self._out = input_num, output_num

    def get_name(self) -> str:
        return self._name

    def get_attr(self, name: str, default: Any = None) -> Any:
        return self._attrs.get(name, default)

    def get_input_num(self) -> int:
        return self._in

    def get_output_num(self) -> int:
        return self._out

    def attrs(self) -> dict[str, Any]:
        return dict(self._attrs)


class RunContext:
    """The running instance: where it is, and its invoked closures."""

    def __init__(self, node: str, instance: int, num: int, device: int, invoked: dict[str, Any]):
        self.node, self.instance, self.num, self.device = node, instance, num, device
        self._invoked = invoked

    def run_flow_model(self, key: str, inputs: list[Any], timeout: int = -1) -> list[Any]:
        """Run the invoked model or flow graph `key` on `inputs`; returns its outputs."""
        fn = self._invoked.get(key)
        if fn is None:
            raise KeyError(
                f"node {self.node!r}: no invoked closure {key!r} (has {sorted(self._invoked)})"
            )
        return list(fn(*inputs))


_current: RunContext | None = None


def get_run_context() -> RunContext:
    """The context of the UDF running in this process (inside a UDF only)."""
    if _current is None:
        raise RuntimeError("get_run_context() is only available inside a running UDF")
    return _current


def get_running_instance_id() -> int:
    return get_run_context().instance


def get_running_instance_num() -> int:
    return get_run_context().num


def get_running_device_id() -> int:
    return get_run_context().device


class NodeRuntime:
    """One instance of one node, built where it runs."""

    def __init__(
        self,
        spec: NodeSpec,
        index: int,
        count: int,
        inst: Instance,
        invoked: dict[str, Any],
    ) -> None:
        global _current
        self.spec = spec
        self.inst = inst
        if inst.kind == "cuda":  # bind the worker to its GPU: UDFs' default device too
            import torch

            torch.cuda.set_device(torch.device(inst.torch_device))
        closures: dict[str, Any] = {}
        for key, pp in spec.invoked.items():
            where = invoked[key]
            if isinstance(pp, FlowGraphProcessPoint):
                closures[key] = InlineGraph(pp.flow_graph.spec, where)
            else:
                closures[key] = load_model(pp, where[index].torch_device)
        self.ctx = RunContext(spec.deploy_name, index, count, inst.device.device, closures)
        self.model = None
        self.obj: Any = None
        _current = self.ctx
        if spec.kind == "model":
            self.model = load_model(spec.pp, inst.torch_device)
        else:
            pp = spec.pp
            assert isinstance(pp, FuncProcessPoint)
            target = pp.udf.target
            if inspect.isclass(target):
                self.obj = target(*pp.udf.init_args, **pp.udf.init_kwargs)
                init = getattr(self.obj, "init_flow_func", None)
                if init is not None:
                    ret = init(MetaParams(spec.deploy_name, pp.init_params, spec.n_in, spec.n_out))
                    if isinstance(ret, int) and not isinstance(ret, bool) and ret != 0:
                        raise RuntimeError(f"init_flow_func returned {ret}")
            else:
                self.obj = target

    def process(self, inputs: list[Any]) -> list[Any]:
        """One transaction: node inputs (by index) -> node outputs (by index)."""
        global _current
        _current = self.ctx
        outs: list[Any] = [None] * self.spec.n_out
        for f in self.spec.functions:
            args = [inputs[i] for i in f.inputs]
            if self.model is not None:
                res: Any = self.model(*args)
            else:
                fn = self.obj if f.method is None else getattr(self.obj, f.method)
                res = fn(*args)
                if len(f.outputs) == 1:
                    res = [res]
            if not isinstance(res, tuple | list) or len(res) < len(
                [o for o in f.outputs if o >= 0]
            ):
                raise ValueError(
                    f"node {self.spec.deploy_name!r}: expected {len(f.outputs)} outputs, got "
                    f"{type(res).__name__}"
                    + (f" of length {len(res)}" if isinstance(res, tuple | list) else "")
                )
            for j, o in enumerate(f.outputs):
                if o >= 0:
                    outs[o] = res[j]
        return outs


class InlineGraph:
    """A nested flow graph run inside the invoking UDF's process, node by node in order.

    Placement (Placer._check_inline) has made sure each inner node has exactly one instance, on
    the invoking UDF's device, so running `instances[0]` here is what the deploy file says.
    """

    def __init__(self, spec: GraphSpec, placement: GraphPlacement) -> None:
        self.spec = spec
        self.nodes = [
            (
                n,
                NodeRuntime(
                    n, 0, 1, placement.nodes[n.name].instances[0], placement.nodes[n.name].invoked
                ),
            )
            for n in spec.nodes
        ]

    def __call__(self, *inputs: Any) -> list[Any]:
        global _current
        saved = _current
        if len(inputs) != len(self.spec.datas):
            raise ValueError(
                f"flow graph {self.spec.name!r} takes {len(self.spec.datas)} inputs, got {len(inputs)}"
            )
        values: dict[tuple, Any] = {("data", k): v for k, v in enumerate(inputs)}
        try:
            for n, rt in self.nodes:
                outs = rt.process([values[s] for s in n.sources])
                for o, v in enumerate(outs):
                    values[("node", n.name, o)] = v
        finally:
            _current = saved
        return [values[("node", name, o)] for name, o in self.spec.outputs]
