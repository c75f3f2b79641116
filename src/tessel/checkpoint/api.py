"""The mindspore.parallel checkpoint API (`convert_checkpoints`, `unified_safetensors`, ...; the
parameter names of tessel's API first, MindSpore's names as keyword-only aliases) on top of
sources, plans and jobs."""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessel.arguments import (
    file_prefix,
    flag,
    integer,
    optional_callable,
    prefixes,
)
from tessel.checkpoint.boxes import Box, device_box
from tessel.checkpoint.convert import check_destination, execute, execute_file, shape_bytes
from tessel.checkpoint.errors import CheckpointError, StrategyError
from tessel.checkpoint.fill import FileJob, needed_holders, plan_file
from tessel.checkpoint.identity import (
    ID_KEY,
    STRATEGY_KEY,
    common_id,
    derived_id,
    new_checkpoint_id,
    strategy_digest,
)
from tessel.checkpoint.jobs import (
    StrategyArg,
    full_dst,
    full_strategy_from_file,
    open_source,
    plan_convert,
    rank_entries,
    rank_jobs,
    resolve_dst,
    strategy_file,
)
from tessel.checkpoint.sources import (
    DCPSource,
    FullSource,
    RankSource,
    Source,
    is_dcp_dir,
)
from tessel.checkpoint.st_io import read_header
from tessel.checkpoint.strategy import (
    ParamLayout,
    Strategy,
    load_strategy,
    merge_stage_prefixed,
    write_strategy,
)
from tessel.dtypes import torch_dtype

Progress = Callable[[int], None] | None


# ---------------------------------------------------------------------------------------------
# helpers


def _pick(
    func: str, name: str, value: Any, alias: str, alias_value: Any, default: Any = None
) -> Any:
    """One argument given by its name or by its MindSpore alias (keyword-only), not both."""
    if value is not None and alias_value is not None:
        raise TypeError(
            f"{func}() got both {name!r} and its MindSpore alias {alias!r}; give only one"
        )
    got = value if value is not None else alias_value
    return default if got is None else got


def _pick_required(func: str, name: str, value: Any, alias: str, alias_value: Any) -> Any:
    """Like ``_pick`` for an argument without a default: one of the two names must be given."""
    got = _pick(func, name, value, alias, alias_value)
    if got is None:
        raise TypeError(f"{func}() missing required argument {name!r} (or its alias {alias!r})")
    return got


def _check_format(output_format: str) -> None:
    if output_format != "safetensors":
        raise CheckpointError(
            None,
            "output_format",
            f"is {output_format!r}; tessel writes only 'safetensors' (no pickle formats)",
        )


# ---------------------------------------------------------------------------------------------
# the API


def rank_list_for_convert(
    rank_id: int, src_strategy_file: StrategyArg = None, dst_strategy_file: StrategyArg = None
) -> list[int]:
    """Source ranks whose files are needed to build destination rank ``rank_id`` (descending).

    Exactly the ranks read: if a slice has replicas, one is chosen so the set is irredundant
    (the destination rank itself is preferred). No checkpoint files are read.

    Args:
        rank_id: The destination rank.
        src_strategy_file: The source's strategy; None means an unsharded source, so the
            answer is ``[0]``.
        dst_strategy_file: The destination's strategy; None means one unsharded rank.

    Returns:
        The source ranks, descending.
    """
    integer("rank_list_for_convert", "rank_id", rank_id, 0)
    src = load_strategy(src_strategy_file)
    if src is None:
        return [0]
    dst = load_strategy(dst_strategy_file)
    names = list(src.params) if dst is None else dst.params_of_rank(rank_id)
    if dst is not None:
        for n in names:
            if n not in src.params:
                raise StrategyError(
                    dst.source, f"params.{n}", f"is not in the source strategy {src.source}"
                )
    # boxes do not depend on the scale of the shape: use a small shape each layout divides
    resolved: dict[str, ParamLayout] = {}
    for n in names:
        p = src.params[n]
        q = dst.params[n] if dst is not None else None
        shape = p.shape or (q.shape if q is not None else None)
        if shape is None:
            ks = [list(p.splits())] + ([list(q.splits())] if q is not None else [])
            for k, lay in zip(ks, [p, q], strict=False):
                if k and lay is not None:
                    k[0] *= lay.opt_shard_size or 1
            shape = tuple(math.lcm(*[k[d] for k in ks]) for d in range(len(ks[0])))
        resolved[n] = shape
    from dataclasses import replace

    src_r = Strategy(
        {n: replace(src.params[n], shape=resolved[n], dtype="float32") for n in names},
        src.source,
        dict(src.extra),
    )
    source = RankSource(src_r, {})
    entries = []
    for n in names:
        if dst is None:
            entries.append((n, tuple((0, s) for s in resolved[n])))
        else:
            q = replace(dst.params[n], shape=resolved[n])
            from tessel.checkpoint.boxes import check_tiling

            check_tiling(n, q, dst.source)
            entries.append((n, device_box(q, dst.holders(n)[rank_id], q.shape)))
    return sorted(needed_holders(source, entries, prefer=rank_id), reverse=True)


