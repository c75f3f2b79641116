"""The data-parallel replicas' gradient exchange: units of gradients in flight over a group.

A unit is a run of gradients exchanged as one flat buffer: all-reduced (every replica then holds
the sum) or reduce-scattered (each replica keeps the sum of its own chunk). Units start in the
same order on every rank while the backward pass goes on, as DDP does, so the ranks' collectives
match; `Exchange` keeps the ones started until they are waited on. Both training runtimes use
it: a training package's step (`runtime/step.py`, units laid out by `FlatLayout`) and the
programs of `tessel.parallel`'s training scripts (units cut by `comm_fusion`: `InFlight`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tessel._torch import reduce_scatter_single

# the units where `comm_fusion` sets none: up to 25 MB each (DDP's buckets), small enough that
# the first ones are exchanged while the backward pass goes on
DEFAULT_FUSION: tuple[str, Any] = ("size", 25.0)

# gloo's worker thread drops a collective's tensors where the caller has let go of them first,
# and dropping a Python tensor takes the GIL: a script that ends within the interpreter's
# switch interval of its last collective aborts ("terminate called without an active
# exception") when that thread takes the GIL of a finalizing interpreter. Holding the last
# collectives' handles leaves their tensors to the main thread, which drops them with this
# module's globals at exit.
_HELD: deque[dist.Work] = deque(maxlen=4)


def hold(work: dist.Work) -> None:
    """Keep the waited-on `work` (and the tensors it holds) until a later one replaces it."""
    _HELD.append(work)


class Exchange:
    """The exchanges of units started over `group` and not yet waited on, oldest first, each
    with the buffer it reads (kept alive until it is done) and what is left to do once it is.

    On gloo a reduce-scatter is the all-reduce of `whole` in place, this rank's chunk copied
    out when it is waited on: gloo has no reduce-scatter, and its stand-in (a clone of the
    whole, all-reduced, copied out by a callback) corrupted workers' heaps (see
    `runtime/gloo.py`). The bytes moved are the ones gloo moves for it; the clone is saved.
    """

    def __init__(self, group: Any, keep_last: bool = False) -> None:
        self.group = group
        # a training script's process ends right after its last exchange (`hold`); a
        # worker's step frees its buffers as soon as they are waited on
        self.keep_last = keep_last
        self.pending: list[tuple[dist.Work, torch.Tensor | None, Callable[[], Any] | None]] = []

    def all_reduce(self, flat: torch.Tensor) -> None:
        """Start summing `flat` over the group, in place."""
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self.pending.append((work, None, None))

    def reduce_scatter(self, mine: torch.Tensor, whole: torch.Tensor) -> None:
        """Start summing `whole` over the group into `mine`, this rank's chunk of it (`whole`
        may hold the sum afterwards: it is not read again)."""
        if dist.get_backend(self.group) != "gloo":
            work = reduce_scatter_single(mine, whole, group=self.group, async_op=True)
            self.pending.append((work, whole, None))
            return
        work = dist.all_reduce(whole, group=self.group, async_op=True)
        position, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.pending.append((work, whole, lambda: mine.copy_(whole.chunk(size)[position])))

    def settle(self, keep: int, room: int = 0, limit: int | None = None) -> None:
        """Wait for the oldest exchanges until at most `keep` are in flight and, with `limit`,
        the buffers they read leave `room` bytes within `limit`."""
        held = sum(b.nbytes for _, b, _ in self.pending if b is not None)
        while self.pending and (
            len(self.pending) > keep or (limit is not None and held + room > limit)
        ):
            work, buffer, then = self.pending.pop(0)
            work.wait()
            if self.keep_last:
                hold(work)
            if then is not None:
                then()
            held -= buffer.nbytes if buffer is not None else 0

    def wait(self) -> None:
        """Wait for every exchange started."""
        self.settle(0)

    def drop(self) -> None:
        """Forget the exchanges started (a step that failed: nothing waits on them)."""
        self.pending.clear()


def fusion_buckets(
    fusion: tuple[str, Any], indices: list[int], grads: list[torch.Tensor]
) -> list[list[int]]:
    """The gradients `indices` in the units `fusion` gives: ("size", MB) each up to that size,
    consecutive in the order given, ("index", starts) each starting at one of those indices,
    ("each", None) one per gradient. `grads` give the sizes (meta tensors do)."""
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


class InFlight:
    """One step's all-reduce of the units `buckets` of gradients over `group`, given one
    gradient at a time: a unit starts once every gradient in it is given and every unit
    before it has started."""

    def __init__(self, buckets: list[list[int]], group: Any) -> None:
        self.buckets = buckets
        # its flat buffers live on as the gradients' views: holding their handles costs nothing
        self.exchange = Exchange(group, keep_last=True)
        self.given: dict[int, torch.Tensor] = {}
        self.flats: list[torch.Tensor] = []  # the started units, each its gradients flat

    def give(self, index: int, grad: torch.Tensor) -> None:
        self.given[index] = grad
        while len(self.flats) < len(self.buckets) and all(
            i in self.given for i in self.buckets[len(self.flats)]
        ):
            self._start()

    def _start(self) -> None:
        bucket = self.buckets[len(self.flats)]
        flat = torch.cat([self.given[i].reshape(-1) for i in bucket])
        self.exchange.all_reduce(flat)
        self.flats.append(flat)

    def sums(self, missing: Callable[[int], torch.Tensor]) -> dict[int, torch.Tensor]:
        """Each gradient summed over the group (a view of its unit), once the units not yet
        started are (a gradient never given taken as `missing(index)`) and all are done."""
        for bucket in self.buckets[len(self.flats) :]:
            for i in bucket:
                if i not in self.given:
                    self.given[i] = missing(i)
            self._start()
        self.exchange.wait()
        out = {}
        for bucket, flat in zip(self.buckets, self.flats):
            parts = flat.split([self.given[i].numel() for i in bucket])
            out.update((i, p.view(self.given[i].shape)) for i, p in zip(bucket, parts))
        return out


def all_reduce_in_buckets(
    fusion: tuple[str, Any], tensors: list[torch.Tensor], indices: list[int], group: Any
) -> None:
    """Sum `tensors[i]` for i in `indices` over `group`, one all-reduce per unit `fusion` gives
    (see `fusion_buckets`), all made already; each tensor is replaced by its sum."""
    flight = InFlight(fusion_buckets(fusion, indices, tensors), group)
    for i in indices:
        flight.give(i, tensors[i])
    for i, summed in flight.sums(lambda i: tensors[i]).items():
        tensors[i] = summed.to(tensors[i].dtype)
