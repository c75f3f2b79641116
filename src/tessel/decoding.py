"""The generation loop over a package's gears: a prompt through a prefill gear, then one decode
call per new token, each call ending in its tokens' choice.

The loop is the same wherever the gears run (the build's check against eager, and every
worker of a session). A request's `Choice` (its processors, then the likeliest token or one
drawn against noise from a generator seeded from the call's seed) is a function of the gear's
logits and of fixed-shaped inputs the loop keeps, so a worker runs it inside each gear's
program, and every caller given the same logits makes the same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import fx

from tessel.config.errors import ConfigError
from tessel.config.sampling import NEW_TOKENS, Sampling


def new_tokens_for(
    asked: int | None, model: Mapping[str, object], gears: GearShapes, prompt_length: int
) -> int:
    """How many tokens a call makes: as `asked`, else the model's `max_new_tokens`, else what
    its `max_length` leaves after the prompt, else 20, as `transformers`' `generate` counts;
    a default is cut to what the package's cache holds after the prompt."""
    if asked is not None:
        return asked
    wanted = model.get("max_new_tokens")
    if wanted is None and "max_length" in model:
        wanted = int(model["max_length"]) - prompt_length  # type: ignore[call-overload]
        if wanted < 1:
            raise ConfigError(
                "generate()",
                "max_new_tokens",
                f"is not given, and the model's max_length ({model['max_length']}, its "
                f"generation_config) leaves no new token after a prompt of {prompt_length}; "
                "give max_new_tokens",
            )
    wanted = NEW_TOKENS if wanted is None else int(wanted)  # type: ignore[call-overload]
    gear = next((n for n in gears.prefill_lengths if n >= prompt_length), None)
    return wanted if gear is None else min(wanted, new_tokens_room(gears, gear))


def penalize(
    logits: torch.Tensor, history: torch.Tensor, counted: torch.Tensor, penalty: float
) -> torch.Tensor:
    """`logits` `[B, vocab]` in fp32 with the score of every token the row of `history`
    `[B, slots]` holds where `counted` is set (its prompt less the left padding, and its new
    tokens) divided by `penalty`, or multiplied where it is negative, as `transformers`'
    `RepetitionPenaltyLogitsProcessor` does."""
    scores = logits.float()
    if penalty == 1:
        return scores
    vocab = scores.shape[-1]
    seen = history.masked_fill(~counted, vocab)  # tokens not counted go to a spare column
    spare = torch.cat([scores, scores.new_zeros(len(scores), 1)], dim=1)
    held = spare.gather(1, seen)
    spare = spare.scatter(1, seen, torch.where(held < 0, held * penalty, held / penalty))
    return spare[:, :vocab]


def ban_repeated_ngrams(
    scores: torch.Tensor, history: torch.Tensor, span: torch.Tensor, n: int
) -> torch.Tensor:
    """`scores` with every token that would end an n-gram of `n` tokens already in the row's
    tokens so far (columns `span[0]` to `span[1]` of `history`) set to -inf, as
    `transformers`' `NoRepeatNGramLogitsProcessor` does."""
    if n == 0 or history.shape[1] < n:
        return scores
    slots = history.shape[1]
    vocab, at = scores.shape[-1], scores.device
    begin, end = span[0], span[1]
    suffix = (end - n + 1 + torch.arange(n - 1, device=at)).clamp(
        0, slots - 1
    )  # the last n - 1 tokens
    prefix = history.index_select(1, suffix)
    windows = history.unfold(1, n, 1)  # [B, slots - n + 1, n], by first column
    first = torch.arange(slots - n + 1, device=at)
    inside = (first >= begin) & (first + n <= end)
    matches = (windows[..., :-1] == prefix[:, None]).all(dim=-1) & inside
    banned = torch.zeros(len(scores), vocab + 1, dtype=torch.bool, device=at)
    banned = banned.scatter(1, torch.where(matches, windows[..., -1], vocab), True)
    return scores.masked_fill(banned[:, :vocab], float("-inf"))


