"""ONNX input (`tessel build --framework=5 --model=model.onnx`): files exported by
torch.onnx.export, built partitioned over 2 devices and run, against onnxruntime; the
--input_shape rules, unsupported operators and frameworks, each with its message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from tests.conftest import small_llama, subprocess_env, token_ids
from torch import nn

import tessel
from tessel.capture.onnx import load_onnx, parse_input_shape
from tessel.cli import main
from tessel.config.errors import ConfigError
from tessel.package import Package
from tessel.package.format import BuiltPackage
from tessel.report import inspect_json
from tessel.runtime.inprocess import run_in_process

ROOT = Path(__file__).resolve().parents[1]


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class SmallResNet(nn.Module):
    """conv, batch norm, relu, residual adds, max and average pooling, linear."""

    def __init__(self, c: int = 48, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.blocks = nn.Sequential(Block(c), Block(c))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


def small_resnet() -> SmallResNet:
    torch.manual_seed(0)
    model = SmallResNet().eval()
    for m in model.modules():  # statistics that are not the identity, so batch norm counts
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.2, 0.2)
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("onnx")
    llama = small_llama()
    torch.onnx.export(
        llama,
        (token_ids(),),
        str(d / "llama.onnx"),
        input_names=["input_ids"],
        output_names=["logits"],
    )
    # batch left dynamic, and the graph as the exporter wrote it (batch norm not folded)
    torch.onnx.export(
        small_resnet(),
        (torch.randn(2, 3, 16, 16),),
        str(d / "resnet.onnx"),
        input_names=["images"],
        output_names=["logits"],
        dynamic_shapes={"x": {0: torch.export.Dim("batch")}},
        optimize=False,
    )
    cluster = json.loads((ROOT / "examples" / "cluster_4p.json").read_text())
    cluster["cluster"][0]["cluster_nodes"][0]["item_list"] = [{"item_id": 0}, {"item_id": 1}]
    # both models' replicated weights exceed these devices: the plans shard weights
    cluster["item_def"][0]["memory"] = "[DDR:400KB]"
    (d / "cluster_2p.json").write_text(json.dumps(cluster))
    cluster["item_def"][0]["memory"] = "[DDR:576KB]"
    (d / "cluster_2p_llama.json").write_text(json.dumps(cluster))
    option = {"graph_parallel_option": {"tensor_parallel_option": {"tensor_parallel_size": 2}}}
    (d / "parallel_option.json").write_text(json.dumps(option))
    return d


def _build_args(d: Path, model: str, cluster: str = "cluster_2p.json", **extra: str) -> list[str]:
    args = {
        "--model": str(d / model),
        "--framework": "5",
        "--soc_version": "cpu",
        "--output": str(d / "out" / Path(model).stem),
        "--cluster_config": str(d / cluster),
        "--distributed_cluster_build": "1",
        "--enable_graph_parallel": "1",
        "--graph_parallel_option_path": str(d / "parallel_option.json"),
        **extra,
    }
    return ["build"] + [f"{k}={v}" for k, v in args.items() if v is not None]


def _onnxruntime(path: Path, feeds: dict[str, torch.Tensor]) -> torch.Tensor:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {k: v.numpy() for k, v in feeds.items()})
    return torch.from_numpy(out)


def _sharded(path: Path) -> None:
    """The plan splits weights over both devices, with collectives between them."""
    ranks = inspect_json(Package.open(path).manifest)["ranks"]
    assert len(ranks) == 2 and all(r["collectives"] for r in ranks), ranks


def test_llama_exported_to_onnx_built_on_2_devices_equals_onnxruntime(files):
    assert main(_build_args(files, "llama.onnx", "cluster_2p_llama.json")) == 0
    path = files / "out" / "llama.tessel"
    _sharded(path)
    ids = token_ids(seed=7)  # other tokens than the example inputs (zeros)
    (out,) = run_in_process(Package.open(path), [ids])
    expected = _onnxruntime(files / "llama.onnx", {"input_ids": ids})
    assert out.shape == expected.shape == (2, 16, 256)
    assert (out - expected).abs().max().item() <= 1e-4
    # the weights take the exported model's names (torch.onnx.export folded each linear's
    # weight into a transposed `val_<k>` and recorded its source), and its layers are found
    manifest = Package.open(path).manifest
    held = set(manifest.submodels[0].weight_order)
    for layer in (0, 1):
        for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
            assert f"lm.model.layers.{layer}.{name}.weight" in held, sorted(held)
    assert not any(name.startswith("initializers.val_") and "proj" in name for name in held)
    data = inspect_json(manifest)
    assert {"lm.model.layers.0", "lm.model.layers.1"} <= set(data["layers"])
    assert "lm.model.layers.1.mlp.up_proj.weight" in data["layers"]["lm.model.layers.1"]
    assert data["solver"]["repeated_layers"] == {"lm.model.layers.*": 2}


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class _Stack(nn.Module):
    """Two residual blocks of two linear layers and a head, on 3-D inputs (MatMul)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Residual() for _ in range(2))
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_weights_and_layers_take_the_exported_models_names(tmp_path, dynamo):
    """Both exporters fold each weight into a transposed initializer of a generated name; the
    dynamo exporter records its source, the TorchScript one names the node by its module."""
    from tessel.capture import capture
    from tessel.capture.onnx import _string_list
    from tessel.plan.layers import template_map

    torch.manual_seed(0)
    path = tmp_path / "stack.onnx"
    x = torch.randn(2, 8, 32)
    torch.onnx.export(
        _Stack().eval(), (x,), str(path), input_names=["x"], output_names=["y"], dynamo=dynamo
    )
    model, example = load_onnx(path)
    names = [name for name, _ in model.named_parameters()]
    if dynamo:
        assert "layers.0.fc1.weight" in names and "layers.1.fc2.weight" in names
        assert "head.weight" in names and "head.bias" in names
    else:  # the transposed weight's source is not in the file: its module's path is
        assert any(n.startswith("layers.0.fc1.onnx__MatMul_") for n in names), names
        assert any(n.startswith("layers.1.fc2.onnx__MatMul_") for n in names), names
    assert "layers.1.fc1.bias" in names
    assert not any(n.startswith("initializers.") for n in names), names
    # operators moved into their layers still compute the file's function
    expected = _onnxruntime(path, {"x": x})
    assert (model(x) - expected).abs().max().item() <= 1e-5
    _, families = template_map(capture(model, example).program.graph_module.graph)
    assert families == {"layers.*": [0, 1]}
    # the exporter's records are read as text, never evaluated
    assert _string_list("['a.b', 'c']") == ["a.b", "c"]
    assert _string_list("__import__('os').getcwd()") is None


