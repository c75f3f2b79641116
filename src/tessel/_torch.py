"""Every private torch symbol tessel uses, imported here and nowhere else.

tessel leans on a few torch internals that have no public counterpart yet: DTensor's sharding
rule registries (to enumerate candidate placements), its caches (so a rank's trace cannot see
another rank's mesh), the fake process group (to trace a rank without other processes),
torch.export's one-trace post-dispatch mode, and the proxy tracer's node slots (to stitch copies
of a traced layer). A torch upgrade that moves any of them touches this file alone.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils._pytree import (
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_map,
    tree_unflatten,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# DTensor's internals take most of a second to import, and a worker that runs a program never
# needs them: they are imported on first use (a module `__getattr__`, PEP 562)
_DTENSOR_SYMBOLS = {
    "DTensorSpec": ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
    "TensorMeta": ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
    "OpSchema": ("torch.distributed.tensor._op_schema", "OpSchema"),
    "OpSpec": ("torch.distributed.tensor._op_schema", "OpSpec"),
    "OpStrategy": ("torch.distributed.tensor._op_schema", "OpStrategy"),
    "TupleStrategy": ("torch.distributed.tensor._op_schema", "TupleStrategy"),
    "fill_single_dim_strategy_placeholders": (
        "torch.distributed.tensor._ops.single_dim_strategy",
        "_fill_single_dim_strategy_placeholders",
    ),
    "insert_single_dim_replication_strategy": (
        "torch.distributed.tensor._ops.single_dim_strategy",
        "_insert_single_dim_replication_strategy",
    ),
    "expand_to_full_mesh_op_strategy": (
        "torch.distributed.tensor._ops.utils",
        "expand_to_full_mesh_op_strategy",
    ),
    "MaskPartial": ("torch.distributed.tensor.placement_types", "_MaskPartial"),
    "StridedShard": ("torch.distributed.tensor.placement_types", "_StridedShard"),
}


def __getattr__(name: str) -> Any:
    if name not in _DTENSOR_SYMBOLS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _DTENSOR_SYMBOLS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


OpOverload = torch._ops.OpOverload
HigherOrderOperator = torch._ops.HigherOrderOperator

# the one-tensor collectives: `*_single` in newer torch, `*_tensor` (now deprecated) before
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

# the op namespace of torch's functional collectives (private by its leading underscore): the
# collectives a lowered program calls, as `torch.ops._c10d_functional.<name>` and, written in a
# program or a slice, as targets named "_c10d_functional.<name>.<overload>"
C10D_FUNCTIONAL = "_c10d_functional"

__all__ = [
    "C10D_FUNCTIONAL",
    "all_gather_single",
    "reduce_scatter_single",
    "OpOverload",
    "clear_dtensor_caches",
    "detached_mesh",
    "dtensor_op_handlers",
    "rules_without_costs",
    "export_post_dispatch",
    "fake_process_group",
    "forget_process_groups",
    "group_ranks",
    "merged_moves",
    "redistribute_steps",
    "proxy_node",
    "redistribute",
    "sharding_propagator",
    "traced_graph_length",
    "traced_nodes_since",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_flatten_with_path",
    "tree_unflatten",
    *_DTENSOR_SYMBOLS,
]


def sharding_propagator() -> Any:
    """DTensor's registry of sharding rules (`op_strategy_funcs`, single-dim rules, schemas)."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator


