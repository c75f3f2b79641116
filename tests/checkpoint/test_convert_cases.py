"""Named conversion scenarios and every error case, each with a clear message."""

from __future__ import annotations

import errno
import hashlib
import inspect
import json
import multiprocessing as mp
import os
import signal
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tessel.checkpoint.strategy import load_strategy
from tessel.parallel import (
    CheckpointError,
    Layout,
    StrategyError,
    convert_checkpoint_by_rank,
    convert_checkpoints,
    load_distributed_checkpoint,
    load_segmented_checkpoints,
    rank_list_for_convert,
    save_strategy_file,
    shard_checkpoint,
    unified_safetensors,
)

from .helpers import blank_id, files_bytes, make_full, metadata, ref_rank_slices, write_full

SHAPES = {"emb": (16, 8), "qkv": (24, 8), "out": (8, 24), "norm": (8,)}


def _tp(n, path, stages=None, opt=None):
    """Megatron-style TP layouts on a (dp, tp) mesh; optional optimizer sharding/pipelining."""
    lay = Layout((n[0], n[1]), ("dp", "tp"))
    stages = stages or {}
    spec = {
        "emb": (lay("tp", "None"), SHAPES["emb"]),
        "qkv": (lay("tp", "None"), SHAPES["qkv"]),
        "out": (lay("None", "tp"), SHAPES["out"]),
        "norm": (lay("None"), SHAPES["norm"]),
    }
    params = {}
    for k, (layout, shape) in spec.items():
        o = {"stage": stages.get(k, 0)}
        if opt and n[0] > 1:
            o["opt_shard_size"] = opt
        params[k] = (layout, shape, "float32", o)
    save_strategy_file(path, params)
    return path


@pytest.fixture
def full():
    return make_full(SHAPES, seed=3)


@pytest.fixture
def src(tmp_path, full):
    hf = write_full(full, tmp_path / "hf")
    a = _tp((1, 4), tmp_path / "tp4.json")
    shard_checkpoint(hf, tmp_path / "A", a)
    return tmp_path / "A", a


def _check(d, full, strat_file, prefix="checkpoint_"):
    st = load_strategy(strat_file)
    n = 0
    for r in range(st.world_size):
        want = ref_rank_slices(full, st, r)
        if not want:
            continue
        got = load_file(str(d / f"rank_{r}" / f"{prefix}{r}.safetensors"))
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), (r, k)
        n += 1
    return n


def test_tp4_to_dp2_tp2_with_optimizer_shard_and_back(tmp_path, src, full):
    a_dir, a = src
    b = _tp((2, 2), tmp_path / "dp2tp2.json", opt=2)
    assert convert_checkpoints(a_dir, tmp_path / "B", "checkpoint_", a, b)
    assert _check(tmp_path / "B", full, b) == 4
    # rank 1 (dp 0, tp 1) keeps only the first optimizer half of its TP slice of emb
    got = load_file(str(tmp_path / "B/rank_1/checkpoint_1.safetensors"))
    assert torch.equal(got["emb"], full["emb"][8:12])
    convert_checkpoints(tmp_path / "B", tmp_path / "A2", "checkpoint_", b, a)
    assert files_bytes(tmp_path / "A2") == files_bytes(a_dir)


def test_uneven_shards_convert_like_any_other_layout(tmp_path, full):
    """Dims that do not divide are cut as torch.chunk cuts them (DTensor's Shard): a checkpoint
    sharded 3 ways converts to 4 ways and back, and unifies to the original tensors."""
    hf = write_full(full, tmp_path / "hf")
    three = _tp((1, 3), tmp_path / "tp3.json")
    shard_checkpoint(hf, tmp_path / "A", three)
    assert _check(tmp_path / "A", full, three) == 3
    got = load_file(str(tmp_path / "A/rank_2/checkpoint_2.safetensors"))
    assert torch.equal(got["emb"], full["emb"][12:16])  # 16 rows: 6, 6, 4
    four = _tp((1, 4), tmp_path / "tp4.json")
    assert convert_checkpoints(tmp_path / "A", tmp_path / "B", "checkpoint_", three, four)
    assert _check(tmp_path / "B", full, four) == 4
    convert_checkpoints(tmp_path / "B", tmp_path / "A2", "checkpoint_", four, three)
    assert files_bytes(tmp_path / "A2") == files_bytes(tmp_path / "A")
    unified_safetensors(tmp_path / "A", three, tmp_path / "U")
    merged = {}
    for f in sorted((tmp_path / "U").glob("*.safetensors")):
        merged.update(load_file(str(f)))
    assert set(merged) == set(full)
    for k in full:
        assert torch.equal(merged[k], full[k]), k


