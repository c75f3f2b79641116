"""Unifying a tessel training checkpoint: the model's state_dict only, under its keys, with its
config files; optimizer states only where asked; every file read is checked (no session here:
tests/training/test_training.py unifies a checkpoint a Session saved and loads it with
`from_pretrained`)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from tests.json_edits import replaced

from tessel.checkpoint.model_files import STATE_DICT_FILE, state_dict_file
from tessel.checkpoint.publish import StagedTree
from tessel.cli import main as cli
from tessel.parallel import CheckpointError, Layout, save_strategy_file, unified_safetensors

from .helpers import make_full, write_full

SHAPES = {
    "model.embed.weight": (16, 8),
    "lm_head.weight": (16, 8),  # tied to the embedding: the checkpoint holds it once
    "model.rotary.inv_freq": (4,),  # a non-persistent buffer
    "optimizer.exp_avg.model.embed.weight": (16, 8),
    "lifted_tensor_0": (2,),
}
RECORD = {"model.embed.weight": "model.embed.weight", "lm_head.weight": "model.embed.weight"}
CONFIG = {"model_type": "llama", "hidden_size": 8}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A two-rank checkpoint as save_checkpoint writes one: rank files, strategy.json,
    model_state_dict.json and config.json."""
    root = tmp_path_factory.mktemp("unify")
    full = make_full(SHAPES, seed=5)
    hf = write_full(full, root / "full")
    lay = Layout((2,), ("tp",))
    params = {n: (lay("tp") if len(s) == 1 else lay("tp", "None"), s, "float32", {})
              for n, s in SHAPES.items()}  # fmt: skip
    src = root / "ckpt"
    from tessel.parallel import shard_checkpoint

    save_strategy_file(root / "strategy.json", params)
    shard_checkpoint(hf, src, root / "strategy.json")
    shutil.copy(root / "strategy.json", src / "strategy.json")
    (src / STATE_DICT_FILE).write_bytes(state_dict_file(RECORD))
    (src / "config.json").write_text(json.dumps(CONFIG))
    return src, full


