"""A served request's settings: its prompt, how many tokens it makes and how it chooses them,
in the names OpenAI's API and vLLM's extras give them, resolved against the package's own
(its model's `generation_config`) as `Session.generate` resolves its keywords.

No torch here: the HTTP process parses and checks requests with this module alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tessel.config.errors import ConfigError
from tessel.config.sampling import Sampling, sampling_for
from tessel.serving.errors import BadRequest

# the `Sampling` fields a served request sets by name (OpenAI's `temperature`, `top_p` and
# `seed`, vLLM's extras); `do_sample` follows from the temperature, `min_new_tokens` is the
# request's `min_tokens`, and `min_length` and `suppress_tokens` are the model's own
SERVED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
FROM_THE_MODEL = ("do_sample", "min_length", "min_new_tokens", "suppress_tokens")
# a package's own settings a served request cannot follow (they change its tokens and the
# per-row choice does not build them): such a package is refused at start, by name
NOT_SERVED = (
    "no_repeat_ngram_size",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "forced_bos_token_id",
    "forced_eos_token_id",
)


@dataclass(frozen=True)
class Limits:
    """What a package's cache takes: its slots (rows), the longest prompt (its longest prefill
    gear), its `max_seq_len`, the vocabulary, its stop tokens and its model's settings."""

    slots: int
    prefill_lengths: tuple[int, ...]
    max_seq_len: int
    vocab_size: int
    eos_token_id: tuple[int, ...]
    defaults: Mapping[str, object]

    @property
    def longest_prompt(self) -> int:
        return self.prefill_lengths[-1]

    def gear(self, prompt: int) -> int:
        """The prefill gear a prompt of `prompt` tokens runs in."""
        return next(n for n in self.prefill_lengths if n >= prompt)

    def room(self, prompt: int) -> int:
        """The most new tokens after a prompt of `prompt` tokens: the slots after its gear, and
        the last token, which is made and never written."""
        return self.max_seq_len - self.gear(prompt) + 1


@dataclass(frozen=True)
class Request:
    """One request, checked: its prompt's token ids, how many new tokens it makes at most, how
    it chooses them (`Sampling`, resolved), and whether it ends at the model's stop tokens."""

    prompt: tuple[int, ...]
    max_tokens: int
    sampling: Sampling
    min_tokens: int = 0
    ignore_eos: bool = False

    def to_json(self) -> dict:
        """The request as the serving loop on the devices reads it."""
        s = self.sampling
        return {
            "prompt": list(self.prompt),
            "max_tokens": self.max_tokens,
            "do_sample": s.do_sample,
            "temperature": s.temperature,
            "top_k": s.top_k,
            "top_p": s.top_p,
            "min_p": s.min_p,
            "repetition_penalty": s.repetition_penalty,
            "seed": s.seed,
            "min_length": s.min_length,
            "min_new_tokens": max(s.min_new_tokens, self.min_tokens),
            "ignore_eos": self.ignore_eos,
        }


def _integer(value: object, param: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise BadRequest(f"{param} must be an integer of at least {low}, found {value!r}", param)
    return value


def request_for(
    limits: Limits,
    prompt: Sequence[int],
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    min_tokens: int | None = None,
    ignore_eos: bool | None = None,
) -> Request:
    """The `Request` for a prompt and its fields (None: not sent), or `BadRequest` naming the
    field. `temperature` 0 means greedy, where the sampled-only fields may still be sent at
    their neutral values (`top_p` 1, `top_k` 0 or -1, `min_p` 0); a field left out is the
    model's own, as `Session.generate` resolves it. `max_tokens` defaults to the model's
    `max_new_tokens`, else what its `max_length` leaves after the prompt, else what the cache
    leaves, and never more than the cache leaves."""
    ids = list(prompt)
    if not ids:
        raise BadRequest("the prompt holds no token; a prompt needs at least one", "prompt")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < limits.vocab_size:
            raise BadRequest(
                f"the prompt holds the token id {i!r}; the vocabulary is 0 to "
                f"{limits.vocab_size - 1}",
                "prompt",
            )
    if len(ids) > limits.longest_prompt:
        raise BadRequest(
            f"the prompt has {len(ids)} tokens; this package takes prompts of at most "
            f"{limits.longest_prompt} tokens (its longest prefill gear)",
            "prompt",
        )
    room = limits.room(len(ids))
    if max_tokens is None:  # the model's, as Session.generate counts it, at most the room
        wanted = limits.defaults.get("max_new_tokens")
        if wanted is None and "max_length" in limits.defaults:
            wanted = int(limits.defaults["max_length"]) - len(ids)  # type: ignore[call-overload]
            if wanted < 1:
                raise BadRequest(
                    f"max_tokens is not given, and the model's max_length "
                    f"({limits.defaults['max_length']}) leaves no new token after a prompt of "
                    f"{len(ids)} tokens; give max_tokens",
                    "max_tokens",
                )
        max_tokens = room if wanted is None else min(int(wanted), room)  # type: ignore[call-overload]
    max_tokens = _integer(max_tokens, "max_tokens", 1)
    if max_tokens > room:
        raise BadRequest(
            f"max_tokens is {max_tokens}; after a prompt of {len(ids)} tokens (in the "
            f"{limits.gear(len(ids))}-token prefill gear) the cache of {limits.max_seq_len} "
            f"slots holds {room} new tokens",
            "max_tokens",
        )
    if top_k == -1:  # vLLM's "every token"
        top_k = 0
    sent = locals()
    asked: dict[str, object] = {name: sent[name] for name in SERVED}
    if temperature is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise BadRequest(f"temperature must be a number, found {temperature!r}", "temperature")
        if temperature < 0:
            raise BadRequest(f"temperature must be 0 or more, found {temperature!r}", "temperature")
        asked["do_sample"] = temperature > 0
        if temperature == 0:  # greedy: the sampled-only fields at their neutral values only
            asked["temperature"] = None
            neutral = {"top_p": 1, "top_k": 0, "min_p": 0}
            for key, value in neutral.items():
                if asked[key] is not None and asked[key] == value:
                    asked[key] = None
            if asked["seed"] is not None:  # a seed draws nothing where nothing is drawn
                _integer(asked["seed"], "seed", 0)
                asked["seed"] = None
    elif not limits.defaults.get("do_sample", False):  # a greedy model: neutral values taken
        for key, value in {"top_p": 1, "top_k": 0, "min_p": 0}.items():
            if asked[key] is not None and asked[key] == value:
                asked[key] = None
    try:
        sampling = sampling_for(asked, limits.defaults)
    except ConfigError as exc:
        raise BadRequest(f"{exc.key} {exc.detail}", exc.key) from None
    if min_tokens is not None:
        _integer(min_tokens, "min_tokens", 0)
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise BadRequest(f"ignore_eos must be true or false, found {ignore_eos!r}", "ignore_eos")
    return Request(tuple(ids), max_tokens, sampling, min_tokens or 0, bool(ignore_eos))
