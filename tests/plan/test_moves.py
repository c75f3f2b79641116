"""The memory model's count of one move against the move itself: DTensor's redistribution of a
value traced on every rank of a fake mesh, its peak taken as the lowering takes a program's
(the source aside). Shapes that split unevenly, every placement on one axis, and two axes."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from tessel.lower.trace import fake_world
from tessel.plan.memory import _move_bytes, program_peak_bytes

SHAPES = [(3, 16, 64), (4, 6, 62), (2, 8, 10)]
PLACED = [Replicate(), Shard(0), Shard(1), Shard(2)]


def _local_shape(shape: tuple, placements: tuple, at: list[int], mesh_shape: tuple) -> list[int]:
    """The shard of `shape` the rank at mesh coordinates `at` holds (torch.chunk's pieces)."""
    out = list(shape)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            pieces = torch.empty(out[p.dim]).chunk(mesh_shape[axis])
            out[p.dim] = len(pieces[at[axis]]) if at[axis] < len(pieces) else 0
    return out


def _traced_peak(shape: tuple, src: tuple, dst: tuple, mesh_shape: tuple) -> int:
    """The most bytes any rank holds while DTensor moves a value of `shape` from `src` to
    `dst`, its own shard aside."""
    whole = torch.empty(shape)
    most = 0
    for rank in range(math.prod(mesh_shape)):
        with fake_world(rank, mesh_shape) as mesh:
            local = _local_shape(shape, src, mesh.get_coordinate(), mesh_shape)

            def move(x: torch.Tensor) -> torch.Tensor:
                placed = DTensor.from_local(
                    x, mesh, src, run_check=False, shape=whole.shape, stride=whole.stride()
                )
                return placed.redistribute(mesh, dst).to_local()

            gm = make_fx(move, tracing_mode="fake")(torch.empty(local))
            source = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
            held, peak = program_peak_bytes(gm.graph, source)
            most = max(most, peak - held)
    return most


def _check(shape: tuple, src: tuple, dst: tuple, mesh_shape: tuple) -> None:
    predicted = _move_bytes(torch.empty(shape), src, dst, mesh_shape)[0]
    assert predicted == _traced_peak(shape, src, dst, mesh_shape), (shape, src, dst)


@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("n", [2, 3])
def test_every_move_on_one_axis_is_counted_as_it_runs(n: int, shape: tuple) -> None:
    # gathers, all-to-alls (a shard moving to another dim), slices, reductions and
    # reduce-scatters, padded where the dim does not split evenly
    for src in [*PLACED, Partial()]:
        for dst in PLACED:
            if src != dst:
                _check(shape, (src,), (dst,), (n,))


_on_two_axes = st.tuples(
    st.sampled_from(SHAPES[:2]),
    st.one_of(
        st.tuples(st.sampled_from(PLACED), st.sampled_from(PLACED)),
        st.just((Replicate(), Partial())),
    ),
    st.tuples(st.sampled_from(PLACED), st.sampled_from(PLACED)),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_on_two_axes)
def test_moves_on_two_axes_are_counted_step_by_step_as_dtensor_takes_them(case) -> None:
    # DTensor moves a value axis by axis, inner axis first where shards are nested, slicing
    # before it gathers where that holds less; a partial value on the inner axis, whole on
    # the outer (a sum partial or sharded on both axes is not counted exactly yet)
    shape, src, dst = case
    if src != dst:
        _check(shape, src, dst, (2, 3))


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 3), (3, 2, 2)])
def test_dtensors_steps_for_a_move_depend_on_the_placements_not_the_sizes(mesh_shape) -> None:
    # the memory model keeps DTensor's steps per placements and mesh (`redistribute_steps`):
    # a torch whose planner picks other steps for other sizes must fail here
    from tessel._torch import _greedy_steps, _greedy_steps_for

    placements = [Replicate(), Partial(), Shard(0), Shard(1), Shard(2)]
    if len(mesh_shape) > 2:  # fewer per axis, so the pairs stay a few thousand
        placements = placements[:4]
    combos = list(itertools.product(placements, repeat=len(mesh_shape)))
    for src in combos:
        for dst in combos:
            kept = _greedy_steps(src, dst, mesh_shape, 3)
            for shape in SHAPES:
                got = _greedy_steps_for(torch.Size(shape), src, dst, mesh_shape)
                assert got == kept, (src, dst, shape)
