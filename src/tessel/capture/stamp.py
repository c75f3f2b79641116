"""Trace the first layer of a stack of identical layers, and stamp out copies for the rest.

Exporting a deep model traces every layer, and that trace is most of a build's time. Where an
`nn.ModuleList` holds layers that are the same program (same class, same weight shapes, equal
attributes except an index that counts up with the layer), tessel traces layer 0 for real and
exports every later layer as one placeholder op. Each placeholder is then replaced by a copy of
layer 0's nodes, wired to that layer's own weights and inputs.

The parent's code still runs in full, so what each layer is given is traced, not assumed: every
call must match layer 0's call (argument structure, tensor shapes and dtypes, equal non-tensor
values). Layer 0 runs with its index attributes guarded; reading one of them, changing an input in
place, or reaching a value outside its arguments and weights, voids the stamping and the model
is traced whole, layer by layer, instead.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.export import ExportedProgram

from tessel._torch import OpOverload, tree_flatten, tree_unflatten
from tessel.capture.layers import MIN_LAYERS

log = logging.getLogger(__name__)


class CannotStamp(Exception):
    """The stack's layers cannot be shown to trace alike; the model is traced whole instead."""


@dataclass
class Stack:
    """An `nn.ModuleList` of layers that are the same program."""

    path: str
    layers: list[nn.Module]
    index_attrs: list[tuple[nn.Module, str]]  # layer 0's (module, attribute) holding its index


@dataclass
class _Call:
    """What layer 0 was called with and returned, for the other layers' calls to match."""

    in_spec: Any = None
    in_consts: list = field(default_factory=list)
    in_meta: list = field(default_factory=list)
    out_spec: Any = None
    out_tensors: list[int] = field(default_factory=list)
    out_consts: list = field(default_factory=list)
    out_meta: list = field(default_factory=list)


_CALLS: dict[int, _Call] = {}  # stack number -> layer 0's call, while an export runs


def marker_op(name: str) -> OpOverload:
    """`tessel::<name>(x, key, slot)`: marks a value in a traced graph, where it is traced as a
    copy of `x`; it never runs, since tessel takes every marker out of the graph it traced."""

    def never_run(x: torch.Tensor, key: int, slot: int) -> torch.Tensor:
        raise RuntimeError(f"tessel::{name} marks a traced graph and never runs")

    op = torch.library.custom_op(f"tessel::{name}", never_run, mutates_args=())
    op.register_fake(lambda x, key, slot: x.clone())
    return getattr(torch.ops.tessel, name).default


LAYER_INPUT = marker_op("layer_input")  # (tensor, stack number, argument slot)
LAYER_OUTPUT = marker_op("layer_output")  # (tensor, stack number, output slot)


@torch.library.custom_op("tessel::stamped_layer", mutates_args=())
def _stamped_layer(xs: list[torch.Tensor], stack: int, layer: int) -> list[torch.Tensor]:
    raise RuntimeError("tessel::stamped_layer stands in for a layer in a traced graph only")


@_stamped_layer.register_fake
def _(xs: list[torch.Tensor], stack: int, layer: int) -> list[torch.Tensor]:
    return [
        torch.empty_strided(shape, stride, dtype=dtype, device=device)
        for shape, stride, dtype, device in _CALLS[stack].out_meta
    ]


_STAMPED = torch.ops.tessel.stamped_layer.default


def find_stacks(model: nn.Module) -> list[Stack]:
    """Every outermost `nn.ModuleList` of at least MIN_LAYERS layers that are the same program."""
    stacks: list[Stack] = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < MIN_LAYERS:
            continue
        if any(path.startswith(s.path + ".") for s in stacks):
            continue
        try:
            stacks.append(Stack(path, list(module), _index_attributes(list(module))))
        except _NotAlike as exc:
            log.debug("the layers of %s are traced one by one: %s", path, exc)
    return stacks


def why_not_a_stack(layers: nn.ModuleList) -> str | None:
    """Why `layers` are not the same program, in words; None where they are."""
    try:
        _index_attributes(list(layers))
    except _NotAlike as exc:
        return str(exc)
    return None


class _NotAlike(Exception):
    """The layers of a list differ beyond their index: they are traced one by one."""


