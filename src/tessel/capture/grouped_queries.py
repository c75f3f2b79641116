"""Attention over grouped keys and values without copying them.

A model with fewer key/value heads than query heads (grouped-query attention) repeats each
key/value head for its group of query heads before attention: `transformers` traces this as an
`expand` and a contiguous `clone` of the keys and of the values, `[B, kv heads, group, S, D]`,
viewed as `[B, heads, S, D]`. In a generation gear those are the whole KV cache, copied on every
step; in any forward they are a copy of every layer's keys and values. Two rewrites read them
as they are instead, each meeting every query head with the same keys, values and mask as
before, so the result is the same attention:

- one query token: the group's query heads stand where the tokens stand, queries
  `[B, kv heads, group, D]` attending to the keys and values in one call, the mask broadcast
  over the group, the result viewed back as `[B, heads, 1, D]`;
- several query tokens (a prompt, a causal flag): one attention call per member of the group,
  its query heads `[B, kv heads, T, D]` (a strided view of the queries) against the keys and
  values as they are, the mask as given; the calls' results are stacked in the layout the
  single call returned.

Eager attention (Gemma-2's, with its soft-capping) multiplies instead: the scores are a batched
matrix product of the queries `[B * heads, T, D]` with the repeated keys, transposed, and the
output one of the weights `[B * heads, T, S]` with the repeated values. There the rows of a
group's heads, where they lie one after the other, are one batch: `[B * kv heads, group * T, D]`
against the keys as they are, viewed back as `[B * heads, T, S]`, with whatever runs between
the two products (scaling, capping, the mask, the softmax) left as it was.

`fold_grouped_queries` makes those rewrites on each traced rank program wherever the pattern is
exact on the rank's local shapes; anything else (a mask that differs between heads, a slice
between the repeat and the attention) is left as it is. A product whose rows of one group lie
apart (one prompt's token-major queries) is given a copy of its rows at capture
(`group_query_rows`): a prompt's queries are far fewer bytes than the cache's keys.
The planner's memory model counts the repeat's copy (`repeat_left_unread`) for the plans that
move a value between the unrepeated keys or values and the attention (`repeat_edges`): there
the rank's program holds the pattern with a move inside it, and the copy stays. Elsewhere it
holds nothing.
"""

from __future__ import annotations

import torch
from torch import fx

_ATTENTION = torch.ops.aten.scaled_dot_product_attention.default
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
_CLONE = torch.ops.aten.clone.default
_EXPAND = torch.ops.aten.expand.default
_UNSQUEEZE = torch.ops.aten.unsqueeze.default
_BMM = torch.ops.aten.bmm.default
_PERMUTE = torch.ops.aten.permute.default
_TRANSPOSE = torch.ops.aten.transpose.int
_SELECT = torch.ops.aten.select.int
_STACK = torch.ops.aten.stack.default


def fold_grouped_queries(graph: fx.Graph) -> int:
    """Rewrite each attention over repeated keys and values (see the module docstring) to
    attend to the unrepeated ones; returns how many. The repeats left unread
    are removed."""
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _ATTENTION and _fold(graph, node):
            folded += 1
        elif node.target is _BMM and _fold_product(graph, node):
            folded += 1
    if folded:
        graph.eliminate_dead_code()
    return folded