def test_resnet_exported_to_onnx_built_on_2_devices_equals_onnxruntime(files):
    assert main(_build_args(files, "resnet.onnx", **{"--input_shape": "images:2,3,16,16"})) == 0
    path = files / "out" / "resnet.tessel"
    _sharded(path)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    expected = _onnxruntime(files / "resnet.onnx", {"images": x})
    (out,) = run_in_process(Package.open(path), [x])
    assert out.shape == expected.shape == (2, 10)
    assert (out - expected).abs().max().item() <= 1e-4
    # and by the workers of a Session, as a user runs it
    tessel.initialize()
    try:
        session = tessel.Session()
        session.load_graph(0, {}, path)
        (ran,) = session.run_graph(0, [x])
    finally:
        tessel.finalize()
    assert (ran - expected).abs().max().item() <= 1e-4


def test_replicated_build_of_an_onnx_file(files):
    out = files / "out" / "resnet_replicas"
    extra = {"--enable_graph_parallel": None, "--graph_parallel_option_path": None}
    extra |= {"--input_shape": "images:2,3,16,16", "--output": str(out)}
    assert main(_build_args(files, "resnet.onnx", **extra)) == 0
    package = Package.open(out.with_suffix(".tessel"))
    assert package.manifest.mode == "replicated" and package.manifest.world_size == 2
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    (ran,) = run_in_process(package, [x])
    expected = _onnxruntime(files / "resnet.onnx", {"images": x})
    assert (ran - expected).abs().max().item() <= 1e-4


def test_python_api_loads_an_onnx_file_as_a_module_and_example_inputs(files):
    model, (example,) = tessel.load_onnx(files / "resnet.onnx", {"images": (4, 3, 16, 16)})
    assert example.shape == (4, 3, 16, 16) and example.dtype == torch.float32
    built = tessel.build(model, (example,), cluster=1)
    (out,) = run_in_process(BuiltPackage(built.manifest, built.members), [example])
    expected = _onnxruntime(files / "resnet.onnx", {"images": example})
    assert (out - expected).abs().max().item() <= 1e-4
    _, (ids,) = load_onnx(files / "llama.onnx")
    assert ids.dtype == torch.int64 and ids.shape == (2, 16) and not ids.any()  # valid token ids


def test_a_llama_exported_with_dynamic_batch_and_sequence_builds_at_the_shape_given(tmp_path):
    """The mask's Range, CumSum and GatherND depend on the shapes alone: fixed by --input_shape,
    they fold away."""
    path = tmp_path / "llama_dynamic.onnx"
    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", max=64)}
    torch.onnx.export(
        small_llama(layers=1),
        (token_ids(),),
        str(path),
        input_names=["input_ids"],
        output_names=["logits"],
        dynamic_shapes={"input_ids": dims},
    )
    with pytest.raises(ConfigError, match="input 'input_ids': dimension 0 is dynamic"):
        load_onnx(path)
    model, example = load_onnx(path, "input_ids:1,7")
    built = tessel.build(model, example, cluster=2)
    ids = token_ids(batch=1, seq=7, seed=5)
    (out,) = run_in_process(BuiltPackage(built.manifest, built.members), [ids])
    expected = _onnxruntime(path, {"input_ids": ids})
    assert out.shape == expected.shape == (1, 7, 256)
    assert (out - expected).abs().max().item() <= 1e-4


