"""Generation on a worker: the package's gears over the cache this rank holds, run in a loop.

Every rank runs the same loop (`tessel.decoding.decode`) on the same request, with no word from
the session between tokens. Without pipeline stages each gear's program ends with the logits
whole on every rank, so every rank chooses the same token. With stages only the last stage's
ranks hold the logits: its first rank chooses the token and broadcasts it, a token per row,
to every rank. Rank 0 hands the tokens to the session: each step's as it is made where the
request streams, all at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
from torch import fx

from tessel.config.sampling import Sampling
from tessel.decoding import decode
from tessel.package.manifest import Gears


@dataclass
class LoadedGears:
    """A rank's gears: its programs by prompt length (1: the decode gear) over its weights,
    the cache among them (zero at load, written in place by every call)."""

    shapes: Gears
    programs: dict[int, fx.GraphModule]
    weights: list[torch.Tensor]
    logits_rank: int = 0  # the rank that chooses the tokens where not every rank can

    @property
    def device(self) -> torch.device:
        return self.weights[0].device if self.weights else torch.device("cpu")

    def run(self, length: int, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """The last token's logits of the gear of `length` tokens on `inputs` (None on a
        pipeline stage before the last, which returns none)."""
        outputs = self.programs[length](*self.weights, *(x.to(self.device) for x in inputs))
        return outputs[-1].cpu() if outputs else None

    def share(self, token: torch.Tensor | None, rows: int) -> torch.Tensor:
        """The token `logits_rank` chose, `[rows]`, on every rank (`token` is this rank's own
        choice where it holds logits, else None)."""
        if token is None:
            token = torch.empty(rows, dtype=torch.int64)
        sent = token.to(self.device, torch.int64).contiguous()  # a collective's, on its device
        dist.broadcast(sent, src=self.logits_rank)
        return sent.cpu()


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
