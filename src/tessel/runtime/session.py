"""initialize / Session / load_graph / run_graph / finalize, as GE names them, for tessel models."""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import socket
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from tessel.config.cluster import cluster_from_dict
from tessel.config.errors import ConfigError
from tessel.errors import TesselError
from tessel.package.format import Package, PackageError
from tessel.package.manifest import TensorSpec
from tessel.runtime.worker import WorkerSpec, worker_main

log = logging.getLogger(__name__)

_state: dict[str, Any] = {"initialized": False, "config": {}}
_sessions: weakref.WeakSet = weakref.WeakSet()


# A worker exits with this code when it finds itself starting a session while it imports the
# user's script: the script has no main guard, and the session says so in one sentence.
_UNGUARDED_MAIN_EXIT = 87
_UNGUARDED_MAIN = (
    "the script that starts a tessel session must do so under "
    "'if __name__ == \"__main__\":', because every worker process imports the script again "
    "and would otherwise start workers of its own"
)


class WorkerError(TesselError, RuntimeError):
    """A worker failed, died or stopped answering.

    The message is one line naming the rank and the cause; `worker_traceback` holds the
    worker's whole traceback where it sent one (also logged at DEBUG).
    """

    def __init__(
        self, message: str, rank: int | None = None, worker_traceback: str | None = None
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.worker_traceback = worker_traceback


class SessionError(TesselError, RuntimeError):
    """The runtime was used out of order: a session before `initialize`, after `finalize`."""


def _exit_if_importing_main() -> None:
    """In a worker that is still importing the user's script, stop quietly with a known code.

    With the spawn start method each worker runs the main script again before it starts; a
    script that starts a session at its top level would make every worker start workers of its
    own. Exiting here, before that, lets the session report it once (see `_describe_exit`).
    """
    # multiprocessing marks a child this way from its start until the main module is imported
    # (its own check for this case, which raises in every worker, reads the same mark)
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise SystemExit(_UNGUARDED_MAIN_EXIT)


def initialize(config: dict[str, str] | None = None) -> None:
    """Start tessel's runtime (GEInitialize). Safe to call again."""
    _exit_if_importing_main()
    if config is not None and not isinstance(config, dict):
        raise ConfigError("config", None, f"expected a dict, found {type(config).__name__}")
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
    inputs: tuple[TensorSpec, ...] = ()


class Session:
    """Loads offline models onto the cluster's devices and runs them."""

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        _exit_if_importing_main()
        if not _state["initialized"]:
            raise SessionError("call tessel.initialize() before creating a Session")
        if options is not None and not isinstance(options, dict):
            raise ConfigError("options", None, f"expected a dict, found {type(options).__name__}")
        self.options = dict(options or {})
        self._graphs: dict[int, _Graph] = {}
        _sessions.add(self)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def load_graph(self, graph_id: int, options: dict[str, Any] | None, path: str | Path) -> None:
        """Start one worker per device of this node, join the process groups, load every rank."""
        _exit_if_importing_main()
        if not _state["initialized"]:
            raise SessionError("tessel.finalize() was called; call tessel.initialize() again")
        if not isinstance(graph_id, int) or isinstance(graph_id, bool):
            raise ConfigError("graph_id", None, f"expected an integer, found {graph_id!r}")
        if graph_id in self._graphs:
            raise ConfigError(
                "graph_id", None, f"graph {graph_id} is already loaded in this session"
            )
        if options is not None and not isinstance(options, dict):
            raise ConfigError("options", None, f"expected a dict, found {type(options).__name__}")
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError("path", None, f"expected a file path, found {type(path).__name__}")
        options = {**self.options, **(options or {})}
        package = Package.open(path)
        manifest = package.manifest
        cluster = cluster_from_dict(manifest.cluster, f"{path} (cluster)", manifest.soc_version)
        if len(cluster.devices) != manifest.world_size:
            raise PackageError(
                path,
                f"the cluster config has {len(cluster.devices)} devices but the model was built "
                f"for {manifest.world_size}",
            )
        node_id = _option(options, "tessel.node_id", int, cluster.head.node_id)
        load_timeout = _option(options, "tessel.load_timeout_s", float, 300.0)
        run_timeout = _option(options, "tessel.run_timeout_s", float, 300.0)
        distributed = manifest.mode == "partitioned" and package.world_size > 1
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
        graph.inputs = manifest.inputs

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
            backend=manifest.backend,
            device_type=manifest.device_type,
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


def _check_inputs(expected: tuple[TensorSpec, ...], inputs: Any) -> list[torch.Tensor]:
    if isinstance(inputs, dict):
        names = [e.name for e in expected]
        missing = [n for n in names if n not in inputs]
        if missing:
            raise ConfigError("inputs", None, f"missing inputs {missing}; the model takes {names}")
        inputs = [inputs[n] for n in names]
    if not isinstance(inputs, (list, tuple)):
        raise ConfigError(
            "inputs",
            None,
            f"expected a list of tensors (or a dict by input name), found {type(inputs).__name__}",
        )
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
        if tuple(x.shape) != e.shape or str(x.dtype).removeprefix("torch.") != e.dtype:
            raise ConfigError(
                "inputs",
                f"input_{i} ({e.name})",
                f"expected shape {list(e.shape)} {e.dtype}, found {list(x.shape)} "
                f"{str(x.dtype).removeprefix('torch.')}",
            )
    return [x.detach().cpu().contiguous() for x in inputs]


def _describe_exit(graph: _Graph, i: int) -> str:
    # The pipe closes a moment before the OS reaps the process; wait briefly for the code.
    graph.procs[i].join(timeout=5)
    code = graph.procs[i].exitcode
    if code == _UNGUARDED_MAIN_EXIT:
        return f"rank {graph.ranks[i]} could not start: {_UNGUARDED_MAIN}"
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
                raise _worker_failed(rank, payload)
            if kind == want and i in pending:
                pending.discard(i)
                result = payload
        for obj in ready:  # a process gone without a last word on its pipe
            if isinstance(obj, int) and sentinels[obj] not in answered:
                raise WorkerError(_describe_exit(graph, sentinels[obj]))
    return result


def _worker_failed(rank: int, report: Any) -> WorkerError:
    """One line naming the rank and the cause; the worker's traceback goes to the DEBUG log."""
    if isinstance(report, tuple) and len(report) == 3:
        kind, message, details = (str(part) for part in report)
    else:  # not what a worker sends; show it as it came
        kind, message, details = "error", str(report), str(report)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    cause = lines[0] if lines else "(no message)"
    if len(cause) > 300:
        cause = cause[:297] + "..."
    log.debug("rank %s failed; its traceback:\n%s", rank, details)
    return WorkerError(f"rank {rank} failed: {kind}: {cause}", rank, details)


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
