"""How a generation call chooses its tokens: the settings `transformers`' `generate` takes
(greedy or sampled, the penalty, the n-gram ban, minimum lengths), checked, and resolved
against the model's own (its `generation_config`, which a package records) as `transformers`
resolves them. No torch: `tessel inspect` reads a package's settings with this module alone.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from tessel.config.errors import ConfigError


@dataclass(frozen=True)
class Sampling:
    """How each new token is chosen, as `transformers`' `generate` chooses it: greedy
    (`do_sample=False`), or drawn from the logits scaled by `temperature`, kept to the `top_k`
    largest (0: all), the smallest set whose probability reaches `top_p`, the tokens at least
    `min_p` times as likely as the likeliest, the locally typical set of mass `typical_p`, and
    the tokens above the `epsilon_cutoff` and `eta_cutoff` probabilities. Before either, greedy
    or sampled: the `repetition_penalty`, no n-gram of `no_repeat_ngram_size` tokens twice in a
    row, no eos token before the row holds `min_length` tokens (its prompt as given and its new
    ones) and `min_new_tokens` new ones, `forced_bos_token_id` where the row holds one token
    (an encoder-decoder's first new token), `forced_eos_token_id` (one id or several) as the
    call's last token, and never a token of `suppress_tokens`. The defaults are
    `transformers`' own (each cut off where it removes nothing), used where neither the call
    nor the model (`MODEL_SETTINGS`) sets a value."""

    # each field's `help` is what every front end (Session.generate's keywords, tessel
    # generate's flags) tells its user: `SAMPLING_FIELDS`
    do_sample: bool = field(
        default=False,
        metadata={"help": "Sample each token, or choose the likeliest (greedy)."},
    )
    temperature: float = field(
        default=1.0,
        metadata={"help": "With sampling, divide the logits by it (below 1: sharper)."},
    )
    top_k: int = field(
        default=50,
        metadata={"help": "With sampling, keep the k likeliest tokens (0: all)."},
    )
    top_p: float = field(
        default=1.0,
        metadata={"help": "With sampling, keep the smallest set of tokens of this mass."},
    )
    seed: int = field(
        default=0,
        metadata={"help": "With sampling, the seed of the draws: the same seed, the same tokens."},
    )
    repetition_penalty: float = field(
        default=1.0,
        metadata={"help": "Make the tokens a row holds this much less likely (1: no penalty)."},
    )
    no_repeat_ngram_size: int = field(
        default=0,
        metadata={"help": "Let no n-gram of this many tokens occur twice in a row (0: no ban)."},
    )
    min_length: int = field(
        default=0,
        metadata={
            "help": "Make no eos token before a row holds this many tokens, its prompt's "
            "included (0: none)."
        },
    )
    min_new_tokens: int = field(
        default=0,
        metadata={
            "help": "Make no eos token before a row holds this many new tokens (0: none). "
            "Where set, it overrules min_length."
        },
    )
    min_p: float = field(
        default=0.0,
        metadata={
            "help": "With sampling, keep the tokens at least this share as likely as the "
            "likeliest (0: all)."
        },
    )
    typical_p: float = field(
        default=1.0,
        metadata={"help": "With sampling, keep the locally typical set of this mass (1: all)."},
    )
    epsilon_cutoff: float = field(
        default=0.0,
        metadata={"help": "With sampling, drop the tokens less likely than this (0: none)."},
    )
    eta_cutoff: float = field(
        default=0.0,
        metadata={
            "help": "With sampling, drop the tokens below this cutoff, lowered by the "
            "entropy (0: none)."
        },
    )
    suppress_tokens: tuple[int, ...] = field(
        default=(),
        metadata={"help": "Never make these tokens."},
    )
    forced_bos_token_id: int | None = field(
        default=None,
        metadata={
            "help": "Make this token where a row holds one token (an encoder-decoder's "
            "first new token)."
        },
    )
    forced_eos_token_id: tuple[int, ...] = field(
        default=(),
        metadata={"help": "Make this token (or one of these) the call's last token."},
    )

    def __post_init__(self) -> None:
        def bad(key: str, allowed: str) -> ConfigError:
            return ConfigError("generate()", key, f"{allowed}, found {getattr(self, key)!r}")

        def number(key: str) -> bool:
            value = getattr(self, key)
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        def count(key: str) -> bool:
            value = getattr(self, key)
            return isinstance(value, int) and not isinstance(value, bool) and value >= 0

        if not isinstance(self.do_sample, bool):
            raise bad("do_sample", "must be True or False")
        if not number("temperature") or not 0 < self.temperature < float("inf"):
            raise bad("temperature", "must be a number above 0")
        if not count("top_k"):
            raise bad("top_k", "must be an int of at least 0 (0 keeps every token)")
        if not number("top_p") or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be a number in (0, 1]")
        if not count("seed"):
            raise bad("seed", "must be an int of at least 0")
        r = self.repetition_penalty
        if not number("repetition_penalty") or not 0 < r < float("inf"):
            raise bad("repetition_penalty", "must be a number above 0 (1: no penalty)")
        for key in ("no_repeat_ngram_size", "min_length", "min_new_tokens"):
            if not count(key):
                raise bad(key, "must be an int of at least 0 (0: none)")
        if not number("min_p") or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be a number in [0, 1] (0: no cutoff)")
        if not number("typical_p") or not 0 < self.typical_p <= 1:
            raise bad("typical_p", "must be a number in (0, 1] (1: no cutoff)")
        for key in ("epsilon_cutoff", "eta_cutoff"):
            if not number(key) or not 0 <= getattr(self, key) < 1:
                raise bad(key, "must be a number in [0, 1) (0: no cutoff)")
        banned = self.suppress_tokens
        if not isinstance(banned, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in banned
        ):
            raise bad("suppress_tokens", "must be a list of token ids")
        object.__setattr__(self, "suppress_tokens", tuple(banned))
        bos = self.forced_bos_token_id
        if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool) or bos < 0):
            raise bad("forced_bos_token_id", "must be a token id or None")
        eos = self.forced_eos_token_id
        eos = [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos
        if not isinstance(eos, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos
        ):
            raise bad("forced_eos_token_id", "must be a token id or a list of them")
        object.__setattr__(self, "forced_eos_token_id", tuple(eos))
        if not self.do_sample:  # greedy decoding takes none of them: refused, never ignored
            unsampled = {f.name: f.default for f in fields(self)}
            for key in SAMPLED_ONLY:
                if getattr(self, key) != unsampled[key]:
                    raise bad(key, "takes effect only with do_sample=True (greedy otherwise)")


@dataclass(frozen=True)
class SamplingField:
    """One `Sampling` setting as a front end offers it (a keyword, a flag, a request's field):
    derived from `Sampling`'s fields, so no front end restates their names, types or help."""

    name: str
    kind: type  # bool, int or float: the value's, or each token id's where `several`
    several: bool  # token ids, one or more (`suppress_tokens`, `forced_eos_token_id`)
    default: object  # `Sampling`'s: where neither the call nor the model sets it
    help: str  # what it does, in short sentences


def _sampling_fields() -> tuple[SamplingField, ...]:
    hints = typing.get_type_hints(Sampling)
    out = []
    for f in fields(Sampling):
        hint = hints[f.name]  # bool, int, float, int | None or tuple[int, ...]
        kinds = [a for a in typing.get_args(hint) if a not in (type(None), Ellipsis)]
        kind = kinds[0] if kinds else hint
        several = typing.get_origin(hint) is tuple
        out.append(SamplingField(f.name, kind, several, f.default, f.metadata["help"]))
    return tuple(out)


# every `Sampling` field, in its order, with its type, default and help
SAMPLING_FIELDS = _sampling_fields()

# the settings only a sampled token reads; the seed too, which only the call gives
SAMPLED_ONLY = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "seed",
)
# the settings a model's `generation_config` may carry that `transformers`' `generate` applies
# unasked, and tessel's loop too: each call's default where the model sets it
SAMPLING_SETTINGS = (
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "min_length",
    "min_new_tokens",
    "min_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "suppress_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
)
# and how many tokens a call makes where it does not say
LENGTH_SETTINGS = ("max_new_tokens", "max_length")
MODEL_SETTINGS = SAMPLING_SETTINGS + LENGTH_SETTINGS
# a setting's value: a flag, a count, a number, or token ids (`suppress_tokens`)
Setting = bool | int | float | list[int]
NEW_TOKENS = 20  # transformers' default, where neither the call nor the model sets a length

# generation_config settings that `transformers`' `generate` applies unasked and tessel's loop
# does not, each with the value that leaves decoding as it is: a model that sets one otherwise
# is refused at build, never generated from without it; a call may pass the neutral value, as
# it may to `transformers`' `generate` (`num_beams=1`)
UNSUPPORTED_SETTINGS: dict[str, object] = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "num_return_sequences": 1,
    "diversity_penalty": 0.0,
    "penalty_alpha": None,
    "dola_layers": None,
    "constraints": None,
    "force_words_ids": None,
    "top_h": None,
    "encoder_repetition_penalty": 1.0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "sequence_bias": None,
    "begin_suppress_tokens": None,
    "exponential_decay_length_penalty": None,
    "remove_invalid_values": False,
    "guidance_scale": 1.0,
    "watermarking_config": None,
    "max_time": None,
    "stop_strings": None,
}


