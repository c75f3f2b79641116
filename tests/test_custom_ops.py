"""Operators tessel rewrites into ATen at capture: `transformers`' experts in bf16 call
`aten._grouped_mm`, which has no sharding rule; its decomposition must equal the kernel in every
form the forward and the backward take, and a bf16 mixture of experts must build. Operators
that draw random numbers are refused at capture, naming the layer."""

from __future__ import annotations

import pytest
import torch
from tests.differential.zoo import FAMILIES

import tessel
from tessel.builder.verify import tolerance
from tessel.capture.custom_ops import CaptureError, _grouped_mm_aten

OFFS = torch.tensor([2, 5, 8], dtype=torch.int32)  # 3 groups, ends of each


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).bfloat16()


@pytest.mark.parametrize(
    "a, b, offs",
    [
        ((8, 16), (3, 16, 8), OFFS),  # rows grouped: the experts' forward
        ((3, 8, 16), (16, 24), torch.tensor([8, 16, 24], dtype=torch.int32)),  # columns grouped
        ((8, 8), (8, 16), OFFS),  # the summed dimension grouped: a weight's gradient
        ((3, 8, 16), (3, 16, 8), None),  # batched
    ],
    ids=["2d-3d", "3d-2d", "2d-2d", "3d-3d"],
)
def test_grouped_mm_decomposition_equals_the_kernel(a, b, offs) -> None:
    x, y = _bf16(*a), _bf16(*b)
    want = torch._grouped_mm(x, y, offs=offs).float()
    got = _grouped_mm_aten(x, y, offs).float()
    assert got.shape == want.shape
    assert (got - want).abs().max() <= tolerance(torch.bfloat16) * want.abs().max()


def test_grouped_mm_forms_it_cannot_take_are_refused() -> None:
    x = torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(CaptureError, match="with a bias"):
        _grouped_mm_aten(x, torch.zeros(3, 16, 8, dtype=torch.bfloat16), OFFS, bias=x)
    with pytest.raises(CaptureError, match="two 3-D tensors"):
        _grouped_mm_aten(x, torch.zeros(16, 8, dtype=torch.bfloat16))


def test_a_bf16_mixture_of_experts_builds_and_equals_eager() -> None:
    """Mixtral in bf16 (its experts call `aten._grouped_mm`) on 3 devices: the build's check
    runs every rank's program from the package against the eager model."""
    spec = FAMILIES["mixtral"]
    model = spec.make().to(torch.bfloat16)
    built = tessel.build(model, spec.inputs(1), cluster=3, verify=True)
    check = built.manifest.plan.verify
    assert check is not None and check.max_relative_diff <= tolerance(torch.bfloat16)


class _Attention(torch.nn.Module):
    """Attention whose dropout (and an optional noise term) follow the module's mode."""

    def __init__(
        self, p: float = 0.0, functional_dropout: float = 0.0, noise: bool = False
    ) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 24)
        self.p, self.functional_dropout, self.noise = p, functional_dropout, noise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        p = self.p if self.training else 0.0
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p)
        out = torch.nn.functional.dropout(out, self.functional_dropout, self.training)
        return out + torch.rand_like(out) if self.noise else out


class _Net(torch.nn.Module):
    def __init__(self, **attention: object) -> None:
        super().__init__()
        self.attn = _Attention(**attention)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x).sum()


@pytest.mark.parametrize(
    "attention, refusal",
    [
        (dict(p=0.1), "with dropout p=0.1 in training mode"),
        (dict(functional_dropout=0.2), "calls aten.native_dropout.default with dropout p=0.2"),
        (dict(noise=True), "calls aten.rand_like.default, which draws random numbers"),
    ],
    ids=["attention-dropout", "functional-dropout", "noise"],
)
def test_a_step_that_draws_random_numbers_is_refused_naming_its_layer(attention, refusal):
    from tessel.capture import capture_training
    from tessel.config.errors import ConfigError

    x = torch.randn(2, 5, 8)
    with pytest.raises(ConfigError) as err:
        capture_training(_Net(**attention).train(), (x,))
    assert err.value.key == "attn" and refusal in str(err.value)
    # at probability 0, or in eval mode, the same layers draw nothing and are captured
    if not attention.get("noise"):
        capture_training(_Net().train(), (x,))
        tessel.capture.capture(_Net(**attention), (x,))
