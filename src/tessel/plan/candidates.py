"""Candidate strategies for every node of a captured graph."""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh

from tessel._torch import OpStrategy, TupleStrategy, rules_without_costs, tree_flatten
from tessel.plan import cost
from tessel.plan.errors import PlanError
from tessel.plan.strategies import (
    DTensorSpec,
    NodeStrategy,
    Replicate,
    Shard,
    as_op_strategy,
    op_strategies,
    placement_strategies,
    strategy_key,
    tensor_meta,
)

log = logging.getLogger(__name__)

# Ops with no output or no effect on values; lowering drops them.
DROPPED = {torch.ops.aten._assert_tensor_metadata.default}


@dataclass
class NodeChoices:
    """What the solver may choose for one node."""

    node: fx.Node
    kind: str  # "param", "input", "const", "op", "getitem", "fallback", "factory", "drop"
    strategies: list[NodeStrategy]
    args: list[fx.Node] = field(
        default_factory=list
    )  # tensor args, in the order of NodeStrategy.inputs
    owner: fx.Node | None = (
        None  # the node whose decision this one shares (getitem, repeated layer)
    )
    out_index: int | None = None  # for getitem: which output of the owner
    reason: str = ""  # why a fallback replicated it

    def out_spec(self, k: int) -> DTensorSpec | None:
        return self.strategies[k].output_at(self.out_index)


def tensor_args(node: fx.Node) -> list[fx.Node]:
    leaves, _ = tree_flatten((node.args, node.kwargs))
    return [a for a in leaves if isinstance(a, fx.Node)]


def enumerate_candidates(
    graph: fx.Graph,
    mesh: DeviceMesh,
    param_names: set[str],
    templates: dict[fx.Node, fx.Node],
    banned: dict[str, set[str]] | None = None,
    fixed: dict[str, tuple[str, ...]] | None = None,
) -> dict[fx.Node, NodeChoices]:
    """Strategies per node; nodes of repeated layers reuse their template's list.

    `banned` names, per node, strategies that lowering found it cannot run (`strategy_key`);
    `fixed` gives weights (by placeholder name) their one placement (`S(d)`/`R` per mesh dim).
    """
    with rules_without_costs():  # the planner prices resharding itself
        return _enumerate(graph, mesh, param_names, templates, banned, fixed or {})


def _enumerate(
    graph: fx.Graph,
    mesh: DeviceMesh,
    param_names: set[str],
    templates: dict[fx.Node, fx.Node],
    banned: dict[str, set[str]] | None,
    fixed: dict[str, tuple[str, ...]],
) -> dict[fx.Node, NodeChoices]:
    choices: dict[fx.Node, NodeChoices] = {}
    for n in graph.nodes:
        if n.op == "output":
            continue
        val = n.meta.get("val")
        template = templates.get(n)
        if n.op == "placeholder" and template is not None and template is not n:
            t = choices[template]
            choices[n] = NodeChoices(n, t.kind, t.strategies, owner=t.owner or template)
            continue
        if n.op == "placeholder":
            if not isinstance(val, torch.Tensor):
                choices[n] = NodeChoices(n, "const", [NodeStrategy(None, ())])
            elif n.name in param_names:
                strategies = placement_strategies(mesh, val)
                if n.name in fixed:
                    strategies = _fixed(n, strategies, fixed[n.name])
                choices[n] = NodeChoices(n, "param", strategies)
            else:
                choices[n] = NodeChoices(n, "input", placement_strategies(mesh, val, True))
            continue
        if n.op != "call_function":
            choices[n] = _replicated(n, mesh, "fallback", f"{n.op} node")
            continue
        if template is not None and template is not n:
            t = choices[template]
            choices[n] = NodeChoices(
                n,
                t.kind,
                t.strategies,
                tensor_args(n),
                owner=t.owner or template,
                out_index=t.out_index,
                reason=t.reason,
            )
            continue
        if n.target is operator.getitem:
            src = n.args[0]
            owner_choice = choices[src]
            choices[n] = NodeChoices(
                n,
                "getitem",
                owner_choice.strategies,
                [],
                owner=owner_choice.owner or src,
                out_index=n.args[1],
            )
            continue
        if n.target in DROPPED:
            choices[n] = NodeChoices(n, "drop", [NodeStrategy(None, ())])
            continue
        args = tensor_args(n)
        if not args:
            choices[n] = _replicated(n, mesh, "factory", "")
            continue
        choices[n] = _op_choices(n, args, mesh, choices, (banned or {}).get(n.name, set()))
    return choices


