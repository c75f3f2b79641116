"""Strategy files: per parameter full shape, dtype, device matrix, tensor map, pipeline stages and
optimizer-shard size/step.

tessel writes its own JSON format::

    {"format": "tessel-strategy", "version": 1, "stage_device_num": 8,
     "params": {"w": {"shape": [1024, 512], "dtype": "float32", "dev_matrix": [2, 4],
                      "tensor_map": [[1], []], "stages": [0],
                      "opt_shard_size": 0, "opt_shard_step": 0}}}

``tensor_map`` has one list per tensor dim of device axes counted from the right (outer first;
``[]`` = not sharded). A param is held by global ranks ``stage * stage_device_num + local`` for
each of its stages, or by ``rank_list[local]`` when a rank list is given.

tessel also reads MindSpore's JSON strategy files and protobuf strategy files (.ckpt, see
mindspore_proto.py); those carry no shape or dtype, which are then taken from the checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tessel.atomic import replace_atomically
from tessel.checkpoint.errors import LayoutError, StrategyError
from tessel.checkpoint.layout import Layout
from tessel.checkpoint.records import (
    FORMAT_NAME,
    ParamLayout,
    Strategy,
    check_param,
    check_ranks,
    check_strategy,
    checked_dtype_name,
    merge_stage_prefixed,
)
from tessel.config.fields import (
    MAX_ID,
    Fields,
    describe,
    int_value,
    str_value,
    suggest,
)

# ---------------------------------------------------------------------------------------------
# reading


def _splits(dev_matrix: tuple[int, ...], tensor_map: tuple[tuple[int, ...], ...]) -> list[int]:
    n = len(dev_matrix)
    return [math.prod(dev_matrix[n - 1 - a] for a in axes if 0 <= a < n) for axes in tensor_map]


MAX_DIM = 2**62  # a tensor dim (MindSpore stores shapes as int64)
_TESSEL_KEYS = ("format", "version", "stage_device_num", "world_size", "params")
_TESSEL_PARAM_KEYS = (
    "shape",
    "dtype",
    "dev_matrix",
    "tensor_map",
    "stages",
    "opt_shard_size",
    "opt_shard_step",
    "rank_list",
    "alias_name",
)
# MindSpore's JSON strategy, plus the members its operator-strategy files add (read, not used).
_MINDSPORE_KEYS = (
    "current_stage",
    "parallel_strategy_item",
    "parallel_layout_item",
    "parallel_out_strategy_item",
    "parallel_layout_value_item",
    "parallel_out_layout_value_item",
    "parallel_newshape_layout_value_item",
    "parallel_out_newshape_layout_value_item",
)
_MINDSPORE_PARAM_KEYS = (
    "dev_matrix",
    "tensor_map",
    "tensor_shape",
    "field",
    "opt_weight_shard_step",
    "opt_weight_shard_size",
    "param_split_shape",
    "indices_offset",
)


def _tensor_map(f: Fields) -> tuple[tuple[int, ...], ...]:
    """`tensor_map`: per tensor dim an axis (-1: not sharded) or a list of axes."""
    out: list[tuple[int, ...]] = []
    path = f.path("tensor_map")
    for i, e in enumerate(f.get("tensor_map", list)):
        fail = f.error_at(f"{path}[{i}]")
        if isinstance(e, list):
            axes = [int_value(a, -1, MAX_ID, fail) for a in e]
        else:
            axes = [int_value(e, -1, MAX_ID, fail)]
        out.append(tuple(a for a in axes if a != -1))
    return tuple(out)


def _param_from_json(name: str, f: Fields, mindspore: bool, stage: int = 0) -> ParamLayout:
    """One parameter record, tessel's or MindSpore's (`mindspore`, whose stage is `stage`)."""
    f.check_keys(_MINDSPORE_PARAM_KEYS if mindspore else _TESSEL_PARAM_KEYS)
    dev = tuple(f.int_list("dev_matrix", 1, MAX_ID, min_len=1))
    tm = _tensor_map(f)
    if mindspore:
        shape = f.int_list("tensor_shape", 0, MAX_DIM, None)
        for d, (s, k) in enumerate(zip(shape or (), _splits(dev, tm))):
            if s % k:  # MindSpore's slices are even
                raise f.error(
                    f"dim {d} of size {s} is not divisible into {k} slices", "tensor_shape"
                )
        dtype = None
        stages: Any = [stage]
        if f.integer("field", 0, MAX_ID, 0):
            raise f.error(f"uses field split (field={f.obj['field']})", "field")
        if f.int_list("param_split_shape", 0, MAX_DIM, []):
            raise f.error("uses a manual uneven split", "param_split_shape")
        f.int_list("indices_offset", 0, MAX_DIM, [])
        size = f.integer("opt_weight_shard_size", -1, MAX_ID, 0)
        step = f.integer("opt_weight_shard_step", 0, MAX_ID, 0)
        rank_list = alias = None
    else:
        shape = f.int_list("shape", 0, MAX_DIM, None) if f.obj.get("shape") is not None else None
        dtype = f.string("dtype", None) if f.obj.get("dtype") is not None else None
        if dtype is not None:
            try:
                dtype = checked_dtype_name(dtype)
            except StrategyError as e:
                raise f.error(e.detail, "dtype") from None
        stages = f.int_list("stages", 0, MAX_ID, [0], min_len=1, unique=True)
        size = f.integer("opt_shard_size", -1, MAX_ID, 0)
        step = f.integer("opt_shard_step", 0, MAX_ID, 0)
        rank_list = f.int_list("rank_list", 0, MAX_ID, None, unique=True)
        alias = f.get("alias_name", list, None)
        if alias is not None:
            path = f.path("alias_name")
            alias = [str_value(a, f.error_at(f"{path}[{i}]")) for i, a in enumerate(alias)]
    p = ParamLayout(
        dev_matrix=dev,
        tensor_map=tm,
        shape=tuple(shape) if shape is not None else None,
        dtype=dtype,
        stages=tuple(stages),
        opt_shard_size=size,
        opt_shard_step=step,
        rank_list=tuple(rank_list) if rank_list is not None else None,
        alias_name=tuple(alias) if alias is not None else None,
    )
    p = check_param(name, p, f.source, f.key_path)
    if p.alias_name is not None or p.rank_list is not None:
        try:  # the names and ranks must make a valid Layout
            p.to_layout()
        except LayoutError as e:
            raise f.error(e.detail, e.key) from None
    return p


def _params(top: Fields, key: str) -> list[tuple[str, Fields]]:
    """The records of the object at `key`: (parameter name, its Fields)."""
    group = top.child(key)
    assert group is not None
    return [(name, group.at(value, name)) for name, value in group.obj.items()]


def _mindspore_stage(top: Fields) -> int:
    """The pipeline stage of a MindSpore strategy: that of its first operator."""
    stage = None
    ops = top.child("parallel_strategy_item", None)
    for name, value in ops.obj.items() if ops is not None else ():
        op = ops.at(value, name)
        op.check_keys(("stage", "parallel_strategy"))
        op_stage = op.integer("stage")
        path = op.path("parallel_strategy")
        for i, dims in enumerate(op.get("parallel_strategy", list, [])):
            if not isinstance(dims, list):
                raise op.error_at(f"{path}[{i}]")(
                    f"expected a list of split counts, found {describe(dims)}"
                )
            for k, d in enumerate(dims):
                int_value(d, 1, MAX_ID, op.error_at(f"{path}[{i}][{k}]"))
        stage = op_stage if stage is None else stage
    return stage or 0


def _strategy_from_json(data: Any, src: str) -> Strategy:
    top = Fields(data, src, error=StrategyError)
    if top.has("format") or top.has("params"):
        top.check_keys(_TESSEL_KEYS)
        top.string("format", choices=(FORMAT_NAME,))
        if top.has("version") and top.obj["version"] != 1:
            raise top.error(
                f"found {describe(top.obj['version'])}; tessel reads version 1", "version"
            )
        out = {
            name: _param_from_json(name, f, mindspore=False) for name, f in _params(top, "params")
        }
        st = Strategy(out, src)
        if top.has("world_size") and out:
            need = st.world_size
            st.extra["world_size"] = top.integer("world_size", need, MAX_ID)
        if top.has("stage_device_num") and out:
            written = top.integer("stage_device_num", 1, MAX_ID)
            got = st.stage_device_num
            if got != written:
                raise top.error(f"is {written} but the dev matrices give {got}", "stage_device_num")
        return st
    if top.has("parallel_layout_item"):  # MindSpore's JSON strategy
        top.check_keys(_MINDSPORE_KEYS)
        top.integer("current_stage", 0, MAX_ID, 0)
        for key in _MINDSPORE_KEYS[3:]:
            top.child(key, None)
        stage = _mindspore_stage(top)
        pairs = [
            (name, _param_from_json(name, f, mindspore=True, stage=stage))
            for name, f in _params(top, "parallel_layout_item")
        ]
        return Strategy(merge_stage_prefixed(pairs, src, prefixed=True), src)
    known = (*_TESSEL_KEYS, *_MINDSPORE_KEYS)
    for key in top.obj:
        if key not in known and suggest(key, known):  # a misspelt key of either format
            raise top.error(
                f"unknown key; {suggest(key, known)}the file is neither a tessel nor a MindSpore JSON strategy",
                key,
            )
    raise StrategyError(
        src,
        None,
        f"is neither a tessel strategy (format {FORMAT_NAME!r}) nor a MindSpore JSON strategy "
        "(parallel_layout_item)",
    )


def load_strategy(path: str | os.PathLike | Strategy | None) -> Strategy | None:
    """Read a strategy file: tessel JSON, MindSpore JSON, or MindSpore protobuf (.ckpt / other).
    A `Strategy` object is checked as a file's records are (`check_strategy`)."""
    if path is None:
        return None
    if isinstance(path, Strategy):
        return check_strategy(path)
    src = str(path)
    if "\0" in src:
        raise StrategyError(repr(src), None, "a path cannot contain a NUL byte")
    p = Path(path)
    try:
        raw = p.read_bytes() if p.is_file() else None
    except OSError as e:  # a name too long, a file that cannot be read
        raise StrategyError(src, None, f"cannot read the strategy file: {e.strerror}") from None
    if raw is None:
        raise StrategyError(src, None, "strategy file does not exist")
    if not raw:
        raise StrategyError(src, None, "strategy file is empty")
    if p.suffix == ".json" or raw.lstrip()[:1] == b"{":
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as e:  # also too-long integers, too-deep nesting
            raise StrategyError(
                src, None, f"is not valid JSON: {e or 'nested too deeply'}"
            ) from None
        st = _strategy_from_json(data, src)
    else:
        from tessel.checkpoint.mindspore_proto import strategy_from_protobuf

        st = strategy_from_protobuf(raw, src)
    if not st.params:
        raise StrategyError(src, None, "has no sliced parameter")
    check_ranks(st)
    return st


