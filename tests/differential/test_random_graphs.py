"""Random small graphs of the ops models are made of, partitioned, equal eager.

Hypothesis draws a model of matmuls, attention, norms, elementwise ops, reshapes, gathers and
reductions over random sizes (dims that do and do not divide the device count), a device count
and a memory setting; the build checks itself against eager, and the built model is run again,
in process, on inputs the build never saw.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tessel
from tessel.builder.verify import tolerance
from tessel.capture import capture
from tessel.config.cluster import cluster_from_dict
from tessel.demo import tight_cluster
from tessel.package.format import BuiltPackage
from tessel.plan import has_rule
from tessel.runtime.inprocess import run_in_process

BLOCKS = ("linear", "mlp", "attention", "norm", "activation", "reshape", "reduction", "gather")


class RandomModel(torch.nn.Module):
    """Token ids -> embedding, a random sequence of blocks, -> logits."""

    def __init__(self, vocab: int, hidden: int, heads: int, blocks: list[str], seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.heads, self.blocks = heads, blocks
        self.embed = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g))
        self.params = torch.nn.ParameterList()
        for block in blocks:
            shapes = {
                "linear": [(hidden, hidden), (hidden,)],
                "mlp": [(3 * hidden, hidden), (hidden, 3 * hidden)],
                "attention": [(3 * hidden, hidden), (hidden, hidden)],
                "norm": [(hidden,)],
                "gather": [(vocab, hidden)],
            }.get(block, [])
            for shape in shapes:
                self.params.append(
                    torch.nn.Parameter(torch.randn(shape, generator=g) / math.sqrt(shape[-1]))
                )
        self.head = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g) / hidden**0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed[ids]
        params = iter(self.params)
        b, s, h = x.shape
        for block in self.blocks:
            if block == "linear":
                w, bias = next(params), next(params)
                x = F.linear(x, w, bias)
            elif block == "mlp":
                up, down = next(params), next(params)
                x = x + F.linear(F.gelu(F.linear(x, up)), down)
            elif block == "attention":
                qkv, out = next(params), next(params)
                q, k, v = F.linear(x, qkv).chunk(3, dim=-1)
                split = lambda t: t.view(b, s, self.heads, h // self.heads).transpose(1, 2)  # noqa: E731
                a = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
                x = x + F.linear(a.transpose(1, 2).reshape(b, s, h), out)
            elif block == "norm":
                w = next(params)
                x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
            elif block == "activation":
                x = F.silu(x) + torch.tanh(x)
            elif block == "reshape":
                x = x.transpose(1, 2).contiguous().view(b, h, s).transpose(1, 2) * 0.5
            elif block == "reduction":
                x = x - x.mean(dim=1, keepdim=True) + x.softmax(dim=-1)
            elif block == "gather":
                table = next(params)
                x = x + table[ids.flip(-1)]
        return F.linear(x, self.head)


@st.composite
def cases(draw):
    heads = draw(st.sampled_from([1, 2, 3, 4]))
    hidden = heads * draw(st.sampled_from([2, 3, 4, 6]))
    return dict(
        vocab=draw(st.sampled_from([13, 16, 24, 30])),
        hidden=hidden,
        heads=heads,
        blocks=draw(st.lists(st.sampled_from(BLOCKS), min_size=1, max_size=5)),
        batch=draw(st.integers(1, 4)),
        seq=draw(st.sampled_from([3, 4, 6, 8])),
        devices=draw(st.integers(2, 4)),
        tight=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(
    max_examples=20,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(cases())
def test_random_graph_partitions_to_eager(case):
    model = RandomModel(case["vocab"], case["hidden"], case["heads"], case["blocks"], case["seed"])
    g = torch.Generator().manual_seed(case["seed"])
    ids = torch.randint(0, case["vocab"], (case["batch"], case["seq"]), generator=g)
    captured = capture(model, (ids,), keep=has_rule)
    devices = case["devices"]
    cluster = (
        # graphs of a few hundred bytes: the programs' own constants weigh in
        cluster_from_dict(tight_cluster(captured, devices, slack=0.3), "tight.json")
        if case["tight"]
        else devices
    )
    built = tessel.build(captured, cluster=cluster)  # checks itself against eager
    assert built.manifest.plan.verify.max_relative_diff <= tolerance(torch.float32)

    fresh = torch.randint(0, case["vocab"], ids.shape, generator=g)
    (got,) = run_in_process(BuiltPackage(built.manifest, built.members), [fresh])
    with torch.no_grad():
        want = model(fresh)
    scale = max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= tolerance(torch.float32) * scale
