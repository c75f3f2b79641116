"""A training step as one graph: the model's loss and the gradient of every trainable weight.

The model is wrapped so that its forward returns `(loss, *gradients)`, with the gradients taken
by `torch.autograd.grad` inside the trace; torch.export then records forward and backward
in one ATen graph (the joint graph), which the planner places and lowering partitions like any
other. Each gradient output is marked with the weight it belongs to (`GradientOutputs` on the
output node), so the plan returns it placed like that weight: a rank receives the gradient of
exactly the shard it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from tessel.capture.layers import layer_of
from tessel.config.errors import ConfigError

GRADIENTS_META = "tessel_gradients"
STATE_META = "tessel_state"
READ_STATE_META = "tessel_read_state"


@dataclass(frozen=True)
class GradientOutputs:
    """Output `i + 1` of a training graph is the gradient of weight `names[i]` (by FQN); output
    0 is the loss. `held_factor` is what a device holds between steps per weight byte: the
    weight and the optimizer's state for it (3 for Adam's two moments), less where sharded
    over data-parallel replicas; the memory model holds that much for each weight."""

    names: tuple[str, ...]
    held_factor: float = 1.0


def gradient_outputs(graph: fx.Graph) -> GradientOutputs | None:
    """The gradient marks of a training graph; None for an inference graph."""
    for n in reversed(graph.nodes):
        if n.op == "output":
            return n.meta.get(GRADIENTS_META)
    return None


def mark_gradients(graph: fx.Graph, marks: GradientOutputs) -> None:
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    out.meta[GRADIENTS_META] = marks


def state_outputs(graph: fx.Graph) -> tuple[str, ...]:
    """The state a generation graph writes in place: output `i` is state `names[i]` (by FQN),
    after the write. Empty for any other graph."""
    for n in reversed(graph.nodes):
        if n.op == "output":
            return n.meta.get(STATE_META, ())
    return ()


def read_state(graph: fx.Graph) -> tuple[str, ...]:
    """The state a generation graph reads and another gear writes (an encoder-decoder's
    cross-attention cache, read by its decode gear): placed as state, never written here."""
    for n in reversed(graph.nodes):
        if n.op == "output":
            return n.meta.get(READ_STATE_META, ())
    return ()


def mark_state(graph: fx.Graph, names: tuple[str, ...], read: tuple[str, ...] = ()) -> None:
    """Mark output `i` as the write into state `names[i]`, and `read` as state only read."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    out.meta[STATE_META] = names
    out.meta[READ_STATE_META] = read


def placed_like(graph: fx.Graph, param_targets: dict[str, str]) -> dict[int, fx.Node]:
    """Output index -> the weight placeholder whose placement that output is returned in: a
    training step's gradients, a generation step's state. Where any output is, the other
    outputs are returned whole on every rank.

    `param_targets` maps placeholder names to FQNs (a tied weight's placeholder stands for all
    of its names).
    """
    marks = gradient_outputs(graph)
    by_fqn = {fqn: name for name, fqn in param_targets.items()}
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    if marks is None:
        return {i: placeholders[by_fqn[fqn]] for i, fqn in enumerate(state_outputs(graph))}
    return {i + 1: placeholders[by_fqn[fqn]] for i, fqn in enumerate(marks.names)}


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The weights a step updates, by FQN, each once (a tied weight under its first name)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


