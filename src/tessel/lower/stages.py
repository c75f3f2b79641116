"""Pipeline stages of tensor-parallel programs, with micro-batches and data-parallel replicas.

On a `pp x dp x tp` mesh the model is planned and lowered once for the `tp` devices of one
stage-replica, on one micro-batch of one replica's rows. The programs of every rank are made
from those `tp` programs here, so the runtime needs nothing new:

- every node goes to one stage: a node that reads a weight runs on the stage holding that weight
  (or later, when it also reads a later stage's value); any other node runs as late as its
  consumers allow, so the values crossing a boundary are the few a layer hands the next;
- a value read on a later stage is sent from rank `(s, d, t)` to rank `(s', d, t)` with a
  broadcast over that pair of ranks: both hold the same tensor-parallel shard of it, so no
  collective is needed to re-lay it out;
- the program of a stage runs its nodes once per micro-batch, each micro-batch reading its rows of
  the inputs, so stage `s` works on micro-batch `k` while stage `s + 1` works on `k - 1`;
- the outputs, whole on the first rank of the stage computing them (`tessel.lower.outputs`),
  travel from it to the first stage's first rank, are put back together in micro-batch order
  and, with replicas, gathered from each replica's first rank into one buffer on rank 0, so
  rank 0 returns the whole batch;
- a generation gear (`gear=True`) ends otherwise: the cache it writes in place stays on the
  stage that holds it, and its logits, whole on every rank of the last stage, are returned
  there alone (the runtime chooses the token on that stage's first rank and broadcasts it to
  every rank: a token, not a row of the vocabulary, crosses the stages). A gear's stage takes
  every weight the stage holds, read or not (a rank loads one set for all its gears), and a
  node that reads a piece of state runs on the stage holding it, or the cut is refused:
  another stage's ranks hold no copy of it that the gears keep up to date.

Rank `(s, d, t)` is `s * dp * tp + d * tp + t`: the mesh axes outermost first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tessel._torch import C10D_FUNCTIONAL
from tessel.errors import TesselError
from tessel.lower.nodes import Node, ProgramNodes, call, contiguous_copy, output, ref, renamed
from tessel.lower.program import RankProgram, tensor_bytes
from tessel.schedules import Handoff, Phase

_SLICE = "aten.slice.Tensor"
_ZEROS = "aten.zeros.default"
_CAT = "aten.cat.default"
_BROADCAST = f"{C10D_FUNCTIONAL}.broadcast.default"
_GATHER = f"{C10D_FUNCTIONAL}.all_to_all_single.default"
_WAIT = f"{C10D_FUNCTIONAL}.wait_tensor.default"


class StageError(TesselError, ValueError):
    """A model whose programs cannot be cut into pipeline stages or micro-batches."""


@dataclass(frozen=True)
class Split:
    """How the mesh cuts the work: stage, replica and tensor-parallel sizes, and micro-batches
    of `rows` rows each (the rows the programs were lowered for)."""

    pp: int
    dp: int
    tp: int
    micro_batches: int
    rows: int

    def rank(self, s: int, d: int, t: int) -> int:
        return (s * self.dp + d) * self.tp + t


@dataclass
class StagedProgram:
    """One rank's program and the weights it takes, in its input order."""

    program: RankProgram
    weights: list[str]
    stage: int
    sent_bytes: int = 0  # activation bytes this rank sends to later stages per run
    # a training stage's: `program` is its forward pass over one micro-batch
    passes: StagePasses | None = None


@dataclass(frozen=True)
class StagePasses:
    """A stage's backward pass beside its forward pass (`StagedProgram.program`), each run
    over one micro-batch, and the handoffs of the whole pipeline (of this rank's replica and
    tensor-parallel rank), in the order every pass takes and makes them.

    Both passes take the stage's weights, then the micro-batch's rows of the model inputs, then
    the handoffs they receive; the backward pass then what the forward pass `saved` for it.
    The forward pass returns the handoffs it sends, then what it saves; the backward pass the
    handoffs it sends, then the gradients of the trained weights of its stage, in the step's
    order. The pipeline's pass `loss` returns the micro-batch's loss last."""

    backward: RankProgram
    handoffs: tuple[Handoff, ...]
    saved: int
    loss: tuple[Phase, int]


