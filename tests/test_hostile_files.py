"""Files tessel reads as data, mutated at random (hypothesis, derandomized): a `.pt2` archive's
program, a model relation config, a checkpoint rank file's header. Every mutation reads, or is
refused with tessel's own error naming the file; nothing else escapes."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from tests.json_edits import replaced

from tessel.capture.pt2 import RefusedArchiveError, load_pt2
from tessel.checkpoint.errors import CheckpointError
from tessel.config.errors import ConfigError
from tessel.runtime.worker import _checkpoint_tensors
from tessel.slices.relation import read_model_relation

_FIXTURES = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> tuple[Path, str, dict]:
    """A `.pt2` with a dynamic batch: its path, its program member's name and its program."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).relu() * x.shape[0]

    batch = torch.export.Dim("batch", min=2)
    program = torch.export.export(Net(), (torch.randn(3, 4),), dynamic_shapes={"x": {0: batch}})
    path = tmp_path_factory.mktemp("pt2") / "net.pt2"
    torch.export.save(program, str(path))
    with zipfile.ZipFile(path) as z:
        member = next(n for n in z.namelist() if n.endswith("models/model.json"))
        return path, member, json.loads(z.read(member))


@settings(max_examples=120, deadline=None, suppress_health_check=_FIXTURES)
@given(data=st.data())
def test_any_edit_of_a_pt2_program_reads_or_is_refused(archive, tmp_path, data):
    source, member, program = archive
    edited = json.dumps(replaced(program, data)).encode()
    target = tmp_path / "edited.pt2"
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, edited if info.filename == member else src.read(info))
    try:
        load_pt2(target)
    except RefusedArchiveError:
        pass


RELATION = {
    "deploy_config": [
        {"submodel_name": "rank0.pt2", "deploy_device_id_list": "0:0:0"},
        {"submodel_name": "rank1.pt2", "deploy_device_id_list": "0:0:1"},
    ],
    "model_name_to_instance_id": [
        {"submodel_name": "rank0.pt2", "model_instance_id": 0},
        {"submodel_name": "rank1.pt2", "model_instance_id": 1},
    ],
    "comm_group": [{"group_name": "tp", "group_rank_list": "[0,1]"}],
    "rank_table": [{"rank_id": 0, "model_instance_id": 0}, {"rank_id": 1, "model_instance_id": 1}],
}


@settings(max_examples=300, deadline=None, suppress_health_check=_FIXTURES)
@given(data=st.data())
def test_any_edit_of_a_model_relation_config_reads_or_is_refused(tmp_path, data):
    path = tmp_path / "model_relation_config.json"
    path.write_text(json.dumps(replaced(RELATION, data)))
    try:
        relation = read_model_relation(path)
    except ConfigError as exc:
        assert str(path) in str(exc)
        return
    for entry in relation.slices:  # what reads is inside the slice directory
        assert "/" not in entry.submodel_name and entry.submodel_name not in ("", ".", "..")
    assert all(list(r) == sorted(r) for r in relation.groups.values())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict]:
    """A rank file of a checkpoint, and the layout a step holding its tensors expects."""
    tensors = {"w": torch.ones(4, 3), "optimizer.exp_avg.w": torch.zeros(4, 3),
               "optimizer.step": torch.tensor(3.0)}  # fmt: skip
    folder = tmp_path_factory.mktemp("ckpt")
    (folder / "rank_0").mkdir()
    save_file(tensors, folder / "rank_0" / "checkpoint_0.safetensors")
    layout = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors.items()}
    return folder, layout


@settings(max_examples=200, deadline=None, suppress_health_check=_FIXTURES)
@given(data=st.data())
def test_any_edit_of_a_checkpoint_rank_files_header_loads_or_is_refused(checkpoint, tmp_path, data):
    """The safetensors header (names, dtypes, shapes, offsets) edited: the rank's tensors load
    exactly as the step holds them, or the file is refused by name."""
    folder, layout = checkpoint
    raw = (folder / "rank_0" / "checkpoint_0.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = replaced(json.loads(raw[8 : 8 + size]), data)
    text = json.dumps(header).encode()
    edited = tmp_path / "rank_0"
    edited.mkdir(exist_ok=True)
    (edited / "checkpoint_0.safetensors").write_bytes(
        struct.pack("<Q", len(text)) + text + raw[8 + size :]
    )
    try:
        tensors = _checkpoint_tensors(str(tmp_path), 0, torch.device("cpu"), layout)
    except CheckpointError as exc:
        assert "checkpoint_0.safetensors" in str(exc)
        return
    for name, (shape, dtype) in layout.items():
        assert tuple(tensors[name].shape) == shape
        assert str(tensors[name].dtype).removeprefix("torch.") == dtype
