"""`@pyflow` and `@method`: turn a Python function or class into a FlowNode factory.

A decorated function `f` gives `f.fnode()`; a decorated class `C` gives `C.fnode(*init_args)`,
built once per node instance in its worker. A class whose methods are marked `@method` becomes a
node with one group of inputs and outputs per method: `node = C.fnode(); out = node.add(a, b)`.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from tessel.config.errors import ConfigError
from tessel.dataflow.nodes import FlowNode, FlowOutput, Source
from tessel.dataflow.process_points import FuncProcessPoint, FuncSpec, UdfSpec

_METHOD = "__tessel_dataflow_method__"
_RESOURCE_KEYS = {"memory", "num_cpus", "num_gpus", "num_npus"}


def _arity(fn: Any, skip_self: bool) -> int:
    params = list(inspect.signature(fn).parameters.values())
    if skip_self:
        params = params[1:]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        raise TypeError(f"@pyflow: {fn.__qualname__} must take a fixed number of inputs")
    return len(params)


def _check_generator(fn: Any) -> None:
    if inspect.isgeneratorfunction(fn):
        raise NotImplementedError(
            f"@pyflow: {fn.__qualname__} is a generator; stream output (1 input -> N outputs) "
            "is not supported by tessel.dataflow yet"
        )


def method(_fn: Any = None, *, num_returns: int = 1, stream_input: Any = None, choice_output=None):
    """Mark a method of a `@pyflow` class as one processing function of the node."""
    if stream_input is not None or choice_output is not None:
        raise NotImplementedError("@method: stream_input and choice_output are not supported yet")

    def mark(fn: Any) -> Any:
        _check_generator(fn)
        setattr(fn, _METHOD, {"num_returns": int(num_returns)})
        return fn

    return mark(_fn) if _fn is not None else mark


class _MethodCaller:
    def __init__(self, node: PyFlowNode, name: str) -> None:
        self.node, self.name = node, name

    def __call__(self, *inputs: Source) -> FlowOutput | tuple[FlowOutput, ...]:
        spec = self.node.method_specs[self.name]
        self.node._connect(spec.inputs, inputs)
        return self.node._outputs(spec.outputs)


class PyFlowNode(FlowNode):
    """A FlowNode built by `@pyflow`; for classes with `@method`s, call `node.<method>(...)`."""

    method_specs: dict[str, FuncSpec]

    def __getattr__(self, name: str) -> Any:
        specs = self.__dict__.get("method_specs") or {}
        if name in specs:
            return _MethodCaller(self, name)
        raise AttributeError(name)

    def __call__(self, *inputs: Source) -> FlowOutput | tuple[FlowOutput, ...]:
        if self.method_specs and len(self.method_specs) > 1:
            raise TypeError(
                f"FlowNode {self.name!r}: its class has several @method functions; call "
                f"node.<method>(...), one of {sorted(self.method_specs)}"
            )
        return super().__call__(*inputs)


class PyFlow:
    """What `@pyflow` returns: still callable as the original, plus `.fnode()`."""

    def __init__(self, target: Any, num_returns: int, resources: dict[str, Any]):
        self.target = target
        self.num_returns = num_returns
        self.resources = resources
        self._made = 0
        functools.update_wrapper(self, target, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.target(*args, **kwargs)

    def fnode(self, *init_args: Any, name: str | None = None, **init_kwargs: Any) -> PyFlowNode:
        """A new FlowNode running this function (or a new instance of this class per worker).

        Without `name`, the first node is named after the function, later ones `<name>_<k>`.
        """
        target = self.target
        functions: list[FuncSpec] = []
        if inspect.isclass(target):
            methods = [
                (n, f)
                for n, f in inspect.getmembers(target, inspect.isfunction)
                if hasattr(f, _METHOD)
            ]
            methods.sort(key=lambda nf: nf[1].__code__.co_firstlineno)
            n_in = n_out = 0
            for mname, fn in methods:
                k = _arity(fn, skip_self=True)
                r = getattr(fn, _METHOD)["num_returns"]
                functions.append(
                    FuncSpec(mname, list(range(n_in, n_in + k)), list(range(n_out, n_out + r)))
                )
                n_in, n_out = n_in + k, n_out + r
            if not methods:
                call = next(
                    (vars(k)["__call__"] for k in target.__mro__ if "__call__" in vars(k)), None
                )
                if call is None:
                    raise TypeError(
                        f"@pyflow class {target.__qualname__}: mark methods with @method "
                        "or define __call__"
                    )
                n_in, n_out = _arity(call, skip_self=True), self.num_returns
                functions.append(FuncSpec(None, list(range(n_in)), list(range(n_out))))
        else:
            n_in, n_out = _arity(target, skip_self=False), self.num_returns
            functions.append(FuncSpec(None, list(range(n_in)), list(range(n_out))))
        if name is None:  # first node: the function's name; then name_1, name_2, ...
            k = self._made
            name = target.__name__ if k == 0 else f"{target.__name__}_{k}"
        self._made += 1
        pp = FuncProcessPoint(name=name, py_func=target, resources=self.resources)
        pp.udf = UdfSpec(target, tuple(init_args), dict(init_kwargs), functions)
        node = PyFlowNode(n_in, n_out, name=name)
        node.method_specs = {f.method: f for f in functions if f.method}
        node.add_process_point(pp)
        return node


def pyflow(
    _target: Any = None,
    *,
    num_returns: int = 1,
    resources: dict[str, Any] | None = None,
    stream_input: Any = None,
    choice_output: Any = None,
    visible_device_enable: bool = False,
    env_hook_func: Any = None,
) -> Any:
    """Decorate a function or class so that `.fnode()` makes FlowNodes running it.

    Args:
        num_returns: The outputs each call returns.
        resources: `num_cpus`, `memory` (MB), `num_gpus`, `num_npus`; placement checks that
            the chosen device has the GPUs or NPUs asked for.
        stream_input: CANN's streamed inputs; not built, refused where given.
        choice_output: CANN's chosen outputs; not built, refused where given.
        visible_device_enable: CANN's device visibility for the node; not built, refused
            where True.
        env_hook_func: CANN's hook run before the node starts; not built, refused where
            given.

    Returns:
        The decorated function or class, still callable as it was, with `.fnode()`.

    Raises:
        ConfigError: A setting that is not built, or an unknown resource.
    """
    not_built = {
        "stream_input": stream_input is not None,
        "choice_output": choice_output is not None,
        "visible_device_enable": visible_device_enable is not False,
        "env_hook_func": env_hook_func is not None,
    }
    for key, given in not_built.items():
        if given:
            raise ConfigError(
                "@pyflow",
                key,
                "is not built in tessel's DataFlow yet; leave it out (a setting accepted and "
                "not honoured would change what the node does without a word)",
            )
    res = dict(resources or {})
    bad = set(res) - _RESOURCE_KEYS
    if bad:
        raise ConfigError(
            "@pyflow",
            "resources",
            f"names unknown resources {sorted(bad)}; allowed {sorted(_RESOURCE_KEYS)}",
        )

    def wrap(target: Any) -> PyFlow:
        if not inspect.isclass(target):
            _check_generator(target)
        return PyFlow(target, int(num_returns), res)

    return wrap(_target) if _target is not None else wrap
