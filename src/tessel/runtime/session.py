"""initialize / Session / load_graph / run_graph / finalize, as GE names them, for tessel models."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from tessel.config.cluster import cluster_from_dict
from tessel.config.errors import ConfigError
from tessel.errors import TesselError
from tessel.package.format import Package
from tessel.runtime.worker import WorkerSpec, worker_main

log = logging.getLogger(__name__)

_state: dict[str, Any] = {"initialized": False, "config": {}}
_sessions: weakref.WeakSet = weakref.WeakSet()


class WorkerError(TesselError, RuntimeError):
    """A worker failed, died or stopped answering."""


def initialize(config: dict[str, str] | None = None) -> None:
    """Start tessel's runtime (GEInitialize). Safe to call again."""
    _state["initialized"] = True
    _state["config"] = dict(config or {})


def finalize() -> None:
    """Stop every session's workers and release the runtime (GEFinalize)."""
    for session in list(_sessions):
        session.close()
    _state["initialized"] = False


atexit.register(finalize)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _option(options: dict, key: str, kind: type, default: Any) -> Any:
    value = options.get(key, default)
    try:
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError("options", key, f"expected {kind.__name__}, found {value!r}") from exc


@dataclass
class _Graph:
    package: Package
    procs: list[Any]
    conns: list[Connection]
    ranks: list[int]
    distributed: bool
    run_timeout: float
    next_replica: int = 0
    inputs: list[dict] = field(default_factory=list)