def sampling_for(asked: Mapping[str, object], model: Mapping[str, object]) -> Sampling:
    """A call's `Sampling`: each setting as `asked` (None: not asked), else the model's, else
    `transformers`' default. As in `transformers`, the model's temperature, top-k and top-p
    apply only where the call samples (the call's own are refused when it does not), and
    `min_new_tokens`, where set, overrules `min_length`."""
    chosen = {k: v for k, v in model.items() if k in SAMPLING_SETTINGS}
    chosen.update((k, v) for k, v in asked.items() if v is not None)
    if not chosen.get("do_sample", False):
        for key in SAMPLED_ONLY:
            if asked.get(key) is None:
                chosen.pop(key, None)
    if "min_new_tokens" in chosen:
        chosen.pop("min_length", None)
    return Sampling(**chosen)  # type: ignore[arg-type]


def check_settings_in_range(settings: Mapping[str, object]) -> None:
    """Raise `ConfigError` unless each of a model's decoding settings (`MODEL_SETTINGS`) is one
    `generate` would accept: every sampling setting in range as if sampling, and each length
    an int of at least 1."""
    sampling_for({}, {**settings, "do_sample": True})
    for key in LENGTH_SETTINGS:
        value = settings.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError("generate()", key, f"must be an int of at least 1, found {value!r}")
