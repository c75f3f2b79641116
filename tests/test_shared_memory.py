"""Same-machine groups of CPU workers meet in shared memory: every collective a program calls
gives what torch's gives (every rank the same bits), in as many rounds as its size needs; a
group that spans machines keeps gloo; a dead peer is an error, not a hang; no segment's file
outlives the load."""

from __future__ import annotations

import operator
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tests.conftest import start_ranks
from torch import fx

from tessel._torch import C10D_FUNCTIONAL
from tessel.runtime import shared_memory

pytestmark = pytest.mark.skipif(
    shared_memory.library() is None, reason="no shared-memory collectives here (no compiler)"
)

_COLLECTIVE = getattr(torch.ops, C10D_FUNCTIONAL)
_WORLD = 3  # odd: no rank's rows sit at the middle by accident
_PAIR = (0, 2)
_SLOT = 256  # bytes: every tensor below takes several rounds


def _value(rank: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)


_SPLITS = [[3, 0, 5], [1, 4, 0], [0, 2, 7]]  # rows rank p sends to rank q: _SPLITS[p][q]


def _cases(rank: int, world: str, pair: str, now: bool = False) -> dict[str, object]:
    """Every collective on this rank, as a program calls it: issued, then waited on; with
    `now`, as a program that waits on each before the next calls it (run at the issue)."""
    out = _issued(rank, world, pair, now)
    wait = shared_memory.wait_tensor
    return {k: [wait(x) for x in v] if isinstance(v, list) else wait(v) for k, v in out.items()}


def _issued(rank: int, world: str, pair: str, now: bool = False) -> dict[str, object]:
    out: dict[str, object] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        x = _value(rank, (37, 5), dtype, 1)
        for op in ("sum", "avg", "product", "min", "max"):
            if op == "avg" and not dtype.is_floating_point:
                continue
            out[f"all_reduce {op} {dtype}"] = shared_memory.all_reduce(x, op, world, now)
        out[f"reduce_scatter {dtype}"] = shared_memory.reduce_scatter_tensor(
            _value(rank, (3 * 13, 3), dtype, 2), "sum", _WORLD, world, now
        )
    out["all_gather bool"] = shared_memory.all_gather_into_tensor(
        _value(rank, (11, 9), torch.bool, 3), _WORLD, world, now
    )
    out["all_gather coalesced"] = shared_memory.all_gather_into_tensor_coalesced(
        [_value(rank, (2, 100), torch.float32, 4), _value(rank, (1,), torch.int64, 5)],
        _WORLD,
        world,
        now,
    )
    out["broadcast"] = shared_memory.broadcast(
        _value(rank, (70, 3), torch.float32, 6), 1, world, now
    )
    sends = _SPLITS[rank]
    receives = [_SPLITS[p][rank] for p in range(_WORLD)]
    out["all_to_all"] = shared_memory.all_to_all_single(
        _value(rank, (sum(sends), 17), torch.float32, 7), receives, sends, world, now
    )
    out["all_to_all empty"] = shared_memory.all_to_all_single(
        torch.empty(0, 4), [0] * _WORLD, [0] * _WORLD, world, now
    )
    if rank in _PAIR:  # a second group, its rounds its own
        out["pair all_reduce"] = shared_memory.all_reduce(
            _value(rank, (130,), torch.float32, 8), "sum", pair, now
        )
    return out


def _expected(rank: int) -> dict[str, object]:
    """What torch's collectives give rank `rank`, from every rank's inputs."""
    out: dict[str, object] = {}
    reduce = {
        "sum": lambda vs: vs[0] + vs[1] + vs[2],
        "avg": lambda vs: (vs[0] + vs[1] + vs[2]) / 3,
        "product": lambda vs: vs[0] * vs[1] * vs[2],
        "min": lambda vs: torch.minimum(torch.minimum(vs[0], vs[1]), vs[2]),
        "max": lambda vs: torch.maximum(torch.maximum(vs[0], vs[1]), vs[2]),
    }
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        xs = [_value(r, (37, 5), dtype, 1) for r in range(_WORLD)]
        for op, f in reduce.items():
            if op == "avg" and not dtype.is_floating_point:
                continue
            out[f"all_reduce {op} {dtype}"] = f(xs)
        whole = reduce["sum"]([_value(r, (3 * 13, 3), dtype, 2) for r in range(_WORLD)])
        out[f"reduce_scatter {dtype}"] = whole[13 * rank : 13 * rank + 13]
    out["all_gather bool"] = torch.cat([_value(r, (11, 9), torch.bool, 3) for r in range(_WORLD)])
    out["all_gather coalesced"] = [
        torch.cat([_value(r, (2, 100), torch.float32, 4) for r in range(_WORLD)]),
        torch.cat([_value(r, (1,), torch.int64, 5) for r in range(_WORLD)]),
    ]
    out["broadcast"] = _value(1, (70, 3), torch.float32, 6)
    pieces = []
    for p in range(_WORLD):
        x = _value(p, (sum(_SPLITS[p]), 17), torch.float32, 7)
        pieces.append(x.split(_SPLITS[p])[rank])
    out["all_to_all"] = torch.cat(pieces)
    out["all_to_all empty"] = torch.empty(0, 4)
    if rank in _PAIR:
        out["pair all_reduce"] = sum(_value(r, (130,), torch.float32, 8) for r in _PAIR)
    return out


