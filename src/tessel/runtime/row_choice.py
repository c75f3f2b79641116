"""Each row's next token when every row has its own request: the settings are per-row inputs of
one traced function, so a request joining the batch never traces it again, and a row's token
depends on its own logits, settings and noise alone.

The arithmetic is `tessel.decoding`'s (`processed`, `warped`, `choose`) row by row: a request's
tokens equal `Session.generate`'s for it alone. A row's thresholds are computed on the host from
the request's numbers exactly as that loop computes them (`1 - top_p` in double, then float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx

# a row's settings, in the order of the `settings` input's columns
COLUMNS = ("temperature", "top_k", "top_p_cut", "min_p", "repetition_penalty")


def row_settings(request: dict | None) -> list[float]:
    """A row's `settings` columns from a served request's fields (None: a free row)."""
    if request is None or not request["do_sample"]:
        penalty = 1.0 if request is None else float(request["repetition_penalty"])
        return [1.0, 0.0, 0.0, 0.0, penalty]
    return [
        float(request["temperature"]),
        float(request["top_k"]),
        1 - float(request["top_p"]),  # double on the host, as the scalar loop compares it
        float(request["min_p"]),
        float(request["repetition_penalty"]),
    ]


@dataclass(frozen=True)
class RowChoice:
    """The traced choice over `rows` rows of a `vocab`-token vocabulary and `slots` cache
    slots. `sampled` and `penalized` say whether any row samples or penalizes (a variant
    without them skips their work); `stops` are held back from rows still short of their
    minimum length (`early`), `suppressed` never chosen.

    Inputs after the logits `[rows, vocab]`: `settings` `[rows, 5]` (`COLUMNS`), `sample`
    `[rows]` (the rows that draw), `early` `[rows]`, `history` and `counted` `[rows, slots]`
    (each row's tokens at its slots, and those the penalty counts; empty where not
    `penalized`), `noise` `[rows, vocab]` (each row's exponential draws; empty where not
    `sampled`)."""

    rows: int
    slots: int
    vocab: int
    sampled: bool
    penalized: bool
    stops: tuple[int, ...] = ()
    suppressed: tuple[int, ...] = ()

    def __call__(
        self,
        logits: torch.Tensor,
        settings: torch.Tensor,
        sample: torch.Tensor,
        early: torch.Tensor,
        history: torch.Tensor,
        counted: torch.Tensor,
        noise: torch.Tensor,
    ) -> torch.Tensor:
        scores = logits.to(torch.float32, copy=True)
        if self.penalized:
            scores = _penalized(scores, history, counted, settings[:, 4:5])
        if self.stops:
            held_back = scores.index_fill(
                1, scores.new_tensor(self.stops, dtype=torch.long), -math.inf
            )
            scores = torch.where(early[:, None], held_back, scores)
        if self.suppressed:
            banned = scores.new_tensor(self.suppressed, dtype=torch.long)
            scores = scores.index_fill(1, banned, -math.inf)
        greedy = scores.argmax(dim=-1)
        if not self.sampled:
            return greedy
        probs = _warped(scores, settings).softmax(dim=-1)
        drawn = (probs / noise.clamp(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
        return torch.where(sample, drawn, greedy)

    def example(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Inputs of the shapes and dtypes each call is given, after the logits."""
        history = (self.rows, self.slots) if self.penalized else (0,)
        return (
            torch.ones(self.rows, len(COLUMNS), device=device),
            torch.zeros(self.rows, dtype=torch.bool, device=device),
            torch.zeros(self.rows, dtype=torch.bool, device=device),
            torch.zeros(history, dtype=torch.long, device=device),
            torch.zeros(history, dtype=torch.bool, device=device),
            torch.ones((self.rows, self.vocab) if self.sampled else (0,), device=device),
        )

    def traced(self, device: torch.device) -> fx.GraphModule:
        """The choice as a program of aten operators on `device`, its inputs in call order."""
        from torch.fx.experimental.proxy_tensor import make_fx

        logits = torch.zeros(self.rows, self.vocab, device=device)
        with torch.no_grad():
            return make_fx(self)(logits, *self.example(device))


def _penalized(
    scores: torch.Tensor, history: torch.Tensor, counted: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """`tessel.decoding.penalize` with a penalty per row (1: the row's scores as they are)."""
    vocab = scores.shape[-1]
    seen = history.masked_fill(~counted, vocab)
    spare = torch.cat([scores, scores.new_zeros(len(scores), 1)], dim=1)
    held = spare.gather(1, seen)
    spare = spare.scatter(1, seen, torch.where(held < 0, held * penalty, held / penalty))
    return spare[:, :vocab]


def _warped(scores: torch.Tensor, settings: torch.Tensor) -> torch.Tensor:
    """`tessel.decoding.warped`'s temperature, top-k, top-p and min-p with a value per row; a
    row's neutral value removes nothing."""
    vocab = scores.shape[-1]
    scores = scores / settings[:, 0:1]
    k = settings[:, 1].long()
    ordered = scores.sort(dim=-1, descending=True).values
    kth = ordered.gather(1, (k - 1).clamp(0, vocab - 1)[:, None])
    cut_k = ((k > 0) & (k < vocab))[:, None]
    scores = scores.masked_fill(cut_k & (scores < kth), float("-inf"))
    rising, order = torch.sort(scores, descending=False, dim=-1)
    cumulative = rising.softmax(dim=-1).cumsum(dim=-1)
    cut = settings[:, 2:3]
    drop = (cumulative <= cut) & (cut > 0)
    drop[:, -1] = False
    scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    probs = scores.softmax(dim=-1)
    likeliest = probs.amax(dim=-1, keepdim=True)
    min_p = settings[:, 3:4]
    drop = (probs < min_p * likeliest) & (min_p > 0) & (probs < likeliest)
    return scores.masked_fill(drop, float("-inf"))
