"""What a generation build holds: the largest batch and sequence its cache takes, and the
prompt lengths its prefill gears are captured at (ATC's `--dynamic_dims` gears)."""

from __future__ import annotations

from dataclasses import dataclass

from tessel.config.errors import ConfigError

# a generation package's state buffers, by name: a layer `i` of attention keeps its keys and
# values as `cache_{2i}` and `cache_{2i+1}`, a recurrent layer its convolution and recurrent
# states as `conv_state_{i}` and `recurrent_state_{i}`; an encoder-decoder's decoder layer
# keeps its cross-attention's as `cross_{2i}` and `cross_{2i+1}`, beside the prompt's mask
KV, CONV, RECURRENT, CROSS = "cache_", "conv_state_", "recurrent_state_", "cross_"
ENCODER_MASK = "encoder_mask"
STATE_KINDS = {
    KV: "keys and values",
    CROSS: "cross-attention keys and values",
    CONV: "convolution states",
    RECURRENT: "recurrent states",
}


def state_kind(name: str) -> str:
    """What a generation package's state buffer holds, in words (`tessel inspect` groups the
    state by it)."""
    for prefix, kind in STATE_KINDS.items():
        if name.startswith(prefix):
            return kind
    return "the prompt's mask" if name == ENCODER_MASK else "other state"


