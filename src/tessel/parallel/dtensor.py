"""Conversion between a `Layout` and a torch DeviceMesh + DTensor placements.

A Layout's tensor map is per tensor dim (which device axes split it, outer first); DTensor
placements are per mesh dim (which tensor dim this axis splits), applied left to right over the
mesh. When a dim is split by several axes in an order other than mesh order, the outer axes that
come later in the mesh are expressed with ``_StridedShard(dim, split_factor=...)``, where
``split_factor`` is the product of the sizes of the axes that are outer in the Layout but are
applied later in mesh order (torch's "right-to-left" sharding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tessel.parallel.errors import NotExpressibleError
from tessel.parallel.layout import INTERLEAVED, Layout, layout_from_tensor_map


def layout_to_placements(layout: Layout) -> list:
    """Placements (one per device-matrix axis) equivalent to a Layout with a tensor map."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if layout.interleaved_parallel:
        raise NotExpressibleError(
            "Layout",
            "alias_name",
            f"'{INTERLEAVED}' splits a tensor into copies on one device; DTensor has no such "
            "placement",
        )
    dev = layout.device_matrix
    ndev = len(dev)
    placements: list = [Replicate() for _ in range(ndev)]
    for d, axes in enumerate(layout.tensor_axes()):
        mesh_dims = [ndev - 1 - a for a in axes]  # outer first
        for i, m in enumerate(mesh_dims):
            # axes outer to m in the Layout that DTensor applies after m (larger mesh dim)
            later_outer = [dev[o] for o in mesh_dims[:i] if o > m]
            sf = math.prod(later_outer)
            placements[m] = Shard(d) if sf == 1 else _StridedShard(d, split_factor=sf)
    return placements


def layout_to_dtensor(layout: Layout, device_type: str = "cpu", mesh=None) -> tuple:
    """Return ``(DeviceMesh, placements)`` for a Layout; build the mesh from rank_list if needed.

    The mesh's dims are the device-matrix axes in order, named by the aliases.
    """
    placements = layout_to_placements(layout)
    if mesh is None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        ranks = torch.tensor(layout.rank_list, dtype=torch.int64).view(layout.device_matrix)
        kwargs = {"mesh_dim_names": layout.alias_name}
        if not dist.is_initialized():
            kwargs.update(_init_backend=False, _rank=0)
        mesh = DeviceMesh(device_type, ranks, **kwargs)
    elif tuple(mesh.shape) != tuple(layout.device_matrix):
        raise NotExpressibleError(
            "mesh",
            "shape",
            f"mesh shape {tuple(mesh.shape)} differs from the device matrix {layout.device_matrix}",
        )
    return mesh, placements


def layout_from_dtensor(
    mesh_or_shape, placements: Sequence, ndim: int, alias_name: Sequence[str] | None = None
) -> Layout:
    """Build the Layout of a tensor with ``ndim`` dims placed on a mesh with ``placements``.

    ``mesh_or_shape`` is a DeviceMesh (its ranks become rank_list, its dim names the aliases)
    or a plain shape tuple. Partial placements and strided orders that no Layout can express
    raise NotExpressibleError.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(mesh_or_shape, (tuple, list)):
        dev = tuple(int(x) for x in mesh_or_shape)
        rank_list = None
        names = alias_name
    else:
        dev = tuple(int(x) for x in mesh_or_shape.shape)
        rank_list = [int(x) for x in mesh_or_shape.mesh.flatten().tolist()]
        names = alias_name or getattr(mesh_or_shape, "mesh_dim_names", None)
    if len(placements) != len(dev):
        raise NotExpressibleError(
            "placements", None, f"{len(placements)} placements for a {len(dev)}-dim mesh"
        )
    ndev = len(dev)
    per_dim: dict[int, list[tuple[int, int]]] = {}
    for m, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            dim, sf = p.dim, int(p.split_factor)
        elif isinstance(p, Shard):
            dim, sf = p.dim, 1
        elif isinstance(p, Replicate):
            continue
        else:
            raise NotExpressibleError(
                "placements", f"[{m}]", f"{p} has no Layout equivalent (only Shard/Replicate)"
            )
        if dim < 0:
            dim += ndim
        if not 0 <= dim < ndim:
            raise NotExpressibleError("placements", f"[{m}]", f"{p} shards dim {dim} of {ndim}")
        per_dim.setdefault(dim, []).append((m, sf))
    axes: list[list[int]] = []
    for d in range(ndim):
        order: list[int] = []  # mesh dims, outer first
        for m, sf in reversed(per_dim.get(d, [])):
            # insert m where the product of outer axes applied after m equals sf
            pos = None
            prod = 1
            for i in range(len(order) + 1):
                if prod == sf:
                    pos = i
                    break
                if i < len(order):
                    prod *= dev[order[i]]
            if pos is None:
                raise NotExpressibleError(
                    "placements",
                    f"[{m}]",
                    f"split_factor {sf} on tensor dim {d} is not a product of the mesh sizes "
                    f"sharding that dim after mesh dim {m}; no Layout expresses this order",
                )
            order.insert(pos, m)
        axes.append([ndev - 1 - m for m in order])
    return layout_from_tensor_map(dev, axes, names, rank_list)
