"""Candidate shardings per graph node from DTensor's own sharding rules.

DTensor keeps its rules in two registries (`op_strategy_funcs` and the single-dim rules); both
are reached through `tessel._torch`, the one module that imports torch internals.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from tessel._torch import (
    DTensorSpec,
    MaskPartial,
    OpOverload,
    OpSchema,
    OpSpec,
    OpStrategy,
    StridedShard,
    TensorMeta,
    TupleStrategy,
    expand_to_full_mesh_op_strategy,
    fill_single_dim_strategy_placeholders,
    insert_single_dim_replication_strategy,
    sharding_propagator,
)
from tessel.plan import cpu_attention  # noqa: F401  (DTensor learns CPU attention)

__all__ = [
    "DTensorSpec",
    "NodeStrategy",
    "OpSpec",
    "OpStrategy",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "op_strategies",
    "placement_strategies",
    "tensor_meta",
]


@dataclass(frozen=True)
class NodeStrategy:
    """One way to run a node: the spec of its output and the spec each tensor input must have."""

    output: DTensorSpec | tuple[DTensorSpec | None, ...] | None
    inputs: tuple[DTensorSpec | None, ...]

    def output_at(self, index: int | None) -> DTensorSpec | None:
        """The spec of output `index` (None: the single output)."""
        if isinstance(self.output, tuple):
            return self.output[index or 0]
        return self.output

    def single_output(self) -> DTensorSpec:
        """The spec of the one tensor a weight's (or another single-output node's) strategy
        places."""
        assert isinstance(self.output, DTensorSpec), f"not one tensor output: {self.output!r}"
        return self.output


def tensor_meta(val: Any) -> TensorMeta | None:
    if isinstance(val, torch.Tensor):
        return TensorMeta(val.shape, val.stride(), val.dtype)
    return None


def placement_strategies(
    mesh: DeviceMesh, val: torch.Tensor, replicate_only: bool = False
) -> list[NodeStrategy]:
    """Every (Replicate | Shard(d)) per mesh dim, for graph inputs and weights.

    Shards follow torch.chunk, as DTensor's do: where a dimension does not divide, the first
    devices hold one more row and the last may hold fewer or none.
    """
    meta = tensor_meta(val)
    options: list[list[Placement]] = []
    for size in mesh.shape:
        dims: list[Placement] = [Replicate()]
        if not replicate_only and size > 1:
            dims += [Shard(d) for d, n in enumerate(val.shape) if n > 1]
        options.append(dims)
    out = []
    for combo in itertools.product(*options):
        if _splittable(val.shape, combo, mesh.shape):
            out.append(NodeStrategy(DTensorSpec(mesh, tuple(combo), meta), ()))
    return out


def _splittable(
    shape: torch.Size, placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]
) -> bool:
    """Whether every shard of the placements holds more than one piece of some device's work:
    a dimension split further than it has rows leaves nothing to gain."""
    local = list(shape)
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, Shard):
            if local[p.dim] < 2:
                return False
            local[p.dim] = -(-local[p.dim] // n)
    return True


def has_rule(op: Any) -> bool:
    """Whether the planner can shard `op` (a DTensor rule or one of tessel's local rules)."""
    prop = sharding_propagator()
    return (
        op in LOCAL_RULES or op in prop.op_strategy_funcs or op in prop.op_single_dim_strategy_funcs
    )


def op_strategies(
    op: object,
    args: tuple,
    kwargs: dict,
    out_val: Any,
    mesh: DeviceMesh,
) -> list[NodeStrategy] | None:
    """The strategies DTensor allows for `op` when its tensor args may take the given candidates.

    `args`/`kwargs` hold an OpStrategy where the graph passes a tensor. Returns None when DTensor
    has no rule for the op (the caller replicates it and reports the fallback); `op` is a graph
    node's target, and only an aten OpOverload has rules.
    """
    if not isinstance(op, OpOverload):
        return None
    if op in LOCAL_RULES:
        return LOCAL_RULES[op](args, kwargs, out_val, mesh)
    prop = sharding_propagator()
    if isinstance(out_val, (tuple, list)):
        out_meta: Any = tuple(tensor_meta(v) for v in out_val)
    else:
        out_meta = tensor_meta(out_val)
    # DTensor's dispatch takes an op's single-dim rule over its full rule where it has both,
    # so the planner offers what dispatch will do
    if op in prop.op_single_dim_strategy_funcs:
        info = prop.op_to_schema_info_for_single_dim_strategy.get(op)
        schema = OpSchema(op, args, kwargs, schema_info=info)
        rule = prop.op_single_dim_strategy_funcs[op]
        rules = rule.func(op, schema.args_meta, schema.kwargs_meta)
        n_in = len(schema.args_strategy) + len(schema.kwargs_strategy)
        if not rules:
            return None
        n_out = len(rules[0]) - n_in
        rules = insert_single_dim_replication_strategy(list(rules), n_out, n_in, out_meta)
        rules = fill_single_dim_strategy_placeholders({Shard(0)}, rules)
        result = expand_to_full_mesh_op_strategy(
            mesh,
            schema,
            rules,
            output_tensor_meta=out_meta,
            input_index=n_out,
            allow_uneven_sharding=True,
        )
    elif op in prop.op_strategy_funcs:
        info = prop.op_to_schema_info.get(op)
        schema = OpSchema(op, args, kwargs, schema_info=info)
        result = prop.op_strategy_funcs[op](schema)
    else:
        return None
    if not isinstance(result, OpStrategy):
        return None
    return _as_dispatched(op, args, kwargs, _dedup(result))


def _as_dispatched(
    op: OpOverload, args: tuple, kwargs: dict, strategies: list[NodeStrategy]
) -> list[NodeStrategy]:
    """`strategies` less those DTensor's dispatch never runs: where a rule offers several
    outputs for one set of input placements (a factory like `new_zeros` may replicate its
    output or follow its input), dispatch, given inputs in those placements, picks one, and a
    plan that counts on another would be refused when it is lowered. DTensor is asked which.

    Left as they are where the op's tensor arguments are not all top-level positional ones."""
    by_inputs: dict[tuple, list[NodeStrategy]] = {}
    for s in strategies:
        by_inputs.setdefault(tuple(_key(i) for i in s.inputs), []).append(s)
    if all(len(group) == 1 for group in by_inputs.values()):
        return strategies
    if any(_holds_strategy(a) for a in args) or any(
        isinstance(v, OpStrategy) or _holds_strategy(v) for v in kwargs.values()
    ):
        return strategies
    positions = [i for i, a in enumerate(args) if isinstance(a, OpStrategy)]
    prop = sharding_propagator()
    info = prop.op_to_schema_info.get(op)
    dropped: set[int] = set()
    for group in by_inputs.values():
        inputs = group[0].inputs
        if len(group) == 1 or len(inputs) != len(positions) or None in inputs:
            continue
        placed = list(args)
        for position, spec in zip(positions, inputs):
            placed[position] = spec
        try:
            chosen = prop.propagate_op_sharding_non_cached(
                OpSchema(op, tuple(placed), kwargs, schema_info=info)
            ).output_spec
        except Exception:  # noqa: BLE001  (DTensor's own refusal: the lowering will say why)
            continue
        if chosen is None or isinstance(chosen, (list, tuple)):
            continue
        if not any(_key(s.output) == _key(chosen) for s in group):
            continue
        dropped.update(id(s) for s in group if _key(s.output) != _key(chosen))
    return [s for s in strategies if id(s) not in dropped]


def _attention_strategies(
    args: tuple, kwargs: dict, out_val: Any, mesh: DeviceMesh
) -> list[NodeStrategy]:
    """Attention is independent per batch row and per head: shard q, k, v (and a mask that has
    the dim) on dim 0 or 1, get the output sharded the same way.

    Shards follow torch.chunk, so a head is never split across devices; heads are sharded only
    where k and v have as many heads as q (each device then holds the key and value heads its
    query heads read).
    """
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, OpStrategy)]
    metas = [t.strategies[0].output_spec.tensor_meta for t in tensors]
    q = metas[0]
    out = []
    for combo in itertools.product(*[(None, 0, 1) for _ in mesh.shape]):
        if any(d is not None and q.shape[d] < 2 for d in combo):
            continue
        ins = [_attention_input(mesh, m, q.shape, i >= 3, combo) for i, m in enumerate(metas)]
        if None in ins:
            continue
        placements = tuple(Replicate() if d is None else Shard(d) for d in combo)
        out.append(NodeStrategy(DTensorSpec(mesh, placements, tensor_meta(out_val)), tuple(ins)))
    return out


