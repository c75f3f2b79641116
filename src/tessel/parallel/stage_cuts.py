"""Where to cut a network into pipeline stages when the planner cuts it (`AutoParallel` in
"recursive_programming" with `pipeline(stages=N)` on a plain network).

A stage starts at a module, as `nn.Pipeline`'s `stage_config` says. The candidates are the
network's repeated blocks (the members of its `ModuleList`s and `Sequential`s: a transformer's
layers) and the modules that run after the last block (final norm, output layer). Each is
weighed by the floating-point operations of one micro-batch's forward and backward pass through
it, as torch's `FlopCounterMode` counts them; what runs before the first block (embeddings)
joins the first stage, what no module runs (the loss) the last. The cut minimises the largest
stage's work: the pipeline runs at the pace of its slowest stage.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.flop_counter import FlopCounterMode

from tessel.parallel.errors import ParallelError
from tessel.parallel.micro_batches import _tensor_output


def _blocks(network: torch.nn.Module) -> list[str]:
    """The members of the network's module lists, outermost lists only."""
    found: list[str] = []
    for name, module in network.named_modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and not any(
            name.startswith(f"{b}.") for b in found
        ):
            found += [f"{name}.{child}" if name else child for child, _ in module.named_children()]
    return found


def _work(
    network: torch.nn.Module, args: tuple, kwargs: dict
) -> tuple[dict[str, int], int, list[str]]:
    """Each module's flops over one forward and backward pass, all flops of the pass, and the
    modules in the order their forward passes begin."""
    order: list[str] = []
    hooks = [
        module.register_forward_pre_hook(functools.partial(lambda n, *_: order.append(n), name))
        for name, module in network.named_modules()
        if name
    ]
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            _tensor_output(network(*args, **kwargs), "AutoParallel").backward()
    finally:
        for hook in hooks:
            hook.remove()
        network.zero_grad(set_to_none=True)
    root = type(network).__name__
    flops = {
        name.removeprefix(root).removeprefix("."): sum(ops.values())
        for name, ops in counter.get_flop_counts().items()
    }
    return flops, counter.get_total_flops(), list(dict.fromkeys(order))


def balanced_stage_config(
    network: torch.nn.Module, args: tuple, kwargs: dict, stages: int
) -> dict[str, int]:
    """A `stage_config` cutting `network` (called on one micro-batch `args`, `kwargs`) into
    `stages` stages of about equal work (see the module docstring)."""
    flops, total, order = _work(network, args, kwargs)
    chosen = set(_blocks(network))
    called = [b for b in order if b in chosen]
    if not called:
        raise ParallelError(
            "pipeline: the network runs no repeated blocks (members of its module lists) to "
            "cut into stages; give a Pipeline network a stage_config"
        )
    inside = tuple(f"{b}." for b in called)
    holding = {b.rsplit(".", k)[0] for b in called for k in range(1, b.count(".") + 1)} | {""}
    # the outermost modules outside the blocks, before the first block or after the last
    tops = [
        n
        for n in order
        if not n.startswith(inside)
        and n not in holding
        and n not in chosen
        and n.rpartition(".")[0] in holding
    ]
    before = [n for n in tops if order.index(n) < order.index(called[0])]
    after = [n for n in tops if order.index(n) > order.index(called[-1])]
    items = called + after  # a stage starts at one of these
    if len(items) < stages:
        raise ParallelError(
            f"pipeline: the network has {len(items)} places to start a stage (its repeated "
            f"blocks and the modules after them) to cut into {stages} stages; give a Pipeline "
            "network a stage_config"
        )
    work = [float(flops.get(n, 0)) for n in items]
    work[0] += sum(flops.get(n, 0) for n in before)
    counted = sum(flops.get(n, 0) for n in (*before, *items))
    work[-1] += max(0.0, total - counted)  # the loss, computed by no module
    cuts = _least_largest(work, stages)
    starts = [before[0] if before else items[0], *(items[i] for i in cuts)]
    return {name: s for s, name in enumerate(starts)}


def _least_largest(work: list[float], stages: int) -> list[int]:
    """Where stages 1.. start in `work` so the largest stage's sum is least (the first such
    cut in order)."""
    n = len(work)
    prefix = [0.0]
    for w in work:
        prefix.append(prefix[-1] + w)
    # best[k][i]: the least largest stage over work[:i] in k stages, and the last start
    best: list[list[tuple[float, int]]] = [
        [(float("inf"), -1)] * (n + 1) for _ in range(stages + 1)
    ]
    best[0][0] = (0.0, -1)
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                largest = max(best[k - 1][j][0], prefix[i] - prefix[j])
                if largest < best[k][i][0]:
                    best[k][i] = (largest, j)
    cuts, i = [], n
    for k in range(stages, 0, -1):
        j = best[k][i][1]
        cuts.append(j)
        i = j
    return sorted(c for c in cuts if c > 0)


def micro_batches_for(rows: int, stages: int) -> int:
    """The fewest micro-batches, at least `stages` (1F1B keeps every stage busy then), that
    split `rows` evenly."""
    for m in range(stages, rows + 1):
        if rows % m == 0:
            return m
    raise ParallelError(
        f"pipeline: a replica's {rows} rows do not split into {stages} or more equal micro-batches"
    )
