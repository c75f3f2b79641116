"""`tessel build` with ATC's gear flags and `tessel generate`, as a user types them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.conftest import hf_llama, subprocess_env

from tessel.cli import main
from tessel.config.errors import ConfigError
from tessel.config.generation import generation_from_flags

ROOT = Path(__file__).resolve().parents[1]
TESSEL = [sys.executable, "-m", "tessel.cli"]
VOCAB = 64
MODEL_PY = """
import sys
sys.path.insert(0, {root!r})
import torch
from tests.conftest import hf_llama

def build():
    torch.manual_seed(0)
    return hf_llama(2, 64, 4, 2, {vocab}).eval(), (torch.randint(0, {vocab}, (2, 12)),)
"""


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return hf_llama(2, 64, 4, 2, VOCAB).eval()


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    """The small Llama built by `tessel build` with two gears (and a one-row prefill gear of
    each length, which `generate` leaves to servers), on two devices."""
    d = tmp_path_factory.mktemp("gen_cli")
    (d / "model.py").write_text(MODEL_PY.format(root=str(ROOT), vocab=VOCAB))
    cluster = json.loads((ROOT / "examples" / "cluster_4p.json").read_text())
    cluster["cluster"][0]["cluster_nodes"][0]["item_list"] = [{"item_id": 0}, {"item_id": 1}]
    (d / "cluster_2p.json").write_text(json.dumps(cluster))
    option = {"graph_parallel_option": {"auto": True}}
    (d / "parallel_option.json").write_text(json.dumps(option))
    built = subprocess.run(
        TESSEL
        + [
            "build",
            f"--model={d}/model.py:build",
            "--input_shape=input_ids:-1,-1",
            "--dynamic_dims=1,8;2,8;2,16",
            "--max_seq_len=32",
            "--row_prefill",
            f"--cluster_config={d}/cluster_2p.json",
            "--distributed_cluster_build=1",
            "--enable_graph_parallel=1",
            f"--graph_parallel_option_path={d}/parallel_option.json",
            f"--output={d}/llama_gen",
        ],
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr
    return d / "llama_gen.tessel"


def _want(ids: torch.Tensor, mask: torch.Tensor, new: int) -> torch.Tensor:
    return _model().generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new,
        do_sample=False,
        cache_implementation="static",
        pad_token_id=0,
    )


def test_inspect_shows_the_gears_and_the_cache(package) -> None:
    shown = subprocess.run(
        TESSEL + ["inspect", str(package)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # the gears' batches 1 and 2 run in the cache's two rows; lengths 8 and 16 are the prefills
    assert "generation: up to 2 rows of 32 tokens; prefill gears of 8, 16 tokens" in shown
    assert "cache, keys and values: 4 tensors" in shown
    assert "each admission's prefill computes its own row (one-row prefill gears)" in shown


def test_generate_from_token_ids_equals_transformers(package, tmp_path) -> None:
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    save_file({"input_ids": ids, "attention_mask": mask}, str(tmp_path / "prompt.safetensors"))
    run = subprocess.run(
        TESSEL
        + [
            "generate",
            str(package),
            "--input-ids",
            str(tmp_path / "prompt.safetensors"),
            "--max-new-tokens=12",
            "--output",
            str(tmp_path / "out.safetensors"),
        ],
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    want = _want(ids, mask, 12)
    got = load_file(str(tmp_path / "out.safetensors"))["sequences"]
    assert torch.equal(got, want)
    # each row's new tokens, one row a line, then where they were written
    lines = run.stdout.splitlines()
    assert lines[-4].startswith("12 new tokens per row: the first in")
    assert lines[-3:-1] == [" ".join(map(str, row.tolist())) for row in want[:, 10:]]
    assert lines[-1] == f"wrote {tmp_path / 'out.safetensors'}"


def test_generate_min_length_equals_transformers(package, tmp_path) -> None:
    """`--min-length` (a flag made from `Sampling`'s field) reaches the loop: the greedy first
    token as the eos token ends the row at once, unless the row must first hold 14 tokens."""
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    eos = int(_want(ids, mask, 1)[0, -1])
    save_file({"input_ids": ids}, str(tmp_path / "prompt.safetensors"))
    flags = ["--input-ids", str(tmp_path / "prompt.safetensors"), "--max-new-tokens=6"]
    flags += [f"--eos-token-id={eos}", "--pad-token-id=0", "--min-length=14"]
    out = str(tmp_path / "out.safetensors")
    assert main(["generate", str(package), *flags, "--output", out]) == 0
    want = _model().generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        min_length=14,
        eos_token_id=eos,
        pad_token_id=0,
        do_sample=False,
        cache_implementation="static",
    )
    got = load_file(out)["sequences"]
    assert torch.equal(got, want)
    assert eos not in got[0, 10:14].tolist()  # without --min-length, got[0, 10] is eos


def _tokenizer(directory: Path):
    """A word-level tokenizer over the model's vocabulary: `w0` ... `w63`, `<pad>` at 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>")
    tokenizer.save_pretrained(directory)
    return tokenizer


def test_generate_from_text_with_a_saved_tokenizer(package, tmp_path) -> None:
    tokenizer = _tokenizer(tmp_path / "tok")
    prompts = ["w5 w9 w13 w2 w40", "w7 w1"]
    run = subprocess.run(
        TESSEL
        + ["generate", str(package), "--tokenizer", str(tmp_path / "tok"), "--max-new-tokens=6"]
        + [f"--prompt={p}" for p in prompts],
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    tokenizer.padding_side = "left"
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    want = _want(encoded["input_ids"], encoded["attention_mask"], 6)[:, 5:]
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in want]
    assert run.stdout.splitlines()[-2:] == texts
    # streamed: one prompt's text as it is made
    run = subprocess.run(
        TESSEL
        + ["generate", str(package), "--tokenizer", str(tmp_path / "tok"), "--max-new-tokens=6"]
        + ["--stream", f"--prompt={prompts[0]}"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == texts[0]


def test_bad_generate_arguments_get_tessels_errors(package, tmp_path, capsys) -> None:
    save_file({"ids": torch.zeros(1, 4, dtype=torch.long)}, str(tmp_path / "misnamed.safetensors"))
    save_file({"input_ids": torch.zeros(1, 4)}, str(tmp_path / "floats.safetensors"))
    save_file(
        {"input_ids": torch.zeros(3, 4, dtype=torch.long)}, str(tmp_path / "rows.safetensors")
    )
    save_file({"input_ids": torch.ones(1, 4, dtype=torch.long)}, str(tmp_path / "ok.safetensors"))
    several = ("--eos-token-id", "1", "--eos-token-id", str(VOCAB))  # each in the vocabulary
    cases = {
        ("--input-ids", str(tmp_path / "ok.safetensors"), *several): "eos_token_id: must be a "
        f"token id from 0 to {VOCAB - 1}, found {VOCAB}",
        ("--input-ids", str(tmp_path / "ok.safetensors"), "--suppress-token", str(VOCAB)): (
            f"suppress_tokens: must be a token id from 0 to {VOCAB - 1}, found {VOCAB}"
        ),
        ("--input-ids", str(tmp_path / "ok.safetensors"), "--min-p=0.5"): "min_p: takes effect "
        "only with do_sample=True",
        ("--input-ids", str(tmp_path / "misnamed.safetensors")): "input_ids: is missing",
        ("--input-ids", str(tmp_path / "floats.safetensors")): "found [1, 4] float32",
        ("--input-ids", str(tmp_path / "nothing.safetensors")): "no such file",
        ("--prompt=w1 w2",): "--prompt: needs --tokenizer",
        (): "give the prompt one way",
        ("--input-ids", str(tmp_path / "rows.safetensors")): "has 3 rows; the package's cache "
        "takes 1 to 2",
    }
    for extra, message in cases.items():
        assert main(["generate", str(package), *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra


@pytest.mark.parametrize(
    "input_shape,dynamic_dims,max_seq_len,message",
    [
        ("input_ids:-1,-1", None, 64, "--dynamic_dims: is required"),
        ("input_ids:2,16", "1,8", 64, "has none"),
        ("input_ids:-1,-1", "1,8;4", 64, "gear '4' gives 1 value(s)"),
        ("input_ids:-1,-1", "1,x", 64, "holds 'x'"),
        ("tokens:-1,-1", "1,8", 64, "takes one input, input_ids"),
        ("input_ids:-1", "8", 64, "has 1 dimensions"),
        ("input_ids:-1,-1", "1,64", 64, "leaves no room for a new token"),
        (None, None, 64, "--input_shape: is required"),
        ("input_ids:-1,-1", "1,8", None, "--max_seq_len: is required"),
    ],
)
def test_gear_flags_are_read_as_atc_writes_them(
    input_shape, dynamic_dims, max_seq_len, message
) -> None:
    with pytest.raises(ConfigError, match=None) as caught:
        generation_from_flags(input_shape, dynamic_dims, max_seq_len)
    assert message in str(caught.value)


def test_gear_flags_give_the_cache_and_the_prefill_gears() -> None:
    g = generation_from_flags("input_ids:-1,-1", "1,64;4,64;4,256", 1024)
    assert (g.max_batch_size, g.max_seq_len, g.prefill_lengths) == (4, 1024, (64, 256))
    g = generation_from_flags('"input_ids:1,-1"', "128;32", 512)
    assert (g.max_batch_size, g.prefill_lengths) == (1, (32, 128))
    g = generation_from_flags("input_ids:3,100", None, 200)
    assert (g.max_batch_size, g.prefill_lengths) == (3, (100,))


def test_a_generation_build_refuses_what_it_cannot_capture(tmp_path, capsys) -> None:
    flags = ["--input_shape=input_ids:-1,-1", "--dynamic_dims=1,8", "--max_seq_len=16"]
    args = ["build", f"--output={tmp_path}/x", *flags]
    assert main([*args, "--model=m.pt2"]) == 2
    assert "captures a transformers causal LM from file.py:function" in capsys.readouterr().err
    (tmp_path / "m.py").write_text(MODEL_PY.format(root=str(ROOT), vocab=VOCAB))
    two = ["--distributed_cluster_build=1", "--enable_graph_parallel=0"]
    assert main([*args, f"--model={tmp_path}/m.py:build", *two]) == 2
    assert "--enable_graph_parallel: must be 1 for a generation build" in capsys.readouterr().err
    plain = ["build", f"--output={tmp_path}/y", f"--model={tmp_path}/m.py:build", "--row_prefill"]
    assert main(plain) == 2
    assert "--row_prefill: adds gears to a generation build" in capsys.readouterr().err