@dataclass(frozen=True)
class Generation:
    """A generation build's shapes.

    The cache holds `max_batch_size` rows of `max_seq_len` tokens (prompt and new tokens
    together) on the devices. A prompt runs through the prefill gear of the shortest length in
    `prefill_lengths` that holds it, left padded; each new token runs through the decode gear.

    With `row_prefill`, each prompt length also gets a prefill gear of one row that writes the
    cache row it is given and no other: `tessel serve` admits a request with it, at the cost
    of one row's prompt, where the other gears compute every row.

    Args:
        max_batch_size: The cache's rows: the most prompts one call, or one server, runs at
            once.
        max_seq_len: The tokens each row holds, prompt and new tokens together.
        prefill_lengths: The prompt lengths of the prefill gears, each below `max_seq_len`.
        row_prefill: Also build a one-row prefill gear per prompt length, for `tessel serve`.

    Raises:
        ConfigError: A size that is not a positive integer, or a prompt length out of range.
    """

    max_batch_size: int
    max_seq_len: int
    prefill_lengths: tuple[int, ...]
    row_prefill: bool = False

    def __post_init__(self) -> None:
        for key in ("max_batch_size", "max_seq_len"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError("Generation", key, f"must be a positive int, found {value!r}")
        if not isinstance(self.row_prefill, bool):
            raise ConfigError(
                "Generation", "row_prefill", f"must be True or False, found {self.row_prefill!r}"
            )
        lengths = self.prefill_lengths
        if isinstance(lengths, int) and not isinstance(lengths, bool):
            lengths = (lengths,)
        if not isinstance(lengths, (tuple, list)) or not lengths:
            raise ConfigError(
                "Generation",
                "prefill_lengths",
                f"must be a non-empty tuple of prompt lengths, found {self.prefill_lengths!r}",
            )
        for n in lengths:
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < self.max_seq_len:
                raise ConfigError(
                    "Generation",
                    "prefill_lengths",
                    f"holds {n!r}; each prompt length must be an int from 1 to max_seq_len - 1 "
                    f"({self.max_seq_len - 1}), leaving room for a new token",
                )
        if len(set(lengths)) != len(lengths):
            raise ConfigError(
                "Generation", "prefill_lengths", f"repeats a length: {tuple(lengths)}"
            )
        object.__setattr__(self, "prefill_lengths", tuple(sorted(lengths)))

    def prefill_length_for(self, prompt_length: int) -> int:
        """The shortest prefill gear that holds a prompt of `prompt_length` tokens."""
        for n in self.prefill_lengths:
            if prompt_length <= n:
                return n
        raise ConfigError(
            "input_ids",
            None,
            f"a prompt of {prompt_length} tokens is longer than the longest prefill gear "
            f"({self.prefill_lengths[-1]}); the package's gears are {self.prefill_lengths}",
        )


def generation_from_flags(
    input_shape: str | None, dynamic_dims: str | None, max_seq_len: int | None
) -> Generation:
    """A `Generation` from ATC's gear flags: `--input_shape="input_ids:-1,-1"` names the
    prompt's `[batch, length]` with each `-1` a dimension the gears set, `--dynamic_dims=
    "1,64;4,64;4,256"` gives each gear's values of the `-1`s in order, and `--max_seq_len` the
    cache's length. The cache takes the largest batch any gear names (a smaller batch runs in
    its rows); each distinct length is a prefill gear."""
    if max_seq_len is None:
        raise ConfigError(
            "--max_seq_len",
            None,
            "is required for a generation build: the tokens (prompt and new) each row's cache "
            "holds",
        )
    if not input_shape:
        raise ConfigError(
            "--input_shape",
            None,
            'is required for a generation build: the prompt\'s "input_ids:BATCH,LENGTH", '
            "with -1 for each dimension --dynamic_dims sets",
        )
    text = input_shape.strip().strip('"')
    name, _, dims_text = text.partition(":")
    if ";" in text or name.strip() != "input_ids":
        raise ConfigError(
            "--input_shape",
            None,
            f"a generation build takes one input, input_ids:BATCH,LENGTH (e.g. "
            f"input_ids:-1,-1), found {input_shape!r}",
        )
    dims = [_dimension("--input_shape", d, allow_dynamic=True) for d in dims_text.split(",")]
    if len(dims) != 2:
        raise ConfigError(
            "--input_shape",
            "input_ids",
            f"has {len(dims)} dimensions; the prompt is [batch, length]",
        )
    dynamic = [i for i, d in enumerate(dims) if d == -1]
    if dynamic and not dynamic_dims:
        raise ConfigError(
            "--dynamic_dims",
            None,
            f"is required: --input_shape {input_shape!r} leaves {len(dynamic)} dimension(s) -1",
        )
    if dynamic_dims and not dynamic:
        raise ConfigError(
            "--dynamic_dims",
            None,
            f"sets -1 dimensions of --input_shape, and {input_shape!r} has none",
        )
    gears = [tuple(dims)]
    if dynamic_dims:
        gears = [
            _gear(entry, dims, dynamic, input_shape)
            for entry in dynamic_dims.strip().strip('"').split(";")
        ]
    lengths = sorted({length for _, length in gears})
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 2:
        raise ConfigError(
            "--max_seq_len", None, f"must be an int of at least 2, found {max_seq_len!r}"
        )
    if lengths[-1] >= max_seq_len:
        raise ConfigError(
            "--max_seq_len",
            None,
            f"is {max_seq_len}; the longest gear's prompt ({lengths[-1]} tokens) leaves no room "
            "for a new token",
        )
    return Generation(
        max_batch_size=max(batch for batch, _ in gears),
        max_seq_len=max_seq_len,
        prefill_lengths=tuple(lengths),
    )


def _gear(entry: str, dims: list[int], dynamic: list[int], input_shape: str) -> tuple[int, ...]:
    """One `--dynamic_dims` gear: `dims` with its values in the `-1` places."""
    values = [_dimension("--dynamic_dims", v) for v in entry.split(",")]
    if len(values) != len(dynamic):
        raise ConfigError(
            "--dynamic_dims",
            None,
            f"gear {entry!r} gives {len(values)} value(s); --input_shape {input_shape!r} has "
            f"{len(dynamic)} -1 dimension(s), and each gear gives one value for each",
        )
    shape = list(dims)
    for i, value in zip(dynamic, values):
        shape[i] = value
    return tuple(shape)


def _dimension(flag: str, text: str, allow_dynamic: bool = False) -> int:
    """One dimension of a flag's shape: a positive int (or -1 where the gears set it)."""
    text = text.strip()
    if text.isascii() and text.isdigit() and int(text) > 0:
        return int(text)
    if allow_dynamic and text == "-1":
        return -1
    allowed = "a positive int or -1" if allow_dynamic else "a positive int"
    raise ConfigError(flag, None, f"holds {text!r}; each dimension is {allowed}")