def dtensor_op_handlers() -> dict:
    """DTensor's table of operators it runs by a handler of their own instead of a sharding
    rule (torch's `loss_parallel` adds its loss operators there too)."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher._custom_op_handlers


def clear_dtensor_caches() -> None:
    """Forget every sharding and redistribution decision DTensor has cached.

    DTensor caches decisions keyed on specs whose mesh compares equal across ranks (a mesh's
    identity is its devices, not the rank looking at it). Tracing several ranks in one process,
    a cached decision would carry the first rank's mesh, and with it that rank's coordinate,
    into the next rank's program; clearing the caches between ranks keeps each trace its own.
    """
    from torch.distributed.tensor import _redistribute

    propagator = sharding_propagator()
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


@contextlib.contextmanager
def rules_without_costs() -> Iterator[None]:
    """DTensor's sharding rules with their redistribution costs left at zero.

    Each rule prices every strategy it returns against every placement its inputs may arrive
    in (`generate_redistribute_costs`); the planner prices resharding with its own cost model
    and never reads those figures, and on a mesh of two axes they are nine tenths of the time
    the rules take. The rules' modules import that function by name, so each binding is swapped
    for the time of the block.
    """
    import sys

    from torch.distributed.tensor._ops import utils

    original = utils.generate_redistribute_costs

    def zeros(src_strategy: Any, dst_spec: Any) -> list[float]:
        return [0.0] * len(src_strategy.strategies)

    modules = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("torch.distributed.tensor")
        and getattr(m, "generate_redistribute_costs", None) is original
    ]
    for m in modules:
        m.generate_redistribute_costs = zeros
    try:
        yield
    finally:
        for m in modules:
            m.generate_redistribute_costs = original


def _create_fake_group(common_opts: Any, backend_opts: Any) -> Any:
    from torch._C._distributed_c10d import FakeProcessGroup

    return FakeProcessGroup._create_internal(
        common_opts.group_rank, common_opts.group_size, backend_opts
    )


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """A process group of `world_size` seen from `rank` whose collectives move no data.

    Collectives traced under it are recorded, never run, so one process can trace any rank.
    """
    if "fake" not in dist.Backend._plugins:
        dist.Backend.register_backend(
            "fake", _create_fake_group, extended_api=True, devices=["cpu", "cuda"]
        )
    hook = sys.excepthook
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    # init_process_group wraps sys.excepthook to put "[rank0]:" before every line of an uncaught
    # error and never unwraps it; a build is one process, so its errors keep their own form
    sys.excepthook = hook
    try:
        yield
    finally:
        dist.destroy_process_group()


_FORGOTTEN: list[Any] = []  # a forked child's inherited process groups, kept, never shut


def forget_process_groups() -> None:
    """In a forked child: the process groups inherited from the parent out of
    torch.distributed's sight, so this process can open its own (a fake one to trace ranks).
    None is shut down or destroyed: their connections are the parent's. The child leaves by
    `os._exit`, so nothing it kept runs a destructor either."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    tables = (
        world.pg_map,
        world.pg_names,
        world.pg_group_ranks,
        world.pg_backend_config,
        world.pg_to_tag,
        world.tags_to_pg,
        world.pg_coalesce_state,
    )
    # DTensor's caches may hold the only references to meshes (and through them groups) of a
    # run the script ended: the child clears those caches to trace, and must not run their
    # destructors, which close the parent's connections
    import gc

    from torch.distributed.device_mesh import DeviceMesh

    meshes = [o for o in gc.get_objects() if isinstance(o, DeviceMesh)]
    _FORGOTTEN.append((world.default_pg, [dict(t) for t in tables], meshes))
    c10d._update_default_pg(None)
    for table in tables:
        table.clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0