def _attention_input(
    mesh: DeviceMesh,
    meta: TensorMeta,
    q_shape: torch.Size,
    is_mask: bool,
    combo: tuple[int | None, ...],
) -> DTensorSpec | None:
    """The spec an attention input takes under `combo` (per mesh dim: the sharded tensor dim,
    or None for replicated), or None where a dim it must shard differs from q's."""
    placements: list[Placement] = []
    for d in combo:
        if d is None or (is_mask and meta.shape[d] == 1):  # a mask broadcast over this dim
            placements.append(Replicate())
        elif meta.shape[d] == q_shape[d]:
            placements.append(Shard(d))
        else:
            return None
    return DTensorSpec(mesh, tuple(placements), meta)


LOCAL_RULES = {torch.ops.aten.scaled_dot_product_attention.default: _attention_strategies}
"""Ops tessel places itself and lowers by running them on the local shards."""


def _holds_strategy(arg: Any) -> bool:
    """Whether `arg` is a list or a tuple strategy holding some tensor's strategy."""
    if isinstance(arg, TupleStrategy):
        return True
    return isinstance(arg, (list, tuple)) and any(
        isinstance(a, (OpStrategy, TupleStrategy)) for a in arg
    )


def _dedup(result: OpStrategy) -> list[NodeStrategy]:
    seen: set = set()
    out: list[NodeStrategy] = []
    for spec in result.strategies:
        output = spec.output_specs
        if isinstance(output, list):
            output = tuple(output)
        inputs = tuple(spec.input_specs or ())
        out_key = tuple(_key(o) for o in output) if isinstance(output, tuple) else _key(output)
        key = (out_key, tuple(_key(s) for s in inputs))
        if key in seen or _left_out(output) or any(_left_out(s) for s in inputs):
            continue
        seen.add(key)
        out.append(NodeStrategy(output, inputs))
    return out