def _tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_the_model_directory_holds_the_state_dict_and_config_only(saved, tmp_path, capsys):
    src, full = saved
    dst = tmp_path / "new" / "hf"  # its parent is made
    assert cli(["ckpt", "unify", str(src), str(dst), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "left out 1 optimizer states (--optimizer-states DIR writes them)" in out
    assert (
        "left out 3 other tensors the model's state_dict does not take (tied copies, program "
        "constants, non-persistent buffers): lm_head.weight, model.rotary.inv_freq, "
        "lifted_tensor_0" in out
    ), out
    assert sorted(p.name for p in dst.iterdir()) == [
        "config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json"
    ]  # fmt: skip
    assert json.loads((dst / "config.json").read_text()) == CONFIG
    got = _tensors(dst)
    assert set(got) == set(RECORD)
    assert torch.equal(got["lm_head.weight"], full["model.embed.weight"])
    assert torch.equal(got["model.embed.weight"], full["model.embed.weight"])
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(RECORD)

    states = tmp_path / "states"
    assert cli(["ckpt", "unify", str(src), str(dst), "--optimizer-states", str(states),
                "--overwrite", "--no-progress"]) == 0  # fmt: skip
    name = "optimizer.exp_avg.model.embed.weight"
    assert set(_tensors(states)) == {name}
    assert torch.equal(_tensors(states)[name], full[name])
    assert set(_tensors(dst)) == set(RECORD)

    # the Python API does the same, its strategy taken from the directory
    api = tmp_path / "api"
    unified_safetensors(src, None, api, optimizer_states_dir=tmp_path / "api_states")
    assert set(_tensors(api)) == set(RECORD) and (api / "config.json").is_file()
    assert set(_tensors(tmp_path / "api_states")) == {name}


def test_a_checkpoint_without_the_record_unifies_every_tensor(saved, tmp_path, capsys):
    src, _ = saved
    old = tmp_path / "old"
    shutil.copytree(src, old)
    (old / STATE_DICT_FILE).unlink()
    assert cli(["ckpt", "unify", str(old), str(tmp_path / "hf"), "--no-progress"]) == 0
    assert set(_tensors(tmp_path / "hf")) == set(SHAPES)
    assert "has no model_state_dict.json" in capsys.readouterr().err
    code = cli(["ckpt", "unify", str(old), str(tmp_path / "hf2"), "--optimizer-states",
                str(tmp_path / "s")])  # fmt: skip
    assert code == 2
    assert "--optimizer-states: takes a tessel training checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "hf2").exists() and not (tmp_path / "s").exists()
    with pytest.raises(CheckpointError, match="has no model_state_dict.json"):
        unified_safetensors(old, None, tmp_path / "hf3", optimizer_states_dir=tmp_path / "s")


@pytest.mark.parametrize(
    "file, text, words",
    [
        (STATE_DICT_FILE, "{", "model_state_dict.json: is not valid JSON"),
        (
            STATE_DICT_FILE,
            '{"format": "tessel.model_state_dict", "version": 1, "state_dict": {"w": "nowhere"}}',
            "state_dict.w: names 'nowhere', which the checkpoint does not hold",
        ),  # fmt: skip
        (
            STATE_DICT_FILE,
            '{"format": "tessel.model_state_dict", "version": 2, "state_dict": {}}',
            "model_state_dict.json: version",
        ),  # fmt: skip
        (
            STATE_DICT_FILE,
            '{"format": "tessel.model_state_dict", "version": 1, "state_dict": {"w": 3}}',
            "state_dict.w: expected a checkpoint tensor's name",
        ),  # fmt: skip
        ("config.json", "[1, 2]", "config.json: expected a JSON object, found"),
        ("generation_config.json", '{"a": ', "generation_config.json: is not valid JSON"),
    ],
)
def test_bad_model_files_are_refused_naming_file_and_key(saved, tmp_path, file, text, words):
    src, _ = saved
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    (bad / file).write_text(text)
    with pytest.raises(CheckpointError, match=words.replace("(", r"\(").replace("[", r"\[")):
        unified_safetensors(bad, None, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_edit_of_the_record_unifies_or_is_refused_naming_the_file(saved, tmp_path, data):
    """Any one value of model_state_dict.json replaced by any JSON: unify writes exactly the
    keys the record names, or refuses with the file named."""
    src, full = saved
    record = json.loads(state_dict_file(RECORD))
    edited = replaced(record, data)
    bad = tmp_path / "edited"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(src, bad)
    (bad / STATE_DICT_FILE).write_text(json.dumps(edited))
    out = tmp_path / "hf"
    shutil.rmtree(out, ignore_errors=True)
    try:
        unified_safetensors(bad, None, out)
    except CheckpointError as exc:
        assert STATE_DICT_FILE in str(exc)
        return
    got = _tensors(out)
    assert set(got) == set(edited["state_dict"])
    for key, name in edited["state_dict"].items():
        assert torch.equal(got[key], full[name])


def test_a_staged_tree_makes_its_parents_and_removes_them_when_not_published(tmp_path):
    dst = tmp_path / "a" / "b" / "out"
    with StagedTree(dst, parents=True) as tree:
        (tree.path / "f").write_text("x")
    assert not (tmp_path / "a").exists()
    with StagedTree(dst, parents=True) as tree:
        (tree.path / "f").write_text("x")
        tree.publish()
    assert (dst / "f").read_text() == "x"
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="cannot build the output beside it"):
        with StagedTree(tmp_path / "file" / "out", parents=True):
            pass


def test_the_record_of_a_tied_transformers_model_is_what_from_pretrained_loads(tmp_path):
    """GPT-2 ties its output layer to the embedding: the record leaves `lm_head.weight` out as
    save_pretrained does, and the files written from it load with no key missing or unexpected
    and the same outputs."""
    from safetensors.torch import save_file
    from tests.conftest import hf_gpt2, token_ids
    from transformers import AutoModelForCausalLM

    from tessel.builder.model_record import model_record, state_dict_names

    model = hf_gpt2(layers=1, hidden=32)
    held = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    held += [n for n, _ in model.named_buffers()]
    record = model_record(model, held)
    assert "lm_head.weight" not in record.state_dict
    assert set(record.state_dict) == set(model.state_dict()) - {"lm_head.weight"}
    assert json.loads(record.config)["architectures"] == ["GPT2LMHeadModel"]
    assert record.generation_config is not None
    tensors = model.state_dict()
    save_file({k: tensors[n].contiguous() for k, n in record.state_dict.items()},
              tmp_path / "model.safetensors")  # fmt: skip
    (tmp_path / "config.json").write_bytes(record.config)
    (tmp_path / "generation_config.json").write_bytes(record.generation_config)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set()), info
    ids = token_ids(vocab=256)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)

    # a plain module keeps every key; one the checkpoint lacks takes another name of its tensor
    plain = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4, bias=False))
    plain[1].weight = plain[0].weight
    assert state_dict_names(plain, ["0.weight"]) == {"0.weight": "0.weight", "1.weight": "0.weight"}
