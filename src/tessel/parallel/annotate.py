"""`shard` and `reshard`: mindspore.parallel's sharding annotations, carried out by DTensor.

A strategy is a `Layout` called with its tensor map, or a tuple of split counts (one per
tensor dim; a dim split over every rank, or nothing split); `None` is data parallel (dim 0
split over every rank). `shard(module, in_strategy, parameter_plan=...)` makes the planned
parameters DTensors placed as asked, and runs the module on DTensors: its positional inputs
placed by `in_strategy` (a plain tensor is taken as the whole tensor, held by every rank),
other tensor inputs replicated; its outputs leave whole, or as DTensors placed by
`out_strategy` where one is given. DTensor inserts the communication, forward and backward.

Inside `data_parallel(mesh)` (AutoParallel's semi_auto) the rest of the network runs data
parallel: its inputs and an annotated region's outputs are DTensors with dim 0 split over every
rank, its other parameters replicated DTensors, and plain tensors it makes are taken as
replicated (DTensor's `implicit_replication`), so DTensor's own rules keep every unannotated
operator data parallel and reduce the replicated parameters' gradients.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

from tessel._torch import tree_flatten, tree_map, tree_unflatten
from tessel.checkpoint.dtensor import layout_to_dtensor
from tessel.checkpoint.layout import Layout
from tessel.parallel.replaced import replace_parameters
from tessel.plan import cpu_attention, nll_loss  # noqa: F401  (DTensor learns them)

_MESHES: dict[tuple, DeviceMesh] = {}
# the mesh the unannotated rest of the network runs data parallel on, inside `data_parallel`
_ROWS_MESH: contextvars.ContextVar[DeviceMesh | None] = contextvars.ContextVar(
    "tessel_rows_mesh", default=None
)


def world_mesh(device_type: str) -> DeviceMesh:
    key = (device_type, "world")
    if key not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES[key] = init_device_mesh(
            device_type, (dist.get_world_size(),), mesh_dim_names=("world",)
        )
    return _MESHES[key]


def _layout_mesh(layout: Layout, device_type: str) -> tuple[DeviceMesh, list]:
    """The layout's mesh (one per distinct device matrix, ranks and aliases: every rank makes
    them in the same order, as SPMD scripts do) and its placements."""
    key = (
        device_type,
        tuple(layout.device_matrix),
        tuple(layout.rank_list),
        tuple(layout.alias_name),
    )
    if key not in _MESHES:
        _MESHES[key], placements = layout_to_dtensor(layout, device_type)
        return _MESHES[key], placements
    return layout_to_dtensor(layout, device_type, _MESHES[key])


def check_layout(layout: Layout, world: int, where: str) -> None:
    """A Layout usable as a strategy: called with its tensor map, over the job's ranks."""
    if layout.tensor_map is None:
        raise ValueError(f"{where}: the Layout needs a tensor map (call it: layout('dp', 'None'))")
    if math.prod(layout.device_matrix) != world:
        raise ValueError(
            f"{where}: the Layout's device matrix {tuple(layout.device_matrix)} covers "
            f"{math.prod(layout.device_matrix)} ranks; the job has {world}"
        )


def placed(
    strategy: Any, ndim: int, shape: tuple[int, ...] | None, device_type: str, where: str
) -> tuple[DeviceMesh, list]:
    """(mesh, placements) of a strategy for a tensor of `shape` (None: a shard of unknown
    whole, not checked for even splits); `where` names it in errors."""
    world = dist.get_world_size()
    if isinstance(strategy, Layout):
        check_layout(strategy, world, where)
        if len(strategy.tensor_map) != ndim:
            raise ValueError(
                f"{where}: the Layout maps {len(strategy.tensor_map)} dims; the tensor has {ndim}"
            )
        mesh, placements = _layout_mesh(strategy, device_type)
    else:
        if strategy is None:  # data parallel
            strategy = (world, *(1,) * (ndim - 1))
        if not isinstance(strategy, tuple) or not all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in strategy
        ):
            raise TypeError(
                f"{where}: a strategy is a Layout, a tuple of split counts (ints >= 1) or None, "
                f"found {strategy!r}"
            )
        if len(strategy) != ndim:
            raise ValueError(f"{where}: {len(strategy)} split counts for a tensor of {ndim} dims")
        split = [d for d, c in enumerate(strategy) if c > 1]
        if len(split) > 1 or (split and strategy[split[0]] != world):
            raise ValueError(
                f"{where}: split counts {strategy} are not built: split one dim over all "
                f"{world} ranks, or give a Layout"
            )
        mesh = world_mesh(device_type)
        placements = [Shard(split[0])] if split else [Replicate()]
    for p, n in zip(placements, mesh.shape):
        if shape is not None and isinstance(p, Shard) and shape[p.dim] % n:
            raise ValueError(
                f"{where}: dim {p.dim} of shape {tuple(shape)} does not divide into {n} shards"
            )
    return mesh, list(placements)