class TrainingStep(torch.nn.Module):
    """`model` whose forward returns `(loss, *gradients)` in `trainable_parameters` order,
    the gradients taken by `torch.autograd.grad` while torch.export traces (so custom autograd
    functions, such as mixture-of-experts routing, are traced through their backward).

    The model's children, parameters and buffers are registered here under their own names, so
    the exported graph's weights keep the model's FQNs.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_model", model)  # not a child: its names are ours
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, p in model._parameters.items():
            if p is not None:
                self.register_parameter(name, p)
        for name, b in model._buffers.items():
            if b is not None:
                self.register_buffer(
                    name, b, persistent=name not in model._non_persistent_buffers_set
                )
        self.names = tuple(trainable_parameters(model))
        first: dict[int, str] = {}
        self.aliases = {  # every name of a weight -> its first name
            n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)
        }

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        model = self._model
        # export lifts each name of a tied weight as its own input: the gradient of a weight
        # sums those of all its names (GPT-2's embedding and output layer)
        lifted = {
            n: p
            for n, p in model.named_parameters(remove_duplicate=False)
            if self.aliases[n] in self.names
        }
        with torch.enable_grad():
            for p in lifted.values():
                p.requires_grad_(True)
            loss = scalar_loss(model(*args, **kwargs))
            grads = torch.autograd.grad(loss, list(lifted.values()), allow_unused=True)
        total: dict[str, torch.Tensor] = {}
        for n, g in zip(lifted, grads):
            if g is not None:
                first = self.aliases[n]
                total[first] = total[first] + g if first in total else g
        return (
            loss.detach(),
            *(total[n] if n in total else torch.zeros_like(lifted[n]) for n in self.names),
        )


def scalar_loss(out: Any) -> torch.Tensor:
    """The loss in a model's output: the output itself, its `.loss` (transformers' outputs), or
    its first element; refused unless a floating-point scalar."""
    loss = getattr(out, "loss", None) if not isinstance(out, torch.Tensor) else out
    if loss is None and isinstance(out, (tuple, list)) and out:
        loss = out[0]
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.dtype.is_floating_point:
        found = (
            f"a tensor of shape {tuple(loss.shape)} ({loss.dtype})"
            if isinstance(loss, torch.Tensor)
            else type(out).__name__
        )
        raise ConfigError(
            "model",
            "forward",
            f"a training step needs the forward to return a scalar loss (a 0-dim float tensor, "
            f"an output with .loss, or a tuple whose first element is the loss); found {found}. "
            "Pass labels (transformers models compute the loss from them) or wrap the model",
        )
    return loss


def check_trainable(model: torch.nn.Module) -> None:
    """Refuse what a training step cannot trace faithfully: no weights to train, random dropout."""
    if not trainable_parameters(model):
        raise ConfigError("model", "parameters", "has no parameter with requires_grad=True")
    if model.training:
        for name, m in model.named_modules():
            p = getattr(m, "p", 0.0)
            if isinstance(m, torch.nn.modules.dropout._DropoutNd) and p > 0:
                raise ConfigError(
                    "model",
                    name,
                    f"is a {type(m).__name__} with p={p} in training mode: programs draw no "
                    "random numbers; set its p to 0 (transformers: the config's *dropout/*pdrop "
                    "keys) or call model.eval()",
                )


def attribute_gradients_to_layers(graph: fx.Graph) -> int:
    """Give each backward node a layer, so identical layers share decisions in the backward
    pass too and are lowered once (a joint graph's backward nodes are traced outside any
    module). Returns how many nodes got a layer.

    A backward node reading values a layer's forward computed is of the latest such layer; one
    reading only gradients is of the layer of the gradient it reads. Those labels interleave
    where layers meet (the gradient of a residual sum is read by the layer below), so each
    layer's backward is then made one contiguous block: from the first node of that layer to
    the first node of the next one the backward reaches, every node between included. The
    blocks repeat layer by layer, so the planner's comparison of layers finds the repeats (the
    first and last layer, whose neighbours differ, stay on their own).
    """
    backward = [n for n in graph.nodes if _traced_by_grad(n)]
    read_by_grad = set(backward)
    labels: dict[fx.Node, tuple[str, int]] = {}
    for n in backward:
        own = layer_of(n)
        if own is not None:
            labels[n] = own
            continue
        read = [layer_of(a) for a in n.all_input_nodes if a not in read_by_grad and layer_of(a)]
        if not read:
            read = [labels[a] for a in n.all_input_nodes if a in labels]
        if read:
            labels[n] = max(read, key=lambda key: key[1])
    blocks: dict[fx.Node, tuple[str, int]] = {}
    labelled = [i for i, n in enumerate(backward) if n in labels]
    if labelled:
        seen: set[tuple[str, int]] = set()
        block = None
        for n in backward[labelled[0] : labelled[-1] + 1]:
            if n in labels and labels[n] not in seen:
                seen.add(labels[n])
                block = labels[n]
            blocks[n] = block
    for n, (family, index) in blocks.items():
        stack = {"tessel_layer": (family.replace("*", str(index)), "")}
        n.meta["nn_module_stack"] = {**stack, **(n.meta.get("nn_module_stack") or {})}
    return len(blocks)


def _traced_by_grad(n: fx.Node) -> bool:
    """Recorded while `torch.autograd.grad` ran (export names the torch function per node)."""
    fn = n.meta.get("torch_fn")
    return n.op == "call_function" and isinstance(fn, tuple) and str(fn[-1]).endswith(".grad")


def drop_detach(graph: fx.Graph) -> None:
    """`detach` is the identity in a program, which runs without autograd."""
    for n in list(graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten.detach.default:
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)


def drop_empty_cat_inputs(graph: fx.Graph) -> None:
    """`cat` skips 1-D empty tensors (legacy semantics) that the backward of a slice makes;
    removed, so every input of a `cat` has the output's rank and can be sharded like it."""
    for n in graph.nodes:
        if n.op != "call_function" or n.target is not torch.ops.aten.cat.default:
            continue
        keep = [
            a
            for a in n.args[0]
            if not (
                isinstance(a, fx.Node)
                and isinstance(v := a.meta.get("val"), torch.Tensor)
                and v.dim() == 1
                and v.shape[0] == 0
            )
        ]
        if 0 < len(keep) < len(n.args[0]):
            n.args = (keep, *n.args[1:])
    graph.eliminate_dead_code()