def stage_programs(
    programs: list[RankProgram],
    weights: list[str],
    weight_stage: dict[str, int],
    user_inputs: int,
    split: Split,
    gear: bool = False,
) -> list[StagedProgram]:
    """Every rank's program, in rank order, from the `tp` programs of one stage-replica.

    `weights` names the programs' weight inputs in order; `weight_stage` gives each the first
    stage that holds it (a weight also read on a later stage is held there too). With `gear`,
    the programs are a generation gear's, of one replica and one micro-batch: their state stays
    where it is written and every rank returns the logits (see the module docstring).
    """
    if gear and split.dp * split.micro_batches > 1:
        raise StageError("a generation gear is cut for one replica and one micro-batch")
    out: list[StagedProgram | None] = [None] * (split.pp * split.dp * split.tp)
    for t, rp in enumerate(programs):
        cut = _Cut(rp, weights, weight_stage, user_inputs, split, gear)
        for s in range(split.pp):
            for d in range(split.dp):
                out[split.rank(s, d, t)] = cut.program(s, d, t)
    return out  # type: ignore[return-value]


def latest_allowed(
    calls: Sequence[Node],
    readers: Mapping[str, list[str]],
    earliest: dict[str, int],
    fixed: set[str],
) -> dict[str, int]:
    """Each call node's place: its `earliest` where it is `fixed`, unread, or joins several
    values (one value crosses, not both), else as late as its readers allow; a tuple and the
    pieces taken from it share the place of the first piece read."""
    pieces: dict[str, list[str]] = {}  # a tuple-valued node -> the getitems reading it
    for n in calls:
        if n.target == "getitem":
            pieces.setdefault(n.reads[0], []).append(n.name)
    place: dict[str, int] = {}
    for n in reversed(calls):
        name = n.name
        later = [place[r] for r in readers[name] if r not in pieces.get(name, ())]
        if name in pieces:
            later = [place[g] for g in pieces[name]]
        joins = len({a for a in n.reads if a in earliest}) > 1
        if name in fixed or not later or joins:
            place[name] = earliest[name]
        else:
            place[name] = max(earliest[name], min(later))
        for g in pieces.get(name, ()):
            place[g] = place[name]
    return place


class StageCut:
    """One tensor-parallel rank's program read for cutting into stages: its weight inputs
    (named by `weights`, in order), its `user_inputs` model inputs, constants, calls and
    output, as typed nodes."""

    def __init__(
        self, rp: RankProgram, weights: Sequence[str], user_inputs: int, split: Split
    ) -> None:
        self.rp, self.split = rp, split
        self.nodes = ProgramNodes.read(rp.program)
        inputs = self.nodes.inputs
        if len(inputs) != len(weights) + user_inputs:
            raise StageError(
                f"the program takes {len(inputs)} inputs; {len(weights)} weights and "
                f"{user_inputs} model inputs were expected"
            )
        self.weight_nodes = inputs[: len(weights)]
        self.user_nodes = inputs[len(weights) :]
        self.fqn = {n.name: fqn for n, fqn in zip(self.weight_nodes, weights)}
        self.constants = self.nodes.constants
        self.calls = self.nodes.calls
        self.output = self.nodes.output
        self.order = {n.name: i for i, n in enumerate(self.calls)}

    def rows(self, body: list[Node], shapes: dict, parts: int, first: int) -> dict[str, list[str]]:
        """Each model input's node per micro-batch: the input cut into `parts` parts of the
        programs' rows along its first dimension, micro-batch `k` taking part `first + k`."""
        split = self.split
        rows_of: dict[str, list[str]] = {}
        if parts > 1:
            self.check_rows()
        for u in self.user_nodes:
            name = u.name
            if parts == 1:
                rows_of[name] = [name]
                continue
            shape, dtype = shapes[name]
            rows_of[name] = []
            for k in range(split.micro_batches):
                start = (first + k) * split.rows
                new = f"{name}__rows{k}"
                shapes[new] = (shape, dtype)
                body.append(call(new, _SLICE, [ref(name), 0, start, start + split.rows, 1]))
                rows_of[name].append(new)
        return rows_of

    def check_rows(self) -> None:
        """Each micro-batch or replica is its rows of every model input: the inputs have the
        programs' rows first."""
        split = self.split
        for u in self.user_nodes:
            shape, _ = self.rp.shapes[u.name]
            if not shape or shape[0] != split.rows:
                raise StageError(
                    f"model input {u.name!r} of shape {shape} has no batch dimension of "
                    f"{split.rows} rows first; micro-batches and replicas split every input "
                    "along its first dimension"
                )

    def staged(
        self,
        stage: int,
        weights: Sequence[Node],
        body: list[Node],
        returned: Any,
        shapes: dict,
        sent: int,
    ) -> StagedProgram:
        """Stage `stage`'s program: `weights`, the model inputs, the constants it reads, `body`,
        then the output returning `returned`."""
        last = output(returned)
        reads = {a for n in (*body, last) for a in n.reads}
        constants = [c for c in self.constants if c.name in reads]
        program = self.nodes.program([*weights, *self.user_nodes, *constants, *body, last])
        if "state" in program:  # the state this stage holds
            held = {w.name for w in weights}
            program["state"] = [n for n in program["state"] if n in held]
        used = {c.name for c in constants}
        rp = replace(
            self.rp,
            program=program,
            shapes=shapes,
            constants={k: v for k, v in self.rp.constants.items() if k in used},
        )
        return StagedProgram(rp, [self.fqn[w.name] for w in weights], stage, sent)


