"""The cost model: compute roofline, alpha-beta collectives, resharding between placements.

One formula per collective; `tessel inspect` and the solver both use these.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Partial, Placement

from tessel.config.cluster import ClusterConfig
from tessel.config.soc import SocProfile
from tessel.sharding.placements import unnested

_MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm"}

# a view makes no new storage: it runs no kernel, and its dispatch, measured on small tensors,
# takes about this share of an operator's (1.3-2.3 us against 4.0-4.4 us for add, mul, clone)
VIEW_DISPATCH = 0.4
# views by result though not by schema: a matmul's output reshaped as it lies
_VIEWS_BY_RESULT = {"aten._unsafe_view.default"}
# lookups: read from their first input (a table) only the rows their indices pick, the output
_LOOKUPS = {
    "aten.embedding.default",
    "aten.index_select.default",
    "aten.index.Tensor",
    "aten.gather.default",
}
# indexed writes in place: write into their first input only the values their last input holds
_INDEXED_WRITES = {
    "aten.index_put_.default",
    "aten.scatter_.src",
    "aten.scatter_add_.default",
}


@dataclass(frozen=True)
class Links:
    """Bandwidth (bytes/s) and latency (s) of the links a mesh dimension's collectives cross.

    With `one_pass`, an all-reduce meets its group once, as an all-gather does: CPU workers of
    one machine each write their part where all can read it and reduce every part
    (`runtime/shared_memory.py`), where a ring reduce-scatters and then all-gathers.
    `local_op` is the time of a move that crosses no link: a replicated value cut to its shard
    (or zeroed to a partial one) by an operator each rank runs on its own copy."""

    bandwidth: float
    latency: float
    one_pass: bool = False
    local_op: float = 0.0

    @classmethod
    def of(cls, cluster: ClusterConfig, ranks: list[int] | None = None) -> Links:
        """The links a program's collectives over `ranks` (None: every rank) cross."""
        ranks = ranks if ranks is not None else list(range(cluster.world_size))
        return cls.in_program(cluster.soc, cluster.bandwidth(ranks))

    @classmethod
    def in_program(cls, soc: SocProfile, bandwidth: float, local_op: float | None = None) -> Links:
        """Links of `bandwidth` as a program's collectives use them: a CPU worker's program
        meets its group in shared memory, in one pass. A local move costs an operator's
        dispatch (`local_op`, the SoC's own where not given)."""
        local = soc.op_overhead if local_op is None else local_op
        return cls(bandwidth, soc.link_latency, one_pass=soc.device_type == "cpu", local_op=local)


def all_reduce_time(nbytes: float, n: int, links: Links) -> float:
    """Ring all-reduce: each rank sends and receives 2(n-1)/n of the buffer, in twice an
    all-gather's steps (once on `one_pass` links)."""
    if n <= 1:
        return 0.0
    steps = (1 if links.one_pass else 2) * (n - 1)
    return steps * links.latency + 2 * (n - 1) / n * nbytes / links.bandwidth


def all_gather_time(nbytes: float, n: int, links: Links) -> float:
    """Ring all-gather of a tensor of `nbytes` in total (each rank holds nbytes/n)."""
    if n <= 1:
        return 0.0
    return (n - 1) * links.latency + (n - 1) / n * nbytes / links.bandwidth


def reduce_scatter_time(nbytes: float, n: int, links: Links) -> float:
    """Ring reduce-scatter of a tensor of `nbytes` (the same volume as an all-gather)."""
    return all_gather_time(nbytes, n, links)


def all_to_all_time(nbytes: float, n: int, links: Links) -> float:
    """Each rank exchanges (n-1)/n of its nbytes/n share."""
    if n <= 1:
        return 0.0
    return (n - 1) * links.latency + (n - 1) / n * (nbytes / n) / links.bandwidth


def transition(src: Placement, dst: Placement) -> str | None:
    """The collective that moves one mesh dimension from `src` to `dst`: "local" where each
    rank cuts (or zero-fills) its own copy, None where nothing moves."""
    if src == dst:
        return None
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return "all_reduce"
        if isinstance(dst, Shard):
            return "reduce_scatter"
        return "all_reduce"
    if isinstance(src, Shard):
        # to Replicate, to Partial through Replicate, or to another dimension: lowered programs
        # are traced on CPU meshes, where DTensor moves a shard by gathering it whole
        return "all_gather"
    return "local"  # Replicate -> Shard / Partial: a slice or zero-fill, an operator a run


_TIME = {
    "local": lambda nbytes, n, links: links.local_op if n > 1 else 0.0,
    "all_reduce": all_reduce_time,
    "all_gather": all_gather_time,
    "reduce_scatter": reduce_scatter_time,
    "all_to_all": all_to_all_time,
}