def detached_mesh(
    ranks: torch.Tensor, dim_names: tuple[str, ...] | None = None, device_type: str = "cpu"
) -> DeviceMesh:
    """A mesh over `ranks` (an N-D tensor of rank ids) with no process group behind it, to
    reason about placements on."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device_type, ranks, mesh_dim_names=dim_names, _init_backend=False, _rank=0)


@contextlib.contextmanager
def merged_moves(mesh: DeviceMesh) -> Iterator[None]:
    """Within the block, a move over several of `mesh`'s axes is one collective over their
    joined group where the result is the same as the per-axis collectives.

    DTensor merges consecutive same-kind collectives over several axes when it finds their
    group flattened (`DeviceMesh._flatten`); without one it runs a collective per axis, in
    sequence, and warns. Every combination of axes is flattened here, in the mesh's order (ranks
    row-major, the only order DTensor merges). A merged all-gather lays the shards out as one
    split over the joined group, which equals the nested per-axis splits only where the tensor
    dim divides evenly by the group's size: DTensor checks that for a reduce-scatter but not for
    an all-gather (a 10-row tensor on 3 x 2 is nested 2,2,2,2,1,1 but joined 2,2,2,2,2,0), so
    a move with an uneven merged gather keeps its per-axis collectives here.
    """
    import itertools

    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import _redistribute as module

    names = mesh.mesh_dim_names
    if names is not None and mesh.ndim >= 2:
        for count in range(2, mesh.ndim + 1):
            for axes in itertools.combinations(names, count):
                mesh[axes]._flatten("+".join(axes))
    optimize = getattr(module, "_optimize_transform_infos", None)
    if optimize is None:  # a torch that never merges
        yield
        return

    def even_merges_only(transform_infos: list, device_mesh: DeviceMesh, *args: Any) -> list:
        merged = optimize(transform_infos, device_mesh, *args)
        for info in merged:
            source = info.src_dst_placements[0]
            if (
                isinstance(info, module._FlattenedTransformInfo)
                and info._comm_type_key() == "all_gather"
                and isinstance(source, Shard)
            ):
                size = math.prod(device_mesh.size(d) for d in info.original_mesh_dims)
                if info.logical_shape[source.dim] % size:
                    return transform_infos
        return merged

    module._optimize_transform_infos = even_merges_only
    try:
        yield
    finally:
        module._optimize_transform_infos = optimize


@functools.cache
def _mesh_of_shape(mesh_shape: tuple[int, ...]) -> DeviceMesh:
    return detached_mesh(torch.arange(math.prod(mesh_shape)).reshape(mesh_shape))


def redistribute_steps(
    val: torch.Tensor, src: tuple, dst: tuple, mesh_shape: tuple[int, ...]
) -> list[tuple[int, Any, Any]]:
    """(mesh axis, from, to) of each step DTensor takes to move `val` from placements `src` to
    `dst` on a mesh of `mesh_shape`, in its order, before it merges steps over several axes.

    DTensor plans a move axis by axis (its greedy planner): nested shards are undone inner axis
    first, and a shard that moves to another dim on one axis is an all-to-all on that axis.
    Which steps it takes depends on the placements and the mesh, not on the tensor's sizes
    (those only size each step), so they are kept per placements and mesh: the memory model
    asks for the same move of many values. `tests/plan/test_moves.py` checks that
    independence on uneven and even shapes, so a torch that breaks it fails there.
    """
    if len(mesh_shape) == 1:
        return [] if src[0] == dst[0] else [(0, src[0], dst[0])]
    return list(_greedy_steps(tuple(src), tuple(dst), tuple(mesh_shape), val.dim()))


@functools.lru_cache(maxsize=1 << 14)
def _greedy_steps(
    src: tuple, dst: tuple, mesh_shape: tuple[int, ...], ndim: int
) -> tuple[tuple[int, Any, Any], ...]:
    """DTensor's greedy steps between `src` and `dst`, for a tensor of `ndim` dims whose every
    dim splits evenly over the whole mesh (see `redistribute_steps`)."""
    return _greedy_steps_for(torch.Size([2 * math.prod(mesh_shape)] * ndim), src, dst, mesh_shape)


def _greedy_steps_for(
    shape: torch.Size, src: tuple, dst: tuple, mesh_shape: tuple[int, ...]
) -> tuple[tuple[int, Any, Any], ...]:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import get_redistribute_planner

    mesh = _mesh_of_shape(mesh_shape)
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    meta = TensorMeta(shape, stride, torch.float32)  # the steps depend on neither
    infos = get_redistribute_planner(mesh, meta).generate_greedy_transform_infos(
        DTensorSpec(mesh, src, meta), DTensorSpec(mesh, dst, meta)
    )
    return tuple((i.mesh_dim, *i.src_dst_placements) for i in infos)


def group_ranks(group_name: str) -> list[int]:
    """The global ranks of the process group a traced collective names."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_process_group_ranks(_resolve_process_group(group_name))


def export_post_dispatch() -> Callable[..., Any] | None:
    """torch.export's one-trace export straight to ATen (`pre_dispatch=False`), where present."""
    try:
        from torch.export._trace import _export
    except ImportError:  # pragma: no cover - depends on the torch release
        return None
    return _export


def _proxy_mode() -> Any:
    try:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode
    except ImportError:  # pragma: no cover - depends on the torch release
        return None
    return get_proxy_mode()


def traced_graph_length() -> int | None:
    """How many nodes the program being traced holds so far (None: nothing is being traced)."""
    mode = _proxy_mode()
    return None if mode is None else len(mode.tracer.graph.nodes)


def traced_nodes_since(length: int) -> list[torch.fx.Node]:
    """The nodes the program being traced gained after it held `length` nodes."""
    mode = _proxy_mode()
    return [] if mode is None else list(mode.tracer.graph.nodes)[length:]


def proxy_node(t: torch.Tensor) -> torch.fx.Node | None:
    """The traced node that produced `t` (None: nothing is being traced)."""
    mode = _proxy_mode()
    if mode is None:
        return None
    from torch.fx.experimental.proxy_tensor import get_proxy_slot

    return get_proxy_slot(t, mode.tracer).proxy.node


def local_tensor(t: Any) -> torch.Tensor:
    """A DTensor's local shard without the autograd hop of `to_local` (for tracer bookkeeping)."""
    return t._local_tensor


def dcp_storage_info_class() -> type:
    """The class torch.distributed.checkpoint pickles into its metadata for each storage."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo


def serialization_get_layout() -> Callable[..., Any]:
    """The function torch.save's pickles name to rebuild a tensor layout."""
    from torch.serialization import _get_layout

    return _get_layout