def shard_of(x: torch.Tensor, layout: Layout, where: str) -> DTensor:
    """The DTensor whose part on this rank is `x`, placed as `layout` says (even splits)."""
    mesh, placements = placed(layout, x.dim(), None, x.device.type, where)
    return DTensor.from_local(x.contiguous(), mesh, placements, run_check=False)


def check_kinds(strategies: list, where: str) -> None:
    kinds = {isinstance(s, Layout) for s in strategies if s is not None}
    if len(kinds) > 1:
        raise TypeError(
            f"{where}: the strategy can only pass in consistent type for all inputs: all "
            "Layouts or all tuples of split counts"
        )


def _as_dtensor(x: torch.Tensor, mesh: DeviceMesh, placements: list) -> DTensor:
    if isinstance(x, DTensor):
        return _onto(x, mesh, placements).redistribute(mesh, placements)
    whole = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, placements)


def _onto(x: DTensor, mesh: DeviceMesh, placements: list) -> DTensor:
    """`x` on `mesh`, a mesh of the same ranks in the same (row-major) order as its own, with
    the same values, on the way to `placements` there. A placement every mesh dim shares
    (replicated, partial sums, or one tensor dim split evenly over all ranks) reads the same
    on any such mesh; any other is first redistributed to one: the target's where it is one,
    else replicated."""
    if x.device_mesh == mesh:
        return x
    if x.device_mesh.mesh.flatten().tolist() != mesh.mesh.flatten().tolist():
        raise ValueError(
            f"shard: a tensor on the ranks {x.device_mesh.mesh.tolist()} meets a layout on "
            f"{mesh.mesh.tolist()}; layouts over different ranks are not built"
        )

    def shared(found: Any) -> Any:
        """The placement every mesh dim of `found` has, where it reads the same on any mesh."""
        kinds = set(found)
        p = kinds.pop() if len(kinds) == 1 else None
        if (
            isinstance(p, Replicate)
            or (isinstance(p, Partial) and p.reduce_op == "sum")
            or (type(p) is Shard and x.shape[p.dim] % mesh.size() == 0)
        ):
            return p
        return None

    placement = shared(x.placements)
    if placement is None:
        target = shared(placements)
        placement = Replicate() if target is None or isinstance(target, Partial) else target
        x = x.redistribute(x.device_mesh, [placement] * x.device_mesh.ndim)
    return DTensor.from_local(
        x.to_local(),
        mesh,
        [placement] * mesh.ndim,
        run_check=False,
        shape=x.shape,
        stride=x.stride(),
    )


@contextlib.contextmanager
def data_parallel(mesh: DeviceMesh) -> Iterator[None]:
    """Run the unannotated part of a network data parallel on `mesh` (see the module
    docstring): annotated regions hand their outputs back split by rows."""
    token = _ROWS_MESH.set(mesh)
    try:
        with implicit_replication():
            yield
    finally:
        _ROWS_MESH.reset(token)


def whole(output: Any, after_backward: Callable[[], None]) -> Any:
    """The DTensors in a `data_parallel` run's output as whole plain tensors; `after_backward`
    runs when their backward pass has filled the gradients.

    That backward must take plain tensors as replicated, as the forward did (autograd saved
    some, such as index tensors the network made, for DTensor operators it runs then), and
    autograd runs a backward pass under the settings of the thread that started it. So the
    outputs come back cut from their graph, and the backward of the cut runs that graph's own
    backward pass with implicit replication on (as reentrant activation checkpointing does).
    """
    leaves, spec = tree_flatten(output)
    leaves = [v.full_tensor() if isinstance(v, DTensor) else v for v in leaves]
    trained = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.requires_grad]
    if trained:
        anchor = torch.empty(0, requires_grad=True)
        cut = _ReplicatedBackward.apply(anchor, [leaves[i] for i in trained], after_backward)
        for i, v in zip(trained, cut):
            leaves[i] = v
    return tree_unflatten(leaves, spec)


