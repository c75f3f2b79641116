"""torch.export capture, decomposed to core ATen so every node has a DTensor rule to look up."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from tessel._torch import export_post_dispatch, tree_leaves
from tessel.capture.custom_ops import custom_op_decompositions, refuse_random_numbers
from tessel.capture.decompose import decompose_in_place
from tessel.capture.grouped_queries import group_query_rows
from tessel.capture.held import describe_outputs, output_names, without_cache
from tessel.capture.portable import portable_attention, zero_fill_allocations
from tessel.capture.program_inputs import check_inputs, recorded_example
from tessel.capture.pt2 import RefusedArchiveError, load_pt2
from tessel.capture.stamp import CannotStamp, find_stacks, stamp_out, stamping
from tessel.capture.training import (
    GradientOutputs,
    TrainingStep,
    attribute_gradients_to_layers,
    check_trainable,
    drop_detach,
    drop_empty_cat_inputs,
    gradient_outputs,
    mark_gradients,
)
from tessel.config.errors import ConfigError

log = logging.getLogger(__name__)

FRAMEWORKS = ("pytorch", "5", "onnx")  # ATC's --framework: 5 is its code for ONNX
_ATC_FRAMEWORKS = {"0": "Caffe", "1": "MindSpore", "3": "TensorFlow"}
# Attention stays one op: the planner shards it by batch or by head (tessel's own rule, since
# DTensor has none for the CPU kernel), and its decomposition breaks some models' strides.
_SDPA_OPS = (
    "aten.scaled_dot_product_attention.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
)


@dataclass
class CapturedModel:
    """A decomposed ExportedProgram plus the flat list of user inputs it takes.

    `source` is the model as the user gave it, called with `example_args` and `example_kwargs`
    to check a build against it.
    """

    program: ExportedProgram
    example_inputs: list[torch.Tensor]
    input_names: list[str]
    source: Callable[..., Any] | None = None
    example_args: tuple = ()
    example_kwargs: dict = field(default_factory=dict)
    output_names: list[str] = field(default_factory=list)  # a name per user output

    def eager_outputs(self) -> list[torch.Tensor]:
        """The source model's outputs on the example inputs, as a flat list of tensors."""
        if self.source is None:
            raise ValueError("this captured model keeps no source model to run")
        with torch.no_grad():
            out = self.source(*self.example_args, **self.example_kwargs)
        return [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]


def capture(
    model: torch.nn.Module | ExportedProgram,
    example_inputs: tuple | list | dict | None = None,
    example_kwargs: dict | None = None,
    keep: Callable[[Any], bool] | None = None,
    reuse_layers: bool = True,
) -> CapturedModel:
    """Export `model` with its example inputs and decompose it to core ATen.

    Ops for which `keep(op)` holds (the planner passes "has a sharding rule") stay whole even
    where core ATen would decompose them; when every op stays, the decomposition's second trace
    of the model is skipped. With `reuse_layers`, a stack of identical layers is traced once and
    stamped out (see `tessel.capture.stamp`); `False` traces every layer.
    """
    args, kwargs = split_inputs(example_inputs, example_kwargs)
    cache_off = False
    if isinstance(model, ExportedProgram):
        if not args and not kwargs:
            args, kwargs = program_example(model)
        args, kwargs, dynamic = check_inputs(
            model, args, kwargs, where="the program", source="build()", key="example_inputs"
        )
        ep = _at_sizes(model, args, kwargs) if dynamic else model
    else:
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(
                "model",
                None,
                f"expected an nn.Module or ExportedProgram, found {type(model).__name__}",
            )
        model = model.eval()
        kwargs, cache_off = without_cache(model, args, kwargs)
        with torch.no_grad():
            ep = _export_stamped(model, args, kwargs) if reuse_layers else None
            ep = ep or _export_aten(model, args, kwargs)
    ep = _core_aten(ep, keep)
    if group_query_rows(ep.graph_module.graph):  # inference alone: a prompt's attention
        ep.graph_module.recompile()
    names, values = _user_inputs(ep)
    if args or kwargs:
        given = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if len(given) == len(values):
            values = [g.detach().clone() for g in given]
    source = model.module() if isinstance(model, ExportedProgram) else model
    outputs = output_names(ep)
    shapes = _output_values(ep)[len(_output_values(ep)) - len(outputs) :]
    log.info("%s", describe_outputs(outputs, shapes, cache_off))
    return CapturedModel(ep, values, names, source, args, kwargs, outputs)