# ---------------------------------------------------------------------------------------------
# writing


def write_strategy(strategy: Strategy, path: str | os.PathLike) -> None:
    """Write a strategy as tessel JSON, atomically: to a temporary name beside `path`, synced,
    then renamed over it; a failure leaves `path` as it was and no temporary behind."""
    text = json.dumps(strategy.to_json(), indent=1)
    try:
        with replace_atomically(path) as tmp:
            tmp.write_text(text)
    except OSError as e:
        raise StrategyError(
            str(path), None, f"cannot write the strategy file: {e.strerror or e}"
        ) from None


def param_from_layout(
    name: str,
    layout: Layout,
    shape: Sequence[int] | None,
    dtype: torch.dtype | str | None,
    stages: int | Sequence[int] = 0,
    opt_shard_size: int = 0,
    opt_shard_step: int = 0,
    src: str = "save_strategy_file",
) -> ParamLayout:
    """The strategy record of one parameter sharded by a Layout (called with a tensor map)."""
    if not isinstance(layout, Layout):
        raise StrategyError(src, name, f"layout is {type(layout).__name__}; expected a Layout")
    if layout.interleaved_parallel:
        raise StrategyError(
            src, name, "'interleaved_parallel' layouts describe compute, not stored slices"
        )
    axes = layout.tensor_axes()
    default_ranks = layout.rank_list == list(range(len(layout.rank_list)))
    p = ParamLayout(
        dev_matrix=tuple(layout.device_matrix),
        tensor_map=axes,
        shape=tuple(int(s) for s in shape) if shape is not None else None,
        dtype=checked_dtype_name(dtype) if dtype is not None else None,
        stages=(stages,) if isinstance(stages, int) else tuple(stages),
        opt_shard_size=opt_shard_size,
        opt_shard_step=opt_shard_step,
        rank_list=None if default_ranks else tuple(layout.rank_list),
        alias_name=tuple(layout.alias_name),
    )
    return check_param(name, p, src)