def _index_attributes(layers: list[nn.Module]) -> list[tuple[nn.Module, str]]:
    """Layer 0's attributes that hold the layer's index; `_NotAlike` unless the layers are
    alike but for them."""
    trees = [list(layer.named_modules(remove_duplicate=False)) for layer in layers]
    first = trees[0]
    shape = [(p, type(m)) for p, m in first]
    for k, tree in enumerate(trees):
        if [(p, type(m)) for p, m in tree] != shape:
            raise _NotAlike(f"layer {k}'s modules or their classes differ from layer 0's")
        if _tensors(layers[k]) != _tensors(layers[0]):
            raise _NotAlike(f"layer {k}'s weights differ in name, shape or dtype from layer 0's")
    found = []
    for i, (path, module) in enumerate(first):
        attrs = [_plain_attributes(tree[i][1], _where(k, path)) for k, tree in enumerate(trees)]
        for k, a in enumerate(attrs):
            if a.keys() != attrs[0].keys():
                raise _NotAlike(
                    f"{_where(k, path)} has attributes {sorted(a.keys() ^ attrs[0].keys())} "
                    f"that {_where(0, path)} lacks, or lacks those"
                )
        for name, value in attrs[0].items():
            values = [a[name] for a in attrs]
            if all(_equal(value, v) for v in values):
                continue
            if all(type(v) is int and v - value == k for k, v in enumerate(values)):
                found.append((module, name))
                continue
            shown = ", ".join(_shown(v) for v in values)
            raise _NotAlike(
                f"{'.'.join(filter(None, (path, name)))} differs between layers and does not "
                f"count up: {shown}"
            )
    return found


def _where(layer: int, path: str) -> str:
    return f"layer {layer}'s {path}" if path else f"layer {layer}"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{type(value).__name__}@{id(value):x}"


def _tensors(layer: nn.Module) -> list:
    params = [(n, p.shape, p.dtype) for n, p in layer.named_parameters(remove_duplicate=False)]
    buffers = [(n, b.shape, b.dtype) for n, b in layer.named_buffers(remove_duplicate=False)]
    return params + buffers


def _plain_attributes(module: nn.Module, where: str) -> dict:
    """A module's own attributes; `_NotAlike` where a forward or backward hook could make
    layers differ."""
    out = {}
    for name, value in vars(module).items():
        if name in ("_parameters", "_buffers", "_modules"):
            continue
        if "hook" in name:
            if (name.startswith("_forward") or name.startswith("_backward")) and value:
                raise _NotAlike(f"{where} has hooks ({name})")
            continue
        out[name] = value
    return out


def _equal(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        return a == b
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, (set, frozenset)):
        return a == b and all(isinstance(x, (int, str)) for x in a)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, nn.Module):
        return _equal_modules(a, b)
    return False


def _equal_modules(a: nn.Module, b: nn.Module) -> bool:
    """Whether two modules a layer holds in a plain attribute, not as its child, compute the
    same: alike as two layers are, with no tensors and no index. (`transformers` with `kernels`
    gives every attention layer its own wrapper of the rotary function so.)"""
    if any(True for m in (a, b) for _ in (*m.parameters(), *m.buffers())):
        return False
    try:
        return _index_attributes([a, b]) == []
    except _NotAlike:
        return False


def _guard_index(module: nn.Module, names: list[str], where: str) -> type:
    """Make any read of `module`'s index attributes raise CannotStamp; returns its class.

    The module's class becomes a look-alike subclass (same name, module and qualname, so the
    traced graph records the same module types) whose properties shadow those attributes: a
    value use, a type test and a hand-off all read the attribute, and each stops the stamping.
    """
    cls = type(module)

    def guarded(name: str) -> property:
        def read(self: nn.Module) -> Any:
            raise CannotStamp(f"{where}: attribute {name!r} is read while the layer runs")

        return property(read)

    look_alike = type(cls.__name__, (cls,), {name: guarded(name) for name in names})
    look_alike.__qualname__, look_alike.__module__ = cls.__qualname__, cls.__module__
    module.__class__ = look_alike
    return cls