def _val(node: object) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _arguments(node: fx.Node) -> dict | None:
    """The attention call's arguments by name, or None where it takes one this pass does
    not know."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    args = dict(zip(names, node.args))
    for key, value in node.kwargs.items():
        if key in args or key not in (*names, "scale", "enable_gqa"):
            return None
        args[key] = value
    return args


def _unrepeated(node: object, heads: int) -> tuple[fx.Node, int] | None:
    """(the tensor `[B, kv heads, S, D]` that `node` repeats into `heads` heads, the group
    size), where `node` is `view(clone(expand(unsqueeze(x, 2))))` doing exactly that."""
    if not (isinstance(node, fx.Node) and node.target in _VIEWS):
        return None
    clone = node.args[0]
    if not (isinstance(clone, fx.Node) and clone.target is _CLONE):
        return None
    expand = clone.args[0]
    if not (isinstance(expand, fx.Node) and expand.target is _EXPAND):
        return None
    unsqueeze = expand.args[0]
    if not (
        isinstance(unsqueeze, fx.Node) and unsqueeze.target is _UNSQUEEZE and unsqueeze.args[1] == 2
    ):
        return None
    source = unsqueeze.args[0]
    if not isinstance(source, fx.Node):
        return None
    kv, repeated, out = _val(source), _val(expand), _val(node)
    if kv is None or repeated is None or out is None or kv.dim() != 4:
        return None
    b, kv_heads, s, d = kv.shape
    group = repeated.shape[2]
    if tuple(repeated.shape) != (b, kv_heads, group, s, d):
        return None
    if tuple(out.shape) != (b, kv_heads * group, s, d) or kv_heads * group != heads:
        return None
    return source, group


def repeat_left_unread(node: fx.Node) -> bool:
    """Whether `node` is the copy of a repeat that `fold_grouped_queries` removes: what the
    memory model counts as holding no storage of its own."""
    if node.op != "call_function" or node.target is not _CLONE:
        return False
    views = list(node.users)
    if len(views) != 1 or views[0].target not in _VIEWS:
        return False
    readers = list(views[0].users)
    return bool(readers) and all(_reads_through_a_fold(r) for r in readers)


def repeat_edges(clone: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """The (producer, consumer) edges a fold reads through, for a repeat's copy `clone` that
    `repeat_left_unread` names: from the unsqueezed keys or values, through the expand, the
    copy and its view, to each attention call or product reading it. On a rank the fold finds
    the pattern only where the plan moves no value along any of them: a move (a gather, a
    slice) stands between the nodes there, and the copy is made as traced."""
    expand = clone.args[0]
    assert isinstance(expand, fx.Node) and isinstance(expand.args[0], fx.Node)
    (view,) = clone.users
    edges = [(expand.args[0], expand), (expand, clone), (clone, view)]
    for reader in view.users:
        edges.append((view, reader))
        node = reader
        while node.target not in (_ATTENTION, _BMM):
            (user,) = node.users  # `_reads_through_a_fold` found one user up to the product
            edges.append((node, user))
            node = user
    return edges


def _reads_through_a_fold(reader: fx.Node) -> bool:
    """Whether `reader` of a repeat is an attention call or the way into a product that
    the fold rewrites to read the unrepeated tensor instead."""
    if reader.op != "call_function":
        return False
    if reader.target is _ATTENTION:
        return _foldable(reader) is not None
    node = reader
    for _ in range(3):  # a transpose (keys), expand, view: then the product, the repeat its right
        users = list(node.users)
        if len(users) != 1:
            return False
        if users[0].target is _BMM:
            product = users[0]
            return product.args[1] is node and _foldable_product(product) is not None
        node = users[0]
    return False


def _foldable(node: fx.Node) -> tuple | None:
    """(its arguments, the unrepeated keys and values, the group size, and how the fold
    rewrites it: "one call", or a call per member of the group stacked as `_stacked_layout`
    says) of an attention call the fold keeps the same; None for any other."""
    args = _arguments(node)
    query, out = _val(args and args.get("query")), _val(node)
    if args is None or query is None or out is None or query.dim() != 4 or out.dim() != 4:
        return None
    heads, tokens = query.shape[1], query.shape[2]
    if args.get("dropout_p", 0.0) != 0.0 or args.get("enable_gqa", False):
        return None
    key = _unrepeated(args.get("key"), heads)
    value = _unrepeated(args.get("value"), heads)
    if key is None or value is None or key[1] != value[1] or key[1] < 2:
        return None
    mask = args.get("attn_mask")
    m = _val(mask) if mask is not None else None
    if mask is not None and (m is None or (m.dim() == 4 and m.shape[1] != 1)):
        return None  # a mask per head cannot stand for every head of a group
    causal = bool(args.get("is_causal", False))
    if tokens == 1 and not causal and (m is None or (m.dim() == 4 and m.shape[2] == 1)):
        return args, key[0], value[0], key[1], "one call"
    layout = _stacked_layout(out)
    if layout is None:
        return None
    return args, key[0], value[0], key[1], layout


def _stacked_layout(out: torch.Tensor) -> str | None:
    """How the per-member results stack into `out`'s layout: "heads" where `out` is
    `[B, heads, T, D]` in that order, "tokens" where it is laid out `[B, T, heads, D]` (CPU
    flash attention's own); None for any other layout."""
    b, heads, tokens, d = out.shape
    if _same_strides(out, (heads * tokens * d, tokens * d, d, 1)):
        return "heads"
    if _same_strides(out, (tokens * heads * d, d, heads * d, 1)):
        return "tokens"
    return None


def _same_strides(t: torch.Tensor, strides: tuple[int, ...]) -> bool:
    """Whether `t` has `strides` on every dimension longer than one (a dimension of one
    element may have any stride)."""
    return all(n == 1 or s == want for n, s, want in zip(t.shape, t.stride(), strides))


def _fold(graph: fx.Graph, node: fx.Node) -> bool:
    found = _foldable(node)
    if found is None:
        return False
    args, keys, values, group, kind = found
    with graph.inserting_before(node):
        if kind == "one call":
            result = _one_call(graph, node, args, keys, values, group)
        else:
            result = _call_per_member(graph, node, args, keys, values, group, kind)
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    return True


def _one_call(
    graph: fx.Graph, node: fx.Node, args: dict, keys: fx.Node, values: fx.Node, group: int
) -> fx.Node:
    """One token's query heads of a group stand where the tokens stand: one attention call."""
    query, out = _val(args["query"]), _val(node)
    assert query is not None and out is not None
    b, heads, _, d = query.shape
    kv_heads = heads // group
    grouped = _call(
        graph,
        _VIEWS[0],
        (args["query"], [b, kv_heads, group, d]),
        query.view(b, kv_heads, group, d),
    )
    attended = _call(
        graph, _ATTENTION, (grouped, keys, values, args.get("attn_mask"), 0.0, False),
        out.new_empty((b, kv_heads, group, out.shape[-1])), {"scale": args.get("scale")},
    )  # fmt: skip
    # attention's result need not be laid out heads-major: made so, it views as [B, H, 1, D]
    laid_out = _call(
        graph, _CLONE, (attended,), attended.meta["val"].contiguous(),
        {"memory_format": torch.contiguous_format},
    )  # fmt: skip
    return _call(
        graph, _VIEWS[0], (laid_out, list(out.shape)), laid_out.meta["val"].view(out.shape)
    )


def _call_per_member(
    graph: fx.Graph,
    node: fx.Node,
    args: dict,
    keys: fx.Node,
    values: fx.Node,
    group: int,
    layout: str,
) -> fx.Node:
    """One attention call per member of the group over the keys and values as they are, the
    results stacked in `node`'s `layout` (`_stacked_layout`)."""
    query, out = _val(args["query"]), _val(node)
    assert query is not None and out is not None
    b, heads, tokens, d = query.shape
    kv_heads, dv = heads // group, out.shape[-1]
    split = _call(
        graph, _VIEWS[0], (args["query"], [b, kv_heads, group, tokens, d]),
        query.view(b, kv_heads, group, tokens, d),
    )  # fmt: skip
    members = []
    for i in range(group):
        member = _call(graph, _SELECT, (split, 2, i), split.meta["val"].select(2, i))
        attended = _call(
            graph, _ATTENTION,
            (member, keys, values, args.get("attn_mask"), 0.0, args.get("is_causal", False)),
            out.new_empty((b, kv_heads, tokens, dv)), {"scale": args.get("scale")},
        )  # fmt: skip
        if layout == "tokens":  # [B, T, kv heads, D]: stacked on dim 3, a group's heads adjacent
            attended = _call(
                graph, _TRANSPOSE, (attended, 1, 2), attended.meta["val"].transpose(1, 2)
            )
        members.append(attended)
    vals = [m.meta["val"] for m in members]
    if layout == "tokens":
        stacked = _call(graph, _STACK, (members, 3), torch.stack(vals, 3))
        stacked = _call(
            graph, _PERMUTE, (stacked, [0, 2, 3, 1, 4]), stacked.meta["val"].permute(0, 2, 3, 1, 4)
        )
    else:
        stacked = _call(graph, _STACK, (members, 2), torch.stack(vals, 2))
    return _call(graph, _VIEWS[0], (stacked, list(out.shape)), stacked.meta["val"].view(out.shape))


def _call(
    graph: fx.Graph, target: object, args: tuple, val: torch.Tensor, kwargs: dict | None = None
) -> fx.Node:
    """A new call of `target` on `args` whose value is `val`."""
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = val
    return node


def _batched_repeat(node: object) -> tuple[fx.Node, bool, int] | None:
    """(the tensor `[B, kv heads, S, D]` repeated, whether it is transposed, the group size)
    where `node` is the repeat, transposed or not, batched for a product:
    `view(expand(repeat or permute(repeat, [0, 1, 3, 2])), [B * heads, ., .])` with an expand
    that changes no shape."""
    if not (isinstance(node, fx.Node) and node.target in _VIEWS):
        return None
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.target is _EXPAND):
        return None
    inner = expand.args[0]
    inner_val, expanded = _val(inner), _val(expand)
    if inner_val is None or expanded is None or inner_val.shape != expanded.shape:
        return None
    transposed = False
    if isinstance(inner, fx.Node) and inner.target in (_PERMUTE, _TRANSPOSE):
        dims = inner.args[1] if inner.target is _PERMUTE else _swap(*inner.args[1:3])
        if [d % 4 for d in dims] != [0, 1, 3, 2]:
            return None
        transposed, inner = True, inner.args[0]
    repeated = _val(inner)
    if repeated is None or repeated.dim() != 4:
        return None
    found = _unrepeated(inner, repeated.shape[1])
    if found is None:
        return None
    return found[0], transposed, found[1]