def test_input_shape_is_read_as_atc_writes_it():
    assert parse_input_shape("input_ids:1,128;mask:1,128") == {
        "input_ids": (1, 128),
        "mask": (1, 128),
    }
    assert parse_input_shape('"x:2,3,224,224"') == {"x": (2, 3, 224, 224)}
    assert parse_input_shape("scale:") == {"scale": ()}
    assert parse_input_shape("input:0:1,3") == {"input:0": (1, 3)}  # TensorFlow-style names
    assert parse_input_shape({"x": [1, 2]}) == {"x": (1, 2)}


@pytest.mark.parametrize(
    "text, words",
    [
        ("images2,3,16,16", "--input_shape: entry 'images2,3,16,16': expected name:d1,d2,..."),
        ("images:2,-1,16,16", "input 'images': dimension '-1' is not a positive integer"),
        ("images:2,3,1~4,16", "input 'images': dimension '1~4' is not a positive integer"),
        ("images:2,3;images:2,3", "input 'images' is given twice"),
        ("pixels:2,3,16,16", "has no input 'pixels'; its inputs: images"),
        ("images:2,3,16", "input 'images' has 4 dimensions in"),
        ("images:2,4,16,16", "input 'images' dimension 1 is 3 in"),
        ("images:２,3,16,16", "input 'images': dimension '２' is not a positive integer"),
        ("images:+2,3,16,16", "input 'images': dimension '+2' is not a positive integer"),
        ("images:2,3,1_6,16", "input 'images': dimension '1_6' is not a positive integer"),
        ("images:2,3,16,16;;", "an empty entry in"),
        (f"images:{10**12},3,16,16", "input 'images' of shape [1000000000000, 3, 16, 16]"),
    ],
)
def test_a_malformed_input_shape_is_refused_naming_it(files, capsys, text, words):
    assert main(_build_args(files, "resnet.onnx", **{"--input_shape": text})) == 2
    err = capsys.readouterr().err
    assert "--input_shape" in err and words in err, err


def test_a_dynamic_dimension_without_input_shape_is_refused_naming_the_input(files, capsys):
    assert main(_build_args(files, "resnet.onnx")) == 2
    err = capsys.readouterr().err
    assert (
        "resnet.onnx: input 'images': dimension 0 is dynamic ('batch'): fix it with "
        '--input_shape="images:N,3,16,16"'
    ) in err, err


def _tiny_model(path: Path, op: str, domain: str = "", **attrs) -> Path:
    """X -> op -> Y on a 4x4 float input."""
    node = helper.make_node(op, ["x"], ["y"], domain=domain, name=f"the_{op.lower()}", **attrs)
    graph = helper.make_graph(
        [node],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])],
    )
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    onnx.save(helper.make_model(graph, opset_imports=opsets), str(path))
    return path


@pytest.mark.parametrize(
    "op, domain, words",
    [
        ("Trilu", "", "operator Trilu: is not taken: onnx2torch has no converter for it"),
        (
            "NonZero",
            "",
            "operator NonZero: is not taken: onnx2torch's module for it reads run-time",
        ),
        ("FusedGemm", "com.microsoft", "operator com.microsoft::FusedGemm: is not taken: domain"),
    ],
)
def test_an_operator_the_converter_cannot_take_is_refused_by_name(tmp_path, op, domain, words):
    path = _tiny_model(tmp_path / f"{op}.onnx", op, domain)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_onnx(path)


def test_a_shape_computed_from_the_inputs_data_is_refused_naming_the_node(tmp_path):
    # Reshape(x, Cast(y)): the target shape is data, known only at run time
    nodes = [
        helper.make_node("Cast", ["shape"], ["target"], to=TensorProto.INT64, name="to_int"),
        helper.make_node("Reshape", ["x", "target"], ["y"], name="data_reshape"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4]),
            helper.make_tensor_value_info("shape", TensorProto.FLOAT, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx"
    )
    with pytest.raises(
        ConfigError, match="operator Reshape: node 'data_reshape' takes its input 1"
    ):
        load_onnx(tmp_path / "m.onnx")


