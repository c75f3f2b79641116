"""DTensor sharding rules for CPU flash attention, forward and backward.

On CPU, `scaled_dot_product_attention` dispatches to `_scaled_dot_product_flash_attention_for_cpu`
(and its backward), for which DTensor has no rule: a network on DTensors could not run attention,
and the planner could only replicate it in a training graph. Attention is independent per batch
row and per head, so each mesh dim may split q, k, v, the output and the logsumexp along dim 0
(rows) or dim 1 (heads), a mask along the same dim where it has it (broadcast masks stay whole),
or keep everything whole. With grouped key/value heads (q has n times as many), splitting both
evenly leaves each device the key/value heads its query heads read; DTensor offers only even
splits here, so an uneven one is never chosen. Registered once, on
import, for every caller of DTensor's rules: the planner and DTensor's own dispatch see the same.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Placement, Replicate, Shard

from tessel._torch import OpSchema, OpStrategy, expand_to_full_mesh_op_strategy, sharding_propagator

_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _shape(strategy: OpStrategy) -> torch.Size:
    return strategy.strategies[0].output_spec.tensor_meta.shape


def _per_dim_strategies(
    q: torch.Size, kv: torch.Size, mask: torch.Size | None, outputs: int, inputs: int
) -> list[list[Placement]]:
    """Placement lists [outputs..., tensor inputs..., mask] for one mesh dim."""
    found: list[list[Placement]] = [[Replicate()] * (outputs + inputs + (mask is not None))]
    for dim in (0, 1):
        if dim == 1 and q[1] % kv[1]:
            continue  # heads that do not group: a q-head shard would need other kv heads
        row: list[Placement] = [Shard(dim)] * (outputs + inputs)
        if mask is not None:
            row.append(Shard(dim) if mask[dim] == q[dim] and mask[dim] > 1 else Replicate())
        found.append(row)
    return found


def _mask(op_schema: OpSchema) -> torch.Size | None:
    mask = op_schema.kwargs_schema.get("attn_mask")
    return _shape(mask) if isinstance(mask, OpStrategy) else None


def _forward_strategy(op_schema: OpSchema) -> OpStrategy:
    q, k = (_shape(op_schema.args_schema[i]) for i in (0, 1))
    rows = _per_dim_strategies(q, k, _mask(op_schema), outputs=2, inputs=3)
    mesh = op_schema.get_mesh_from_args()
    return expand_to_full_mesh_op_strategy(mesh, op_schema, rows, input_index=2)


def _backward_strategy(op_schema: OpSchema) -> OpStrategy:
    # grad_out, q, k, v, out, logsumexp
    q, k = (_shape(op_schema.args_schema[i]) for i in (1, 2))
    rows = _per_dim_strategies(q, k, _mask(op_schema), outputs=3, inputs=6)
    mesh = op_schema.get_mesh_from_args(validate=False)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, rows, input_index=3)


def register() -> None:
    """Add the rules to DTensor's registry (once; later calls do nothing)."""
    propagator = sharding_propagator()
    for op, rule in ((_FORWARD, _forward_strategy), (_BACKWARD, _backward_strategy)):
        if op not in propagator.op_strategy_funcs:
            propagator.register_op_strategy(op, rule)


register()