class _Cut(StageCut):
    """One tensor-parallel rank's program, each node assigned its stage."""

    def __init__(
        self,
        rp: RankProgram,
        weights: list[str],
        weight_stage: dict[str, int],
        user_inputs: int,
        split: Split,
        gear: bool = False,
    ) -> None:
        super().__init__(rp, weights, user_inputs, split)
        self.gear = gear
        self.target = {n.name: n.target for n in self.calls}
        self.weight_stage = {n: weight_stage[fqn] for n, fqn in self.fqn.items()}
        self.state = set(rp.program.get("state", ()))
        self.stage = self._assign(weight_stage)
        if gear:
            self._state_stays()

    def _state_stays(self) -> None:
        """Every node that reads or writes a piece of state runs on the stage holding it: each
        stage's ranks hold their own state, which a node on another stage would not see."""
        for n in self.calls:
            for a in n.reads:
                if a in self.state and self.stage[n.name] != self.weight_stage[a]:
                    raise StageError(
                        f"{n.name} on stage {self.stage[n.name]} reads the state "
                        f"{self.fqn[a]}, which stage {self.weight_stage[a]} holds"
                    )

    def _assign(self, weight_stage: dict[str, int]) -> dict[str, int]:
        """Each call node's stage: a node that reads a weight, or a value made from weights
        alone (a transposed weight, a gathered shard), runs where the weight is held, or later
        if it also reads a later stage's value; a node joining several values runs as early as
        they allow; any other node (a view, a cast) as late as its readers allow."""
        pp = self.split.pp
        earliest: dict[str, int] = {}
        pinned: set[str] = set()
        of_weights: set[str] = set()  # nodes computed from weights (and constants) alone
        constants = {c.name for c in self.constants}
        for n in self.calls:
            name, at, args = n.name, 0, n.reads
            for a in args:
                if a in self.fqn:
                    at = max(at, weight_stage[self.fqn[a]])
                    pinned.add(name)
                elif a in earliest:
                    at = max(at, earliest[a])
                    if a in of_weights:
                        pinned.add(name)
            if args and all(a in self.fqn or a in of_weights or a in constants for a in args):
                if any(a in self.fqn or a in of_weights for a in args):
                    of_weights.add(name)
            earliest[name] = min(at, pp - 1)
        returned = set(self.output.reads)
        stage = latest_allowed(self.calls, self.nodes.readers, earliest, pinned | returned)
        for n in self.calls:
            for a in n.reads:
                if a in stage and stage[a] > stage[n.name]:
                    raise StageError(f"{n.name} runs on a stage before {a}, which it reads")
                if a in stage and stage[a] != stage[n.name] and a not in self.rp.shapes:
                    raise StageError(
                        f"{n.name} on stage {stage[n.name]} reads {a}, which is not a "
                        f"tensor, from stage {stage[a]}: pipeline stages can pass only tensors"
                    )
        return stage

    def program(self, s: int, d: int, t: int) -> StagedProgram:
        split = self.split
        shapes = dict(self.rp.shapes)
        mine = [n for n in self.calls if self.stage[n.name] == s]
        reads = {a for n in mine for a in n.reads}
        # a gear's stage takes every weight its stage holds, read or not: a rank loads one set
        # for all its gears, and another gear may read what this one does not
        weights = [
            n
            for n in self.weight_nodes
            if n.name in reads or (self.gear and self.weight_stage[n.name] == s)
        ]
        received = sorted(
            {a for a in reads if a in self.stage and self.stage[a] < s},
            key=lambda a: (self.stage[a], self.order[a]),
        )
        sends: dict[str, list[int]] = {}
        for n in self.calls:
            for a in n.reads:
                if a in self.stage and self.stage[a] == s and self.stage[n.name] > s:
                    targets = sends.setdefault(a, [])
                    if self.stage[n.name] not in targets:
                        targets.append(self.stage[n.name])

        def tp_rank(r: int) -> int:
            return split.rank(s, d, r)

        transfers = _Transfers(split.rank(s, d, t), shapes)
        body: list[Node] = []
        m = split.micro_batches
        rows_of = self.rows(body, shapes, m * split.dp, d * m)
        for k in range(m):
            names = {u.name: rows_of[u.name][k] for u in self.user_nodes}
            for a in received:
                names[a] = f"{a}__mb{k}"
                body += transfers.recv(a, names[a], split.rank(self.stage[a], d, t))
            waits: list[Node] = []
            for n in mine:
                new = f"{n.name}__mb{k}"
                names[n.name] = new
                if n.name in shapes:
                    shapes[new] = shapes[n.name]
                body.append(n.renamed(new, names, tp_rank))
                for target in sends.get(n.name, ()):
                    body.append(transfers.send(new, split.rank(target, d, t), waits))
            body += waits
        if self.gear:
            returned = self._logits_where_made(s)
        else:
            returned = self._outputs(s, d, t, shapes, transfers, body)
        return self.staged(s, weights, body, returned, shapes, transfers.sent)

    def _logits_where_made(self, s: int) -> list:
        """What stage `s`'s ranks return from a gear: the logits (its last output) on the stage
        computing them, nothing on the others. The gear's other outputs are its writes into the
        state, in place on the stages holding it; the runtime chooses the token on the first
        rank of the logits' stage and broadcasts the token, not the logits."""
        args = self.output.args
        if not isinstance(args, list) or not args or "$node" not in args[-1]:
            raise StageError("a gear's program must return the logits last")
        logits = args[-1]["$node"]
        if self.stage[logits] != self.split.pp - 1:
            raise StageError("a gear's logits must be made on its last stage")
        return [ref(f"{logits}__mb0")] if s == self.split.pp - 1 else []

    def _outputs(
        self, s: int, d: int, t: int, shapes: dict, transfers: _Transfers, body: list[Node]
    ) -> list:
        """Append to `body` the nodes that bring the outputs to rank 0; returns what this
        rank's program returns (nothing, but on rank 0).

        The first rank of a stage holds the outputs whole, so only tensor-parallel rank 0 of
        each stage-replica sends or receives them: a later stage sends its outputs to the first
        stage, which puts the micro-batches together; the replicas' first ranks gather their
        rows to rank 0 (`_replicas_to_first`)."""
        split = self.split
        m = split.micro_batches
        returned = list(dict.fromkeys(a for a in self.output.reads if a in self.stage))
        if t > 0:
            return []
        waits: list[Node] = []
        if s > 0:
            body += [
                transfers.send(f"{a}__mb{k}", split.rank(0, d, 0), waits, forward=False)
                for k in range(m)
                for a in returned
                if self.stage[a] == s
            ]
            body += waits
            return []
        parts: dict[str, list[str]] = {}
        for k in range(m):
            for a in returned:
                name = f"{a}__mb{k}"
                if self.stage[a] != 0:
                    source = split.rank(self.stage[a], d, 0)
                    body += transfers.recv(a, f"{name}_out", source)
                    name = f"{name}_out"
                parts.setdefault(a, []).append(name)
        whole: dict[str, str] = {}
        for a in returned:
            shape, dtype = shapes[a]
            if (m > 1 or split.dp > 1) and (not shape or shape[0] != split.rows):
                raise StageError(
                    f"model output {a!r} of shape {shape} has no batch dimension of "
                    f"{split.rows} rows first; micro-batches and replicas put every output "
                    "together along its first dimension"
                )
            name = parts[a][0]
            if m > 1:
                name = f"{a}__batches"
                shapes[name] = ([m * shape[0], *shape[1:]], dtype)
                body.append(call(name, _CAT, [[ref(p) for p in parts[a]], 0]))
            if split.dp > 1:
                name = self._replicas_to_first(a, name, d, shapes, body)
            whole[a] = name
        if d > 0:
            body += waits
            return []
        return renamed(self.output.args, whole)

    def _replicas_to_first(self, a: str, name: str, d: int, shapes: dict, body: list) -> str:
        """Append to `body` the gather of output `a`'s rows (`name`, on replica `d`'s first
        rank) to rank 0: one `all_to_all_single` over the replicas' first ranks in which each
        sends its rows to rank 0 alone, and rank 0 receives every replica's rows, in order, into
        the one buffer it returns. Returns the name of what this rank holds after it."""
        split = self.split
        shape, dtype = shapes[name]
        rows = shape[0]
        received = split.micro_batches > 1 or self.stage[a] != 0  # joined or received whole
        if not received and self.target.get(a) not in (_WAIT, _CAT):
            # the collective sends contiguous rows: a view (a gathered output with its
            # dimensions put back in order) is copied first
            sent = f"{a}__rows_sent"
            shapes[sent] = (shape, dtype)
            body.append(contiguous_copy(sent, name))
            name = sent
        into = [rows] * split.dp if d == 0 else [0] * split.dp
        sent_rows = [rows if r == 0 else 0 for r in range(split.dp)]
        group = {"$group": [split.rank(0, r, 0) for r in range(split.dp)]}
        buf, out = f"{a}__replicas_buf", f"{a}__replicas"
        shapes[buf] = shapes[out] = ([sum(into), *shape[1:]], dtype)
        body.append(call(buf, _GATHER, [ref(name), into, sent_rows, group]))
        body.append(call(out, _WAIT, [ref(buf)]))
        return out


