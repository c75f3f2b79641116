"""What a generation build holds: the largest batch and sequence its cache takes, and the
prompt lengths its prefill gears are captured at (ATC's `--dynamic_dims` gears)."""

from __future__ import annotations

from dataclasses import dataclass

from tessel.config.errors import ConfigError


@dataclass(frozen=True)
class Generation:
    """A generation build's shapes.

    The cache holds `max_batch_size` rows of `max_seq_len` tokens (prompt and new tokens
    together) on the devices. A prompt runs through the prefill gear of the shortest length in
    `prefill_lengths` that holds it, left padded; each new token runs through the decode gear.
    """

    max_batch_size: int
    max_seq_len: int
    prefill_lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        for key in ("max_batch_size", "max_seq_len"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError("Generation", key, f"must be a positive int, found {value!r}")
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