def save_strategy_file(
    path: str | os.PathLike,
    params: Mapping[str, tuple],
    world_size: int | None = None,
) -> Strategy:
    """Write a tessel strategy file from ``{name: (layout, shape, dtype[, options])}``.

    ``options`` is an optional dict with ``stage`` (int or list), ``opt_shard_size`` and
    ``opt_shard_step``. Returns the Strategy written.
    """
    src = str(path)
    out: dict[str, ParamLayout] = {}
    for name, spec in params.items():
        if isinstance(spec, ParamLayout):
            out[name] = check_param(name, spec, src)
            continue
        if not isinstance(spec, tuple) or len(spec) not in (3, 4):
            raise StrategyError(
                src, name, "expected (layout, shape, dtype) or (layout, shape, dtype, options)"
            )
        layout, shape, dtype = spec[:3]
        opts = dict(spec[3]) if len(spec) == 4 else {}
        unknown = set(opts) - {"stage", "stages", "opt_shard_size", "opt_shard_step"}
        if unknown:
            raise StrategyError(
                src,
                name,
                f"unknown options {sorted(unknown)}; allowed: stage, opt_shard_size, "
                "opt_shard_step",
            )
        out[name] = param_from_layout(
            name,
            layout,
            shape,
            dtype,
            opts.get("stage", opts.get("stages", 0)),
            int(opts.get("opt_shard_size", 0)),
            int(opts.get("opt_shard_step", 0)),
            src,
        )
    st = Strategy(out, src, {"world_size": world_size} if world_size else {})
    if out:
        st.stage_device_num  # noqa: B018 - validates consistency
    from tessel.checkpoint.boxes import check_tiling

    for name, p in out.items():
        if p.shape is not None:
            check_tiling(name, p, src)
    write_strategy(st, path)
    return st