def redistribute(value: Any, placements: tuple) -> Any:
    """`value` (a DTensor) moved to `placements`, Partial targets included.

    The public `DTensor.redistribute` refuses to make a tensor Partial; a plan may need exactly
    that (a bias added once to partial sums, indices masked for a sharded embedding), and
    DTensor's own op dispatch makes those moves through this same function.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._redistribute import redistribute_local_tensor

    spec = value._spec
    if tuple(spec.placements) == tuple(placements):
        return value
    # DTensor makes a tensor Partial only from Replicate: a shard is gathered first
    via = tuple(
        Replicate() if isinstance(a, Shard) and b.is_partial() else a
        for a, b in zip(spec.placements, placements)
    )
    if via != tuple(spec.placements):
        value = redistribute(value, via)
        spec = value._spec
    target = __getattr__("DTensorSpec")(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)
    local = redistribute_local_tensor(value._local_tensor, spec, target)
    return DTensor.from_local(
        local, spec.mesh, placements, run_check=False, shape=value.shape, stride=value.stride()
    )


class RefusedArchiveError(ValueError):
    """A .pt2 archive holds something tessel does not read as data (the message names it)."""


def load_exported_program(
    path: str,
    check_expression: Callable[[str], None],
    check_target: Callable[[str], None],
) -> torch.export.ExportedProgram:
    """The one ExportedProgram of a `torch.export.save` archive, read as data.

    `torch.export.load` unpickles weights, constants and example inputs that the archive stores
    as pickles (a pickle can run code), hands every symbolic size's text to `sympy.sympify`
    (which evaluates it as Python), and resolves every node's target string to whatever
    attribute of `torch` it names. Here every payload must be a raw tensor, and every size
    expression and node target (an operator given as an argument too) passes `check_expression`
    and `check_target` first, which raise to refuse one; anything else is refused with
    `RefusedArchiveError` before it is read. The example inputs are not read at all.
    """
    from torch._export.serde.serialize import ExportedProgramDeserializer, _bytes_to_dataclass
    from torch.export.pt2_archive import _package as package
    from torch.export.pt2_archive.constants import (
        CONSTANTS_CONFIG_FILENAME_FORMAT,
        MODELS_FILENAME_FORMAT,
        TENSOR_CONSTANT_FILENAME_PREFIX,
        WEIGHTS_CONFIG_FILENAME_FORMAT,
    )

    with package.PT2ArchiveReader(path) as reader:
        names = reader.get_file_names()
        prefix, suffix = MODELS_FILENAME_FORMAT.split("{}")
        models = [n[len(prefix) : -len(suffix)] for n in names if n.startswith(prefix)]
        if len(models) != 1:
            raise RefusedArchiveError(f"expected one exported program, found {len(models)}")
        (model,) = models
        configs = {}
        for what, fmt in (
            ("weight", WEIGHTS_CONFIG_FILENAME_FORMAT),
            ("constant", CONSTANTS_CONFIG_FILENAME_FORMAT),
        ):
            name = fmt.format(model)
            if name not in names:
                raise RefusedArchiveError(
                    f"no {name} (an archive of an older torch, whose {what}s are pickled)"
                )
            configs[what] = package._load_payload_config(reader, name)
        for what, config in configs.items():
            for fqn, meta in config.config.items():
                tensor = what == "weight" or meta.path_name.startswith(
                    TENSOR_CONSTANT_FILENAME_PREFIX
                )
                if meta.use_pickle or not tensor:
                    raise RefusedArchiveError(f"{what} {fqn!r} is stored as a pickle")
        serialized = _bytes_to_dataclass(
            package.schema.ExportedProgram, reader.read_bytes(MODELS_FILENAME_FORMAT.format(model))
        )
        _check_serialized(serialized, check_expression, check_target)
        state_dict = package._load_state_dict(reader, model)
        constants = package._load_constants(reader, model)
    return ExportedProgramDeserializer().deserialize(serialized, state_dict, constants, b"")


def _check_serialized(
    value: Any, check_expression: Callable[[str], None], check_target: Callable[[str], None]
) -> None:
    """Every size expression and operator name in a serialized program, checked (see
    `load_exported_program`); the walk goes over torch's serde schema dataclasses."""
    import dataclasses

    from torch._export.serde.union import _Union

    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, _Union):  # one field set: its value
            if type(item).__name__ == "Argument" and item.type == "as_operator":
                check_target(item.value)
            stack.append(item.value)
        elif dataclasses.is_dataclass(item):
            kind = type(item).__name__
            if kind == "SymExpr":
                check_expression(item.expr_str)
            elif kind == "Node":
                check_target(item.target)
            stack.extend(getattr(item, f.name) for f in dataclasses.fields(item))


def fake_tensor_mode() -> Any:
    """A FakeTensorMode in which real tensors may meet fake ones (a model's fake weights)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(t: Any) -> bool:
    """Whether `t` is a fake tensor (shape and dtype, no data)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def fake_mode_of(values: Sequence[Any]) -> Any:
    """The FakeTensorMode the fake tensors among `values` belong to (None if there are none)."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode(list(values))