def test_to_tp8_and_pipeline_stages(tmp_path, src, full):
    a_dir, a = src
    b = _tp((1, 2), tmp_path / "pp2.json", stages={"emb": [0, 1], "qkv": 0, "out": 1, "norm": 1})
    convert_checkpoints(a_dir, tmp_path / "B", "checkpoint_", a, b, process_num=2)
    assert _check(tmp_path / "B", full, b) == 4
    assert set(load_file(str(tmp_path / "B/rank_0/checkpoint_0.safetensors"))) == {"emb", "qkv"}
    assert set(load_file(str(tmp_path / "B/rank_3/checkpoint_3.safetensors"))) == {
        "emb", "out", "norm"
    }  # fmt: skip
    c = _tp((1, 8), tmp_path / "tp8.json")
    convert_checkpoints(tmp_path / "B", tmp_path / "C", "checkpoint_", b, c)
    assert _check(tmp_path / "C", full, c) == 8
    unified_safetensors(tmp_path / "C", c, tmp_path / "U")
    idx = json.loads((tmp_path / "U/model.safetensors.index.json").read_text())
    assert set(idx["weight_map"]) == set(full)
    assert idx["metadata"]["total_size"] == sum(t.numel() * 4 for t in full.values())
    u = load_file(str(tmp_path / "U/model-00001-of-00001.safetensors"))
    assert all(torch.equal(u[k], full[k]) for k in full)


def test_device_counts_need_not_divide(tmp_path, full):
    hf = write_full(full, tmp_path / "hf")
    three = tmp_path / "three.json"
    lay = Layout((3,), ("tp",))
    save_strategy_file(three, {"qkv": (lay("tp", "None"), (24, 8), "float32"),
                               "out": (lay("None", "tp"), (8, 24), "float32")})  # fmt: skip
    two = tmp_path / "two.json"
    lay2 = Layout((2,), ("tp",))
    save_strategy_file(two, {"qkv": (lay2("None", "tp"), (24, 8), "float32"),
                             "out": (lay2("tp", "None"), (8, 24), "float32")})  # fmt: skip
    shard_checkpoint(hf, tmp_path / "A", three)
    convert_checkpoints(tmp_path / "A", tmp_path / "B", "checkpoint_", three, two)
    assert _check(tmp_path / "B", {k: full[k] for k in ("qkv", "out")}, two) == 2
    assert rank_list_for_convert(1, three, two) == [2, 1, 0]


def test_unify_split_dst_file_and_choice_func(tmp_path, src, full):
    a_dir, a = src
    kw = dict(max_shard_size=600, choice_func=lambda n: False if n == "norm" else "m." + n)
    unified_safetensors(a_dir, a, tmp_path / "U", split_dst_file=(1, 2), **kw)
    unified_safetensors(a_dir, a, tmp_path / "U", split_dst_file=(2, 2), **kw)
    idx = json.loads((tmp_path / "U/model.safetensors.index.json").read_text())
    got = {}
    for f in set(idx["weight_map"].values()):
        got.update(load_file(str(tmp_path / "U" / f)))
    assert set(got) == {"m.emb", "m.qkv", "m.out"}
    assert all(torch.equal(got["m." + k], full[k]) for k in ("emb", "qkv", "out"))
    assert len(set(idx["weight_map"].values())) == 3


