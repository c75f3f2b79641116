"""Generation on a worker: the package's gears over the cache this rank holds, run in a loop.

Every rank runs the same loop (`tessel.decoding.decode`) on the same request, with no word from
the session between tokens. Each gear's program is run with the request's choice traced onto
its end, so the program returns each row's next token, not its logits. Without pipeline stages
the logits are whole on every rank, so every rank's program chooses the same token. With stages
only the last stage's ranks hold the logits: its first rank's token is broadcast, a token per
row, to every rank. Rank 0 hands the tokens to the session: each step's as it is made where the
request streams, all at the end.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
from torch import fx

from tessel.config.generation import KV
from tessel.config.sampling import Sampling
from tessel.decoding import Choice, decode
from tessel.package.manifest import Gears
from tessel.sharding.geometry import Box

# a cache tensor, the index of what was kept of it, and that copy
Kept = tuple[torch.Tensor, tuple, torch.Tensor]


@dataclass
class LoadedGears:
    """A rank's gears: its programs by prompt length (1: the decode gear) over its weights,
    the cache among them (zero at load, written in place by every call)."""

    shapes: Gears
    programs: dict[int, fx.GraphModule]
    weights: list[torch.Tensor]
    logits_rank: int = 0  # the rank that chooses the tokens where not every rank can
    # the cache's tensors among the weights, by name, each with its box of the whole cache
    state: dict[str, tuple[torch.Tensor, Box]] = field(default_factory=dict)
    # each gear ending in the choices of the latest requests' settings, the latest last
    chosen: OrderedDict[tuple[int, bool, Choice], fx.GraphModule] = field(
        default_factory=OrderedDict
    )
    # the one-row prefill gears by prompt length (`Gears.row_prefill`): each writes the row
    # given as its last input
    rows: dict[int, fx.GraphModule] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.weights[0].device if self.weights else torch.device("cpu")

    def run(
        self,
        length: int,
        inputs: tuple[torch.Tensor, ...],
        choice: Choice,
        extra: tuple[torch.Tensor, ...],
        row: bool = False,
    ) -> torch.Tensor | None:
        """Each row's token, as `choice` makes it from the logits of the gear of `length`
        tokens on `inputs` (`row`: the one-row prefill gear, its row last in `inputs`); None
        on a pipeline stage before the last, which holds none."""
        program = (self.rows if row else self.programs)[length]
        if not _outputs(program):  # a stage before the last: no logits, nothing to choose
            program(*self.weights, *(x.to(self.device) for x in inputs))
            return None
        program = self._ending_in(length, row, choice)
        return program(*self.weights, *(x.to(self.device) for x in (*inputs, *extra)))[-1]

    def _ending_in(self, length: int, row: bool, choice: Choice) -> fx.GraphModule:
        """The gear of `length` tokens with `choice` run on its logits, traced once for a few
        requests' settings."""
        key = (length, row, choice)
        if key not in self.chosen:
            program = (self.rows if row else self.programs)[length]
            self.chosen[key] = ending_in(program, choice.traced(self.device))
            while len(self.chosen) > _CHOICES_KEPT * (len(self.programs) + len(self.rows)):
                self.chosen.popitem(last=False)
        self.chosen.move_to_end(key)
        return self.chosen[key]

    def states(self, prefix: str) -> list[tuple[torch.Tensor, Box]]:
        """This rank's cache tensors of one kind (`tessel.config.generation`'s prefixes)."""
        return [held for name, held in self.state.items() if name.startswith(prefix)]

    def keep(self, rows: list[int], start: int, stop: int) -> list[Kept]:
        """A copy of what a prefill gear writing slots `start` to `stop` of every row would
        overwrite in the cache rows `rows` on this rank: their keys and values at those slots,
        their recurrent and convolution states whole (`restore` puts it back)."""
        kept = []
        for name, (tensor, box) in self.state.items():
            low, high = box[0]
            local = [r - low for r in rows if low <= r < high]
            if not local:
                continue
            index: tuple = (torch.tensor(local, device=tensor.device),)
            if name.startswith(KV):
                index = (*index, slice(None), slice(start, stop))
            kept.append((tensor, index, tensor[index].clone()))
        return kept

    @staticmethod
    def restore(kept: list[Kept]) -> None:
        """Put back what `keep` copied."""
        for tensor, index, held in kept:
            tensor[index] = held

    def share(self, token: torch.Tensor | None, rows: int) -> torch.Tensor:
        """The token `logits_rank` chose, `[rows]`, on every rank (`token` is this rank's own
        choice where it holds logits, else None)."""
        if token is None:
            token = torch.empty(rows, dtype=torch.int64)
        sent = token.to(self.device, torch.int64).contiguous()  # a collective's, on its device
        dist.broadcast(sent, src=self.logits_rank)
        return sent.cpu()