def program_example(program: ExportedProgram) -> tuple[tuple, dict]:
    """The example `(args, kwargs)` a program was saved with (`torch.export.load` reads
    them), or else ones at the sizes its placeholders record (see `program_inputs`)."""
    if program.example_inputs is not None:
        args, kwargs = program.example_inputs
        return tuple(args), dict(kwargs)
    return recorded_example(program, source="build()")


def _at_sizes(program: ExportedProgram, args: tuple, kwargs: dict) -> ExportedProgram:
    """A program with dynamic dimensions exported again at the sizes of `args` and `kwargs`
    (checked against its ranges by `check_inputs`), so that every size in it is a number. Its
    module runs only the operators it holds; a condition the program asserts on its sizes that
    these break is refused by name."""
    module = program.module()
    try:
        with torch.no_grad():
            return _export_aten(module, args, kwargs)
    except Exception as exc:  # noqa: BLE001 - torch's guards on sizes raise many types
        text = str(exc).strip()
        reason = text.splitlines()[0] if text else type(exc).__name__
        shapes = [list(x.shape) for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        raise ConfigError(
            "build()",
            "example_inputs",
            f"the program does not take inputs of shapes {shapes}: {reason}",
        ) from None


# the training captures `training_capture_reused` offers, newest last
_REUSABLE: list[tuple[torch.nn.Module, Any, tuple, dict, CapturedModel]] = []


@contextlib.contextmanager
def training_capture_reused(
    model: torch.nn.Module,
    keep: Callable[[Any], bool] | None,
    args: tuple,
    kwargs: dict,
    captured: CapturedModel | None,
) -> Iterator[None]:
    """While the context lasts, `capture_training` of this same `model` object, with `keep`,
    on inputs equal to `args` and `kwargs` (structure, shapes, dtypes, values) returns
    `captured` instead of exporting the step again: choosing the data-parallel size has
    captured the replica step the build then needs. The model must not change meanwhile."""
    if captured is None:
        yield
        return
    entry = (model, keep, args, kwargs, captured)
    _REUSABLE.append(entry)
    try:
        yield
    finally:
        _REUSABLE.remove(entry)


def _same_inputs(a: Any, b: Any) -> bool:
    """Whether two example inputs (nested tuples, lists, dicts of tensors and constants) hold
    the same structure, tensors equal in shape, dtype and values, and equal constants."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and a.device == b.device
            and torch.equal(a, b)
        )
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_same_inputs(x, y) for x, y in zip(a, b))
        )
    if isinstance(a, dict) or isinstance(b, dict):
        return (
            isinstance(a, dict)
            and isinstance(b, dict)
            and list(a) == list(b)
            and all(_same_inputs(a[k], b[k]) for k in a)
        )
    return type(a) is type(b) and a == b


def capture_training(
    model: torch.nn.Module,
    example_inputs: tuple | list | dict | None = None,
    example_kwargs: dict | None = None,
    keep: Callable[[Any], bool] | None = None,
    held_factor: float = 1.0,
) -> CapturedModel:
    """Export one training step of `model` (its loss, then the gradient of every trainable
    weight; see `tessel.capture.training`) and decompose it as `capture` does.

    The model keeps its mode (dropout with p > 0 in training mode is refused: programs draw no
    random numbers). Every layer is traced: the backward runs the layers in reverse, which the
    stamping of identical layers does not follow. `held_factor` is what a device holds between
    steps per weight byte (see `GradientOutputs`), for the memory model.
    """
    args, kwargs = split_inputs(example_inputs, example_kwargs)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            "model", None, f"a training step needs an nn.Module, found {type(model).__name__}"
        )
    for same, kept, a, k, captured in reversed(_REUSABLE):
        if same is model and kept is keep and _same_inputs((a, k), (args, kwargs)):
            graph = captured.program.graph_module.graph
            names = gradient_outputs(graph).names
            mark_gradients(graph, GradientOutputs(names, held_factor))
            return captured
    check_trainable(model)
    step = TrainingStep(model)
    with torch.enable_grad():
        ep = _export_aten(step, args, kwargs)
    ep = _core_aten(ep, keep)
    drop_detach(ep.graph_module.graph)
    attribute_gradients_to_layers(ep.graph_module.graph)
    drop_empty_cat_inputs(ep.graph_module.graph)
    ep.graph_module.recompile()
    mark_gradients(ep.graph_module.graph, GradientOutputs(step.names, held_factor))
    names, values = _user_inputs(ep)
    given = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if len(given) == len(values):
        values = [g.detach().clone() for g in given]
    return CapturedModel(ep, values, names, None, args, kwargs)


def _core_aten(ep: ExportedProgram, keep: Callable[[Any], bool] | None) -> ExportedProgram:
    """`ep` in core ATen, ops `keep` holds for left whole, attention device-neutral, every
    allocation zero-filled. A program that draws random numbers is refused."""
    refuse_random_numbers(ep.graph)
    table = torch.export.default_decompositions()
    for name in _SDPA_OPS:
        op = _resolve(name)
        if op is not None:
            table.pop(op, None)
    if keep is not None:
        table = {op: fn for op, fn in table.items() if not keep(op)}
    table.update(custom_op_decompositions(ep.graph))
    # factories (no graph inputs) are replicated whatever they are, so they never need it
    if any(
        n.op == "call_function" and n.target in table and n.all_input_nodes for n in ep.graph.nodes
    ):
        if not decompose_in_place(ep.graph_module, table):  # else a second trace of the model
            ep.graph_module.recompile()
            ep = ep.run_decompositions(table)
    portable_attention(ep.graph_module, recompile=False)
    zero_fill_allocations(ep.graph_module)
    ep.graph_module.recompile()
    return ep


def _export_stamped(model: torch.nn.Module, args: tuple, kwargs: dict) -> ExportedProgram | None:
    """Export tracing only the first of each stack of identical layers; None where it cannot."""
    stacks = find_stacks(model)
    if not stacks:
        return None
    try:
        with stamping(stacks):
            ep = _export_aten(model, args, kwargs)
        stamp_out(ep, stacks)
    except Exception as exc:  # noqa: BLE001 - any doubt about the copies: trace every layer
        log.info("tracing every layer of %s: %s", ", ".join(s.path for s in stacks), exc)
        return None
    log.debug("traced layer 0 of %s and stamped out the rest", ", ".join(s.path for s in stacks))
    return ep


def _export_aten(model: torch.nn.Module, args: tuple, kwargs: dict) -> ExportedProgram:
    """Export straight to the ATen IR (past autograd, composite ops decomposed) in one trace.

    `torch.export.export` stops at the pre-dispatch IR, and turning that into ATen costs a
    second trace of the whole model (`run_decompositions`), which doubles capture time on deep
    models. torch.export's own post-dispatch mode does it in one; where this torch lacks it, the
    public path is taken.
    """
    _export = export_post_dispatch()
    if _export is not None:
        try:
            with _no_stack_traces():
                return _export(model, args, kwargs, strict=False, pre_dispatch=False)
        except Exception as exc:  # noqa: BLE001 - a private API: the public path decides
            if _caused_by(exc, CannotStamp):
                raise
            log.debug("post-dispatch export failed (%s); using torch.export.export", exc)
    with _no_stack_traces():
        return torch.export.export(model, args, kwargs)


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """Skip recording a Python stack per traced node: tessel never reads them, and on deep
    models they cost a tenth of the trace. Older torch releases record them always."""
    if not hasattr(torch.fx.config, "do_not_emit_stack_traces"):
        yield
        return
    saved = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = saved


def _caused_by(exc: BaseException, kind: type) -> bool:
    while exc is not None:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def framework_name(value: object, source: str = "command line", key: str = "--framework") -> str:
    """ATC's `--framework`: `pytorch`, or `5` / `onnx` (ATC's code for ONNX); returns `pytorch`
    or `onnx`. ATC's other codes (0 Caffe, 1 MindSpore, 3 TensorFlow) are refused by name."""
    text = str(value).strip().strip('"').lower()
    if text in FRAMEWORKS:
        return "pytorch" if text == "pytorch" else "onnx"
    known = _ATC_FRAMEWORKS.get(text)
    found = f"{value!r} ({known}, which tessel does not take)" if known else repr(value)
    raise ConfigError(source, key, f"found {found}; accepted: pytorch, 5 or onnx (ONNX)")


