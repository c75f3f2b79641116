"""A `.pt2` is read as data: hostile archives made here (a size expression that would create a
marker file, a node calling something that is not an operator, a pickled weight) are refused by
name and run nothing; an honest archive reads and runs as exported."""

from __future__ import annotations

import json
import re
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessel.capture.pt2 import RefusedArchiveError, check_expression, load_pt2
from tessel.cli import main


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu() * x.shape[0]


@pytest.fixture(scope="module")
def honest(tmp_path_factory) -> Path:
    """A `.pt2` with a dynamic batch size (so it holds size expressions)."""
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=2)
    program = torch.export.export(_Net(), (torch.randn(3, 4),), dynamic_shapes={"x": {0: batch}})
    path = tmp_path_factory.mktemp("pt2") / "net.pt2"
    torch.export.save(program, str(path))
    return path


def _altered(source: Path, target: Path, member: str, edit: Callable[[str], str]) -> Path:
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith(member):
                data = edit(data.decode()).encode()
            dst.writestr(info, data)
    return target


def _first_expression(text: str, replacement: str) -> str:
    found = re.search(r'"expr_str": ("(?:[^"\\]|\\.)*")', text)
    assert found, "the archive holds no size expression: the test would prove nothing"
    return text[: found.start(1)] + json.dumps(replacement) + text[found.end(1) :]


def test_an_honest_archive_reads_and_runs_as_exported(honest):
    program = load_pt2(honest)
    torch.manual_seed(0)
    eager = _Net()
    x = torch.randn(5, 4)
    torch.testing.assert_close(program.module()(x), eager(x))


def test_a_size_expression_that_would_run_code_is_refused_and_runs_nothing(honest, tmp_path):
    marker = tmp_path / "ran"
    payload = f"__import__('pathlib').Path({str(marker)!r}).touch() or s0"
    hostile = _altered(
        honest,
        tmp_path / "hostile.pt2",
        "models/model.json",
        lambda t: _first_expression(t, payload),
    )
    with pytest.raises(RefusedArchiveError, match="a symbolic size .*__import__"):
        load_pt2(hostile)
    assert not marker.exists()
    # torch's own reader runs it: the archive is hostile indeed
    try:
        torch.export.load(str(hostile))
    except Exception:  # noqa: BLE001 - whatever it does after running the payload
        pass
    assert marker.exists()


def test_a_node_that_calls_no_operator_is_refused(honest, tmp_path):
    def redirect(text: str) -> str:
        model = json.loads(text)
        nodes = model["graph_module"]["graph"]["nodes"]
        node = next(n for n in nodes if n["target"].startswith("torch.ops.aten"))
        node["target"] = "torch.serialization.os.system"
        return json.dumps(model)

    hostile = _altered(honest, tmp_path / "hostile.pt2", "models/model.json", redirect)
    with pytest.raises(RefusedArchiveError, match="'torch.serialization.os.system', which is not"):
        load_pt2(hostile)


def test_a_pickled_weight_is_refused_unread(honest, tmp_path):
    def pickled(text: str) -> str:
        config = json.loads(text)
        config["config"][next(iter(config["config"]))]["use_pickle"] = True
        return json.dumps(config)

    hostile = _altered(honest, tmp_path / "hostile.pt2", "model_weights_config.json", pickled)
    with pytest.raises(RefusedArchiveError, match="is stored as a pickle"):
        load_pt2(hostile)


def test_tessel_build_names_the_refused_model_file(honest, tmp_path, capsys):
    payload = "exec('1') or s0"
    hostile = _altered(
        honest,
        tmp_path / "hostile.pt2",
        "models/model.json",
        lambda t: _first_expression(t, payload),
    )
    code = main(["build", f"--model={hostile}", "--soc_version=cpu", f"--output={tmp_path}/o"])
    assert code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hostile.pt2" in err[0] and "names 'exec'" in err[0]


@settings(derandomize=True, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.text(
        alphabet=st.sampled_from("s0u1()'.,_=+-*/ aeximportSymbolInteger[]:\"lambd"), max_size=40
    )
)
def test_a_size_expression_the_grammar_takes_cannot_reach_outside_sympy(text):
    """Whatever the grammar takes holds no attribute, subscript, lambda, string of code or
    name beginning with an underscore: evaluating it can only call sympy's classes."""
    try:
        check_expression(text)
    except RefusedArchiveError:
        return
    outside = re.sub(r"'[^']*'", "''", text)  # quoted: a size symbol or a number only
    assert not re.search(r"[\[\]:\"\\]", outside)
    assert not re.search(r"\.\s*[A-Za-z_]", outside)
    assert not re.search(r"(?<![A-Za-z0-9])_", outside)
    assert all(re.fullmatch(r"[a-z]+[0-9]+|[-+]?[0-9][0-9.e+-]*|[-+]?inf|nan", q)
               for q in re.findall(r"'([^']*)'", text))  # fmt: skip
