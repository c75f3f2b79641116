"""The local executor: one forked worker process per node instance, shared-memory channels.

The parent builds every channel (transport.Channel) before forking, so workers inherit the shared
pages and pipes. Transactions go to consumer instance `(tid - 1) % n` (round-robin by transaction
id), or to the least-loaded one (most free slots) after a balance-scatter node (or everywhere,
with the deploy file's `dynamic_schedule_enable`), for consumers with one input (routing.py). A
collector thread in the parent reads the graph outputs, failure reports and worker exits; a dead
worker's held transactions are read from its channels' slot headers and reported failed, and the
graph keeps serving the rest.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tessel.dataflow.errors import FlowTimeout, TransactionFailed
from tessel.dataflow.executors.book import ResultBook
from tessel.dataflow.executors.routing import pick
from tessel.dataflow.placement import GraphPlacement, Instance
from tessel.dataflow.spec import GraphSpec, NodeSpec
from tessel.dataflow.transport import Channel
from tessel.forked import die_with_parent

SLOT_BYTES_OPTION = "tessel.dataflow.slot_bytes"
PIN_OPTION = "tessel.dataflow.pin_cpu_devices"  # "1": a CPU device's workers run on one core
DEFAULT_SLOT_BYTES = 4 << 20
START_TIMEOUT_S = 300.0
SINK = "<fetch>"
_ABORTED_KEEP = 100_000  # failed transaction ids a worker remembers, to drop their late inputs


@dataclass
class Route:
    """Where one output goes: a consumer node's input, one channel per consumer instance."""

    consumer: str  # the consumer's deploy name (alias, else name): what failures report
    input_index: int
    channels: list[Channel]
    gids: list[int]  # global worker ids of the consumer instances (-1: the parent)
    scatter: bool = False
    single_input: bool = True


@dataclass
class Worker:
    gid: int
    node: NodeSpec
    index: int
    count: int
    inst: Instance
    invoked: dict[str, Any]
    inputs: list[Channel] = field(default_factory=list)
    routes: list[list[Route]] = field(default_factory=list)  # per output index
    control: Any = None  # (reader, writer)
    report: Any = None  # (reader, writer)
    process: Any = None


class Undeliverable(Exception):
    """A value could not reach its consumer: why, and the consumer instance (-1: none chosen)."""

    def __init__(self, why: str, instance: int = -1) -> None:
        super().__init__(why)
        self.instance = instance


class Sender:
    """Routes a value to a consumer instance and writes it to that channel.

    Sending is two steps, shared by workers and by the parent's `submit`: `reserve` picks the
    instance and takes a free slot of its channel, `deliver` writes the value there and, when the
    consumer died meanwhile, takes the slot back and says so (nothing is silently lost).
    """

    def __init__(self, alive: Any, stopping: Any) -> None:
        self.alive = alive
        self.stopping = stopping

    def _live(self, gid: int) -> bool:
        return gid < 0 or (self.alive[gid] == 1 and not self.stopping.value)

    def choose(self, route: Route, tid: int) -> int | None:
        """The consumer instance for `tid` (see routing.py); None when none is alive."""
        return pick(
            len(route.channels),
            tid,
            lambda i: self._live(route.gids[i]),
            route.single_input,
            route.scatter,
            lambda i: -route.channels[i].free.get_value(),  # fewer free slots: more loaded
        )

    def reserve(self, route: Route, tid: int, deadline: float | None) -> int | None:
        """Take a slot for `tid`: the instance index, None on timeout, Undeliverable when no
        live instance can take it."""
        idx = self.choose(route, tid)
        if idx is None:
            raise Undeliverable(f"no live instance of node {route.consumer!r} to take it")
        gid = route.gids[idx]
        if route.channels[idx].acquire(deadline, alive=lambda: self._live(gid)):
            return idx
        if self._live(gid):
            return None
        raise Undeliverable(f"node {route.consumer!r} instance {idx} stopped before taking it", idx)

    def deliver(self, route: Route, idx: int, tid: int, value: Any, info: tuple) -> None:
        """Write `value` into the slot `reserve` took; Undeliverable if the consumer died
        between the reserve and the write (its slot is taken back, so the reclaim of the dead
        consumer's slots and this check cannot both miss the transaction)."""
        ch, gid = route.channels[idx], route.gids[idx]
        slot = ch.put(tid, route.input_index, value, info)
        if not self._live(gid) and ch.unsend(slot):
            raise Undeliverable(
                f"node {route.consumer!r} instance {idx} died before taking it", idx
            )

    def send(self, route: Route, tid: int, value: Any, info: tuple) -> str | None:
        """Blocking send; returns None on success, else why it could not be delivered."""
        try:
            idx = self.reserve(route, tid, None)
            assert idx is not None  # no deadline: reserve waits or raises
            self.deliver(route, idx, tid, value, info)
        except Undeliverable as exc:
            return str(exc)
        return None


