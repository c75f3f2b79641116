"""The device mesh: the cluster's devices arranged on named axes by the policy.

One validated object holds the axis sizes every stage agrees on: `pp` (pipeline stages), `dp`
(data-parallel replicas) and `tp` (tensor parallel), outermost first. Ranks are laid out with
`tp` innermost, so a tensor-parallel group is consecutive devices, within one node wherever the
node holds it; each axis carries the slowest link any of its groups crosses, and collectives are
priced on the axis they run over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessel.config.cluster import ClusterConfig
from tessel.config.errors import ConfigError
from tessel.config.parallel_option import ParallelOption, check_sizes

AXES = ("pp", "dp", "tp")  # outermost first
POLICY_KEYS = {  # each axis size's key under graph_parallel_option
    "pp": "pipeline_parallel_option.pipe_stage_num",
    "dp": "data_parallel_option.data_parallel_size",
    "tp": "tensor_parallel_option.tensor_parallel_size",
}


@dataclass(frozen=True)
class MeshAxis:
    name: str  # pp, dp, tp, or tp_node (a tensor-parallel group's nodes, see tensor_axes)
    size: int
    bandwidth: float  # bytes/s: the slowest link a group on this axis crosses


@dataclass(frozen=True)
class ParallelDims:
    """The mesh's axes, checked against the cluster: the one source of truth for its shape."""

    axes: tuple[MeshAxis, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(a.size for a in self.axes)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def size(self, name: str) -> int:
        return self.axis(name).size

    def axis(self, name: str) -> MeshAxis:
        for a in self.axes:
            if a.name == name:
                return a
        raise ValueError(f"no mesh axis {name!r}; the axes are {', '.join(AXES)}")

    def coordinate(self, rank: int) -> dict[str, int]:
        """Where `rank` sits on each axis."""
        out = {}
        for a in reversed(self.axes):
            rank, out[a.name] = divmod(rank, a.size)
        return {a.name: out[a.name] for a in self.axes}

    def groups(self, name: str) -> list[tuple[int, ...]]:
        """The rank groups along axis `name`: ranks that differ only in that coordinate."""
        self.axis(name)
        return axis_groups(self.shape, AXES.index(name))


def axis_groups(shape: tuple[int, ...], dim: int) -> list[tuple[int, ...]]:
    """The rank groups along mesh dim `dim` of a mesh of `shape` (ranks row-major)."""
    inner = math.prod(shape[dim + 1 :])
    size = shape[dim]
    out = []
    for outer in range(math.prod(shape[:dim])):
        for i in range(inner):
            base = outer * size * inner + i
            out.append(tuple(base + k * inner for k in range(size)))
    return out


def tensor_axes(cluster: ClusterConfig) -> tuple[MeshAxis, ...]:
    """The devices of `cluster`, all of one tensor-parallel group, as the planner meshes them.

    Within one node (or over nodes of one device each) that is one `tp` axis. Over nodes of
    several devices each it is two: `tp_node` across the nodes, on the network's link, and `tp`
    over each node's devices, on the node's link. The planner then chooses a placement per axis,
    so a collective that only needs the node's devices never crosses the network.
    """
    per_node = {len(n.devices) for n in cluster.nodes}
    if len(cluster.nodes) > 1 and len(per_node) == 1 and (k := next(iter(per_node))) > 1:
        return (
            MeshAxis("tp_node", len(cluster.nodes), cluster.network_bandwidth),
            MeshAxis("tp", k, cluster.link_bandwidth),
        )
    every = tuple(range(cluster.world_size))
    return (MeshAxis("tp", cluster.world_size, cluster.bandwidth(every)),)


def parallel_dims(cluster: ClusterConfig, policy: ParallelOption) -> ParallelDims:
    """The mesh for `cluster` under `policy`: sizes the policy leaves out take what remains of
    the devices, tensor parallel first (a policy that sets nothing is one tensor-parallel axis
    over every device, as before N-D meshes)."""
    world = cluster.world_size
    check_sizes(
        {
            "tensor_parallel_size": policy.tensor_parallel_size,
            "data_parallel_size": policy.data_parallel_size,
            "pipe_stage_num": policy.pipe_stage_num,
        },
        world,
        lambda message, key: ConfigError(policy.source, f"graph_parallel_option.{key}", message),
    )
    pp = policy.pipe_stage_num or 1
    dp = policy.data_parallel_size or (
        world // (pp * policy.tensor_parallel_size) if policy.tensor_parallel_size else 1
    )
    tp = world // (pp * dp)
    shape = (pp, dp, tp)
    _check_hierarchy(cluster, shape, policy.source)
    axes = tuple(
        MeshAxis(name, size, min(cluster.bandwidth(g) for g in axis_groups(shape, i)))
        for i, (name, size) in enumerate(zip(AXES, shape))
    )
    return ParallelDims(axes)


def _check_hierarchy(cluster: ClusterConfig, shape: tuple[int, ...], source: str) -> None:
    """Every group of an axis must sit the same way on the nodes: within one node, or across
    whole nodes. With nodes of k devices, an axis whose groups span `inner` consecutive ranks
    (its size times the sizes inside it) needs `inner` to divide k or k to divide `inner`."""
    per_node = {len(n.devices) for n in cluster.nodes}
    if len(cluster.nodes) < 2 or len(per_node) != 1:
        return
    (k,) = per_node
    inner = 1
    for name, size in reversed(list(zip(AXES, shape))):
        inner *= size
        if size > 1 and inner % k and k % inner:
            raise ConfigError(
                source,
                f"graph_parallel_option.{POLICY_KEYS[name]}",
                f"gives groups of {inner} consecutive devices, but the cluster's nodes hold {k} "
                "devices each, so some groups would span two nodes and others not; choose sizes "
                f"whose groups divide {k} or are whole multiples of it",
            )
