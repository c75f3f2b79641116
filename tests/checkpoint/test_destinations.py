"""A checkpoint directory never holds two checkpoints.

Writers refuse a destination that is not empty unless told to overwrite it, and one that is, lies
inside or holds their source; every safetensors file records the checkpoint it belongs to, and
readers refuse files of two checkpoints (or, for files that record none, a rank count or a slice
the strategy does not give), naming the file and both ids.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tessel.checkpoint.identity import ID_KEY, STRATEGY_KEY, check_saved, strategy_digest
from tessel.checkpoint.model_files import state_dict_file
from tessel.checkpoint.strategy import load_strategy
from tessel.cli import main
from tessel.parallel import (
    CheckpointError,
    convert_checkpoint_by_rank,
    convert_checkpoints,
    load_distributed_checkpoint,
    load_segmented_checkpoints,
    shard_checkpoint,
    unified_safetensors,
)

from .helpers import (
    SMALL_SHAPES,
    checkpoint_ids,
    files_bytes,
    make_full,
    metadata,
    ref_rank_slices,
    small_strategy,
    write_full,
)

SHAPES = SMALL_SHAPES


def _strategy(path: Path, tp: int) -> Path:
    return small_strategy(path, 1, tp)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """Two 4-rank checkpoints of the same strategy and other weights (A, B), their Hugging Face
    sources and a 2-rank strategy, shared by every test (each copies what it changes)."""
    root = tmp_path_factory.mktemp("made")
    tp4, _ = _strategy(root / "tp4.json", 4), _strategy(root / "tp2.json", 2)
    for name, seed in (("A", 3), ("B", 5)):
        shard_checkpoint(write_full(make_full(SHAPES, seed=seed), root / f"{name}_hf"),
                         root / name, tp4)  # fmt: skip
    return root


def _copy(made: Path, name: str, to: Path) -> Path:
    shutil.copytree(made / name, to)
    return to


def test_every_writer_refuses_a_destination_that_is_not_empty(made, tmp_path, capsys):
    """convert, unify and shard (their functions and `tessel ckpt`) leave a destination that
    holds anything as it was, naming it and the flag; with it, the old checkpoint is gone."""
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "tokenizer.json").write_text("{}")
    (dst / "rank_7").mkdir()
    before = files_bytes(dst)
    words = re.escape(f"{dst}: is not empty (it holds rank_7, tokenizer.json); ")
    runs = {
        "convert": lambda **kw: convert_checkpoints(made / "A", dst, "checkpoint_", None,
                                                    made / "tp2.json", **kw),
        "unify": lambda **kw: unified_safetensors(made / "A", None, dst, **kw),
        "shard": lambda **kw: shard_checkpoint(made / "A_hf", dst, made / "tp2.json", **kw),
    }  # fmt: skip
    for run in runs.values():
        with pytest.raises(CheckpointError, match=words + ".*--overwrite \\(overwrite=True"):
            run()
        assert files_bytes(dst) == before
    for command in (
        ["convert", str(made / "A"), str(dst)],
        ["unify", str(made / "A"), str(dst)],
        ["shard", str(made / "A_hf"), str(dst), "--strategy", str(made / "tp2.json")],
    ):
        assert main(["ckpt", *command, "--no-progress"]) == 2  # fmt: skip
        assert re.match("tessel: error: " + words, capsys.readouterr().err)
        assert files_bytes(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]  # no staging made
    # with the flag each replaces the checkpoint there whole and keeps the tokenizer
    kept = {"tokenizer.json"}
    runs["shard"](overwrite=True)
    assert {p.name for p in dst.iterdir()} == kept | {"rank_0", "rank_1", "strategy.json"}
    runs["unify"](overwrite=True)
    names = {p.name for p in dst.iterdir()} - kept
    assert names == {"model-00001-of-00001.safetensors", "model.safetensors.index.json"}
    assert main(["ckpt", "convert", str(made / "A"), str(dst), "--no-progress",
                 "--overwrite"]) == 0  # fmt: skip
    assert {p.name for p in dst.iterdir()} == kept | {"rank_0", "strategy.json"}


def test_a_destination_that_is_inside_or_holds_the_source_is_refused(made, tmp_path):
    src = _copy(made, "A", tmp_path / "A")
    for dst, what in ((src, "is the source"), (src / "rank_0", "lies inside the source"),
                      (tmp_path, "holds the source")):  # fmt: skip
        with pytest.raises(CheckpointError, match=f"{re.escape(str(dst))}: {what} {src}"):
            unified_safetensors(src, None, dst, overwrite=True)
        with pytest.raises(CheckpointError, match=f"{what} {src}"):
            shard_checkpoint(src, dst, made / "tp2.json", overwrite=True)
    (src / "model_state_dict.json").write_bytes(state_dict_file({n: n for n in SHAPES}))
    states = src / "states"
    with pytest.raises(CheckpointError, match=f"{states}: lies inside the source"):
        unified_safetensors(src, None, tmp_path / "hf", optimizer_states_dir=states)
    assert not states.exists() and not (tmp_path / "hf").exists()


def _mixed(made: Path, root: Path) -> tuple[Path, Path]:
    """A's checkpoint with B's rank 1 file in it: two checkpoints in one directory."""
    mixed = _copy(made, "A", root / "mixed")
    other = mixed / "rank_1" / "checkpoint_1.safetensors"
    shutil.copy(made / "B" / "rank_1" / "checkpoint_1.safetensors", other)
    return mixed, other


def test_a_rank_file_of_another_checkpoint_is_refused_by_every_reader(made, tmp_path, capsys):
    mixed, other = _mixed(made, tmp_path)
    ids = checkpoint_ids(mixed)
    a, b = ids["rank_0/checkpoint_0.safetensors"], ids["rank_1/checkpoint_1.safetensors"]
    assert a != b and a == checkpoint_ids(made / "A")["rank_1/checkpoint_1.safetensors"]
    words = (f"{re.escape(str(other))}: belongs to checkpoint {b}, but .*rank_0/"
             f"checkpoint_0.safetensors belongs to checkpoint {a}: these files are parts of two "
             "checkpoints")  # fmt: skip
    readers = {
        "convert": lambda: convert_checkpoints(mixed, tmp_path / "out", "p", None, None),
        "unify": lambda: unified_safetensors(mixed, None, tmp_path / "out"),
        "load": lambda: load_distributed_checkpoint(None, mixed),
        "by rank": lambda: convert_checkpoint_by_rank(
            0, {r: mixed / f"rank_{r}" / f"checkpoint_{r}.safetensors" for r in (0, 1)},
            tmp_path / "out" / "r0.safetensors", mixed / "strategy.json",
            made / "tp2.json"),

        "resume": lambda: check_saved(
            mixed, json.loads((mixed / "strategy.json").read_text())),
    }  # fmt: skip
    for name, read in readers.items():
        with pytest.raises(CheckpointError, match=words):
            read()
        assert not (tmp_path / "out").exists(), name
    assert main(["ckpt", "inspect", str(mixed)]) == 2
    assert re.search(words, capsys.readouterr().err)
    assert main(["ckpt", "inspect", str(made / "A")]) == 0
    assert f"checkpoint={a}" in capsys.readouterr().out
    # and rank files written for another strategy, read with this one
    shard_checkpoint(made / "A_hf", tmp_path / "two", made / "tp2.json")
    digest = strategy_digest(load_strategy(made / "tp2.json"))
    with pytest.raises(CheckpointError, match=f"checkpoint_0.safetensors: was written for the "
                       f"strategy with digest {digest}, and .*tp4.json has digest"):  # fmt: skip
        load_distributed_checkpoint(
            None, tmp_path / "two", train_strategy_filename=made / "tp4.json"
        )


def test_files_that_record_no_checkpoint_are_checked_by_rank_count_and_slices(made, tmp_path):
    """MindSpore's rank files record no checkpoint: a rank the strategy does not have, or a
    slice it does not give that rank, is refused naming the file."""
    plain = _copy(made, "A", tmp_path / "plain")
    for f in plain.glob("rank_*/*.safetensors"):
        save_file(load_file(f), f)  # its tensors, no metadata
    assert set(checkpoint_ids(plain).values()) == {None}
    got = load_distributed_checkpoint(None, plain, train_strategy_filename=made / "tp4.json")
    assert set(got) == set(SHAPES)
    with pytest.raises(CheckpointError, match=r"rank_2/checkpoint_2.safetensors: is a file of "
                       r"rank 2, but the strategy \(.*tp2.json\) has 2 ranks \(0..1\)"):  # fmt: skip
        load_distributed_checkpoint(None, plain, train_strategy_filename=made / "tp2.json")
    f = plain / "rank_3" / "checkpoint_3.safetensors"
    tensors = load_file(f)
    tensors["qkv"] = torch.zeros(5, 8)  # rank 3 holds rows 18..24
    save_file(tensors, f)
    with pytest.raises(CheckpointError, match=r"checkpoint_3.safetensors: qkv: is stored as "
                       r"float32\[5, 8\], but the strategy .* gives rank 3 the slice "
                       r"float32\[6, 8\]"):  # fmt: skip
        convert_checkpoints(plain, tmp_path / "out", "p", made / "tp4.json", made / "tp2.json")


def test_the_ranks_of_one_conversion_by_rank_share_its_id(made, tmp_path):
    """convert_checkpoint_by_rank: each rank's call derives the same id, so its files read as
    one checkpoint; the file a conversion of another source writes is refused beside them."""
    out = tmp_path / "out"
    files = {name: {r: made / name / f"rank_{r}" / f"checkpoint_{r}.safetensors" for r in range(4)}
             for name in "AB"}  # fmt: skip
    for r in (0, 1):
        convert_checkpoint_by_rank(r, files["A"], out / f"rank_{r}" / f"checkpoint_{r}.safetensors",
                                   made / "tp4.json", made / "tp2.json")  # fmt: skip
    ids = checkpoint_ids(out)
    assert len(set(ids.values())) == 1 and None not in ids.values()
    st = load_strategy(made / "tp2.json")
    meta = metadata(out / "rank_0" / "checkpoint_0.safetensors")
    assert meta[STRATEGY_KEY] == strategy_digest(st) and meta[ID_KEY] == ids.popitem()[1]
    got = load_distributed_checkpoint(None, out, train_strategy_filename=made / "tp2.json",
                                      predict_strategy=made / "tp2.json", rank_id=1)  # fmt: skip
    want = ref_rank_slices(make_full(SHAPES, seed=3), st, 1)
    assert all(torch.equal(got[k], want[k]) for k in want)
    convert_checkpoint_by_rank(1, files["B"], out / "rank_1" / "checkpoint_1.safetensors",
                               made / "tp4.json", made / "tp2.json")  # fmt: skip
    with pytest.raises(CheckpointError, match="rank_1/checkpoint_1.safetensors: belongs to "
                       "checkpoint [0-9a-f]{32}, but .*rank_0/checkpoint_0.safetensors belongs "
                       "to checkpoint"):  # fmt: skip
        load_distributed_checkpoint(None, out, train_strategy_filename=made / "tp2.json")


def test_the_parts_of_a_split_unification_keep_each_other(made, tmp_path):
    """Two calls write the two parts of one unification into one directory: the second keeps
    the first's shards (a stale shard of another unification goes), and all record one id."""
    dst = tmp_path / "hf"
    unified_safetensors(made / "A", None, dst, max_shard_size=1000, split_dst_file=(2, 2))
    unified_safetensors(made / "A", None, dst, max_shard_size=1000, split_dst_file=(1, 2))
    shards = sorted(p.name for p in dst.glob("*.safetensors"))
    assert len(shards) == 3 and len(set(checkpoint_ids(dst).values())) == 1
    assert set(load_segmented_checkpoints(dst)) == set(SHAPES)
    # another source's part 2 over it: refused (its shards have the same names), and with
    # overwrite the old unification's shards go; its part 1 then completes it
    a = set(checkpoint_ids(dst).values())
    with pytest.raises(CheckpointError, match=r"is not empty \(it holds model-00001-of-00003"):
        unified_safetensors(made / "B", None, dst, max_shard_size=1000, split_dst_file=(2, 2))
    unified_safetensors(made / "B", None, dst, max_shard_size=1000, split_dst_file=(2, 2),
                        overwrite=True)  # fmt: skip
    assert sorted(p.name for p in dst.glob("*.safetensors")) == [shards[1]]
    assert set(checkpoint_ids(dst).values()).isdisjoint(a)
    shutil.copy(made / "A" / "rank_0" / "checkpoint_0.safetensors", dst / "stale.safetensors")
    with pytest.raises(CheckpointError, match="stale.safetensors: records no checkpoint id|"
                       "belongs to checkpoint .* parts of two checkpoints"):  # fmt: skip
        load_segmented_checkpoints(dst)
    (dst / "stale.safetensors").unlink()
    unified_safetensors(made / "B", None, dst, max_shard_size=1000, split_dst_file=(1, 2))
    got = load_segmented_checkpoints(dst)
    full = make_full(SHAPES, seed=5)
    assert set(got) == set(SHAPES) and all(torch.equal(got[k], full[k]) for k in full)


def test_cli_help_names_the_flag(capsys):
    for command in ("convert", "unify", "shard"):
        with pytest.raises(SystemExit):
            main(["ckpt", command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--overwrite" in text and "files of other names (a tokenizer) are kept" in text