def processed(
    logits: torch.Tensor,
    history: torch.Tensor,
    counted: torch.Tensor,
    span: torch.Tensor,
    sampling: Sampling,
    stops: Sequence[int],
) -> torch.Tensor:
    """Each row's scores `[B, vocab]` (fp32) before its token is chosen: the logits after the
    penalty, the n-gram ban, the minimum lengths, the forced first and last tokens and the
    suppressed tokens, in `transformers`' order. The row's tokens so far (its prompt as given
    and its new ones) are columns `span[0]` to `span[1]` of `history`, `span[2]` of them new,
    and the call makes `span[3]` more after this one; `counted` marks those the penalty
    counts."""
    scores = penalize(logits, history, counted, sampling.repetition_penalty)
    scores = ban_repeated_ngrams(scores, history, span, sampling.no_repeat_ngram_size)
    if stops and (sampling.min_length or sampling.min_new_tokens):
        early = (span[1] - span[0] < sampling.min_length) | (span[2] < sampling.min_new_tokens)
        held_back = scores.index_fill(1, scores.new_tensor(stops, dtype=torch.long), -math.inf)
        scores = torch.where(early, held_back, scores)
    if sampling.forced_bos_token_id is not None:  # where the row holds one token
        scores = torch.where(
            span[1] - span[0] == 1, _only(scores, (sampling.forced_bos_token_id,)), scores
        )
    if sampling.forced_eos_token_id:  # the call's last token
        scores = torch.where(span[3] == 0, _only(scores, sampling.forced_eos_token_id), scores)
    if sampling.suppress_tokens:
        suppressed = scores.new_tensor(sampling.suppress_tokens, dtype=torch.long)
        scores = scores.index_fill(1, suppressed, -math.inf)
    return scores