def test_load_distributed_checkpoint(tmp_path, src, full):
    a_dir, a = src
    files = [a_dir / f"rank_{r}" / f"checkpoint_{r}.safetensors" for r in range(4)]
    net = torch.nn.Module()
    for k, v in full.items():
        net.register_parameter(k, torch.nn.Parameter(torch.zeros_like(v)))
    load_distributed_checkpoint(net, files, None, a)
    assert all(torch.equal(getattr(net, k).detach(), full[k]) for k in full)
    b = _tp((1, 2), tmp_path / "tp2.json")
    got = load_distributed_checkpoint(None, a_dir, b, a, rank_id=1)
    assert torch.equal(got["out"], full["out"][:, 12:])


def test_load_segmented_checkpoints(tmp_path, full):
    d = tmp_path / "seg"
    d.mkdir()
    save_file({"emb": full["emb"]}, str(d / "net_part0.safetensors"))
    save_file({"out": full["out"], "opt.m": full["norm"]}, str(d / "net_part1.safetensors"))
    got = load_segmented_checkpoints(d, filter_prefix="opt.")
    assert set(got) == {"emb", "out"} and torch.equal(got["out"], full["out"])


# --------------------------------------------------------------------------------- errors


def _digest(d: Path) -> dict:
    return {k: hashlib.sha256(v).hexdigest() for k, v in files_bytes(d).items()}


def test_missing_rank_file(tmp_path, src):
    a_dir, a = src
    b = _tp((1, 2), tmp_path / "tp2.json")
    (a_dir / "rank_2" / "checkpoint_2.safetensors").unlink()
    with pytest.raises(CheckpointError, match="rank") as e:
        convert_checkpoints(a_dir, tmp_path / "B", "checkpoint_", a, b)
    assert "emb" in str(e.value) or "qkv" in str(e.value) or "out" in str(e.value)
    assert not (tmp_path / "B").exists()


def test_missing_file_in_map(tmp_path, src):
    a_dir, a = src
    with pytest.raises(CheckpointError, match="does not exist"):
        convert_checkpoint_by_rank(0, {0: tmp_path / "nope.safetensors"}, tmp_path / "o.safetensors",
                                   a, a)  # fmt: skip


def test_shape_mismatch_between_strategy_and_files(tmp_path, src):
    """Rank files read with another strategy than theirs are refused: by the strategy's digest
    they record, and where they record none (MindSpore's), by the slices they hold."""
    a_dir, a = src
    bad = tmp_path / "bad.json"
    lay = Layout((1, 4), ("dp", "tp"))
    save_strategy_file(bad, {"emb": (lay("None", "tp"), (16, 8), "float32")})
    only = tmp_path / "only.json"
    save_strategy_file(only, {"emb": (Layout((2,), ("tp",))("tp", "None"), (16, 8), "float32")})
    with pytest.raises(CheckpointError, match=r"checkpoint_0.safetensors: was written for the "
                       r"strategy with digest [0-9a-f]{32}, and .*bad.json has digest"):  # fmt: skip
        convert_checkpoints(a_dir, tmp_path / "B", "p", bad, only)
    for f in a_dir.glob("rank_*/*.safetensors"):  # as MindSpore writes them: no record
        save_file(load_file(f), f)
    with pytest.raises(CheckpointError, match=r"emb.*\[4, 8\].*\[16, 2\]") as e:
        convert_checkpoints(a_dir, tmp_path / "B", "p", bad, only)
    assert "checkpoint_0.safetensors" in str(e.value) and "emb" in str(e.value)


def test_dst_shape_or_dtype_disagrees_with_source(tmp_path, src):
    a_dir, a = src
    b = tmp_path / "b.json"
    lay = Layout((2,), ("tp",))
    save_strategy_file(b, {"emb": (lay("tp", "None"), (32, 8), "float32")})
    with pytest.raises(StrategyError, match=r"emb.shape.*\[32, 8\].*\[16, 8\]"):
        convert_checkpoints(a_dir, tmp_path / "B", "p", a, b)
    save_strategy_file(b, {"emb": (lay("tp", "None"), (16, 8), "bfloat16")})
    with pytest.raises(StrategyError, match="emb.dtype.*bfloat16.*float32"):
        convert_checkpoints(a_dir, tmp_path / "B", "p", a, b)


