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
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from tessel.atomic import replace_atomically
from tessel.checkpoint.errors import LayoutError, StrategyError
from tessel.checkpoint.layout import Layout
from tessel.config.fields import (
    MAX_ID,
    Fields,
    describe,
    int_value,
    key_text,
    str_value,
    suggest,
)
from tessel.package.safetensors_io import ST_DTYPES, TORCH_TO_ST

FORMAT_NAME = "tessel-strategy"

NAME_TO_TORCH = {str(v).removeprefix("torch."): v for v in ST_DTYPES.values()}


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical dtype name ("float32"); accepts torch dtypes, names and safetensors codes."""
    if isinstance(dtype, torch.dtype):
        if dtype not in TORCH_TO_ST:
            raise StrategyError(None, "dtype", f"{dtype} is not supported")
        return str(dtype).removeprefix("torch.")
    s = str(dtype).removeprefix("torch.")
    if s in NAME_TO_TORCH:
        return s
    if s.upper() in ST_DTYPES:
        return str(ST_DTYPES[s.upper()]).removeprefix("torch.")
    raise StrategyError(None, "dtype", f"{dtype!r} is unknown; allowed: {sorted(NAME_TO_TORCH)}")


@dataclass(frozen=True)
class ParamLayout:
    """How one parameter is sharded: the strategy-file record for it."""

    dev_matrix: tuple[int, ...]
    tensor_map: tuple[tuple[int, ...], ...]
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    stages: tuple[int, ...] = (0,)
    opt_shard_size: int = 0
    opt_shard_step: int = 0
    rank_list: tuple[int, ...] | None = None
    alias_name: tuple[str, ...] | None = None

    @property
    def device_num(self) -> int:
        return math.prod(self.dev_matrix)

    def splits(self) -> tuple[int, ...]:
        """How many pieces each tensor dim is cut into by the device axes (no optimizer shard)."""
        n = len(self.dev_matrix)
        return tuple(
            math.prod(self.dev_matrix[n - 1 - a] for a in axes) for axes in self.tensor_map
        )

    def repeat(self) -> int:
        """Number of ranks holding each model-parallel slice (the data-parallel replica count)."""
        return self.device_num // math.prod(self.splits()) if self.tensor_map else self.device_num

    def used_axes(self) -> set[int]:
        return {a for axes in self.tensor_map for a in axes}

    def to_layout(self) -> Layout:
        from tessel.checkpoint.layout import layout_from_tensor_map

        return layout_from_tensor_map(
            self.dev_matrix, self.tensor_map, self.alias_name, self.rank_list
        )

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "shape": list(self.shape) if self.shape is not None else None,
            "dtype": self.dtype,
            "dev_matrix": list(self.dev_matrix),
            "tensor_map": [list(a) for a in self.tensor_map],
            "stages": list(self.stages),
            "opt_shard_size": self.opt_shard_size,
            "opt_shard_step": self.opt_shard_step,
        }
        if self.rank_list is not None:
            d["rank_list"] = list(self.rank_list)
        if self.alias_name is not None:
            d["alias_name"] = list(self.alias_name)
        return d


@dataclass
class Strategy:
    """All parameter layouts of one model, plus where they came from (for error messages)."""

    params: dict[str, ParamLayout]
    source: str = "<strategy>"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def stage_device_num(self) -> int:
        nums = {p.device_num for p in self.params.values() if p.rank_list is None}
        if len(nums) > 1:
            raise StrategyError(
                self.source,
                "dev_matrix",
                f"parameters disagree on the per-stage device count: {sorted(nums)}",
            )
        if nums:
            return nums.pop()
        return max((p.device_num for p in self.params.values()), default=1)

    def holders(self, name: str) -> dict[int, int]:
        """Global rank -> flat device index, for every rank holding parameter ``name``."""
        p = self.params[name]
        if p.rank_list is not None:
            return {r: i for i, r in enumerate(p.rank_list)}
        n = self.stage_device_num
        return {s * n + i: i for s in p.stages for i in range(p.device_num)}

    @property
    def world_size(self) -> int:
        if "world_size" in self.extra:
            return int(self.extra["world_size"])
        top = 0
        n = self.stage_device_num if self.params else 1
        for p in self.params.values():
            if p.rank_list is not None:
                top = max(top, max(p.rank_list) + 1)
            else:
                top = max(top, (max(p.stages) + 1) * n)
        return max(top, 1)

    @property
    def num_stages(self) -> int:
        return max((max(p.stages) for p in self.params.values()), default=0) + 1

    def params_of_rank(self, rank: int) -> list[str]:
        return [n for n in self.params if rank in self.holders(n)]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT_NAME, "version": 1}
        if self.params:
            out["stage_device_num"] = self.stage_device_num
        out.update({k: v for k, v in self.extra.items() if k == "world_size"})
        out["params"] = {n: p.to_json() for n, p in self.params.items()}
        return out


# ---------------------------------------------------------------------------------------------
# validation


def _splits(dev_matrix: tuple[int, ...], tensor_map: tuple[tuple[int, ...], ...]) -> list[int]:
    n = len(dev_matrix)
    return [math.prod(dev_matrix[n - 1 - a] for a in axes if 0 <= a < n) for axes in tensor_map]


def check_param(name: str, p: ParamLayout, src: str, key: str | None = None) -> ParamLayout:
    """Validate one layout and resolve opt_shard_size -1 / a missing step; returns the result.

    `key` is the record's key path in the file (default `params.<name>`). Ids and sizes are
    bounded by MAX_ID: MindSpore stores them as 32-bit ints.
    """
    str_value(name, lambda m: StrategyError(src, "params", f"a parameter name: {m}"))
    key = key or f"params.{key_text(name)}"
    if not p.dev_matrix or any(d <= 0 for d in p.dev_matrix):
        raise StrategyError(src, key, f"dev_matrix {list(p.dev_matrix)} must be positive ints")
    if math.prod(p.dev_matrix) > MAX_ID:
        raise StrategyError(
            src, f"{key}.dev_matrix", f"{list(p.dev_matrix)} makes more than {MAX_ID} devices"
        )
    n = len(p.dev_matrix)
    seen: set[int] = set()
    for d, axes in enumerate(p.tensor_map):
        for a in axes:
            if not 0 <= a < n:
                raise StrategyError(
                    src,
                    f"{key}.tensor_map[{d}]",
                    f"axis {a} is outside 0..{n - 1} for dev_matrix {list(p.dev_matrix)}",
                )
            if a in seen:
                raise StrategyError(src, f"{key}.tensor_map", f"uses device axis {a} twice")
            seen.add(a)
    if p.shape is not None:
        if len(p.shape) != len(p.tensor_map):
            raise StrategyError(
                src,
                f"{key}.tensor_map",
                f"has {len(p.tensor_map)} entries for a {len(p.shape)}-dim shape {list(p.shape)}",
            )
        if any(s < 0 for s in p.shape):
            raise StrategyError(src, f"{key}.shape", f"{list(p.shape)} has a negative size")
    if not p.stages or any(not 0 <= s <= MAX_ID for s in p.stages):
        raise StrategyError(src, f"{key}.stages", f"{list(p.stages)}: need stage ids 0..{MAX_ID}")
    if len(set(p.stages)) != len(p.stages):
        raise StrategyError(src, f"{key}.stages", f"{list(p.stages)} lists a stage twice")
    if p.rank_list is not None:
        if len(p.rank_list) != p.device_num:
            raise StrategyError(
                src,
                f"{key}.rank_list",
                f"has {len(p.rank_list)} ranks for {p.device_num} devices",
            )
        if any(not 0 <= r <= MAX_ID for r in p.rank_list) or len(set(p.rank_list)) != len(
            p.rank_list
        ):
            raise StrategyError(
                src,
                f"{key}.rank_list",
                f"needs distinct ranks in 0..{MAX_ID}, found a repeat or a rank out of range",
            )
    if not -1 <= p.opt_shard_size <= p.device_num:
        raise StrategyError(
            src,
            f"{key}.opt_shard_size",
            f"is {p.opt_shard_size}; allowed: -1, 0 or 1..{p.device_num} (the device count)",
        )
    if not 0 <= p.opt_shard_step <= p.device_num:
        raise StrategyError(
            src,
            f"{key}.opt_shard_step",
            f"is {p.opt_shard_step}; allowed: 0 (derive it) or 1..{p.device_num}",
        )
    size, step = p.opt_shard_size, p.opt_shard_step
    if size == -1:
        size = p.repeat()
    if size < 0:
        raise StrategyError(src, f"{key}.opt_shard_size", f"is {size}; allowed: -1, 0 or > 0")
    if size == 1:
        size = 0
    if size > 0:
        if not p.tensor_map:
            raise StrategyError(src, f"{key}.opt_shard_size", "a scalar cannot be sharded")
        if p.shape is not None and (p.shape[0] // p.splits()[0]) % size:
            raise StrategyError(
                src,
                f"{key}.opt_shard_size",
                f"is {size} but the dim 0 slice has {p.shape[0] // p.splits()[0]} rows; "
                "it must divide that",
            )
        if p.repeat() % size:
            raise StrategyError(
                src,
                f"{key}.opt_shard_size",
                f"is {size} but each slice has {p.repeat()} replicas; it must divide that",
            )
        if step <= 0:
            unused = [i for i in range(n) if (n - 1 - i) not in p.used_axes()]
            inner = max(unused) if unused else n - 1
            step = math.prod(p.dev_matrix[inner + 1 :])
    else:
        step = 0
    return replace(p, opt_shard_size=size, opt_shard_step=step)


# ---------------------------------------------------------------------------------------------
# reading


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
                dtype = dtype_name(dtype)
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


_STAGE_PREFIX = re.compile(r"([0-9]+)-(.+)", re.S)


def merge_stage_prefixed(
    items: Sequence[tuple[str, ParamLayout]], src: str, prefixed: bool
) -> dict[str, ParamLayout]:
    """Collect layouts, stripping MindSpore's ``"{stage}-"`` name prefix into the stage list."""
    out: dict[str, ParamLayout] = {}
    for name, p in items:
        m = _STAGE_PREFIX.fullmatch(name) if prefixed else None
        if m:
            if len(m.group(1)) > 10 or int(m.group(1)) > MAX_ID:
                raise StrategyError(
                    src, f"params.{key_text(name)}", f"stage prefix is above {MAX_ID}"
                )
            stage, name = int(m.group(1)), m.group(2)
            p = replace(p, stages=(stage,))
        if name in out:
            q = out[name]
            if (q.dev_matrix, q.tensor_map) != (p.dev_matrix, p.tensor_map):
                raise StrategyError(
                    src, f"params.{key_text(name)}", "is listed twice with different layouts"
                )
            p = replace(q, stages=tuple(sorted(set(q.stages) | set(p.stages))))
        out[name] = p
    return out


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
    """Read a strategy file: tessel JSON, MindSpore JSON, or MindSpore protobuf (.ckpt / other)."""
    if path is None or isinstance(path, Strategy):
        return path
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
    st.stage_device_num  # noqa: B018 - validates consistency
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
        dtype=dtype_name(dtype) if dtype is not None else None,
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