def _fixed(
    n: fx.Node, strategies: list[NodeStrategy], wanted: tuple[str, ...]
) -> list[NodeStrategy]:
    """The one strategy placing weight `n` as `wanted` says."""
    from tessel.sharding.placements import placement_str

    def placed(s: NodeStrategy) -> tuple[str, ...]:
        return tuple(placement_str(p) for p in s.single_output().placements)

    found = [s for s in strategies if placed(s) == wanted]
    if not found:
        allowed = sorted({placed(s) for s in strategies})
        raise PlanError(
            f"weight {n.name}: the placement {list(wanted)} given for it is not one of the "
            f"mesh's ({[list(a) for a in allowed]})"
        )
    return found


def _op_choices(
    n: fx.Node,
    args: list[fx.Node],
    mesh: DeviceMesh,
    choices: dict[fx.Node, NodeChoices],
    banned: set[str],
) -> NodeChoices:
    def to_strategy(a):
        if isinstance(a, fx.Node):
            c = choices[a]
            outs = [c.out_spec(k) for k in range(len(c.strategies))]
            return as_op_strategy(outs, mesh, tensor_meta(a.meta.get("val")))
        if isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a):
            return TupleStrategy([to_strategy(x) for x in a])
        return a

    s_args = tuple(to_strategy(a) for a in n.args)
    s_kwargs = {k: to_strategy(v) for k, v in n.kwargs.items()}
    try:
        found = op_strategies(n.target, s_args, s_kwargs, n.meta.get("val"), mesh)
    except Exception as exc:  # noqa: BLE001 - a rule that cannot handle this call
        found = _one_candidate_at_a_time(n, s_args, s_kwargs, mesh) if len(args) == 1 else None
        if not found:
            return _replicated(
                n, mesh, "fallback", f"rule raised {type(exc).__name__}: {exc}"[:200]
            )
    if found is None:
        return _replicated(n, mesh, "fallback", "no DTensor sharding rule")
    found = [
        s
        for s in found
        if len(s.inputs) == len(args)
        and strategy_key(s) not in banned
        and _shards_dims_it_has(s, n, args)
        and not _partial_integers(s, n)
    ]
    # on an axis of one device every placement is the whole tensor: Replicate stands for all
    found = [s for s in found if _replicated_on_single_axes(s, mesh)] or found
    if not found:
        return _replicated(n, mesh, "fallback", "rule gave no strategy for these arguments")
    return NodeChoices(n, "op", found, args)


def _partial_integers(s: NodeStrategy, n: fx.Node) -> bool:
    """Whether the strategy leaves an integer or boolean output as partial values on the
    ranks: their reduction runs in floating point (a sum of booleans is no boolean), so such
    values are held whole or sharded, never partial."""
    outputs = s.output if isinstance(s.output, tuple) else (s.output,)
    vals = n.meta.get("val")
    vals = vals if isinstance(vals, (tuple, list)) else (vals,)
    return any(
        isinstance(v, torch.Tensor)
        and not (v.dtype.is_floating_point or v.dtype.is_complex)
        and spec is not None
        and any(p.is_partial() for p in spec.placements)
        for spec, v in zip(outputs, vals)
    )


