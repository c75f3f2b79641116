"""Random edits of JSON documents for the property tests: any value anywhere replaced by any
JSON value."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st


def json_values() -> st.SearchStrategy:
    """Any JSON value: scalars (with some that look like code or names), lists and objects."""
    leaves = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(), st.text(max_size=8),
        st.sampled_from(["s0", "torch.ops.aten.add.Tensor", "Symbol('s0')", "__import__('os')"]),
    )  # fmt: skip
    return st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
        ),
        max_leaves=6,
    )


def json_paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every location in `doc` as a key/index path (the root is `()`)."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += json_paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += json_paths(v, (*prefix, i))
    return out


def replaced(doc: Any, data: Any) -> Any:
    """A copy of `doc` with one value anywhere in it replaced by any JSON value (`data`:
    hypothesis's `st.data()`)."""
    doc = json.loads(json.dumps(doc))
    path = data.draw(st.sampled_from([p for p in json_paths(doc) if p]))
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = data.draw(json_values())
    return doc