@contextlib.contextmanager
def stamping(stacks: list[Stack]) -> Iterator[None]:
    """While exporting: layer 0 of each stack runs marked, later layers as one placeholder op."""
    saved: list[tuple[nn.Module, str, Any]] = []
    try:
        for number, stack in enumerate(stacks):
            _CALLS[number] = _Call()
            guarded: dict[nn.Module, list[str]] = {}
            for module, name in stack.index_attrs:
                guarded.setdefault(module, []).append(name)
            for module, names in guarded.items():
                saved.append((module, "__class__", _guard_index(module, names, f"{stack.path}.0")))
            first = stack.layers[0]
            saved.append((first, "forward", None))
            first.forward = _marked_forward(first.forward, number)
            for k, layer in enumerate(stack.layers[1:], start=1):
                saved.append((layer, "forward", None))
                layer.forward = _stamped_forward(number, k, f"{stack.path}.{k}")
        yield
    finally:
        for module, name, value in reversed(saved):
            if name == "forward":
                module.__dict__.pop("forward", None)
            else:
                module.__class__ = value
        _CALLS.clear()


def _split(tree: Any) -> tuple[list[Any], list[int], Any]:
    leaves, spec = tree_flatten(tree)
    tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    return leaves, tensors, spec


def _marked_forward(forward: Any, stack: int) -> Any:
    def marked(*args: Any, **kwargs: Any) -> Any:
        call = _CALLS[stack]
        leaves, tensors, spec = _split((args, kwargs))
        call.in_spec = spec
        call.in_consts = [x for i, x in enumerate(leaves) if i not in tensors]
        call.in_meta = [(leaves[i].shape, leaves[i].dtype) for i in tensors]
        for slot, i in enumerate(tensors):
            leaves[i] = LAYER_INPUT(leaves[i], stack, slot)
        versions = [leaves[i]._version for i in tensors]
        args, kwargs = tree_unflatten(leaves, spec)
        out = forward(*args, **kwargs)
        if [leaves[i]._version for i in tensors] != versions:
            raise CannotStamp("layer 0 changes one of its inputs in place")
        outs, out_tensors, out_spec = _split(out)
        if not out_tensors:
            raise CannotStamp("layer 0 returns no tensor")
        call.out_spec = out_spec
        call.out_tensors = out_tensors
        call.out_consts = [x for i, x in enumerate(outs) if i not in out_tensors]
        call.out_meta = [
            (outs[i].shape, outs[i].stride(), outs[i].dtype, outs[i].device) for i in out_tensors
        ]
        for slot, i in enumerate(out_tensors):
            outs[i] = LAYER_OUTPUT(outs[i], stack, slot)
        return tree_unflatten(outs, out_spec)

    return marked


def _stamped_forward(stack: int, layer: int, path: str) -> Any:
    def stamped(*args: Any, **kwargs: Any) -> Any:
        call = _CALLS[stack]
        if call.out_spec is None:
            raise CannotStamp(f"{path} runs before layer 0")
        leaves, tensors, spec = _split((args, kwargs))
        consts = [x for i, x in enumerate(leaves) if i not in tensors]
        meta = [(leaves[i].shape, leaves[i].dtype) for i in tensors]
        if spec != call.in_spec or meta != call.in_meta:
            raise CannotStamp(f"{path} is called with other arguments than layer 0")
        if not all(_equal(a, b) for a, b in zip(consts, call.in_consts)):
            raise CannotStamp(f"{path} is called with other non-tensor values than layer 0")
        results = iter(_STAMPED([leaves[i] for i in tensors], stack, layer))
        consts_out = iter(call.out_consts)
        outs = [
            next(results) if i in call.out_tensors else next(consts_out)
            for i in range(call.out_spec.num_leaves)
        ]
        return tree_unflatten(outs, call.out_spec)

    return stamped