def convert_checkpoint_by_rank(
    rank_id: int,
    checkpoint_files_map: Mapping[int, str | os.PathLike],
    save_file: str | os.PathLike | None = None,
    src_strategy_file: StrategyArg = None,
    dst_strategy_file: StrategyArg = None,
    *,
    save_checkpoint_file_name: str | os.PathLike | None = None,
) -> str:
    """Build destination rank ``rank_id``'s safetensors file ``save_file`` from ``{src rank: file}``.

    Only the files ``rank_list_for_convert`` names are needed. The output is written under a
    temporary name beside ``save_file``, synced and renamed over it when complete: it replaces
    that one file, whole (the ranks of one conversion write their files into one directory).
    It records the conversion it belongs to, an id every rank's call derives alike from the two
    strategies and the source checkpoint's own id, and its strategy's digest, so readers refuse
    it beside files of another conversion.

    Args:
        rank_id: The destination rank.
        checkpoint_files_map: ``{source rank: its safetensors file}``, at least the ranks
            ``rank_list_for_convert`` names.
        save_file: The destination file, ending in ``.safetensors``.
        src_strategy_file: The source's strategy; None means one unsharded file, rank 0's.
        dst_strategy_file: The destination's strategy; None means one unsharded rank.
        save_checkpoint_file_name: MindSpore's name for ``save_file`` (keyword-only).

    Returns:
        The path written.

    Raises:
        CheckpointError: A source file is missing, or ``save_file`` is no ``.safetensors``.
        StrategyError: A strategy cannot be read, or the destination rank holds nothing.
    """
    save = Path(_pick_required("convert_checkpoint_by_rank", "save_file", save_file,
                               "save_checkpoint_file_name", save_checkpoint_file_name))  # fmt: skip
    if save.suffix != ".safetensors":
        raise CheckpointError(str(save), "save_file", "must end with .safetensors")
    func = "convert_checkpoint_by_rank"
    integer(func, "rank_id", rank_id, 0)
    if not isinstance(checkpoint_files_map, Mapping):
        raise TypeError(
            f"{func}: checkpoint_files_map must map source ranks to files, found "
            f"{type(checkpoint_files_map).__name__}"
        )
    files = {
        integer(func, "checkpoint_files_map's ranks", r, 0): str(f)
        for r, f in checkpoint_files_map.items()
    }
    for r, f in files.items():
        if not Path(f).is_file():
            raise CheckpointError(f, None, f"checkpoint file of source rank {r} does not exist")
    src = load_strategy(src_strategy_file)
    if src is None:
        if set(files) != {0}:
            raise StrategyError(
                None, "src_strategy_file", "is None, so give exactly one file, for rank 0"
            )
        src = full_strategy_from_file(files[0])
    source = RankSource(src, files)
    dst = load_strategy(dst_strategy_file)
    dst = resolve_dst(dst, source) if dst is not None else full_dst(source)
    entries = (
        rank_entries(dst, rank_id)
        if dst_strategy_file is not None
        else [(n, tuple((0, s) for s in dst.params[n].shape)) for n in dst.params]
    )
    if not entries:
        raise StrategyError(dst.source, None, f"rank {rank_id} holds no parameter")
    digest = strategy_digest(dst)
    ident = derived_id("by-rank", strategy_digest(src), digest, source.checkpoint_id or "")
    meta = {"format": "pt", "tessel_rank": str(rank_id), STRATEGY_KEY: digest, ID_KEY: ident}
    job = plan_file(source, entries, save.name, prefer=rank_id, allowed=set(files), metadata=meta)
    execute_file(job, save, forbidden=list(files.values()))
    return str(save)


def convert_checkpoints(
    src_dir: str | os.PathLike | None = None,
    dst_dir: str | os.PathLike | None = None,
    dst_prefix: str | None = None,
    src_strategy_file: StrategyArg = None,
    dst_strategy_file: StrategyArg = None,
    process_num: int = 1,
    output_format: str = "safetensors",
    progress: Progress = None,
    *,
    overwrite: bool = False,
    src_checkpoints_dir: str | os.PathLike | None = None,
    dst_checkpoints_dir: str | os.PathLike | None = None,
    ckpt_prefix: str | None = None,
) -> list[str]:
    """Convert a whole distributed checkpoint to another strategy.

    Source: ``src_dir/rank_{r}/*.safetensors`` plus its strategy, or a DCP directory (no
    strategy needed). Output: ``dst_dir/rank_{r}/{dst_prefix}{r}.safetensors`` for every
    destination rank and ``dst_dir/strategy.json``, the destination strategy. ``dst_dir`` must
    be new or empty, or, with ``overwrite=True``, its checkpoint is replaced whole (files of
    other names are kept; see ``tessel.checkpoint.identity``); it may not be, lie inside or
    hold ``src_dir``.

    Args:
        src_dir: The source checkpoint's directory.
        dst_dir: The destination directory.
        dst_prefix: The destination files' name before the rank.
        src_strategy_file: The source's strategy (none for a DCP source).
        dst_strategy_file: The destination's strategy; None means one unsharded rank.
        process_num: Destination files written at once, by separate processes.
        output_format: ``"safetensors"``, the one format written.
        progress: Called once per file written.
        overwrite: Replace a checkpoint already in ``dst_dir``.
        src_checkpoints_dir: MindSpore's name for ``src_dir`` (keyword-only).
        dst_checkpoints_dir: MindSpore's name for ``dst_dir`` (keyword-only).
        ckpt_prefix: MindSpore's name for ``dst_prefix`` (keyword-only).

    Returns:
        The files written.

    Raises:
        CheckpointError: A destination that holds anything (without ``overwrite``), or that
            is, lies inside or holds the source; a source file missing or of another
            checkpoint.
        StrategyError: A strategy that cannot be read or does not fit the checkpoint.
    """
    fn = "convert_checkpoints"
    src_dir = _pick_required(fn, "src_dir", src_dir, "src_checkpoints_dir", src_checkpoints_dir)
    dst_dir = _pick_required(fn, "dst_dir", dst_dir, "dst_checkpoints_dir", dst_checkpoints_dir)
    dst_prefix = _pick_required(fn, "dst_prefix", dst_prefix, "ckpt_prefix", ckpt_prefix)
    file_prefix(fn, "dst_prefix", dst_prefix)
    integer(fn, "process_num", process_num, 1)
    flag(fn, "overwrite", overwrite)
    _check_format(output_format)
    check_destination(dst_dir, [src_dir], overwrite)
    jobs, source, files = plan_convert(src_dir, src_strategy_file, dst_strategy_file, dst_prefix)
    return execute(jobs, dst_dir, process_num, progress, source.holder_files(), files,
                   overwrite=overwrite, sources=[src_dir])  # fmt: skip


