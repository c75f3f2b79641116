"""The bytes a plan moves per run over each axis of its mesh, as the cost model counts them.

The walk is the solver's (`planner._problem`): every edge whose producer's placement differs
from the one its consumer takes, and every output made whole (or placed like its weight), with
the collective `cost.transition` names and the ring volume of each. On a cluster of several
nodes, the bytes of an axis whose groups span nodes cross the slow link; `mesh_choice` weighs
shapes by them.
"""

from __future__ import annotations

from torch import fx
from torch.distributed.tensor import Replicate

from tessel._torch import tree_leaves
from tessel.capture.training import placed_like
from tessel.plan import cost
from tessel.plan.planner import Plan


def sent_bytes(plan: Plan, graph: fx.Graph) -> dict[str, float]:
    """Bytes one device sends per run over each mesh axis (by name) under `plan`."""
    mesh_shape = tuple(plan.mesh_shape)
    sent = [0.0] * len(mesh_shape)

    def move(src: tuple | None, dst: tuple | None, val: object) -> None:
        if not src or not dst or src == dst:
            return
        shape = tuple(val.shape) if hasattr(val, "shape") else None
        volume = cost.redistribute_bytes(src, dst, cost.nbytes(val), mesh_shape, shape)
        for d, b in enumerate(volume):
            sent[d] += b

    for n, c in plan.choices.items():
        if c.kind not in ("op", "fallback"):
            continue
        taken = plan.strategy(n)
        for j, a in enumerate(c.args):
            if a not in plan.choices or plan.choices[a].kind in ("const", "drop"):
                continue
            dst = taken.inputs[j] if j < len(taken.inputs) else None
            move(_placements(plan, a), dst and tuple(dst.placements), a.meta.get("val"))

    out_node = next(n for n in graph.nodes if n.op == "output")
    whole = (Replicate(),) * len(mesh_shape)
    like = placed_like(graph, plan.param_targets)
    for i, a in enumerate(tree_leaves(out_node.args[0])):
        if not isinstance(a, fx.Node) or a not in plan.choices:
            continue
        weight = like.get(i)
        dst = plan.out_placements(weight) if weight in plan.choices else whole
        move(_placements(plan, a), dst, a.meta.get("val"))
    return dict(zip(plan.mesh_names, sent))


def _placements(plan: Plan, node: fx.Node) -> tuple | None:
    placements = plan.out_placements(node)
    return placements or None