def _left_out(spec: Any) -> bool:
    """Whether a spec is left out of the search: strided shards (a split dim merged into
    another), and a tensor masked over several mesh dims (an embedding whose vocabulary is split
    over two axes), which DTensor cannot make, as it keeps one mask per tensor."""
    if isinstance(spec, tuple):
        return any(_left_out(s) for s in spec)
    if spec is None:
        return False
    placements = spec.placements
    return any(isinstance(p, StridedShard) for p in placements) or (
        sum(isinstance(p, MaskPartial) for p in placements) > 1
    )


def _key(spec: DTensorSpec | None) -> Any:
    return None if spec is None else tuple(spec.placements)


def as_op_strategy(
    outputs: list[DTensorSpec | None], mesh: DeviceMesh, meta: TensorMeta | None
) -> OpStrategy:
    """Producer candidates in the form DTensor's rules take as an argument."""
    specs = []
    seen = set()
    for out in outputs:
        out = out or DTensorSpec(mesh, (Replicate(),) * mesh.ndim, meta)
        if out.tensor_meta is None:
            out = DTensorSpec(mesh, out.placements, meta)
        key = tuple(out.placements)
        if key in seen:
            continue
        seen.add(key)
        specs.append(OpSpec(out))
    return OpStrategy(specs)


def _placement_text(spec: DTensorSpec | tuple | None) -> str:
    if spec is None:
        return "-"
    if isinstance(spec, tuple):
        return "(" + ", ".join(_placement_text(s) for s in spec) + ")"
    return "/".join(str(p) for p in spec.placements)


def describe_strategy(strategy: NodeStrategy) -> str:
    """`S(0), R -> S(0)`: the input placements, then the output's."""
    ins = ", ".join(_placement_text(s) for s in strategy.inputs)
    return f"{ins} -> {_placement_text(strategy.output)}"


def strategy_key(strategy: NodeStrategy) -> str:
    """A name for a strategy that is the same in every planning of one graph."""
    return describe_strategy(strategy)
