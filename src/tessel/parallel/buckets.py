"""The data-parallel replicas' gradient all-reduce, in buckets (`comm_fusion`).

`fusion_buckets` groups gradients into buckets; `all_reduce_in_buckets` sums them once all are
made; `InFlight` starts each bucket's all-reduce as soon as its gradients are given, while the
backward pass goes on, as DDP does. Buckets start in their order on every rank, so the ranks'
collectives match whatever order the gradients come in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# the buckets where `comm_fusion` sets none: up to 25 MB each (DDP's), small enough that the
# first ones are exchanged while the backward pass goes on
DEFAULT_FUSION: tuple[str, Any] = ("size", 25.0)


def fusion_buckets(
    fusion: tuple[str, Any], indices: list[int], grads: list[torch.Tensor]
) -> list[list[int]]:
    """The gradients `indices` in the all-reduce buckets `fusion` gives: ("size", MB) each up
    to that size, consecutive in the order given, ("index", starts) each starting at one of
    those indices, ("each", None) one per gradient. `grads` give the sizes (meta tensors do)."""
    mode, value = fusion
    if mode == "each":
        return [[i] for i in indices]
    out: list[list[int]] = []
    if mode == "index":
        for i in indices:
            if not out or i in value:
                out.append([])
            out[-1].append(i)
        return out
    limit, size = value * 2**20, 0.0
    for i in indices:
        nbytes = grads[i].numel() * grads[i].element_size()
        if not out or (size + nbytes > limit and out[-1]):
            out.append([])
            size = 0.0
        out[-1].append(i)
        size += nbytes
    return out


def all_reduce_in_buckets(
    fusion: tuple[str, Any], tensors: list[torch.Tensor], indices: list[int], group: Any
) -> None:
    """Sum `tensors[i]` for i in `indices` over `group`, one all-reduce per bucket `fusion`
    gives (see `fusion_buckets`); each tensor is replaced by its sum."""
    for bucket in fusion_buckets(fusion, indices, tensors):
        flat = torch.cat([tensors[i].reshape(-1) for i in bucket])
        dist.all_reduce(flat, group=group)
        for i, part in zip(bucket, flat.split([tensors[i].numel() for i in bucket])):
            tensors[i] = part.view(tensors[i].shape).to(tensors[i].dtype)


class InFlight:
    """One step's all-reduce of `buckets` of gradients over `group`: a bucket starts once
    every gradient in it is given and every bucket before it has started."""

    def __init__(self, buckets: list[list[int]], group: Any) -> None:
        self.buckets, self.group = buckets, group
        self.given: dict[int, torch.Tensor] = {}
        self.flats: list[torch.Tensor] = []  # the started buckets, each its gradients flat
        self.pending: list[dist.Work] = []

    def give(self, index: int, grad: torch.Tensor) -> None:
        self.given[index] = grad
        while len(self.flats) < len(self.buckets) and all(
            i in self.given for i in self.buckets[len(self.flats)]
        ):
            self._start()

    def _start(self) -> None:
        bucket = self.buckets[len(self.flats)]
        flat = torch.cat([self.given[i].reshape(-1) for i in bucket])
        self.pending.append(dist.all_reduce(flat, group=self.group, async_op=True))
        self.flats.append(flat)

    def sums(self, missing: Callable[[int], torch.Tensor]) -> dict[int, torch.Tensor]:
        """Each gradient summed over the group (a view of its bucket), once the buckets not
        yet started are (a gradient never given taken as `missing(index)`) and all are done."""
        for bucket in self.buckets[len(self.flats) :]:
            for i in bucket:
                if i not in self.given:
                    self.given[i] = missing(i)
            self._start()
        for work in self.pending:
            work.wait()
        self.pending.clear()
        out = {}
        for bucket, flat in zip(self.buckets, self.flats):
            parts = flat.split([self.given[i].numel() for i in bucket])
            out.update((i, p.view(self.given[i].shape)) for i, p in zip(bucket, parts))
        return out
