"""The few calls a capture must decompose are decomposed where they stand, each traced alone,
without a second trace of the model; what cannot be shown right is left to that trace."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn

import tessel.capture.export as export
from tessel.capture import capture
from tessel.capture.decompose import decompose_in_place
from tessel.plan import has_rule

aten = torch.ops.aten


class _Buckets(nn.Module):
    """A floor division (no sharding rule: decomposed) between ops the planner keeps whole, one
    of its results read twice."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        q = torch.floor_divide(h * 7, 3)
        return torch.relu(q) + q.sum(dim=-1, keepdim=True)


def _targets(captured) -> set:
    return {n.target for n in captured.program.graph.nodes if n.op == "call_function"}


def test_a_call_without_a_sharding_rule_is_decomposed_where_it_stands(monkeypatch) -> None:
    def no_second_trace(self, *args, **kwargs):
        raise AssertionError("the whole program was traced again")

    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", no_second_trace)
    model = _Buckets().eval()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)) * 5
    captured = capture(model, (x,), keep=has_rule)
    assert aten.floor_divide.default not in _targets(captured)
    assert aten.div.Tensor_mode in _targets(captured)
    # the layer each made node belongs to is the call's
    div = next(n for n in captured.program.graph.nodes if n.target is aten.div.Tensor_mode)
    assert div.meta.get("nn_module_stack") is not None
    assert isinstance(div.meta["val"], torch.Tensor) and div.meta["val"].shape == (4, 8)
    with torch.no_grad():
        got = captured.program.module()(x)
        assert torch.equal(got, model(x))


def test_a_call_whose_results_are_read_one_by_one_is_replaced_by_each() -> None:
    """A call of several results (read through getitem) gives each reader its own result."""

    def f(x: torch.Tensor) -> torch.Tensor:
        low, high = torch.ops.aten.split.Tensor(x, 3, 1)
        return low * 2 + high

    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(torch.empty(2, 6))
    assert any(n.target is operator.getitem for n in gm.graph.nodes)
    table = {aten.split.Tensor: torch._decomp.decomposition_table[aten.split.Tensor]}
    assert decompose_in_place(gm, table)
    assert aten.split.Tensor not in {n.target for n in gm.graph.nodes}
    x = torch.randn(2, 6)
    assert torch.equal(gm(x), f(x))


def test_a_call_the_output_returns_is_left_to_the_whole_trace() -> None:
    """The graph's output names the call's node: replacing it would leave the program's
    signature naming a node that is gone, so nothing is changed and False is returned."""

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.floor_divide(x, 2)

    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(torch.empty(3))
    before = [(n.op, n.target) for n in gm.graph.nodes]
    table = {
        aten.floor_divide.default: export.torch.export.default_decompositions()[
            aten.floor_divide.default
        ]
    }
    assert not decompose_in_place(gm, table)
    assert [(n.op, n.target) for n in gm.graph.nodes] == before


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_a_mixture_of_experts_is_captured_in_one_trace(family, monkeypatch) -> None:
    """Experts' custom ops and their index arithmetic need decompositions: made in place, the
    captured program still computes the model's logits."""
    from tests.differential.zoo import FAMILIES

    calls = []
    original = torch.export.ExportedProgram.run_decompositions

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", counted)
    spec = FAMILIES[family]
    model = spec.make()
    captured = capture(model, spec.inputs(2), keep=has_rule)
    assert calls == []
    assert not any(
        getattr(t, "namespace", "aten") not in ("aten", "prims") for t in _targets(captured)
    )
    with torch.no_grad():
        got = captured.program.module()(*captured.example_args, **captured.example_kwargs)
        want = captured.eager_outputs()
    got = [x for x in torch.utils._pytree.tree_leaves(got) if isinstance(x, torch.Tensor)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5, rtol=1e-5)
