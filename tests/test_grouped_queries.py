"""Attention over grouped keys and values: the folds that stop a decode step, a prompt or any
forward from copying the keys and values give the same attention, and touch nothing else."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tessel.capture.grouped_queries import fold_grouped_queries
from tessel.capture.portable import portable_attention


def _repeated(x: torch.Tensor, group: int) -> torch.Tensor:
    """What transformers' `repeat_kv` does: each key/value head once per query head."""
    b, kv_heads, s, d = x.shape
    return x[:, :, None].expand(b, kv_heads, group, s, d).reshape(b, kv_heads * group, s, d)


def _attention(group: int, is_causal: bool = False, scale: float | None = None):
    def run(q, k, v, mask):
        out = torch.nn.functional.scaled_dot_product_attention(
            q, _repeated(k, group), _repeated(v, group), attn_mask=mask, is_causal=is_causal,
            scale=scale,
        )  # fmt: skip
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)

    return run


def _traced(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    gm.graph.eliminate_dead_code()  # as a rank's trace is, before its attention is made portable
    portable_attention(gm)
    return gm


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _inputs(b, kv_heads, group, tokens, slots, d, mask_kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, tokens, kv_heads * group, d, generator=g).transpose(1, 2)  # as a model
    k = torch.randn(b, kv_heads, slots, d, generator=g)
    v = torch.randn(b, kv_heads, slots, d, generator=g)
    keep = torch.rand(b, 1, tokens, slots, generator=g) > 0.3
    keep[..., 0] = True  # every row attends to something
    mask = {"none": None, "bool": keep, "float": torch.where(keep, 0.0, -1e9)}[mask_kind]
    return q, k, v, mask


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize(
    "b,kv_heads,group,slots,d", [(1, 2, 2, 5, 4), (2, 3, 4, 16, 8), (3, 2, 7, 9, 16)]
)
def test_one_query_token_attends_to_the_cache_as_it_is_and_gives_the_same_attention(
    b, kv_heads, group, slots, d, mask_kind
):
    args = _inputs(b, kv_heads, group, 1, slots, d, mask_kind)
    for scale in (None, 0.3):
        fn = _attention(group, scale=scale)
        gm = _traced(fn, *args)
        assert torch.ops.aten.clone.default in _targets(gm)  # the repeat copies keys and values
        assert fold_grouped_queries(gm.graph) == 1
        gm.recompile()
        targets = _targets(gm)
        assert torch.ops.aten.expand.default not in targets  # nothing repeats the cache now
        attention = next(n for n in gm.graph.nodes if "scaled_dot" in str(n.target))
        assert attention.args[1].op == "placeholder" and attention.args[2].op == "placeholder"
        torch.testing.assert_close(gm(*args), fn(*args), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize(
    "b,kv_heads,group,tokens,slots,d",
    [(1, 2, 2, 3, 5, 4), (2, 3, 4, 16, 16, 8), (3, 2, 7, 4, 9, 16), (2, 2, 3, 1, 6, 4)],
)
def test_several_query_tokens_attend_member_by_member_to_the_keys_as_they_are(
    b, kv_heads, group, tokens, slots, d, mask_kind
):
    """A prompt's tokens (or a causal forward's): one call per member of each group over the
    keys and values themselves, stacked back into the layout the single call returned."""
    q, k, v, mask = _inputs(b, kv_heads, group, tokens, slots, d, mask_kind)
    for is_causal, scale in ((False, None), (False, 0.3), (mask is None, None)):
        if tokens == 1 and not is_causal:
            continue  # one token without a causal flag: one call (the test above)
        fn = _attention(group, is_causal=is_causal, scale=scale)
        gm = _traced(fn, q, k, v, mask)
        attention = next(n for n in gm.graph.nodes if "scaled_dot" in str(n.target))
        out, reader = attention.meta["val"], next(iter(attention.users))
        assert fold_grouped_queries(gm.graph) == 1
        gm.recompile()
        targets = _targets(gm)
        assert torch.ops.aten.expand.default not in targets  # nothing repeats keys or values
        assert torch.ops.aten.clone.default not in targets
        calls = [n for n in gm.graph.nodes if "scaled_dot" in str(n.target)]
        assert len(calls) == group
        for call in calls:
            assert call.args[1].op == "placeholder" and call.args[2].op == "placeholder"
        result = reader.args[0]  # what the model reads where it read the single call's
        assert (result.meta["val"].shape, result.meta["val"].stride()) == (out.shape, out.stride())
        torch.testing.assert_close(gm(q, k, v, mask), fn(q, k, v, mask), rtol=1e-6, atol=1e-6)


def test_a_mask_that_differs_between_heads_is_left_as_it_is():
    b, kv_heads, group, slots, d = 2, 2, 3, 8, 4
    for tokens in (1, 3):
        q, k, v, mask = _inputs(b, kv_heads, group, tokens, slots, d, "bool")
        mask = mask.expand(b, kv_heads * group, tokens, slots).clone()
        mask[:, 1, ..., 1:] = False
        gm = _traced(_attention(group), q, k, v, mask)
        before = _targets(gm)
        assert fold_grouped_queries(gm.graph) == 0
        assert _targets(gm) == before


def test_attention_without_grouped_heads_is_left_as_it_is():
    q, k, v, mask = _inputs(2, 4, 1, 1, 8, 4, "bool")
    gm = _traced(_attention(1), q, k, v, mask)
    assert fold_grouped_queries(gm.graph) == 0


def test_the_memory_model_holds_the_folded_copy_as_no_storage():
    """The planner counts what the lowered program holds: the repeat's copy only where the
    fold cannot remove it."""
    from tessel.plan.memory import is_view

    for tokens, per_head, free in ((1, False, True), (3, False, True), (3, True, False)):
        q, k, v, mask = _inputs(2, 2, 3, tokens, 8, 4, "bool")
        if per_head:
            mask = mask.expand(2, 6, tokens, 8).clone()
        gm = _traced(_attention(3), q, k, v, mask)
        clones = [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default]
        assert len(clones) == 2
        assert [is_view(n) for n in clones] == [free, free]


def _eager_attention(group: int, cap: float = 50.0):
    """Attention as eager `transformers` models (Gemma-2) write it: products over the repeated
    keys and values, with soft-capping and the mask between them."""

    def run(q, k, v, mask):
        scores = torch.matmul(q, _repeated(k, group).transpose(2, 3)) * q.shape[-1] ** -0.5
        scores = torch.tanh(scores / cap) * cap + mask
        out = torch.matmul(torch.softmax(scores, dim=-1), _repeated(v, group))
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)

    return run


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("b,kv_heads,group,slots,d", [(1, 2, 2, 5, 4), (3, 2, 7, 9, 16)])
def test_eager_attention_s_products_read_the_cache_as_it_is_and_give_the_same_attention(
    b, kv_heads, group, slots, d, tokens
):
    q, k, v, mask = _inputs(b, kv_heads, group, tokens, slots, d, "float")
    fn = _eager_attention(group)
    gm = _traced(fn, q, k, v, mask)
    assert len(_repeats(gm)) == 2  # keys and values repeated
    # a batch of one prompt's queries, token-major as the model made them, is batched for the
    # keys' product without a copy: a group's rows lie apart, and that product is left
    keys_fold = tokens == 1 or b > 1
    assert fold_grouped_queries(gm.graph) == 1 + keys_fold
    gm.recompile()
    assert len(_repeats(gm)) == 1 - keys_fold
    caches = [n for n in gm.graph.nodes if n.op == "placeholder"][1 if keys_fold else 2 : 3]
    for cache in caches:
        for reader in cache.users:  # the keys (transposed) and values, viewed as a batch
            assert reader.target in (torch.ops.aten.permute.default, torch.ops.aten.view.default), (
                reader.target
            )
    torch.testing.assert_close(gm(q, k, v, mask), fn(q, k, v, mask), rtol=1e-6, atol=1e-6)


def test_one_prompt_s_queries_are_copied_so_that_its_keys_are_not():
    """A batch of one prompt: its token-major queries, batched for the keys' product without
    a copy, leave a group's rows apart. Capture copies the queries (a prompt's tokens), after
    which both products fold and neither the keys nor the values are repeated."""
    from tessel.capture.grouped_queries import group_query_rows

    q, k, v, mask = _inputs(1, 2, 3, 4, 9, 8, "float")
    fn = _eager_attention(3)
    gm = _traced(fn, q, k, v, mask)
    assert group_query_rows(gm.graph) == 1  # the keys' product; the values' rows are grouped
    assert group_query_rows(gm.graph) == 0  # and once is enough
    assert fold_grouped_queries(gm.graph) == 2
    gm.recompile()
    assert not _repeats(gm)
    torch.testing.assert_close(gm(q, k, v, mask), fn(q, k, v, mask), rtol=1e-6, atol=1e-6)


def _repeats(gm) -> list:
    """The copies that repeat each key/value head for its group (several tokens' products also
    copy the queries into a batch: those stay)."""
    return [
        n
        for n in gm.graph.nodes
        if n.target is torch.ops.aten.clone.default
        and n.args[0].args[0].target is torch.ops.aten.unsqueeze.default
    ]


def test_eager_attention_s_repeats_are_counted_as_no_storage_where_the_products_fold():
    from tessel.plan.memory import is_view

    for tokens, contiguous_rows in ((1, True), (3, True), (3, False)):
        q, k, v, mask = _inputs(2, 2, 3, tokens, 8, 4, "float")
        gm = _traced(_eager_attention(3), q, k, v, mask)
        if not contiguous_rows:  # the rows laid out token-major: a group's rows are apart
            for n in [n for n in gm.graph.nodes if n.target is torch.ops.aten.bmm.default]:
                rows = n.args[0]
                val = rows.meta["val"].transpose(0, 1).contiguous()
                with gm.graph.inserting_before(n):
                    made = gm.graph.call_function(torch.ops.aten.clone.default, (rows,))
                    made.meta["val"] = val.transpose(0, 1)  # strides (n, B * heads * n, 1)
                n.replace_input_with(rows, made)
        folds = 2 if contiguous_rows else 0
        assert [is_view(n) for n in _repeats(gm)] == [folds > 0] * 2
        assert fold_grouped_queries(gm.graph) == folds