def test_dtype_mismatch_in_rank_file(tmp_path, src, full):
    a_dir, a = src
    f = a_dir / "rank_1" / "checkpoint_1.safetensors"
    t = load_file(str(f))
    t["emb"] = t["emb"].to(torch.bfloat16)
    save_file(t, str(f), metadata(f))
    with pytest.raises(CheckpointError, match="emb.*bfloat16.*float32") as e:
        convert_checkpoints(a_dir, tmp_path / "B", "p", a, _tp((1, 2), tmp_path / "b.json"))
    assert str(f) in str(e.value)


def test_param_missing_from_rank_file(tmp_path, src):
    a_dir, a = src
    f = a_dir / "rank_0" / "checkpoint_0.safetensors"
    t = load_file(str(f))
    del t["qkv"]
    save_file(t, str(f), metadata(f))
    with pytest.raises(CheckpointError, match="qkv.*missing"):
        convert_checkpoints(a_dir, tmp_path / "B", "p", a, _tp((1, 2), tmp_path / "b.json"))


def test_param_not_in_source(tmp_path, src):
    a_dir, a = src
    b = tmp_path / "b.json"
    save_strategy_file(b, {"nope": (Layout((2,), ("tp",))("tp"), (4,), "float32")})
    with pytest.raises(CheckpointError, match="nope.*not in the source"):
        convert_checkpoints(a_dir, tmp_path / "B", "p", a, b)


def test_truncated_safetensors(tmp_path, src):
    a_dir, a = src
    f = a_dir / "rank_3" / "checkpoint_3.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[:-10])
    with pytest.raises(CheckpointError, match="truncated") as e:
        convert_checkpoints(a_dir, tmp_path / "B", "p", a, _tp((1, 2), tmp_path / "b.json"))
    assert str(f) in str(e.value)


@pytest.mark.parametrize(
    "payload, words",
    [
        (b"\x01\x02", "truncated"),
        (struct.pack("<Q", 10**12) + b"{}", "header length"),
        (struct.pack("<Q", 4) + b"{{{{", "corrupt"),
        (struct.pack("<Q", 2) + b"[]", "corrupt"),
    ],
)
def test_corrupt_safetensors(tmp_path, src, payload, words):
    a_dir, a = src
    f = a_dir / "rank_0" / "checkpoint_0.safetensors"
    f.write_bytes(payload)
    with pytest.raises(CheckpointError, match=words) as e:
        convert_checkpoints(a_dir, tmp_path / "B", "p", a, _tp((1, 2), tmp_path / "b.json"))
    assert str(f) in str(e.value)


def test_corrupt_header_entry_names_parameter(tmp_path, src):
    a_dir, a = src
    f = a_dir / "rank_0" / "checkpoint_0.safetensors"
    hdr = {"emb": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 99]}}
    js = json.dumps(hdr).encode()
    f.write_bytes(struct.pack("<Q", len(js)) + js + b"\0" * 128)
    with pytest.raises(CheckpointError, match="emb.*99 bytes"):
        convert_checkpoints(a_dir, tmp_path / "B", "p", a, _tp((1, 2), tmp_path / "b.json"))


def test_failure_leaves_destination_and_source_untouched(tmp_path, src):
    a_dir, a = src
    b = _tp((1, 2), tmp_path / "tp2.json")
    dst = tmp_path / "B"
    (dst / "rank_0").mkdir(parents=True)
    (dst / "rank_0" / "checkpoint_0.safetensors").write_bytes(b"old contents")
    before_src, before_dst = _digest(a_dir), _digest(dst)
    # rank 3's file is corrupt: ranks 0/1 of the destination could be written before it is read
    f = a_dir / "rank_3" / "checkpoint_3.safetensors"
    f.write_bytes(f.read_bytes()[:-4])
    before_src = _digest(a_dir)
    with pytest.raises(CheckpointError):
        convert_checkpoints(a_dir, dst, "checkpoint_", a, b, process_num=2)
    assert _digest(dst) == before_dst and _digest(a_dir) == before_src
    assert [p.name for p in dst.iterdir()] == ["rank_0"]