def test_shape_operators_agree_with_onnxruntime(tmp_path):
    """tessel's static converters (Slice with a negative step and clamped bounds, Reshape with 0
    and -1, Expand, Tile, Squeeze, Unsqueeze, Split, ReduceMean and Gelu at opset 20) and the
    folding of Shape, Gather and Concat into a shape, against onnxruntime, eager and built; the
    graph takes one of Split's two outputs."""
    const = lambda name, values: helper.make_tensor(name, TensorProto.INT64, [len(values)], values)  # noqa: E731
    big = 2**63 - 1
    inits = [
        const("s_start", [-1, 1]),
        const("s_end", [-big - 1, big]),
        const("s_axes", [1, 2]),
        const("s_steps", [-2, 3]),
        const("r_shape", [0, -1]),
        const("e_shape", [2, 1, 1, 1]),
        const("t_reps", [1, 2, 1, 1]),
        const("axes0", [0]),
        const("axes_m1", [-1]),
        const("split", [1, 2]),
        const("gather1", [1]),
    ]
    nodes = [
        helper.make_node("Slice", ["x", "s_start", "s_end", "s_axes", "s_steps"], ["sl"]),
        helper.make_node("Shape", ["sl"], ["sl_shape"]),
        helper.make_node("Gather", ["sl_shape", "gather1"], ["dim1"], axis=0),
        helper.make_node("Concat", ["dim1", "r_shape"], ["shape3"], axis=0),
        helper.make_node("Reshape", ["sl", "r_shape"], ["rs"]),
        helper.make_node("Unsqueeze", ["rs", "axes0"], ["us"]),
        helper.make_node("Expand", ["us", "e_shape"], ["ex"]),
        helper.make_node("Tile", ["ex", "t_reps"], ["ti"]),
        helper.make_node("Squeeze", ["us", "axes0"], ["sq"]),
        helper.make_node("ReduceMean", ["ti", "axes_m1"], ["rm"], keepdims=0),
        helper.make_node("Split", ["rm", "split"], ["p0", "p1"], axis=2),
        helper.make_node("Gelu", ["p1"], ["ge"], approximate="tanh"),
        helper.make_node("Reshape", ["x", "shape3"], ["y2"]),  # [3, 0, -1]: 0 copies x's dim
    ]
    graph = helper.make_graph(
        nodes,
        "shapes",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5, 7])],
        [
            helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)
            for name, shape in [
                ("sl", [3, 3, 2]),
                ("ti", [2, 2, 3, 6]),
                ("sq", [3, 6]),
                ("p0", [2, 2, 1]),
                ("ge", [2, 2, 2]),
                ("y2", [3, 5, 7]),
            ]
        ],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    path = tmp_path / "shapes.onnx"
    onnx.save(model, str(path))
    x = torch.randn(3, 5, 7)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    expected = session.run(None, {"x": x.numpy()})
    module, (example,) = load_onnx(path)
    with torch.no_grad():
        got = module(x)
    assert len(got) == len(expected) == 6
    for g, e in zip(got, expected):
        assert tuple(g.shape) == e.shape
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-5, atol=1e-6)
    built = tessel.build(module, (example,), cluster=1)
    ran = run_in_process(BuiltPackage(built.manifest, built.members), [x])
    for g, e in zip(ran, expected):
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("code, name", [("0", "Caffe"), ("1", "MindSpore"), ("3", "TensorFlow")])
def test_frameworks_tessel_does_not_take_are_refused_listing_the_accepted(
    files, capsys, code, name
):
    assert main(_build_args(files, "llama.onnx", **{"--framework": code})) == 2
    err = capsys.readouterr().err
    assert (
        f"--framework: found '{code}' ({name}, which tessel does not take); "
        "accepted: pytorch, 5 or onnx (ONNX)"
    ) in err, err


def test_onnx_and_pytorch_flags_do_not_mix(files, capsys):
    assert main(_build_args(files, "llama.onnx", **{"--framework": "pytorch"})) == 2
    assert "llama.onnx is an ONNX file: build it with --framework=5" in capsys.readouterr().err
    args = _build_args(files, "x.py:build", **{"--framework": "pytorch", "--input_shape": "x:1"})
    assert main(args) == 2
    assert "--input_shape: fixes the input shapes of an ONNX model" in capsys.readouterr().err
    assert main(_build_args(files, "llama.onnx", **{"--weights": str(files)})) == 2
    assert "--weights: streams a PyTorch model's weights" in capsys.readouterr().err


def test_a_missing_onnx_extra_is_named(files, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx2torch", None)
    with pytest.raises(ConfigError, match=r"needs the onnx extra: pip install 'tessel\[onnx\]'"):
        load_onnx(files / "llama.onnx")


def test_importing_tessel_does_not_import_onnx():
    code = "import sys, tessel.cli, tessel.builder; assert 'onnx' not in sys.modules, 'onnx'"
    done = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