def _program(group: str) -> fx.GraphModule:
    """A lowered program's shape: collectives, work between, then their waits."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    summed = graph.call_function(_COLLECTIVE.all_reduce.default, (x, "sum", group))
    gathered = graph.call_function(
        _COLLECTIVE.all_gather_into_tensor_coalesced.default, ([x, x], _WORLD, group)
    )
    first = graph.call_function(operator.getitem, (gathered, 0))
    later = graph.call_function(torch.ops.aten.mul.Tensor, (x, 3.0))
    total = graph.call_function(_COLLECTIVE.wait_tensor.default, (summed,))
    whole = graph.call_function(_COLLECTIVE.wait_tensor.default, (first,))
    graph.output((total, whole, later))
    return fx.GraphModule(torch.nn.Module(), graph)


def _program_in_turn(group: str) -> fx.GraphModule:
    """A program that waits on each collective before it issues the next."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    summed = graph.call_function(_COLLECTIVE.all_reduce.default, (x, "sum", group))
    later = graph.call_function(torch.ops.aten.mul.Tensor, (x, 3.0))
    total = graph.call_function(_COLLECTIVE.wait_tensor.default, (summed,))
    gathered = graph.call_function(
        _COLLECTIVE.all_gather_into_tensor_coalesced.default, ([total, x], _WORLD, group)
    )
    first = graph.call_function(operator.getitem, (gathered, 1))
    whole = graph.call_function(_COLLECTIVE.wait_tensor.default, (first,))
    graph.output((total, whole, later))
    return fx.GraphModule(torch.nn.Module(), graph)


def _group_threads() -> int:
    return sum(t.name.startswith("tessel-shm") for t in threading.enumerate())


def _start(rank: int, store: str) -> tuple[str, str]:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=_WORLD)
    pair = dist.new_group(list(_PAIR))
    world = dist.group.WORLD.group_name
    return world, pair.group_name if rank in _PAIR else ""


def _rank(rank: int, store: str, results: dict) -> None:
    world, pair = _start(rank, store)
    try:
        # rank 1 waits as on a machine with fewer cores than ranks: it sleeps at once
        joined = shared_memory.join(
            {(0, 1, 2): world, _PAIR: pair}, rank, shared_memory.library(), 60.0, _SLOT,
            crowded=rank == 1,
        )  # fmt: skip
        patience = {g._patience for g in shared_memory._JOINED.values()}
        maps = [line for line in open("/proc/self/maps") if "/dev/shm/tessel-" in line]
        x = _value(rank, (9, 4), torch.float32, 9)
        # first at the issue, in this thread: no group starts a thread of its own
        in_turn = _program_in_turn(world)
        assert shared_memory.rewrite(in_turn, joined) == 2
        ran_in_turn = [t.tolist() for t in in_turn(x)]
        at_issue = {k: _plain(v) for k, v in _cases(rank, world, pair, now=True).items()}
        threads_at_issue = _group_threads()
        program = _program(world)
        assert shared_memory.rewrite(program, joined) == 2
        results[rank] = (
            joined,
            maps,
            {str(n.target) for n in program.graph.nodes if n.op == "call_function"},
            [t.tolist() for t in program(x)],
            {k: _plain(v) for k, v in _cases(rank, world, pair).items()},
            (ran_in_turn, at_issue, threads_at_issue, _group_threads()),
            patience,
        )
    finally:
        dist.destroy_process_group()


def _plain(value: object) -> object:
    if isinstance(value, list):
        return [_plain(v) for v in value]
    assert isinstance(value, torch.Tensor)
    return (value.dtype, tuple(value.shape), value.float().tolist())


def _spawn(target, tmp_path, *extra) -> dict:
    results = mp.Manager().dict()
    start_ranks(target, (os.fspath(tmp_path / "store"), results, *extra), _WORLD)
    return dict(results)