def _swap(first: int, second: int) -> list[int]:
    """The permutation of four dimensions that `transpose(first, second)` makes."""
    dims = [0, 1, 2, 3]
    dims[first % 4], dims[second % 4] = dims[second % 4], dims[first % 4]
    return dims


def _foldable_product(node: fx.Node) -> tuple[fx.Node, bool, int] | None:
    """(the unrepeated tensor, whether it is transposed, the group size) of a product of the
    rows `[B * heads, T, n]` with a batched repeat that the fold keeps the same: the rows of a
    group's heads must lie one after the other (`[B * kv heads, group * T, n]` a view of
    them); None for any other."""
    found = _product_over_repeat(node)
    if found is None or not _grouped_rows(node, found):
        return None
    return found


def _product_over_repeat(node: fx.Node) -> tuple[fx.Node, bool, int] | None:
    """What `_foldable_product` finds, whatever the layout of the product's rows."""
    rows, out = _val(node.args[0]), _val(node)
    found = _batched_repeat(node.args[1])
    if found is None or rows is None or out is None or rows.dim() != 3:
        return None
    source, transposed, group = found
    kv = _val(source)
    assert kv is not None
    b, kv_heads = kv.shape[:2]
    if group < 2 or rows.shape[0] != b * kv_heads * group:
        return None
    side = kv.transpose(2, 3) if transposed else kv
    if not _viewable(side, [b * kv_heads, *side.shape[2:]]):
        return None
    return found


