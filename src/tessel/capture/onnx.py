"""ONNX input (ATC's `--framework=5`): an `.onnx` file becomes an nn.Module and example inputs.

The file's input shapes are fixed first (ATC's `--input_shape="name:1,3,224,224;..."`); a
dimension left dynamic is refused with the input's name. The graph is then folded where its
values no longer depend on the inputs (`Shape` of a fixed shape, arithmetic on constants), so
every shape, axis and slice bound an operator takes is a constant. onnx2torch converts the
folded graph to an fx GraphModule, which tessel captures like any model.

onnx2torch's own modules for the shape operators read their shape arguments from tensors at
run time (`.tolist()`, `.numpy()`, `torch.Size(tensor)`), which a capture from fake tensors
cannot do; this module registers static converters for them that read the folded constants at
conversion time, and for the opset 18-21 versions of operators onnx2torch stops short of.
Operators are taken from a list tessel has read (`TAKEN`); any other, or one whose shape
argument is computed from the inputs' data, is refused by name before anything is converted.

onnx comes with the `onnx` extra (`pip install 'tessel[onnx]'`), onnx2torch with `pip install
--no-deps 'onnx2torch>=1.5'` (README, Installing); both are imported only here, when an ONNX
model is loaded. onnx2torch imports torchvision for two detection
operators (NonMaxSuppression, RoiAlign); where torchvision is missing or does not load with
this torch, onnx2torch is imported without it and those two operators are refused.
"""

from __future__ import annotations

import keyword
import logging
import math
import operator
import re
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import fx, nn

from tessel.config.errors import ConfigError
from tessel.dtypes import dtype_name

log = logging.getLogger(__name__)

INPUT_SHAPE = "--input_shape"
_DIGITS = re.compile(r"[0-9]+", re.ASCII)

# ONNX tensor element types tessel takes as model inputs (TensorProto.DataType numbers)
_DTYPES = {
    1: torch.float32,
    2: torch.uint8,
    3: torch.int8,
    5: torch.int16,
    6: torch.int32,
    7: torch.int64,
    9: torch.bool,
    10: torch.float16,
    11: torch.float64,
    16: torch.bfloat16,
}

# Operators (default domain) whose converted modules tessel captures: onnx2torch's own where
# they compute from tensors alone, tessel's static ones below for the rest.
_ONNX2TORCH = {
    "Abs", "Acos", "Add", "And", "ArgMax", "ArgMin", "Asin", "Atan", "AveragePool",
    "BatchNormalization", "Cast", "Ceil", "Celu", "Clip", "Concat", "Conv", "ConvTranspose",
    "Cos", "DepthToSpace", "Div", "Dropout", "Einsum", "Elu", "Equal", "Erf", "Exp", "Flatten",
    "Floor", "Gather", "GatherElements", "Gemm", "GlobalAveragePool", "Greater",
    "GreaterOrEqual", "HardSigmoid", "HardSwish", "Identity", "InstanceNormalization", "IsInf",
    "IsNaN", "LRN", "LayerNormalization", "LeakyRelu", "Less", "LessOrEqual", "Log",
    "LogSoftmax", "MatMul", "Max", "MaxPool", "Mean", "Min", "Mod", "Mul", "Neg", "Not", "Or",
    "PRelu", "Pow", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin", "Softmax",
    "Softplus", "Softsign", "Sqrt", "Sub", "Sum", "Tan", "Tanh", "Transpose", "Where", "Xor",
}  # fmt: skip
_REDUCE = {
    "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
    "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare",
}  # fmt: skip
_STATIC = {"Reshape", "Slice", "Expand", "Tile", "Squeeze", "Unsqueeze", "Split", "TopK", "Pad"}
_STATIC |= {"Gelu", "CastLike"} | _REDUCE
# computed from shapes or constants only: folded away, or refused where an input's data feeds them
_FOLDED = {"Constant", "Shape", "Size", "ConstantOfShape", "Range"}
TAKEN = frozenset(_ONNX2TORCH | _STATIC | _FOLDED)

# later versions that only widen the element types (float8, int4, bfloat16, strings) of an
# operator onnx2torch converts at an earlier version: (op, version) -> the version to use
_SAME_AS = {
    ("Cast", 19): 13, ("Cast", 21): 13, ("Identity", 19): 16, ("Identity", 21): 16,
    ("Transpose", 21): 13, ("Flatten", 21): 13, ("Equal", 19): 13, ("IsNaN", 20): 13,
    ("IsInf", 20): 10, ("LessOrEqual", 16): 12, ("GreaterOrEqual", 16): 12,
}  # fmt: skip
# operators whose inputs at these positions are shapes, axes or bounds: constants after folding
_CONSTANT_INPUTS = {
    "Reshape": (1,), "Slice": (1, 2, 3, 4), "Expand": (1,), "Tile": (1,), "Squeeze": (1,),
    "Unsqueeze": (1,), "Split": (1,), "TopK": (1,), "Pad": (1, 2, 3), "Clip": (1, 2),
    "Conv": (1, 2), "ConvTranspose": (1, 2), "Dropout": (1, 2),
    **{op: (1,) for op in _REDUCE},
}  # fmt: skip
# where onnx2torch reads torchvision
_NEEDS_TORCHVISION = {"NonMaxSuppression", "RoiAlign"}