def _fail_on_call(monkeypatch, name: str, failing) -> list:
    """Patch ``os.<name>`` to raise on the calls whose 1-based numbers ``failing`` accepts."""
    real = getattr(os, name)
    calls: list = []

    def flaky(a, b, *args, **kw):
        calls.append((a, b))
        if failing(len(calls)):
            raise OSError(f"injected failure of os.{name} call {len(calls)}")
        return real(a, b, *args, **kw)

    monkeypatch.setattr(os, name, flaky)
    return calls


def _existing_destination(dst: Path) -> None:
    """A destination that already holds an older rank 0 and files no conversion writes."""
    (dst / "rank_0").mkdir(parents=True)
    (dst / "rank_0" / "checkpoint_0.safetensors").write_bytes(b"old rank 0")
    (dst / "rank_0" / "notes.txt").write_text("keep me too")
    (dst / "logs").mkdir()
    (dst / "logs" / "run.txt").write_text("keep the logs")
    (dst / "notes.txt").write_text("keep me")
    (dst / "latest").symlink_to("rank_0")


def test_existing_destination_keeps_what_the_output_does_not_replace(tmp_path, src, full):
    """Over an existing destination (with overwrite) the checkpoint is replaced whole, rank
    directories with all they held; entries of other names are kept as they were."""
    a_dir, a = src
    b = _tp((1, 2), tmp_path / "tp2.json")
    dst = tmp_path / "B"
    _existing_destination(dst)
    dst.chmod(0o750)
    notes = os.stat(dst / "notes.txt")
    before = _digest(dst)
    with pytest.raises(CheckpointError, match=r"B: is not empty \(it holds latest, logs, "
                       r"notes.txt, \.\.\.\); .* --overwrite \(overwrite=True"):  # fmt: skip
        convert_checkpoints(a_dir, dst, "checkpoint_", a, b)
    assert _digest(dst) == before
    convert_checkpoints(a_dir, dst, "checkpoint_", a, b, overwrite=True)
    assert _check(dst, full, b) == 2
    assert (dst / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in (dst / "rank_0").iterdir()) == ["checkpoint_0.safetensors"]
    assert (dst / "logs" / "run.txt").read_text() == "keep the logs"
    assert os.readlink(dst / "latest") == "rank_0"
    assert os.stat(dst / "notes.txt").st_ino == notes.st_ino  # kept as a link, not copied
    assert dst.stat().st_mode & 0o777 == 0o750
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_failed_swap_leaves_existing_destination_as_it_was(tmp_path, src, monkeypatch, exchange):
    from tessel.checkpoint import publish

    a_dir, a = src
    b = _tp((1, 2), tmp_path / "tp2.json")
    dst = tmp_path / "B"
    _existing_destination(dst)
    before = _digest(dst)
    if exchange:

        def broken(x, y):
            raise OSError("injected failure of the exchange")

        monkeypatch.setattr(publish, "exchange", broken)
    else:  # no atomic exchange: the old tree goes aside, then moving the new one in fails
        monkeypatch.setattr(publish, "exchange", lambda x, y: False)
        _fail_on_call(monkeypatch, "rename", lambda n: n == 2)
    with pytest.raises(CheckpointError, match="injected.*destination is unchanged"):
        convert_checkpoints(a_dir, dst, "checkpoint_", a, b, overwrite=True)
    monkeypatch.undo()
    assert _digest(dst) == before and os.readlink(dst / "latest") == "rank_0"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_an_entry_of_a_checkpoints_name_is_replaced_whatever_it_is(tmp_path, src, full):
    """A file named as a rank directory is the old checkpoint's: replaced whole by the
    directory, as a rank directory by a file would be."""
    a_dir, a = src
    b = _tp((1, 2), tmp_path / "tp2.json")
    dst = tmp_path / "B"
    dst.mkdir()
    (dst / "rank_1").write_text("a file where the output needs a directory")
    convert_checkpoints(a_dir, dst, "checkpoint_", a, b, overwrite=True)
    assert _check(dst, full, b) == 2
    assert sorted(p.name for p in dst.iterdir()) == ["rank_0", "rank_1", "strategy.json"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_symlinked_destination_replaces_the_tree_it_points_to(tmp_path, src, full):
    a_dir, a = src
    b = _tp((1, 2), tmp_path / "tp2.json")
    _existing_destination(tmp_path / "real")
    (tmp_path / "B").symlink_to("real")
    convert_checkpoints(a_dir, tmp_path / "B", "checkpoint_", a, b, overwrite=True)
    assert os.readlink(tmp_path / "B") == "real"
    assert _check(tmp_path / "real", full, b) == 2
    assert (tmp_path / "real" / "notes.txt").read_text() == "keep me"


def test_rank_file_over_an_existing_one(tmp_path, src, full):
    a_dir, a = src
    b = _tp((1, 2), tmp_path / "tp2.json")
    out = tmp_path / "out"
    out.mkdir()
    (out / "rank1.safetensors").write_bytes(b"old")
    (out / "other.txt").write_text("keep")
    files = {r: a_dir / f"rank_{r}" / f"checkpoint_{r}.safetensors" for r in range(4)}
    convert_checkpoint_by_rank(1, files, out / "rank1.safetensors", a, b)
    got = load_file(str(out / "rank1.safetensors"))
    want = ref_rank_slices(full, load_strategy(b), 1)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert sorted(p.name for p in out.iterdir()) == ["other.txt", "rank1.safetensors"]


def test_new_destination_appears_in_one_rename(tmp_path, src, full, monkeypatch):
    a_dir, a = src
    b = _tp((1, 2), tmp_path / "tp2.json")
    dst = tmp_path / "new" / "B"
    seen = []
    renames = _fail_on_call(monkeypatch, "rename", lambda n: False)
    replaces = _fail_on_call(monkeypatch, "replace", lambda n: n == 2)
    convert_checkpoints(
        a_dir, dst, "checkpoint_", a, b, progress=lambda n: seen.append(dst.exists())
    )
    assert seen == [False, False]  # nothing at the destination until every file is complete
    assert len(renames) == 1 and replaces == []
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["B"]
    assert _check(dst, full, b) == 2


def test_failed_rename_of_new_destination_leaves_nothing(tmp_path, src, monkeypatch):
    a_dir, a = src
    b = _tp((1, 2), tmp_path / "tp2.json")
    _fail_on_call(monkeypatch, "rename", lambda n: True)
    with pytest.raises(CheckpointError, match="nothing written") as e:
        convert_checkpoints(a_dir, tmp_path / "new" / "B", "checkpoint_", a, b)
    assert str(tmp_path / "new" / "B") in str(e.value)
    assert not (tmp_path / "new").exists()


def test_interrupt_cleans_up_and_leaves_no_processes(tmp_path, src):
    a_dir, a = src
    b = _tp((1, 4), tmp_path / "tp4b.json")

    def boom(n):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_checkpoints(a_dir, tmp_path / "B", "x_", a, b, process_num=2, progress=boom)
    assert not (tmp_path / "B").exists()
    assert mp.active_children() == []


def test_writer_process_that_dies_is_an_error_not_a_hang(tmp_path, src, monkeypatch):
    from tessel.checkpoint import convert

    a_dir, a = src
    b = _tp((1, 4), tmp_path / "tp4b.json")
    real = convert.run_job

    def dying(job, staging):
        if job.rel_path.startswith("rank_2/"):
            os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would
        return real(job, staging)

    monkeypatch.setattr(convert, "run_job", dying)
    with pytest.raises(CheckpointError, match="writer process died"):
        convert_checkpoints(a_dir, tmp_path / "B", "x_", a, b, process_num=2)
    assert not (tmp_path / "B").exists()
    assert mp.active_children() == []


@pytest.mark.parametrize(
    "error, kind, words",
    [
        (CheckpointError("src.safetensors", "qkv", "source file disappeared"), CheckpointError,
         "src.safetensors: qkv: source file disappeared"),
        (OSError(errno.ENOSPC, "No space left on device", "f"), CheckpointError,
         "B: could not be written: No space left on device \\(f\\); the destination is unchanged"),
        (ZeroDivisionError("a bug"), RuntimeError, "(?s)writer process failed.*ZeroDivisionError: a bug"),
    ],
)  # fmt: skip
def test_error_in_a_writer_process_reaches_the_caller(tmp_path, src, monkeypatch, error, kind,
                                                      words):  # fmt: skip
    from tessel.checkpoint import convert

    a_dir, a = src
    b = _tp((1, 4), tmp_path / "tp4b.json")

    def failing(job, staging):
        raise error

    monkeypatch.setattr(convert, "run_job", failing)
    with pytest.raises(kind, match=words):
        convert_checkpoints(a_dir, tmp_path / "B", "x_", a, b, process_num=2)
    assert not (tmp_path / "B").exists()
    assert mp.active_children() == []


def test_output_would_overwrite_source(tmp_path, src):
    a_dir, a = src
    with pytest.raises(CheckpointError, match="A: is the source .*A: the output replaces"):
        convert_checkpoints(a_dir, a_dir, "checkpoint_", a, a, overwrite=True)
    with pytest.raises(CheckpointError, match="A/rank_0: lies inside the source"):
        convert_checkpoints(a_dir, a_dir / "rank_0", "checkpoint_", a, a, overwrite=True)
    with pytest.raises(CheckpointError, match=f"{tmp_path}: holds the source"):
        convert_checkpoints(a_dir, tmp_path, "checkpoint_", a, a, overwrite=True)
    files = {0: a_dir / "rank_0" / "checkpoint_0.safetensors"}
    with pytest.raises(CheckpointError, match="lies beside the source file"):
        convert_checkpoint_by_rank(0, files, a_dir / "rank_0" / "new.safetensors", a, a)


def test_output_format_and_suffix(tmp_path, src):
    a_dir, a = src
    with pytest.raises(CheckpointError, match="output_format"):
        convert_checkpoints(a_dir, tmp_path / "B", "p", a, a, output_format="ckpt")
    files = {0: a_dir / "rank_0" / "checkpoint_0.safetensors"}
    with pytest.raises(CheckpointError, match=".safetensors"):
        convert_checkpoint_by_rank(0, files, tmp_path / "x.ckpt", a, a)


def test_api_parameter_names_come_first_and_aliases_are_keyword_only():
    sig = inspect.signature(convert_checkpoints).parameters
    assert list(sig)[:7] == ["src_dir", "dst_dir", "dst_prefix", "src_strategy_file",
                             "dst_strategy_file", "process_num", "output_format"]  # fmt: skip
    sig_r = inspect.signature(convert_checkpoint_by_rank).parameters
    assert list(sig_r)[:5] == ["rank_id", "checkpoint_files_map", "save_file",
                               "src_strategy_file", "dst_strategy_file"]  # fmt: skip
    sig_u = inspect.signature(unified_safetensors).parameters
    assert "process_num" in sig_u
    for params, alias in [(sig, "src_checkpoints_dir"), (sig, "dst_checkpoints_dir"),
                          (sig, "ckpt_prefix"), (sig_r, "save_checkpoint_file_name"),
                          (sig_u, "max_process_num")]:  # fmt: skip
        assert params[alias].kind is inspect.Parameter.KEYWORD_ONLY, alias


def test_api_names_and_mindspore_aliases_give_the_same_files(tmp_path, src):
    a_dir, a = src
    b = _tp((1, 2), tmp_path / "tp2.json")
    convert_checkpoints(src_dir=a_dir, dst_dir=tmp_path / "N", dst_prefix="c_",
                        src_strategy_file=a, dst_strategy_file=b, process_num=2,
                        output_format="safetensors")  # fmt: skip
    convert_checkpoints(src_checkpoints_dir=a_dir, dst_checkpoints_dir=tmp_path / "M",
                        ckpt_prefix="c_", src_strategy_file=a, dst_strategy_file=b)  # fmt: skip
    assert files_bytes(tmp_path / "N") == files_bytes(tmp_path / "M")
    assert set(files_bytes(tmp_path / "N")) == {
        "rank_0/c_0.safetensors", "rank_1/c_1.safetensors", "strategy.json"
    }  # fmt: skip
    files = {r: a_dir / f"rank_{r}" / f"checkpoint_{r}.safetensors" for r in (0, 1)}
    convert_checkpoint_by_rank(rank_id=0, checkpoint_files_map=files,
                               save_file=tmp_path / "r" / "new.safetensors",
                               src_strategy_file=a, dst_strategy_file=b)  # fmt: skip
    convert_checkpoint_by_rank(0, files, save_checkpoint_file_name=tmp_path / "r" / "old.safetensors",
                               src_strategy_file=a, dst_strategy_file=b)  # fmt: skip
    new = (tmp_path / "r" / "new.safetensors").read_bytes()
    assert new == (tmp_path / "r" / "old.safetensors").read_bytes()
    assert blank_id(new) == blank_id((tmp_path / "N" / "rank_0" / "c_0.safetensors").read_bytes())
    kw = dict(max_shard_size=600)
    unified_safetensors(a_dir, a, tmp_path / "U1", process_num=2, **kw)
    unified_safetensors(a_dir, a, tmp_path / "U2", max_process_num=2, **kw)
    assert files_bytes(tmp_path / "U1") == files_bytes(tmp_path / "U2")
    assert len(files_bytes(tmp_path / "U1")) > 2


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda d, a, o: convert_checkpoints(d, o, "p", a, a, src_checkpoints_dir=d),
         "'src_dir' and its MindSpore alias 'src_checkpoints_dir'"),
        (lambda d, a, o: convert_checkpoints(d, o, "p", a, a, dst_checkpoints_dir=o),
         "'dst_dir' and its MindSpore alias 'dst_checkpoints_dir'"),
        (lambda d, a, o: convert_checkpoints(src_dir=d, dst_dir=o, dst_prefix="p",
                                             ckpt_prefix="q", src_strategy_file=a),
         "'dst_prefix' and its MindSpore alias 'ckpt_prefix'"),
        (lambda d, a, o: convert_checkpoints(src_dir=d, dst_dir=o, src_strategy_file=a),
         "missing required argument 'dst_prefix' (or its alias 'ckpt_prefix')"),
        (lambda d, a, o: convert_checkpoint_by_rank(
            0, {0: d / "rank_0" / "checkpoint_0.safetensors"}, o / "x.safetensors", a, a,
            save_checkpoint_file_name=o / "y.safetensors"),
         "'save_file' and its MindSpore alias 'save_checkpoint_file_name'"),
        (lambda d, a, o: convert_checkpoint_by_rank(0, {}, src_strategy_file=a),
         "missing required argument 'save_file'"),
        (lambda d, a, o: unified_safetensors(d, a, o, process_num=2, max_process_num=2),
         "'process_num' and its MindSpore alias 'max_process_num'"),
    ],
)  # fmt: skip
def test_name_and_alias_together_is_a_type_error(tmp_path, src, call, words):
    a_dir, a = src
    with pytest.raises(TypeError) as e:
        call(a_dir, a, tmp_path / "out")
    assert words in str(e.value)
    assert not (tmp_path / "out").exists()


