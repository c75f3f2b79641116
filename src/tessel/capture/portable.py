"""Rewrites that make a traced graph portable and deterministic.

Tracing runs on CPU tensors, so dispatch resolves attention to the CPU flash kernel. The planner
shards the device-neutral `scaled_dot_product_attention` (by batch or head), and a package built
for CUDA or NPU devices must call it too, so each device dispatches to its own kernel when the
program runs. And a program never allocates memory it does not fill (whatever the memory held
before could otherwise reach an output): `empty` allocations become zero-filled ones. Both the
captured graph and every traced rank program are rewritten. A traced rank program also makes
the scalars its operators take as tensors where it uses them (`fresh_scalars`), rather than
holding them as constants the captured graph never had.
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
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.empty_permuted.default:
            _zero_filled_permuted(gm.graph, node)
            changed += 1
        elif node.op == "call_function" and node.target in _ZERO_FILLED:
            if node.target is torch.ops.aten.empty.memory_format:
                node.kwargs = {k: v for k, v in node.kwargs.items() if k != "memory_format"}
            node.target = _ZERO_FILLED[node.target]
            changed += 1
    return changed


def _zero_filled_permuted(graph: fx.Graph, node: fx.Node) -> None:
    """`empty_permuted(size, layout)` (what `empty_like` of a strided tensor traces to) as
    zeros laid out in `layout`'s order, viewed back in `size`'s."""
    size, layout = list(node.args[0]), list(node.args[1])
    kwargs = {k: v for k, v in node.kwargs.items() if k != "pin_memory"}
    if layout == sorted(layout):
        node.target, node.args, node.kwargs = torch.ops.aten.zeros.default, (size,), kwargs
        return
    inverse = [layout.index(d) for d in range(len(layout))]
    with graph.inserting_after(node):
        zeros = graph.call_function(
            torch.ops.aten.zeros.default, ([size[d] for d in layout],), kwargs
        )
        if "val" in node.meta:
            zeros.meta["val"] = node.meta["val"].permute(layout)
        with graph.inserting_after(zeros):
            viewed = graph.call_function(torch.ops.aten.permute.default, (zeros, inverse))
    for key in ("val", "tensor_meta"):
        if key in node.meta:
            viewed.meta[key] = node.meta[key]
    node.replace_all_uses_with(viewed)
    graph.erase_node(node)


_LIFTS = {torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift_fresh.default}


def fresh_scalars(gm: fx.GraphModule) -> int:
    """Make each 0-dim tensor constant a traced program lifts where it is used (`scalar_tensor`);
    returns how many (no recompile).

    Tracing turns a Python scalar an operator takes as a tensor (DTensor's mask of a
    vocabulary-sharded embedding writes `tensor(0)` through it) into a constant of the program
    and a fresh copy of it. The copy is what the operator reads, and `scalar_tensor` makes the
    same fresh tensor from the value alone: the program then holds no constant the captured
    graph did not have, which the planner, reading the captured graph, cannot know of.
    """
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _LIFTS:
            continue
        const = node.args[0]
        if not isinstance(const, fx.Node) or const.op != "get_attr":
            continue
        name = str(const.target)
        value = getattr(gm, name, None)
        if not isinstance(value, torch.Tensor) or value.dim() != 0 or value.is_complex():
            continue
        with gm.graph.inserting_before(node):
            made = gm.graph.call_function(
                torch.ops.aten.scalar_tensor.default,
                (value.item(),),
                {"dtype": value.dtype, "device": value.device},
            )
        made.meta = dict(node.meta)
        node.replace_all_uses_with(made)
        gm.graph.erase_node(node)
        if not const.users:
            gm.graph.erase_node(const)
            delattr(gm, name)
        changed += 1
    return changed
