"""Which stored chunks (and which copy of each) fill each output slice.

Each output slice is filled from the chunks whose boxes intersect it. When a chunk has several
holders (replicas), the holders are chosen so that the set of source files read per output file is
as small as possible: greedy set cover, then every holder that the others make unnecessary is
dropped, so the result is irredundant (no returned rank can be left out). The output rank itself is
preferred when it holds a needed chunk, as MindSpore does, for locality.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tessel.checkpoint.boxes import Box, intersect, relative, slice_shape, volume
from tessel.checkpoint.errors import CheckpointError
from tessel.checkpoint.sources import Holder, Source
from tessel.checkpoint.st_io import Piece, itemsize


@dataclass
class OutParam:
    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: list[Piece]


@dataclass
class FileJob:
    """One output file: its path relative to the output directory and its tensors in order."""

    rel_path: str
    params: list[OutParam]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(op.shape) * itemsize(op.dtype) for op in self.params)


def _hkey(h: Holder) -> tuple:
    return (isinstance(h, str), h)


def choose_holders(
    needs: list[frozenset], prefer: Holder | None = None
) -> tuple[set[Holder], dict[frozenset, Holder]]:
    """A small irredundant set of holders covering every need, and the holder used for each."""
    needs = list({n for n in needs})
    chosen: set[Holder] = set()
    if prefer is not None and any(prefer in n for n in needs):
        chosen.add(prefer)
    uncovered = [n for n in needs if not (n & chosen)]
    while uncovered:
        counts: dict[Holder, int] = {}
        for n in uncovered:
            for h in n:
                counts[h] = counts.get(h, 0) + 1
        best = min(counts, key=lambda h: (-counts[h], _hkey(h)))
        chosen.add(best)
        uncovered = [n for n in uncovered if best not in n]
    for h in sorted(chosen, key=lambda h: (h == prefer, _hkey(h)), reverse=True):
        rest = chosen - {h}
        if all(n & rest for n in needs):
            chosen = rest
    assign = {}
    for n in needs:
        cand = n & chosen
        assign[n] = prefer if prefer in cand else min(cand, key=_hkey)
    return chosen, assign


def needs_of(
    source: Source, entries: list[tuple[str, Box]], allowed: set[Holder] | None
) -> list[tuple[str, Box, list]]:
    """For each ``(name, dst box)``: the intersecting chunks and their usable holders."""
    out = []
    for name, dst_box in entries:
        hits = []
        for ch in source.chunks(name):
            inter = intersect(ch.box, dst_box)
            if inter is None:
                continue
            hs = ch.holders if allowed is None else [h for h in ch.holders if h in allowed]
            if not hs:
                raise CheckpointError(
                    source.label,
                    name,
                    f"slice {list(ch.box)} is held by {_fmt(ch.holders)}, none of which has a "
                    "file here",
                )
            hits.append((ch, inter, frozenset(hs)))
        out.append((name, dst_box, hits))
    return out


def _fmt(holders: list[Holder]) -> str:
    if holders and isinstance(holders[0], int):
        return "ranks " + str(sorted(holders)[:16])
    return ", ".join(map(str, holders[:4]))


def plan_file(
    source: Source,
    entries: list[tuple[str, Box]],
    rel_path: str,
    prefer: Holder | None = None,
    allowed: set[Holder] | None = None,
    metadata: dict[str, str] | None = None,
) -> FileJob:
    """Plan one output file holding ``entries`` (parameter name, box of the full tensor)."""
    needs = needs_of(source, entries, allowed)
    _, assign = choose_holders([n for _, _, hits in needs for _, _, n in hits], prefer)
    params = []
    for name, dst_box, hits in needs:
        _, dtype = source.info(name)
        pieces = []
        covered = 0
        for ch, inter, n in hits:
            loc = source.loc(name, ch, assign[n])
            pieces.append(Piece(loc, relative(inter, ch.box), relative(inter, dst_box)))
            covered += volume(inter)
        if covered != volume(dst_box):
            raise CheckpointError(
                source.label,
                name,
                f"stored chunks cover {covered} of the {volume(dst_box)} elements needed for "
                f"slice {list(dst_box)}",
            )
        params.append(OutParam(name, dtype, slice_shape(dst_box), pieces))
    return FileJob(rel_path, params, dict(metadata or {}))


def needed_holders(
    source: Source, entries: list[tuple[str, Box]], prefer: Holder | None = None
) -> set[Holder]:
    """The holders a plan for ``entries`` reads (what rank_list_for_convert returns)."""
    needs = needs_of(source, entries, None)
    chosen, _ = choose_holders([n for _, _, hits in needs for _, _, n in hits], prefer)
    return chosen