def _moves(
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    nbytes: float,
    mesh_shape: tuple[int, ...],
    shape: tuple[int, ...] | None,
) -> list[tuple[int, str, float]]:
    """The moves that take a tensor of `nbytes` (global, of `shape` where given) from
    placements `src` to `dst`, one per mesh dim that changes: (mesh dim, kind, the bytes of the
    tensor it moves), the kind a collective or "local" (each rank cuts its own copy).
    A gather or reduce-scatter of a dim the devices split unevenly moves every shard padded to
    the largest (10 rows over 4 devices move as 12). An axis nested inside one that changes is
    gathered first (`unnested`)."""
    first = unnested(src, dst)
    if first != tuple(src):
        return _moves(src, first, nbytes, mesh_shape, shape) + _moves(
            first, dst, nbytes, mesh_shape, shape
        )
    out = []
    for d, (a, b) in enumerate(zip(src, dst)):
        kind = transition(a, b)
        if kind is None:
            continue
        # the tensor's size on this mesh dim: global bytes over the shards of the other dims
        others = math.prod(
            n for i, (p, n) in enumerate(zip(src, mesh_shape)) if i != d and isinstance(p, Shard)
        )
        split = a if isinstance(a, Shard) else b if isinstance(b, Shard) else None
        padding = 1.0
        if shape is not None and split is not None and kind != "all_reduce":
            rows = shape[split.dim] if split.dim < len(shape) else 0
            if rows > 0:
                padding = -(-rows // mesh_shape[d]) * mesh_shape[d] / rows
        out.append((d, kind, padding * nbytes / max(others, 1)))
    return out


def redistribute_time(
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    nbytes: float,
    mesh_shape: tuple[int, ...],
    links: list[Links],
    shape: tuple[int, ...] | None = None,
) -> float:
    """Time to move a tensor of `nbytes` (global, of `shape` where given) from placements `src`
    to `dst`: a collective, or a local cut, per mesh dim that changes."""
    return sum(
        _TIME[kind](moved, mesh_shape[d], links[d])
        for d, kind, moved in _moves(src, dst, nbytes, mesh_shape, shape)
    )


def redistribute_bytes(
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    nbytes: float,
    mesh_shape: tuple[int, ...],
    shape: tuple[int, ...] | None = None,
) -> list[float]:
    """Bytes one device sends, per mesh dim, to move a tensor from `src` to `dst` placements
    (the ring volumes `redistribute_time` prices)."""
    sent = [0.0] * len(mesh_shape)
    for d, kind, moved in _moves(src, dst, nbytes, mesh_shape, shape):
        sent[d] += _SENT[kind](moved, mesh_shape[d])
    return sent


_SENT = {
    "local": lambda b, n: 0.0,
    "all_reduce": lambda b, n: 2 * (n - 1) / n * b,
    "all_gather": lambda b, n: (n - 1) / n * b,
    "reduce_scatter": lambda b, n: (n - 1) / n * b,
    "all_to_all": lambda b, n: (n - 1) / n * b / n,
}


def largest_share(
    placements: tuple[Placement, ...] | None,
    mesh_shape: tuple[int, ...],
    shape: tuple[int, ...] | None = None,
) -> float:
    """The part of a tensor the busiest device holds with these placements.

    A dimension of `shape` split unevenly leaves the first devices one row more (torch.chunk's
    cut), and they set the step's time: 10 rows over 4 devices is a share of 3/10, not 1/4.
    Shards of a tensor whose shape is not given split evenly; a Partial tensor is whole on
    every device.
    """
    if placements is None:
        return 1.0
    sizes = list(shape) if shape is not None else None
    share = 1.0
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, Shard) and sizes is not None and sizes[p.dim] > 0:
            rows = -(-sizes[p.dim] // n)
            share *= rows / sizes[p.dim]
            sizes[p.dim] = rows
        elif isinstance(p, Shard):
            share /= n
    return share


def work_share(
    inputs: list[tuple[tuple[Placement, ...] | None, tuple[int, ...] | None]],
    output: tuple[tuple[Placement, ...], tuple[int, ...] | None] | None,
    mesh_shape: tuple[int, ...],
) -> float:
    """The part of an op's work the busiest device does: that of its most split operand. Each
    device runs the op on its local tensors, so the work splits only where an operand is
    sharded: a matmul of two shards split on the summed dim does half of it on each of two
    devices (a Partial sum out), and one of a Partial operand, whole on every device, all of
    it. The output counts where it is a shard (an op that makes its own slice)."""
    shares = [largest_share(p, mesh_shape, shape) for p, shape in inputs]
    if output is not None and not any(isinstance(p, Partial) for p in output[0]):
        shares.append(largest_share(output[0], mesh_shape, output[1]))
    return min(shares, default=1.0)


def nbytes(val: object) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(nbytes(v) for v in val)
    return 0


def flops(op_name: str, out_val: object, in_vals: list[object]) -> float:
    """Floating-point operations of one node (matmuls and attention exactly; others one per
    output element)."""
    if isinstance(out_val, (tuple, list)) and "scaled_dot_product" in op_name:
        out_val = next((v for v in out_val if isinstance(v, torch.Tensor)), None)
    if not isinstance(out_val, torch.Tensor):
        return 0.0
    shapes = [tuple(v.shape) for v in in_vals if isinstance(v, torch.Tensor)]
    return shape_flops(op_name, tuple(out_val.shape), shapes)


def shape_flops(
    op_name: str, out_shape: tuple[int, ...], in_shapes: list[tuple[int, ...]]
) -> float:
    """`flops` from the shapes alone: of an output and of the tensors a node reads.

    Attention (`scaled_dot_product_*`, [batch, heads, length, head dim]) does two matmuls over
    every (query, key) pair; its backward recomputes the scores and does four more (the
    gradients of v, the scores, q and k)."""
    base = op_name.split(".")[1] if "." in op_name else op_name
    if "scaled_dot_product" in base:
        four = [s for s in in_shapes if len(s) == 4]
        backward = base.endswith("_backward")
        if len(four) >= 2 + backward:  # the backward's first input is the output's gradient
            q, k = four[backward], four[backward + 1]
            pairs = 2.0 * q[0] * q[1] * q[2] * k[2] * q[3]  # one matmul's FLOPs
            return pairs * (5 if backward else 2)
    if base in _MATMUL_OPS:
        matrices = [s for s in in_shapes if len(s) >= 2]
        if matrices:
            return 2.0 * math.prod(out_shape) * matrices[-1][-2]
    return float(math.prod(out_shape))


# per weight, the tensor operations torch's single-tensor optimizer runs beside the ones for
# its states, and the passes over the weight's bytes (the weight read and written, its
# gradient read), each state adding an operation and a read and a write
_UPDATE = {"SGD": (1, 3), "Adam": (8, 3), "AdamW": (9, 4)}


def update_time(
    optimizer: str, states: float, tensors: int, nbytes: float, bandwidth: float, overhead: float
) -> float:
    """An optimizer step over `tensors` weights of `nbytes` in all, each with `states` states
    of its size: memory-bound passes over them, and one dispatch per operation."""
    ops, passes = _UPDATE[optimizer]
    return tensors * (ops + states) * overhead + (passes + 2 * states) * nbytes / bandwidth


@functools.cache
def is_view(op_name: str) -> bool:
    """Whether the operator named `op_name` ("aten.select.int") returns a view of an input (its
    schema's result aliases an argument it does not write): it moves no bytes and does no
    arithmetic."""
    if op_name in _VIEWS_BY_RESULT:
        return True
    namespace, _, rest = op_name.partition(".")
    packet, _, overload = rest.partition(".")
    try:
        op = getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")
        returns = op._schema.returns
    except (AttributeError, RuntimeError):
        return False
    aliases = [r.alias_info for r in returns]
    return bool(aliases) and all(a is not None and not a.is_write for a in aliases)


def dispatch_time(op_name: str, overhead: float) -> float:
    """Host time to dispatch one node: an operator's `overhead`, a share of it for a view, and
    nothing for an item of a tuple (plain Python indexing)."""
    if "getitem" in op_name:
        return 0.0
    return VIEW_DISPATCH * overhead if is_view(op_name) else overhead


def moved_bytes(op_name: str, out_bytes: float, in_bytes: list[float]) -> float:
    """The bytes one run of `op_name` reads and writes, given its output's and its tensor
    inputs' (in argument order): all of them, but a lookup (an embedding) reads only the rows it
    outputs from its table, and an indexed write in place (a KV cache's new slots) touches only
    the values it writes in its target."""
    if op_name in _LOOKUPS and in_bytes:
        return 2 * out_bytes + sum(in_bytes[1:])
    if op_name in _INDEXED_WRITES and len(in_bytes) > 1:
        return sum(in_bytes[1:]) + in_bytes[-1]
    return out_bytes + sum(in_bytes)


def compute_time(op_flops: float, moved_bytes: float, peak_flops: float, bandwidth: float) -> float:
    """Roofline: the slower of arithmetic and memory traffic."""
    return max(op_flops / peak_flops, moved_bytes / bandwidth)
