"""The pipeline schedule runner: one rank's stages run their forward and backward passes over
the micro-batches in the order `tessel.schedules` lays out, and what one stage hands the next
travels between the ranks holding them.

What a pass computes is the caller's (`StageWork`); the runner owns the order and the
transfers. Stage `s` hands stage `s + 1` the same tensors for every micro-batch (its
`Boundary`), and gets back a gradient for each floating one. Before a pass the runner receives
what the pass reads, and after it sends what the pass made: receives are waited on at once,
sends are left in flight until the step ends, so a rank never waits on a rank that is itself
waiting to send. Messages are matched by a tag naming the stage, the micro-batch, the direction
and the tensor, so the order in which two ranks post them does not matter. Stages held by the
same rank hand their tensors over in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from tessel.schedules import Action


@dataclass(frozen=True)
class Boundary:
    """The tensors a stage hands the next one for each micro-batch, in order, as the meta
    tensors (shape and dtype) the receiving rank allocates its buffers from."""

    tensors: tuple[torch.Tensor, ...]

    @property
    def differentiable(self) -> list[int]:
        """The positions of the tensors a gradient comes back for: the floating ones."""
        return [i for i, t in enumerate(self.tensors) if t.dtype.is_floating_point]


class StageWork(Protocol):
    """What this rank's stages compute in one step."""

    def forward(
        self, stage: int, micro_batch: int, inputs: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Run `stage`'s forward pass over `micro_batch`, given what the previous stage handed
        it (nothing for the first stage); return what it hands the next (nothing for the last)."""
        ...

    def backward(
        self, stage: int, micro_batch: int, gradients: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Run `stage`'s backward pass over `micro_batch`, given the gradients of the floating
        tensors it handed on (nothing for the last stage); return the gradients of the floating
        tensors it was handed (nothing for the first stage)."""
        ...


class PipelineRunner:
    """Runs this rank's `actions` over `work`, stage `s` held by pipeline rank
    `holder(s)` of `group`; `boundaries[s]` is what stage `s` hands stage `s + 1`."""

    def __init__(
        self,
        actions: Sequence[Action],
        stages: int,
        micro_batches: int,
        boundaries: Sequence[Boundary],
        holder: Callable[[int], int],
        group: Any,
        device: torch.device,
    ) -> None:
        if len(boundaries) != stages - 1:
            raise ValueError(
                f"PipelineRunner: {stages} stages have {stages - 1} boundaries, found "
                f"{len(boundaries)}"
            )
        self.actions = list(actions)
        self.stages, self.micro_batches = stages, micro_batches
        self.boundaries = list(boundaries)
        self.width = max((len(b.tensors) for b in self.boundaries), default=1)  # tags per pass
        self.holder, self.group, self.device = holder, group, device
        self.me = dist.get_rank(group)
        self.ran: list[Action] = []  # the passes the last step ran, in order

    def step(self, work: StageWork) -> None:
        """Run every action of this rank once; returns when its sends have been received."""
        in_memory: dict[tuple[str, int, int], list[torch.Tensor]] = {}
        sends: list[Any] = []
        self.ran = []
        try:
            for action in self.actions:
                s, k = action.stage, action.micro_batch
                if action.phase == "F":
                    inputs = [] if s == 0 else self._receive("F", s - 1, k, in_memory)
                    made = work.forward(s, k, inputs)
                    if s < self.stages - 1:
                        sends += self._send("F", s, k, made, in_memory)
                else:
                    last = s == self.stages - 1
                    gradients = [] if last else self._receive("B", s + 1, k, in_memory)
                    made = work.backward(s, k, gradients)
                    if s > 0:
                        sends += self._send("B", s, k, made, in_memory)
                self.ran.append(action)
        finally:
            for work_item in sends:
                work_item.wait()
        if in_memory:
            raise RuntimeError(f"PipelineRunner: handed over but never read: {sorted(in_memory)}")

    def _expected(self, phase: str, sender: int) -> list[torch.Tensor]:
        """The meta tensors of what `sender`'s pass of `phase` hands on."""
        if phase == "F":
            return list(self.boundaries[sender].tensors)
        boundary = self.boundaries[sender - 1]
        return [boundary.tensors[i] for i in boundary.differentiable]

    def _tag(self, phase: str, sender: int, k: int, i: int) -> int:
        return ((k * self.stages + sender) * 2 + (phase == "B")) * self.width + i

    def _send(
        self,
        phase: str,
        sender: int,
        k: int,
        made: list[torch.Tensor],
        in_memory: dict[tuple[str, int, int], list[torch.Tensor]],
    ) -> list[Any]:
        expected = self._expected(phase, sender)
        receiver = sender + 1 if phase == "F" else sender - 1
        if len(made) != len(expected):
            raise RuntimeError(
                f"PipelineRunner: stage {sender}'s {'forward' if phase == 'F' else 'backward'} "
                f"pass made {len(made)} tensors for stage {receiver}, which takes {len(expected)}"
            )
        for got, want in zip(made, expected):
            if got.shape != want.shape or got.dtype != want.dtype:
                raise RuntimeError(
                    f"PipelineRunner: stage {sender} hands stage {receiver} a tensor of "
                    f"{tuple(got.shape)} {got.dtype}, where it was traced as "
                    f"{tuple(want.shape)} {want.dtype}"
                )
        if self.holder(receiver) == self.me:
            in_memory[(phase, sender, k)] = list(made)
            return []
        to = self.holder(receiver)
        return [
            dist.isend(
                t.contiguous(), group=self.group, group_dst=to, tag=self._tag(phase, sender, k, i)
            )
            for i, t in enumerate(made)
        ]

    def _receive(
        self,
        phase: str,
        sender: int,
        k: int,
        in_memory: dict[tuple[str, int, int], list[torch.Tensor]],
    ) -> list[torch.Tensor]:
        if self.holder(sender) == self.me:
            return [t.detach() for t in in_memory.pop((phase, sender, k))]
        buffers = [
            torch.empty(t.shape, dtype=t.dtype, device=self.device)
            for t in self._expected(phase, sender)
        ]
        works = [
            dist.irecv(
                b,
                group=self.group,
                group_src=self.holder(sender),
                tag=self._tag(phase, sender, k, i),
            )
            for i, b in enumerate(buffers)
        ]
        for w in works:
            w.wait()
        return buffers
