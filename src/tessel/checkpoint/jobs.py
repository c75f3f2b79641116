"""Planning a checkpoint's conversion: the source a directory holds, the destination
strategy resolved against it, and one file job per destination rank (`tessel.checkpoint.convert`
runs them). `tessel.parallel`'s API and the runtime's resume from a checkpoint both use it."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from tessel.checkpoint.boxes import Box, device_box
from tessel.checkpoint.errors import CheckpointError, StrategyError
from tessel.checkpoint.fill import FileJob, plan_file
from tessel.checkpoint.identity import STRATEGY_KEY, strategy_digest
from tessel.checkpoint.sources import (
    DCPSource,
    FullSource,
    RankSource,
    Source,
    find_rank_files,
    is_dcp_dir,
)
from tessel.checkpoint.st_io import read_header
from tessel.checkpoint.strategy import ParamLayout, Strategy, load_strategy

StrategyArg = str | os.PathLike | Strategy | None


def full_strategy_from_file(path: str) -> Strategy:
    """A strategy for one unsharded checkpoint file: every tensor whole on rank 0."""
    hdr = read_header(path)[0]
    params = {
        n: ParamLayout((1,), tuple(() for _ in loc.shape), loc.shape, loc.dtype)
        for n, loc in hdr.items()
    }
    return Strategy(params, f"{path} (unsharded)")


STRATEGY_FILE = "strategy.json"  # a checkpoint's own strategy, as save_checkpoint writes it


def open_source(
    src_dir: str | os.PathLike,
    src_strategy_file: StrategyArg,
    need_strategy: bool = True,
    strategy_arg: str = "src_strategy_file",
) -> Source:
    """The checkpoint in `src_dir`: a DCP directory, `rank_{r}/*.safetensors` files laid out by
    `src_strategy_file` (by default the directory's own `strategy.json`), or full tensors.
    `strategy_arg` is how errors name the strategy argument (a CLI flag, say)."""
    if is_dcp_dir(src_dir):
        return DCPSource(src_dir)
    files = find_rank_files(src_dir)
    if src_strategy_file is None and files and (Path(src_dir) / STRATEGY_FILE).is_file():
        src_strategy_file = Path(src_dir) / STRATEGY_FILE
    strategy = load_strategy(src_strategy_file)
    if strategy is None:
        if files and need_strategy:
            if len(files) == 1 and 0 in files:
                return RankSource(full_strategy_from_file(files[0]), files)
            raise StrategyError(
                str(src_dir),
                strategy_arg,
                f"is needed: the directory holds {len(files)} rank files and no "
                f"{STRATEGY_FILE} (only a DCP directory or a single unsharded rank_0 file "
                "needs no strategy)",
            )
        return FullSource(src_dir)
    if not files:
        raise CheckpointError(
            str(src_dir), None, "holds no rank_{r}/*.safetensors files and no DCP .metadata"
        )
    return RankSource(strategy, files)


def resolve_dst(dst: Strategy, source: Source) -> Strategy:
    """Fill unknown shapes/dtypes of the destination from the source; check the known ones."""
    names = set(source.names())
    out = {}
    for name, p in dst.params.items():
        if name not in names:
            raise CheckpointError(
                source.label,
                name,
                f"is in the destination strategy ({dst.source}) but not in the source checkpoint",
            )
        shape, dtype = source.info(name)
        if p.shape is not None and tuple(p.shape) != tuple(shape):
            raise StrategyError(
                dst.source,
                f"params.{name}.shape",
                f"is {list(p.shape)} but the source checkpoint has {list(shape)}",
            )
        if p.dtype is not None and p.dtype != dtype:
            raise StrategyError(
                dst.source,
                f"params.{name}.dtype",
                f"is {p.dtype} but the source checkpoint has {dtype}",
            )
        from dataclasses import replace

        from tessel.checkpoint.boxes import check_tiling

        q = replace(p, shape=tuple(shape), dtype=dtype)
        check_tiling(name, q, dst.source)
        out[name] = q
    return Strategy(out, dst.source, dict(dst.extra))


def rank_entries(dst: Strategy, rank: int) -> list[tuple[str, Box]]:
    out = []
    for name in dst.params_of_rank(rank):
        p = dst.params[name]
        out.append((name, device_box(p, dst.holders(name)[rank], p.shape)))
    return out


def full_dst(source: Source) -> Strategy:
    params = {}
    for n in source.names():
        shape, dt = source.info(n)
        params[n] = ParamLayout((1,), tuple(() for _ in shape), shape, dt)
    return Strategy(params, "<unsharded destination>")


def strategy_file(strategy: Strategy) -> dict[str, bytes]:
    """The ``strategy.json`` written beside the rank directories of a converted or sharded
    checkpoint (its destination strategy, shapes and dtypes filled in), so the checkpoint says
    its own layout as `Session.save_checkpoint`'s does: ``{name: bytes}``."""
    return {STRATEGY_FILE: json.dumps(strategy.to_json(), indent=1).encode()}


def rank_jobs(
    source: Source, dst: Strategy, prefix: str, ranks: Sequence[int] | None = None
) -> list[FileJob]:
    """One file job per rank of ``dst`` holding a tensor: ``rank_{r}/{prefix}{r}.safetensors``,
    recording its rank and its strategy's digest (the checkpoint's id is added when written)."""
    jobs = []
    digest = strategy_digest(dst)
    allowed = None
    if isinstance(source, RankSource):
        allowed = set(source.files)
    for r in ranks if ranks is not None else range(dst.world_size):
        entries = rank_entries(dst, r)
        if not entries:
            continue
        prefer = r if isinstance(source, RankSource) else None
        jobs.append(
            plan_file(
                source,
                entries,
                f"rank_{r}/{prefix}{r}.safetensors",
                prefer=prefer,
                allowed=allowed,
                metadata={"format": "pt", "tessel_rank": str(r), STRATEGY_KEY: digest},
            )
        )
    return jobs


def plan_convert(
    src_dir: str | os.PathLike,
    src_strategy_file: StrategyArg,
    dst_strategy_file: StrategyArg,
    dst_prefix: str = "checkpoint_",
    strategy_arg: str = "src_strategy_file",
) -> tuple[list[FileJob], Source, dict[str, bytes]]:
    """What convert_checkpoints writes: the rank files' jobs, the source they read and the
    files beside them (``strategy_file``)."""
    source = open_source(src_dir, src_strategy_file, strategy_arg=strategy_arg)
    dst = load_strategy(dst_strategy_file)
    dst = resolve_dst(dst, source) if dst is not None else full_dst(source)
    return rank_jobs(source, dst, dst_prefix), source, strategy_file(dst)