class _Transfers:
    """Point-to-point sends between this rank and another, as broadcasts over the pair."""

    def __init__(self, me: int, shapes: dict) -> None:
        self.me, self.shapes = me, shapes
        self.sent = 0  # bytes sent on to later stages per run

    def _pair(self, peer: int) -> tuple[dict, int, int]:
        ranks = sorted({self.me, peer})
        return {"$group": ranks}, ranks.index(self.me), ranks.index(peer)

    def recv(self, value: str, new: str, source: int) -> list[Node]:
        """Nodes receiving `value` (shaped as this rank's own) from `source` as `new`."""
        shape, dtype = self.shapes[value]
        group, _, src = self._pair(source)
        self.shapes[f"{new}_buf"] = self.shapes[f"{new}_recv"] = self.shapes[new] = (shape, dtype)
        return [
            zeros(f"{new}_buf", shape, dtype),
            call(f"{new}_recv", _BROADCAST, [ref(f"{new}_buf"), src, group]),
            call(new, _WAIT, [ref(f"{new}_recv")]),
        ]

    def send(self, value: str, target: int, waits: list[Node], forward: bool = True) -> Node:
        """The node sending `value` to `target`; its wait goes into `waits`."""
        group, me, _ = self._pair(target)
        name = f"{value}_to{target}"
        self.shapes[name] = self.shapes[value]
        if forward:
            self.sent += tensor_bytes(*self.shapes[value])
        waits.append(call(f"{name}_done", _WAIT, [ref(name)]))
        return call(name, _BROADCAST, [ref(value), me, group])


def zeros(name: str, shape: list[int], dtype: str) -> Node:
    """A call making a tensor of zeros of `shape` and `dtype` (a name as programs write it)."""
    return call(name, _ZEROS, [shape], {"dtype": {"$dtype": dtype}, "device": {"$device": "cpu"}})
