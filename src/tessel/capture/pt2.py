"""Reading a `.pt2` archive (`torch.export.save`) as data: nothing in it runs.

torch's own reader unpickles payloads, evaluates every symbolic size's text as Python (through
`sympy.sympify`) and resolves node targets to any attribute of `torch`. tessel reads the
archive with `tessel._torch.load_exported_program`, which takes raw tensors only and hands
every size expression and operator name to the checks here before anything is built from them:

- a size expression, in sympy's printed form (`s0*2 + 1`) or its `srepr` form (`Add(Mul(
  Integer(2), Symbol('s0', integer=True)), Integer(1))`, what torch 2.13 writes), holds
  numbers, the symbols torch names sizes with (`s0`, `u3`), the sympy classes and functions
  torch writes sizes with, keyword-argument names (followed by `=`: never looked up), quoted
  size symbols and numbers, arithmetic and comparison operators, parentheses and commas; nothing else
  (no attribute, no subscript, no other name), so evaluating it can only build a sympy
  expression;
- a node's target is an operator: `torch.ops.<namespace>.<op>.<overload>`, a higher-order
  operator, or one of the Python operators on symbolic sizes on the list below.

After reading, every node of every graph must call an operator object of those kinds. What
fails any check is refused by name (`RefusedArchiveError`): the file, the node or the text.
"""

from __future__ import annotations

import math
import operator
import re
from pathlib import Path

import torch

from tessel._torch import (
    HigherOrderOperator,
    OpOverload,
    RefusedArchiveError,
    load_exported_program,
)

__all__ = ["RefusedArchiveError", "check_expression", "check_target", "load_pt2"]

_LONGEST_EXPRESSION = 4096

# the sympy classes and functions torch writes sizes with (torch.utils._sympy.functions, and
# sympy's own, as printed and as `srepr` spells them)
_FUNCTIONS = frozenset(
    {
        "FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv", "CeilToInt",
        "FloorToInt", "CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv",
        "IntTrueDiv", "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt",
        "RoundToInt", "RoundDecimal", "ToFloat", "Identity", "Max", "Min", "Abs", "floor",
        "ceiling", "sqrt", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not", "oo", "zoo",
        "nan", "true", "false", "True", "False", "Symbol", "Integer", "Rational", "Float", "Add",
        "Mul", "Pow", "Equality", "Unequality", "StrictLessThan", "LessThan",
        "StrictGreaterThan", "GreaterThan", "BooleanTrue", "BooleanFalse", "Infinity",
        "NegativeInfinity", "ComplexInfinity", "NaN", "IntInfinity", "NegativeIntInfinity",
        "Piecewise", "ExprCondPair", "Zero", "One", "NegativeOne", "Half",
    }
)  # fmt: skip
_SYMBOL = re.compile(r"[a-z]+[0-9]+", re.ASCII)
_TOKEN = re.compile(
    r"[ ]*(?:(?P<number>[0-9]+(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?)"
    r"|(?P<quoted>'(?:[a-z]+[0-9]+|[-+]?[0-9][0-9.e+-]*|[-+]?inf|nan)')"  # a symbol, a number
    r"|(?P<name>[A-Za-z][A-Za-z0-9_]*)"
    r"|(?P<operator>\*\*|//|<=|>=|==|!=|[-+*/%(),<>&|~=]))[ ]*",
    re.ASCII,
)
_KEYWORD = re.compile(r"[ ]*=(?!=)", re.ASCII)  # after a name: a keyword argument's

# Python operators a graph may call on symbolic sizes, by the name the archive gives them
_PYTHON_OPERATORS = {
    **{
        f"_operator.{name}": getattr(operator, name)
        for name in (
            "getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "pow", "neg", "pos",
            "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "not_", "abs",
        )
    },
    **{f"math.{name}": getattr(math, name) for name in ("ceil", "floor", "trunc", "sqrt")},
    **{
        f"torch.{name}": getattr(torch, name)
        for name in ("sym_int", "sym_float", "sym_max", "sym_min", "sym_not", "sym_ite",
                     "sym_sqrt", "sym_sum")
        if hasattr(torch, name)
    },
}  # fmt: skip
_OPERATOR = re.compile(r"torch\.ops\.(?:higher_order\.\w+|\w+\.\w+\.\w+)", re.ASCII)


def check_expression(text: str) -> None:
    """Refuse a symbolic size's text unless the grammar in the module docstring takes it."""
    if not isinstance(text, str) or not text.strip() or len(text) > _LONGEST_EXPRESSION:
        raise RefusedArchiveError(f"a symbolic size {text!r:.80} is not an expression")
    at = 0
    while at < len(text):
        token = _TOKEN.match(text, at)
        if token is None:
            raise RefusedArchiveError(
                f"a symbolic size {text!r:.200} holds {text[at : at + 20]!r}, which is not "
                "an integer, a size symbol, an operator or a sympy function"
            )
        name = token["name"]
        if (
            name is not None
            and name not in _FUNCTIONS
            and not _SYMBOL.fullmatch(name)
            and not _KEYWORD.match(text, token.end("name"))
        ):
            raise RefusedArchiveError(
                f"a symbolic size {text!r:.200} names {name!r}, which is neither a size "
                "symbol nor a sympy function torch writes sizes with"
            )
        at = token.end()


def check_target(target: str) -> None:
    """Refuse a node's target unless it names an operator (see the module docstring)."""
    if not isinstance(target, str) or not (
        _OPERATOR.fullmatch(target) or target in _PYTHON_OPERATORS
    ):
        raise RefusedArchiveError(f"a node calls {target!r:.200}, which is not an operator")


def load_pt2(path: str | Path) -> torch.export.ExportedProgram:
    """The ExportedProgram a `.pt2` file holds, read as data (see the module docstring). Any
    file that does not read so is refused with RefusedArchiveError, whatever torch's reader
    raised on it."""
    try:
        program = load_exported_program(str(path), check_expression, check_target)
    except RefusedArchiveError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch's reader has no error type of its own
        raise RefusedArchiveError(
            f"does not load as a torch.export.save archive ({type(exc).__name__}: {exc})"
        ) from None
    allowed = set(_PYTHON_OPERATORS.values())
    for module in program.graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op in ("call_method", "call_module"):
                raise RefusedArchiveError(f"node {node.name!r} is a {node.op}, not an operator")
            if node.op != "call_function":
                continue
            target = node.target
            if isinstance(target, (OpOverload, HigherOrderOperator)):
                continue
            if target not in allowed:
                raise RefusedArchiveError(f"node {node.name!r} calls {target!r:.200}")
    return program
