"""Slices as boxes: which region of the full tensor each device holds under a ParamLayout.

A box is a tuple of ``(start, stop)`` per tensor dim, in full-tensor coordinates. A dim split
into k slices is cut as torch.chunk cuts it (and DTensor's Shard): every slice but the last
holds ceil(size / k) rows, so where k does not divide the size the last slices are shorter or
empty. Where it divides, these are MindSpore's even slices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tessel.checkpoint.errors import StrategyError
from tessel.checkpoint.records import ParamLayout
from tessel.sharding import chunk_range, mesh_coordinate
from tessel.sharding.geometry import Box


def coords(index: int, dev_matrix: Sequence[int]) -> tuple[int, ...]:
    """Row-major coordinate of flat device index ``index`` (last axis fastest)."""
    return mesh_coordinate(index, dev_matrix)


def check_divisible(name: str, p: ParamLayout, shape: Sequence[int], src: str) -> None:
    """A layout must name every dim of its tensor; the optimizer shard must divide dim 0's
    slice. Other dims may split unevenly (see the module docstring)."""
    _check_resolved(name, p, src)
    splits = p.splits()
    if len(shape) != len(splits):
        raise StrategyError(
            src,
            f"params.{name}.tensor_map",
            f"has {len(splits)} entries for a {len(shape)}-dim tensor of shape {list(shape)}",
        )
    if p.opt_shard_size and shape[0] % splits[0]:
        raise StrategyError(
            src,
            f"params.{name}.opt_shard_size",
            f"needs dim 0 (size {shape[0]}) to split evenly into {splits[0]} slices",
        )
    if p.opt_shard_size and (shape[0] // splits[0]) % p.opt_shard_size:
        raise StrategyError(
            src,
            f"params.{name}.opt_shard_size",
            f"dim 0 slice of size {shape[0] // splits[0]} is not divisible by the optimizer "
            f"shard size {p.opt_shard_size}",
        )


def _check_resolved(name: str | None, p: ParamLayout, src: str | None) -> None:
    """A layout as `check_param` leaves it: an optimizer shard of a size with its step (-1,
    the whole data-parallel group, resolved to both), so no box divides by zero or runs
    backwards."""
    if p.opt_shard_size < 0 or (p.opt_shard_size > 0 and p.opt_shard_step <= 0):
        raise StrategyError(
            src,
            f"params.{name}.opt_shard_size" if name else "opt_shard_size",
            f"is {p.opt_shard_size} with opt_shard_step {p.opt_shard_step}, not resolved to a "
            "group size and its step: read the record through load_strategy or check_param",
        )


def device_box(p: ParamLayout, index: int, shape: Sequence[int]) -> Box:
    """The box held by flat device index ``index`` (optimizer shard applied inside dim 0)."""
    _check_resolved(None, p, None)
    n = len(p.dev_matrix)
    c = coords(index, p.dev_matrix)
    box = []
    for d, axes in enumerate(p.tensor_map):
        idx, k = 0, 1
        for a in axes:  # outer first
            size = p.dev_matrix[n - 1 - a]
            idx = idx * size + c[n - 1 - a]
            k *= size
        start, stop = chunk_range(shape[d], k, idx)
        length = stop - start
        if d == 0 and p.opt_shard_size:
            sub = length // p.opt_shard_size
            j = (index // p.opt_shard_step) % p.opt_shard_size
            start, length = start + j * sub, sub
        box.append((start, start + length))
    return tuple(box)


def slice_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None when they do not overlap (or the overlap is empty)."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=False):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def relative(inner: Box, outer: Box) -> Box:
    """``inner`` in the local coordinates of ``outer``."""
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(inner, outer, strict=False))


def distinct_boxes(p: ParamLayout, shape: Sequence[int]) -> dict[Box, list[int]]:
    """Each distinct box -> the flat device indices holding it (ascending)."""
    out: dict[Box, list[int]] = {}
    for i in range(p.device_num):
        out.setdefault(device_box(p, i, shape), []).append(i)
    return out


def check_tiling(name: str, p: ParamLayout, src: str, shape: Sequence[int] | None = None) -> None:
    """Check that the distinct slices tile the whole tensor (nothing lost, nothing overlapping)."""
    shape = p.shape if shape is None else shape
    if shape is None:
        return
    check_divisible(name, p, shape, src)
    if volume(tuple((0, s) for s in shape)) == 0:
        return
    boxes = {b for b in distinct_boxes(p, shape) if volume(b)}
    want = math.prod(
        -(-size // -(-size // k)) if size else 1  # the non-empty chunks torch.chunk makes
        for k, size in zip(p.splits(), shape, strict=False)
    )
    want *= p.opt_shard_size or 1
    if len(boxes) != want:
        raise StrategyError(
            src,
            f"params.{name}.opt_shard_step",
            f"optimizer shard size {p.opt_shard_size} with step {p.opt_shard_step} gives "
            f"{len(boxes)} distinct slices where {want} are needed to cover the tensor; the step "
            "must walk the data-parallel (unused) device axes",
        )
