"""A `.pt2` from `torch.export.save` builds at the input shapes its program records, or at those
`--input_shape` fixes within what the program takes, and runs to the eager module's outputs;
shapes the program does not take are refused naming the flag, the input, what was found and
what is allowed. Programs with keyword, nested and constant inputs, dynamic and derived sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tessel
from tessel.capture.pt2 import load_pt2
from tessel.cli import main
from tessel.config.errors import ConfigError
from tessel.package import Package
from tessel.runtime.inprocess import run_in_process


class _Net(torch.nn.Module):
    """Output scaled by the batch size: a size left symbolic would show in the values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu() * x.shape[0]


class _Call(torch.nn.Module):
    """Positional, nested and keyword inputs, and a constant export fixes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x, pair, *, scale, n=2):
        return self.lin(x * scale + pair[0] - pair[1]) * n


class _Two(torch.nn.Module):
    """Two inputs sharing a dynamic batch, the second's width derived from the first's."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x], 1) * y


def _eager(cls: type[torch.nn.Module]) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls().eval()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """`torch.export.save`d programs: static, dynamic batch (2 or more), call structure, two
    inputs of one batch (2 to 64) and derived widths."""
    root = tmp_path_factory.mktemp("pt2_build")
    x = torch.randn(3, 8)
    batch = torch.export.Dim("batch", min=2)
    saved = {
        "static": torch.export.export(_eager(_Net), (x,)),
        "dynamic": torch.export.export(_eager(_Net), (x,), dynamic_shapes={"x": {0: batch}}),
        "call": torch.export.export(_eager(_Call), (x, (x + 1, x * 2)), {"scale": x - 1, "n": 3}),
    }
    batch, width = torch.export.Dim("rows", min=2, max=64), torch.export.Dim("width", max=16)
    saved["two"] = torch.export.export(
        _Two(),
        (torch.randn(3, 4), torch.randn(3, 8)),
        dynamic_shapes={"x": {0: batch, 1: width}, "y": {0: batch, 1: 2 * width}},
    )
    for name, program in saved.items():
        torch.export.save(program, str(root / f"{name}.pt2"))
    return root


def _build(files: Path, name: str, *extra: str) -> list[str]:
    return [
        "build",
        f"--model={files / name}.pt2",
        "--soc_version=cpu",
        f"--output={files / 'out' / name}",
        *extra,
    ]


def test_a_saved_program_builds_at_its_recorded_shapes_and_runs_as_the_eager_module(files, capsys):
    for name in ("static", "dynamic"):
        assert main(_build(files, name, "--verify")) == 0, capsys.readouterr().err
        assert "inputs: x float32[3, 8]" in capsys.readouterr().out
        x = torch.randn(3, 8)
        (out,) = run_in_process(Package.open(files / "out" / f"{name}.tessel"), [x])
        torch.testing.assert_close(out, _eager(_Net)(x))


def test_input_shape_fixes_a_dynamic_size_and_tessel_run_gives_the_eager_outputs(
    files, capsys, tmp_path
):
    args = _build(files, "dynamic", "--input_shape=x:5,8", "--distributed_cluster_build=1")
    assert main(args) == 0, capsys.readouterr().err
    assert "inputs: x float32[5, 8]" in capsys.readouterr().out
    x = torch.randn(5, 8)
    save_file({"input_0": x}, tmp_path / "x.safetensors")
    package = files / "out" / "dynamic.tessel"
    ran = ["run", str(package), f"--inputs={tmp_path / 'x.safetensors'}"]
    assert main([*ran, f"--output={tmp_path / 'y.safetensors'}"]) == 0
    out = load_file(tmp_path / "y.safetensors")["output_0"]
    torch.testing.assert_close(out, _eager(_Net)(x))  # scaled by 5: no size left at 3


def test_a_program_with_keyword_nested_and_constant_inputs_builds(files, capsys):
    assert main(_build(files, "call", "--verify", "--input_shape=x:3,8;scale:3,8")) == 0
    assert "x float32[3, 8], pair_0 float32[3, 8], pair_1" in capsys.readouterr().out
    x, a, b, s = (torch.randn(3, 8) for _ in range(4))
    (out,) = run_in_process(Package.open(files / "out" / "call.tessel"), [x, a, b, s])
    torch.testing.assert_close(out, _eager(_Call)(x, (a, b), scale=s, n=3))


def test_sizes_one_symbol_or_derived_from_one_follow_the_size_given(files, capsys):
    assert main(_build(files, "two", "--verify", "--input_shape=y:6,12")) == 0
    assert "inputs: x float32[6, 6], y float32[6, 12]" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("dynamic", "x:1,8", "input 'x' dimension 0: found 1; {f} takes 2 or more for the dyn"),
        ("two", "x:65,6", "input 'x' dimension 0: found 65; {f} takes 2 to 64 for the dynamic"),
        ("dynamic", "x:5,9", "input 'x' dimension 1: found 9; {f} takes 8 only (a static"),
        ("static", "x:4,8", "input 'x' dimension 0: found 4; {f} takes 3 only (a static"),
        ("dynamic", "x:5", "input 'x': found 1 dimension [5]; {f} takes 2, [s"),
        ("dynamic", "y:5,8", "{f} has no input 'y'; its inputs: x[s"),
        ("dynamic", "x:0,8", "input 'x': dimension '0' is not a positive integer"),
        ("dynamic", "x:-1,8", "input 'x': dimension '-1' is not a positive integer"),
        ("dynamic", "x:3,8;x:3,8", "input 'x' is given twice"),
        ("dynamic", "x=3,8", "entry 'x=3,8': expected name:d1,d2"),
        ("dynamic", "x:10000000000000,8", "input 'x' of shape [10000000000000, 8] (float32) takes"),
        ("call", "n:1", "input 'n' of {f} is the constant 3, not a tensor"),
        ("two", "x:4,6;y:5,12", "input 'y' dimension 0: found 5, but input 'x' dimension 0 makes"),
        ("two", "y:6,13", "input 'y' dimension 1: found 13; {f} takes 2*s"),
        ("two", "y:6,40", "input 'y' dimension 1: found 40 (so s"),
    ],
)
def test_an_input_shape_the_program_does_not_take_is_refused_by_name(
    files, capsys, name, text, words
):
    assert main(_build(files, name, f"--input_shape={text}")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tessel: error: --input_shape: ") and "Traceback" not in err, err
    assert words.format(f=files / f"{name}.pt2") in err, err


def test_python_build_of_a_program_checks_the_inputs_it_is_given(files):
    program = load_pt2(files / "dynamic.pt2")  # no example inputs: read as data
    built = tessel.build(program, (torch.randn(4, 8),), cluster=2, verify=True)
    assert built.manifest.plan.verify.max_relative_diff == 0
    with pytest.raises(ConfigError, match=r"example_inputs: input 'x': found float64; the pro"):
        tessel.build(program, (torch.randn(4, 8, dtype=torch.float64),), cluster=1)
    with pytest.raises(ConfigError, match=r"takes positional \(x\) and keywords \{\}; found pos"):
        tessel.build(program, (torch.randn(4, 8), torch.randn(4, 8)), cluster=1)
    call = load_pt2(files / "call.pt2")
    x = torch.randn(3, 8)
    with pytest.raises(ConfigError, match="input 'n': found 4; the program was exported with"):
        tessel.build(call, (x, (x, x)), example_kwargs={"scale": x, "n": 4}, cluster=1)