def load_model_spec(
    spec: str, framework: str = "pytorch", input_shape: str | None = None
) -> tuple[Any, Any, Any]:
    """`--model`: a `.pt2` file, or `file.py:function` returning `(module, example_inputs)`
    or `(module, example_inputs, optimizer)` (a training step); with `framework="onnx"` an
    ONNX file, its dynamic dimensions fixed by `input_shape`. Returns the model, its example
    inputs and the optimizer (None but for a training step)."""
    if framework == "onnx":
        from tessel.capture.onnx import load_onnx

        return (*load_onnx(spec, input_shape), None)
    if spec.endswith(".onnx"):
        raise ConfigError("--model", None, f"{spec} is an ONNX file: build it with --framework=5")
    if spec.endswith(".pt2"):
        return load_pt2_spec(spec, input_shape), None, None
    if input_shape:
        raise ConfigError(
            "--input_shape",
            None,
            "fixes the input shapes of an ONNX model (--framework=5) or a .pt2; a "
            "file.py:function's example inputs give its shapes",
        )
    if ":" not in spec:
        raise ConfigError(
            "--model", None, f"expected a .pt2 file or file.py:function, found {spec!r}"
        )
    file, func = spec.rsplit(":", 1)
    path = Path(file)
    if not path.is_file() or path.suffix != ".py":
        raise ConfigError("--model", None, f"expected a Python file before ':', found {file!r}")
    # as `python file.py` runs it: modules beside the file import
    directory = str(path.resolve().parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    module_spec = importlib.util.spec_from_file_location(f"tessel_user_model_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, func):
        raise ConfigError("--model", None, f"{file} has no function {func!r}")
    result = getattr(module, func)()
    if not (isinstance(result, tuple) and len(result) in (2, 3)):
        raise ConfigError(
            "--model",
            None,
            f"{spec} must return (module, example_inputs), or (module, example_inputs, "
            "optimizer) for a training step",
        )
    return result if len(result) == 3 else (*result, None)


def load_pt2_spec(spec: str, input_shape: str | dict | None = None) -> ExportedProgram:
    """`--model x.pt2`: the program read as data (`load_pt2`), holding example inputs at the
    sizes its placeholders record, or at those `input_shape` (ATC's `--input_shape` text, or a
    dict of input name to shape) fixes within what the program takes."""
    from tessel.capture.onnx import parse_input_shape

    path = Path(spec)
    if not path.is_file():
        raise ConfigError("--model", None, f"file not found: {spec}")
    shapes = parse_input_shape(input_shape)
    try:
        program = load_pt2(path)
    except RefusedArchiveError as exc:
        raise ConfigError(path, None, str(exc)) from None
    program.example_inputs = recorded_example(program, shapes, where=str(path))
    return program


def split_inputs(example_inputs: Any, example_kwargs: dict | None) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), {**example_inputs, **(example_kwargs or {})}
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), dict(example_kwargs or {})
    return tuple(example_inputs or ()), dict(example_kwargs or {})


def _user_inputs(ep: ExportedProgram) -> tuple[list[str], list[torch.Tensor]]:
    names = [
        s.arg.name
        for s in ep.graph_signature.input_specs
        if s.kind.name == "USER_INPUT" and hasattr(s.arg, "name")
    ]
    placeholders = {n.name: n for n in ep.graph_module.graph.nodes if n.op == "placeholder"}
    tensor_names = [n for n in names if isinstance(placeholders[n].meta.get("val"), torch.Tensor)]
    values = [_example_from_meta(placeholders[n].meta["val"]) for n in tensor_names]
    return tensor_names, values


def _output_values(ep: ExportedProgram) -> list[Any]:
    """The example value of every output of `ep`'s graph (buffer mutations first)."""
    out = next(n for n in ep.graph_module.graph.nodes if n.op == "output")
    return [a.meta.get("val") for a in tree_leaves(out.args[0]) if hasattr(a, "meta")]


def _example_from_meta(val: Any) -> torch.Tensor:
    return torch.zeros(tuple(val.shape), dtype=val.dtype)


def _resolve(name: str) -> Any:
    ns, op, overload = name.split(".")
    packet = getattr(getattr(torch.ops, ns), op, None)
    return getattr(packet, overload, None) if packet is not None else None
