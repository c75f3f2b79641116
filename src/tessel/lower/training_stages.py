"""Pipeline stages of a training step: each rank's stage as two programs over one micro-batch,
its forward pass and its backward pass, which the runtime's pipeline runner runs over the
micro-batches in 1F1B order (`runtime.pipeline_runner`, as `tessel.parallel`'s `Pipeline` runs
its stages), summing the gradients of the stage's weights over them.

The joint forward + backward program is planned and lowered once for the `tp` devices of one
stage-replica, on one micro-batch (as `lower.stages` does for inference). Here every node is
given a *position* in one micro-batch's journey through the pipeline, `F0 < F1 < ... < F(p-1)
< B(p-1) < ... < B0`: stage `s`'s forward pass computes the nodes at `Fs` and its backward pass
those at `Bs`. A value may be read at its own position or any later one, so activations travel
to later stages and gradients back to earlier ones:

- the forward pass is what the loss is computed from; every other node makes gradients and
  runs in a backward pass, after every forward position;
- a node that reads a weight (or a value made from weights alone) runs on the weight's stage:
  at `Fs` when its other inputs allow, at `Bs` when it reads a gradient made on that stage or
  a later one; a forward node reading a later stage's activation runs there and the weight is
  sent (a tied embedding read by the last stage), and its backward nodes run there too;
- a weight's gradient made from its stage's activations and a later stage's gradient runs
  on the weight's stage, so the gradient comes back rather than the activation going on;
- any other node runs as early as its inputs allow, or, not joining values, as late as its
  readers allow, so the few values a layer hands on cross between stages;
- a weight's gradient is returned by its stage's backward pass; the loss by the pass making it.

What a pass reads from another stage is a handoff (`tessel.schedules.Handoff`) from the pass
making it: a weight from its stage's forward pass, once per step (a tied embedding read by the
last stage); any other value per micro-batch, to the forward pass of a stage reading it there,
or else to its backward pass. What a stage's backward pass reads of its own forward pass (and of
what was handed to it) the forward pass returns as saved, and the runtime keeps until the
micro-batch's backward pass; views and values made of the stage's weights alone the backward
pass computes again instead, as they cost it nothing held.

Rank `(s, d, t)` is `s * dp * tp + d * tp + t`, as for inference; the handoffs of a replica and
tensor-parallel rank travel between the ranks `(*, d, t)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from tessel.lower.nodes import INPUT, Node, output, ref
from tessel.lower.program import RankProgram, tensor_bytes
from tessel.lower.stages import (
    Split,
    StageCut,
    StagedProgram,
    StageError,
    StagePasses,
    latest_allowed,
)
from tessel.plan.cost import is_view
from tessel.schedules import Handoff, Phase


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
                out[split.rank(s, d, t)] = cut.passes(s, d, t)
    return out  # type: ignore[return-value]


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
        self.of_weights: set[str] = set()  # calls made of weights (and constants) alone
        self.pos = self._assign()
        if split.micro_batches * split.dp > 1:
            self.check_rows()
        # every handoff of the pipeline: (value, sender, receiver), in the order the passes
        # take them; the same for every replica and tensor-parallel rank
        self.routes = self._routes()

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
        forward = self._forward_nodes()
        feeds = self._gradient_stages()
        sources: dict[str, frozenset[str]] = {}  # a node made of weights -> those weights
        sent_to: dict[str, set[int]] = {}  # a weight -> the later stages its forward pass reads
        for n in self.calls:
            name, args = n.name, n.reads
            read = frozenset(a for a in args if a in self.weight_stage).union(
                *(sources[a] for a in args if a in sources)
            )
            stages = [self.weight_stage[a] for a in args if a in self.weight_stage]
            stages += [made_of_weights[a] for a in args if a in made_of_weights]
            others = [earliest[a] for a in args if a in earliest and a not in made_of_weights]
            e = max(others, default=-1)
            made = all(
                a in self.weight_stage or a in made_of_weights or a in constants for a in args
            )
            if name not in forward and not made:  # the backward pass: after every forward one
                e = max(e, p)
            if not stages:
                # a weight's gradient from its stage's activations (x^T dy) runs on that stage:
                # the later stage's gradient comes back, not the activation on and the result
                w = min(feeds.get(name, {-1}))
                mine = any(earliest.get(a) == self._f(w) for a in args)
                if name not in forward and feeds.get(name) == {w} and mine and e < self._b(w):
                    e = self._b(w)
                earliest[name] = max(e, 0)
                continue
            if not made:  # a weight's value read with others: on the weight's stage
                pinned.add(name)
            w = max(stages)
            if e <= self._f(w):
                earliest[name] = self._f(w)
            elif e < p:
                earliest[name] = e  # a later stage's activation: the weight is sent there
                for x in read:
                    sent_to.setdefault(x, set()).add(self.stage_of(e))
            else:  # on the weight's stage, unless a later stage holds it already (a tied one)
                there = self.stage_of(e)
                held = all(there in sent_to.get(x, ()) for x in read)
                earliest[name] = self._b(w) if there >= w and not held else e
            if made:  # runs where it is read: the weight is sent there once, not this per batch
                made_of_weights[name] = w
                self.of_weights.add(name)
                sources[name] = read
        fixed = pinned | {self.loss, *self.gradients}
        pos = latest_allowed(self.calls, self.nodes.readers, earliest, fixed)
        for n in self.calls:
            for a in n.reads:
                where = pos.get(a, self._f(self.weight_stage.get(a, 0)))
                if a in pos or a in self.weight_stage:
                    if where > pos[n.name]:
                        raise StageError(f"{n.name} runs before {a}, which it reads")
                    if where != pos[n.name] and a not in self.rp.shapes:
                        raise StageError(
                            f"{n.name} reads {a}, which is not a tensor, from another pass: "
                            "pipeline passes can hand on only tensors"
                        )
        for value, stage in zip(self.gradients, self.gradient_stage):
            if value in pos and pos[value] > self._b(stage):
                raise StageError(
                    f"the gradient {value} is made on stage {self.stage_of(pos[value])} after "
                    f"stage {stage}, which holds its weight, has finished its backward pass"
                )
        return pos

    def _forward_nodes(self) -> set[str]:
        """The calls the loss is computed from: the forward pass. The others make only the
        gradients: the backward pass, which runs on a stage after every forward pass of its
        micro-batch, so each stage's backward nodes run on it (a backward node reading a
        weight runs in the weight's stage's backward pass), not on the last stage."""
        made = {n.name: n for n in self.calls}
        forward: set[str] = set()
        stack = [self.loss] if self.loss in made else []
        while stack:
            name = stack.pop()
            if name in forward:
                continue
            forward.add(name)
            stack += [a for a in made[name].reads if a in made]
        return forward

    def _gradient_stages(self) -> dict[str, set[int]]:
        """Each call -> the stages of the weights whose gradients it goes into."""
        feeds: dict[str, set[int]] = {}
        for g, stage in zip(self.gradients, self.gradient_stage):
            feeds.setdefault(g, set()).add(stage)
        readers = self.nodes.readers
        for n in reversed(self.calls):
            for r in readers[n.name]:
                if r in feeds:
                    feeds.setdefault(n.name, set()).update(feeds[r])
        return feeds

    def _position(self, value: str) -> int:
        if value in self.pos:
            return self.pos[value]
        return self._f(self.weight_stage[value])  # a weight, held by its stage from the start

    def _phase(self, pos: int) -> Phase:
        return "F" if pos < self.split.pp else "B"

    def _pass(self, pos: int) -> tuple[Phase, int]:
        return self._phase(pos), self.stage_of(pos)

    def _elsewhere(self, value: str, s: int) -> bool:
        """Whether `value` is a weight or a value that another stage than `s` holds or makes."""
        held = value in self.pos or value in self.weight_stage
        return held and self.stage_of(self._position(value)) != s

    def _read_by(self, s: int, phase: Phase) -> list[str]:
        """What stage `s`'s pass of `phase` reads that it does not make, in order of first
        reading (the backward pass's returned gradients last)."""
        here = self._f(s) if phase == "F" else self._b(s)
        out: dict[str, None] = {}
        for n in self.calls:
            if self.pos[n.name] == here:
                out.update((a, None) for a in n.reads if self.pos.get(a) != here)
        if phase == "B":
            for value, stage in zip(self.gradients, self.gradient_stage):
                if stage == s and self.pos.get(value) != here:
                    out.setdefault(value)
        return list(out)

    def _routes(self) -> list[tuple[str, tuple[Phase, int], tuple[Phase, int]]]:
        """Every handoff as (value, sending pass, receiving pass): what a pass reads from
        another stage. A weight comes from its stage's forward pass, once per step, to each
        pass reading it; any other value from the pass making it, to the forward pass of a stage
        reading it there (its backward pass then reads what the forward pass saved) or else to
        the backward pass."""
        routes = []
        phases: tuple[Phase, Phase] = ("F", "B")
        for s in range(self.split.pp):
            forward = [a for a in self._read_by(s, "F") if self._elsewhere(a, s)]
            for phase in phases:
                for a in self._read_by(s, phase):
                    if not self._elsewhere(a, s):
                        continue
                    if phase == "B" and a in forward and a not in self.weight_stage:
                        continue  # saved by the forward pass
                    routes.append((a, self._pass(self._position(a)), (phase, s)))
        return routes

    def _kept(self, s: int) -> tuple[list[str], list[Node]]:
        """What stage `s`'s backward pass reads of its forward pass: the values the forward
        pass saves for it, and the calls it computes again instead (in program order): those
        made of its stage's weights alone, and views of what it holds, which cost no memory
        there but would be counted once per micro-batch held if saved."""
        f = self._f(s)
        received = {a for a, _, to in self.routes if to == ("F", s)}
        made = {n.name: n for n in self.calls}
        saved: dict[str, None] = {}
        again: dict[str, Node] = {}

        def keep(a: str) -> None:
            if a in saved or a in again or a in self.weight_stage:
                return
            if self.pos.get(a) != f and a not in received:
                return  # the backward pass's own, an input, or a constant
            n = made.get(a)
            free = (
                n is not None
                and a not in received
                and (a in self.of_weights or (n.target != "getitem" and is_view(n.target)))
            )
            if n is not None and free and all(self.weight_stage.get(x, s) == s for x in n.reads):
                for x in n.reads:
                    keep(x)
                again[a] = n
            else:
                saved[a] = None

        for a in self._read_by(s, "B"):
            keep(a)
        return list(saved), sorted(again.values(), key=lambda n: self.order[n.name])

    def handoffs(self) -> tuple[Handoff, ...]:
        """The routes as this tensor-parallel rank's handoffs: each with its local shape."""
        out = []
        for value, sender, receiver in self.routes:
            shape, dtype = self.rp.shapes[value]
            once = value in self.weight_stage
            out.append(Handoff(sender, receiver, tuple(shape), dtype, once))
        return tuple(out)

    # -- one rank's passes -------------------------------------------------------------

    def passes(self, s: int, d: int, t: int) -> StagedProgram:
        """Rank `(s, d, t)`'s forward pass, with its backward pass and the handoffs beside."""
        split = self.split

        def tp_rank(r: int) -> int:
            return split.rank(s, d, r)

        weights = [w for w in self.weight_nodes if self.weight_stage[w.name] == s]
        saved, again = self._kept(s)
        loss_pass = self._pass(self._position(self.loss))
        made: dict[str, RankProgram] = {}
        for phase in ("F", "B"):
            here = self._f(s) if phase == "F" else self._b(s)
            shapes = dict(self.rp.shapes)
            names: dict[str, str] = {}
            inputs = [*weights, *self.user_nodes]
            taken = [(i, a) for i, (a, _, to) in enumerate(self.routes) if to == (phase, s)]
            for new, a in [(f"{a}__handoff{i}", a) for i, a in taken] + [
                (f"{a}__saved", a) for a in (saved if phase == "B" else ())
            ]:
                names[a] = new
                shapes[new] = shapes[a]
                inputs.append(Node(INPUT, new))
            mine = [n for n in self.calls if self.pos[n.name] == here]
            if phase == "B":
                mine = again + mine
            body = [n.renamed(n.name, names, tp_rank) for n in mine]
            returned = [names.get(a, a) for a, sender, _ in self.routes if sender == (phase, s)]
            if phase == "F":
                returned += [names.get(a, a) for a in saved]
            else:
                returned += [
                    names.get(g, g)
                    for g, stage in zip(self.gradients, self.gradient_stage)
                    if stage == s
                ]
            if loss_pass == (phase, s):
                returned.append(names.get(self.loss, self.loss))
            made[phase] = self._program(inputs, body, [ref(a) for a in returned], shapes)
        handoffs = self.handoffs()
        m = split.micro_batches
        sent = sum(
            tensor_bytes(list(h.shape), h.dtype) * (1 if h.once else m)
            for h in handoffs
            if h.sender == ("F", s) and h.receiver[1] != s
        )
        forward = StagedProgram(made["F"], [self.fqn[w.name] for w in weights], s, sent)
        forward.passes = StagePasses(made["B"], handoffs, len(saved), loss_pass)
        return forward

    def _program(
        self, inputs: list[Node], body: list[Node], returned: list, shapes: dict
    ) -> RankProgram:
        last = output(returned)
        reads = {a for n in (*body, last) for a in n.reads}
        constants = [c for c in self.constants if c.name in reads]
        program = self.nodes.program([*inputs, *constants, *body, last])
        used = {c.name for c in constants}
        return replace(
            self.rp,
            program=program,
            shapes=shapes,
            constants={k: v for k, v in self.rp.constants.items() if k in used},
        )
