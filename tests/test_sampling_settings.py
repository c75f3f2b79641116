"""One source for the sampling settings: `Sampling`'s fields, each with its help, are
`Session.generate`'s keywords and `tessel generate`'s flags, none added or left out."""

from __future__ import annotations

import inspect
import subprocess
import sys
from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from tests.conftest import subprocess_env

from tessel.cli import main, make_parser
from tessel.config.sampling import SAMPLING_FIELDS, Sampling
from tessel.runtime import cli_run
from tessel.runtime.session import Session

NAMES = {f.name for f in fields(Sampling)}
# Session.generate's arguments that are not sampling settings
GENERATE_ARGUMENTS = {
    "self",
    "graph_id",
    "input_ids",
    "attention_mask",
    "max_new_tokens",
    "eos_token_id",
    "pad_token_id",
    "stream",
}
# tessel generate's flags (their dests) that are not sampling settings
GENERATE_FLAGS = {
    "command",
    "log",
    "func",
    "model",
    "input_ids",
    "tokenizer",
    "prompt",
    "max_new_tokens",
    "eos_token_id",
    "pad_token_id",
    "stream",
    "output",
    "node_id",
}


def test_each_sampling_field_is_described_once() -> None:
    assert [s.name for s in SAMPLING_FIELDS] == [f.name for f in fields(Sampling)]
    for setting, f in zip(SAMPLING_FIELDS, fields(Sampling)):
        assert setting.help.endswith(".") and setting.help == f.metadata["help"], f.name
        assert setting.kind in (bool, int, float) and setting.default == f.default, f.name
    several = {s.name for s in SAMPLING_FIELDS if s.several}
    assert several == {"suppress_tokens", "forced_eos_token_id"}
    # tessel inspect reads a package's settings without torch
    code = "import sys, tessel.config.sampling; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], env=subprocess_env(), check=True)


def test_session_generate_takes_each_sampling_field_by_keyword() -> None:
    parameters = inspect.signature(Session.generate).parameters.values()
    named = {p.name for p in parameters if p.kind is not p.VAR_KEYWORD}
    assert named - GENERATE_ARGUMENTS == NAMES, "a Sampling field and a keyword differ"
    assert GENERATE_ARGUMENTS <= named
    for p in parameters:
        if p.name in NAMES:  # by keyword, None for not asked (the model's setting)
            assert p.kind is p.KEYWORD_ONLY and p.default is None, p.name


def test_session_generate_asks_each_keyword(monkeypatch) -> None:
    """Each keyword reaches the settings resolved against the model's, under its name."""
    seen = {}

    def sampling_for(asked, model):
        seen.update(asked)
        raise KeyboardInterrupt  # stop before the workers

    monkeypatch.setattr("tessel.runtime.session.sampling_for", sampling_for)
    session = object.__new__(Session)
    gears = SimpleNamespace(defaults={})
    graph = SimpleNamespace(package=SimpleNamespace(manifest=SimpleNamespace(generation=gears)))
    session._graph = lambda graph_id: graph  # type: ignore[method-assign]
    given = {name: object() for name in NAMES}
    with pytest.raises(KeyboardInterrupt):
        session.generate(0, torch.zeros(1, 4, dtype=torch.long), **given)
    assert seen == given


def test_generate_flags_are_the_sampling_fields() -> None:
    parsed = vars(make_parser().parse_args(["generate", "model.tessel"]))
    assert set(parsed) - GENERATE_FLAGS == NAMES, "a Sampling field and a flag differ"
    assert all(parsed[name] is None for name in NAMES)  # not asked: the model's setting


def test_generate_flags_tell_the_fields_help(capsys) -> None:
    with pytest.raises(SystemExit):
        make_parser().parse_args(["generate", "--help"])
    shown = "".join(capsys.readouterr().out.split())  # as wrapped, whitespace aside
    for setting in SAMPLING_FIELDS:
        assert "".join(setting.help.split()) in shown, setting.name


class _Session:
    """Session's stand-in: records what generate is given and makes one token per row."""

    calls: list[dict] = []

    def load_graph(self, graph_id, options, path) -> None:
        pass

    def generate(self, graph_id, ids, mask, max_new_tokens, **settings):
        self.calls.append(settings)
        return iter([torch.ones(len(ids), dtype=torch.long)])


@pytest.fixture
def fake_run(monkeypatch, tmp_path):
    """tessel generate's run with Session, its package and its processes stood in for: the
    settings generate is given, per call of `run(*flags)`."""
    gears = SimpleNamespace(decoder_start_token_id=None)
    package = SimpleNamespace(manifest=SimpleNamespace(generation=gears))
    monkeypatch.setattr(cli_run.Package, "open", lambda path: package)
    monkeypatch.setattr(cli_run, "Session", _Session)
    monkeypatch.setattr(cli_run, "initialize", lambda: None)
    monkeypatch.setattr(cli_run, "finalize", lambda: None)
    monkeypatch.setattr(_Session, "calls", [])
    prompt = tmp_path / "prompt.safetensors"
    save_file({"input_ids": torch.ones(1, 4, dtype=torch.long)}, str(prompt))

    def run(*flags: str) -> dict:
        assert main(["generate", "model.tessel", "--input-ids", str(prompt), *flags]) == 0
        return _Session.calls[-1]

    return run


def test_generate_min_length_reaches_the_call(fake_run) -> None:
    settings = fake_run("--min-length", "7")
    assert settings["min_length"] == 7
    assert all(settings[name] is None for name in NAMES - {"min_length"})


def test_each_generate_flag_reaches_the_call(fake_run) -> None:
    """Every flag as a user types it (the spellings the docs and scripts use), under the
    keyword of its setting."""
    flags = [
        "--do-sample",
        "--temperature=0.5",
        "--top-k=3",
        "--top-p=0.9",
        "--seed=4",
        "--repetition-penalty=1.2",
        "--no-repeat-ngram-size=2",
        "--min-length=7",
        "--min-new-tokens=2",
        "--min-p=0.1",
        "--typical-p=0.8",
        "--epsilon-cutoff=0.01",
        "--eta-cutoff=0.02",
        "--suppress-token=5",
        "--suppress-token=6",
        "--forced-bos-token-id=1",
        "--forced-eos-token-id=2",
        "--forced-eos-token-id=3",
        "--eos-token-id=9",
        "--pad-token-id=0",
    ]
    want = dict(
        do_sample=True,
        temperature=0.5,
        top_k=3,
        top_p=0.9,
        seed=4,
        repetition_penalty=1.2,
        no_repeat_ngram_size=2,
        min_length=7,
        min_new_tokens=2,
        min_p=0.1,
        typical_p=0.8,
        epsilon_cutoff=0.01,
        eta_cutoff=0.02,
        suppress_tokens=[5, 6],
        forced_bos_token_id=1,
        forced_eos_token_id=[2, 3],
        eos_token_id=[9],
        pad_token_id=0,
        stream=True,
    )
    assert set(want) - {"eos_token_id", "pad_token_id", "stream"} == NAMES  # a new field: add it
    assert fake_run(*flags) == want
    Sampling(**{name: want[name] for name in NAMES})  # values a call takes
    assert fake_run("--no-do-sample")["do_sample"] is False