def _set_parent_death_signal() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # PDEATHSIG follows the forking thread; the getppid() check covers this case
    die_with_parent()


def _pin_to_device(inst: Instance) -> None:
    """A CPU logical device is one core of this host: device_id modulo the cores we may use."""
    cores = sorted(os.sched_getaffinity(0))
    phys = int(inst.torch_device.split(":")[1]) if ":" in inst.torch_device else inst.device.device
    os.sched_setaffinity(0, {cores[phys % len(cores)]})


def _worker_main(w: Worker, alive: Any, stopping: Any, parent: int, pin: bool = False) -> None:
    """Body of a worker process: build the node, then serve transactions until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _set_parent_death_signal()
    if pin and w.inst.kind == "cpu" and not w.inst.device.is_host:
        _pin_to_device(w.inst)
    import torch

    torch.set_num_threads(1)
    report = w.report[1]
    from tessel.dataflow.node_runtime import NodeRuntime

    try:
        rt = NodeRuntime(w.node, w.index, w.count, w.inst, w.invoked)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        report.send(("init_failed", w.gid, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    report.send(("ready", w.gid))
    sender = Sender(alive, stopping)
    copy = w.node.kind != "model"  # UDFs may keep their inputs; models get views of the slots
    by_reader = {ch.reader: ch for ch in w.inputs}
    control = w.control[0]
    readers = [*by_reader, control]
    pending: dict[int, list] = {}  # tid -> [values, held (channel, slot) pairs, count, info]
    aborted: set[int] = set()
    aborted_order: deque[int] = deque()
    name = w.node.deploy_name

    def fail(tid: int, err: str, tb: str = "") -> None:
        report.send(("fail", tid, name, w.index, err, tb))

    while True:
        ready = mpc.wait(readers, timeout=1.0)
        if not ready:
            if os.getppid() != parent:
                return
            continue
        for r in ready:
            if r is control:
                msg = r.recv()
                if msg[0] == "stop":
                    return
                if msg[0] == "abort":
                    entry = pending.pop(msg[1], None)
                    for ch, slot in entry[1] if entry else ():
                        ch.release(slot)
                    aborted.add(msg[1])
                    aborted_order.append(msg[1])
                    if len(aborted_order) > _ABORTED_KEEP:
                        aborted.discard(aborted_order.popleft())
                continue
            ch = by_reader[r]
            tid, dst, slot, meta, info = r.recv()
            if tid in aborted:  # the transaction failed elsewhere: drop its late inputs
                ch.release(slot)
                continue
            entry = pending.get(tid)
            if entry is None:
                entry = pending[tid] = [[None] * w.node.n_in, [], 0, info]
            entry[0][dst] = ch.read(slot, meta, copy)
            entry[1].append((ch, slot))
            entry[2] += 1
            if entry[2] < w.node.n_in:
                continue
            del pending[tid]
            try:
                outs = rt.process(entry[0])
            except BaseException as exc:  # noqa: BLE001 - the transaction fails, the worker lives
                fail(tid, f"{type(exc).__name__}: {exc}", traceback.format_exc())
            else:
                for o, routes in enumerate(w.routes):
                    for route in routes:
                        why = sender.send(route, tid, outs[o], entry[3])
                        if why is not None:
                            fail(tid, why)
            entry[0] = None
            for c, s in entry[1]:
                c.release(s)


def _release(plan: list[tuple[Route, int, Any]]) -> None:
    """Give back the slots reserved for values that will not be sent."""
    for route, idx, _ in plan:
        route.channels[idx].free.release()


class LocalExecutor:
    """Runs a placed graph on this host: workers, channels, collector."""

    def __init__(self, spec: GraphSpec, placement: GraphPlacement, options: dict[str, str]) -> None:
        self.spec = spec
        self.placement = placement
        self.slot_bytes = int(options.get(SLOT_BYTES_OPTION, DEFAULT_SLOT_BYTES))
        self.pin = options.get(PIN_OPTION, "0").lower() in ("1", "true")
        self.book = ResultBook(len(spec.outputs))
        self.ctx = mp.get_context("fork")
        self.workers: list[Worker] = []
        self.input_routes: list[list[Route]] = []
        self.sinks: dict[Any, tuple[Channel, int]] = {}
        self.closed = False
        self._closing = False
        self._collector: threading.Thread | None = None
        self._failed_start: str | None = None

    # ---- wiring ------------------------------------------------------------------------
    def _wire(self) -> None:
        ctx = self.ctx
        by_node: dict[str, list[Worker]] = {}
        for n in self.spec.nodes:
            np_ = self.placement.nodes[n.name]
            count = len(np_.instances)
            for i, inst in enumerate(np_.instances):
                w = Worker(len(self.workers), n, i, count, inst, np_.invoked)
                w.control = ctx.Pipe(duplex=False)
                w.report = ctx.Pipe(duplex=False)
                w.routes = [[] for _ in range(n.n_out)]
                self.workers.append(w)
                by_node.setdefault(n.name, []).append(w)

        def routes_to(src: tuple, producer: str) -> list[Route]:
            out = []
            for cname, idx in self.spec.consumers(src):
                consumer = self.spec.node(cname)
                ws = by_node[cname]
                chans = []
                for cw in ws:
                    ch = Channel(
                        ctx, consumer.depth, self.slot_bytes, f"{producer}->{cname}[{cw.index}]"
                    )
                    cw.inputs.append(ch)
                    chans.append(ch)
                scatter = self.placement.dynamic_schedule
                if src[0] == "node":
                    scatter = scatter or self.spec.node(src[1]).scatter
                out.append(
                    Route(
                        consumer.deploy_name,
                        idx,
                        chans,
                        [cw.gid for cw in ws],
                        scatter,
                        consumer.n_in == 1,
                    )
                )
            return out

        self.input_routes = [routes_to(("data", k), "<feed>") for k in range(len(self.spec.datas))]
        for w in self.workers:
            for o in range(w.node.n_out):
                w.routes[o] = routes_to(("node", w.node.name, o), f"{w.node.name}[{w.index}]")
        for j, (name, o) in enumerate(self.spec.outputs):
            for w in by_node[name]:
                ch = Channel(
                    ctx, max(w.node.depth, 2), self.slot_bytes, f"{name}[{w.index}]->fetch"
                )
                w.routes[o].append(Route(SINK, j, [ch], [-1]))
                self.sinks[ch.reader] = (ch, j)
        self.alive = ctx.Array("b", [1] * len(self.workers), lock=False)
        self.stopping = ctx.Value("b", 0, lock=False)
        self.sender = Sender(self.alive, self.stopping)

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        import torch

        # is_initialized, not is_available: asking for the device count poisons later forks
        if torch.cuda.is_initialized():
            kinds = {i.kind for n in self.placement.nodes.values() for i in n.instances}
            if "cuda" in kinds:
                raise RuntimeError(
                    "tessel.dataflow forks its workers; CUDA is already initialised in this "
                    "process, so forked CUDA workers would fail. Feed the graph before touching "
                    "CUDA in this process, and build offline models in another one (`tessel "
                    "build`): on a machine with a GPU, torch.export initialises CUDA."
                )
        self._wire()
        from tessel.dataflow import session

        session.register_executor(self)
        parent = os.getpid()
        for w in self.workers:
            p = self.ctx.Process(
                target=_worker_main,
                args=(w, self.alive, self.stopping, parent, self.pin),
                name=f"tessel-df-{w.node.deploy_name}-{w.index}",
                daemon=True,
            )
            p.start()
            w.process = p
        self._await_ready()
        self._collector = threading.Thread(
            target=self._collect, name="tessel-df-collect", daemon=True
        )
        self._collector.start()

    def _await_ready(self) -> None:
        waiting = {w.report[0]: w for w in self.workers}
        deadline = time.monotonic() + START_TIMEOUT_S
        while waiting:
            ready = mpc.wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.close()
                raise RuntimeError(
                    f"workers did not start within {START_TIMEOUT_S:.0f} s: "
                    f"{sorted({w.node.deploy_name for w in waiting.values()})}"
                )
            for r in ready:
                w = waiting.pop(r)
                try:
                    msg = r.recv()
                except EOFError:
                    msg = ("init_failed", w.gid, "worker exited during start", "")
                if msg[0] == "init_failed":
                    self.close()
                    raise RuntimeError(
                        f"node {w.node.deploy_name!r} instance {w.index} on {w.inst.device} failed "
                        f"to start: {msg[2]}\n{msg[3]}"
                    )

    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self.workers if w.process is not None]

    def close(self) -> None:
        """Stop every worker; kill those that do not stop within 2 s."""
        if self.closed:
            return
        self.closed = True
        self._closing = True
        if hasattr(self, "stopping"):
            self.stopping.value = 1
        for w in self.workers:
            if w.process is not None and w.process.is_alive():
                try:
                    w.control[1].send(("stop",))
                except OSError:
                    pass
        deadline = time.monotonic() + 2.0
        for w in self.workers:
            if w.process is not None:
                w.process.join(max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            if w.process is not None and w.process.is_alive():
                w.process.kill()
                w.process.join(2.0)
        if self._collector is not None and self._collector is not threading.current_thread():
            self._collector.join(2.0)
        for tid in self.book.outstanding():
            self.book.fail(TransactionFailed(tid, "<graph>", -1, "the graph was finalized"))

    # ---- feed / fetch ------------------------------------------------------------------
    def submit(self, tid: int, values: list[Any], info: tuple, timeout_s: float | None) -> None:
        """Send one transaction's inputs: a slot for every input first (FlowTimeout, nothing
        sent, if one has no room in time), then the writes. A consumer found dead on the way
        fails the transaction with its node's name, as a worker's send does."""
        if self.closed:
            raise RuntimeError("the graph is finalized")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        plan: list[tuple[Route, int, Any]] = []
        try:
            for k, routes in enumerate(self.input_routes):
                for route in routes:
                    idx = self.sender.reserve(route, tid, deadline)
                    if idx is None:
                        raise FlowTimeout(
                            f"feed: node {route.consumer!r} did not take transaction {tid} "
                            f"within {(timeout_s or 0) * 1000:.0f} ms"
                        )
                    plan.append((route, idx, values[k]))
        except Undeliverable as exc:
            _release(plan)
            self.book.expect(tid)
            self.book.fail(TransactionFailed(tid, route.consumer, exc.instance, str(exc)))
            return
        except BaseException:
            _release(plan)
            raise
        self.book.expect(tid)
        for done, (route, idx, value) in enumerate(plan):
            try:
                self.sender.deliver(route, idx, tid, value, info)
            except Undeliverable as exc:
                _release(plan[done + 1 :])
                self._fail(TransactionFailed(tid, route.consumer, idx, str(exc)))
                return

    def result(self, tid: int, timeout_s: float | None) -> Any:
        return self.book.take(tid, timeout_s)

    # ---- collector ---------------------------------------------------------------------
    def _collect(self) -> None:
        reports = {w.report[0]: w for w in self.workers}
        sentinels = {w.process.sentinel: w for w in self.workers}
        while not self._closing:
            watch = [*self.sinks, *reports, *sentinels]
            try:
                ready = mpc.wait(watch, timeout=0.5)
            except OSError:
                return
            if self._closing:
                return
            for r in ready:
                if r in self.sinks:
                    ch, j = self.sinks[r]
                    try:
                        tid, _, slot, meta, info = r.recv()
                    except (EOFError, OSError):
                        continue
                    value = ch.read(slot, meta, copy=True)
                    ch.release(slot)
                    self.book.add_output(tid, j, value, info)
                elif r in reports:
                    try:
                        msg = r.recv()
                    except (EOFError, OSError):
                        del reports[r]
                        continue
                    if msg[0] == "fail":
                        _, tid, node, inst, err, tb = msg
                        self._fail(TransactionFailed(tid, node, inst, err, tb))
                elif r in sentinels:
                    w = sentinels.pop(r)
                    if not self._closing:
                        self._worker_died(w)

    def _fail(self, exc: TransactionFailed) -> None:
        if self.book.fail(exc) and self.spec.has_joins:
            for w in self.workers:  # drop half-joined inputs of this transaction everywhere
                if self.alive[w.gid]:
                    try:
                        w.control[1].send(("abort", exc.transaction_id))
                    except OSError:
                        pass

    def _worker_died(self, w: Worker) -> None:
        self.alive[w.gid] = 0
        w.process.join(1.0)  # reap it, so the exit code is known
        code = w.process.exitcode
        err = f"worker process died (exit code {code})"
        for ch in w.inputs:
            for tid in ch.reclaim():
                self._fail(TransactionFailed(tid, w.node.deploy_name, w.index, err))
            while ch.reader.poll():  # headers it never read: their slots are free already
                try:
                    ch.reader.recv()
                except (EOFError, OSError):
                    break
