"""Operators a model library registers itself (`torch.library` custom ops), and ATen
operators with no sharding rule that models call (`aten._grouped_mm`, experts in bf16).

The planner has no sharding rule for them and a package may only call operators from tessel's
list, so each one a captured model calls is rewritten into ATen at capture, by a
decomposition that computes the same values with static shapes. A custom op tessel has no
decomposition for is refused by name, with the layer that calls it, and so is an operator that
draws random numbers (dropout in training mode): a program is a fixed function of its inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from tessel._torch import C10D_FUNCTIONAL, OpOverload
from tessel.config.errors import ConfigError
from tessel.errors import TesselError

BUILT_IN_NAMESPACES = {"aten", "prims", C10D_FUNCTIONAL}


class CaptureError(TesselError, ValueError):
    """The model calls something tessel cannot turn into its operators."""


def _grouped_mm_over_all_experts(
    input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """A grouped matmul (rows sorted by expert, `offs` the cumulative row count per expert):
    every expert multiplies every row and a one-hot mask keeps each row's own expert.

    The values equal the grouped kernel's; the shapes are static, and the expert dimension is
    one the planner can shard (each device runs its experts; the sum over experts is a partial
    sum).
    """
    rows = torch.arange(input.shape[0], device=input.device).to(offs.dtype)
    expert = torch.searchsorted(offs, rows, right=True)  # rows past the last offset: none
    experts = torch.arange(weight.shape[0], device=input.device)
    mask = (expert.unsqueeze(1) == experts.unsqueeze(0)).to(input.dtype)
    every = torch.einsum("sh,eho->seo", input, weight)
    return (every * mask.unsqueeze(-1)).sum(dim=1)


def _grouped_mm_backward_over_all_experts(
    input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, grad_output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `_grouped_mm_over_all_experts` with respect to input and weight: each
    row's gradient flows through its own expert only (the same one-hot mask)."""
    rows = torch.arange(input.shape[0], device=input.device).to(offs.dtype)
    expert = torch.searchsorted(offs, rows, right=True)
    experts = torch.arange(weight.shape[0], device=input.device)
    mask = (expert.unsqueeze(1) == experts.unsqueeze(0)).to(input.dtype)  # (rows, experts)
    grad_input = torch.einsum("so,eho,se->sh", grad_output, weight, mask)
    grad_weight = torch.einsum("sh,so,se->eho", input, grad_output, mask)
    return grad_input, grad_weight


def _group_of(index: torch.Tensor, offs: torch.Tensor, groups: int) -> torch.Tensor:
    """One-hot `[len(index), groups]`: the group each index falls in, `offs` holding each
    group's end (an index past the last end is in none)."""
    group = torch.searchsorted(offs, index.to(offs.dtype), right=True)
    return (group.unsqueeze(1) == torch.arange(groups, device=offs.device)).to(torch.float32)


def _grouped_mm_aten(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`aten._grouped_mm` (what `transformers` calls for experts in bf16) in every form its
    kernel takes, each group's product computed for all and a one-hot mask keeping its own:
    rows of `a` grouped (2-D x 3-D, the experts' forward), columns of `b` grouped (3-D x 2-D),
    the summed dimension grouped (2-D x 2-D: a 3-D result, the experts' weight gradient), or
    a batch (3-D x 3-D)."""
    if bias is not None:
        raise CaptureError("aten._grouped_mm with a bias: tessel decomposes it without one")
    if offs is None:
        if a.dim() != 3 or b.dim() != 3:
            raise CaptureError(
                f"aten._grouped_mm without offsets takes two 3-D tensors, found "
                f"{a.dim()}-D and {b.dim()}-D"
            )
        out = torch.bmm(a, b)
    elif a.dim() == 2 and b.dim() == 3:  # the fallback op's form: its decomposition
        out = _grouped_mm_over_all_experts(a, b, offs)
    elif a.dim() == 3 and b.dim() == 2:
        mask = _group_of(torch.arange(b.shape[1], device=b.device), offs, a.shape[0])
        out = torch.einsum("emk,kn,ne->mn", a, b, mask.to(a.dtype))
    elif a.dim() == 2 and b.dim() == 2:
        mask = _group_of(torch.arange(a.shape[1], device=a.device), offs, offs.shape[0])
        out = torch.einsum("mk,kn,ke->emn", a, b, mask.to(a.dtype))
    else:
        raise CaptureError(
            f"aten._grouped_mm with offsets takes 2-D and 3-D tensors, found {a.dim()}-D and "
            f"{b.dim()}-D"
        )
    return out if out_dtype is None else out.to(out_dtype)


DECOMPOSITIONS: dict[str, Callable[..., Any]] = {
    "transformers::grouped_mm_fallback": _grouped_mm_over_all_experts,
    "transformers::grouped_mm_fallback_backward": _grouped_mm_backward_over_all_experts,
}
# ATen operators with no sharding rule that models call: rewritten like the custom ops
ATEN_DECOMPOSITIONS: dict[str, Callable[..., Any]] = {"aten::_grouped_mm": _grouped_mm_aten}


def _layer(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for path, _ in stack.values() if path]
    return paths[-1] if paths else "(outside any module)"


def refuse_random_numbers(graph: fx.Graph) -> None:
    """Refuse, naming its layer, an operator of `graph` that draws random numbers: dropout
    in training mode (a module, `F.dropout`, attention's `dropout_p`) or a sampling operator.
    Dropout at probability 0, or outside training (`train` False), draws none and stays."""
    for n in graph.nodes:
        seeded = torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
        if n.op != "call_function" or not seeded:
            continue
        p = _argument(n, "dropout_p", _argument(n, "p", None))
        if p is None:
            raise ConfigError(
                "model",
                _layer(n),
                f"calls {n.target}, which draws random numbers: programs draw none, so tessel "
                "cannot build a model that samples inside its forward",
            )
        if p != 0 and _argument(n, "train", True) is not False:
            raise ConfigError(
                "model",
                _layer(n),
                f"calls {n.target} with dropout p={p} in training mode: programs draw no "
                "random numbers; set its p to 0 (transformers: the config's *dropout/*pdrop "
                "keys) or call model.eval()",
            )


def _argument(n: fx.Node, name: str, default: Any) -> Any:
    """The value node `n` passes for its operator's argument `name` (its schema's default where
    not passed), or `default` where the operator has no such argument."""
    for i, arg in enumerate(n.target._schema.arguments):
        if arg.name == name:
            if i < len(n.args):
                return n.args[i]
            if name in n.kwargs:
                return n.kwargs[name]
            return arg.default_value if arg.has_default_value() else default
    return default


def custom_op_decompositions(graph: fx.Graph) -> dict[Any, Callable[..., Any]]:
    """The decomposition of every custom op `graph` calls; `CaptureError` for one tessel lacks."""
    table: dict[Any, Callable[..., Any]] = {}
    for n in graph.nodes:
        target = n.target
        if n.op != "call_function" or not isinstance(target, OpOverload):
            continue
        name = target._schema.name
        if name in ATEN_DECOMPOSITIONS:
            table[target] = ATEN_DECOMPOSITIONS[name]
            continue
        if target.namespace in BUILT_IN_NAMESPACES or target in table:
            continue
        if name not in DECOMPOSITIONS:
            raise CaptureError(
                f"the model calls the custom operator {name} (in {_layer(n)}), which tessel "
                f"cannot partition: it has no decomposition into ATen operators. Known custom "
                f"operators: {', '.join(sorted(DECOMPOSITIONS))}"
            )
        table[target] = DECOMPOSITIONS[name]
    return table
