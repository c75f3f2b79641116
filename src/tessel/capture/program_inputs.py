"""The inputs an ExportedProgram takes, read from the program itself.

A `.pt2` read as data keeps no example inputs (`torch.export.save` pickles them), but its
program records every user input: its place in the call (`call_spec.in_spec`: positional
arguments and keywords, nested ones included) and, in its placeholder's metadata, its dtype and
shape, a dimension exported dynamic being a size symbol with the size it was exported at and
the range `range_constraints` allows it. From these tessel makes example inputs at the recorded
sizes, or at sizes the user fixes (ATC's `--input_shape`, by placeholder name), each checked
against the program: a static dimension takes its own size only, a dynamic one any size in its
range, dimensions that are one symbol one size, and a derived one (`2*s0`) the size its symbols
make it. A program with dynamic dimensions is then captured at the chosen sizes (`capture`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ConstantArgument, InputKind, TensorArgument

from tessel._torch import tree_flatten, tree_map, tree_unflatten
from tessel.capture.onnx import check_input_sizes
from tessel.config.errors import ConfigError
from tessel.dtypes import dtype_name

__all__ = ["ProgramInput", "check_inputs", "program_inputs", "recorded_example"]

_CONSTANT = object()  # ProgramInput.constant of a tensor input


@dataclass(frozen=True)
class ProgramInput:
    """One user input of a program: its placeholder's name and either the tensor it takes
    (dtype; dims as recorded, a dynamic one a sympy expression; hints: the size every dim was
    exported at) or the constant export fixed it to."""

    name: str
    dtype: torch.dtype | None = None
    dims: tuple[int | sympy.Expr, ...] = ()
    hints: tuple[int, ...] = ()
    constant: Any = _CONSTANT

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None

    def shown(self) -> str:
        """The recorded shape, a dynamic dimension by its symbol: `[s0, 8]`."""
        return "[" + ", ".join(str(d) for d in self.dims) + "]"


def program_inputs(program: ExportedProgram, where: str) -> list[ProgramInput]:
    """Every user input of `program`, in the order of its call's leaves. A program whose call
    is not `(args, kwargs)`, or that takes a symbolic number or an opaque object, is refused
    naming `where` (the file, or the argument the program came as)."""
    spec = program.call_spec.in_spec
    user = [s for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    if spec is None or spec.num_leaves != len(user):
        raise ConfigError(
            where,
            None,
            "records no call signature matching its inputs (the program's module call graph "
            f"takes {None if spec is None else spec.num_leaves} values, its graph "
            f"{len(user)})",
        )
    template = tree_unflatten(list(range(len(user))), spec)
    if not (
        isinstance(template, tuple)
        and len(template) == 2
        and isinstance(template[0], tuple)
        and isinstance(template[1], dict)
    ):
        raise ConfigError(where, None, "records a call that is not (args, kwargs)")
    placeholders = {n.name: n for n in program.graph_module.graph.nodes if n.op == "placeholder"}
    found = []
    for input_spec in user:
        arg = input_spec.arg
        if isinstance(arg, ConstantArgument):
            found.append(ProgramInput(arg.name, constant=arg.value))
            continue
        node = placeholders.get(getattr(arg, "name", None))
        value = None if node is None else node.meta.get("val")
        if not isinstance(arg, TensorArgument) or not isinstance(value, torch.Tensor):
            raise ConfigError(
                where,
                None,
                f"input {getattr(arg, 'name', '?')!r} is a {type(arg).__name__}: tessel builds "
                "programs whose inputs are tensors and constants",
            )
        dims, hints = [], []
        for i, size in enumerate(value.shape):
            if isinstance(size, torch.SymInt):
                hint = size.node.hint
                if hint is None:
                    raise ConfigError(
                        where,
                        None,
                        f"input {arg.name!r} dimension {i} ({size.node.expr}) records no "
                        "example size",
                    )
                dims.append(size.node.expr)
                hints.append(int(hint))
            else:
                dims.append(int(size))
                hints.append(int(size))
        found.append(ProgramInput(arg.name, value.dtype, tuple(dims), tuple(hints)))
    return found


def recorded_example(
    program: ExportedProgram,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    *,
    where: str = "the program",
    source: str = "--input_shape",
) -> tuple[tuple, dict]:
    """Example `(args, kwargs)` for `program`: every tensor input at the sizes `shapes` fixes
    (by input name) or else at the sizes it was exported at, floating inputs random normal
    (seeded), integer and boolean ones zeros (valid token ids and indices); constants as
    recorded. Shapes the program does not take are refused naming `source` (see `fix_shapes`)."""
    inputs = program_inputs(program, where)
    fixed = fix_shapes(program, inputs, dict(shapes or {}), where, source, None)
    check_input_sizes([(i.name, fixed[i.name], i.dtype) for i in inputs if i.dtype is not None])
    generator = torch.Generator().manual_seed(0)
    leaves: list[Any] = []
    for item in inputs:
        if item.dtype is None:
            leaves.append(item.constant)
        elif item.dtype.is_floating_point or item.dtype.is_complex:
            leaves.append(
                torch.randn(fixed[item.name], generator=generator, dtype=torch.float32).to(
                    item.dtype
                )
            )
        else:
            leaves.append(torch.zeros(fixed[item.name], dtype=item.dtype))
    args, kwargs = tree_unflatten(leaves, program.call_spec.in_spec)
    return args, kwargs


def check_inputs(
    program: ExportedProgram, args: tuple, kwargs: dict, *, where: str, source: str, key: str
) -> tuple[tuple, dict, bool]:
    """`(args, kwargs)` checked against what `program` takes (the call's structure, each
    tensor's dtype and shape, each constant's value), keywords in the program's order; and
    whether the program has dynamic dimensions (so that it must be captured again at these
    sizes). What does not match is refused naming `source` and `key`."""
    inputs = program_inputs(program, where)
    spec = program.call_spec.in_spec
    names = tree_unflatten([i.name for i in inputs], spec)
    if isinstance(kwargs, dict) and set(kwargs) == set(names[1]):
        kwargs = {k: kwargs[k] for k in names[1]}
    leaves, given = tree_flatten((tuple(args), kwargs))
    if given != spec:
        shown = tree_map(_describe, (tuple(args), kwargs))
        raise ConfigError(
            source,
            key,
            f"{where} takes positional {_structure(names[0])} and keywords "
            f"{_structure(names[1])}; found positional {_structure(shown[0])} and keywords "
            f"{_structure(shown[1])}",
        )
    shapes = {}
    for item, value in zip(inputs, leaves):
        if item.dtype is None:
            if (
                isinstance(value, torch.Tensor)
                or type(value) is not type(item.constant)
                or (value != item.constant)
            ):
                raise ConfigError(
                    source,
                    key,
                    f"input {item.name!r}: found {_describe(value)}; {where} was exported with "
                    f"the constant {item.constant!r} there and takes only it",
                )
            continue
        if not isinstance(value, torch.Tensor):
            raise ConfigError(
                source,
                key,
                f"input {item.name!r}: found {_describe(value)}; {where} takes a "
                f"{dtype_name(item.dtype)} tensor of shape {item.shown()}",
            )
        if value.dtype != item.dtype:
            raise ConfigError(
                source,
                key,
                f"input {item.name!r}: found {dtype_name(value.dtype)}; {where} takes "
                f"{dtype_name(item.dtype)}",
            )
        shapes[item.name] = tuple(value.shape)
    fix_shapes(program, inputs, shapes, where, source, key)
    dynamic = any(not isinstance(d, int) for i in inputs for d in i.dims)
    return tuple(args), kwargs, dynamic


def fix_shapes(
    program: ExportedProgram,
    inputs: list[ProgramInput],
    shapes: dict[str, tuple[int, ...]],
    where: str,
    source: str,
    key: str | None,
) -> dict[str, tuple[int, ...]]:
    """Every tensor input's shape: `shapes`' where it names the input, else the sizes it was
    exported at (a size symbol that `shapes` fixes elsewhere taking that size). Refused, naming
    `source`, the input and the dimension: an unknown name, a constant's, another rank, a static
    dimension of another size, a dynamic one out of its range, one symbol given two sizes, a
    derived dimension other than its symbols make it."""
    by_name = {i.name: i for i in inputs}
    for name, shape in shapes.items():
        item = by_name.get(name)
        if item is None:
            tensors = ", ".join(f"{i.name}{i.shown()}" for i in inputs if i.is_tensor)
            raise ConfigError(
                source, key, f"{where} has no input {name!r}; its inputs: {tensors or 'none'}"
            )
        if not item.is_tensor:
            raise ConfigError(
                source,
                key,
                f"input {name!r} of {where} is the constant {item.constant!r}, not a tensor",
            )
        if len(shape) != len(item.dims):
            raise ConfigError(
                source,
                key,
                f"input {name!r}: found {_dimensions(len(shape))} {list(shape)}; {where} "
                f"takes {len(item.dims)}, {item.shown()}",
            )
    # a size symbol takes the size given for a dimension that is that symbol alone, then one
    # that no such dimension fixes the size that makes a dimension linear in it (`2*s0`) given
    bound: dict[sympy.Symbol, tuple[int, str]] = {}

    def bind(symbol: sympy.Symbol, value: int, name: str, i: int, size: int) -> None:
        here = f"input {name!r} dimension {i}: found {size}"
        if value != size:
            here += f" (so {symbol} = {value})"
        seen = bound.setdefault(symbol, (value, f"input {name!r} dimension {i}"))
        if seen[0] != value:
            raise ConfigError(
                source,
                key,
                f"{here}, but {seen[1]} makes {symbol} {seen[0]}; {where} takes one size for "
                f"{symbol} in both",
            )
        _check_range(program, symbol, value, here, where, source, key)

    for name, shape in shapes.items():
        for i, (dim, size) in enumerate(zip(by_name[name].dims, shape)):
            if isinstance(dim, sympy.Symbol):
                bind(dim, size, name, i, size)
    for name, shape in shapes.items():
        for i, (dim, size) in enumerate(zip(by_name[name].dims, shape)):
            if isinstance(dim, sympy.Expr) and not isinstance(dim, sympy.Symbol):
                free = dim.free_symbols - set(bound)
                if len(free) == 1:
                    symbol = free.pop()
                    known = {s: sympy.Integer(v) for s, (v, _) in bound.items()}
                    solved = _solve(dim.xreplace(known), symbol, size)
                    if solved is not None:
                        bind(symbol, solved, name, i, size)
    values = {symbol: sympy.Integer(size) for symbol, (size, _) in bound.items()}
    for item in inputs:  # the rest at the sizes the program was exported at
        for dim, hint in zip(item.dims, item.hints):
            if isinstance(dim, sympy.Symbol):
                values.setdefault(dim, sympy.Integer(hint))
    fixed = {}
    for item in inputs:
        if not item.is_tensor:
            continue
        given = shapes.get(item.name)
        sizes = []
        for i, (dim, hint) in enumerate(zip(item.dims, item.hints)):
            size = _size(dim, values)
            if given is not None and given[i] != size:
                if isinstance(dim, int):
                    allowed = f"{dim} only (a static dimension)"
                else:
                    symbols = ", ".join(sorted(str(s) for s in dim.free_symbols))
                    allowed = f"{dim} for whole {symbols}"
                    if size is not None:
                        allowed += f": {size} at {_shown(values, dim)}"
                raise ConfigError(
                    source,
                    key,
                    f"input {item.name!r} dimension {i}: found {given[i]}; {where} takes "
                    + allowed,
                )
            sizes.append(given[i] if given is not None else size if size is not None else hint)
        fixed[item.name] = tuple(sizes)
    return fixed


def _size(dim: int | sympy.Expr, values: dict) -> int | None:
    """A dimension's size with its symbols at `values`; None where that is not a whole
    number (a symbol that no given or recorded size binds)."""
    if isinstance(dim, int):
        return dim
    size = dim.xreplace(values)
    return int(size) if isinstance(size, sympy.Integer) else None


def _shown(values: dict, dim: sympy.Expr) -> str:
    return ", ".join(f"{s}={values[s]}" for s in sorted(dim.free_symbols, key=str) if s in values)


def _check_range(
    program: ExportedProgram,
    symbol: sympy.Symbol,
    size: int,
    found: str,
    where: str,
    source: str,
    key: str | None,
) -> None:
    """A size symbol's size lies in the range the program was exported for; else `found`
    (the input, the dimension and its size) is refused naming that range."""
    bounds = program.range_constraints.get(symbol)
    if bounds is None:
        return
    lower, upper = bounds.lower, bounds.upper
    low = int(lower) if isinstance(lower, sympy.Integer) else None
    high = int(upper) if isinstance(upper, sympy.Integer) else None
    if (low is None or size >= low) and (high is None or size <= high):
        return
    if high is None:
        allowed = f"{low} or more"
    elif low is None:
        allowed = f"{high} or less"
    else:
        allowed = f"{low} to {high}"
    raise ConfigError(
        source, key, f"{found}; {where} takes {allowed} for the dynamic size {symbol}"
    )


def _solve(expr: sympy.Expr, symbol: sympy.Symbol, size: int) -> int | None:
    """The whole number `symbol` must be for `expr`, linear in it, to equal `size`; None where
    `expr` is not linear in it or no whole number does."""
    try:
        poly = sympy.Poly(expr, symbol)
    except Exception:  # noqa: BLE001 - sympy: not a polynomial in the symbol (FloorDiv, Mod, ...)
        return None
    if poly.degree() != 1:
        return None
    slope, offset = poly.all_coeffs()
    value = (sympy.Integer(size) - offset) / slope
    return int(value) if isinstance(value, sympy.Integer) else None


def _dimensions(count: int) -> str:
    return f"{count} dimension" if count == 1 else f"{count} dimensions"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {dtype_name(value.dtype)} tensor of shape {list(value.shape)}"
    return repr(value)


def _structure(value: Any) -> str:
    """Names or descriptions nested as the call nests them, without quotes on names."""
    if isinstance(value, dict):
        shown = (k if v == k else f"{k}: {_structure(v)}" for k, v in value.items())
        return "{" + ", ".join(shown) + "}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_structure(v) for v in value) + ")"
    return str(value)
