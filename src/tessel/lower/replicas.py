"""Data-parallel replicas of a generation gear: every rank's program from one replica's.

A gear is lowered once for the `tp` devices of one replica, on that replica's rows of the cache.
Rank `(d, t)` (rank `d * tp + t`) runs tensor-parallel rank `t`'s program with its collective
groups moved to replica `d`'s ranks. It takes the whole batch's inputs and reads its replica's
rows of them, and the last-token logits it ends with (whole on every rank of the replica) are
gathered over the replicas, one `all_gather_into_tensor` over the ranks `(d', t)`: every rank
ends a call with every row's logits, so every rank chooses the same tokens with no word from
the session, at any number of replicas.

With pipeline stages, one replica's programs are its `pp x tp` stage programs (rank
`s * tp + t`, those of the last stage ending with the logits, `lower/stages.py`); rank
`(s, d, t)` is then `(s * dp + d) * tp + t`, the mesh axes outermost first, and the last
stage's logits are gathered over the ranks `(pp - 1, d', t)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from tessel._torch import C10D_FUNCTIONAL
from tessel.lower.nodes import INPUT, Node, ProgramNodes, call, contiguous_copy, output, ref
from tessel.lower.outputs import measured
from tessel.lower.program import ProgramError, RankProgram

_SLICE = "aten.slice.Tensor"
_ALL_GATHER = f"{C10D_FUNCTIONAL}.all_gather_into_tensor.default"
_WAIT = f"{C10D_FUNCTIONAL}.wait_tensor.default"


def replica_programs(
    programs: Sequence[RankProgram],
    replicas: int,
    rows: int,
    user_inputs: int,
    batch_inputs: Sequence[int],
    tp: int | None = None,
) -> list[RankProgram]:
    """Every rank's program, in rank order, from the programs of one replica lowered for
    `rows` rows (`tp` of them a stage, all of them where `tp` is None): the model's last
    `user_inputs` inputs, of which those at `batch_inputs` have the batch first, and the last
    output the logits `[rows, vocab]`."""
    per_stage = tp or len(programs)

    def rank(s: int, d: int, t: int) -> int:
        return (s * replicas + d) * per_stage + t

    def in_replica(d: int) -> Callable[[int], int]:
        """Replica `d`'s rank for a rank of one replica's programs."""
        return lambda r: rank(r // per_stage, d, r % per_stage)

    return [
        _replica(
            programs[s * per_stage + t],
            d,
            rows,
            user_inputs,
            batch_inputs,
            in_replica(d),
            [rank(s, r, t) for r in range(replicas)],
            tp is not None,
        )
        for s in range(len(programs) // per_stage)
        for d in range(replicas)
        for t in range(per_stage)
    ]


def _replica(
    rp: RankProgram,
    d: int,
    rows: int,
    user_inputs: int,
    batch_inputs: Sequence[int],
    moved_to: Callable[[int], int],
    over_replicas: list[int],
    pipelined: bool,
) -> RankProgram:
    """Replica `d`'s copy of `rp` (one replica's rank): collectives over the ranks `moved_to`
    gives, its rows of the batched inputs read, the logits gathered over `over_replicas`."""
    replicas = len(over_replicas)
    program = ProgramNodes.read(rp.program)
    shapes = dict(rp.shapes)
    inputs = program.inputs
    weights = len(inputs) - user_inputs
    batched = {inputs[weights + i].name for i in batch_inputs}
    head: list[Node] = []
    reads: list[Node] = []
    for n in inputs:
        if n.name not in batched:
            head.append(n)
            continue
        shape, dtype = shapes[n.name]
        if not shape or shape[0] != rows:
            raise ProgramError(f"gear input {n.name!r} of shape {shape} has no {rows} rows first")
        whole = f"{n.name}__batch"
        shapes[whole] = ([rows * replicas, *shape[1:]], dtype)
        head.append(replace(n, name=whole))
        reads.append(call(n.name, _SLICE, [ref(whole), 0, d * rows, (d + 1) * rows]))
    moved = [n.renamed(n.name, {}, moved_to) for n in program.nodes if n.op != INPUT]
    args = program.output.args
    if args == [] and pipelined:  # a stage before the last: it returns no logits to gather
        nodes = [*head, *reads, *moved, output([])]
        return measured(replace(rp, program=program.program(nodes), shapes=shapes), weights)
    if not isinstance(args, list) or not args or "$node" not in args[-1]:
        raise ProgramError("a gear's program must return the logits last")
    logits = args[-1]["$node"]
    shape, dtype = shapes[logits]
    sent, buf, whole = f"{logits}__rows", f"{logits}__replicas_buf", f"{logits}__replicas"
    shapes[sent] = (shape, dtype)
    shapes[buf] = shapes[whole] = ([shape[0] * replicas, *shape[1:]], dtype)
    group = {"$group": over_replicas}
    tail = [
        contiguous_copy(sent, logits),
        call(buf, _ALL_GATHER, [ref(sent), replicas, group]),
        call(whole, _WAIT, [ref(buf)]),
        output([*args[:-1], ref(whole)]),
    ]
    made = replace(rp, program=program.program([*head, *reads, *moved, *tail]), shapes=shapes)
    return measured(made, weights)