def _grouped_rows(node: fx.Node, found: tuple[fx.Node, bool, int]) -> bool:
    """Whether the product's rows of each group lie one after the other."""
    rows, kv = _val(node.args[0]), _val(found[0])
    assert rows is not None and kv is not None
    b, kv_heads = kv.shape[:2]
    return _viewable(rows, [b * kv_heads, found[2] * rows.shape[1], rows.shape[2]])


def group_query_rows(graph: fx.Graph) -> int:
    """Before each product over a batched repeat whose rows of a group lie apart, a copy of
    the rows laid out one row after the other; returns how many.

    One prompt's queries, token-major as a model makes them, are batched for the product
    without a copy, so a group's rows lie apart and the product cannot be folded: its keys
    would be repeated into a copy of the cache. A copy of the queries (a prompt's tokens) is
    far smaller than that of the keys (every slot of the cache), and the copy is a node of the
    captured graph, so the planner counts it."""
    made = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _BMM:
            continue
        found = _product_over_repeat(node)
        if found is None or _grouped_rows(node, found):
            continue
        rows = node.args[0]
        assert isinstance(rows, fx.Node)
        val = _val(rows)
        assert val is not None
        with graph.inserting_before(node):
            copy = _call(
                graph,
                _CLONE,
                (rows,),
                val.clone(memory_format=torch.contiguous_format),
                {"memory_format": torch.contiguous_format},
            )
        copy.meta = {**node.meta, "val": copy.meta["val"]}  # the layer the product is in
        node.replace_input_with(rows, copy)
        made += 1
    return made


def _viewable(val: torch.Tensor, shape: list[int]) -> bool:
    try:
        val.view(shape)
    except (RuntimeError, ValueError):  # a fake tensor's view raises ValueError
        return False
    return True


def _fold_product(graph: fx.Graph, node: fx.Node) -> bool:
    found = _foldable_product(node)
    if found is None:
        return False
    source, transposed, group = found
    rows, out, kv = _val(node.args[0]), _val(node), _val(source)
    assert rows is not None and out is not None and kv is not None
    b, kv_heads = kv.shape[:2]
    tokens = rows.shape[1]
    with graph.inserting_before(node):
        # a group's rows one after the other: [B * heads, T, n] viewed as [B * kv, group * T, n]
        shape = [b * kv_heads, group * tokens, rows.shape[2]]
        grouped = _call(graph, _VIEWS[0], (node.args[0], shape), rows.view(shape))
        side, side_val = source, kv
        if transposed:
            side_val = kv.permute(0, 1, 3, 2)
            side = _call(graph, _PERMUTE, (source, [0, 1, 3, 2]), side_val)
        batch = [b * kv_heads, *side_val.shape[2:]]
        batched = _call(graph, _VIEWS[0], (side, batch), side_val.view(batch))
        made = out.new_empty((b * kv_heads, group * tokens, out.shape[2]))
        product = _call(graph, _BMM, (grouped, batched), made)
        result = _call(graph, _VIEWS[0], (product, list(out.shape)), made.view(out.shape))
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    return True