def test_sharded_dir_without_strategy(tmp_path, src):
    a_dir, _ = src
    (a_dir / "strategy.json").unlink()
    with pytest.raises(StrategyError, match="src_strategy_file"):
        convert_checkpoints(a_dir, tmp_path / "B", "p", None, None)


def test_layout_rank_list_places_slices_on_listed_ranks(tmp_path, full):
    hf = write_full({"qkv": full["qkv"]}, tmp_path / "hf1")
    rev = tmp_path / "rev.json"
    save_strategy_file(
        rev, {"qkv": (Layout((4,), ("tp",), rank_list=[3, 2, 1, 0])("tp", "None"), (24, 8),
                      "float32")}
    )  # fmt: skip
    shard_checkpoint(hf, tmp_path / "R", rev)
    got = load_file(str(tmp_path / "R/rank_3/checkpoint_3.safetensors"))
    assert torch.equal(got["qkv"], full["qkv"][:6])  # device index 0 is global rank 3
    plain = tmp_path / "plain.json"
    save_strategy_file(plain, {"qkv": (Layout((2,), ("tp",))("tp", "None"), (24, 8), "float32")})
    assert rank_list_for_convert(0, rev, plain) == [3, 2]
    convert_checkpoints(tmp_path / "R", tmp_path / "P", "checkpoint_", rev, plain)
    assert _check(tmp_path / "P", {"qkv": full["qkv"]}, plain) == 2
