"""Capture: a stack of identical layers traced once and stamped out gives the graph tracing
every layer gives; anything doubtful traces every layer instead."""

from __future__ import annotations

import logging

import pytest
import torch
from tests.conftest import hf_gpt2, hf_llama, token_ids
from torch import fx, nn

import tessel.capture.export as export_mod
from tessel.capture import capture
from tessel.capture.stamp import find_stacks, why_not_a_stack
from tessel.plan import has_rule

FALLBACK = "tracing every layer"
EXPORT_LOG = "tessel.capture.export"


# --- models --------------------------------------------------------------------------------


def tiny_gpt2() -> nn.Module:
    return hf_gpt2(layers=4, vocab=128)


def tiny_llama() -> nn.Module:
    return hf_llama(layers=4, kv_heads=2, vocab=128)


def lm_inputs() -> dict:
    return {"input_ids": token_ids(seq=8, vocab=128), "use_cache": False}


class Block(nn.Module):
    def __init__(self, i: int, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.layer_idx = i

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class IndexReadingBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) / (self.layer_idx + 1)


class ScaledBlock(Block):
    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.lin(x) * scale


class InPlaceBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return self.lin(x)


class AuxBlock(Block):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h, h.sum(-1, keepdim=True)


class SideInputBlock(Block):
    """Reads a tensor its caller leaves on it rather than passing it as an argument."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.side


class Activation(nn.Module):
    """A function as a module, which a layer holds outside its children."""

    def __init__(self, slope: float = 0.1) -> None:
        super().__init__()
        self.slope = slope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.leaky_relu(x, self.slope)


class FunctionHoldingBlock(Block):
    """Holds its own `Activation` in a dict, not as a child: `transformers` with `kernels`
    installed gives each attention layer its own wrapper of the rotary function so."""

    def __init__(self, i: int, width: int = 8) -> None:
        super().__init__(i, width)
        self.funcs = {"act": Activation()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.funcs["act"](self.lin(x))


class TypeTestingBlock(Block):
    """Behaves by the type of its index attribute, without reading its value."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (2.0 if isinstance(self.layer_idx, int) else 1.0)