def _shards_dims_it_has(s: NodeStrategy, n: fx.Node, args: list[fx.Node]) -> bool:
    """Whether each value the strategy shards has the dim it shards: a rule may give a
    result it reduces to 0 dims its input's Shard (sum over an empty dim list, which sums
    every dim), and that placement places nothing."""
    val = n.meta.get("val")
    outputs = s.output if isinstance(s.output, tuple) else (s.output,)
    values = tuple(val) if isinstance(val, (tuple, list)) else (val,)
    pairs = [*zip(outputs, values), *zip(s.inputs, (a.meta.get("val") for a in args))]
    return all(
        p.dim < v.dim()
        for spec, v in pairs
        if spec is not None and isinstance(v, torch.Tensor)
        for p in spec.placements
        if isinstance(p, Shard)
    )


def _replicated_on_single_axes(s: NodeStrategy, mesh: DeviceMesh) -> bool:
    single = [i for i, size in enumerate(mesh.shape) if size == 1]
    outputs = s.output if isinstance(s.output, tuple) else (s.output,)
    return all(
        spec is None or all(spec.placements[i].is_replicate() for i in single)
        for spec in (*outputs, *s.inputs)
    )


def _one_candidate_at_a_time(
    n: fx.Node, s_args: tuple, s_kwargs: dict, mesh: DeviceMesh
) -> list[NodeStrategy]:
    """Rules such as view's reject a whole candidate list for one bad layout: ask per layout."""
    index = next(i for i, a in enumerate(s_args) if isinstance(a, OpStrategy))
    found: list[NodeStrategy] = []
    for spec in s_args[index].strategies:
        args = s_args[:index] + (OpStrategy([spec]),) + s_args[index + 1 :]
        try:
            found += op_strategies(n.target, args, s_kwargs, n.meta.get("val"), mesh) or []
        except Exception:  # noqa: BLE001 - this layout cannot feed the op
            continue
    seen, unique = set(), []
    for s in found:
        key = (repr(s.output), repr(s.inputs))
        if key not in seen:
            seen.add(key)
            unique.append(s)
    return unique


def _replicated(n: fx.Node, mesh: DeviceMesh, kind: str, reason: str) -> NodeChoices:
    val = n.meta.get("val")
    rep = (Replicate(),) * mesh.ndim
    out: DTensorSpec | tuple[DTensorSpec | None, ...] | None
    if isinstance(val, (tuple, list)):
        out = tuple(
            DTensorSpec(mesh, rep, tensor_meta(v)) if isinstance(v, torch.Tensor) else None
            for v in val
        )
    else:
        out = DTensorSpec(mesh, rep, tensor_meta(val)) if isinstance(val, torch.Tensor) else None
    args = tensor_args(n)
    ins = tuple(DTensorSpec(mesh, rep, tensor_meta(a.meta.get("val"))) for a in args)
    if reason:
        log.debug("replicating %s (%s): %s", n.name, n.target, reason)
    return NodeChoices(n, kind, [NodeStrategy(out, ins)], args, reason=reason)


def node_flops(n: fx.Node) -> float:
    ins = [a.meta.get("val") for a in tensor_args(n)]
    return cost.flops(str(n.target), n.meta.get("val"), ins)


def node_seconds(n: fx.Node, peak: float, bandwidth: float, overhead: float = 0.0) -> float:
    """One device's time for all of `n`: the roofline of its arithmetic and the bytes it reads
    and writes (none for a view), and its dispatch (`overhead` for an operator)."""
    name = str(n.target)
    dispatch = cost.dispatch_time(name, overhead)
    if cost.is_view(name):
        return dispatch
    moved = cost.moved_bytes(
        name,
        cost.nbytes(n.meta.get("val")),
        [cost.nbytes(a.meta.get("val")) for a in n.all_input_nodes],
    )
    return cost.compute_time(node_flops(n), moved, peak, bandwidth) + dispatch