def _parse_size(size: int | str) -> int:
    """`max_shard_size`: bytes, or a number with a unit ("5GB", "512MiB")."""
    if not isinstance(size, str):
        return integer("unified_safetensors", "max_shard_size", size, 1)
    text = size.strip().upper()
    number, mul = text, 1
    for unit, factor in (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("GB", 10**9),
                         ("MB", 10**6), ("KB", 10**3), ("B", 1)):  # fmt: skip
        if text.endswith(unit):
            number, mul = text[: -len(unit)].strip(), factor
            break
    if not _SIZE.fullmatch(number) or float(number) * mul < 1:
        raise ValueError(
            f"unified_safetensors: max_shard_size must be bytes or a number with a unit such as "
            f"'5GB', found {size!r}"
        )
    return int(float(number) * mul)


_SIZE = re.compile(r"[0-9]+(?:\.[0-9]+)?", re.ASCII)


@dataclass
class Shards:
    """Full-tensor shards of one output directory: the file jobs, the index's weight map and
    the bytes of every tensor."""

    jobs: list[FileJob]
    weight_map: dict[str, str]
    total: int


@dataclass
class UnifyPlan:
    """What unifying a checkpoint writes. `model`: the shards of the output directory; `files`:
    the model's config files copied beside them; `optimizer`: the optimizer states' shards
    (written only where asked); `left_out`: the checkpoint's other tensors, which the model's
    state_dict does not take (tied copies, program constants, non-persistent buffers). A checkpoint without
    `model_state_dict.json` (`recorded` False) has every tensor in `model`."""

    source: Source
    src_dir: str
    model: Shards
    optimizer: Shards
    files: dict[str, bytes]
    left_out: list[str]
    recorded: bool


def _shards(
    source: Source, pairs: Sequence[tuple[str, str]], limit: int, prefix: str = "model"
) -> Shards:
    """`(checkpoint name, output name)` pairs cut into files of at most `limit` bytes (a
    tensor larger than that gets a file of its own)."""
    groups: list[list[tuple[str, str, Box]]] = [[]]
    size = 0
    total = 0
    for name, out_name in pairs:
        shape, dt = source.info(name)
        nb = shape_bytes(shape, dt)
        if groups[-1] and size + nb > limit:
            groups.append([])
            size = 0
        groups[-1].append((name, out_name, tuple((0, s) for s in shape)))
        size += nb
        total += nb
    if groups == [[]]:
        return Shards([], {}, 0)
    n = len(groups)
    jobs = []
    weight_map = {}
    for k, g in enumerate(groups, 1):
        fname = f"{prefix}-{k:05d}-of-{n:05d}.safetensors"
        job = plan_file(source, [(nm, box) for nm, _, box in g], fname, metadata={"format": "pt"})
        for op, (_, out_name, _) in zip(job.params, g, strict=True):
            op.name = out_name
            weight_map[out_name] = fname
        jobs.append(job)
    return Shards(jobs, weight_map, total)


OPTIMIZER_PREFIX = "optimizer."  # a tessel training checkpoint's optimizer states


