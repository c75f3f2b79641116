"""`tessel ckpt ...` commands, run in process through tessel.cli.main."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from safetensors.torch import load_file
from tests.conftest import on_a_terminal

from tessel.cli import main
from tessel.parallel import Layout, save_strategy_file

from .helpers import make_full, write_full

SHAPES = {"qkv": (12, 4), "out": (4, 12)}


def _strategies(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    l4, l2 = Layout((4,), ("tp",)), Layout((2,), ("tp",))
    save_strategy_file(a, {"qkv": (l4("tp", "None"), (12, 4), "float32"),
                           "out": (l4("None", "tp"), (4, 12), "float32")})  # fmt: skip
    save_strategy_file(b, {"qkv": (l2("tp", "None"), (12, 4), "float32"),
                           "out": (l2("None", "tp"), (4, 12), "float32")})  # fmt: skip
    return a, b


def test_shard_convert_unify_ranks_inspect(tmp_path, capsys):
    full = make_full(SHAPES)
    hf = write_full(full, tmp_path / "hf")
    a, b = _strategies(tmp_path)
    assert main(["ckpt", "shard", str(hf), str(tmp_path / "A"), "--strategy", str(a),
                 "--no-progress"]) == 0  # fmt: skip
    assert main(["ckpt", "convert", str(tmp_path / "A"), str(tmp_path / "B"), "--src-strategy",
                 str(a), "--dst-strategy", str(b), "-j", "2", "--no-progress"]) == 0  # fmt: skip
    got = load_file(str(tmp_path / "B/rank_1/checkpoint_1.safetensors"))
    assert torch.equal(got["out"], full["out"][:, 6:])
    assert main(["ckpt", "unify", str(tmp_path / "B"), str(tmp_path / "U"), "--strategy", str(b),
                 "--no-progress"]) == 0  # fmt: skip
    u = load_file(str(tmp_path / "U/model-00001-of-00001.safetensors"))
    assert all(torch.equal(u[k], full[k]) for k in full)
    capsys.readouterr()
    assert main(["ckpt", "ranks", "1", "--src-strategy", str(a), "--dst-strategy", str(b)]) == 0
    assert capsys.readouterr().out.split() == ["3", "2"]
    assert main(["ckpt", "inspect", str(b), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "strategy" and data["world_size"] == 2
    assert main(["ckpt", "inspect", str(tmp_path / "B"), "--strategy", str(b)]) == 0
    assert "qkv: shape=[12, 4]" in capsys.readouterr().out


def test_bad_input_is_a_clean_error(tmp_path):
    a, b = _strategies(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "tessel.cli", "ckpt", "convert", str(tmp_path / "missing"),
         str(tmp_path / "B"), "--src-strategy", str(a), "--dst-strategy", str(b)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert "tessel: error:" in out.stderr and "does not exist" in out.stderr
    assert "Traceback" not in out.stderr


def test_progress_bar_is_shown_on_a_terminal_only(tmp_path):
    full = make_full(SHAPES)
    hf = write_full(full, tmp_path / "hf")
    a, _ = _strategies(tmp_path)
    argv = [sys.executable, "-m", "tessel.cli", "ckpt", "shard", str(hf), str(tmp_path / "A"),
            "--strategy", str(a)]  # fmt: skip
    code, text = on_a_terminal(argv, tmp_path)
    assert code == 0, text
    assert "writing 4 files" in text and "100%" in text
    piped = subprocess.run([*argv, "--overwrite"], capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0, piped.stderr
    assert "writing 4 files" not in piped.stderr and "%" not in piped.stderr


def test_convert_with_the_api_s_option_names(tmp_path):
    """`--dst-prefix` / `--process-num` are the API's names; `--prefix` / `-j` stay as aliases."""
    full = make_full(SHAPES)
    hf = write_full(full, tmp_path / "hf")
    a, b = _strategies(tmp_path)
    assert main(["ckpt", "shard", str(hf), str(tmp_path / "A"), "--strategy", str(a),
                 "--dst-prefix", "w_", "--no-progress"]) == 0  # fmt: skip
    assert (tmp_path / "A/rank_3/w_3.safetensors").is_file()
    assert main(["ckpt", "convert", str(tmp_path / "A"), str(tmp_path / "B"), "--src-strategy",
                 str(a), "--dst-strategy", str(b), "--dst-prefix", "tp2_", "--process-num", "2",
                 "--no-progress"]) == 0  # fmt: skip
    got = load_file(str(tmp_path / "B/rank_0/tp2_0.safetensors"))
    assert torch.equal(got["qkv"], full["qkv"][:6])
    assert main(["ckpt", "convert", str(tmp_path / "A"), str(tmp_path / "C"), "--src-strategy",
                 str(a), "--prefix", "old_", "-j", "1", "--no-progress"]) == 0  # fmt: skip
    assert torch.equal(load_file(str(tmp_path / "C/rank_0/old_0.safetensors"))["out"], full["out"])
