"""DTensor's negative log-likelihood mean over rows split across ranks: the mean of every
rank's tokens, not of each rank's mean.

DTensor's rule for `nll_loss_forward` (the loss of `cross_entropy`) with `reduction="mean"`
averages the ranks' local means. Where labels ignore tokens unevenly (-100 padding), that is
not the batch's mean: each rank's mean weighs its own count. Its backward already divides by
the summed count. So where the target is split, the mean is taken as the sum over every rank
divided by the summed count, both then whole on every rank; other calls keep DTensor's rule.
Registered once, on import, in DTensor's handler table (as torch's `loss_parallel` does).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from tessel._torch import dtensor_op_handlers

_OPS = (torch.ops.aten.nll_loss_forward.default, torch.ops.aten.nll_loss2d_forward.default)
_MEAN, _SUM = 1, 2  # torch's Reduction values


def _default(op: Any, args: tuple, kwargs: dict) -> Any:
    """`op` run by DTensor's own rule."""
    handlers = dtensor_op_handlers()
    mine = handlers.pop(op)
    try:
        return op(*args, **kwargs)
    finally:
        handlers[op] = mine


def _forward(op: Any, args: tuple, kwargs: dict) -> Any:
    names = ("self", "target", "weight", "reduction", "ignore_index")
    given = {**dict(zip(names, args)), **kwargs}
    target = given["target"]
    split = isinstance(target, DTensor) and any(isinstance(p, Shard) for p in target.placements)
    if given["reduction"] != _MEAN or not split:
        return _default(op, args, kwargs)
    total, count = _default(op, (), {**given, "reduction": _SUM})
    whole = [Replicate()] * count.device_mesh.ndim
    count = count.redistribute(count.device_mesh, whole)
    return total.redistribute(total.device_mesh, whole) / count, count


def register() -> None:
    """Add the handler to DTensor's table (once; later calls do nothing)."""
    handlers = dtensor_op_handlers()
    for op in _OPS:
        handlers.setdefault(op, _forward)


register()
