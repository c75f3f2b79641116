"""A strategy's records in memory: `ParamLayout` (how one parameter is sharded) and `Strategy`
(all of a model's), with the checks every record passes. strategy.py reads and writes them as
files; boxes.py and mindspore_proto.py work on them."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from tessel.checkpoint.errors import StrategyError
from tessel.checkpoint.layout import Layout
from tessel.config.fields import MAX_ID, key_text, str_value
from tessel.dtypes import dtype_name
from tessel.package.safetensors_io import ST_DTYPES, TORCH_TO_ST

FORMAT_NAME = "tessel-strategy"

NAME_TO_TORCH = {dtype_name(v): v for v in ST_DTYPES.values()}


def checked_dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical dtype name ("float32") of a dtype a checkpoint can hold; accepts torch dtypes,
    names and safetensors codes, and refuses any other with a StrategyError."""
    if isinstance(dtype, torch.dtype):
        if dtype not in TORCH_TO_ST:
            raise StrategyError(None, "dtype", f"{dtype} is not supported")
        return dtype_name(dtype)
    s = str(dtype).removeprefix("torch.")
    if s in NAME_TO_TORCH:
        return s
    if s.upper() in ST_DTYPES:
        return dtype_name(ST_DTYPES[s.upper()])
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


def check_param(name: str, p: ParamLayout, src: str, key: str | None = None) -> ParamLayout:
    """Validate one layout and resolve its optimizer shard; returns the result: size -1 read as
    MindSpore means it (the parameter's whole data-parallel group, see `_whole_group`), size 1
    as none, and a step of 0 as the stride of the fastest data-parallel axis.

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
    # the data-parallel axes (dev_matrix indices): those the tensor map leaves unused, of size
    # above 1 (an axis of size 1 holds no replica); the last of them varies fastest
    dp_axes = [i for i in range(n) if (n - 1 - i) not in p.used_axes() and p.dev_matrix[i] > 1]
    if size == -1 and p.repeat() > 1:
        size, step = _whole_group(p, dp_axes, step, src, key)
    elif size == -1:
        size = 0  # the data-parallel group is the rank alone: nothing to shard
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
        if step <= 0:  # the group's ranks lie the fastest data-parallel axis's stride apart
            inner = max(dp_axes) if dp_axes else n - 1
            step = math.prod(p.dev_matrix[inner + 1 :])
    else:
        step = 0
    return replace(p, opt_shard_size=size, opt_shard_step=step)


def _whole_group(
    p: ParamLayout, dp_axes: list[int], step: int, src: str, key: str
) -> tuple[int, int]:
    """`opt_shard_size: -1` as MindSpore means it: the optimizer shard spans the parameter's
    whole data-parallel group (every rank holding its model-parallel slice, `repeat()` of them),
    a rank's shard being its place in that group. Those ranks lie one stride apart (the
    `opt_shard_step`) when no model-parallel axis of size above 1 lies between two data-parallel
    ones; returns (size, step). A step given that is not that stride contradicts -1, and a group
    that no stride walks has no step: both are refused by name."""
    n = len(p.dev_matrix)
    first, last = min(dp_axes), max(dp_axes)
    between = [i for i in range(first, last) if i not in dp_axes and p.dev_matrix[i] > 1]
    if between:
        raise StrategyError(
            src,
            f"{key}.opt_shard_size",
            f"is -1 (the whole data-parallel group), but the data-parallel device axes "
            f"{[n - 1 - i for i in dp_axes]} of dev_matrix {list(p.dev_matrix)} lie apart "
            f"(axis {n - 1 - between[0]} between them shards the tensor), so no "
            "opt_shard_step walks that group; give a size and step that walk one of those axes",
        )
    stride = math.prod(p.dev_matrix[last + 1 :])
    if step not in (0, stride):
        raise StrategyError(
            src,
            f"{key}.opt_shard_step",
            f"is {step}, but opt_shard_size -1 shards over the whole data-parallel group, "
            f"whose {p.repeat()} ranks lie {stride} apart; allowed: 0 (derive it) or {stride}",
        )
    return p.repeat(), stride


def check_strategy(strategy: Strategy) -> Strategy:
    """`strategy` with every record checked and resolved (`check_param`: `opt_shard_size: -1`,
    a missing step), as a file's are when read: one built in memory (the `Strategy` and
    `ParamLayout` classes are public) reaches the converters through here too. Its stages must
    agree on the per-stage device count, and every global rank it places lie in 0..MAX_ID."""
    params = {name: check_param(name, p, strategy.source) for name, p in strategy.params.items()}
    checked = Strategy(params, strategy.source, dict(strategy.extra))
    check_ranks(checked)
    return checked


def check_ranks(strategy: Strategy) -> None:
    """Every global rank a strategy places (`stage * stage_device_num + index`, or its rank
    list's) lies in 0..MAX_ID, as MindSpore's 32-bit rank ids do; the per-stage device counts
    agree (see `Strategy.stage_device_num`)."""
    n = strategy.stage_device_num
    for name, p in strategy.params.items():
        if p.rank_list is None and (max(p.stages) + 1) * n - 1 > MAX_ID:
            raise StrategyError(
                strategy.source,
                f"params.{key_text(name)}.stages",
                f"stage {max(p.stages)} of {n} devices per stage places ranks above {MAX_ID}",
            )


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
