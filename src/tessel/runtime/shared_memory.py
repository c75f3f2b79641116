"""Collectives among CPU workers of one machine, through a segment of shared memory.

gloo moves every collective through TCP sockets, even between processes of one machine: an
all-reduce of a few kilobytes takes 1.5 ms between two workers on this project's 2-core CI
machines and 6 ms among four, which is most of a decode step's time. The workers of a group
that all run on one machine instead meet in a segment they all map: each round, every rank
writes its part into its own slot, says it has arrived (`shared_memory.cpp`), waits for the
others, and reads theirs; the same all-reduce takes about 50 us. torch has no such path for CPU
tensors (its symmetric memory is CUDA's), so this is tessel's own.

A group's segment holds a header line per rank and two sets of slots, one per rank each, used
in turn: a rank writes round k's set only after every rank has arrived at round k - 1, which
each did after reading round k - 2 from the same set, so no rank overwrites what another has
yet to read. Larger tensors go in several rounds of one slot each. Every rank reduces the same
values in rank order, so every rank's sum is the same, bit for bit.

A program issues a collective and waits on it later. Where it waits on each before it issues
the next (a decode step, most forward passes), its collectives run at the issue, in its own
thread: every rank reaches each collective when it would have waited on it anyway. A program
that issues several before waiting (a pipeline stage posts every receive when it starts) runs
each group's collectives on a thread of the group's own, in the order issued, as gloo runs them:
meeting at the issue there would deadlock ranks that issue collectives of several groups in
different orders. `rewrite` decides which, per program.

`join` sets up the segments of a package's groups at load (every rank calls it, in the same
order); `rewrite` points a program's collectives on those groups here, by group name, with the
signatures of torch's functional collectives. A group with members on other machines, or a
rank that cannot map the segment, keeps gloo.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import mmap
import operator
import os
import queue
import socket
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from tessel._torch import C10D_FUNCTIONAL, tree_map
from tessel.lower.program import ProgramError
from tessel.runtime import native

log = logging.getLogger(__name__)

_LINE = 64
SLOT_BYTES = 256 * 1024  # one rank's data per round: larger tensors take several rounds
# a waiter's busy polls, then its time yielding, before it sleeps: yielding hands the core to
# any peer waiting for it, and a yielding waiter, unlike a sleeping one, goes on at once when
# its peer arrives, without a wake-up through the scheduler
SPINS, YIELD_S = 1000, 2e-3
_SHM_DIR = Path("/dev/shm")


class CollectiveError(RuntimeError):
    """A peer of a shared-memory collective died or did not arrive in time."""


@functools.cache
def library() -> str | None:
    """The compiled meeting point, built on first use; None (with a warning, once) where it
    cannot be: not Linux, or no C++ compiler. Workers then meet through gloo alone."""
    if not _SHM_DIR.is_dir():
        return None
    return native.load(
        "shared_memory",
        "tessel_shm_meet",
        against_torch=False,
        log=log,
        without="CPU workers meet through gloo's sockets only, which is slower for small "
        "collectives",
    )


class SharedMemoryGroup:
    """This rank's view of one group's segment: its slots and the rounds it has met in."""

    def __init__(
        self,
        segment: mmap.mmap,
        ranks: Sequence[int],
        rank: int,
        meet: Callable[..., int],
        timeout_s: float,
        slot_bytes: int = SLOT_BYTES,
        crowded: bool = False,
    ) -> None:
        self.ranks = tuple(sorted(ranks))  # torch numbers a group's members in rank order
        self.size = len(self.ranks)
        self.me = self.ranks.index(rank)
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self._segment = segment  # kept mapped for as long as the views below live
        whole = torch.frombuffer(segment, dtype=torch.uint8)
        self._address = whole.data_ptr()
        header = header_bytes(self.size)
        self._sets = whole[header:].view(2, self.size, slot_bytes)
        self._meet = meet
        # a waiter polls, then yields, then sleeps until woken; where the machine's workers
        # outnumber its cores, the peer it waits for may be waiting for this core: it does not
        # poll, and yields at once
        self._patience = (0 if crowded else SPINS, YIELD_S)
        self._round = 0
        self._jobs: queue.SimpleQueue[_Pending] = queue.SimpleQueue()
        self._runner: threading.Thread | None = None
        self._issued = self._finished = 0

    def call(self, now: bool, collective: Callable[..., Any], *args: Any) -> Any:
        """`collective(*args)`: with `now`, run here and its result returned, where the group's
        thread has nothing in flight (else issued behind what it has); otherwise issued."""
        if now and self._issued == self._finished:
            return collective(*args)
        return self.issue(collective, *_snapshot(args))

    def issue(self, collective: Callable[..., Any], *args: Any) -> _Pending:
        """Run `collective(*args)` on the group's thread after every collective issued before
        it; its result is the returned handle's, at `wait_tensor`."""
        pending = _Pending(collective, args)
        if self._runner is None:
            self._runner = threading.Thread(
                target=self._run, name=f"tessel-shm-{self.ranks}", daemon=True
            )
            self._runner.start()
        self._issued += 1
        self._jobs.put(pending)
        return pending

    def _run(self) -> None:
        # each count is written by one thread only: issued by the program's, finished here
        while True:
            job = self._jobs.get()
            job.run()
            self._finished += 1
            job.signal()

    # rounds

    def _next(self) -> torch.Tensor:
        """The slots of the next round, `[ranks, slot bytes]`: write this rank's, then `_arrive`."""
        self._round += 1
        return self._sets[self._round % 2]

    def _arrive(self) -> None:
        late = self._meet(
            self._address, self.size, self.me, self._round & 0xFFFFFFFF, self.timeout_s,
            *self._patience,
        )  # fmt: skip
        if late == -1:
            return
        if late >= 0:
            raise CollectiveError(
                f"rank {self.ranks[late]} of group {list(self.ranks)} did not reach a "
                f"collective within {self.timeout_s:.0f} s"
            )
        raise CollectiveError(
            f"rank {self.ranks[-2 - late]} of group {list(self.ranks)} died during a collective"
        )

    def _rounds(self, nbytes: int) -> range:
        return range(0, nbytes, self.slot_bytes)

    # collectives, as torch's functional ones take them

    def all_reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        return self._reduce(x, op, 0, x.numel())

    def reduce_scatter(self, x: torch.Tensor, op: str) -> torch.Tensor:
        rows = x.shape[0] // self.size
        part = x.numel() // self.size
        out = self._reduce(x, op, self.me * part, part)
        return out.view((rows, *x.shape[1:]))

    def _reduce(self, x: torch.Tensor, op: str, first: int, count: int) -> torch.Tensor:
        """The reduction of every rank's `x`, elements [first, first + count) of it, flat;
        the whole of it (shaped as `x`) where that is all of `x`."""
        source = _bytes(x)
        out = torch.empty(count, dtype=x.dtype)
        width = x.element_size()
        step = self.slot_bytes - self.slot_bytes % width
        for start in range(0, source.numel(), step):
            end = min(start + step, source.numel())
            slots = self._next()
            slots[self.me, : end - start].copy_(source[start:end])
            self._arrive()
            lo, hi = max(start // width, first), min(end // width, first + count)
            if lo >= hi:
                continue
            values = [
                slots[r, lo * width - start : hi * width - start].view(x.dtype)
                for r in range(self.size)
            ]
            _reduce_into(out[lo - first : hi - first], values, op)
        return out.view(x.shape) if count == x.numel() else out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        source = _bytes(x)
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype)
        target = _bytes(out).view(self.size, source.numel())
        for start in self._rounds(source.numel()):
            end = min(start + self.slot_bytes, source.numel())
            slots = self._next()
            slots[self.me, : end - start].copy_(source[start:end])
            self._arrive()
            target[:, start:end].copy_(slots[:, : end - start])
        return out

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """`src` counts within the group, as torch's does."""
        out = x.clone(memory_format=torch.contiguous_format)
        target = _bytes(out)
        for start in self._rounds(target.numel()):
            end = min(start + self.slot_bytes, target.numel())
            slots = self._next()
            if self.me == src:
                slots[src, : end - start].copy_(target[start:end])
            self._arrive()
            if self.me != src:
                target[start:end].copy_(slots[src, : end - start])
        return out

    def all_to_all(
        self, x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int]
    ) -> torch.Tensor:
        """Rows `input_splits[q]` of `x` to rank q; rows `output_splits[p]` from rank p.

        A first round shares every rank's sizes, so all take the same number of rounds; then
        each round carries up to a share of a slot from every rank to every rank.
        """
        n = self.size
        row_shape = x.shape[1:]
        row_bytes = x[:1].numel() * x.element_size() if x.shape[0] else 0
        sends = list(input_splits) if input_splits else [x.shape[0] // n] * n
        receives = list(output_splits) if output_splits else [x.shape[0] // n] * n
        slots = self._next()
        slots[self.me, : 8 * n].view(torch.int64).copy_(torch.tensor(sends) * row_bytes)
        self._arrive()
        longest = int(slots[:, : 8 * n].view(torch.int64).max()) if n else 0
        share = (self.slot_bytes // n) // _LINE * _LINE
        source = _bytes(x)
        out = torch.empty((sum(receives), *row_shape), dtype=x.dtype)
        target = _bytes(out)
        sent = [sum(sends[:q]) * row_bytes for q in range(n)]
        landed = [sum(receives[:p]) * row_bytes for p in range(n)]
        for start in range(0, longest, share):
            slots = self._next()
            for q in range(n):
                piece = min(share, max(0, sends[q] * row_bytes - start))
                if piece:
                    at = sent[q] + start
                    slots[self.me, q * share : q * share + piece].copy_(source[at : at + piece])
            self._arrive()
            for p in range(n):
                piece = min(share, max(0, receives[p] * row_bytes - start))
                if piece:
                    at = landed[p] + start
                    target[at : at + piece].copy_(
                        slots[p, self.me * share : self.me * share + piece]
                    )
        return out


def header_bytes(ranks: int) -> int:
    """The segment's header: a line of its own and one per rank, to a page."""
    return -(-_LINE * (ranks + 1) // 4096) * 4096


def segment_bytes(ranks: int, slot_bytes: int) -> int:
    return header_bytes(ranks) + 2 * ranks * slot_bytes


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """`x`'s elements as flat bytes (copied first where they are not contiguous)."""
    return x.contiguous().view(-1).view(torch.uint8)


def _reduce_into(out: torch.Tensor, values: list[torch.Tensor], op: str) -> None:
    """`out` = the reduction of `values` in their order (every rank the same order)."""
    out.copy_(values[0])
    for value in values[1:]:
        if op in ("sum", "avg"):
            out.add_(value)
        elif op == "product":
            out.mul_(value)
        elif op == "min":
            torch.minimum(out, value, out=out)
        elif op == "max":
            torch.maximum(out, value, out=out)
        else:
            raise CollectiveError(f"reduce op {op!r} is not one of sum, avg, product, min, max")
    if op == "avg":
        if out.is_floating_point():
            out.div_(len(values))
        else:
            out.floor_divide_(len(values))


# The groups this process has joined, by torch's group name; the program's calls find them here.
_JOINED: dict[str, SharedMemoryGroup] = {}
_TRIED: set[tuple[int, ...]] = set()  # groups already set up (joined or left to gloo)


def join(
    groups: dict[tuple[int, ...], str],
    rank: int,
    path: str,
    timeout_s: float,
    slot_bytes: int = SLOT_BYTES,
    crowded: bool | None = None,
) -> set[str]:
    """Set up a segment for each of `groups` (rank lists to torch group names; "" where this
    rank is not a member) not set up before, whose members all run on this machine; returns the
    names of every group of this rank's now in shared memory. `crowded`: whether this machine's
    ranks outnumber the cores this process may run on (then a rank that waits yields at once);
    by default, counted.

    Every rank calls this with the same groups, in the same order: it meets the others over the
    world group (gloo) three times. The segments' files are removed once every member has
    mapped its own, so none outlives the workers.
    """
    new = sorted(set(groups) - _TRIED)
    if new:
        _join(new, groups, rank, path, timeout_s, slot_bytes, crowded)
        _TRIED.update(new)
    return {name for name in _JOINED if name}


def _join(
    new: list[tuple[int, ...]],
    names: dict[tuple[int, ...], str],
    rank: int,
    path: str,
    timeout_s: float,
    slot_bytes: int,
    crowded: bool | None,
) -> None:
    meet = ctypes.CDLL(path).tessel_shm_meet
    meet.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_uint32, ctypes.c_double,
        ctypes.c_int, ctypes.c_double,
    ]  # fmt: skip
    meet.restype = ctypes.c_int
    joined = ctypes.CDLL(path).tessel_shm_join
    joined.argtypes = [ctypes.c_void_p, ctypes.c_int]

    # which machine each rank is on, and a token of this load (rank 0's) to name segments by
    mine = torch.zeros(32, dtype=torch.uint8)
    mine[:16] = torch.frombuffer(bytearray(_machine()), dtype=torch.uint8)
    mine[16:] = torch.frombuffer(bytearray(os.urandom(16)), dtype=torch.uint8)
    everyone = torch.zeros(dist.get_world_size(), 32, dtype=torch.uint8)
    dist.all_gather(list(everyone.unbind(0)), mine)
    token = bytes(everyone[0, 16:].tolist()).hex()
    machine = [bytes(row[:16].tolist()) for row in everyone]

    def file(ranks: tuple[int, ...]) -> Path:
        key = hashlib.sha256(",".join(map(str, ranks)).encode()).hexdigest()[:16]
        return _SHM_DIR / f"tessel-{token}-{key}"

    local = [g for g in new if len({machine[r] for r in g}) == 1 and len(g) > 1]
    if crowded is None:
        crowded = machine.count(machine[rank]) > len(os.sched_getaffinity(0))
    created = torch.zeros(len(local), dtype=torch.int32)
    for i, ranks in enumerate(local):
        if ranks[0] == rank:
            created[i] = int(_create(file(ranks), segment_bytes(len(ranks), slot_bytes)))
    dist.all_reduce(created)
    segments: dict[tuple[int, ...], mmap.mmap] = {}
    mapped = torch.ones(len(local), dtype=torch.int32)
    for i, ranks in enumerate(local):
        if rank in ranks and created[i]:
            segment = _map(file(ranks), segment_bytes(len(ranks), slot_bytes))
            if segment is None:
                mapped[i] = 0
            else:
                segments[ranks] = segment
    dist.all_reduce(mapped, op=dist.ReduceOp.MIN)
    for i, ranks in enumerate(local):
        if ranks[0] == rank and created[i]:
            file(ranks).unlink(missing_ok=True)  # every member has mapped it, or given up
        segment = segments.pop(ranks, None)
        if segment is None:
            continue
        if not (created[i] and mapped[i]):
            segment.close()
            continue
        group = SharedMemoryGroup(segment, ranks, rank, meet, timeout_s, slot_bytes, crowded)
        joined(group._address, group.me)
        _JOINED[names[ranks]] = group
    dist.barrier()  # every member has recorded its process before any program meets


def _machine() -> bytes:
    """16 bytes that are the same for processes of one running kernel and one host name."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_bytes()
    except OSError:
        boot = b""
    return hashlib.sha256(boot + socket.gethostname().encode()).digest()[:16]


def _create(file: Path, size: int) -> bool:
    try:
        fd = os.open(file, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as exc:
        log.debug("cannot create %s: %s", file, exc)
        return False
    try:
        os.ftruncate(fd, size)
        return True
    except OSError as exc:
        log.debug("cannot size %s: %s", file, exc)
        file.unlink(missing_ok=True)
        return False
    finally:
        os.close(fd)


def _map(file: Path, size: int) -> mmap.mmap | None:
    try:
        fd = os.open(file, os.O_RDWR)
    except OSError as exc:
        log.debug("cannot open %s: %s", file, exc)
        return None
    try:
        if os.fstat(fd).st_size != size:
            return None
        return mmap.mmap(fd, size)
    except OSError as exc:
        log.debug("cannot map %s: %s", file, exc)
        return None
    finally:
        os.close(fd)


class _Pending:
    """A collective issued to a group's thread: its result once it has run."""

    __slots__ = ("_args", "_collective", "_done", "_error", "_value")

    def __init__(self, collective: Callable[..., Any], args: tuple) -> None:
        self._collective, self._args = collective, args
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._value = self._collective(*self._args)
        except BaseException as exc:  # noqa: BLE001 - raised where the program waits on it
            self._error = exc
        self._args = ()

    def signal(self) -> None:
        self._done.set()

    def result(self) -> Any:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


class _Item:
    """One tensor of a coalesced collective's list."""

    __slots__ = ("_index", "_pending")

    def __init__(self, pending: _Pending, index: int) -> None:
        self._pending, self._index = pending, index

    def result(self) -> torch.Tensor:
        return self._pending.result()[self._index]


def _snapshot(args: tuple) -> tuple:
    """`args`' tensors as they are when the collective is issued (the program may write them
    before it runs)."""
    return tree_map(
        lambda x: (
            x.clone(memory_format=torch.contiguous_format) if isinstance(x, torch.Tensor) else x
        ),
        args,
    )


def _each(collective: Callable[..., torch.Tensor]) -> Callable[..., list[torch.Tensor]]:
    def run(xs: list[torch.Tensor], *rest: Any) -> list[torch.Tensor]:
        return [collective(x, *rest) for x in xs]

    return run


def _items(result: Any, count: int) -> Any:
    """A coalesced collective's list: its tensors, or handles to each where it was issued."""
    if isinstance(result, _Pending):
        return [_Item(result, i) for i in range(count)]
    return result


# torch's functional collectives, by name, as a program calls them on a joined group. `rewrite`
# appends `now`: true in a program that waits on each collective before it issues the next,
# where the collective runs at once in the program's thread; otherwise each returns a handle
# that `wait_tensor` turns into its result


def all_reduce(x: torch.Tensor, op: str, group_name: str, now: bool = False) -> Any:
    group = _JOINED[group_name]
    return group.call(now, group.all_reduce, x, op)


def all_reduce_coalesced(
    xs: list[torch.Tensor], op: str, group_name: str, now: bool = False
) -> Any:
    group = _JOINED[group_name]
    return _items(group.call(now, _each(group.all_reduce), xs, op), len(xs))


def all_gather_into_tensor(
    x: torch.Tensor, group_size: int, group_name: str, now: bool = False
) -> Any:
    group = _JOINED[group_name]
    return group.call(now, group.all_gather, x)


def all_gather_into_tensor_coalesced(
    xs: list[torch.Tensor], group_size: int, group_name: str, now: bool = False
) -> Any:
    group = _JOINED[group_name]
    return _items(group.call(now, _each(group.all_gather), xs), len(xs))


def reduce_scatter_tensor(
    x: torch.Tensor, op: str, group_size: int, group_name: str, now: bool = False
) -> Any:
    group = _JOINED[group_name]
    return group.call(now, group.reduce_scatter, x, op)


def reduce_scatter_tensor_coalesced(
    xs: list[torch.Tensor], op: str, group_size: int, group_name: str, now: bool = False
) -> Any:
    group = _JOINED[group_name]
    return _items(group.call(now, _each(group.reduce_scatter), xs, op), len(xs))


def all_to_all_single(
    x: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    group_name: str,
    now: bool = False,
) -> Any:
    group = _JOINED[group_name]
    return group.call(now, group.all_to_all, x, output_split_sizes, input_split_sizes)


def broadcast(x: torch.Tensor, src: int, group_name: str, now: bool = False) -> Any:
    group = _JOINED[group_name]
    return group.call(now, group.broadcast, x, src)


def wait_tensor(x: Any) -> Any:
    """The result of an issued shared-memory collective, once it has run."""
    return x.result() if isinstance(x, (_Pending, _Item)) else x


_CALLS: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (
        all_reduce,
        all_reduce_coalesced,
        all_gather_into_tensor,
        all_gather_into_tensor_coalesced,
        reduce_scatter_tensor,
        reduce_scatter_tensor_coalesced,
        all_to_all_single,
        broadcast,
    )
}


def rewrite(program: fx.GraphModule, names: set[str]) -> int:
    """Point `program`'s collectives on the groups named in `names` (and their waits) at the
    shared-memory ones, in place; returns how many collectives it rewrote. Each call gets a
    last argument, `now`: whether the program waits on each collective (of any group) before it
    issues the next, so its collectives can run at the issue without the hand-off to their
    groups' threads (see the module's docstring)."""
    now = _waits_in_turn(program)
    moved: set[fx.Node] = set()
    for node in program.graph.nodes:
        name = _collective_name(node)
        if name in _CALLS and node.args[-1] in names:
            _check_waited(node)
            node.target = _CALLS[name]
            node.args = (*node.args, now)
            moved.add(node)
        elif name == "wait_tensor" and _source(node.args[0]) in moved:
            node.target = wait_tensor
    if moved:
        program.recompile()
        log.debug(
            "%d collectives in shared memory, run %s",
            len(moved),
            "at the issue" if now else "on their groups' threads",
        )
    return len(moved)


def _waits_in_turn(program: fx.GraphModule) -> bool:
    """Whether `program` waits on each collective it issues before it issues another."""
    waiting: fx.Node | None = None
    for node in program.graph.nodes:
        name = _collective_name(node)
        if name == "wait_tensor":
            if _source(node.args[0]) is waiting:
                waiting = None
        elif name:
            if waiting is not None:
                return False
            waiting = node
    return waiting is None


def _check_waited(node: fx.Node) -> None:
    """A collective's result (each item of a coalesced one's) is read only by its waits."""
    for user in node.users:
        readers = user.users if user.target is operator.getitem else {user: None}
        if not readers or any(_collective_name(r) != "wait_tensor" for r in readers):
            raise ProgramError(f"{node.name} is read before it is waited on")


def _collective_name(node: fx.Node) -> str:
    target = node.target
    if node.op != "call_function" or getattr(target, "namespace", None) != C10D_FUNCTIONAL:
        return ""
    return target._schema.name.split("::")[1]


def _source(node: Any) -> Any:
    """The collective a waited value comes from (through the item of a coalesced one's list)."""
    if isinstance(node, fx.Node) and node.op == "call_function" and node.args:
        if node.target.__name__ == "getitem":
            return node.args[0]
    return node
