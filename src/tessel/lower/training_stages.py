"""Pipeline stages of a training step: each rank's program runs its stage's part of the forward
and backward pass over the micro-batches in a 1F1B schedule, and returns its weights' gradients
summed over them.

The joint forward + backward program is planned and lowered once for the `tp` devices of one
stage-replica, on one micro-batch (as `lower.stages` does for inference). Here every node is
given a *position* in one micro-batch's journey through the pipeline, `F0 < F1 < ... < F(p-1)
< B(p-1) < ... < B0`: stage `s` computes the nodes at `Fs` in its forward slot and those at
`Bs` in its backward slot. A value may be read at its own position or any later one, so
activations travel to later stages and gradients back to earlier ones:

- a node that reads a weight (or a value made from weights alone) runs on the weight's stage:
  at `Fs` when its other inputs allow, at `Bs` when it reads a gradient made on that stage or
  a later one; a node reading a later stage's activation runs there and the weight is sent;
- any other node runs as early as its inputs allow, or, not joining values, as late as its
  readers allow, so the few values a layer hands on cross between stages;
- a weight's gradient is returned by its stage, summed over the micro-batches; the loss, the
  mean over the micro-batches, is sent from its stage to the first one.

Stage `s` runs its slots in the 1F1B order of `tessel.schedules`, the order `tessel.parallel`'s
`Pipeline` scripts run too: `min(p - 1 - s, m)` forward slots, then one forward and one backward
slot in turn, then the remaining backward slots, so at most `p - s` micro-batches' activations
are held.

Values travel over a channel per ordered pair of ranks: a process group over the two ranks,
listed sender first, so a pair has one group each way and the broadcasts on each group come
in the same order on both ranks. A rank posts every receive when its program starts and waits
on each where it is first read, so no send waits for a receiver that is busy sending.

Rank `(s, d, t)` is `s * dp * tp + d * tp + t`, as for inference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tessel.lower.nodes import Node, call, ref
from tessel.lower.program import RankProgram
from tessel.lower.stages import (
    Split,
    StageCut,
    StagedProgram,
    StageError,
    _Transfers,
    latest_allowed,
    zeros,
)
from tessel.schedules import pipeline_order

_ADD = "aten.add.Tensor"
_DIV = "aten.div.Tensor"


def training_stage_programs(
    programs: Sequence[RankProgram],
    weights: Sequence[str],
    weight_stage: dict[str, int],
    gradients: Sequence[str],
    user_inputs: int,
    split: Split,
) -> list[StagedProgram]:
    """Every rank's training program, in rank order, from the joint programs of one
    stage-replica's `tp` ranks, which return the loss and then the gradients of the weights
    `gradients` names. `weights` names the programs' weight inputs in order, `weight_stage`
    gives each its stage (a weight's other names, tied to it, the same stage)."""
    out: list[StagedProgram | None] = [None] * (split.pp * split.dp * split.tp)
    for t, rp in enumerate(programs):
        cut = _TrainingCut(rp, weights, weight_stage, gradients, user_inputs, split)
        for s in range(split.pp):
            for d in range(split.dp):
                out[split.rank(s, d, t)] = cut.program(s, d, t)
    return out  # type: ignore[return-value]


@dataclass(frozen=True)
class _Send:
    """A value one stage sends another: for one micro-batch, or (-1) once for all of them."""

    value: str  # the node or weight input sent
    micro_batch: int
    target: int  # the receiving stage


class _TrainingCut(StageCut):
    """One tensor-parallel rank's joint program, each node given its position."""

    def __init__(
        self,
        rp: RankProgram,
        weights: Sequence[str],
        weight_stage: dict[str, int],
        gradients: Sequence[str],
        user_inputs: int,
        split: Split,
    ) -> None:
        super().__init__(rp, weights, user_inputs, split)
        self.weight_stage = {n: weight_stage[fqn] for n, fqn in self.fqn.items()}
        returned = self.output.args
        if len(returned) != 1 + len(gradients) or not all(
            isinstance(a, dict) and "$node" in a for a in returned
        ):
            raise StageError(
                f"a training program returns the loss and {len(gradients)} gradients, each a "
                "value it computes"
            )
        self.loss, *self.gradients = self.output.reads
        self.gradient_stage = [weight_stage[fqn] for fqn in gradients]  # the stage returning it
        self.pos = self._assign()
        # stage s runs on pipeline rank s: its slots, ("F" or "B", micro-batch), are that
        # rank's actions in order
        self.slots = [
            [(a.phase, a.micro_batch) for a in actions]
            for actions in pipeline_order("1f1b", split.pp, split.pp, split.micro_batches)
        ]
        # what each stage sends, in the order it sends it: the same for every replica and rank
        self.sends = {s: self._sends(s) for s in range(split.pp)}

    # -- positions ---------------------------------------------------------------------

    def _f(self, s: int) -> int:
        return s

    def _b(self, s: int) -> int:
        return 2 * self.split.pp - 1 - s

    def stage_of(self, pos: int) -> int:
        p = self.split.pp
        return pos if pos < p else 2 * p - 1 - pos

    def _assign(self) -> dict[str, int]:
        """Each call node's position (see the module docstring)."""
        p = self.split.pp
        constants = {c.name for c in self.constants}
        earliest: dict[str, int] = {}
        made_of_weights: dict[str, int] = {}  # node -> the stage of the weights it is made of
        pinned: set[str] = set()
        for n in self.calls:
            name, args = n.name, n.reads
            stages = [self.weight_stage[a] for a in args if a in self.weight_stage]
            stages += [made_of_weights[a] for a in args if a in made_of_weights]
            others = [earliest[a] for a in args if a in earliest and a not in made_of_weights]
            e = max(others, default=-1)
            if not stages:
                earliest[name] = max(e, 0)
                continue
            made = all(
                a in self.weight_stage or a in made_of_weights or a in constants for a in args
            )
            if not made:  # a weight's value read with others: on the weight's stage
                pinned.add(name)
            w = max(stages)
            if e <= self._f(w):
                earliest[name] = self._f(w)
            elif e < p:
                earliest[name] = e  # a later stage's activation: the weight is sent there
            else:
                earliest[name] = self._b(w) if self.stage_of(e) >= w else e
            if made:  # runs where it is read: the weight is sent there once, not this per batch
                made_of_weights[name] = w
        fixed = pinned | {self.loss, *self.gradients}
        pos = latest_allowed(self.calls, self.nodes.readers, earliest, fixed)
        for n in self.calls:
            for a in n.reads:
                where = pos.get(a, self._f(self.weight_stage.get(a, 0)))
                if a in pos or a in self.weight_stage:
                    if where > pos[n.name]:
                        raise StageError(f"{n.name} runs before {a}, which it reads")
                    crosses = self.stage_of(where) != self.stage_of(pos[n.name])
                    if crosses and a not in self.rp.shapes:
                        raise StageError(
                            f"{n.name} reads {a}, which is not a tensor, from another "
                            "stage: pipeline stages can pass only tensors"
                        )
        for value, stage in zip(self.gradients, self.gradient_stage):
            if value in pos and pos[value] > self._b(stage):
                raise StageError(
                    f"the gradient {value} is made on stage {self.stage_of(pos[value])} after "
                    f"stage {stage}, which holds its weight, has finished its backward pass"
                )
        return pos

    def _position(self, value: str) -> int:
        if value in self.pos:
            return self.pos[value]
        return self._f(self.weight_stage[value])  # a weight, held by its stage from the start

    # -- what each stage sends ---------------------------------------------------------

    def _reads(self, s: int) -> dict[str, int]:
        """Values stage `s` reads from other stages -> the first position it reads them at
        (gradients returned by `s` are read at its backward position)."""
        first: dict[str, int] = {}
        for n in self.calls:
            where = self.pos[n.name]
            if self.stage_of(where) != s:
                continue
            for a in n.reads:
                if (a in self.pos or a in self.weight_stage) and self.stage_of(
                    self._position(a)
                ) != s:
                    first[a] = min(first.get(a, where), where)
        for value, stage in zip(self.gradients, self.gradient_stage):
            if stage == s and self.stage_of(self._position(value)) != s:
                first.setdefault(value, self._b(s))
        return first

    def _sends(self, s: int) -> list[_Send]:
        """Everything stage `s` sends, in the order its program sends it."""
        targets: dict[str, list[int]] = {}
        for q in range(self.split.pp):
            if q != s:
                for value in self._reads(q):
                    if self.stage_of(self._position(value)) == s:
                        targets.setdefault(value, []).append(q)
        sends: list[_Send] = []
        for phase, k in self.slots[s]:
            here = self._f(s) if phase == "F" else self._b(s)
            if phase == "F" and k == 0:
                sends += [
                    _Send(w, -1, q)
                    for w in self.weight_stage
                    if self.weight_stage[w] == s
                    for q in targets.get(w, ())
                ]
            for n in self.calls:
                if self.pos[n.name] == here:
                    sends += [_Send(n.name, k, q) for q in targets.get(n.name, ())]
        loss_stage = self.stage_of(self._position(self.loss))
        if s == loss_stage and s != 0:
            sends.append(_Send(_LOSS, -1, 0))
        return sends

    # -- one rank's program ------------------------------------------------------------

    def program(self, s: int, d: int, t: int) -> StagedProgram:
        split, p = self.split, self.split.pp
        shapes = dict(self.rp.shapes)
        me = split.rank(s, d, t)

        def rank_of(stage: int) -> int:
            return split.rank(stage, d, t)

        def tp_rank(r: int) -> int:
            return split.rank(s, d, r)

        loss_stage = self.stage_of(self._position(self.loss))
        shapes[_LOSS] = self.rp.shapes[self.loss]
        body: list[Node] = []
        rows_of = self.rows(body, shapes, split.micro_batches, 0)

        # every receive posted first, each channel's in its sender's order
        transfers = _Transfers(me, shapes, directed=True)
        received: dict[tuple[str, int], str] = {}  # (value, micro-batch or -1) -> node
        waits: dict[str, Node] = {}  # received node -> its wait, placed where first read
        for q in range(p):
            for x in self.sends[q] if q != s else ():
                if x.target != s:
                    continue
                tag = "w" if x.micro_batch < 0 else f"mb{x.micro_batch}"
                new = f"{x.value}__{tag}_from{q}"
                *post, waits[new] = transfers.recv(x.value, new, rank_of(q))
                body += post
                received[(x.value, x.micro_batch)] = new

        targets: dict[tuple[str, int], list[int]] = {}
        for x in self.sends[s]:
            targets.setdefault((x.value, x.micro_batch), []).append(x.target)

        def send(value: str, node: str, k: int, pending: list[Node]) -> None:
            for q in targets.get((value, k), ()):
                body.append(transfers.send(node, rank_of(q), pending))

        def wait_for(node: str) -> str:
            if node in waits:
                body.append(waits.pop(node))
            return node

        weights = [w for w in self.weight_nodes if self.weight_stage[w.name] == s]
        accumulated: dict[int, str] = {}  # gradient output index -> its running sum's node
        loss_sum = ""
        for phase, k in self.slots[s]:
            here = self._f(s) if phase == "F" else self._b(s)
            pending: list[Node] = []
            if phase == "F" and k == 0:
                for w in weights:
                    send(w.name, w.name, -1, pending)

            def name_of(a: str, k: int = k) -> str:
                if a in self.weight_stage:
                    if self.weight_stage[a] == s:
                        return a
                    return wait_for(received[(a, -1)])
                if a in rows_of:
                    return rows_of[a][k]
                if a in self.pos:
                    if self.stage_of(self.pos[a]) == s:
                        return f"{a}__mb{k}"
                    return wait_for(received[(a, k)])
                return a  # a constant

            for n in self.calls:
                if self.pos[n.name] != here:
                    continue
                names = {a: name_of(a) for a in n.reads}
                new = f"{n.name}__mb{k}"
                if n.name in shapes:
                    shapes[new] = shapes[n.name]
                body.append(n.renamed(new, names, tp_rank))
                send(n.name, new, k, pending)
            if s == loss_stage and self._position(self.loss) == here:
                loss_sum = self._accumulate(body, shapes, loss_sum, name_of(self.loss), k)
            if phase == "B":
                for i, (value, stage) in enumerate(zip(self.gradients, self.gradient_stage)):
                    if stage == s:
                        accumulated[i] = self._accumulate(
                            body, shapes, accumulated.get(i, ""), name_of(value), k
                        )
            body += pending

        # the loss: the mean over the micro-batches, sent from its stage to the first
        pending = []
        if s == loss_stage:
            loss = loss_sum
            if split.micro_batches > 1:
                loss = f"{_LOSS}__mean"
                shapes[loss] = shapes[_LOSS]
                body.append(call(loss, _DIV, [ref(loss_sum), split.micro_batches]))
            send(_LOSS, loss, -1, pending)  # to the first stage, unless this is it
        elif s == 0:
            loss = wait_for(received[(_LOSS, -1)])
        else:  # a middle stage returns no loss of its own
            loss = f"{_LOSS}__none"
            shapes[loss] = shapes[_LOSS]
            body.append(zeros(loss, *shapes[_LOSS]))
        body += pending
        if waits:
            raise StageError(f"rank {me} receives {sorted(waits)[0]} but never reads it")
        outputs = [ref(loss)] + [
            ref(accumulated[i]) for i, stage in enumerate(self.gradient_stage) if stage == s
        ]
        return self.staged(s, weights, body, outputs, shapes, transfers.sent)

    @staticmethod
    def _accumulate(body: list[Node], shapes: dict, total: str, value: str, k: int) -> str:
        """The running sum over micro-batches `total` (empty before the first) plus `value`."""
        if not total:
            return value
        new = f"{value}__sum{k}"
        shapes[new] = shapes.get(value, shapes.get(total))
        body.append(call(new, _ADD, [ref(total), ref(value)]))
        return new


_LOSS = "tessel_loss"  # the loss's mean over the micro-batches, as sent to the first stage