def parse_input_shape(
    text: str | dict | None, source: str = INPUT_SHAPE, key: str | None = None
) -> dict[str, tuple[int, ...]]:
    """ATC's `--input_shape`: `"name:1,3,224,224;name2:1,16"` (a scalar input: `"name:"`), or a
    dict of name to shape. Every dimension is a positive integer: tessel builds static shapes."""
    if text is None:
        return {}
    if isinstance(text, dict):
        items = [(str(k), v) for k, v in text.items()]
    else:
        items = []
        body = str(text).strip().strip('"')
        entries = body.split(";") if body.strip() else []
        if len(entries) > 1 and entries[-1].strip() == "":
            entries.pop()  # a trailing ';'
        for entry in entries:
            if not entry.strip():
                raise ConfigError(
                    source,
                    key,
                    f"an empty entry in {text!r}; entries are name:d1,d2,... separated by ';'",
                )
            if ":" not in entry:
                raise ConfigError(
                    source,
                    key,
                    f"entry {entry!r}: expected name:d1,d2,... (e.g. input_ids:1,128), "
                    "entries separated by ';'",
                )
            name, dims = entry.rsplit(":", 1)
            items.append(
                (name.strip(), [d.strip() for d in dims.split(",")] if dims.strip() else [])
            )
    shapes: dict[str, tuple[int, ...]] = {}
    for name, dims in items:
        if not name:
            raise ConfigError(source, key, f"an entry has no input name before ':' in {text!r}")
        if name in shapes:
            raise ConfigError(source, key, f"input {name!r} is given twice")
        shape = []
        if not isinstance(dims, (list, tuple)):
            raise ConfigError(source, key, f"input {name!r}: expected a list of dimensions")
        for d in dims:
            # ASCII digits only: int() also takes '+3', '1_0' and other scripts' digits
            if isinstance(d, str) and _DIGITS.fullmatch(d):
                value = int(d)
            elif type(d) is int:
                value = d
            else:
                value = -1
            if value < 1:
                raise ConfigError(
                    source,
                    key,
                    f"input {name!r}: dimension {d!r} is not a positive integer (tessel builds "
                    "static shapes: -1 and ranges are not taken)",
                )
            shape.append(value)
        shapes[name] = tuple(shape)
    return shapes


def load_onnx(
    path: str | Path, input_shape: str | dict | None = None, *, source_key: str = "--model"
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """An ONNX file as `(module, example_inputs)`, ready for `tessel.build`.

    `input_shape` fixes dynamic dimensions (ATC's `--input_shape` text, or a dict of input name
    to shape). Example inputs follow the fixed shapes and the inputs' types: floating inputs
    random normal (seeded), integer and boolean inputs zeros (valid token ids and indices).
    """
    onnx, convert = _imports()
    path = Path(path)
    if not path.is_file():
        raise ConfigError(source_key, None, f"file not found: {path}")
    try:
        model = onnx.load(str(path))
    except Exception as exc:  # noqa: BLE001 - protobuf's errors have no common base
        raise ConfigError(str(path), None, f"is not an ONNX model: {exc}") from exc
    fixed = parse_input_shape(input_shape)
    inputs = _fix_inputs(model, fixed, str(path))
    check_input_sizes(inputs)
    names = _exported_names(model)  # before folding: the exporter's record of its own folds
    model = _fold(onnx, model, str(path), names)  # what the fixed shapes decide is no operator's
    _register_converters()
    _check_operators(model, str(path))
    _check_constant_inputs(model, str(path))
    try:
        gm = convert(
            model,
            save_input_names=_identifiers([n for n, _, _ in inputs]),
            attach_onnx_mapping=True,
        )
    except (NotImplementedError, KeyError, ValueError, RuntimeError) as exc:
        raise ConfigError(str(path), None, f"onnx2torch cannot convert it: {exc}") from exc
    _fix_outputs(gm, model, str(path))
    scopes = _node_scopes(model)
    _name_weights(gm, _weight_names(model, names, scopes))
    _into_layers(gm, scopes)
    gm.eval()
    generator = torch.Generator().manual_seed(0)
    examples = tuple(
        torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)
        if dtype.is_floating_point
        else torch.zeros(shape, dtype=dtype)
        for _, shape, dtype in inputs
    )
    return gm, examples