def stamp_out(ep: ExportedProgram, stacks: list[Stack]) -> None:
    """Replace each stamped layer of `ep` by a copy of its stack's layer 0, on its own weights.

    Raises CannotStamp, leaving `ep` unusable, where layer 0's nodes reach past its arguments
    and weights or are used past its outputs.
    """
    graph = ep.graph_module.graph
    target_of = {
        s.arg.name: s.target
        for s in ep.graph_signature.input_specs
        if s.target is not None and hasattr(s.arg, "name")
    }
    placeholder_of = {target_of[n.name]: n for n in graph.nodes if n.name in target_of}
    for number, stack in enumerate(stacks):
        nodes = list(graph.nodes)
        ins = _slots(nodes, LAYER_INPUT, number, stack)
        outs = _slots(nodes, LAYER_OUTPUT, number, stack)
        stubs = [n for n in nodes if n.target is _STAMPED and n.args[1] == number]
        if not ins or not outs:
            if stubs:
                raise CannotStamp(f"{stack.path}.0 left no trace")
            continue
        region = _region(nodes, ins, outs, stack, target_of)
        first = f"{stack.path}.0"
        for stub in stubs:
            layer = f"{stack.path}.{stub.args[2]}"
            # markers of inputs that layer 0 never reads were dropped as dead code
            env: dict[fx.Node, Any] = {ins[i]: x for i, x in enumerate(stub.args[0]) if i in ins}

            def wire(
                a: fx.Node, env: dict = env, layer: str = layer, first: str = first
            ) -> fx.Node:
                if a in env:
                    return env[a]
                target = target_of[a.name]  # _region let only weights through
                if not target.startswith(first + "."):
                    return a  # shared by every layer
                own = placeholder_of.get(layer + target[len(first) :])
                if own is None:
                    raise CannotStamp(f"{layer} has no {target[len(first) + 1 :]!r}")
                return own

            with graph.inserting_before(stub):
                for n in region:
                    if n.target is LAYER_OUTPUT:
                        env[n] = wire(n.args[0])
                        continue
                    copy = graph.node_copy(n, wire)
                    stack_meta = n.meta.get("nn_module_stack")
                    if stack_meta:
                        copy.meta["nn_module_stack"] = _moved(stack_meta, first, layer)
                    env[n] = copy
            for user in list(stub.users):
                if user.target is not operator.getitem or user.args[1] not in outs:
                    raise CannotStamp(f"{layer} gives an output that layer 0's caller never used")
                user.replace_all_uses_with(env[outs[user.args[1]]])
                graph.erase_node(user)
            graph.erase_node(stub)
        for n in [*outs.values(), *ins.values()]:
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
    _rename_outputs(ep)
    graph.lint()  # the caller recompiles ep.graph_module


def _rename_outputs(ep: ExportedProgram) -> None:
    """Point the signature's outputs at the nodes the output now returns (some were replaced)."""
    returned = tree_flatten(ep.graph.output_node().args[0])[0]
    for spec, node in zip(ep.graph_signature.output_specs, returned):
        if isinstance(node, fx.Node) and isinstance(getattr(spec.arg, "name", None), str):
            spec.arg.name = node.name


def _slots(nodes: list[fx.Node], marker: Any, number: int, stack: Stack) -> dict[int, fx.Node]:
    found = [n for n in nodes if n.target is marker and n.args[1] == number]
    slots = {n.args[2]: n for n in found}
    if len(slots) != len(found):
        raise CannotStamp(f"{stack.path}.0 ran more than once")
    return slots


def _region(
    nodes: list[fx.Node],
    ins: dict[int, fx.Node],
    outs: dict[int, fx.Node],
    stack: Stack,
    target_of: dict[str, str],
) -> list[fx.Node]:
    """Layer 0's nodes, checked to take only its arguments and weights, and give only outputs."""
    position = {n: i for i, n in enumerate(nodes)}
    start = min(position[n] for n in ins.values())
    end = max(position[n] for n in outs.values())
    region = [n for n in nodes[start : end + 1] if n not in ins.values()]
    inside = set(region) | set(ins.values())
    for n in region:
        if n.op != "call_function" or n.target is _STAMPED:
            raise CannotStamp(f"{stack.path}.0 holds a {n.op} node {n.name!r}")
        for a in n.all_input_nodes:
            if a not in inside and not (a.op == "placeholder" and a.name in target_of):
                raise CannotStamp(f"{stack.path}.0 uses {a.name!r} from outside its arguments")
    for n in [*region, *ins.values()]:
        if n in outs.values():
            continue
        if any(u not in inside for u in n.users):
            raise CannotStamp(f"{n.name!r} of {stack.path}.0 is used outside the layer")
    return region


def _moved(stack_meta: dict, first: str, layer: str) -> dict:
    """nn_module_stack of a copy: paths inside `first` move to `layer`."""

    def move(text: str) -> str:
        for lead in ("", "L__self__", "L['self']."):
            if text == lead + first or text.startswith(lead + first + "."):
                return lead + layer + text[len(lead + first) :]
        return text

    return {move(key): (move(path), cls) for key, (path, cls) in stack_meta.items()}
