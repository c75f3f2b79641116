"""A DCP checkpoint written by torch's own dcp.save from DTensors, read without pickle."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tessel.checkpoint.dcp import read_dcp_metadata
from tessel.checkpoint.strategy import load_strategy
from tessel.cli import main as tessel_main
from tessel.parallel import (
    CheckpointError,
    Layout,
    convert_checkpoints,
    layout_from_dtensor,
    save_strategy_file,
    shard_checkpoint,
    unified_safetensors,
)

from .dcp_writer import PLACEMENTS, full_tensors
from .helpers import ref_rank_slices


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    out, init = root / "ckpt", root / "init"
    script = Path(__file__).with_name("dcp_writer.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), "4", str(out), str(init)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        for r in range(4)
    ]  # fmt: skip
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=120)[0].decode())
        finally:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return out


def test_metadata_read_with_restricted_unpickler(dcp_dir):
    meta = read_dcp_metadata(dcp_dir)
    assert set(meta.state_dict_metadata) == {"w", "b", "r", "m", "step"}
    assert list(meta.state_dict_metadata["w"].size) == [8, 6]


def test_a_data_file_its_metadata_names_must_be_there(dcp_dir, tmp_path):
    """A DCP directory records no tessel checkpoint id: every rank's data file its .metadata
    names must be there, or it is refused by name before anything is written."""
    partial = tmp_path / "partial"
    shutil.copytree(dcp_dir, partial)
    gone = sorted(partial.glob("*.distcp"))[-1]
    gone.unlink()
    with pytest.raises(CheckpointError, match=f"{gone}: is named by .*.metadata but does not "
                       "exist: the directory does not hold the whole checkpoint"):  # fmt: skip
        unified_safetensors(partial, None, tmp_path / "U")
    assert not (tmp_path / "U").exists()


def test_unify_dcp_equals_full(dcp_dir, tmp_path):
    unified_safetensors(dcp_dir, None, tmp_path / "U")
    got = load_file(str(tmp_path / "U" / "model-00001-of-00001.safetensors"))
    full = full_tensors()
    assert set(got) == set(full)
    for k in full:
        assert got[k].dtype == full[k].dtype and torch.equal(got[k], full[k]), k


def test_convert_dcp_to_strategy(dcp_dir, tmp_path):
    lay = Layout((2, 2), ("dp", "tp"))
    b = tmp_path / "b.json"
    save_strategy_file(b, {
        "w": (lay(("tp", "dp"), "None"), (8, 6), "float32"),
        "b": (lay("None"), (8,), "bfloat16", {"opt_shard_size": 2}),
        "r": (lay("tp", "dp"), (4, 4), "float32"),
        "m": (lay("dp", "None"), (6, 4), "float32", {"stage": [0, 1]}),
    })  # fmt: skip
    convert_checkpoints(dcp_dir, tmp_path / "B", "checkpoint_", None, b, process_num=2)
    st, full = load_strategy(b), full_tensors()
    for r in range(st.world_size):
        want = ref_rank_slices(full, st, r)
        got = load_file(str(tmp_path / "B" / f"rank_{r}" / f"checkpoint_{r}.safetensors"))
        assert set(got) == set(want)
        assert all(torch.equal(got[k], want[k]) for k in want), r


def test_layout_of_dtensor_placements_reads_same_slices(dcp_dir, tmp_path):
    """The Layout derived from each DTensor's placements slices the data exactly as DCP stored."""
    from tessel.checkpoint.sources import DCPSource
    from tessel.checkpoint.strategy import param_from_layout

    src = DCPSource(dcp_dir)
    for k, make in PLACEMENTS.items():
        shape, _ = src.info(k)
        lay = layout_from_dtensor((2, 2), make(), len(shape), ("dp", "tp"))
        p = param_from_layout(k, lay, shape, None)
        from tessel.checkpoint.boxes import distinct_boxes

        assert {c.box for c in src.chunks(k)} == set(distinct_boxes(p, shape)), k


def test_cli_unify_dcp_without_strategy(dcp_dir, tmp_path, capsys):
    assert tessel_main(["ckpt", "unify", str(dcp_dir), str(tmp_path / "U"), "--no-progress"]) == 0
    got = load_file(str(tmp_path / "U" / "model-00001-of-00001.safetensors"))
    assert torch.equal(got["w"], full_tensors()["w"])
    assert tessel_main(["ckpt", "inspect", str(dcp_dir)]) == 0
    assert "kind=dcp" in capsys.readouterr().out


def test_shard_from_dcp(dcp_dir, tmp_path):
    b = tmp_path / "b.json"
    save_strategy_file(b, {"w": (Layout((3,), ("tp",))("None", "tp"), (8, 6), "float32")})
    shard_checkpoint(dcp_dir, tmp_path / "S", b)
    got = load_file(str(tmp_path / "S" / "rank_2" / "checkpoint_2.safetensors"))
    assert torch.equal(got["w"], full_tensors()["w"][:, 4:6])


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_malicious_metadata_is_refused(tmp_path):
    d = tmp_path / "evil"
    d.mkdir()
    (d / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointError, match="not allowed"):
        read_dcp_metadata(d)
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()


def test_malicious_chunk_pickle_is_refused(dcp_dir, tmp_path):
    import shutil
    import zipfile

    d = tmp_path / "copy"
    shutil.copytree(dcp_dir, d)
    # replace every chunk archive's data.pkl with a pickle that calls os.system
    from tessel.checkpoint.sources import DCPSource

    src = DCPSource(d)
    ch = src.chunks("r")[0]
    f = Path(ch.holders[0])
    raw = f.read_bytes()
    buf = __import__("io").BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps(_Evil(), protocol=2))
        z.writestr("archive/data/0", b"\0" * 64)
    evil = buf.getvalue()
    meta = read_dcp_metadata(d)
    for idx, info in meta.storage_data.items():
        if idx.fqn == "r":
            assert len(evil) <= info.length
            raw = (
                raw[: info.offset]
                + evil.ljust(info.length, b"\0")
                + raw[info.offset + info.length :]
            )
    f.write_bytes(raw)
    with pytest.raises(CheckpointError, match="r"):
        unified_safetensors(d, None, tmp_path / "U")
    assert not Path("pwned").exists()


def test_dcp_safetensors_serialization_format(tmp_path):
    """DCP's SAFETENSORS serialization format (one safetensors file per rank) is read too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

    full = {"a": torch.randn(4, 6), "b": torch.arange(5, dtype=torch.int32)}
    w = FileSystemWriter(str(tmp_path / "d"), serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save(dict(full), storage_writer=w, no_dist=True)
    unified_safetensors(tmp_path / "d", None, tmp_path / "U")
    got = load_file(str(tmp_path / "U" / "model-00001-of-00001.safetensors"))
    assert all(torch.equal(got[k], full[k]) for k in full)