def test_every_collective_gives_what_torch_s_gives_on_every_rank(tmp_path):
    results = _spawn(_rank, tmp_path)
    for rank in range(_WORLD):
        joined, maps, targets, got, cases, (in_turn, at_issue, before, after), patience = results[
            rank
        ]
        assert len(joined) == (2 if rank in _PAIR else 1)
        waits = (0 if rank == 1 else shared_memory.SPINS, shared_memory.YIELD_S)
        assert patience == {waits}
        # mapped, and the files already removed: nothing is left in /dev/shm after the load
        assert len(maps) == len(joined) and all(m.rstrip().endswith("(deleted)") for m in maps)
        assert not any(C10D_FUNCTIONAL in t for t in targets), targets
        x = [_value(r, (9, 4), torch.float32, 9) for r in range(_WORLD)]
        assert got == [(x[0] + x[1] + x[2]).tolist(), torch.cat(x).tolist(), (x[rank] * 3).tolist()]
        # the program that waits in turn ran its collectives at the issue, with no threads;
        # the one that issues two before waiting, and the cases issued, started their groups'
        assert in_turn == [got[0], got[1], got[2]]
        assert at_issue == cases
        assert (before, after) == (0, len(joined))
        expected = {k: _plain(v) for k, v in _expected(rank).items()}
        assert cases.keys() == expected.keys()
        for name, value in expected.items():
            if "bfloat16" in name and "all_reduce" in name:  # bf16 sums round per add
                dtype, shape, values = cases[name]
                assert (dtype, shape) == value[:2], name
                torch.testing.assert_close(
                    torch.tensor(values), torch.tensor(value[2]), rtol=0.02, atol=0.1
                )
            else:
                assert cases[name] == value, name
    for name in results[0][4]:  # every rank reduces in rank order: the same bits everywhere
        if name.startswith("all_reduce"):
            assert results[0][4][name] == results[1][4][name] == results[2][4][name], name


def _rank_issuing_in_its_own_order(rank: int, store: str, results: dict) -> None:
    """Ranks 0 and 2 issue a collective of each group before waiting on either, each in its
    own order (as a pipeline stage posts its receives first): the groups' collectives run on
    their own threads, as gloo's do, so neither waits for the other."""
    world, pair = _start(rank, store)
    try:
        # the pair listed sender first, as a pipeline's channels are: torch numbers its
        # members in rank order all the same, so its source 1 is rank 2
        shared_memory.join(
            {(0, 1, 2): world, _PAIR[::-1]: pair}, rank, shared_memory.library(), 60.0
        )
        x = torch.full((5,), float(rank + 1))
        if rank == 0:
            first = shared_memory.all_reduce(x, "sum", world)
            second = shared_memory.broadcast(x, 1, pair)
        elif rank == 2:
            second = shared_memory.broadcast(x, 1, pair)
            first = shared_memory.all_reduce(x, "sum", world)
        else:
            first = second = shared_memory.all_reduce(x, "sum", world)
        x.fill_(-1.0)  # written after the issue: the collectives saw it as it was
        wait = shared_memory.wait_tensor
        results[rank] = (wait(first).tolist(), wait(second).tolist())
    finally:
        dist.destroy_process_group()


def test_collectives_of_several_groups_issued_in_different_orders_all_complete(tmp_path):
    results = _spawn(_rank_issuing_in_its_own_order, tmp_path)
    assert results == {r: ([6.0] * 5, [6.0 if r == 1 else 3.0] * 5) for r in range(_WORLD)}


def _rank_on_two_machines(rank: int, store: str, results: dict) -> None:
    world, pair = _start(rank, store)
    try:
        if rank == 1:  # rank 1 says it runs elsewhere: only the pair (0, 2) is on one machine
            shared_memory._machine = lambda: b"elsewhere".ljust(16, b".")
        joined = shared_memory.join(
            {(0, 1, 2): world, _PAIR: pair}, rank, shared_memory.library(), 60.0, _SLOT
        )
        program = _program(world)
        results[rank] = (
            joined == ({pair} if pair else set()),
            shared_memory.rewrite(program, joined),
        )
    finally:
        dist.destroy_process_group()


def test_a_group_that_spans_machines_keeps_gloo(tmp_path):
    results = _spawn(_rank_on_two_machines, tmp_path)
    assert results == {r: (True, 0) for r in range(_WORLD)}


def _rank_with_a_peer_that_dies(rank: int, store: str, results: dict) -> None:
    world, pair = _start(rank, store)
    joined = shared_memory.join({(0, 1, 2): world}, rank, shared_memory.library(), 600.0, _SLOT)
    assert joined == {world}
    if rank == 1:
        os._exit(0)  # gone before the collective; its parent has not reaped it yet
    start = time.monotonic()
    try:
        shared_memory.wait_tensor(shared_memory.all_reduce(torch.ones(4), "sum", world))
        results[rank] = "no error"
    except shared_memory.CollectiveError as exc:
        results[rank] = (str(exc), time.monotonic() - start < 60)


def test_a_dead_peer_is_an_error_not_a_hang(tmp_path):
    results = _spawn(_rank_with_a_peer_that_dies, tmp_path)
    message = "rank 1 of group [0, 1, 2] died during a collective"
    assert results == {0: (message, True), 2: (message, True)}