class Net(nn.Module):
    """A linear, then a ModuleList of 4 blocks called in a way `mode` picks."""

    def __init__(self, block: type[Block] = Block, mode: str = "plain", layers: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(block(i) for i in range(layers))
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        order = list(enumerate(self.blocks))
        if self.mode == "reversed":
            order.reverse()
        elif self.mode == "first_twice":
            order.insert(0, (0, self.blocks[0]))
        extra = None
        firsts = []
        for i, block in order:
            if self.mode == "scale":
                h = block(h, scale=float(i))
            elif self.mode == "aux":
                h, aux = block(h)
                if i == len(self.blocks) - 1:  # only the last layer's second output is used
                    extra = aux
            elif self.mode == "side":
                block.side = h * 2
                h = block(h)
            else:
                h = block(h)
            firsts.append(h)
        if self.mode == "first_out":  # layer 0's output is a model output too
            return h + 1, firsts[0]
        return h if extra is None else h + extra


class SharedBlock(nn.Module):
    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(torch.relu(self.lin(x)))


class SharedNet(nn.Module):
    """Every block holds the same `shared` Linear (registered only inside the blocks)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        shared = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(SharedBlock(shared) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


# --- helpers -------------------------------------------------------------------------------


def canonical(ep: torch.export.ExportedProgram) -> list[tuple]:
    """The graph node by node: op, target and args with every node replaced by its index."""
    nodes = list(ep.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}

    def sub(a):
        return fx.node.map_aggregate(a, lambda x: ("%", index[x]) if isinstance(x, fx.Node) else x)

    out = []
    for n in nodes:
        name = n.name if n.op == "placeholder" else None
        out.append((n.op, name, str(n.target), repr(sub(n.args)), repr(sub(dict(n.kwargs)))))
    return out


def value_meta(ep: torch.export.ExportedProgram) -> list:
    def one(v):
        return (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__

    return [one(n.meta.get("val")) for n in ep.graph.nodes]


def signature(ep: torch.export.ExportedProgram) -> tuple:
    """The graph signature with output node names replaced by their index in the graph."""
    index = {n.name: i for i, n in enumerate(ep.graph.nodes)}
    sig = ep.graph_signature
    ins = [
        (s.kind.name, s.target, s.persistent, getattr(s.arg, "name", repr(s.arg)))
        for s in sig.input_specs
    ]
    outs = [
        (s.kind.name, s.target, index.get(getattr(s.arg, "name", None), repr(s.arg)))
        for s in sig.output_specs
    ]
    return ins, outs


def dangling_signature_names(ep: torch.export.ExportedProgram) -> list[str]:
    """Names the graph signature gives that no node of the graph has."""
    names = {n.name for n in ep.graph.nodes}
    specs = [*ep.graph_signature.input_specs, *ep.graph_signature.output_specs]
    given = [getattr(s.arg, "name", None) for s in specs]
    return [g for g in given if g is not None and g not in names]


def tessel_nodes(ep: torch.export.ExportedProgram) -> list[fx.Node]:
    return [
        n
        for n in ep.graph.nodes
        if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "tessel"
    ]


def fallbacks(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == EXPORT_LOG and FALLBACK in r.msg]


@pytest.fixture
def stamp_spy(monkeypatch):
    """Counts stamp_out calls and the layer placeholders each found in the exported graph."""
    calls: list[int] = []
    real = export_mod.stamp_out

    def spy(ep, stacks):
        stub = torch.ops.tessel.stamped_layer.default
        calls.append(sum(1 for n in ep.graph.nodes if n.target is stub))
        return real(ep, stacks)

    monkeypatch.setattr(export_mod, "stamp_out", spy)
    return calls


def assert_restored(stacks: list) -> None:
    """The stamping left no guarded class and no patched forward on the layers of `stacks`
    (found before capture: a model's forward may change its layers so they no longer match)."""
    assert stacks, "the model has no stack of identical layers to check"
    for stack_layers in (s.layers for s in stacks):
        for k, layer in enumerate(stack_layers):
            for module in layer.modules():
                assert "forward" not in vars(module)
                assert type(module) is type(stack_layers[-1].get_submodule(_path(layer, module)))
                if hasattr(module, "layer_idx"):
                    assert type(module.layer_idx) is int and module.layer_idx == k


def _path(layer: nn.Module, module: nn.Module) -> str:
    return next(p for p, m in layer.named_modules() if m is module)


def output_of(out):
    return out.logits if hasattr(out, "logits") else out


# --- transformers models: the stamped graph is the traced one --------------------------------


@pytest.mark.parametrize("keep", [None, has_rule], ids=["core_aten", "keep_ruled"])
@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_stamped_capture_equals_tracing_every_layer(make, keep, stamp_spy, caplog):
    caplog.set_level(logging.INFO, logger=EXPORT_LOG)
    model = make()
    inputs = lm_inputs()
    stacks = find_stacks(model)
    prefix = "transformer.h" if "GPT2" in type(model).__name__ else "model.layers"
    assert [s.path for s in stacks] == [prefix], why_not_a_stack(model.get_submodule(prefix))
    stamped = capture(model, inputs, keep=keep)
    # the stamped path was taken: layers 1..3 were exported as placeholders, then stamped out
    assert stamp_spy == [3]
    assert fallbacks(caplog) == []
    assert_restored(stacks)
    full = capture(model, inputs, keep=keep, reuse_layers=False)
    assert stamp_spy == [3]  # reuse_layers=False never stamps

    assert tessel_nodes(stamped.program) == []
    assert dangling_signature_names(stamped.program) == []
    assert canonical(stamped.program) == canonical(full.program)
    assert value_meta(stamped.program) == value_meta(full.program)
    stacks = [n.meta.get("nn_module_stack") for n in stamped.program.graph.nodes]
    assert stacks == [n.meta.get("nn_module_stack") for n in full.program.graph.nodes]
    assert signature(stamped.program) == signature(full.program)
    assert stamped.input_names == full.input_names
    assert len(stamped.example_inputs) == len(full.example_inputs)
    assert all(torch.equal(a, b) for a, b in zip(stamped.example_inputs, full.example_inputs))
    assert stamped.program.state_dict.keys() == full.program.state_dict.keys()

    # every layer's nodes exist and are attributed to that layer
    paths = {
        path
        for n in stamped.program.graph.nodes
        for path, _cls in (n.meta.get("nn_module_stack") or {}).values()
    }
    assert {f"{prefix}.{k}" for k in range(4)} <= paths

    with torch.no_grad():
        reference = model(**inputs).logits
        got = output_of(stamped.program.module()(**inputs))
        traced = output_of(full.program.module()(**inputs))
    assert torch.equal(got, traced)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)


def test_find_stacks_reports_a_transformer_layers_index():
    model = tiny_gpt2()
    (stack,) = find_stacks(model)
    assert stack.path == "transformer.h"
    assert len(stack.layers) == 4 and stack.layers[0] is model.transformer.h[0]
    assert [(m, a) for m, a in stack.index_attrs] == [(model.transformer.h[0].attn, "layer_idx")]


# --- small models: stamped where it may be ----------------------------------------------------


def function_holding_net() -> Net:
    return Net(FunctionHoldingBlock)


@pytest.mark.parametrize(
    "make",
    [Net, SharedNet, function_holding_net],
    ids=["blocks", "shared_linear", "own_function_modules"],
)
def test_small_stack_is_stamped_and_equals_the_traced_graph(make, stamp_spy, caplog):
    caplog.set_level(logging.INFO, logger=EXPORT_LOG)
    model = make().eval()
    x = torch.randn(3, 8)
    stamped = capture(model, (x,), keep=has_rule)
    assert stamp_spy == [3] and fallbacks(caplog) == []
    full = capture(model, (x,), keep=has_rule, reuse_layers=False)
    assert tessel_nodes(stamped.program) == []
    assert canonical(stamped.program) == canonical(full.program)
    assert signature(stamped.program) == signature(full.program)
    with torch.no_grad():
        reference = model(x)
        got = stamped.program.module()(x)
    assert torch.equal(got, full.program.module()(x))
    torch.testing.assert_close(got, reference)


@pytest.mark.parametrize("mode", ["plain", "first_out"], ids=["last_layer_out", "first_layer_out"])
def test_stamped_program_signature_names_nodes_of_its_graph(mode, stamp_spy):
    model = Net(mode=mode).eval()
    x = torch.randn(3, 8)
    stamped = capture(model, (x,), keep=has_rule)
    assert stamp_spy == [3]
    with torch.no_grad():
        torch.testing.assert_close(stamped.program.module()(x), model(x))
    assert dangling_signature_names(stamped.program) == []
    full = capture(model, (x,), keep=has_rule, reuse_layers=False)
    assert signature(stamped.program) == signature(full.program)


# --- small models: anything doubtful traces every layer ---------------------------------------

FALLBACK_CASES = {
    "reads_its_index": (lambda: Net(IndexReadingBlock), "'layer_idx' is read"),
    "other_non_tensor_args": (lambda: Net(ScaledBlock, "scale"), "other non-tensor values"),
    "changes_its_input": (lambda: Net(InPlaceBlock), "changes one of its inputs in place"),
    "other_outputs_used": (lambda: Net(AuxBlock, "aux"), "caller never used"),
    "later_layer_first": (lambda: Net(Block, "reversed"), "runs before layer 0"),
    "first_layer_twice": (lambda: Net(Block, "first_twice"), "ran more than once"),
    "reads_a_side_tensor": (lambda: Net(SideInputBlock, "side"), "from outside its arguments"),
}


@pytest.mark.parametrize("case", list(FALLBACK_CASES))
def test_doubtful_stack_traces_every_layer(case, caplog):
    make, reason = FALLBACK_CASES[case]
    caplog.set_level(logging.INFO, logger=EXPORT_LOG)
    model = make().eval()
    stacks = find_stacks(model)
    assert len(stacks) == 1  # the stack is found: the trace itself must refuse it
    x = torch.randn(3, 8)
    got = capture(model, (x,))
    (message,) = fallbacks(caplog)
    assert message.startswith("tracing every layer of blocks")
    assert reason in message
    assert_restored(stacks)
    full = capture(model, (x,), reuse_layers=False)
    assert tessel_nodes(got.program) == []
    assert canonical(got.program) == canonical(full.program)
    assert signature(got.program) == signature(full.program)
    with torch.no_grad():
        reference = make().eval()(x.clone())  # a fresh copy: some blocks change their inputs
        out = got.program.module()(x.clone())
    torch.testing.assert_close(out, reference)


def test_a_layer_testing_its_index_type_is_not_stamped_wrong():
    model = Net(TypeTestingBlock).eval()
    x = torch.randn(3, 8)
    got = capture(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(got.program.module()(x), model(x))


def test_reuse_layers_false_never_stamps(stamp_spy, caplog):
    caplog.set_level(logging.INFO, logger=EXPORT_LOG)
    capture(Net().eval(), (torch.randn(3, 8),), reuse_layers=False)
    assert stamp_spy == [] and fallbacks(caplog) == []


# --- find_stacks ---------------------------------------------------------------------------


class Act(nn.Module):
    def __init__(self, act: str) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = act


def test_find_stacks_reports_index_attributes():
    model = Net()
    (stack,) = find_stacks(model)
    assert stack.path == "blocks"
    assert stack.layers == list(model.blocks)
    assert [(m, a) for m, a in stack.index_attrs] == [(model.blocks[0], "layer_idx")]


def test_find_stacks_takes_an_index_counting_from_any_start():
    model = Net()
    for k, block in enumerate(model.blocks):
        block.layer_idx = 10 + k
    (stack,) = find_stacks(model)
    assert [a for _m, a in stack.index_attrs] == ["layer_idx"]


def test_find_stacks_needs_equal_plain_attributes():
    blocks = nn.ModuleList([Act("relu"), Act("relu"), Act("gelu"), Act("relu")])
    assert find_stacks(blocks) == []
    assert "'relu', 'relu', 'gelu', 'relu'" in why_not_a_stack(blocks)
    assert len(find_stacks(nn.ModuleList([Act("relu") for _ in range(3)]))) == 1


def test_find_stacks_refuses_ints_that_do_not_count_up():
    model = Net()
    for k, block in enumerate(model.blocks):
        block.layer_idx = 2 * k
    assert find_stacks(model) == []
    assert "layer_idx differs between layers and does not count up: 0, 2, 4, 6" in why_not_a_stack(
        model.blocks
    )
    assert why_not_a_stack(Net().blocks) is None


def test_find_stacks_needs_three_layers():
    assert find_stacks(Net(layers=2)) == []
    assert len(find_stacks(Net(layers=3))) == 1


def test_find_stacks_needs_equal_weight_shapes_and_no_hooks():
    model = Net()
    model.blocks[2].lin = nn.Linear(8, 8, bias=False)
    assert find_stacks(model) == []
    assert why_not_a_stack(model.blocks) == (
        "layer 2's weights differ in name, shape or dtype from layer 0's"
    )
    model = Net()
    model.blocks[1].register_forward_hook(lambda *args: None)
    assert find_stacks(model) == []
    assert why_not_a_stack(model.blocks) == "layer 1 has hooks (_forward_hooks)"


def test_find_stacks_needs_function_modules_held_outside_the_children_to_be_equal():
    model = function_holding_net()
    model.blocks[2].funcs["act"].slope = 0.2
    assert find_stacks(model) == []
    assert "funcs differs between layers" in why_not_a_stack(model.blocks)
    model = function_holding_net()
    model.blocks[1].funcs["act"].register_buffer("scale", torch.ones(1))
    assert find_stacks(model) == []  # a tensor outside the layer's weights
    model = function_holding_net()
    model.blocks[3].funcs["act"].register_forward_hook(lambda *args: None)
    assert find_stacks(model) == []


def test_find_stacks_reports_only_the_outermost_stack():
    inner = nn.Module()
    inner.layers = nn.ModuleList(Act("relu") for _ in range(3))
    outer = nn.ModuleList()
    for _ in range(3):
        layer = nn.Module()
        layer.inner = nn.ModuleList(Act("relu") for _ in range(3))
        outer.append(layer)
    root = nn.Module()
    root.outer = outer
    assert [s.path for s in find_stacks(root)] == ["outer"]