_CHOICES_KEPT = 4  # requests' settings whose programs a rank keeps, per gear


def _outputs(program: fx.GraphModule) -> tuple[fx.Node, ...]:
    return tuple(program.graph.output_node().args[0])  # type: ignore[arg-type]


def ending_in(program: fx.GraphModule, choice: fx.GraphModule) -> fx.GraphModule:
    """One program: `program` (called as it is, not traced again) whose last output, the
    logits, is replaced by what `choice` (a traced function of those logits and inputs of its
    own) makes of it; the choice's other inputs follow the program's."""
    graph = fx.Graph()
    inputs = [graph.placeholder(n.name) for n in program.graph.find_nodes(op="placeholder")]
    logits, *rest = choice.graph.find_nodes(op="placeholder")
    extra = {p: graph.placeholder(f"choice_{p.name}") for p in rest}
    called = graph.call_module("gear", tuple(inputs))
    outputs = [
        graph.call_function(operator.getitem, (called, i)) for i in range(len(_outputs(program)))
    ]
    attributes: dict[str, object] = {"gear": program}
    for node in choice.graph.find_nodes(op="get_attr"):  # the choice's constants
        attributes[f"choice_{node.target}"] = operator.attrgetter(node.target)(choice)
        extra[node] = graph.get_attr(f"choice_{node.target}")
    token = graph.graph_copy(choice.graph, {logits: outputs[-1], **extra})
    graph.output((*outputs[:-1], token))
    return fx.GraphModule(attributes, graph)


def generate_on_rank(
    gears: LoadedGears,
    message: tuple,
    conn: Connection | None,
    distributed: bool,
    device: torch.device,
) -> None:
    """Run one request's loop on this rank; `conn` (rank 0's pipe to the session, None on the
    others) receives the tokens."""
    request = message[1]
    shape = (int(request["rows"]), int(request["length"]))
    if len(message) > 2:  # rank 0: the session sent the tensors
        ids, mask = (x.to(device) for x in message[2:4])
    else:
        ids = torch.empty(shape, dtype=torch.int64, device=device)
        mask = torch.empty(shape, dtype=torch.int64, device=device)
    if distributed:
        dist.broadcast(ids, src=0)
        dist.broadcast(mask, src=0)
    tokens = []
    steps = decode(
        gears.run,
        gears.shapes,
        ids.cpu(),
        mask.cpu(),
        int(request["max_new_tokens"]),
        Sampling(**request["sampling"]),
        request["eos_token_id"],
        int(request["pad_token_id"]),
        gears.share if gears.logits_rank else None,  # stages: chosen on one rank, shared
    )
    # tokens travel as lists of ints: a tensor sent down a pipe would be moved into shared
    # memory (torch's reduction), a segment and a descriptor per token
    with torch.no_grad():
        for token in steps:
            tokens.append(token)
            if conn is not None and request["stream"]:
                conn.send(("token", 0, token.tolist()))
    if conn is not None:
        conn.send(("result", 0, torch.stack(tokens, dim=1).tolist()))