def _only(scores: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
    """Scores of 0 for `tokens` and -inf for every other, as `transformers`' forcing
    processors set them."""
    kept = scores.new_tensor(tokens, dtype=torch.long)
    return torch.full_like(scores, -math.inf).index_fill(1, kept, 0.0)


def choose(scores: torch.Tensor, sampling: Sampling, noise: torch.Tensor) -> torch.Tensor:
    """Each row's next token from its scores `[B, vocab]`: the likeliest, or where sampling
    one drawn from the warped scores' probabilities by racing them against `noise` `[B,
    vocab]` (independent exponential draws: the token of the largest probability over its
    draw is distributed as the probabilities are)."""
    if not sampling.do_sample:
        return scores.argmax(dim=-1)
    probs = warped(scores, sampling).softmax(dim=-1)
    return (probs / noise.clamp(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def warped(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The scores a sampled token is drawn from (fp32): the logits over `temperature`, then
    every token outside the top-k, the top-p nucleus, the min-p set, the typical set and the
    epsilon and eta cutoffs set to -inf, in `transformers`' order; the likeliest token always
    stays."""
    scores = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - sampling.top_p
        drop[:, -1] = False
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    if sampling.min_p > 0:
        probs = scores.softmax(dim=-1)
        drop = probs < sampling.min_p * probs.amax(dim=-1, keepdim=True)
        scores = scores.masked_fill(_keeping_the_likeliest(drop, probs), float("-inf"))
    if sampling.typical_p < 1:
        scores = _typical(scores, sampling.typical_p)
    if sampling.epsilon_cutoff > 0:
        drop = scores.softmax(dim=-1) < sampling.epsilon_cutoff
        scores = scores.masked_fill(_keeping_the_likeliest(drop, scores), float("-inf"))
    if sampling.eta_cutoff > 0:  # a cutoff that falls as the row's entropy rises
        eta = scores.new_tensor(sampling.eta_cutoff)
        categorical = torch.distributions.Categorical(logits=scores, validate_args=False)
        entropy = categorical.entropy()[:, None]
        drop = scores.softmax(dim=-1) < torch.minimum(eta, eta.sqrt() * torch.exp(-entropy))
        scores = scores.masked_fill(_keeping_the_likeliest(drop, scores), float("-inf"))
    return scores


def _keeping_the_likeliest(drop: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """`drop` with each row's highest-scoring token kept."""
    return drop & (scores < scores.amax(dim=-1, keepdim=True))


def _typical(scores: torch.Tensor, mass: float) -> torch.Tensor:
    """Locally typical sampling: the tokens whose surprise is closest to the row's entropy,
    in that order, until they hold `mass` of the probability."""
    logp = scores.log_softmax(dim=-1)
    entropy = -(logp * logp.exp()).nansum(dim=-1, keepdim=True)
    distance = (-logp - entropy).abs()
    nearest, order = distance.sort(dim=-1)
    cumulative = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=-1, keepdim=True).clamp(max=scores.shape[-1] - 1)
    drop = nearest > nearest.gather(-1, last)
    drop[:, 0] = False  # the nearest token always stays
    return scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def token_id(value: object, key: str, vocab_size: int) -> int:
    """`value` as a token id of a vocabulary of `vocab_size`, or `key`'s `ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ConfigError(
            "generate()", key, f"must be a token id from 0 to {vocab_size - 1}, found {value!r}"
        )
    return value


def stop_tokens(value: int | Sequence[int] | None, vocab_size: int) -> tuple[int, ...]:
    """`eos_token_id` as the ids a row stops at: none, one id, or several (a model may end a
    turn with any of a few tokens, as Llama 3's instruct models do), each in the vocabulary."""
    if value is None:
        return ()
    ids = value if isinstance(value, (list, tuple)) else [value]
    return tuple(dict.fromkeys(token_id(v, "eos_token_id", vocab_size) for v in ids))


class GearShapes(Protocol):
    """A generation package's shapes: its cache's rows and slots, its prefill gears' prompt
    lengths (rising) and its vocabulary (the manifest's `Gears`)."""

    @property
    def max_batch_size(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def prefill_lengths(self) -> tuple[int, ...]: ...
    @property
    def vocab_size(self) -> int: ...


def check_request(
    gears: GearShapes,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    max_new_tokens: int,
) -> tuple[torch.Tensor, int]:
    """The request's padding mask (all ones when none is given) and its prefill gear; bad
    requests get `ConfigError`s naming the argument."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        found = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise ConfigError(
            "generate()", "input_ids", f"must be a 2-D tensor [batch, tokens], found {found}"
        )
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ConfigError(
            "generate()", "input_ids", f"must hold integer ids, found {input_ids.dtype}"
        )
    rows, length = input_ids.shape
    if length == 0:
        raise ConfigError("generate()", "input_ids", "holds no token: a prompt needs at least one")
    if not 1 <= rows <= gears.max_batch_size:
        raise ConfigError(
            "generate()",
            "input_ids",
            f"has {rows} rows; the package's cache takes 1 to {gears.max_batch_size} "
            "(Generation.max_batch_size)",
        )
    if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= gears.vocab_size):
        raise ConfigError(
            "generate()",
            "input_ids",
            f"holds ids from {int(input_ids.min())} to {int(input_ids.max())}; the vocabulary "
            f"is 0 to {gears.vocab_size - 1}",
        )
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    elif not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        found = (
            tuple(attention_mask.shape)
            if isinstance(attention_mask, torch.Tensor)
            else type(attention_mask)
        )
        raise ConfigError(
            "generate()",
            "attention_mask",
            f"must have input_ids' shape {tuple(input_ids.shape)}, found {found}",
        )
    mask = attention_mask.long()
    if ((mask != 0) & (mask != 1)).any() or (mask.sum(dim=1) == 0).any():
        raise ConfigError(
            "generate()", "attention_mask", "must hold 0s and 1s, at least one 1 per row"
        )
    if (mask.cummax(dim=1).values != mask).any():
        raise ConfigError(
            "generate()",
            "attention_mask",
            "pads a row on the right; prompts are padded on the left",
        )
    if length > gears.max_seq_len - 1:
        raise ConfigError(
            "generate()",
            "input_ids",
            f"a prompt of {length} tokens leaves no room in a cache of {gears.max_seq_len} "
            "(Generation.max_seq_len)",
        )
    gear = next((n for n in gears.prefill_lengths if n >= length), None)
    if gear is None:
        raise ConfigError(
            "generate()",
            "input_ids",
            f"a prompt of {length} tokens is longer than the longest prefill gear "
            f"({gears.prefill_lengths[-1]}); the package's gears are {gears.prefill_lengths}",
        )
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        raise ConfigError(
            "generate()",
            "max_new_tokens",
            f"must be an int of at least 1, found {max_new_tokens!r}",
        )
    room = new_tokens_room(gears, gear)
    if max_new_tokens > room:
        raise ConfigError(
            "generate()",
            "max_new_tokens",
            f"is {max_new_tokens}; after a prompt in the {gear}-token prefill gear the cache of "
            f"{gears.max_seq_len} slots holds {room} new tokens",
        )
    return mask, gear


def new_tokens_room(gears: GearShapes, gear: int) -> int:
    """How many new tokens the cache holds after a prompt in the prefill gear of `gear`
    tokens: the slots after the prompt, and the last token, which is made and never written
    (an encoder-decoder's decoder has every slot for its own tokens, its start token first)."""
    if getattr(gears, "decoder_start_token_id", None) is not None:
        return gears.max_seq_len
    return gears.max_seq_len - gear + 1


@dataclass(frozen=True)
class Choice:
    """How a request chooses every row's next token from its gear's logits: the processors,
    then the likeliest token or a drawn one (`processed`, `choose`). It is a function of
    fixed-shaped tensors, so a worker traces it once per request's settings and runs it as the
    end of each gear's program; every rank holding the same logits chooses the same tokens.

    Its inputs after the logits `[rows, vocab]`: `history` `[rows, slots]` (each row's
    tokens so far, at columns `span[0]` to `span[1]`), `counted` (those the penalty counts),
    `span` (those two columns, the count of new tokens among them, and how many the call
    makes after this one) and `noise` (a draw per token where sampling, else empty)."""

    sampling: Sampling  # its seed left out: the seed draws the noise, not the program
    stops: tuple[int, ...]
    rows: int
    slots: int
    vocab: int

    @classmethod
    def of(cls, sampling: Sampling, stops: tuple[int, ...], gears: GearShapes) -> Choice:
        """The choice of a request: its stop tokens count only to hold them back from rows
        shorter than the minimum lengths, and its seed only draws the noise."""
        minimum = sampling.min_length or sampling.min_new_tokens
        return cls(
            replace(sampling, seed=0),
            stops if minimum else (),
            gears.max_batch_size,
            gears.max_seq_len,
            gears.vocab_size,
        )

    def __call__(
        self,
        logits: torch.Tensor,
        history: torch.Tensor,
        counted: torch.Tensor,
        span: torch.Tensor,
        noise: torch.Tensor,
    ) -> torch.Tensor:
        # a copy always: the traced function starts with it whatever the logits' dtype
        scores = logits.to(torch.float32, copy=True)
        scores = processed(scores, history, counted, span, self.sampling, self.stops)
        return choose(scores, self.sampling, noise)

    def example(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Inputs of the shapes and dtypes each call is given (the logits last: their dtype is
        the program's), on `device`."""
        return (
            torch.zeros(self.history_shape, dtype=torch.long, device=device),
            torch.zeros(self.history_shape, dtype=torch.bool, device=device),
            torch.zeros(4, dtype=torch.long, device=device),
            torch.ones(self.noise_shape, device=device),
        )

    @property
    def history_shape(self) -> tuple[int, ...]:
        """The shape of `history` and `counted`: empty where no processor reads them, so a
        device is not sent them every step for nothing."""
        s = self.sampling
        return (
            (self.rows, self.slots) if s.repetition_penalty != 1 or s.no_repeat_ngram_size else (0,)
        )

    @property
    def noise_shape(self) -> tuple[int, ...]:
        return (self.rows, self.vocab) if self.sampling.do_sample else (0,)

    def traced(self, device: torch.device) -> fx.GraphModule:
        """The choice as a program of aten operators on `device`, its inputs in call order."""
        from torch.fx.experimental.proxy_tensor import make_fx

        logits = torch.zeros(self.rows, self.vocab, device=device)
        with torch.no_grad():
            return make_fx(self)(logits, *self.example(device))


def draws(vocab: int, generator: torch.Generator) -> torch.Tensor:
    """One token's noise for a sampled row: `vocab` exponential draws from the row's own
    generator."""
    return torch.empty(vocab).exponential_(generator=generator)


# a gear's call: `(length, gear inputs, choice, choice inputs)` to each row's chosen token
Step = Callable[
    [int, tuple[torch.Tensor, ...], Choice, tuple[torch.Tensor, ...]], torch.Tensor | None
]


def choosing(run: Callable[[int, tuple[torch.Tensor, ...]], torch.Tensor]) -> Step:
    """A `Step` over `run`, a gear's call that returns its logits: the choice run after it, in
    this process (the build's check against eager, and the captured gears)."""

    def step(
        length: int,
        inputs: tuple[torch.Tensor, ...],
        choice: Choice,
        extra: tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        return choice(run(length, inputs), *extra)

    return step


def decode(
    step: Step,
    gears: GearShapes,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 1,
    sampling: Sampling = Sampling(),
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int = 0,
    share: Callable[[torch.Tensor | None, int], torch.Tensor] | None = None,
) -> Iterator[torch.Tensor]:
    """Generate: yields each step's new tokens `[rows]` (rows that finished at
    `eos_token_id`, one id or any of several, give `pad_token_id`), until `max_new_tokens`
    or every row has finished.

    `step(length, (input_ids, position_ids, cache_position, attention_mask), choice, extra)`
    calls the gear of `length` tokens on the cache's `max_batch_size` rows and returns the
    token `choice` makes of its last token's logits given `extra` (None where this caller
    holds no logits); rows past the request's are padding that attends to nothing.
    `share(token, rows)`, where given, returns the token the caller holding the logits chose
    (`token` there, None elsewhere), so every caller feeds the same one.
    """
    mask, gear = check_request(gears, input_ids, attention_mask, max_new_tokens)
    stops = stop_tokens(eos_token_id, gears.vocab_size)
    choice = Choice.of(sampling, stops, gears)
    rows, length = input_ids.shape
    batch, slots = gears.max_batch_size, gears.max_seq_len
    ids = torch.full((batch, gear), pad_token_id, dtype=torch.long)
    ids[:rows, gear - length :] = input_ids
    valid = torch.zeros(batch, slots, dtype=torch.long)
    valid[:rows, gear - length : gear] = mask
    positions = (valid[:, :gear].cumsum(dim=1) - 1).clamp(min=0)
    # row r draws from its own generator, seeded `seed + r`: a row's draws do not depend on
    # how many rows share the call, so a request alone draws what a served request does
    generators = [torch.Generator().manual_seed(sampling.seed + r) for r in range(rows)]
    finished = torch.zeros(rows, dtype=torch.bool)
    # every row's tokens so far, as the choice reads them: its prompt as given and its new
    # tokens, the penalty counting all but the left padding
    history = torch.full((batch, slots), pad_token_id, dtype=torch.long)
    history[:, :gear] = ids
    counted = valid.bool()
    begin = gear - length
    start = getattr(gears, "decoder_start_token_id", None)
    if start is not None:  # an encoder-decoder: the decoder's own tokens, from its start token
        history[:rows, 0] = start
        counted = torch.zeros(batch, slots, dtype=torch.bool)
        counted[:rows, 0] = True
        begin = 0
    # the column of the next new token, in the history and the cache: after the prompt, or
    # after an encoder-decoder's start token (its decoder's slots are its own from 0)
    first = written = gear if start is None else 1

    read = choice.history_shape == tuple(history.shape)  # else an empty history is given
    nothing = torch.empty(0, dtype=torch.long)

    def extra(new: int) -> tuple[torch.Tensor, ...]:
        span = torch.tensor([begin, written, new, max_new_tokens - 1 - new])
        noise = torch.ones(choice.noise_shape)
        if sampling.do_sample:
            for row, generator in enumerate(generators):
                noise[row] = draws(gears.vocab_size, generator)
        if read:
            return history, counted, span, noise
        return nothing, nothing.bool(), span, noise

    token = step(gear, (ids, positions, torch.arange(gear), valid), choice, extra(0))
    last = positions[:, -1]
    if start is not None:  # the decoder's slots from here: its start token's alone
        valid = torch.zeros(batch, slots, dtype=torch.long)
        valid[:rows, 0] = 1
        last = torch.zeros(batch, dtype=torch.long)
    for new in range(max_new_tokens):
        token = None if token is None else token[:rows].cpu()
        if share is not None:
            token = share(token, rows)
        if token is None:
            raise ValueError("decode: step returned no token and no share was given")
        if stops:
            token = token.masked_fill(finished, pad_token_id)
            finished |= torch.isin(token, torch.tensor(stops))
        yield token
        if new == max_new_tokens - 1 or bool(finished.all()):
            return
        history[:rows, written] = token
        counted[:rows, written] = True
        written += 1
        slot = first + new
        valid[:rows, slot] = 1
        last = last + 1
        fed = torch.full((batch, 1), pad_token_id, dtype=torch.long)
        fed[:rows, 0] = token
        inputs = (fed, last[:, None].clone(), torch.tensor([slot]), valid.clone())
        token = step(1, inputs, choice, extra(new + 1))
