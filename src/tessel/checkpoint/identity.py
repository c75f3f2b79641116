"""What makes a directory one checkpoint, and which checkpoint a file belongs to.

A checkpoint's own names. Every tessel writer of a checkpoint directory (`tessel ckpt
convert | unify | shard`, their Python functions and `Session.save_checkpoint`) replaces whole
every entry of the destination whose name is a checkpoint's, whichever writer wrote it, and
keeps the entries of other names (a tokenizer, notes, logs), as `save_pretrained` does. The
names are one set for all writers, since a directory holding one checkpoint's rank files beside
another's Hugging Face shards holds two checkpoints:

==========================  =====================================================
name                        written by
==========================  =====================================================
``rank_<r>`` (a directory)  convert, shard, save_checkpoint: rank r's files
``strategy.json``           convert, shard, save_checkpoint: the ranks' strategy
``model_state_dict.json``   save_checkpoint: which tensors are the model's
``config.json``             save_checkpoint, unify: the model's config
``generation_config.json``  save_checkpoint, unify
``*.safetensors``           unify (``model-0000k-of-0000n``, ``optimizer-...``)
``*.safetensors.index.json``  unify (``model.``, ``optimizer.``)
``.metadata``, ``*.distcp``  torch.distributed.checkpoint (read by tessel)
==========================  =====================================================

`convert_checkpoint_by_rank` writes one file into a directory that ranks share by design; it
replaces only that file.

Which checkpoint. Each safetensors file a writer makes records in its metadata the checkpoint it
belongs to, ``tessel_checkpoint`` (an id made per write, or derived from the conversion where
several calls write parts of one checkpoint: `convert_checkpoint_by_rank`,
`unified_safetensors` with `split_dst_file`), and each rank file its strategy's digest,
``tessel_strategy``. Readers refuse files of two checkpoints, and a rank file read with another
strategy than the one it was written for, naming the file and both ids.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from tessel.checkpoint.errors import CheckpointError
from tessel.checkpoint.records import Strategy, check_param

ID_KEY = "tessel_checkpoint"  # safetensors metadata: the checkpoint a file belongs to
STRATEGY_KEY = "tessel_strategy"  # safetensors metadata: the digest of a rank file's strategy

_RANK_DIR = re.compile(r"rank_[0-9]+")
_OWN_NAMES = frozenset(
    {"strategy.json", "model_state_dict.json", "config.json", "generation_config.json",
     ".metadata"}
)  # fmt: skip
_OWN_SUFFIXES = (".safetensors", ".safetensors.index.json", ".distcp")


def is_checkpoint_name(name: str) -> bool:
    """Whether an entry of a checkpoint directory named ``name`` is a checkpoint's own (see the
    table above): a writer replaces it whole, or removes it where the new checkpoint has none."""
    return name in _OWN_NAMES or name.endswith(_OWN_SUFFIXES) or bool(_RANK_DIR.fullmatch(name))


def new_checkpoint_id() -> str:
    """A fresh id for one write of a checkpoint."""
    return uuid.uuid4().hex


def derived_id(kind: str, *parts: str) -> str:
    """The id of a checkpoint written in parts by separate calls (each computes the same one
    from what the calls share: the conversion's strategies and the source's own id)."""
    h = hashlib.sha256(kind.encode())
    for p in parts:
        h.update(b"\0" + p.encode())
    return h.hexdigest()[:32]


def strategy_digest(strategy: Strategy) -> str:
    """A digest of what a strategy says of each parameter's placement: its device matrix,
    tensor map, stages or rank list and optimizer shard, normalized as a strategy file is read
    (shapes and dtypes are left out: readers check those against each file's tensors)."""
    params = []
    for name in sorted(strategy.params):
        p = check_param(name, replace(strategy.params[name], shape=None), strategy.source)
        params.append([name, list(p.dev_matrix), [list(a) for a in p.tensor_map],
                       list(p.stages), list(p.rank_list) if p.rank_list is not None else None,
                       p.opt_shard_size, p.opt_shard_step])  # fmt: skip
    per_stage = strategy.stage_device_num if strategy.params else 1
    text = json.dumps({"stage_device_num": per_stage, "params": params}, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def strategy_json_digest(data: object, source: str) -> str:
    """`strategy_digest` of a strategy given as its JSON value (a package's, say)."""
    from tessel.checkpoint.strategy import _strategy_from_json

    return strategy_digest(_strategy_from_json(data, source))


_AGAIN = (
    "write the checkpoint again into an empty directory, or over this one with --overwrite "
    "(overwrite=True), which replaces every file of the old checkpoint"
)


def common_id(files: Mapping[int | str, str], metas: Mapping[int | str, Mapping[str, str]]) -> (
    str | None
):  # fmt: skip
    """The checkpoint id every file records, or None where none records one; a file recording
    another id, or none beside files that do, is refused naming it, the first file and both ids
    (the files of a checkpoint directory that holds parts of two checkpoints)."""
    keys = sorted(files, key=lambda k: (isinstance(k, str), k))
    recorded = [k for k in keys if metas[k].get(ID_KEY)]
    if not recorded:
        return None
    first = recorded[0]
    want = metas[first][ID_KEY]
    for k in keys:
        got = metas[k].get(ID_KEY)
        if got != want:
            what = f"belongs to checkpoint {got}" if got else "records no checkpoint id"
            raise CheckpointError(
                files[k], None, f"{what}, but {files[first]} belongs to checkpoint {want}: these "
                f"files are parts of two checkpoints; {_AGAIN}",
            )  # fmt: skip
    return want


def check_strategy(
    files: Mapping[int | str, str],
    metas: Mapping[int | str, Mapping[str, str]],
    strategy: Strategy,
) -> None:
    """Refuse a rank file that records another strategy's digest than ``strategy``'s (read with
    another strategy than it was written for, its slices would be taken for others)."""
    digest = None
    for k in sorted(files, key=lambda k: (isinstance(k, str), k)):
        got = metas[k].get(STRATEGY_KEY)
        if not got:
            continue
        digest = digest or strategy_digest(strategy)
        if got != digest:
            raise CheckpointError(
                files[k], None, f"was written for the strategy with digest {got}, and "
                f"{strategy.source} has digest {digest}: read it with the strategy it was "
                "written with (the checkpoint's own strategy.json)",
            )  # fmt: skip


def check_saved(directory: str | os.PathLike, strategy: object) -> None:
    """Refuse a checkpoint that `Session.save_checkpoint` wrote for the strategy given as its
    JSON value (a package's), whose rank files (``rank_<r>/checkpoint_<r>.safetensors``, those
    a resuming session's workers read) are not all of one checkpoint written for it, naming the
    file, before any worker reads one."""
    from tessel.checkpoint.st_io import read_header
    from tessel.checkpoint.strategy import _strategy_from_json

    files: dict[int | str, str] = {}
    for rank_dir in Path(directory).glob("rank_*"):
        rank = rank_dir.name.removeprefix("rank_")
        path = rank_dir / f"checkpoint_{rank}.safetensors"
        if rank.isdigit() and path.is_file():
            files[int(rank)] = str(path)
    metas = {r: read_header(f)[1] for r, f in files.items()}
    common_id(files, metas)
    check_strategy(
        files, metas, _strategy_from_json(strategy, str(Path(directory) / "strategy.json"))
    )