class _ReplicatedBackward(torch.autograd.Function):
    """`outputs` detached; its backward runs theirs under implicit replication, then
    `after_backward`."""

    @staticmethod
    def forward(
        ctx: Any, anchor: torch.Tensor, outputs: list, after_backward: Callable[[], None]
    ) -> tuple:
        ctx.outputs, ctx.after_backward = outputs, after_backward
        return tuple(v.detach() for v in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, None, None]:
        pairs = [(v, g) for v, g in zip(ctx.outputs, grads) if g is not None]
        ctx.outputs = None
        if pairs:
            with implicit_replication():
                torch.autograd.backward([v for v, _ in pairs], [g for _, g in pairs])
            ctx.after_backward()
        return None, None, None


def rows(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """`x` (a DTensor, or a whole tensor every rank holds) on the 1-D `mesh` with dim 0 split
    over its ranks, or replicated where dim 0 does not divide among them."""
    split = x.dim() > 0 and x.shape[0] % mesh.size() == 0
    return _as_dtensor(x, mesh, [Shard(0) if split else Replicate()])


def shard(
    fn: torch.nn.Module | Callable,
    in_strategy: tuple,
    out_strategy: tuple | None = None,
    parameter_plan: Mapping[str, Any] | None = None,
    device: str = "Ascend",
    level: int = 0,
) -> torch.nn.Module | Callable:
    """Run `fn` sharded (see the module docstring). A module is changed in place and returned;
    a function comes back wrapped.

    Args:
        fn: A module or a function.
        in_strategy: Each input's layout, or its split counts per dim (all of one kind).
        out_strategy: Each output's layout or split counts. Default: as DTensor leaves them.
        parameter_plan: ``{parameter name: layout}``, for a module's parameters.
        device: MindSpore's backend name; it chooses nothing here (the job's devices do).
        level: MindSpore's search level (0, 1 or 2); it chooses nothing here.

    Returns:
        The module, changed in place, or the wrapped function.

    Raises:
        TypeError: A strategy of the wrong type, or layouts mixed with split counts.
    """
    if not isinstance(in_strategy, tuple):
        raise TypeError(f"shard: in_strategy must be a tuple, found {type(in_strategy).__name__}")
    if out_strategy is not None and not isinstance(out_strategy, tuple):
        raise TypeError(
            f"shard: out_strategy must be a tuple or None, found {type(out_strategy).__name__}"
        )
    if level not in (0, 1, 2):
        raise ValueError(f"shard: level must be 0, 1 or 2, found {level!r}")
    check_kinds(list(in_strategy), "shard: in_strategy")
    if out_strategy is not None:
        check_kinds(list(out_strategy), "shard: out_strategy")
    if parameter_plan is not None and not isinstance(fn, torch.nn.Module):
        raise TypeError("shard: parameter_plan needs fn to be an nn.Module")
    if not dist.is_initialized():
        raise RuntimeError("shard needs torch.distributed initialised first")
    if dist.get_world_size() == 1:
        return fn

    annotation = _Annotation(in_strategy, out_strategy)
    if isinstance(fn, torch.nn.Module):
        device_type = _device_type(fn)
        mesh = _default_mesh(in_strategy, device_type)
        distribute_parameters(fn, parameter_plan or {}, mesh, "shard()")
        fn.register_forward_pre_hook(annotation.enter_module, with_kwargs=True)
        fn.register_forward_hook(annotation.leave_module)
        return fn

    @functools.wraps(fn)
    def sharded(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = annotation.enter(args, kwargs)
        return annotation.leave(fn(*args, **kwargs))

    return sharded


class _Annotation:
    """What `shard` does on the way into and out of a module or function. Outside a job (no
    process group: a copy traced for planning) a module's hooks let everything pass."""

    def __init__(self, in_strategy: tuple, out_strategy: tuple | None) -> None:
        self.in_strategy = in_strategy
        self.out_strategy = out_strategy

    def enter_module(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        return self.enter(args, kwargs) if dist.is_initialized() else None

    def leave_module(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        return self.leave(output) if dist.is_initialized() else None

    def enter(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        in_strategy = self.in_strategy
        if len(args) > len(in_strategy):
            raise ValueError(
                f"shard: in_strategy has {len(in_strategy)} entries; the call has {len(args)} "
                "positional inputs"
            )
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        device_type = tensors[0].device.type if tensors else "cpu"
        placed_args = []
        for i, x in enumerate(args):
            if isinstance(x, torch.Tensor):
                mesh, placements = placed(
                    in_strategy[i], x.dim(), tuple(x.shape), device_type, f"shard: in_strategy[{i}]"
                )
                x = _as_dtensor(x, mesh, placements)
            placed_args.append(x)
        mesh = _default_mesh(in_strategy, device_type)
        kwargs = tree_map(
            lambda v: (
                _as_dtensor(v, mesh, [Replicate()] * mesh.ndim)
                if isinstance(v, torch.Tensor)
                else v
            ),
            kwargs,
        )
        return tuple(placed_args), kwargs

    def leave(self, output: Any) -> Any:
        out_strategy = self.out_strategy
        leaves, spec = tree_flatten(output)
        out = []
        for i, v in enumerate(leaves):
            if isinstance(v, DTensor):
                if out_strategy is None:
                    rows_mesh = _ROWS_MESH.get()
                    v = v.full_tensor() if rows_mesh is None else rows(v, rows_mesh)
                else:
                    if i >= len(out_strategy):
                        raise ValueError(
                            f"shard: out_strategy has {len(out_strategy)} entries; the output "
                            f"has tensor {i} too"
                        )
                    mesh, placements = placed(
                        out_strategy[i],
                        v.dim(),
                        tuple(v.shape),
                        v.device_mesh.device_type,
                        f"shard: out_strategy[{i}]",
                    )
                    v = v.redistribute(mesh, placements)
            out.append(v)
        return tree_unflatten(out, spec)


def _device_type(module: torch.nn.Module) -> str:
    for t in (*module.parameters(), *module.buffers()):
        return t.device.type
    return "cpu"


def _default_mesh(strategies: tuple, device_type: str) -> DeviceMesh:
    """The mesh the annotation's tensors share: its layouts', or every rank in a row."""
    for s in strategies:
        if isinstance(s, Layout):
            return _layout_mesh(s, device_type)[0]
    return world_mesh(device_type)


def distribute_parameters(
    module: torch.nn.Module, plan: Mapping[str, Any], mesh: DeviceMesh, cause: str
) -> None:
    """Every parameter of `module` a DTensor: placed by `plan`, or replicated. A parameter
    shared under several names (tied weights) stays one parameter under all of them. The old
    parameters retire (`replaced`), `cause` naming what placed them."""
    names = dict(module.named_parameters(remove_duplicate=False))
    wanted = {}
    for key, strategy in plan.items():
        name = key.removeprefix("self.")
        if name not in names:
            raise KeyError(
                f"shard: parameter_plan names {key!r}; the module's parameters are {sorted(names)}"
            )
        wanted[name] = strategy
    aliases: dict[int, list[str]] = {}
    for name, parameter in names.items():
        if not isinstance(parameter, DTensor):
            aliases.setdefault(id(parameter), []).append(name)
    values = {}
    for group in aliases.values():
        parameter = names[group[0]]
        planned = [(name, wanted[name]) for name in group if name in wanted]
        if any(strategy != planned[0][1] for _, strategy in planned):
            raise ValueError(
                f"shard: parameter_plan places the tied parameters {[n for n, _ in planned]} "
                "differently; they are one tensor"
            )
        if planned:
            name, strategy = planned[0]
            p_mesh, placements = placed(
                strategy,
                parameter.dim(),
                tuple(parameter.shape),
                parameter.device.type,
                f"shard: parameter_plan[{name!r}]",
            )
            if p_mesh != mesh:
                raise ValueError(
                    f"shard: parameter_plan[{name!r}] is on another device mesh than the inputs "
                    "(give layouts of one device matrix)"
                )
        else:
            placements = [Replicate()] * mesh.ndim
        values[group[0]] = torch.nn.Parameter(
            distribute_tensor(parameter.detach(), mesh, placements),
            requires_grad=parameter.requires_grad,
        )
    replace_parameters(module, values, cause)


def reshard(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """`tensor` placed as `layout` says: a DTensor is redistributed, a plain tensor is taken as
    the whole tensor, held by every rank. One rank: the tensor unchanged.

    Args:
        tensor: A DTensor, or a plain tensor every rank holds whole.
        layout: The placement to give it.

    Returns:
        The DTensor placed as `layout` says.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"reshard: tensor must be a Tensor, found {type(tensor).__name__}")
    if not isinstance(layout, Layout):
        raise TypeError(f"reshard: layout must be a Layout, found {type(layout).__name__}")
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tensor
    mesh, placements = placed(
        layout, tensor.dim(), tuple(tensor.shape), tensor.device.type, "reshard: layout"
    )
    return _as_dtensor(tensor, mesh, placements)
