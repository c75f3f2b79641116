"""Operators a model library registers itself (`torch.library` custom ops).

The planner has no sharding rule for them and a package may only call operators from tessel's
list, so each custom op a captured model calls is rewritten into ATen at capture, by a
decomposition that computes the same values with static shapes. A custom op tessel has no
decomposition for is refused by name, with the layer that calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from tessel._torch import C10D_FUNCTIONAL, OpOverload
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


DECOMPOSITIONS: dict[str, Callable[..., Any]] = {
    "transformers::grouped_mm_fallback": _grouped_mm_over_all_experts,
    "transformers::grouped_mm_fallback_backward": _grouped_mm_backward_over_all_experts,
}


def _layer(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for path, _ in stack.values() if path]
    return paths[-1] if paths else "(outside any module)"


def custom_op_decompositions(graph: fx.Graph) -> dict[Any, Callable[..., Any]]:
    """The decomposition of every custom op `graph` calls; `CaptureError` for one tessel lacks."""
    table: dict[Any, Callable[..., Any]] = {}
    for n in graph.nodes:
        target = n.target
        if n.op != "call_function" or not isinstance(target, OpOverload):
            continue
        if target.namespace in BUILT_IN_NAMESPACES or target in table:
            continue
        name = target._schema.name
        if name not in DECOMPOSITIONS:
            raise CaptureError(
                f"the model calls the custom operator {name} (in {_layer(n)}), which tessel "
                f"cannot partition: it has no decomposition into ATen operators. Known custom "
                f"operators: {', '.join(sorted(DECOMPOSITIONS))}"
            )
        table[target] = DECOMPOSITIONS[name]
    return table
