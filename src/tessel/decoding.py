"""The generation loop over a package's gears: a prompt through a prefill gear, then one decode
call per new token, each call's token chosen from its logits.

The loop is the same wherever the gears run (the build's check against eager, and every
worker of a session); `run(length, inputs)` calls the gear of `length` tokens. Tokens are
chosen by `choose` alone, from logits and a generator seeded from the call's seed, so every
caller given the same logits makes the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

import torch

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
    return wanted if gear is None else min(wanted, gears.max_seq_len - gear + 1)


def penalize(
    logits: torch.Tensor, seen: torch.Tensor, penalty: float, skip: torch.Tensor | None = None
) -> torch.Tensor:
    """`logits` `[B, vocab]` in fp32 with the score of every token of `seen` `[B, tokens]` (each
    row's tokens so far, its first `skip[row]` left out: the left padding) divided by
    `penalty`, or multiplied where it is negative, as `transformers`'
    `RepetitionPenaltyLogitsProcessor` does."""
    scores = logits.float()
    if penalty == 1:
        return scores
    vocab = scores.shape[-1]
    if skip is not None:  # left-out tokens go to a spare column past the vocabulary
        seen = seen.masked_fill(torch.arange(seen.shape[1]) < skip[:, None], vocab)
    spare = torch.cat([scores, scores.new_zeros(len(scores), 1)], dim=1)
    held = spare.gather(1, seen)
    spare = spare.scatter(1, seen, torch.where(held < 0, held * penalty, held / penalty))
    return spare[:, :vocab]


def ban_repeated_ngrams(scores: torch.Tensor, seen: torch.Tensor, n: int) -> torch.Tensor:
    """`scores` with every token that would end an n-gram of `n` tokens the row of `seen` holds
    already set to -inf, as `transformers`' `NoRepeatNGramLogitsProcessor` does."""
    if n == 0 or seen.shape[1] < n:
        return scores
    vocab = scores.shape[-1]
    prefix = seen[:, seen.shape[1] + 1 - n :]
    windows = seen.unfold(1, n, 1)
    matches = (windows[..., :-1] == prefix[:, None]).all(dim=-1)
    banned = torch.zeros(len(scores), vocab + 1, dtype=torch.bool)
    banned.scatter_(1, torch.where(matches, windows[..., -1], vocab), True)
    return scores.masked_fill(banned[:, :vocab], float("-inf"))


def processed(
    logits: torch.Tensor,
    seen: torch.Tensor,
    padding: torch.Tensor,
    new: int,
    sampling: Sampling,
    stops: torch.Tensor,
) -> torch.Tensor:
    """Each row's scores `[B, vocab]` (fp32) before its token is chosen: the logits after the
    penalty, the n-gram ban, the minimum lengths and the suppressed tokens, in `transformers`'
    order. `seen` holds each row's prompt as given and its `new` tokens so far; `padding`
    counts its left padding."""
    scores = penalize(logits, seen, sampling.repetition_penalty, padding)
    scores = ban_repeated_ngrams(scores, seen, sampling.no_repeat_ngram_size)
    if len(stops) and (seen.shape[1] < sampling.min_length or new < sampling.min_new_tokens):
        scores = scores.index_fill(1, stops, float("-inf"))
    if sampling.suppress_tokens:
        scores = scores.index_fill(1, torch.tensor(sampling.suppress_tokens), float("-inf"))
    return scores


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """Each row's next token from its logits `[B, vocab]`."""
    if not sampling.do_sample:
        return logits.argmax(dim=-1)
    probs = warped(logits, sampling).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


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
        eta = torch.tensor(sampling.eta_cutoff)
        entropy = torch.distributions.Categorical(logits=scores).entropy()[:, None]
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
    room = gears.max_seq_len - gear + 1
    if max_new_tokens > room:
        raise ConfigError(
            "generate()",
            "max_new_tokens",
            f"is {max_new_tokens}; after a prompt in the {gear}-token prefill gear the cache of "
            f"{gears.max_seq_len} slots holds {room} new tokens",
        )
    return mask, gear


def decode(
    run: Callable[[int, tuple[torch.Tensor, ...]], torch.Tensor],
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

    `run(length, (input_ids, position_ids, cache_position, attention_mask))` calls the gear of
    `length` tokens on the cache's `max_batch_size` rows and returns the last token's logits
    (None where this caller holds none); rows past the request's are padding that attends to
    nothing. `share(token, rows)`, where given, returns the token the caller holding the
    logits chose (`token` there, None elsewhere), so every caller feeds the same one.
    """
    mask, gear = check_request(gears, input_ids, attention_mask, max_new_tokens)
    stops = torch.tensor(stop_tokens(eos_token_id, gears.vocab_size), dtype=torch.long)
    rows, length = input_ids.shape
    batch, slots = gears.max_batch_size, gears.max_seq_len
    ids = torch.full((batch, gear), pad_token_id, dtype=torch.long)
    ids[:rows, gear - length :] = input_ids
    valid = torch.zeros(batch, slots, dtype=torch.long)
    valid[:rows, gear - length : gear] = mask
    positions = (valid[:, :gear].cumsum(dim=1) - 1).clamp(min=0)
    generator = torch.Generator().manual_seed(sampling.seed)
    finished = torch.zeros(rows, dtype=torch.bool)
    seen = input_ids.long()  # every row's prompt as given and its tokens so far
    padding = (mask == 0).sum(dim=1)
    start = getattr(gears, "decoder_start_token_id", None)
    if start is not None:  # an encoder-decoder: the decoder's own tokens, from its start token
        seen = torch.full((rows, 1), start, dtype=torch.long)
        padding = torch.zeros_like(padding)
    logits = run(gear, (ids, positions, torch.arange(gear), valid))
    last = positions[:, -1]
    for step in range(max_new_tokens):
        token = None
        if logits is not None:
            scores = processed(logits[:rows], seen, padding, step, sampling, stops)
            token = choose(scores, sampling, generator)
        if share is not None:
            token = share(token, rows)
        if token is None:
            raise ValueError("decode: run returned no logits and no share was given")
        if len(stops):
            token = token.masked_fill(finished, pad_token_id)
            finished |= torch.isin(token, stops)
        seen = torch.cat([seen, token[:, None]], dim=1)
        yield token
        if step == max_new_tokens - 1 or bool(finished.all()):
            return
        slot = gear + step
        valid[:rows, slot] = 1
        last = last + 1
        fed = torch.full((batch, 1), pad_token_id, dtype=torch.long)
        fed[:rows, 0] = token
        logits = run(1, (fed, last[:, None].clone(), torch.tensor([slot]), valid.clone()))
