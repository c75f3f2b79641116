"""A lowered program's estimated time: the planner's cost model applied to what a rank runs.

The planner prices the captured graph under a plan; the lowering may run it differently (its
collectives are DTensor's, a gather of the outputs to rank 0 is added, layouts are copied).
Pricing each rank's program as written, call by call, with the planner's own formulas, gives
the figure to hold a plan to once it is lowered: compute by the roofline at the device's share
of its host, one dispatch per operator (less for a view), and each collective on the slowest
link its group crosses.
"""

from __future__ import annotations

from tessel._torch import C10D_FUNCTIONAL
from tessel.config.cluster import ClusterConfig
from tessel.lower.program import RankProgram, group_of, node_refs, tensor_bytes
from tessel.plan import cost
from tessel.plan.planner import device_rates

_FREE = {"wait_tensor"}  # collectives whose time is their start's


def program_seconds(rp: RankProgram, rank: int, cluster: ClusterConfig) -> float:
    """Seconds one run of `rp`, the program of `rank`, takes on a device of `cluster` (the
    cluster the plan was made for: the program's collective groups are ranks of it)."""
    peak, bandwidth, overhead = device_rates(cluster)
    shapes = rp.shapes
    seconds = 0.0
    for node in rp.program["nodes"]:
        if node.get("op") != "call":
            continue
        target = node["target"]
        reads = [shapes[name] for name in node_refs(node["args"]) if name in shapes]
        if target.startswith(C10D_FUNCTIONAL + "."):
            seconds += _collective_seconds(target.split(".")[1], node, reads, rank, cluster)
            continue
        dispatch = cost.dispatch_time(target, overhead)
        if node["name"] not in shapes or cost.is_view(target):
            seconds += dispatch  # no tensor made (an item of a tuple, a scalar), or a view
            continue
        out_shape, dtype = shapes[node["name"]]
        moved = cost.moved_bytes(
            target, tensor_bytes(out_shape, dtype), [tensor_bytes(s, d) for s, d in reads]
        )
        f = cost.shape_flops(target, tuple(out_shape), [tuple(s) for s, _ in reads])
        seconds += cost.compute_time(f, moved, peak, bandwidth) + dispatch
    return seconds


def _collective_seconds(
    kind: str, node: dict, reads: list[tuple[list[int], str]], rank: int, cluster: ClusterConfig
) -> float:
    if kind in _FREE or not reads:
        return 0.0
    group = group_of(node) or []
    n = len(group)
    if n <= 1:
        return 0.0
    links = cost.Links.of(cluster, list(group))
    shape, dtype = reads[0]
    size = tensor_bytes(shape, dtype)
    if kind.startswith("all_gather"):
        return cost.all_gather_time(size * n, n, links)
    if kind.startswith("reduce_scatter"):
        return cost.reduce_scatter_time(size, n, links)
    if kind.startswith("all_reduce"):
        return cost.all_reduce_time(size, n, links)
    if kind == "all_to_all_single":
        return _all_to_all_seconds(node, shape, size, list(group).index(rank), n, links)
    if kind == "broadcast":
        return (n - 1) * links.latency + size / links.bandwidth
    raise ValueError(f"no cost formula for the collective {node['target']!r}")


def _all_to_all_seconds(
    node: dict, shape: list[int], size: int, me: int, n: int, links: cost.Links
) -> float:
    """An exchange of rows: where the split sizes are written, the larger of what this rank
    (`me` in its group) receives from the others and sends them; an even split otherwise."""
    received, sent = (list(node["args"][1:3]) + [None, None])[:2]
    if not (isinstance(received, list) and isinstance(sent, list) and received and shape[:1]):
        return cost.all_to_all_time(size * n, n, links)
    row = size / shape[0] if shape[0] else 0.0
    rows = max(sum(received) - received[me], sum(sent) - sent[me])
    return (n - 1) * links.latency + rows * row / links.bandwidth
