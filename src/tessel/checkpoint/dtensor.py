"""Conversion between a `Layout` and a torch DeviceMesh + DTensor placements.

A Layout's tensor map is per tensor dim (which device axes split it, outer first); DTensor
placements are per mesh dim (which tensor dim this axis splits), applied left to right over the
mesh. When a dim is split by several axes in an order other than mesh order, the outer axes that
come later in the mesh are expressed with ``_StridedShard(dim, split_factor=...)``, where
``split_factor`` is the product of the sizes of the axes that are outer in the Layout but are
applied later in mesh order (torch's "right-to-left" sharding). That covers every order of the
axes on one dim; even so, the placements are checked against a model of torch's splitting and an
order they would get wrong raises NotExpressibleError instead of returning wrong shards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tessel.checkpoint.errors import NotExpressibleError
from tessel.checkpoint.layout import INTERLEAVED, Layout, layout_from_tensor_map


def _split_factor(dev: Sequence[int], mesh_dims: Sequence[int], i: int) -> int:
    """``_StridedShard`` split factor of ``mesh_dims[i]`` (one tensor dim's axes, outer first).

    torch applies placements in mesh order, so the axes outer to this one in the Layout that it
    applies later (larger mesh dim) have not split the tensor yet: their product is the factor.
    """
    m = mesh_dims[i]
    return math.prod(dev[o] for o in mesh_dims[:i] if o > m)


def layout_to_placements(layout: Layout) -> list:
    """Placements (one per device-matrix axis) equivalent to a Layout with a tensor map.

    The result is checked against torch's left-to-right splitting (``_check_placements``); an
    order it cannot reproduce raises NotExpressibleError rather than giving wrong shards.
    """
    from torch.distributed.tensor import Replicate, Shard

    from tessel._torch import StridedShard

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
            sf = _split_factor(dev, mesh_dims, i)
            placements[m] = Shard(d) if sf == 1 else StridedShard(d, split_factor=sf)
    _check_placements(layout, placements)
    return placements


def _torch_blocks(dev: Sequence[int], placements: Sequence, d: int) -> torch.Tensor | None:
    """Which block of tensor dim ``d`` each mesh coordinate gets from torch's placements.

    Models ``Shard`` / ``_StridedShard._split_tensor`` on block indices: the dim is cut into as
    many blocks as the mesh dims sharding it have devices; placements apply in mesh order, and
    ``_StridedShard(sf)`` on ``n`` devices cuts the local blocks into ``sf`` pieces, each into
    ``n`` chunks, and gives device ``i`` chunk ``i`` of every piece. Returns a tensor indexed by
    the coordinates of those mesh dims (in mesh order), or None when a split is uneven.
    """
    from tessel._torch import StridedShard

    mesh_dims = [m for m, p in enumerate(placements) if getattr(p, "dim", None) == d]
    x = torch.arange(math.prod(dev[m] for m in mesh_dims)).view(1, -1)
    for m in mesh_dims:
        p, n = placements[m], dev[m]
        sf = int(p.split_factor) if isinstance(p, StridedShard) else 1
        *batch, length = x.shape
        if length % (sf * n):
            return None
        x = x.reshape(*batch, sf, n, length // (sf * n)).transpose(-3, -2)
        x = x.reshape(*batch, n, -1)
    if x.shape[-1] != 1:
        return None
    return x.reshape([dev[m] for m in mesh_dims])


def _layout_blocks(dev: Sequence[int], axes: Sequence[int]) -> torch.Tensor:
    """Block index of tensor dim ``d`` per coordinate of its mesh dims (mesh order) in a Layout."""
    ndev = len(dev)
    mesh_dims = sorted(ndev - 1 - a for a in axes)
    out = torch.zeros([dev[m] for m in mesh_dims], dtype=torch.int64)
    stride = 1
    for a in reversed(axes):  # innermost axis first
        m = ndev - 1 - a
        shape = [dev[m] if k == m else 1 for k in mesh_dims]
        out = out + torch.arange(dev[m]).view(shape) * stride
        stride *= dev[m]
    return out


def _check_placements(layout: Layout, placements: Sequence) -> None:
    """Raise NotExpressibleError unless torch's placements give every device the Layout's slice."""
    dev = layout.device_matrix
    for d, axes in enumerate(layout.tensor_axes()):
        if not axes:
            continue
        got = _torch_blocks(dev, placements, d)
        if got is None or not torch.equal(got, _layout_blocks(dev, axes)):
            names = [layout.alias_name[len(dev) - 1 - a] for a in axes]
            raise NotExpressibleError(
                "Layout",
                f"tensor_map[{d}]",
                f"{layout!r}: splitting tensor dim {d} by {tuple(names)} (outer first) has no "
                f"DTensor placements; the nearest, {placements}, would give devices other "
                "slices than the Layout",
            )


def layout_to_dtensor(layout: Layout, device_type: str = "cpu", mesh=None) -> tuple:
    """Return ``(DeviceMesh, placements)`` for a Layout; build the mesh from rank_list if needed.

    The mesh's dims are the device-matrix axes in order, named by the aliases.
    """
    placements = layout_to_placements(layout)
    if mesh is None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        from tessel._torch import detached_mesh

        ranks = torch.tensor(layout.rank_list, dtype=torch.int64).view(layout.device_matrix)
        names = tuple(layout.alias_name)
        if dist.is_initialized():
            mesh = DeviceMesh(device_type, ranks, mesh_dim_names=names)
        else:
            mesh = detached_mesh(ranks, names, device_type)
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

    from tessel._torch import StridedShard

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
        if isinstance(p, StridedShard):
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
