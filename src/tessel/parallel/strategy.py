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

from tessel.package.safetensors_io import ST_DTYPES, TORCH_TO_ST
from tessel.parallel.errors import StrategyError
from tessel.parallel.layout import Layout

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
        from tessel.parallel.layout import layout_from_tensor_map

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


def _int_list(value: Any, src: str, key: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    ):
        raise StrategyError(src, key, f"is {value!r}; expected a list of ints")
    return tuple(value)


def check_param(name: str, p: ParamLayout, src: str) -> ParamLayout:
    """Validate one layout and resolve opt_shard_size -1 / a missing step; returns the result."""
    key = f"params.{name}"
    if not p.dev_matrix or any(d <= 0 for d in p.dev_matrix):
        raise StrategyError(src, key, f"dev_matrix {list(p.dev_matrix)} must be positive ints")
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
    if any(s < 0 for s in p.stages) or not p.stages:
        raise StrategyError(src, f"{key}.stages", f"{list(p.stages)}: need stage ids >= 0")
    if p.rank_list is not None and len(p.rank_list) != p.device_num:
        raise StrategyError(
            src,
            f"{key}.rank_list",
            f"has {len(p.rank_list)} ranks for {p.device_num} devices",
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


def _param_from_json(name: str, d: Mapping[str, Any], src: str) -> ParamLayout:
    key = f"params.{name}"
    if not isinstance(d, Mapping):
        raise StrategyError(src, key, f"is {type(d).__name__}; expected an object")
    for k in ("dev_matrix", "tensor_map"):
        if k not in d:
            raise StrategyError(src, key, f"has no {k!r}")
    dev = _int_list(d["dev_matrix"], src, f"{key}.dev_matrix")
    tm_raw = d["tensor_map"]
    if not isinstance(tm_raw, list):
        raise StrategyError(src, f"{key}.tensor_map", f"is {tm_raw!r}; expected a list")
    tm: list[tuple[int, ...]] = []
    for i, e in enumerate(tm_raw):
        if isinstance(e, int) and not isinstance(e, bool):
            tm.append(() if e == -1 else (e,))
        else:
            axes = _int_list(e, src, f"{key}.tensor_map[{i}]")
            tm.append(tuple(a for a in axes if a != -1))
    shape = d.get("shape", d.get("tensor_shape"))
    shape = _int_list(shape, src, f"{key}.shape") if shape is not None else None
    dtype = d.get("dtype")
    if dtype is not None:
        try:
            dtype = dtype_name(dtype)
        except StrategyError as e:
            raise StrategyError(src, f"{key}.dtype", e.detail) from None
    stages = d.get("stages", d.get("stage", [0]))
    if isinstance(stages, int):
        stages = [stages]
    stages = _int_list(stages, src, f"{key}.stages")
    rl = d.get("rank_list")
    alias = d.get("alias_name")
    p = ParamLayout(
        dev_matrix=dev,
        tensor_map=tuple(tm),
        shape=shape,
        dtype=dtype,
        stages=stages,
        opt_shard_size=int(d.get("opt_shard_size", d.get("opt_weight_shard_size", 0)) or 0),
        opt_shard_step=int(d.get("opt_shard_step", d.get("opt_weight_shard_step", 0)) or 0),
        rank_list=_int_list(rl, src, f"{key}.rank_list") if rl is not None else None,
        alias_name=tuple(alias) if alias is not None else None,
    )
    return check_param(name, p, src)


_STAGE_PREFIX = re.compile(r"^(\d+)-(.+)$")


def merge_stage_prefixed(
    items: Sequence[tuple[str, ParamLayout]], src: str, prefixed: bool
) -> dict[str, ParamLayout]:
    """Collect layouts, stripping MindSpore's ``"{stage}-"`` name prefix into the stage list."""
    out: dict[str, ParamLayout] = {}
    for name, p in items:
        m = _STAGE_PREFIX.match(name) if prefixed else None
        if m:
            stage, name = int(m.group(1)), m.group(2)
            p = replace(p, stages=(stage,))
        if name in out:
            q = out[name]
            if (q.dev_matrix, q.tensor_map) != (p.dev_matrix, p.tensor_map):
                raise StrategyError(src, f"params.{name}", "is listed twice with different layouts")
            p = replace(q, stages=tuple(sorted(set(q.stages) | set(p.stages))))
        out[name] = p
    return out


def _strategy_from_json(data: Any, src: str) -> Strategy:
    if not isinstance(data, dict):
        raise StrategyError(src, None, "is not a JSON object")
    if data.get("format") == FORMAT_NAME:
        params = data.get("params")
        if not isinstance(params, dict):
            raise StrategyError(src, "params", "is missing or not an object")
        out = {n: _param_from_json(n, d, src) for n, d in params.items()}
        extra = {k: data[k] for k in ("world_size",) if k in data}
        st = Strategy(out, src, extra)
        if "stage_device_num" in data and out:
            got = st.stage_device_num
            if got != data["stage_device_num"]:
                raise StrategyError(
                    src,
                    "stage_device_num",
                    f"is {data['stage_device_num']} but the dev matrices give {got}",
                )
        return st
    if "parallel_layout_item" in data:  # MindSpore's JSON strategy
        items = data["parallel_layout_item"]
        if not isinstance(items, dict):
            raise StrategyError(src, "parallel_layout_item", "is not an object")
        stage = 0
        ops = data.get("parallel_strategy_item")
        if isinstance(ops, dict) and ops:
            first = next(iter(ops.values()))
            if isinstance(first, dict):
                stage = int(first.get("stage", 0))
        pairs = []
        for n, d in items.items():
            p = _param_from_json(n, d, src)
            pairs.append((n, replace(p, stages=(stage,))))
        return Strategy(merge_stage_prefixed(pairs, src, prefixed=True), src)
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
    p = Path(path)
    if not p.is_file():
        raise StrategyError(src, None, "strategy file does not exist")
    raw = p.read_bytes()
    if not raw:
        raise StrategyError(src, None, "strategy file is empty")
    if p.suffix == ".json" or raw.lstrip()[:1] == b"{":
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise StrategyError(src, None, f"is not valid JSON: {e}") from None
        st = _strategy_from_json(data, src)
    else:
        from tessel.parallel.mindspore_proto import strategy_from_protobuf

        st = strategy_from_protobuf(raw, src)
    if not st.params:
        raise StrategyError(src, None, "has no sliced parameter")
    st.stage_device_num  # noqa: B018 - validates consistency
    return st


# ---------------------------------------------------------------------------------------------
# writing


def write_strategy(strategy: Strategy, path: str | os.PathLike) -> None:
    """Write a strategy as tessel JSON, atomically (temporary name, then rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(strategy.to_json(), indent=1))
    os.replace(tmp, path)


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
    from tessel.parallel.boxes import check_tiling

    for name, p in out.items():
        if p.shape is not None:
            check_tiling(name, p, src)
    write_strategy(st, path)
    return st
