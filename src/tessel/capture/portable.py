"""Rewrites that make a traced graph portable and deterministic.

Tracing runs on CPU tensors, so dispatch resolves attention to the CPU flash kernel. The planner
shards the device-neutral `scaled_dot_product_attention` (by batch or head), and a package built
for CUDA or NPU devices must call it too, so each device dispatches to its own kernel when the
program runs. And a program never allocates memory it does not fill (whatever the memory held
before could otherwise reach an output): `empty` allocations become zero-filled ones. Both the
captured graph and every traced rank program are rewritten.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

_CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_ATTENTION = torch.ops.aten.scaled_dot_product_attention.default


def portable_attention(gm: fx.GraphModule, recompile: bool = True) -> int:
    """Rewrite CPU flash attention calls whose logsumexp is unused; returns how many.

    `recompile=False` leaves `gm`'s code stale, for a caller that only reads its graph.
    """
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _CPU_ATTENTION:
            continue
        users = list(node.users)
        if not all(u.target is operator.getitem and u.args[1] == 0 for u in users):
            continue  # the logsumexp is used (a backward): no device-neutral equivalent
        q, k, v, *rest = node.args
        dropout_p = rest[0] if len(rest) > 0 else node.kwargs.get("dropout_p", 0.0)
        is_causal = rest[1] if len(rest) > 1 else node.kwargs.get("is_causal", False)
        with gm.graph.inserting_before(node):
            out = gm.graph.call_function(
                _ATTENTION,
                (q, k, v, node.kwargs.get("attn_mask"), dropout_p, is_causal),
                {"scale": node.kwargs.get("scale")},
            )
        out.meta = {key: val for key, val in node.meta.items() if key != "val"}
        if "val" in node.meta:
            out.meta["val"] = node.meta["val"][0]
        for user in users:
            user.replace_all_uses_with(out)
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten and recompile:
        gm.recompile()
    return rewritten


_ZERO_FILLED = {
    torch.ops.aten.empty_like.default: torch.ops.aten.zeros_like.default,
    torch.ops.aten.empty.memory_format: torch.ops.aten.zeros.default,
    torch.ops.aten.new_empty.default: torch.ops.aten.new_zeros.default,
}


def zero_fill_allocations(gm: fx.GraphModule) -> int:
    """Make every `empty` allocation zero-filled; returns how many (no recompile)."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _ZERO_FILLED:
            if node.target is torch.ops.aten.empty.memory_format:
                node.kwargs = {k: v for k, v in node.kwargs.items() if k != "memory_format"}
            node.target = _ZERO_FILLED[node.target]
            changed += 1
    return changed
