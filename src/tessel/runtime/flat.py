"""Where a training step's trained weights sit in one flat buffer, and which part of it each
data-parallel replica owns.

The weights are grouped in units (a repeated layer's weights, or another module's), laid end
to end in the flat buffer, each unit padded to a multiple of `dp` and cut into `dp` equal
chunks. Replica `r` owns chunk `r` of every unit; its segment is those chunks end to end. So
one unit is gathered or reduce-scattered in one collective, and the part of a weight that a
replica owns is one contiguous range of that weight.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Unit:
    """Weights gathered and reduced together: their place in the flat buffer and the segment."""

    names: tuple[str, ...]
    start: int  # first element in the flat buffer
    chunk: int  # elements each replica owns (the unit's padded size over dp)
    segment_start: int  # where a replica's chunk of this unit begins in its segment


@dataclass(frozen=True)
class Owned:
    """The part of one weight a replica owns: `[start, stop)` in the flat buffer, and where
    that range begins in the replica's segment."""

    start: int
    stop: int
    segment_start: int

    @property
    def size(self) -> int:
        return self.stop - self.start


class FlatLayout:
    """The flat buffer of the weights in `units` (their element counts in `numel`) over `dp`
    replicas."""

    def __init__(self, units: Sequence[Sequence[str]], numel: Mapping[str, int], dp: int):
        self.dp = dp
        self.units: list[Unit] = []
        self.unit_of: dict[str, int] = {}
        self.start: dict[str, int] = {}  # each weight's first element in the flat buffer
        self.numel = dict(numel)
        flat = segment = 0
        for i, names in enumerate(units):
            size = sum(numel[n] for n in names)
            chunk = math.ceil(size / dp)
            offset = flat
            for n in names:
                self.unit_of[n], self.start[n] = i, offset
                offset += numel[n]
            self.units.append(Unit(tuple(names), flat, chunk, segment))
            flat += chunk * dp
            segment += chunk
        self.total, self.segment = flat, segment

    def padded(self, unit: Unit) -> int:
        return unit.chunk * self.dp

    def chunk_range(self, unit: Unit, replica: int) -> tuple[int, int]:
        """Replica `replica`'s chunk of `unit` in the flat buffer."""
        lo = unit.start + replica * unit.chunk
        return lo, lo + unit.chunk

    def owned(self, name: str, replica: int) -> Owned | None:
        """The part of weight `name` that `replica` owns, or None where it owns none of it."""
        unit = self.units[self.unit_of[name]]
        lo, hi = self.chunk_range(unit, replica)
        start = self.start[name]
        a, b = max(start, lo), min(start + self.numel[name], hi)
        if a >= b:
            return None
        return Owned(a, b, unit.segment_start + (a - lo))
