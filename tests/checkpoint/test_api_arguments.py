"""tessel.parallel's checkpoint functions check their arguments before they read or write
anything: a wrong type is a TypeError, a value out of range a ValueError, each naming the
function and the argument."""

from __future__ import annotations

import pytest

from tessel.parallel import (
    convert_checkpoint_by_rank,
    convert_checkpoints,
    load_distributed_checkpoint,
    load_segmented_checkpoints,
    rank_list_for_convert,
    shard_checkpoint,
    unified_safetensors,
)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda d: rank_list_for_convert("0"), TypeError, "rank_list_for_convert: rank_id must"),
        (lambda d: rank_list_for_convert(-1), ValueError, "rank_id must be at least 0"),
        (
            lambda d: convert_checkpoint_by_rank(True, {0: "x"}, f"{d}/o.safetensors"),
            TypeError,
            "convert_checkpoint_by_rank: rank_id must be an int",
        ),
        (
            lambda d: convert_checkpoint_by_rank(0, ["x"], f"{d}/o.safetensors"),
            TypeError,
            "checkpoint_files_map must map source ranks to files",
        ),
        (
            lambda d: convert_checkpoint_by_rank(0, {"0": "x"}, f"{d}/o.safetensors"),
            TypeError,
            "checkpoint_files_map's ranks must be an int",
        ),
        (
            lambda d: convert_checkpoints(d, d / "o", "../escape_"),
            ValueError,
            "convert_checkpoints: dst_prefix must be a file name's start, found '../escape_'",
        ),
        (
            lambda d: convert_checkpoints(d, d / "o", "ckpt_", process_num=0),
            ValueError,
            "process_num must be at least 1",
        ),
        (
            lambda d: unified_safetensors(d, None, d / "o", max_shard_size="five GB"),
            ValueError,
            "max_shard_size must be bytes or a number with a unit",
        ),
        (
            lambda d: unified_safetensors(d, None, d / "o", split_dst_file=(1,)),
            TypeError,
            "split_dst_file must be () or (k, n)",
        ),
        (
            lambda d: unified_safetensors(d, None, d / "o", choice_func="all"),
            TypeError,
            "choice_func must be a function or None",
        ),
        (
            lambda d: shard_checkpoint(d, d / "o", None, dst_prefix="a/b"),
            ValueError,
            "shard_checkpoint: dst_prefix must be a file name's start",
        ),
        (
            lambda d: load_segmented_checkpoints(d, strict_load="yes"),
            TypeError,
            "strict_load must be True or False",
        ),
        (
            lambda d: load_segmented_checkpoints(d, filter_prefix=3),
            TypeError,
            "filter_prefix must be a str or a list of str",
        ),
        (
            lambda d: load_distributed_checkpoint(None, rank_id=-2),
            ValueError,
            "load_distributed_checkpoint: rank_id must be at least 0",
        ),
    ],
)
def test_checkpoint_functions_check_their_arguments_first(tmp_path, call, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        call(tmp_path)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.safetensors").exists()