def check_input_sizes(inputs: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
    """Every input's example fits this machine's available memory, checked before any is
    made (a dimension of 10^12 would otherwise end in the allocator)."""
    import psutil

    available = psutil.virtual_memory().available
    for name, shape, dtype in inputs:
        size = math.prod(shape) * dtype.itemsize
        if size > available:
            raise ConfigError(
                INPUT_SHAPE,
                None,
                f"input {name!r} of shape {list(shape)} ({dtype_name(dtype)}) "
                f"takes {size:,} bytes; this machine has {available:,} available",
            )


def _imports() -> tuple[Any, Callable[..., fx.GraphModule]]:
    """onnx and onnx2torch's `convert`, or an error naming the extra that brings them."""
    missing = (
        "needs the onnx extra: pip install 'tessel[onnx]', then pip install --no-deps "
        "'onnx2torch>=1.5' (onnx and onnx2torch)"
    )
    try:
        import onnx
    except ImportError as exc:
        raise ConfigError("--framework", None, f"onnx: {missing}; {exc}") from exc
    if sys.modules.get("onnx2torch") is None:
        try:
            import onnx2torch  # noqa: F401
        except ModuleNotFoundError as exc:
            if exc.name == "onnx2torch":
                raise ConfigError("--framework", None, f"onnx: {missing}; {exc}") from exc
            if not (exc.name or "").startswith("torchvision"):
                raise
            _import_without_torchvision()
        except Exception:  # noqa: BLE001 - torchvision built for another torch fails in many ways
            _import_without_torchvision()
    try:
        from onnx2torch import convert
    except ImportError as exc:
        raise ConfigError("--framework", None, f"onnx: {missing}; {exc}") from exc
    return onnx, convert


def _import_without_torchvision() -> None:
    """Import onnx2torch with a stand-in for torchvision, which it reads for NMS and RoiAlign
    only (refused by `_check_operators` then); the stand-in leaves sys.modules afterwards."""
    for name in [n for n in sys.modules if n == "onnx2torch" or n.startswith("onnx2torch.")]:
        del sys.modules[name]
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise ConfigError("--model", None, "this operator needs torchvision, which does not load")

    stub, ops = types.ModuleType("torchvision"), types.ModuleType("torchvision.ops")
    ops.nms = ops.roi_align = ops.box_convert = unavailable
    stub.ops = ops
    sys.modules.update({"torchvision": stub, "torchvision.ops": ops})
    try:
        import onnx2torch  # noqa: F401
    finally:
        for name in ("torchvision", "torchvision.ops"):
            sys.modules.pop(name, None)
    onnx2torch.TESSEL_WITHOUT_TORCHVISION = True
    log.debug("onnx2torch imported without torchvision: NonMaxSuppression and RoiAlign refused")


def _identifiers(names: list[str]) -> bool:
    return all(n.isidentifier() and not keyword.iskeyword(n) for n in names)


def _fix_inputs(
    model: Any, fixed: dict, path: str
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Write `fixed` shapes into the graph's inputs; every input's (name, shape, dtype)."""
    initializers = {i.name for i in model.graph.initializer}
    graph_inputs = [i for i in model.graph.input if i.name not in initializers]
    names = [i.name for i in graph_inputs]
    unknown = [n for n in fixed if n not in names]
    if unknown:
        raise ConfigError(
            INPUT_SHAPE,
            None,
            f"{path} has no input {unknown[0]!r}; its inputs: {', '.join(names) or 'none'}",
        )
    out = []
    for value in graph_inputs:
        name = value.name
        if not value.type.HasField("tensor_type"):
            raise ConfigError(
                path, f"input {name!r}", "is not a tensor (sequences and maps are not taken)"
            )
        tensor = value.type.tensor_type
        dtype = _DTYPES.get(tensor.elem_type)
        if dtype is None:
            raise ConfigError(
                path,
                f"input {name!r}",
                f"element type {tensor.elem_type} is not taken; taken: float, float16, bfloat16, "
                "double, int8/16/32/64, uint8, bool",
            )
        if not tensor.HasField("shape"):
            if name not in fixed:
                raise ConfigError(
                    path,
                    f"input {name!r}",
                    f'has no shape: give it with {INPUT_SHAPE}="{name}:..."',
                )
            dims: list[int | str] = ["?"] * len(fixed[name])
        else:
            dims = [
                d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                for d in tensor.shape.dim
            ]
        if name in fixed:
            want = fixed[name]
            if len(want) != len(dims):
                raise ConfigError(
                    INPUT_SHAPE,
                    None,
                    f"input {name!r} has {len(dims)} dimensions in {path}, found {len(want)}: {want}",
                )
            for i, (had, new) in enumerate(zip(dims, want)):
                if isinstance(had, int) and had > 0 and had != new:
                    raise ConfigError(
                        INPUT_SHAPE,
                        None,
                        f"input {name!r} dimension {i} is {had} in {path}, found {new}",
                    )
            tensor.shape.Clear()
            for d in want:
                tensor.shape.dim.add().dim_value = d
            shape = tuple(want)
        else:
            dynamic = [(i, d) for i, d in enumerate(dims) if not (isinstance(d, int) and d > 0)]
            if dynamic:
                i, d = dynamic[0]
                example = ",".join(str(x) if isinstance(x, int) and x > 0 else "N" for x in dims)
                raise ConfigError(
                    path,
                    f"input {name!r}",
                    f"dimension {i} is dynamic ({d!r}): fix it with "
                    f'{INPUT_SHAPE}="{name}:{example}" (N a positive integer)',
                )
            shape = tuple(int(d) for d in dims)
        out.append((name, shape, dtype))
    return out


def _opsets(model: Any) -> dict[str, int]:
    return {(o.domain or ""): o.version for o in model.opset_import}


def _since(op: str, domain: str, opset: int) -> int | None:
    from onnx import defs

    try:
        return defs.get_schema(op, opset, domain).since_version
    except Exception:  # noqa: BLE001 - onnx raises SchemaError, a RuntimeError, or others
        return None


def _check_operators(model: Any, path: str) -> None:
    """Refuse, by name, every operator tessel does not take: other domains, control flow and
    data-dependent operators, anything neither onnx2torch nor tessel converts."""
    from onnx2torch.node_converters.registry import _CONVERTER_REGISTRY, OperationDescription

    opsets = _opsets(model)
    without_tv = getattr(sys.modules.get("onnx2torch"), "TESSEL_WITHOUT_TORCHVISION", False)
    refused: dict[str, str] = {}
    for node in model.graph.node:
        domain = node.domain or ""
        label = node.op_type if not domain else f"{domain}::{node.op_type}"
        if label in refused:
            continue
        if domain not in ("", "ai.onnx"):
            refused[label] = f"domain {domain!r} (only the default ONNX domain is taken)"
        elif node.op_type in _NEEDS_TORCHVISION and without_tv:
            refused[label] = "onnx2torch needs torchvision for it, which does not load here"
        elif node.op_type == "BatchNormalization" and any(
            a.name == "training_mode" and a.i for a in node.attribute
        ):
            refused[label] = "training_mode=1 (batch statistics): tessel builds inference"
        elif node.op_type not in TAKEN:
            known = any(
                k.operation_type == node.op_type and not k.domain for k in _CONVERTER_REGISTRY
            )
            refused[label] = (
                "onnx2torch's module for it reads run-time values (data-dependent shapes or "
                "control flow), which tessel does not capture"
                if known
                else "onnx2torch has no converter for it"
            )
        elif node.op_type not in _FOLDED:
            version = _since(node.op_type, "", opsets.get("", 1))
            if (
                version is not None
                and OperationDescription("", node.op_type, version) not in _CONVERTER_REGISTRY
            ):
                refused[label] = (
                    f"onnx2torch has no converter for its version {version} (the model's opset "
                    f"is {opsets.get('', 1)})"
                )
    if refused:
        label, why = next(iter(refused.items()))
        more = f" (also refused: {', '.join(list(refused)[1:])})" if len(refused) > 1 else ""
        raise ConfigError(path, f"operator {label}", f"is not taken: {why}{more}")


def _fold(onnx: Any, model: Any, path: str, names: dict[str, str] | None = None) -> Any:
    """The graph with every value that depends on no input computed: `Shape`/`Size` of fixed
    shapes, `Constant`, and any node whose inputs are all constants (by onnx's reference
    evaluator), written as initializers.

    `names` (ONNX value -> the weight name it takes) gains the values folded from one named
    initializer alone, of its size (a transpose, a cast, a reshape of a weight): they take its
    name."""
    names = {} if names is None else names
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    try:
        model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - inference errors name the node
        raise ConfigError(path, None, f"ONNX shape inference fails: {exc}") from exc
    graph = model.graph
    shapes: dict[str, tuple] = {}
    types: dict[str, int] = {}
    for value in list(graph.input) + list(graph.value_info) + list(graph.output):
        t = value.type.tensor_type
        if not value.type.HasField("tensor_type"):
            continue
        types[value.name] = t.elem_type
        if t.HasField("shape"):
            dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
            if all(d is not None for d in dims):
                shapes[value.name] = dims
    consts = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    named = {i.name: names.get(i.name, i.name) for i in graph.initializer}
    opset = _opsets(model).get("", 1)
    kept, folded = [], 0
    for node in graph.node:
        values = None
        if node.op_type in ("Shape", "Size") and node.input[0] in shapes:
            values = [_shape_value(node, shapes[node.input[0]])]
        elif node.op_type == "CastLike" and node.input[0] in consts and types.get(node.input[1]):
            dtype = onnx.helper.tensor_dtype_to_np_dtype(types[node.input[1]])
            values = [np.asarray(consts[node.input[0]]).astype(dtype)]
        elif (node.op_type == "Constant" or (node.input and all(
            not name or name in consts for name in node.input
        ))) and not node.op_type.startswith("Random") and not node.domain:  # fmt: skip
            try:
                evaluator = ReferenceEvaluator(node, opsets={"": opset})
                feeds = {name: consts[name] for name in node.input if name}
                values = evaluator.run(None, feeds)
            except Exception as exc:  # noqa: BLE001 - left to the converter
                log.debug("not folded: %s (%s): %s", node.name, node.op_type, exc)
        if values is None:
            kept.append(node)
            continue
        folded += 1
        for name, value in zip(node.output, values):
            if name:
                consts[name] = value
        sources = [x for x in dict.fromkeys(node.input) if x in named]
        if (
            len(sources) == 1
            and len(node.output) == 1
            and np.size(values[0]) == np.size(consts[sources[0]])
            and np.size(values[0]) > 1
        ):
            named[node.output[0]] = names[node.output[0]] = named[sources[0]]
    if not folded:
        return model
    used = {name for node in kept for name in node.input} | {o.name for o in graph.output}
    del graph.node[:]
    graph.node.extend(kept)
    had = {i.name for i in graph.initializer}
    for name, value in consts.items():
        if name in used and name not in had:
            graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    kept_inits = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept_inits)
    log.debug("folded %d ONNX nodes into constants", folded)
    return model


def _shape_value(node: Any, shape: tuple[int, ...]) -> Any:
    if node.op_type == "Size":
        return np.array(math.prod(shape), dtype=np.int64)
    attrs = {a.name: a.i for a in node.attribute}
    rank = len(shape)
    start, end = attrs.get("start", 0), attrs.get("end", rank)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return np.array(shape[start:end], dtype=np.int64)


def _check_constant_inputs(model: Any, path: str) -> None:
    """Shapes, axes and bounds must be known once the inputs' shapes are: refuse by name the
    node whose such input is computed from the inputs' data."""
    from onnx import numpy_helper

    constant = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type in _FOLDED:
            raise ConfigError(
                path,
                f"operator {node.op_type}",
                f"node {node.name!r} computes from the inputs' data (not their shapes), which "
                "tessel does not capture",
            )
        for i in _CONSTANT_INPUTS.get(node.op_type, ()):
            if i < len(node.input) and node.input[i] and node.input[i] not in constant:
                raise ConfigError(
                    path,
                    f"operator {node.op_type}",
                    f"node {node.name!r} takes its input {i} ({node.input[i]!r}) from the inputs' "
                    "data; tessel takes it only where it is a constant once the input shapes are "
                    f"fixed ({INPUT_SHAPE})",
                )
        if node.op_type == "Dropout" and len(node.input) > 2 and node.input[2]:
            if numpy_helper.to_array(constant[node.input[2]]).any():
                raise ConfigError(
                    path,
                    "operator Dropout",
                    f"node {node.name!r} has training_mode true (random): tessel builds inference",
                )


def _fix_outputs(gm: fx.GraphModule, model: Any, path: str) -> None:
    """Return the graph's outputs in order, each the right one of its node's outputs (onnx2torch
    returns a whole multi-output node where the graph takes one of its outputs)."""
    producer: dict[str, tuple[fx.Node, int, int]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            mapping = getattr(gm.get_submodule(node.target), "onnx_mapping", None)
            if mapping is not None:
                outs = list(mapping.outputs)
                for k, name in enumerate(outs):
                    producer[name] = (node, k, len(outs))
        elif node.op == "placeholder":
            producer.setdefault(node.name, (node, 0, 1))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    initializers = {i.name for i in model.graph.initializer}
    graph_inputs = [i.name for i in model.graph.input if i.name not in initializers]
    for name, node in zip(graph_inputs, placeholders):
        producer[name] = (node, 0, 1)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = []
    with gm.graph.inserting_before(output):
        for value in model.graph.output:
            if value.name not in producer:
                raise ConfigError(
                    path, f"output {value.name!r}", "is a constant: tessel builds computed outputs"
                )
            node, k, n = producer[value.name]
            values.append(gm.graph.call_function(operator.getitem, (node, k)) if n > 1 else node)
    output.args = (values[0] if len(values) == 1 else tuple(values),)
    gm.graph.eliminate_dead_code()
    gm.recompile()


_FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"  # torch.onnx.export's (dynamo) record
_NAME_SCOPES = "pkg.torch.onnx.name_scopes"  # the module path of the node that made a node
_STRINGS = re.compile(r"\[\s*(?:'[^'\\]*'\s*(?:,\s*'[^'\\]*'\s*)*)?\]")


def _string_list(text: str) -> list[str] | None:
    """A list of plain strings as Python writes it (`['a', 'b.c']`), read without evaluating
    anything; None for any other text."""
    if not _STRINGS.fullmatch(text.strip()):
        return None
    return re.findall(r"'([^'\\]*)'", text)


def _exported_names(model: Any) -> dict[str, str]:
    """ONNX value -> the name of the one initializer torch.onnx.export (dynamo) folded it from
    (`val_110` -> `model.layers.0.self_attn.q_proj.weight`, the weight transposed for MatMul);
    the exporter records it on the value as `pkg.onnxscript.optimizer.folded_from`."""
    out: dict[str, str] = {}
    for value in model.graph.value_info:
        for prop in value.metadata_props:
            if prop.key == _FOLDED_FROM:
                sources = _string_list(prop.value)
                if sources is not None and len(sources) == 1 and sources[0]:
                    out[value.name] = sources[0]
    return out


def _node_scopes(model: Any) -> dict[str, str]:
    """A node's first output -> the module path the node was exported from
    (`model.layers.0.self_attn`): torch.onnx.export writes it as the node's
    `pkg.torch.onnx.name_scopes` (dynamo) or in the node's name,
    `/model/layers.0/self_attn/MatMul` (TorchScript)."""
    out: dict[str, str] = {}
    for node in model.graph.node:
        scope = ""
        for prop in node.metadata_props:
            if prop.key == _NAME_SCOPES:
                scopes = _string_list(prop.value)
                scope = scopes[-2] if scopes and len(scopes) >= 2 else ""
        if not scope and node.name.startswith("/"):
            scope = ".".join(node.name.split("/")[1:-1])
        if scope and node.output:
            out[node.output[0]] = scope
    return out


def _weight_names(model: Any, names: dict[str, str], scopes: dict[str, str]) -> dict[str, str]:
    """ONNX initializer -> the name its weight takes: the exported module's own name where the
    file records it (`names`: an initializer folded from one weight takes that weight's name),
    an initializer's name where it is a module path already (`layers.0.fc1.bias`), else
    `<module path of its readers>.<its ONNX name>` where every node reading it comes from one
    module (`layers.0.fc1.onnx__MatMul_30`); otherwise its ONNX name. Each name is given once."""
    readers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(
                scopes.get(node.output[0], "") if node.output else ""
            )
    out: dict[str, str] = {}
    taken: set[str] = set()
    for init in model.graph.initializer:
        plain = init.name
        scope = readers.get(plain, set())
        local = f"{next(iter(scope))}.{plain}" if len(scope) == 1 and "" not in scope else plain
        wanted = names.get(plain) or (plain if "." in plain else local)
        if wanted in taken:
            wanted = local if local not in taken else plain
        taken.add(wanted)
        out[plain] = wanted
    return out


def _name_weights(gm: fx.GraphModule, names: dict[str, str]) -> None:
    """onnx2torch holds every initializer as a buffer `initializers.onnx_initializer_<k>`, a
    fresh copy for each node that reads it. Here each is held once, a floating one as a
    parameter, which the planner may shard (it replicates buffers): at the module path `names`
    gives it (`model.layers.0.mlp.up_proj.weight`, see `_weight_names`), or where that is taken
    or no path, under `initializers.` with its ONNX name."""
    if not hasattr(gm, "initializers"):  # every initializer is held by its node's module
        return
    old = gm.get_submodule("initializers")
    onnx_name: dict[str, str] = {}
    for node in gm.graph.nodes:
        mapping = (
            getattr(gm.get_submodule(node.target), "onnx_mapping", None)
            if node.op == "call_module"
            else None
        )
        if mapping is None:
            continue
        for name, arg in zip(mapping.inputs, node.args):
            if (
                isinstance(arg, fx.Node)
                and arg.op == "get_attr"
                and arg.target.startswith("initializers.")
            ):
                onnx_name.setdefault(arg.target, name)
    weights = nn.Module()
    placed: dict[str, str] = {}  # ONNX name -> path under the module
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not node.target.startswith("initializers."):
            continue
        local = node.target.split(".", 1)[1]
        key = onnx_name.get(node.target, local)
        if key not in placed:
            tensor = getattr(old, local)
            held = (
                nn.Parameter(tensor, requires_grad=False) if tensor.is_floating_point() else tensor
            )
            wanted = names.get(key, key)
            path = _place(gm, wanted, held) if "." in wanted else None
            if path is None:
                path = _place(weights, key, held) or _place(weights, local, held)
                path = f"initializers.{path}"
            placed[key] = path
        node.target = placed[key]
    gm.initializers = weights
    gm.recompile()


class _Scope(nn.Module):
    """A module of the exported model (`model.layers.0`) holding its operators' modules and
    weights; calling it with an operator's path calls that operator, so a capture records the
    operator inside this module (nn_module_stack), where tessel finds layers."""

    def forward(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.get_submodule(name)(*args, **kwargs)


_LAYER = re.compile(r"^(.+?\.\d+)(?:\.(.+))?$")  # `model.layers.3` and the path inside it


def _into_layers(gm: fx.GraphModule, scopes: dict[str, str]) -> None:
    """Move each operator's module into the layer it was exported from (its module path's
    first indexed part, `model.layers.3`), called through that layer's `_Scope`: identical
    layers are then found as in the PyTorch model. Operators outside layers, or without a
    recorded module path, stay where onnx2torch put them."""
    moved = False
    for node in gm.graph.nodes:
        if node.op != "call_module" or "." in node.target:
            continue
        module = gm.get_submodule(node.target)
        mapping = getattr(module, "onnx_mapping", None)
        outputs = list(mapping.outputs) if mapping is not None else []
        scope = scopes.get(outputs[0], "") if outputs else ""
        m = _LAYER.match(scope) if scope else None
        if m is None:
            continue
        layer = _container(gm, m.group(1))
        if layer is None:
            continue
        inside = [*(m.group(2).split(".") if m.group(2) else []), node.target]
        path = _put(layer, inside, module)
        if path is None:
            continue
        del gm._modules[node.target]
        node.target = ".".join(_identifier(p) for p in m.group(1).split("."))
        node.args = (path, *node.args)
        moved = True
    if moved:
        gm.recompile()


def _identifier(part: str) -> str:
    return re.sub(r"\W", "_", part) or "_"


def _container(root: nn.Module, dotted: str) -> _Scope | None:
    """The `_Scope` at module path `dotted` under `root`, made where missing; None where that
    path is taken by something else."""
    module = root
    for part in (_identifier(p) for p in dotted.split(".")):
        child = module._modules.get(part)
        if child is None:
            if hasattr(module, part):
                return None
            child = _Scope()
            module.add_module(part, child)
        if not isinstance(child, _Scope):
            return None
        module = child
    return module


def _put(layer: _Scope, parts: list[str], module: nn.Module) -> str | None:
    """Register `module` at `parts` under `layer`; its path there, or None where taken."""
    names = [_identifier(p) for p in parts]
    parent = _container(layer, ".".join(names[:-1])) if len(names) > 1 else layer
    if parent is None or hasattr(parent, names[-1]):
        return None
    parent.add_module(names[-1], module)
    return ".".join(names)


def _place(root: nn.Module, dotted: str, value: torch.Tensor) -> str | None:
    """Register `value` at the module path `dotted` (each part made an identifier) under
    `root`; None where that path is taken."""
    parts = [_identifier(part) for part in dotted.split(".")]
    module = root
    for part in parts[:-1]:
        child = module._modules.get(part)
        if child is None:
            if hasattr(module, part):
                return None
            child = _Scope()  # a layer's operators may move in (`_into_layers`)
            module.add_module(part, child)
        if not isinstance(child, _Scope):  # an operator's module, or onnx2torch's initializers
            return None
        module = child
    if hasattr(module, parts[-1]):
        return None
    if isinstance(value, nn.Parameter):
        module.register_parameter(parts[-1], value)
    else:
        module.register_buffer(parts[-1], value)
    return ".".join(parts)


# ---- converters for what onnx2torch's modules compute from tensors at run time ----


def _register_converters() -> None:
    """Register tessel's static converters in onnx2torch's registry (once)."""
    from onnx2torch.node_converters.registry import _CONVERTER_REGISTRY, OperationDescription

    if getattr(_register_converters, "done", False):
        return
    table: dict[tuple[str, int], Callable] = {}
    for version in (5, 13, 14, 19, 21):
        table["Reshape", version] = _reshape
    for version in (1, 10, 11, 13):
        table["Slice", version] = _slice
    for version in (8, 13):
        table["Expand", version] = _expand
    for version in (6, 13):
        table["Tile", version] = _tile
    for version in (13, 21):
        table["Squeeze", version] = _squeeze
        table["Unsqueeze", version] = _unsqueeze
    for version in (13, 18):
        table["Split", version] = _split
    for version in (10, 11):
        table["TopK", version] = _topk
    for version in (11, 13, 18, 19, 21):
        table["Pad", version] = _pad
    table["Gelu", 20] = _gelu
    for version in (15, 19, 21):
        table["CastLike", version] = _cast_like
    for op in _REDUCE:
        for version in (13, 18, 20):
            if op == "ReduceSum" or version >= 18:
                table[op, version] = _reduce
    for key, converter in table.items():
        _CONVERTER_REGISTRY[OperationDescription("", *key)] = converter
    for (op, version), same in _SAME_AS.items():
        new, old = OperationDescription("", op, version), OperationDescription("", op, same)
        if new not in _CONVERTER_REGISTRY and old in _CONVERTER_REGISTRY:
            _CONVERTER_REGISTRY[new] = _CONVERTER_REGISTRY[old]
    _register_converters.done = True


def _result(module: nn.Module, node: Any, inputs: Sequence[str]) -> Any:
    from onnx2torch.utils.common import OnnxMapping, OperationConverterResult

    return OperationConverterResult(
        torch_module=module,
        onnx_mapping=OnnxMapping(inputs=tuple(inputs), outputs=node.output_values),
    )


def _const(node: Any, graph: Any, i: int) -> list | None:
    """The constant input `i` of `node` as a Python list (None where the input is absent)."""
    from onnx2torch.utils.common import get_const_value

    names = node.input_values
    if i >= len(names) or not names[i]:
        return None
    value = get_const_value(names[i], graph)
    return value.tolist() if isinstance(value, torch.Tensor) else value


class _Reshape(nn.Module):
    def __init__(self, shape: list[int], allowzero: bool) -> None:
        super().__init__()
        self.shape, self.allowzero = shape, allowzero

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.allowzero:
            return torch.reshape(x, self.shape)
        return torch.reshape(x, [x.shape[i] if d == 0 else d for i, d in enumerate(self.shape)])


def _reshape(node: Any, graph: Any) -> Any:
    shape = [int(d) for d in _const(node, graph, 1)]
    return _result(
        _Reshape(shape, bool(node.attributes.get("allowzero", 0))), node, node.input_values[:1]
    )


class _Slice(nn.Module):
    """ONNX Slice with constant bounds; a negative step reads the flipped axis."""

    def __init__(self, starts: list, ends: list, axes: list, steps: list) -> None:
        super().__init__()
        self.parts = list(zip(starts, ends, axes, steps))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for start, end, axis, step in self.parts:
            axis = axis + x.dim() if axis < 0 else axis
            size = x.shape[axis]
            picked = _onnx_range(size, start, end, step)
            if not picked:
                x = x.narrow(axis, 0, 0)
                continue
            first = picked[0]
            if step < 0:  # index i of x is index size - 1 - i of the flipped axis
                x, first = x.flip(axis), size - 1 - first
            stop = first + (len(picked) - 1) * abs(step) + 1
            x = x[(slice(None),) * axis + (slice(first, stop, abs(step)),)]
        return x


def _onnx_range(size: int, start: int, end: int, step: int) -> range:
    """The indices ONNX Slice takes along an axis of `size` (its clamping rules)."""
    start, end = start + size if start < 0 else start, end + size if end < 0 else end
    if step > 0:
        return range(min(max(start, 0), size), min(max(end, 0), size), step)
    return range(min(max(start, 0), size - 1), min(max(end, -1), size - 1), step)


def _slice(node: Any, graph: Any) -> Any:
    a = node.attributes
    if "starts" in a:  # Slice-1: bounds as attributes
        starts, ends, axes, steps = a["starts"], a["ends"], a.get("axes"), None
    else:
        starts, ends = _const(node, graph, 1), _const(node, graph, 2)
        axes, steps = _const(node, graph, 3), _const(node, graph, 4)
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    if any(s == 0 for s in steps):
        raise ValueError(f"Slice {node.name}: a step is 0")
    return _result(
        _Slice(
            [int(s) for s in starts],
            [int(e) for e in ends],
            [int(a) for a in axes],
            [int(s) for s in steps],
        ),
        node,
        node.input_values[:1],
    )


class _Expand(nn.Module):
    def __init__(self, shape: list[int]) -> None:
        super().__init__()
        self.shape = shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.expand(torch.broadcast_shapes(tuple(x.shape), tuple(self.shape)))


def _expand(node: Any, graph: Any) -> Any:
    return _result(_Expand([int(d) for d in _const(node, graph, 1)]), node, node.input_values[:1])


class _Tile(nn.Module):
    def __init__(self, repeats: list[int]) -> None:
        super().__init__()
        self.repeats = repeats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(self.repeats)


def _tile(node: Any, graph: Any) -> Any:
    return _result(_Tile([int(r) for r in _const(node, graph, 1)]), node, node.input_values[:1])


class _Squeeze(nn.Module):
    def __init__(self, axes: list[int] | None) -> None:
        super().__init__()
        self.axes = axes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.axes:
            return torch.squeeze(x)
        return torch.squeeze(x, tuple(a + x.dim() if a < 0 else a for a in self.axes))


def _squeeze(node: Any, graph: Any) -> Any:
    axes = _const(node, graph, 1)
    return _result(
        _Squeeze(None if axes is None else [int(a) for a in axes]), node, node.input_values[:1]
    )


class _Unsqueeze(nn.Module):
    def __init__(self, axes: list[int]) -> None:
        super().__init__()
        self.axes = axes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = x.dim() + len(self.axes)
        for axis in sorted(a + rank if a < 0 else a for a in self.axes):
            x = x.unsqueeze(axis)
        return x


def _unsqueeze(node: Any, graph: Any) -> Any:
    return _result(
        _Unsqueeze([int(a) for a in _const(node, graph, 1)]), node, node.input_values[:1]
    )


class _Split(nn.Module):
    def __init__(self, sizes: list[int] | None, parts: int, axis: int) -> None:
        super().__init__()
        self.sizes, self.parts, self.axis = sizes, parts, axis

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        sizes = self.sizes or -(-x.shape[self.axis] // self.parts)  # the last part the smallest
        return tuple(torch.split(x, sizes, dim=self.axis))


def _split(node: Any, graph: Any) -> Any:
    sizes = _const(node, graph, 1)
    parts = node.attributes.get("num_outputs", len(node.output_values))
    return _result(
        _Split(
            None if sizes is None else [int(s) for s in sizes],
            int(parts),
            int(node.attributes.get("axis", 0)),
        ),
        node,
        node.input_values[:1],
    )


class _TopK(nn.Module):
    def __init__(self, k: int, axis: int, largest: bool, sorted_: bool) -> None:
        super().__init__()
        self.k, self.axis, self.largest, self.sorted = k, axis, largest, sorted_

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = torch.topk(x, self.k, self.axis, self.largest, self.sorted)
        return values, indices


def _topk(node: Any, graph: Any) -> Any:
    (k,) = [int(v) for v in _const(node, graph, 1)]
    a = node.attributes
    module = _TopK(k, int(a.get("axis", -1)), bool(a.get("largest", 1)), bool(a.get("sorted", 1)))
    return _result(module, node, node.input_values[:1])


class _Pad(nn.Module):
    def __init__(self, pads: list[int], axes: list[int] | None, value: float) -> None:
        super().__init__()
        self.pads, self.axes, self.value = pads, axes, value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        axes = self.axes if self.axes is not None else list(range(x.dim()))
        axes = [a + x.dim() if a < 0 else a for a in axes]
        n = len(axes)
        begin = dict(zip(axes, self.pads[:n]))
        end = dict(zip(axes, self.pads[n:]))
        torch_pads: list[int] = []
        for axis in reversed(range(x.dim())):  # torch: the last axis first
            torch_pads += [begin.get(axis, 0), end.get(axis, 0)]
        return nn.functional.pad(x, torch_pads, mode="constant", value=self.value)


def _pad(node: Any, graph: Any) -> Any:
    mode = node.attributes.get("mode", "constant")
    if isinstance(mode, bytes):
        mode = mode.decode()
    if mode != "constant":
        raise ValueError(f"Pad {node.name}: mode {mode!r} is not taken (only 'constant')")
    pads = node.attributes.get("pads") or _const(node, graph, 1)
    value = _const(node, graph, 2)
    value = node.attributes.get("value", 0.0) if value is None else value
    value = value[0] if isinstance(value, list) and value else value
    axes = _const(node, graph, 3)
    return _result(
        _Pad(
            [int(p) for p in pads],
            None if axes is None else [int(a) for a in axes],
            float(value or 0),
        ),
        node,
        node.input_values[:1],
    )


class _Gelu(nn.Module):
    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x, approximate=self.approximate)


def _gelu(node: Any, graph: Any) -> Any:
    approximate = node.attributes.get("approximate", "none")
    if isinstance(approximate, bytes):
        approximate = approximate.decode()
    return _result(_Gelu(approximate), node, node.input_values[:1])


class _CastLike(nn.Module):
    def forward(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return x.to(like.dtype)


def _cast_like(node: Any, graph: Any) -> Any:
    return _result(_CastLike(), node, node.input_values[:2])


_REDUCERS: dict[str, Callable[[torch.Tensor, list[int], bool], torch.Tensor]] = {
    "ReduceSum": lambda x, d, k: torch.sum(x, d, keepdim=k),
    "ReduceMean": lambda x, d, k: torch.mean(x, d, keepdim=k),
    "ReduceMax": lambda x, d, k: torch.amax(x, d, keepdim=k),
    "ReduceMin": lambda x, d, k: torch.amin(x, d, keepdim=k),
    "ReduceL1": lambda x, d, k: torch.sum(torch.abs(x), d, keepdim=k),
    "ReduceL2": lambda x, d, k: torch.sqrt(torch.sum(x * x, d, keepdim=k)),
    "ReduceSumSquare": lambda x, d, k: torch.sum(x * x, d, keepdim=k),
    "ReduceLogSum": lambda x, d, k: torch.log(torch.sum(x, d, keepdim=k)),
    "ReduceLogSumExp": lambda x, d, k: torch.logsumexp(x, d, keepdim=k),
}


class _Reduce(nn.Module):
    def __init__(self, op: str, axes: list[int] | None, keepdims: bool, noop: bool) -> None:
        super().__init__()
        self.op, self.axes, self.keepdims, self.noop = op, axes, keepdims, noop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.axes and self.noop:
            return x
        dims = sorted(
            {a + x.dim() if a < 0 else a for a in self.axes} if self.axes else range(x.dim())
        )
        if self.op == "ReduceProd":
            for d in reversed(dims):
                x = torch.prod(x, d, keepdim=True)
            return (
                x
                if self.keepdims
                else x.reshape([s for i, s in enumerate(x.shape) if i not in dims])
            )
        return _REDUCERS[self.op](x, dims, self.keepdims)


def _reduce(node: Any, graph: Any) -> Any:
    axes = node.attributes.get("axes")
    if axes is None:
        axes = _const(node, graph, 1)
    a = node.attributes
    module = _Reduce(
        node.operation_type,
        None if axes is None else [int(x) for x in axes],
        bool(a.get("keepdims", 1)),
        bool(a.get("noop_with_empty_axes", 0)),
    )
    return _result(module, node, node.input_values[:1])
