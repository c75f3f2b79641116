"""`Layout`: MindSpore's device-matrix + alias description of how a tensor is sharded.

Semantics follow mindspore.parallel.Layout exactly:

* ``Layout(device_matrix, alias_name, rank_list=None)`` names each device-matrix axis.
* ``layout(*tensor_map)`` gives one entry per tensor dim: an alias, ``"None"`` (not sharded) or a
  tuple of aliases (the dim is split by several axes; the first alias is the outer index).
* The stored tensor map numbers device axes from the right: alias ``a`` becomes
  ``len(alias_name) - 1 - alias_name.index(a)``; ``-1`` means not sharded.
* A rank's coordinate in the device matrix is row-major (last axis fastest); ``rank_list[i]`` is
  the global rank at flat device index ``i``.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Sequence
from typing import Any

from tessel.checkpoint.errors import LayoutError, LayoutTypeError

INTERLEAVED = "interleaved_parallel"
NONE_ALIAS = "None"
_ALIAS = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
# more devices than any cluster has: a device matrix this large is a mistake, and its rank
# list would not fit in memory
MAX_DEVICES = 2**20

TensorMapEntry = int | tuple[int, ...]


class Layout:
    """Topology of the devices a tensor is placed on, with one alias per device-matrix axis."""

    def __init__(
        self,
        device_matrix: tuple[int, ...],
        alias_name: tuple[str, ...],
        rank_list: Sequence[int] | None = None,
    ) -> None:
        if not isinstance(device_matrix, tuple):
            raise LayoutTypeError(
                "device_matrix", f"must be a tuple of ints, got {type(device_matrix).__name__}"
            )
        if not isinstance(alias_name, tuple):
            raise LayoutTypeError(
                "alias_name", f"must be a tuple of str, got {type(alias_name).__name__}"
            )
        if not device_matrix:
            raise LayoutError("device_matrix", "is empty; give one size per device axis")
        if len(device_matrix) != len(alias_name):
            raise LayoutError(
                "alias_name",
                f"has {len(alias_name)} names but device_matrix has {len(device_matrix)} axes; "
                "they must have the same length",
            )
        for i, d in enumerate(device_matrix):
            if isinstance(d, bool) or not isinstance(d, int):
                raise LayoutTypeError(
                    "device_matrix", f"element {i} is {d!r}; every element must be an int"
                )
            if d <= 0:
                raise LayoutError(
                    "device_matrix", f"element {i} is {d}; every element must be positive"
                )
        for i, a in enumerate(alias_name):
            if not isinstance(a, str):
                raise LayoutTypeError(
                    "alias_name", f"element {i} is {a!r}; every element must be a str"
                )
            if a == "" or a == NONE_ALIAS or not _ALIAS.fullmatch(a):
                raise LayoutError(
                    "alias_name",
                    f"element {i} is {a!r}; an alias is a name of letters, digits and "
                    "underscores (not empty, not 'None')",
                )
        if len(set(alias_name)) != len(alias_name):
            dup = sorted({a for a in alias_name if alias_name.count(a) > 1})
            raise LayoutError("alias_name", f"repeats {dup}; aliases must be unique")
        if INTERLEAVED in alias_name and alias_name[-1] != INTERLEAVED:
            raise LayoutError(
                "alias_name",
                f"'{INTERLEAVED}' is at position {alias_name.index(INTERLEAVED)}; "
                "it must be the last alias",
            )
        n = math.prod(device_matrix)
        if n > MAX_DEVICES:
            raise LayoutError(
                "device_matrix",
                f"{device_matrix} holds {n} devices; at most {MAX_DEVICES} are taken",
            )
        if rank_list is None:
            ranks = list(range(n))
        else:
            if not isinstance(rank_list, (list, tuple)):
                raise LayoutTypeError(
                    "rank_list", f"must be a list of ints, got {type(rank_list).__name__}"
                )
            ranks = list(rank_list)
            for i, r in enumerate(ranks):
                if isinstance(r, bool) or not isinstance(r, int):
                    raise LayoutTypeError(
                        "rank_list", f"element {i} is {r!r}; rank_list must be a 1-D list of ints"
                    )
                if r < 0:
                    raise LayoutError("rank_list", f"element {i} is {r}; ranks must be >= 0")
            if len(ranks) != n:
                raise LayoutError(
                    "rank_list",
                    f"has {len(ranks)} ranks; it must have prod(device_matrix) = {n}",
                )
            if len(set(ranks)) != len(ranks):
                raise LayoutError("rank_list", "repeats a rank; ranks must be unique")
        self._device_shape = device_matrix
        self._alias_name = alias_name
        self._rank_list = ranks
        self._tensor_map: tuple[TensorMapEntry, ...] | None = None
        self._alias_map: tuple[Any, ...] | None = None

    # -- building a tensor layout ---------------------------------------------------------------
    def __call__(self, *tensor_map: str | tuple[str, ...]) -> Layout:
        """Return a copy of this layout that shards a tensor with one entry per tensor dim."""
        used: set[str] = set()
        ints: list[TensorMapEntry] = []
        for d, entry in enumerate(tensor_map):
            if isinstance(entry, str):
                ints.append(self._axis_of(entry, d, used))
            elif isinstance(entry, tuple):
                if not entry:
                    raise LayoutError(f"tensor_map[{d}]", "is an empty tuple; give aliases")
                axes = []
                for a in entry:
                    if not isinstance(a, str):
                        raise LayoutTypeError(
                            f"tensor_map[{d}]", f"has {a!r}; tuple entries must be alias strings"
                        )
                    if a == NONE_ALIAS:
                        raise LayoutError(
                            f"tensor_map[{d}]", "'None' may not appear inside a tuple entry"
                        )
                    axes.append(self._axis_of(a, d, used))
                ints.append(tuple(axes))
            else:
                raise LayoutTypeError(
                    f"tensor_map[{d}]",
                    f"is {entry!r}; each entry must be an alias, 'None' or a tuple of aliases",
                )
        out = copy.deepcopy(self)
        out._tensor_map = tuple(ints)
        out._alias_map = tuple(tensor_map)
        return out

    def _axis_of(self, alias: str, dim: int, used: set[str]) -> int:
        if alias == NONE_ALIAS:
            return -1
        if alias not in self._alias_name:
            raise LayoutError(
                f"tensor_map[{dim}]",
                f"alias {alias!r} is not in alias_name {self._alias_name} (or 'None')",
            )
        if alias in used:
            raise LayoutError(
                f"tensor_map[{dim}]",
                f"alias {alias!r} is used twice; each alias may shard a tensor only once",
            )
        used.add(alias)
        return len(self._alias_name) - 1 - self._alias_name.index(alias)

    # -- accessors -------------------------------------------------------------------------------
    @property
    def device_matrix(self) -> tuple[int, ...]:
        return self._device_shape

    @property
    def alias_name(self) -> tuple[str, ...]:
        return self._alias_name

    @property
    def rank_list(self) -> list[int]:
        return list(self._rank_list)

    @property
    def tensor_map(self) -> tuple[TensorMapEntry, ...] | None:
        """The stored tensor map (axes counted from the right, -1 = not sharded), or None."""
        return self._tensor_map

    @property
    def interleaved_parallel(self) -> bool:
        return INTERLEAVED in self._alias_name

    def tensor_axes(self) -> tuple[tuple[int, ...], ...]:
        """Tensor map as one tuple of right-numbered axes per dim (outer first; () = replicated)."""
        if self._tensor_map is None:
            raise LayoutError("tensor_map", "is not set; call the layout with one entry per dim")
        out = []
        for e in self._tensor_map:
            if isinstance(e, tuple):
                out.append(tuple(e))
            else:
                out.append(() if e == -1 else (e,))
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        """The layout as a dict, with the same keys MindSpore uses."""
        if self._tensor_map is None:
            raise LayoutError("tensor_map", "is None; call the layout with a tensor map first")
        return {
            "device_matrix": self._device_shape,
            "tensor_map": self._tensor_map,
            "interleaved_parallel": self.interleaved_parallel,
            "alias_name": self._alias_name,
            "rank_list": list(self._rank_list),
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return (
            self._device_shape == other._device_shape
            and self._alias_name == other._alias_name
            and self._rank_list == other._rank_list
            and self._tensor_map == other._tensor_map
        )

    def __hash__(self) -> int:
        return hash((self._device_shape, self._alias_name, self._tensor_map))

    def __repr__(self) -> str:
        tm = "" if self._alias_map is None else f"{self._alias_map}"
        rl = "" if self._rank_list == list(range(len(self._rank_list))) else f", {self._rank_list}"
        return f"Layout({self._device_shape}, {self._alias_name}{rl}){tm}"


def layout_from_tensor_map(
    device_matrix: Sequence[int],
    tensor_axes: Sequence[Sequence[int]],
    alias_name: Sequence[str] | None = None,
    rank_list: Sequence[int] | None = None,
) -> Layout:
    """Build a Layout from a stored (right-numbered) tensor map, naming axes ``a0, a1, ...``."""
    dev = tuple(int(d) for d in device_matrix)
    names = tuple(alias_name) if alias_name else tuple(f"a{i}" for i in range(len(dev)))
    base = Layout(dev, names, list(rank_list) if rank_list is not None else None)
    entries: list[str | tuple[str, ...]] = []
    for d, axes in enumerate(tensor_axes):
        axes = [a for a in axes if a != -1]
        for a in axes:
            if not 0 <= a < len(dev):
                raise LayoutError(
                    f"tensor_map[{d}]", f"axis {a} is outside the device matrix {dev}"
                )
        named = [names[len(dev) - 1 - a] for a in axes]
        if not named:
            entries.append(NONE_ALIAS)
        elif len(named) == 1:
            entries.append(named[0])
        else:
            entries.append(tuple(named))
    return base(*entries)