def plan_unify(
    src_dir: str | os.PathLike,
    src_strategy_file: StrategyArg = None,
    max_shard_size: int | str = "5GB",
    choice_func: Callable[[str], bool | str] | None = None,
    strategy_arg: str = "src_strategy_file",
) -> UnifyPlan:
    """What unified_safetensors writes (see UnifyPlan); `strategy_arg` is how errors name the
    strategy argument. `choice_func(name)` sees each output name: False drops the tensor, a
    string renames it."""
    from tessel.checkpoint.model_files import config_files, read_state_dict

    source = open_source(src_dir, src_strategy_file, strategy_arg=strategy_arg)
    limit = _parse_size(max_shard_size)
    names = source.names()
    record = read_state_dict(src_dir, names) if isinstance(source, RankSource) else None
    if record is None:
        model_pairs = [(n, n) for n in names]
        optimizer_pairs: list[tuple[str, str]] = []
        left_out: list[str] = []
    else:
        model_pairs = [(name, key) for key, name in record.items()]
        kept = set(record.values())
        optimizer_pairs = [
            (n, n) for n in names if n not in kept and n.startswith(OPTIMIZER_PREFIX)
        ]
        left_out = [n for n in names if n not in kept and not n.startswith(OPTIMIZER_PREFIX)]

    def chosen(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
        if choice_func is None:
            return pairs
        out = []
        for name, out_name in pairs:
            c = choice_func(out_name)
            if c is False:
                continue
            out.append((name, c if isinstance(c, str) else out_name))
        return out

    model_pairs, optimizer_pairs = chosen(model_pairs), chosen(optimizer_pairs)
    counts = Counter(o for _, o in model_pairs)
    twice = sorted(o for o, c in counts.items() if c > 1)
    if twice:
        raise CheckpointError(
            source.label, twice[0], "is written twice (choice_func renames two tensors to it)"
        )
    return UnifyPlan(
        source=source,
        src_dir=str(src_dir),
        model=_shards(source, model_pairs, limit),
        optimizer=_shards(source, optimizer_pairs, limit, prefix="optimizer"),
        files=config_files(src_dir) if isinstance(source, RankSource) else {},
        left_out=left_out,
        recorded=record is not None,
    )


INDEX_NAME = "model.safetensors.index.json"
OPTIMIZER_INDEX_NAME = "optimizer.safetensors.index.json"


def unify_index(weight_map: Mapping[str, str], total: int) -> bytes:
    """The Hugging Face index file of unified shards."""
    return json.dumps({"metadata": {"total_size": total}, "weight_map": dict(weight_map)},
                      indent=2).encode()  # fmt: skip


def write_unified(
    plan: UnifyPlan,
    dst_dir: str | os.PathLike,
    optimizer_states_dir: str | os.PathLike | None = None,
    process_num: int = 1,
    progress: Progress = None,
    part: tuple[int, int] = (1, 1),
    overwrite: bool = False,
) -> list[str]:
    """Write a UnifyPlan: the model's shards, index and config files into `dst_dir`, and where
    `optimizer_states_dir` is given the optimizer states' shards and index there (first, so the
    model directory appears last). `part=(k, n)` writes the k-th of n parts of each shard list;
    part 1 writes the indexes and config files; each part keeps the others' files in place.
    Each directory must be new or empty (or hold only other parts' files), or with `overwrite`
    its checkpoint is replaced (see ``convert.check_destination``). Returns the paths written."""
    k, n = part
    forbidden = plan.source.holder_files()
    outputs = [(plan.model, dst_dir, INDEX_NAME, plan.files)]
    if optimizer_states_dir is not None:
        if not plan.recorded:
            raise CheckpointError(
                plan.source.label,
                None,
                "has no model_state_dict.json (which Session.save_checkpoint writes), so its "
                "optimizer states cannot be told from the model's weights: every tensor is "
                "written to the destination; leave out the optimizer states' directory",
            )
        if Path(os.path.abspath(optimizer_states_dir)) == Path(os.path.abspath(dst_dir)):
            raise CheckpointError(
                str(optimizer_states_dir), None, "must be another directory than the model's"
            )
        outputs.insert(0, (plan.optimizer, optimizer_states_dir, OPTIMIZER_INDEX_NAME, {}))
    # the parts of a split unification are separate calls: they derive one id from the plan,
    # and each keeps the files of the others that record it
    ident = new_checkpoint_id() if n == 1 else derived_id("unify", *_plan_words(plan))
    keeps = []
    for shards, directory, index_name, files in outputs:
        names = set(shards.weight_map.values()) | set(files) | {index_name}
        keep = _parts_kept(directory, names, ident) if n > 1 else set()
        check_destination(directory, [plan.src_dir], overwrite, keep)
        keeps.append(keep)
    out = []
    for (shards, directory, index_name, files), keep in zip(outputs, keeps, strict=True):
        jobs = [j for i, j in enumerate(shards.jobs) if i % n == k - 1]
        extra: dict[str, bytes] = {}
        if k == 1:  # published with the shards, so the index never names missing files
            extra = {**files, index_name: unify_index(shards.weight_map, shards.total)}
        out += execute(jobs, directory, process_num, progress, forbidden, extra,
                       overwrite=overwrite, sources=[plan.src_dir], keep=keep,
                       checkpoint_id=ident)  # fmt: skip
        out += [str(Path(directory) / name) for name in extra]
    return out


def _parts_kept(directory: str | os.PathLike, names: set[str], ident: str) -> set[str]:
    """Which of a split unification's file ``names`` in ``directory`` another part of it wrote:
    its shards that record ``ident`` (a shard of the same name from another unification is not
    kept), and its index and config files (part 1 writes them again)."""
    kept = set()
    for name in names:
        if name.endswith(".safetensors"):
            try:
                if read_header(Path(directory) / name)[1].get(ID_KEY) != ident:
                    continue
            except CheckpointError:  # missing or unreadable
                continue
        kept.add(name)
    return kept


def _plan_words(plan: UnifyPlan) -> list[str]:
    """What every part of one split unification shares: the source's id and layout, and each
    output tensor's file, shape and dtype."""
    source = plan.source
    strategy = strategy_digest(source.strategy) if isinstance(source, RankSource) else ""
    layout = [
        [job.rel_path, op.name, op.dtype, list(op.shape)]
        for shards in (plan.model, plan.optimizer)
        for job in shards.jobs
        for op in job.params
    ]
    return [source.checkpoint_id or "", strategy, json.dumps(layout)]


def unified_safetensors(
    src_dir: str | os.PathLike,
    src_strategy_file: StrategyArg,
    dst_dir: str | os.PathLike,
    merge_with_redundancy: bool = True,
    file_suffix: str | None = None,
    process_num: int | None = None,
    choice_func: Callable[[str], bool | str] | None = None,
    split_dst_file: tuple[int, int] | tuple = (),
    max_shard_size: int | str = "5GB",
    progress: Progress = None,
    *,
    overwrite: bool = False,
    max_process_num: int | None = None,
    optimizer_states_dir: str | os.PathLike | None = None,
) -> list[str]:
    """Merge a distributed checkpoint into Hugging Face style full-tensor shards.

    Writes ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json`` into
    ``dst_dir``. ``src_strategy_file=None`` takes ``src_dir/strategy.json`` where there is one;
    a DCP source needs no strategy. A tessel training checkpoint (``Session.save_checkpoint``)
    gives the model's state_dict only, under its keys, with the model's ``config.json`` and
    ``generation_config.json``, so ``from_pretrained(dst_dir)`` loads it; its optimizer states
    go to ``optimizer_states_dir`` (``optimizer-0000k-of-0000n.safetensors`` and
    ``optimizer.safetensors.index.json``) where given, else nowhere. ``choice_func(name)`` may
    drop a tensor (False) or rename it (a str). ``split_dst_file=(k, n)`` writes only the k-th
    of n parts of the shard list, so several machines can share the work; part 1 writes the
    index and config files, and each part keeps the other parts' files. ``dst_dir`` (and
    ``optimizer_states_dir``) must be new or empty, or, with ``overwrite=True``, the checkpoint
    there is replaced whole (files of other names are kept; see ``tessel.checkpoint.identity``);
    neither may be, lie inside or hold ``src_dir``.

    Args:
        src_dir: The distributed checkpoint's directory.
        src_strategy_file: Its strategy; None takes ``src_dir/strategy.json`` where there is
            one (a DCP source needs none).
        dst_dir: Where the shards go.
        merge_with_redundancy: MindSpore's ``.ckpt`` option; only True is taken.
        file_suffix: MindSpore's ``.ckpt`` option; only None is taken.
        process_num: Shards written at once (default 1).
        choice_func: Sees each tensor's name: False drops it, a string renames it.
        split_dst_file: ``(k, n)`` writes only the k-th of n parts of the shard list.
        max_shard_size: Bytes per shard, or a size such as ``"5GB"``.
        progress: Called once per file written.
        overwrite: Replace a checkpoint already in ``dst_dir``.
        max_process_num: MindSpore's name for ``process_num`` (keyword-only).
        optimizer_states_dir: Where a training checkpoint's optimizer states go.

    Returns:
        The files written.

    Raises:
        CheckpointError: A destination that holds anything (without ``overwrite``), or a
            MindSpore ``.ckpt`` option tessel does not take.
    """
    fn = "unified_safetensors"
    process_num = _pick(fn, "process_num", process_num, "max_process_num", max_process_num,
                        default=1)  # fmt: skip
    integer(fn, "process_num", process_num, 1)
    flag(fn, "overwrite", overwrite)
    optional_callable(fn, "choice_func", choice_func)
    _parse_size(max_shard_size)
    if split_dst_file and not (
        isinstance(split_dst_file, tuple)
        and len(split_dst_file) == 2
        and all(type(v) is int for v in split_dst_file)
    ):
        raise TypeError(f"{fn}: split_dst_file must be () or (k, n), found {split_dst_file!r}")
    if optimizer_states_dir is not None and not isinstance(
        optimizer_states_dir, (str, os.PathLike)
    ):
        raise TypeError(
            f"{fn}: optimizer_states_dir must be a path, found "
            f"{type(optimizer_states_dir).__name__}"
        )
    if file_suffix is not None or not merge_with_redundancy:
        raise CheckpointError(
            None,
            "file_suffix/merge_with_redundancy",
            "are MindSpore .ckpt options that tessel does not support",
        )
    part = (1, 1)
    if split_dst_file:
        k, n = split_dst_file
        if not (1 <= k <= n):
            raise CheckpointError(None, "split_dst_file", f"is {split_dst_file}; need 1 <= k <= n")
        part = (k, n)
    plan = plan_unify(src_dir, src_strategy_file, max_shard_size, choice_func)
    return write_unified(
        plan, dst_dir, optimizer_states_dir, process_num, progress, part, overwrite
    )


def shard_checkpoint(
    hf_dir: str | os.PathLike,
    dst_dir: str | os.PathLike,
    dst_strategy_file: StrategyArg,
    dst_prefix: str = "checkpoint_",
    process_num: int = 1,
    progress: Progress = None,
    *,
    overwrite: bool = False,
) -> list[str]:
    """Pre-shard full tensors (a Hugging Face directory, or a DCP directory) for a strategy.

    Writes ``dst/rank_{r}/{dst_prefix}{r}.safetensors`` for every rank and ``dst/strategy.json``,
    without a job. ``dst_dir`` must be new or empty, or, with ``overwrite=True``, its checkpoint
    is replaced whole (files of other names are kept); it may not be, lie inside or hold
    ``hf_dir``.

    Args:
        hf_dir: The full tensors: a Hugging Face directory or a DCP directory.
        dst_dir: Where the ranks' files go.
        dst_strategy_file: The strategy to shard for.
        dst_prefix: The files' name before the rank.
        process_num: Files written at once, by separate processes.
        progress: Called once per file written.
        overwrite: Replace a checkpoint already in ``dst_dir``.

    Returns:
        The files written.

    Raises:
        StrategyError: No destination strategy, or one that does not fit the tensors.
    """
    file_prefix("shard_checkpoint", "dst_prefix", dst_prefix)
    integer("shard_checkpoint", "process_num", process_num, 1)
    flag("shard_checkpoint", "overwrite", overwrite)
    check_destination(dst_dir, [hf_dir], overwrite)
    source: Source = DCPSource(hf_dir) if is_dcp_dir(hf_dir) else FullSource(hf_dir)
    dst = load_strategy(dst_strategy_file)
    if dst is None:
        raise StrategyError(None, "dst_strategy_file", "is required")
    dst = resolve_dst(dst, source)
    jobs = rank_jobs(source, dst, dst_prefix)
    return execute(jobs, dst_dir, process_num, progress, source.holder_files(),
                   strategy_file(dst), overwrite=overwrite, sources=[hf_dir])  # fmt: skip


def build_searched_strategy(strategy_filename: str | os.PathLike) -> dict[str, ParamLayout]:
    """Every parameter's layout in a strategy file (tessel JSON, MindSpore JSON or protobuf).

    Args:
        strategy_filename: The strategy file.

    Returns:
        ``{parameter name: its layout}``.

    Raises:
        StrategyError: The file cannot be read, or is inconsistent.
    """
    if not isinstance(strategy_filename, (str, os.PathLike)):
        raise TypeError(f"strategy_filename must be a str, got {type(strategy_filename).__name__}")
    st = load_strategy(strategy_filename)
    assert st is not None
    return dict(st.params)


def merge_pipeline_strategys(
    src_strategy_dirs: str | os.PathLike | Sequence[str | os.PathLike],
    dst_strategy_file: str | os.PathLike,
) -> Strategy:
    """Merge the strategy files of all pipeline stages into one tessel strategy file.

    Every ``*.json`` or ``*.ckpt`` file in the directories is read (byte-identical copies, as
    written by ranks of one stage, count once). A parameter listed by several stages (a shared
    weight) keeps all of them.

    Args:
        src_strategy_dirs: A directory, or several, holding the stages' strategy files.
        dst_strategy_file: The merged tessel strategy file to write.

    Returns:
        The merged strategy.

    Raises:
        StrategyError: A directory is missing, holds no strategy files or mixes .json and
            .ckpt ones, or a file cannot be read.
    """
    dirs = (
        [src_strategy_dirs]
        if isinstance(src_strategy_dirs, (str, os.PathLike))
        else list(src_strategy_dirs)
    )
    files: list[Path] = []
    for d in dirs:
        d = Path(d)
        if d.is_file():
            files.append(d)
            continue
        if not d.is_dir():
            raise StrategyError(str(d), None, "strategy directory does not exist")
        files += sorted(d.glob("*.json")) + sorted(d.glob("*.ckpt"))
    kinds = {f.suffix for f in files}
    if not files:
        raise StrategyError(str(dirs), None, "holds no *.json or *.ckpt strategy files")
    if len(kinds) > 1:
        raise StrategyError(str(dirs), None, "mixes .json and .ckpt strategy files")
    seen: set[bytes] = set()
    pairs = []
    for f in files:
        raw = f.read_bytes()
        if raw in seen:
            continue
        seen.add(raw)
        st = load_strategy(f)
        assert st is not None
        pairs += list(st.params.items())
    merged = Strategy(merge_stage_prefixed(pairs, str(dst_strategy_file), prefixed=False),
                      str(dst_strategy_file))  # fmt: skip
    merged.stage_device_num  # noqa: B018 - all stages must agree on the per-stage device count
    write_strategy(merged, dst_strategy_file)
    return merged


def restore_group_info_list(group_info_file_name: str | os.PathLike) -> list[int]:
    """The ranks whose checkpoints equal this rank's, from a MindSpore group-info file.

    Args:
        group_info_file_name: The group-info file a MindSpore rank saved.

    Returns:
        The ranks.

    Raises:
        StrategyError: The file is missing, empty or not a group-info file.
    """
    from tessel.checkpoint.mindspore_proto import read_group_info

    p = Path(group_info_file_name)
    if not p.is_file():
        raise StrategyError(str(p), None, "group info file does not exist")
    raw = p.read_bytes()
    if not raw:
        raise StrategyError(str(p), None, "group info file is empty")
    return read_group_info(raw, str(p))


def parameter_broadcast(
    net: torch.nn.Module,
    layout: str | os.PathLike | Strategy,
    cur_rank: int = 0,
    initial_rank: int = 0,
) -> None:
    """Give every rank holding the same slice of a parameter the values of the first of them.

    `layout` is a strategy file (or Strategy) naming the parameters of `net`; its ranks count
    from `initial_rank` (the first rank of this pipeline stage), and `cur_rank` is this rank.
    Every rank of the job calls it: the groups of ranks holding one slice are made on all of
    them, in one order, and each parameter is broadcast within its group from its lowest rank
    (a DTensor's local shard, a plain tensor whole).

    Args:
        net: The network whose parameters are broadcast.
        layout: A strategy file (or `Strategy`) naming the parameters of `net`.
        cur_rank: This rank.
        initial_rank: The first rank of this pipeline stage, where `layout`'s ranks start.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not isinstance(net, torch.nn.Module):
        raise TypeError(
            f"parameter_broadcast: net must be an nn.Module, found {type(net).__name__}"
        )
    for name, value in (("cur_rank", cur_rank), ("initial_rank", initial_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"parameter_broadcast: {name} must be an int >= 0, found {value!r}")
    strategy = layout if isinstance(layout, Strategy) else load_strategy(layout)
    if not dist.is_initialized():
        raise RuntimeError("parameter_broadcast needs torch.distributed initialised first")
    params = dict(net.named_parameters())
    unknown = sorted(set(strategy.params) - set(params))
    if unknown:
        raise StrategyError(
            strategy.source,
            unknown[0],
            f"names parameters the network does not have: {unknown[:5]}",
        )
    # each parameter's groups: the ranks holding one box of it
    groups: dict[str, list[tuple[int, ...]]] = {}
    for name, p in strategy.params.items():
        shape = tuple(params[name].shape)
        boxes: dict[Box, list[int]] = {}
        for rank, index in strategy.holders(name).items():
            boxes.setdefault(device_box(p, index, shape), []).append(initial_rank + rank)
        groups[name] = [tuple(sorted(r)) for r in boxes.values() if len(r) > 1]
    made = {
        ranks: dist.new_group(list(ranks))
        for ranks in sorted({g for gs in groups.values() for g in gs})
    }
    with torch.no_grad():
        for name, gs in groups.items():
            for ranks in gs:
                if cur_rank in ranks:
                    value = params[name]
                    local = value.to_local() if isinstance(value, DTensor) else value.data
                    dist.broadcast(local, src=ranks[0], group=made[ranks])


def load_segmented_checkpoints(
    ckpt_file_dir: str | os.PathLike,
    net: torch.nn.Module | None = None,
    strict_load: bool = False,
    filter_prefix: str | Sequence[str] | None = None,
    specify_prefix: str | Sequence[str] | None = None,
    choice_func: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Load and merge every ``*.safetensors`` file in a directory (no pickle).

    Args:
        ckpt_file_dir: The directory; its files must belong to one checkpoint.
        net: Where given, the merged tensors are loaded into it.
        strict_load: Load into `net` with ``strict=True``.
        filter_prefix: Leave out the tensors whose names start with it (or any of several).
        specify_prefix: Keep only the tensors whose names start with it (or any of several).
        choice_func: Sees each tensor's name; False leaves the tensor out.

    Returns:
        ``{name: tensor}`` of what was kept.

    Raises:
        CheckpointError: The directory is missing or empty, a file is corrupt, or its files
            belong to two checkpoints.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    fn = "load_segmented_checkpoints"
    flag(fn, "strict_load", strict_load)
    optional_callable(fn, "choice_func", choice_func)
    fp = prefixes(fn, "filter_prefix", filter_prefix)
    sp = prefixes(fn, "specify_prefix", specify_prefix)
    d = Path(ckpt_file_dir)
    if not d.is_dir():
        raise CheckpointError(str(d), None, "directory does not exist")
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(str(d), None, "holds no .safetensors files")
    # clear errors for truncated or corrupt files, and for files of two checkpoints
    metas = {str(f): read_header(f)[1] for f in files}
    common_id({f: f for f in metas}, metas)
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors = load_file(f)
        except SafetensorError as e:
            raise CheckpointError(str(f), None, f"cannot be read: {e}") from None
        for k, v in tensors.items():
            if fp and k.startswith(fp):
                continue
            if sp and not k.startswith(sp):
                continue
            if choice_func is not None and not choice_func(k):
                continue
            out[k] = v
    if net is not None:
        net.load_state_dict(out, strict=strict_load)
    return out


def _read_entries(source: Source, entries: list[tuple[str, Box]]) -> dict[str, torch.Tensor]:
    from tessel.checkpoint.convert import _Fds
    from tessel.checkpoint.st_io import fill

    out = {}
    fds = _Fds()
    try:
        for name, box in entries:
            job = plan_file(source, [(name, box)], "<memory>")
            op = job.params[0]
            buf = torch.empty(op.shape, dtype=torch_dtype(op.dtype))
            for p in op.pieces:
                fill(buf, p, fds.get(p.loc.path), name)
            out[name] = buf
    finally:
        fds.close()
    return out


def load_distributed_checkpoint(
    network: torch.nn.Module | None,
    checkpoint_filenames: Sequence[str | os.PathLike] | str | os.PathLike | None = None,
    predict_strategy: StrategyArg = None,
    train_strategy_filename: StrategyArg = None,
    strict_load: bool = False,
    rank_id: int | None = None,
    unified_safetensors_dir: str | os.PathLike | None = None,
    return_param_dict: bool = False,
) -> dict[str, Any] | None:
    """Load a distributed checkpoint into ``network`` for this rank's layout, reading only slices.

    Source: ``checkpoint_filenames`` (one safetensors file per training rank, in rank order, or a
    checkpoint / DCP directory) with ``train_strategy_filename``; or ``unified_safetensors_dir``.
    Target: ``predict_strategy`` and ``rank_id`` (default: this process's rank, else 0); None means
    full tensors. Parameters of ``network`` that are DTensors get their own local shard.

    Args:
        network: The network to load into, or None to only return the tensors.
        checkpoint_filenames: One safetensors file per training rank, in rank order, or a
            checkpoint or DCP directory.
        predict_strategy: The layout to load for; None means full tensors.
        train_strategy_filename: The checkpoint's strategy.
        strict_load: Refuse a parameter of `network` the checkpoint lacks.
        rank_id: The rank to load for. Default: this process's rank, else 0.
        unified_safetensors_dir: A directory of full tensors, instead of
            `checkpoint_filenames`.
        return_param_dict: Return the tensors read even where `network` is given.

    Returns:
        ``{name: tensor}`` where `network` is None or `return_param_dict` is set, else None.

    Raises:
        CheckpointError: A file is missing or of another checkpoint, or (with `strict_load`)
            a parameter is not in the checkpoint.
    """
    fn = "load_distributed_checkpoint"
    flag(fn, "strict_load", strict_load)
    flag(fn, "return_param_dict", return_param_dict)
    if rank_id is not None:
        integer(fn, "rank_id", rank_id, 0)
    if unified_safetensors_dir is not None:
        source: Source = FullSource(unified_safetensors_dir)
    elif isinstance(checkpoint_filenames, (str, os.PathLike)):
        source = open_source(checkpoint_filenames, train_strategy_filename)
    elif checkpoint_filenames:
        files = {i: str(f) for i, f in enumerate(checkpoint_filenames)}
        for r, f in files.items():
            if not Path(f).is_file():
                raise CheckpointError(f, None, f"checkpoint file of rank {r} does not exist")
        st = load_strategy(train_strategy_filename)
        if st is None:
            if len(files) != 1:
                raise StrategyError(None, "train_strategy_filename", "is needed for >1 file")
            st = full_strategy_from_file(files[0])
        source = RankSource(st, files)
    else:
        raise CheckpointError(None, "checkpoint_filenames", "give files or a directory")
    if rank_id is None:
        import torch.distributed as dist

        rank_id = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    dst = load_strategy(predict_strategy)
    if dst is not None:
        dst = resolve_dst(dst, source)
    wanted = list(network.state_dict()) if network is not None else source.names()
    local = dict(network.state_dict()) if network is not None else {}
    entries: list[tuple[str, Box]] = []
    dtensors: dict[str, Any] = {}
    names = set(source.names())
    for n in wanted:
        if n not in names:
            if strict_load:
                raise CheckpointError(source.label, n, "is not in the checkpoint")
            continue
        shape, _ = source.info(n)
        t = local.get(n)
        if t is not None and _is_dtensor(t):
            box, spec = _dtensor_box(n, t, shape)
            entries.append((n, box))
            dtensors[n] = spec
        elif dst is not None and n in dst.params:
            if rank_id not in dst.holders(n):
                continue
            p = dst.params[n]
            entries.append((n, device_box(p, dst.holders(n)[rank_id], p.shape)))
        else:
            entries.append((n, tuple((0, s) for s in shape)))
    tensors: dict[str, Any] = _read_entries(source, entries)
    for n, (mesh, placements) in dtensors.items():
        from torch.distributed.tensor import DTensor

        tensors[n] = DTensor.from_local(tensors[n], mesh, placements, run_check=False)
    if network is not None:
        network.load_state_dict(tensors, strict=strict_load)
    return tensors if (return_param_dict or network is None) else None


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def _dtensor_box(name: str, t: Any, shape: Sequence[int]) -> tuple[Box, tuple]:
    from tessel.checkpoint.dtensor import layout_from_dtensor
    from tessel.checkpoint.strategy import param_from_layout

    mesh = t.device_mesh
    lay = layout_from_dtensor(mesh, t.placements, t.ndim)
    p = param_from_layout(name, lay, shape, None, src="DTensor")
    import torch.distributed as dist

    # this process's position in the mesh, from its global rank (robust to cached meshes)
    flat = [int(x) for x in mesh.mesh.flatten().tolist()]
    me = dist.get_rank() if dist.is_initialized() else None
    if me is None or me not in flat:
        raise CheckpointError("DTensor", name, f"this rank ({me}) is not in the mesh {flat}")
    index = flat.index(me)
    return device_box(p, index, shape), (mesh, t.placements)