class Session:
    """Loads offline models onto the cluster's devices and runs them."""

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        if not _state["initialized"]:
            raise RuntimeError("call tessel.initialize() before creating a Session")
        self.options = dict(options or {})
        self._graphs: dict[int, _Graph] = {}
        _sessions.add(self)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def load_graph(self, graph_id: int, options: dict[str, Any] | None, path: str | Path) -> None:
        """Start one worker per device of this node, join the process groups, load every rank."""
        if graph_id in self._graphs:
            raise ConfigError(
                "graph_id", None, f"graph {graph_id} is already loaded in this session"
            )
        options = {**self.options, **(options or {})}
        package = Package.open(path)
        manifest = package.manifest
        cluster = cluster_from_dict(
            manifest["cluster"], f"{path} (cluster)", manifest["soc_version"]
        )
        node_id = _option(options, "tessel.node_id", int, cluster.head.node_id)
        load_timeout = _option(options, "tessel.load_timeout_s", float, 300.0)
        run_timeout = _option(options, "tessel.run_timeout_s", float, 300.0)
        distributed = manifest["mode"] == "partitioned" and package.world_size > 1
        if len(cluster.nodes) == 1 and distributed:
            addr, port = "127.0.0.1", _option(options, "tessel.master_port", int, _free_port())
        else:
            addr = cluster.head.ipaddr
            port = _option(options, "tessel.master_port", int, cluster.head.port)
        local = [d for d in cluster.devices if d.node_id == node_id]
        if not local:
            raise ConfigError(
                "options", "tessel.node_id", f"no node {node_id} in the model's cluster config"
            )
        threads = _option(
            options, "tessel.threads_per_worker", int, max(1, (os.cpu_count() or 1) // len(local))
        )
        graph = _start_workers(package, local, addr, port, threads, run_timeout, distributed)
        self._graphs[graph_id] = graph
        try:
            _wait_ready(graph, load_timeout)
        except BaseException:
            self.remove_graph(graph_id)
            raise
        if node_id != cluster.head.node_id:
            return
        graph.inputs = manifest["inputs"]

    def run_graph(
        self, graph_id: int, inputs: list[torch.Tensor] | tuple | dict
    ) -> list[torch.Tensor]:
        """Run a loaded graph; returns the same outputs as the single-device model."""
        graph = self._graph(graph_id)
        tensors = _check_inputs(graph.inputs, inputs)
        if graph.distributed:
            index = 0
        else:
            index = graph.next_replica
            graph.next_replica = (index + 1) % len(graph.conns)
        graph.conns[index].send(("run", tensors))
        return _wait_result(graph, index)

    def remove_graph(self, graph_id: int) -> None:
        graph = self._graphs.pop(graph_id, None)
        if graph is not None:
            _stop(graph)

    def close(self) -> None:
        for graph_id in list(self._graphs):
            self.remove_graph(graph_id)

    def _graph(self, graph_id: int) -> _Graph:
        if graph_id not in self._graphs:
            raise ConfigError(
                "graph_id", None, f"graph {graph_id} is not loaded; loaded: {sorted(self._graphs)}"
            )
        return self._graphs[graph_id]


def _start_workers(package, local, addr, port, threads, run_timeout, distributed) -> _Graph:
    manifest = package.manifest
    ctx = mp.get_context("spawn")
    procs, conns, ranks = [], [], []
    for device in local:
        parent, child = ctx.Pipe()
        spec = WorkerSpec(
            rank=device.rank,
            world_size=package.world_size,
            package=str(package.path),
            master_addr=addr,
            master_port=port,
            backend=manifest["backend"],
            device_type=manifest["device_type"],
            device_index=device.device_id,
            threads=threads,
            timeout_s=run_timeout,
            distributed=distributed,
        )
        proc = ctx.Process(
            target=worker_main, args=(spec, child), daemon=True, name=f"tessel-rank{device.rank}"
        )
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
        ranks.append(device.rank)
    return _Graph(package, procs, conns, ranks, distributed, run_timeout)


def _check_inputs(expected: list[dict], inputs: Any) -> list[torch.Tensor]:
    if isinstance(inputs, dict):
        names = [e["name"] for e in expected]
        missing = [n for n in names if n not in inputs]
        if missing:
            raise ConfigError("inputs", None, f"missing inputs {missing}; the model takes {names}")
        inputs = [inputs[n] for n in names]
    inputs = list(inputs)
    if len(inputs) != len(expected):
        raise ConfigError(
            "inputs", None, f"the model takes {len(expected)} inputs, found {len(inputs)}"
        )
    for i, (x, e) in enumerate(zip(inputs, expected)):
        if not isinstance(x, torch.Tensor):
            raise ConfigError(
                "inputs", f"input_{i}", f"expected a tensor, found {type(x).__name__}"
            )
        if list(x.shape) != e["shape"] or str(x.dtype).removeprefix("torch.") != e["dtype"]:
            raise ConfigError(
                "inputs",
                f"input_{i} ({e['name']})",
                f"expected shape {e['shape']} {e['dtype']}, found {list(x.shape)} "
                f"{str(x.dtype).removeprefix('torch.')}",
            )
    return [x.detach().cpu().contiguous() for x in inputs]


def _describe_exit(graph: _Graph, i: int) -> str:
    # The pipe closes a moment before the OS reaps the process; wait briefly for the code.
    graph.procs[i].join(timeout=5)
    code = graph.procs[i].exitcode
    return f"rank {graph.ranks[i]} died (exit code {code})"


def _poll(graph: _Graph, deadline: float, want: str, index: int | None) -> Any:
    """Wait for `want` from worker `index` (or all ready); fail fast on errors and deaths.

    Blocks in `multiprocessing.connection.wait` on every pipe and process sentinel, so an answer
    is taken the moment it arrives and an idle session costs no CPU.
    """
    pending = set(range(len(graph.conns))) if index is None else {index}
    conn_index = {id(c): i for i, c in enumerate(graph.conns)}
    sentinels = {p.sentinel: i for i, p in enumerate(graph.procs)}
    result = None
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WorkerError(f"no answer from ranks {[graph.ranks[i] for i in pending]} in time")
        ready = wait([*graph.conns, *sentinels], timeout=remaining)
        answered = set()
        for obj in ready:
            if isinstance(obj, int):
                continue
            i = conn_index[id(obj)]
            answered.add(i)
            try:
                kind, rank, payload = obj.recv()
            except (EOFError, OSError):
                raise WorkerError(_describe_exit(graph, i)) from None
            if kind == "error":
                raise WorkerError(f"rank {rank} failed:\n{payload}")
            if kind == want and i in pending:
                pending.discard(i)
                result = payload
        for obj in ready:  # a process gone without a last word on its pipe
            if isinstance(obj, int) and sentinels[obj] not in answered:
                raise WorkerError(_describe_exit(graph, sentinels[obj]))
    return result


def _wait_ready(graph: _Graph, timeout: float) -> None:
    _poll(graph, time.monotonic() + timeout, "ready", None)


def _wait_result(graph: _Graph, index: int) -> list[torch.Tensor]:
    try:
        return _poll(graph, time.monotonic() + graph.run_timeout, "result", index)
    except WorkerError:
        _stop(graph, graceful=False)
        raise


def _stop(graph: _Graph, graceful: bool = True) -> None:
    if graceful:
        for proc, conn in zip(graph.procs, graph.conns):
            if proc.is_alive():
                with contextlib.suppress(Exception):
                    conn.send(("stop",))
        deadline = time.monotonic() + 10
        for proc in graph.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in graph.procs:
        if proc.is_alive():
            proc.terminate()
    for proc in graph.procs:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in graph.conns:
        conn.close()
