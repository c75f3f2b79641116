"""initialize / Session / load_graph / run_graph / finalize, as GE names them, for tessel models."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import inspect
import json
import logging
import math
import multiprocessing
import os
import random
import signal
import socket
import sys
import tempfile
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import resource_sharer
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

from tessel.checkpoint.errors import CheckpointError
from tessel.config.cluster import cluster_from_dict
from tessel.config.errors import ConfigError
from tessel.config.fields import Fields
from tessel.config.sampling import UNSUPPORTED_SETTINGS, Sampling, sampling_for
from tessel.decoding import check_request, new_tokens_for, stop_tokens, token_id
from tessel.dtypes import dtype_name
from tessel.errors import TesselError
from tessel.forked import signal_name
from tessel.package.format import Package, PackageError
from tessel.package.manifest import TensorSpec
from tessel.progress import phase
from tessel.runtime import cpu_cache, shared_memory
from tessel.runtime.fork_server import stop_fork_server, worker_context
from tessel.runtime.main_guard import unguarded_call_site
from tessel.runtime.rendezvous import Meeting, meet
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

    Each worker runs the main script again before it starts (`tessel.runtime.fork_server`); a
    script that starts a session at its top level would make every worker start workers of its
    own. Exiting here, before that, lets the session report it once (see `_describe_exit`).
    """
    # multiprocessing marks a child this way from its start until the main module is imported
    # (its own check for this case, which raises in every worker, reads the same mark)
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise SystemExit(_UNGUARDED_MAIN_EXIT)


def _refuse_unguarded_main(call: str) -> None:
    """Refuse `call` from the main script's top level, where every spawned worker would run
    the script again (see `tessel.runtime.main_guard`)."""
    site = unguarded_call_site(sys._getframe(2))
    if site is not None:
        file, line = site
        raise SessionError(
            f"{file}:{line}: {call} runs at the script's top level, and every worker a session "
            "starts imports the script again and would run it too: "
            'put the code that uses tessel\'s runtime under `if __name__ == "__main__":`'
        )


# GEInitialize's keys tessel reads: the run mode, which a package loaded must match
INITIALIZE_OPTIONS = frozenset({"ge.graphRunMode"})
# the keys `load_graph` reads from its options and the Session's
LOAD_OPTIONS = INITIALIZE_OPTIONS | {
    "checkpoint",
    "tessel.learning_rate",
    "tessel.node_id",
    "tessel.load_timeout_s",
    "tessel.run_timeout_s",
    "tessel.reuse_workers",
    "tessel.reuse_freed_memory",
    "tessel.master_port",
    "tessel.threads_per_worker",
}
# GE's keys with no meaning in tessel, and why: refused by name rather than ignored
_NOT_BUILT = {
    "ge.exec.deviceId": "each rank runs on the device its package's cluster config names, and "
    "a session drives every device of the package: remove ge.exec.deviceId",
}


def _check_options(options: dict, known: frozenset[str] | set[str], what: str) -> None:
    """Refuse a key tessel does not read (a setting accepted and ignored would be a silent
    no-op), naming the closest known key."""
    Fields(options, what).check_keys(known, _NOT_BUILT)


def initialize(config: dict[str, str] | None = None) -> None:
    """Start tessel's runtime (GEInitialize). Safe to call again.

    Args:
        config: GEInitialize's config. tessel reads `ge.graphRunMode` (`"0"` inference,
            `"1"` training), which a loaded package must match; any other key is refused.

    Raises:
        ConfigError: A key tessel does not read, or a config that is not a dict.
        SessionError: Called from a script's top level, where every worker would run it too.
    """
    _exit_if_importing_main()
    _refuse_unguarded_main("tessel.initialize()")
    if config is not None and not isinstance(config, dict):
        raise ConfigError("config", None, f"expected a dict, found {type(config).__name__}")
    _check_options(config or {}, INITIALIZE_OPTIONS, "tessel.initialize()")
    _state["initialized"] = True
    _state["config"] = dict(config or {})


def is_initialized() -> bool:
    """Whether `initialize` was called (and `finalize` not since)."""
    return bool(_state["initialized"])


def finalize() -> None:
    """Stop every session's workers and release the runtime (GEFinalize).

    It runs at exit too, so no worker outlives the process that started it.
    """
    for session in list(_sessions):
        session.close()
    stop_fork_server()
    _state["initialized"] = False


atexit.register(finalize)


