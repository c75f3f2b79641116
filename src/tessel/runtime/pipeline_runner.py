"""The pipeline schedule runner: one rank's stages run their forward and backward passes over
the micro-batches in the order `tessel.schedules` lays out, and what one pass hands another
travels between the ranks holding them.

What a pass computes is the caller's (`StageWork`); the runner owns the order and the
transfers. Every tensor a pass hands a later pass of the same micro-batch is a `Handoff`: a
stage's activations to the next, the gradients of the floating ones back (`handoffs_between`
makes those from each stage's `Boundary`), or any tensor one stage reads from another. A pass
takes the handoffs it receives, in their order, and returns the ones it sends, in theirs.
Messages are matched by a tag naming the handoff and the micro-batch, so the order in which two
ranks post them does not matter. Stages held by the same rank hand their tensors over in memory.

Receives are waited on where a pass reads them. By default a receive is posted then too and
sends are left in flight until the step ends, so a rank never waits on a rank that is itself
waiting to send. With `receive_ahead` every receive of the step is posted when it starts, so
each pass's sends complete at once and are waited on after the pass, freeing what they sent:
the order a training package's stage memory is counted in (`lower.training_stages`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from tessel.dtypes import dtype_name, torch_dtype
from tessel.schedules import Action, Handoff


@dataclass(frozen=True)
class Boundary:
    """The tensors a stage hands the next one for each micro-batch, in order, as the meta
    tensors (shape and dtype) the receiving rank allocates its buffers from."""

    tensors: tuple[torch.Tensor, ...]

    @property
    def differentiable(self) -> list[int]:
        """The positions of the tensors a gradient comes back for: the floating ones."""
        return [i for i, t in enumerate(self.tensors) if t.dtype.is_floating_point]


def handoffs_between(boundaries: Sequence[Boundary], stages: int) -> list[Handoff]:
    """The handoffs of a chain of `stages` stages, `boundaries[s]` what stage `s` hands stage
    `s + 1`: each tensor forward, and the gradient of each floating one back."""
    if len(boundaries) != stages - 1:
        raise ValueError(
            f"PipelineRunner: {stages} stages have {stages - 1} boundaries, found {len(boundaries)}"
        )
    out = []
    for s, boundary in enumerate(boundaries):
        for t in boundary.tensors:
            out.append(Handoff(("F", s), ("F", s + 1), tuple(t.shape), dtype_name(t.dtype)))
        for i in boundary.differentiable:
            t = boundary.tensors[i]
            out.append(Handoff(("B", s + 1), ("B", s), tuple(t.shape), dtype_name(t.dtype)))
    return out


class StageWork(Protocol):
    """What this rank's stages compute in one step."""

    def forward(
        self, stage: int, micro_batch: int, inputs: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Run `stage`'s forward pass over `micro_batch`, given the handoffs it receives;
        return the handoffs it sends."""
        ...

    def backward(
        self, stage: int, micro_batch: int, gradients: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Run `stage`'s backward pass over `micro_batch`, given the handoffs it receives (in a
        chain: the gradients of the floating tensors it handed on, nothing for the last
        stage); return the handoffs it sends (the gradients of the floating tensors it was
        handed, nothing for the first stage)."""
        ...


class PipelineRunner:
    """Runs this rank's `actions` over `work`, stage `s` held by rank `holder(s)` of `group`
    (None: the default group), handing `handoffs` between the passes."""

    def __init__(
        self,
        actions: Sequence[Action],
        stages: int,
        micro_batches: int,
        handoffs: Sequence[Handoff],
        holder: Callable[[int], int],
        group: Any,
        device: torch.device,
        receive_ahead: bool = False,
    ) -> None:
        self.actions = list(actions)
        self.stages, self.micro_batches = stages, micro_batches
        self.handoffs = list(handoffs)
        self.into: dict[tuple[str, int], list[int]] = {}  # a pass -> the handoffs it takes
        self.out_of: dict[tuple[str, int], list[int]] = {}  # a pass -> the handoffs it makes
        for i, h in enumerate(self.handoffs):
            for stage in (h.sender[1], h.receiver[1]):
                if not 0 <= stage < stages:
                    raise ValueError(f"PipelineRunner: handoff {i} names stage {stage} of {stages}")
            self.into.setdefault(h.receiver, []).append(i)
            self.out_of.setdefault(h.sender, []).append(i)
        self.holder, self.group, self.device = holder, group, device
        self.receive_ahead = receive_ahead
        self.me = dist.get_rank(group) if dist.is_initialized() else 0
        self.ran: list[Action] = []  # the passes the last step ran, in order

    def step(self, work: StageWork) -> None:
        """Run every action of this rank once; returns when its sends have been received."""
        in_memory: dict[tuple[int, int], torch.Tensor] = {}
        kept: dict[int, torch.Tensor] = {}  # handoffs received once for the step
        posted: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        sends: list[Any] = []
        self.ran = []
        try:
            if self.receive_ahead:
                for action in self.actions:
                    for i in self.into.get((action.phase, action.stage), ()):
                        if self._remote(i, action.micro_batch):
                            posted[(i, action.micro_batch)] = self._post(i, action.micro_batch)
            for action in self.actions:
                k, here = action.micro_batch, (action.phase, action.stage)
                inputs = [
                    self._receive(i, k, in_memory, kept, posted) for i in self.into.get(here, ())
                ]
                if action.phase == "F":
                    made = work.forward(action.stage, k, inputs)
                else:
                    made = work.backward(action.stage, k, inputs)
                del inputs
                sends += self._send(here, k, made, in_memory)
                del made
                if self.receive_ahead:
                    for work_item in sends:
                        work_item.wait()
                    sends.clear()
                self.ran.append(action)
        finally:
            for work_item in sends:
                work_item.wait()
        if in_memory:
            raise RuntimeError(f"PipelineRunner: handed over but never read: {sorted(in_memory)}")

    def _remote(self, i: int, k: int) -> bool:
        """Whether handoff `i` of micro-batch `k` comes from another rank."""
        h = self.handoffs[i]
        return (k == 0 or not h.once) and self.holder(h.sender[1]) != self.me

    def _tag(self, i: int, k: int) -> int:
        return k * len(self.handoffs) + i

    def _send(
        self,
        here: tuple[str, int],
        k: int,
        made: list[torch.Tensor],
        in_memory: dict[tuple[int, int], torch.Tensor],
    ) -> list[Any]:
        mine = self.out_of.get(here, [])
        name = f"stage {here[1]}'s {'forward' if here[0] == 'F' else 'backward'} pass"
        if len(made) != len(mine):
            raise RuntimeError(
                f"PipelineRunner: {name} made {len(made)} tensors to hand on, where "
                f"{len(mine)} were traced"
            )
        out = []
        for i, got in zip(mine, made):
            h = self.handoffs[i]
            if got.shape != h.shape or dtype_name(got.dtype) != h.dtype:
                raise RuntimeError(
                    f"PipelineRunner: {name} hands stage {h.receiver[1]} a tensor of "
                    f"{tuple(got.shape)} {got.dtype}, where it was traced as {h.shape} {h.dtype}"
                )
            if h.once and k > 0:
                continue
            to = self.holder(h.receiver[1])
            if to == self.me:
                in_memory[(i, k)] = got
            else:
                out.append(
                    dist.isend(
                        got.contiguous(), group=self.group, group_dst=to, tag=self._tag(i, k)
                    )
                )
        return out

    def _post(self, i: int, k: int) -> tuple[Any, torch.Tensor]:
        h = self.handoffs[i]
        buffer = torch.empty(h.shape, dtype=torch_dtype(h.dtype), device=self.device)
        src = self.holder(h.sender[1])
        return dist.irecv(buffer, group=self.group, group_src=src, tag=self._tag(i, k)), buffer

    def _receive(
        self,
        i: int,
        k: int,
        in_memory: dict[tuple[int, int], torch.Tensor],
        kept: dict[int, torch.Tensor],
        posted: dict[tuple[int, int], tuple[Any, torch.Tensor]],
    ) -> torch.Tensor:
        h = self.handoffs[i]
        if h.once and k > 0:
            return kept[i]
        if not self._remote(i, k):
            got = in_memory.pop((i, k)).detach()
        else:
            work_item, got = posted.pop((i, k)) if (i, k) in posted else self._post(i, k)
            work_item.wait()
        if h.once:
            kept[i] = got
        return got