@contextlib.contextmanager
def _checkpoint_in_layout(checkpoint: Any, package: Package) -> Iterator[str]:
    """The directory of `checkpoint` (a training checkpoint of any layout of this model) in
    the package's layout: itself when its strategy is the package's, else a converted copy
    (tessel's checkpoint tools) that lives while the workers load it; "" for none."""
    if checkpoint is None:
        yield ""
        return
    if package.manifest.training is None:
        raise ConfigError("options", "checkpoint", f"{package.path} is not a training package")
    source = Path(checkpoint)
    strategy = source / "strategy.json"
    if not source.is_dir() or not strategy.is_file():
        raise ConfigError(
            "options",
            "checkpoint",
            f"{source} is not a training checkpoint (a directory with strategy.json and "
            "rank_<r>/ files, as Session.save_checkpoint writes)",
        )
    ours = package.json(package.manifest.strategy)
    try:
        theirs = json.loads(strategy.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(strategy, None, f"is not a strategy file's JSON ({exc})") from None
    if theirs == ours:
        from tessel.checkpoint.identity import check_saved

        check_saved(source, ours)  # the rank files the workers read: one checkpoint's
        yield str(source)
        return
    from tessel.checkpoint.convert import execute
    from tessel.checkpoint.jobs import plan_convert

    with tempfile.TemporaryDirectory(prefix="tessel-resume-") as tmp:
        dst_strategy = Path(tmp) / "strategy.json"
        dst_strategy.write_text(json.dumps(ours))
        jobs, held, files = plan_convert(source, strategy, dst_strategy, "checkpoint_")
        execute(jobs, Path(tmp) / "ranks", forbidden=held.holder_files(), extra_files=files)
        yield str(Path(tmp) / "ranks")


def _model_files(package: Package) -> dict[str, bytes]:
    """The files a training package's checkpoint holds beside its tensors (see
    `tessel.checkpoint.model_files`): which tensors are the model's state_dict, and a
    transformers model's config files, each checked against the package first."""
    from tessel.checkpoint.model_files import STATE_DICT_FILE, state_dict_file
    from tessel.package.format import parse_json

    training = package.manifest.training
    out: dict[str, bytes] = {}
    if training is None:
        return out
    if training.state_dict is not None and package.manifest.strategy is not None:
        strategy = package.json(package.manifest.strategy)
        held = strategy.get("params") if isinstance(strategy, dict) else None
        if not isinstance(held, dict):
            raise PackageError(
                package.path, f"member {package.manifest.strategy!r}: expected a strategy object"
            )
        for key, name in training.state_dict.items():
            if name not in held:
                raise PackageError(
                    package.path,
                    f"manifest training.state_dict[{key!r}]: names {name!r}, which the "
                    "package's strategy does not hold",
                )
        out[STATE_DICT_FILE] = state_dict_file(training.state_dict)
    for file, member in (
        ("config.json", training.model_config),
        ("generation_config.json", training.generation_config),
    ):
        if member is None:
            continue
        data = package.read(member)
        if not isinstance(parse_json(data, package.path, f"member {member!r}"), dict):
            raise PackageError(package.path, f"member {member!r}: expected a JSON object")
        out[file] = data
    return out


_RUN_MODES = {"0": "inference", "1": "training"}


def _check_run_mode(manifest: Any, path: Any, options: dict) -> None:
    """GE's `ge.graphRunMode` (0 inference, 1 training), from the load options or
    `initialize`'s config: where given, it must be the package's."""
    key = "ge.graphRunMode"
    value = options.get(key, _state["config"].get(key))
    if value is None:
        return
    mode = _RUN_MODES.get(str(value).strip())
    if mode is None:
        raise ConfigError("options", key, f"found {value!r}; allowed: 0 (inference), 1 (training)")
    package = "training" if manifest.training is not None else "inference"
    if mode != package:
        raise ConfigError(
            "options",
            key,
            f"is {value} ({mode}), but {path} holds a{'n' * (package == 'inference')} "
            f"{package} model; set ge.graphRunMode to {1 if package == 'training' else 0}",
        )


def _learning_rate(value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise ConfigError(
            "options", "tessel.learning_rate", f"found {value!r}; expected a finite number >= 0"
        )
    return float(value)


def _free_port() -> int:
    """A port free now for rank 0's store, below the range the system hands outgoing
    connections (Linux's `ip_local_port_range`): a port asked of the system (bind to 0) comes
    from that range, where any process's next connection may take it before rank 0 listens."""
    low = _ephemeral_low()
    for port in random.Random().sample(range(_LOWEST_PORT, low), k=min(64, low - _LOWEST_PORT)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LOWEST_PORT = 20000  # below it lie the ports services are configured on


def _ephemeral_low() -> int:
    """The lowest port the system hands outgoing connections (32768 where it does not say)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return low if low > _LOWEST_PORT + 64 else 32768


def _option(options: dict, key: str, kind: type, default: Any) -> Any:
    value = options.get(key, default)
    try:
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError("options", key, f"expected {kind.__name__}, found {value!r}") from exc


def _flag(options: dict, key: str, default: bool) -> bool:
    value = options.get(key, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, str)) and str(value).strip().lower() in _FLAGS:
        return _FLAGS[str(value).strip().lower()]
    raise ConfigError("options", key, f"expected true or false, found {value!r}")


_FLAGS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


@dataclass
class _Workers:
    """One worker process per local device, with the pipes the session talks to them through.

    `key` says what makes two sets of workers interchangeable (see `_pool_key`); None when
    these workers may serve only the package they were started for. `broken` is set on any
    error or interruption: broken workers are stopped and never handed another package.
    """

    procs: list[Any]
    conns: list[Connection]
    ranks: list[int]
    distributed: bool
    run_timeout: float
    key: tuple | None = None
    broken: bool = False
    meeting: Meeting | None = None  # this node's place at the head's store, in a cluster of nodes


@dataclass
class _Graph:
    package: Package
    workers: _Workers
    next_replica: int = 0
    inputs: tuple[TensorSpec, ...] = ()
    learning_rate: float | None = None  # a training step's, where the session set one
    stream: _TokenStream | None = None  # a generation package's last streamed request

    @property
    def procs(self) -> list[Any]:
        return self.workers.procs

    @property
    def conns(self) -> list[Connection]:
        return self.workers.conns

    @property
    def distributed(self) -> bool:
        return self.workers.distributed


class Session:
    """Loads offline models onto the cluster's devices and runs them (GE's `ge::Session`).

    Args:
        options: The load options every `load_graph` of this session takes, under its own
            (the sessions guide's table lists them); a key tessel does not read is refused.

    Raises:
        SessionError: `tessel.initialize()` was not called.
        ConfigError: An option tessel does not read.

    Options (also per `load_graph`): `tessel.node_id`, `tessel.master_port`,
    `tessel.threads_per_worker`, `tessel.load_timeout_s`, `tessel.run_timeout_s`,
    `tessel.reuse_workers` (default true), and `tessel.reuse_freed_memory` (default false: a
    CPU worker keeps large freed blocks for the next request of their size, but never holds
    more than the most its program had in use at once; see `tessel.runtime.cpu_cache`. True
    leaves freed memory to glibc's heap, as torch's own processes run, at up to half more).

    Workers are reused: `remove_graph` keeps the graph's workers, idle, and the next
    `load_graph` whose workers would be the same (same local devices and ranks, world size,
    backend, device type, threads, timeout and master port) hands them the new package
    instead of starting new processes; they make any process groups it adds on the process
    group they already share. One idle set is kept: a package that needs other workers stops
    it and starts fresh ones. A graph still loaded keeps its workers to itself, so a second
    graph loaded beside it gets its own. Workers that reported an error, died, stopped
    answering or were interrupted are never reused. Clusters of several nodes reuse no workers
    of a partitioned model: the other nodes' workers leave when the graph is removed.
    """

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        _exit_if_importing_main()
        if not _state["initialized"]:
            raise SessionError("call tessel.initialize() before creating a Session")
        if options is not None and not isinstance(options, dict):
            raise ConfigError("options", None, f"expected a dict, found {type(options).__name__}")
        _check_options(options or {}, LOAD_OPTIONS, "Session()")
        self.options = dict(options or {})
        self._graphs: dict[int, _Graph] = {}
        self._idle: _Workers | None = None  # the workers of a removed graph, kept for reuse
        _sessions.add(self)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def load_graph(self, graph_id: int, options: dict[str, Any] | None, path: str | Path) -> None:
        """Load every rank of this node onto one worker per device; return when all are ready.

        Idle workers take the package where they fit; otherwise new ones start and join the
        process groups.

        Args:
            graph_id: The id later calls name the graph by.
            options: The load options, over the session's own (the sessions guide's table).
            path: A `.tessel` package.

        Raises:
            ConfigError: An option tessel does not read, a graph id in use, or a run mode
                that is not the package's.
            PackageError: The package is missing, altered, or of another version.
            WorkerError: A worker failed to start or to load; the message names the rank.
        """
        _exit_if_importing_main()
        _refuse_unguarded_main("Session.load_graph")
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
        _check_options(options or {}, LOAD_OPTIONS, "Session.load_graph()")
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError("path", None, f"expected a file path, found {type(path).__name__}")
        options = {**self.options, **(options or {})}
        package = Package.open(path)
        manifest = package.manifest
        _check_run_mode(manifest, path, options)
        learning_rate = None
        if "tessel.learning_rate" in options:
            if manifest.training is None:
                raise ConfigError(
                    "options", "tessel.learning_rate", f"{path} is not a training package"
                )
            learning_rate = _learning_rate(options["tessel.learning_rate"])
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
        reuse = _flag(options, "tessel.reuse_workers", True)
        reuse_memory = _flag(options, "tessel.reuse_freed_memory", False)
        distributed = manifest.mode != "replicated" and package.world_size > 1
        port_option = options.get("tessel.master_port")
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
        key = None
        # the workers of a partitioned model spanning nodes share a process group with other
        # nodes' workers, which leave when the graph is removed: those are never reused
        if reuse and (len(cluster.nodes) == 1 or not distributed):
            key = _pool_key(
                manifest, local, distributed, threads, run_timeout, port_option, reuse_memory
            )
        idle, self._idle = self._idle, None
        if idle is not None:
            healthy = _healthy(idle)
            if key is None or idle.key != key or not healthy:
                _stop(idle, graceful=healthy)
                idle = None
        meeting = None
        if idle is None and distributed and len(cluster.nodes) > 1:
            # the id is this node's, and the head's store answers, before any worker starts
            # (or a checkpoint is converted for them): a second node of one id is refused here
            with phase(f"node {node_id}: meeting at {addr}:{port}"):
                meeting = meet(cluster, node_id, addr, port, load_timeout, package.path.name)
        with (
            _given_back_on_error(meeting),
            _checkpoint_in_layout(options.get("checkpoint"), package) as resume,
        ):
            if idle is not None:
                workers = idle
                _send_load(workers, str(package.path), resume)
            else:
                workers = _start_workers(
                    package, local, addr, port, threads, run_timeout, distributed,
                    reuse_memory, resume, meeting is not None,
                )  # fmt: skip
                workers.key = key
                workers.meeting = meeting
            graph = _Graph(package, workers, learning_rate=learning_rate)
            self._graphs[graph_id] = graph
            what = "loading" if idle is not None else f"starting {len(local)} workers, loading"
            try:
                with phase(f"{what} {package.path.name}"):
                    _wait_ready(workers, load_timeout)
            except BaseException:
                workers.broken = True
                self.remove_graph(graph_id)
                raise
        if node_id != cluster.head.node_id:
            return
        graph.inputs = manifest.inputs

    def run_graph(
        self, graph_id: int, inputs: list[torch.Tensor] | tuple | dict
    ) -> list[torch.Tensor]:
        """Run a loaded graph once.

        A training package's run is one step: forward, backward, and the optimizer's update
        of the weights on the devices.

        Args:
            graph_id: A loaded graph that is not a generation package.
            inputs: The inputs, as a list in the package's order or a dict by name.

        Returns:
            The outputs the single-device model returns; for a training step, `[loss]`, the
            loss before the update.

        Raises:
            ConfigError: Inputs of other names, shapes or dtypes than the package's.
            WorkerError: A worker failed; a training step's weights are then lost.
        """
        graph = self._graph(graph_id)
        if graph.package.manifest.generation is not None:
            raise ConfigError(
                "run_graph()",
                "graph_id",
                f"graph {graph_id} is a generation package: call Session.generate",
            )
        tensors = _check_inputs(graph.inputs, inputs)
        workers = graph.workers
        if workers.broken:
            raise WorkerError(
                f"graph {graph_id}'s workers were stopped after an error; remove the graph and "
                "load it again"
            )
        if workers.distributed:
            index = 0
        else:
            index = graph.next_replica
            graph.next_replica = (index + 1) % len(workers.conns)
        _sharing_tensors()
        # a worker gone since the last run closed its pipe: the wait below says how it ended
        with contextlib.suppress(OSError):
            workers.conns[index].send(("run", tensors, graph.learning_rate))
        try:
            return _wait_result(workers, index)
        except WorkerError as exc:
            if graph.package.manifest.training is None:
                raise
            raise WorkerError(
                f"{exc}; the training step failed, so the weights and optimizer states on the "
                "devices are lost (some ranks may have updated, others not): remove the graph "
                "and load it again from the last checkpoint",
                exc.rank,
                exc.worker_traceback,
            ) from exc

    def generate(
        self,
        graph_id: int,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int | None = None,
        *,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        repetition_penalty: float | None = None,
        no_repeat_ngram_size: int | None = None,
        min_length: int | None = None,
        min_new_tokens: int | None = None,
        min_p: float | None = None,
        typical_p: float | None = None,
        epsilon_cutoff: float | None = None,
        eta_cutoff: float | None = None,
        suppress_tokens: Sequence[int] | None = None,
        forced_bos_token_id: int | None = None,
        forced_eos_token_id: int | Sequence[int] | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        stream: bool = False,
        **unknown: Any,
    ) -> Any:
        """Generate from a generation package, as `transformers`' `generate` does.

        Prompts are padded on the left (`attention_mask` 0 over the padding). The loop runs on
        the devices, every rank choosing each token. A setting left None is the model's own
        (its `generation_config`, recorded at build), else `transformers`' default, as
        `transformers`' `generate` chooses it. A `transformers` argument this loop does not
        take (beam search, `max_length`) is refused by name, never ignored, unless it is
        given the value that leaves decoding as it is (`num_beams=1`).

        Args:
            graph_id: A loaded generation package.
            input_ids: The prompts, `[rows, length]`.
            attention_mask: 1 over each prompt's tokens, 0 over its left padding.
            max_new_tokens: The new tokens per row. Default: the model's, else what its
                `max_length` leaves after the prompt, at most what the cache holds.
            do_sample: Sample each token, or choose the likeliest (greedy).
            temperature: With sampling, divide the logits by it (below 1: sharper).
            top_k: With sampling, keep the k likeliest tokens (0: all).
            top_p: With sampling, keep the smallest set of tokens of this mass.
            seed: With sampling, the seed of the draws: the same seed, the same tokens.
            repetition_penalty: Make the tokens a row holds this much less likely (1: no
                penalty).
            no_repeat_ngram_size: Let no n-gram of this many tokens occur twice in a row (0: no
                ban).
            min_length: Make no eos token before a row holds this many tokens, its prompt's
                included (0: none).
            min_new_tokens: Make no eos token before a row holds this many new tokens (0: none).
                Where set, it overrules min_length.
            min_p: With sampling, keep the tokens at least this share as likely as the likeliest
                (0: all).
            typical_p: With sampling, keep the locally typical set of this mass (1: all).
            epsilon_cutoff: With sampling, drop the tokens less likely than this (0: none).
            eta_cutoff: With sampling, drop the tokens below this cutoff, lowered by the entropy
                (0: none).
            suppress_tokens: Never make these tokens.
            forced_bos_token_id: Make this token where a row holds one token (an
                encoder-decoder's first new token).
            forced_eos_token_id: Make this token (or one of these) the call's last token.
            eos_token_id: The token (or any of several) that ends a row.
            pad_token_id: The token finished rows are padded with. Default: the model's,
                else the first eos token.
            stream: Return an iterator of each step's new tokens `[rows]` instead.

        Returns:
            Token ids `[rows, prompt + new tokens]` (an encoder-decoder's `[rows, 1 + new
            tokens]`, its decoder's start token first), rows finished at `eos_token_id`
            padded with `pad_token_id`; with `stream`, an iterator of each step's tokens.

        Raises:
            ConfigError: An argument this loop does not take, or a value out of range.
            WorkerError: A worker failed; the message names the rank and the cause.
        """
        unknown = {
            k: v
            for k, v in unknown.items()
            if k not in UNSUPPORTED_SETTINGS or UNSUPPORTED_SETTINGS[k] != v
        }
        if unknown:
            key = next(iter(unknown))
            if key in UNSUPPORTED_SETTINGS:
                raise ConfigError(
                    "generate()",
                    key,
                    f"is {unknown[key]!r}, which tessel's generate does not build (it decodes "
                    f"greedily or by sampling); {UNSUPPORTED_SETTINGS[key]!r} is taken",
                )
            taken = [
                p.name
                for p in inspect.signature(Session.generate).parameters.values()
                if p.kind is p.KEYWORD_ONLY or p.name in ("attention_mask", "max_new_tokens")
            ]
            raise ConfigError(
                "generate()",
                key,
                f"is not an argument tessel's generate takes; it takes {', '.join(taken)}",
            )
        graph = self._graph(graph_id)
        gears = graph.package.manifest.generation
        if gears is None:
            raise ConfigError(
                "generate()",
                "graph_id",
                f"graph {graph_id} was built without generation (tessel.build(..., "
                "generation=tessel.Generation(...)))",
            )
        # each Sampling field is a keyword above (tests/test_sampling_settings.py keeps them
        # equal); None: not asked
        given = locals()
        asked = {f.name: given[f.name] for f in dataclasses.fields(Sampling)}
        sampling = sampling_for(asked, gears.defaults)
        for key in ("suppress_tokens", "forced_eos_token_id"):
            for token in getattr(sampling, key):
                token_id(token, key, gears.vocab_size)
        if sampling.forced_bos_token_id is not None:
            token_id(sampling.forced_bos_token_id, "forced_bos_token_id", gears.vocab_size)
        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1:
            input_ids = input_ids[None]
            if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 1:
                attention_mask = attention_mask[None]
        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[1]:
            length = input_ids.shape[1]
            max_new_tokens = new_tokens_for(max_new_tokens, gears.defaults, gears, length)
        mask, _ = check_request(gears, input_ids, attention_mask, max_new_tokens)
        eos = gears.eos_token_id if eos_token_id is None else eos_token_id
        eos = stop_tokens(eos, gears.vocab_size)
        pad = token_id(
            gears.pad_for(eos) if pad_token_id is None else pad_token_id,
            "pad_token_id",
            gears.vocab_size,
        )
        if not isinstance(stream, bool):
            raise ConfigError("generate()", "stream", f"must be True or False, found {stream!r}")
        if graph.stream is not None:  # a stream its caller left before its end
            graph.stream.finish()
            graph.stream = None
        workers = graph.workers
        if workers.broken:
            raise WorkerError(
                f"graph {graph_id}'s workers were stopped after an error; remove the graph and "
                "load it again"
            )
        request = {
            "rows": input_ids.shape[0],
            "length": input_ids.shape[1],
            "max_new_tokens": max_new_tokens,
            "sampling": dataclasses.asdict(sampling),
            "eos_token_id": list(eos),
            "pad_token_id": pad,
            "stream": stream,
        }
        prompt = input_ids.detach().long().cpu().contiguous()
        _sharing_tensors()
        with contextlib.suppress(OSError):
            workers.conns[0].send(("generate", request, prompt, mask.cpu().contiguous()))
        if stream:
            graph.stream = _TokenStream(workers)
            return graph.stream
        new = torch.tensor(_wait_result(workers, 0), dtype=prompt.dtype)
        if gears.decoder_start_token_id is not None:  # an encoder-decoder: the decoder's tokens
            prompt = torch.full_like(prompt[:, :1], gears.decoder_start_token_id)
        return torch.cat([prompt, new.reshape(len(prompt), -1)], dim=1)

    def save_checkpoint(self, graph_id: int, path: str | Path) -> Path:
        """Write a training graph's weights and optimizer states as a distributed checkpoint.

        Args:
            graph_id: A loaded training package.
            path: The checkpoint's directory.

        Returns:
            The directory written.

        The format is tessel's: `rank_<r>/checkpoint_<r>.safetensors` per rank and
        `strategy.json` (weights under their names, optimizer states as
        `optimizer.<key>.<weight>`, Adam's step count as `optimizer.step`), with
        `model_state_dict.json` (which tensors are the model's state_dict) and a transformers
        model's `config.json` and `generation_config.json`; built beside `path` (missing
        parent directories are made) and swapped in whole when every rank has written (a
        directory every node can reach). A checkpoint already at `path` is replaced whole,
        files of other names kept (see `tessel.checkpoint.identity`); each rank file records
        this checkpoint's id and its strategy's digest. `tessel ckpt unify` turns it into a
        Hugging Face checkpoint; `load_graph` with `{"checkpoint": path}` resumes from it."""
        from tessel.checkpoint.identity import (
            ID_KEY,
            STRATEGY_KEY,
            new_checkpoint_id,
            strategy_json_digest,
        )
        from tessel.checkpoint.publish import StagedTree, sync_file

        graph = self._graph(graph_id)
        if graph.package.manifest.training is None:
            raise ConfigError("graph_id", None, f"graph {graph_id} is not a training package")
        extra = _model_files(graph.package)
        package = graph.package
        strategy = package.json(package.manifest.strategy)
        record = {
            ID_KEY: new_checkpoint_id(),
            STRATEGY_KEY: strategy_json_digest(strategy, f"{package.path} (its strategy)"),
        }
        workers = graph.workers
        with StagedTree(path, parents=True) as tree:
            targets = workers.conns[:1] if workers.distributed else workers.conns
            for conn in targets:
                with contextlib.suppress(OSError):
                    conn.send(("save", str(tree.path), json.dumps(record)))
            try:
                _poll(workers, time.monotonic() + workers.run_timeout, "saved", 0)
            except BaseException as exc:
                workers.broken = True
                _stop(workers, graceful=False)
                if isinstance(exc, WorkerError):
                    raise WorkerError(
                        f"{exc}; the checkpoint was not saved ({tree.dst} is as it was), and "
                        "the weights and optimizer states on the devices are lost: load the "
                        "graph again from the last checkpoint",
                        exc.rank,
                        exc.worker_traceback,
                    ) from None
                raise
            for name, data in extra.items():
                with open(tree.path / name, "wb") as f:
                    f.write(data)
                    f.flush()
                    sync_file(f.fileno())
            tree.publish()
        return tree.dst

    def training_stats(self, graph_id: int) -> dict[str, int]:
        """What a training graph's steps measured, the largest over its ranks.

        Args:
            graph_id: A loaded training package.

        Returns:
            The counts by name, as below.

        The counts:
        `prefetch_peak_bytes`, the most gathered weights fetched ahead and held at once, and
        `prefetch_bytes`, the buffer that bounds them (0: no prefetch); on CPU workers with
        their block cache, its counts (`cpu_cache_hits`, `cpu_cache_misses`, ...: see
        `tessel.runtime.cpu_cache.counts`)."""
        graph = self._graph(graph_id)
        if graph.package.manifest.training is None:
            raise ConfigError("graph_id", None, f"graph {graph_id} is not a training package")
        workers = graph.workers
        targets = workers.conns[:1] if workers.distributed else workers.conns
        for conn in targets:
            with contextlib.suppress(OSError):
                conn.send(("stats",))
        return _poll(workers, time.monotonic() + workers.run_timeout, "stats", 0)

    def set_learning_rate(self, graph_id: int, lr: float) -> None:
        """Set the learning rate of every parameter group from the next step on.

        It is what `tessel.learning_rate` in the load options sets, so any schedule can
        drive it.

        Args:
            graph_id: A loaded training package.
            lr: The learning rate, a finite number >= 0.
        """
        graph = self._graph(graph_id)
        if graph.package.manifest.training is None:
            raise ConfigError("graph_id", None, f"graph {graph_id} is not a training package")
        graph.learning_rate = _learning_rate(lr)

    def remove_graph(self, graph_id: int) -> None:
        """Unload a graph. Its workers stay, idle, for a later `load_graph` to reuse where they
        can serve again (see the class docstring); otherwise they stop.

        Args:
            graph_id: The graph to unload; an id not loaded is no error.
        """
        graph = self._graphs.pop(graph_id, None)
        if graph is None:
            return
        workers = graph.workers
        if workers.key is None or workers.broken or not _unload(workers):
            _stop(workers, graceful=not workers.broken)
            return
        if self._idle is not None:
            _stop(self._idle)
        self._idle = workers

    def close(self) -> None:
        """Stop every worker this session started: loaded graphs' and idle ones."""
        for graph_id in list(self._graphs):
            graph = self._graphs.pop(graph_id)
            _stop(graph.workers, graceful=not graph.workers.broken)
        idle, self._idle = self._idle, None
        if idle is not None:
            _stop(idle)

    def _graph(self, graph_id: int) -> _Graph:
        if graph_id not in self._graphs:
            raise ConfigError(
                "graph_id", None, f"graph {graph_id} is not loaded; loaded: {sorted(self._graphs)}"
            )
        return self._graphs[graph_id]


@contextlib.contextmanager
def _given_back_on_error(meeting: Meeting | None) -> Iterator[None]:
    """A node's claimed id given back where its load fails (again where its workers held it
    and were stopped: giving it back twice is no error)."""
    try:
        yield
    except BaseException:
        if meeting is not None:
            meeting.leave()
        raise


def _pool_key(
    manifest: Any,
    local: list,
    distributed: bool,
    threads: int,
    run_timeout: float,
    port: Any,
    reuse_memory: bool,
) -> tuple:
    """What must match for idle workers to take a package: everything a worker is started with
    except the package. A port chosen for the session (none given) is no constraint: the
    workers already share a process group."""
    return (
        tuple((d.rank, d.node_id, d.device_id) for d in local),
        manifest.world_size,
        manifest.backend,
        manifest.device_type,
        distributed,
        threads,
        run_timeout,
        None if port is None else str(port),
        reuse_memory,
    )


def _healthy(workers: _Workers) -> bool:
    """Idle workers that are all alive and have said nothing since they went idle."""
    if workers.broken or not all(p.is_alive() for p in workers.procs):
        return False
    try:
        return not any(c.poll() for c in workers.conns)
    except OSError:
        return False


def _sharing_tensors() -> None:
    """Make sure this process can hand tensors to its workers. A tensor sent down a worker's
    pipe travels as a file descriptor that multiprocessing's resource sharer, one thread of
    this process, gives the worker that asks for it; were that thread gone, every later send
    would leave its worker waiting for ever, so a sharer whose thread has ended is reset (the
    next send starts it again), and the log says so."""
    sharer = resource_sharer._resource_sharer
    thread = sharer._thread
    if sharer._address is not None and (thread is None or not thread.is_alive()):
        log.warning("the thread that hands tensors to the workers had ended; starting it again")
        sharer._afterfork()  # drops the ended listener and its unsent descriptors


def _send_load(workers: _Workers, path: str, resume: str = "") -> None:
    """Hand idle workers a package; rank 0 passes the word on to the other ranks."""
    targets = workers.conns[:1] if workers.distributed else workers.conns
    for conn in targets:
        with contextlib.suppress(OSError):  # a worker gone: the wait for `ready` says how
            conn.send(("load", path, resume))


_UNLOAD_TIMEOUT_S = 10.0


def _unload(workers: _Workers) -> bool:
    """Make loaded workers drop their model and wait until all are idle; False if any fail."""
    targets = workers.conns[:1] if workers.distributed else workers.conns
    try:
        for conn in targets:
            conn.send(("unload",))
        _poll(workers, time.monotonic() + _UNLOAD_TIMEOUT_S, "idle", None)
    except (WorkerError, OSError) as exc:
        log.debug("workers could not be kept for reuse: %s", exc)
        workers.broken = True
        return False
    except BaseException:
        workers.broken = True
        _stop(workers, graceful=False)
        raise
    return True


def _start_workers(
    package, local, addr, port, threads, run_timeout, distributed, reuse_memory, resume="",
    met=False,
) -> _Workers:  # fmt: skip
    manifest = package.manifest
    ctx = worker_context()
    cache = ""
    if manifest.device_type == "cpu" and not reuse_memory:
        cache = cpu_cache.library() or ""
    meeting = ""
    if manifest.device_type == "cpu" and distributed:
        meeting = shared_memory.library() or ""
    procs, conns, ranks = [], [], []
    for device in local:
        parent, child = ctx.Pipe()
        spec = WorkerSpec(
            rank=device.rank,
            world_size=package.world_size,
            package=str(package.path),
            environ=dict(os.environ),
            master_addr=addr,
            master_port=port,
            backend=manifest.backend,
            device_type=manifest.device_type,
            device_index=device.device_id,
            threads=threads,
            timeout_s=run_timeout,
            distributed=distributed,
            reuse_freed_memory=reuse_memory,
            cpu_cache=cache,
            shared_memory=meeting,
            resume=resume,
            log_level=logging.getLogger("tessel").getEffectiveLevel(),
            store_at_head=met,
        )
        proc = ctx.Process(
            target=worker_main, args=(spec, child), daemon=True, name=f"tessel-rank{device.rank}"
        )
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
        ranks.append(device.rank)
    return _Workers(procs, conns, ranks, distributed, run_timeout)


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
        if tuple(x.shape) != e.shape or dtype_name(x.dtype) != e.dtype:
            raise ConfigError(
                "inputs",
                f"input_{i} ({e.name})",
                f"expected shape {list(e.shape)} {e.dtype}, found {list(x.shape)} "
                f"{dtype_name(x.dtype)}",
            )
    return [x.detach().cpu().contiguous() for x in inputs]


# the signals a worker's faulthandler reports: it prints every thread's stack to its stderr
_FAULTS = {
    getattr(signal, name)
    for name in ("SIGSEGV", "SIGFPE", "SIGABRT", "SIGBUS", "SIGILL")
    if hasattr(signal, name)
}


def _describe_exit(workers: _Workers, i: int) -> str:
    # The pipe closes a moment before the OS reaps the process; wait briefly for the code.
    workers.procs[i].join(timeout=5)
    code = workers.procs[i].exitcode
    if code == _UNGUARDED_MAIN_EXIT:
        return f"rank {workers.ranks[i]} could not start: {_UNGUARDED_MAIN}"
    if code is not None and code < 0:
        said = f"rank {workers.ranks[i]} died of {signal_name(-code)} (exit code {code})"
        if -code in _FAULTS:  # a crash in native code: the worker printed its threads' stacks
            said += "; its stderr shows each thread's Python stack"
        return said
    return f"rank {workers.ranks[i]} died (exit code {code})"


# how long the workers are given to print their stacks before a failed run stops them
_STACKS_GRACE_S = 0.5


def _print_stacks(workers: _Workers) -> None:
    """Have every live worker print each of its threads' Python stacks to its stderr (its
    faulthandler's answer to SIGUSR1): where each rank waits when a run takes too long."""
    asked = [_send(proc.pid, "SIGUSR1") for proc in workers.procs if proc.is_alive()]
    if any(asked):
        time.sleep(_STACKS_GRACE_S)


def _poll(
    workers: _Workers, deadline: float, want: str | tuple[str, ...], index: int | None
) -> Any:
    """Wait for `want` from worker `index` (or all ready); fail fast on errors and deaths.
    Where `want` gives several kinds, returns the kind that came with its payload.

    Blocks in `multiprocessing.connection.wait` on every pipe and process sentinel, so an answer
    is taken the moment it arrives and an idle session costs no CPU.
    """
    pending = set(range(len(workers.conns))) if index is None else {index}
    conn_index = {id(c): i for i, c in enumerate(workers.conns)}
    sentinels = {p.sentinel: i for i, p in enumerate(workers.procs)}
    result = None
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _print_stacks(workers)
            raise WorkerError(f"no answer from ranks {[workers.ranks[i] for i in pending]} in time")
        ready = wait([*workers.conns, *sentinels], timeout=remaining)
        answered = set()
        for obj in ready:
            if isinstance(obj, int):
                continue
            i = conn_index[id(obj)]
            answered.add(i)
            try:
                kind, rank, payload = obj.recv()
            except (EOFError, OSError):
                raise WorkerError(_describe_exit(workers, i)) from None
            if kind == "error":
                raise _silent_death(workers, i) or _worker_failed(rank, payload)
            if isinstance(want, tuple) and kind in want and i in pending:
                return kind, payload
            if kind == want and i in pending:
                pending.discard(i)
                result = payload
        for obj in ready:  # a process gone without a last word on its pipe
            if isinstance(obj, int) and sentinels[obj] not in answered:
                raise WorkerError(_describe_exit(workers, sentinels[obj]))
    return result


# a worker killed outright closes its sockets and its pipe to the session in the same moment:
# a peer may report the broken connection first, so a report waits this long for a death
_DEATH_WINDOW_S = 1.0


def _silent_death(workers: _Workers, reporter: int) -> WorkerError | None:
    """The death of a worker other than `reporter` that sent no word (killed, or crashed),
    seen within `_DEATH_WINDOW_S` of `reporter`'s error: the cause of that error, which then
    only says a connection broke. None where every other worker is alive or reported."""
    others = [j for j in range(len(workers.procs)) if j != reporter]
    sentinels = {workers.procs[j].sentinel: j for j in others}
    deadline = time.monotonic() + _DEATH_WINDOW_S
    while sentinels and (remaining := deadline - time.monotonic()) > 0:
        for sentinel in wait(list(sentinels), timeout=remaining):
            j = sentinels.pop(sentinel)
            try:
                said = workers.conns[j].poll() and workers.conns[j].recv()[0] == "error"
            except (EOFError, OSError):
                said = False
            if not said:
                return WorkerError(_describe_exit(workers, j))
    return None


def _worker_failed(rank: int, report: Any) -> WorkerError:
    """One line naming the rank and the cause; the worker's traceback goes to the DEBUG log."""
    if isinstance(report, tuple) and len(report) == 3:
        kind, message, details = (str(part) for part in report)
    else:  # not what a worker sends; show it as it came
        kind, message, details = "error", str(report), str(report)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    cause = lines[0] if lines else "(no message)"
    if len(cause) > 600:  # room for two file paths (a package mismatch names both)
        cause = cause[:597] + "..."
    log.debug("rank %s failed; its traceback:\n%s", rank, details)
    return WorkerError(f"rank {rank} failed: {kind}: {cause}", rank, details)


def _wait_ready(workers: _Workers, timeout: float) -> None:
    _poll(workers, time.monotonic() + timeout, "ready", None)


def _wait_result(workers: _Workers, index: int, want: str = "result") -> Any:
    try:
        return _poll(workers, time.monotonic() + workers.run_timeout, want, index)
    except BaseException:  # a failure, or an interruption that leaves a run in flight
        _stop(workers, graceful=False)
        raise


class _TokenStream:
    """Each step's tokens `[rows]` as rank 0 sends them, until its result."""

    def __init__(self, workers: _Workers) -> None:
        self.workers = workers
        self.done = False

    def __iter__(self) -> _TokenStream:
        return self

    def __next__(self) -> torch.Tensor:
        if self.done:
            raise StopIteration
        kind, payload = _wait_result(self.workers, 0, ("token", "result"))
        if kind == "result":
            self.done = True
            raise StopIteration
        return torch.tensor(payload, dtype=torch.long)

    def finish(self) -> None:
        """Read the rest of the request, so the next one's answers are its own."""
        while not self.done and not self.workers.broken:
            kind, _ = _wait_result(self.workers, 0, ("token", "result"))
            self.done = kind == "result"


def _send(pid: int | None, name: str) -> bool:
    """Send the signal `name` to process `pid`, where this platform has it; whether it went."""
    number = getattr(signal, name, None)
    if pid is None or number is None:
        return False
    try:
        os.kill(pid, number)
    except OSError:  # gone already
        return False
    return True


def _continue(pid: int | None) -> None:
    """Resume a stopped process (SIGSTOP, a debugger's pause) so a pending SIGTERM ends it now
    rather than when something else resumes it."""
    _send(pid, "SIGCONT")


def _stop(workers: _Workers, graceful: bool = True) -> None:
    """Stop the workers: asked to (where `graceful`), then terminated, then killed."""
    workers.broken = True
    if graceful:
        for proc, conn in zip(workers.procs, workers.conns):
            if proc.is_alive():
                with contextlib.suppress(Exception):
                    conn.send(("stop",))
        deadline = time.monotonic() + 10
        for proc in workers.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in workers.procs:
        if proc.is_alive():
            proc.terminate()
            _continue(proc.pid)
    for proc in workers.procs:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in workers.conns:
        conn.close()
    if workers.meeting is not None:  # once no worker uses the head's store
        workers.meeting.leave()
