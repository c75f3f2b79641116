"""FlowGraph: a DAG of FlowNodes from FlowData inputs to outputs, fed and fetched by transaction.

The graph is placed and started lazily on the first feed (as CANN adds it on first feed), so a
deploy template can be written after the graph is built. `feed`/`fetch` take Python objects,
`feed_data`/`fetch_data` tensors with a FlowInfo. Results come back in transaction order; a
failed transaction raises TransactionFailed from fetch (or, with `set_exception_catch(True)`,
returns a non-zero code and leaves the error in `last_error`). Timeouts are in ms, -1 = forever.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import Any

import numpy as np
import torch

from tessel.dataflow import session
from tessel.dataflow.deploy import DEPLOY_INFO_OPTION, read_deploy_info
from tessel.dataflow.errors import TransactionFailed
from tessel.dataflow.flow_info import FlowFlag, FlowInfo
from tessel.dataflow.nodes import FlowData, FlowOutput
from tessel.dataflow.placement import GraphPlacement, Placer
from tessel.dataflow.spec import build_spec

BACKEND_OPTION = "tessel.dataflow.backend"  # auto | local | ray
SUCCESS = 0
FAILED = 1
_names = itertools.count()


def _timeout_s(timeout: int) -> float | None:
    if not isinstance(timeout, int) or timeout < -1:
        raise ValueError(f"timeout must be -1 (forever) or >= 0 ms, found {timeout!r}")
    return None if timeout == -1 else timeout / 1000.0


def _now_us() -> int:
    return time.time_ns() // 1000


class FlowGraph:
    """A flow graph: its nodes each run in worker processes on the devices its deploy info
    names, and transactions flow through them in order.

    Args:
        outputs: The graph's outputs (a node's output, or a list of them); the graph is
            every node they depend on.
        graph_options: GE's AddGraph options, such as the deploy-info path
            (`tessel.dataflow.DEPLOY_INFO_OPTION`).
        name: The graph's name. Default: `FlowGraph_<n>`.
        graphpp_builder_async: GE's option; the graph is built when it is first fed either way.
    """

    def __init__(
        self,
        outputs: list[FlowOutput] | FlowOutput,
        graph_options: dict[str, str] | None = None,
        name: str | None = None,
        graphpp_builder_async: bool = False,
    ) -> None:
        if isinstance(outputs, FlowOutput):
            outputs = [outputs]
        flat: list[FlowOutput] = []
        for o in outputs:
            flat.extend(o if isinstance(o, tuple) else [o])
        self.name = name or f"FlowGraph_{next(_names)}"
        self.graph_options = {str(k): str(v) for k, v in (graph_options or {}).items()}
        self.spec = build_spec(flat, self.name)
        self.outputs = flat
        self.exception_catch = False
        self.contains_n_mapping_node = False
        self.align_attrs: tuple[int, int, bool] | None = None
        self.last_error: TransactionFailed | None = None
        self._executor: Any = None
        self._lock = threading.RLock()
        self._next_tid = 1
        self._fed: deque[tuple[int, FlowInfo | None]] = deque()  # (tid, EOS info or None)

    def __getstate__(self) -> dict:
        # A nested graph travels to Ray actors: its definition only, not its running state.
        state = dict(self.__dict__)
        state.update(_executor=None, _lock=None, _fed=deque())
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def worker_pids(self) -> list[int]:
        """Process ids of this graph's local workers (empty before the first feed, or on Ray)."""
        ex = self._executor
        return ex.worker_pids() if ex is not None and hasattr(ex, "worker_pids") else []

    # ---- settings ----------------------------------------------------------------------
    def set_contains_n_mapping_node(self, contains: bool) -> FlowGraph:
        if contains:
            raise NotImplementedError(
                f"FlowGraph {self.name!r}: n-mapping nodes (one input, many outputs) are not "
                "supported by tessel.dataflow yet"
            )
        self.contains_n_mapping_node = False
        return self

    def set_inputs_align_attrs(
        self, align_max_cache_num: int, align_timeout: int, dropout_when_not_align: bool = False
    ) -> FlowGraph:
        """Accepted and checked; tessel always aligns inputs by transaction id."""
        if not 0 <= align_max_cache_num <= 1024:
            raise ValueError("align_max_cache_num must be in [0, 1024]")
        if align_timeout != -1 and not 0 < align_timeout <= 600_000:
            raise ValueError("align_timeout must be -1 or in (0, 600000] ms")
        self.align_attrs = (align_max_cache_num, align_timeout, dropout_when_not_align)
        return self

    def set_exception_catch(self, enable_exception_catch: bool = False) -> FlowGraph:
        """When on, fetch returns code FAILED for a failed transaction instead of raising."""
        self.exception_catch = bool(enable_exception_catch)
        return self

    # ---- placement ---------------------------------------------------------------------
    def deploy_info_path(self) -> str | None:
        path = self.graph_options.get(DEPLOY_INFO_OPTION)
        if path is None and session.is_initialized():
            path = session.options().get(DEPLOY_INFO_OPTION)
        return path

    def plan(self) -> GraphPlacement:
        """Check the deploy file against this graph and the cluster; the devices of each node."""
        path = self.deploy_info_path()
        info = read_deploy_info(path) if path else None
        return Placer(session.cluster()).place(self.spec, info, path or "<no deploy file>")

    def _backend(self, placement: GraphPlacement) -> str:
        opts = {**session.options(), **self.graph_options}
        backend = opts.get(BACKEND_OPTION, "auto")
        if backend not in ("auto", "local", "ray"):
            raise ValueError(f"{BACKEND_OPTION} must be auto, local or ray, found {backend!r}")
        if backend == "auto":
            backend = "ray" if len(session.cluster().nodes) > 1 else "local"
        return backend

    def _ensure_started(self) -> Any:
        with self._lock:
            if self._executor is not None:
                if self._executor.closed:
                    raise RuntimeError(f"FlowGraph {self.name!r}: finalized")
                return self._executor
            placement = self.plan()
            opts = {**session.options(), **self.graph_options}
            if self._backend(placement) == "ray":
                from tessel.dataflow.executors.ray import RayExecutor

                ex: Any = RayExecutor(self.spec, placement, opts, session.cluster())
            else:
                from tessel.dataflow.executors.local import LocalExecutor

                ex = LocalExecutor(self.spec, placement, opts)
            ex.start()
            session.register_executor(ex)
            self._executor = ex
            return ex

    def start(self) -> FlowGraph:
        """Place and start the graph now (otherwise the first feed does it)."""
        self._ensure_started()
        return self

    def close(self) -> None:
        """Stop this graph's workers."""
        with self._lock:
            if self._executor is not None:
                self._executor.close()

    # ---- feed ----------------------------------------------------------------------------
    def _values(self, feed_dict: dict[FlowData, Any], partial_inputs: bool) -> list[Any]:
        if partial_inputs:
            raise NotImplementedError("partial_inputs=True is not supported by tessel.dataflow yet")
        if not isinstance(feed_dict, dict):
            raise TypeError("feed_dict must map FlowData to values")
        known = {id(d): k for k, d in enumerate(self.spec.datas)}
        values: list[Any] = [None] * len(self.spec.datas)
        seen = set()
        for d, v in feed_dict.items():
            if id(d) not in known:
                raise KeyError(f"FlowGraph {self.name!r}: {d!r} is not an input of this graph")
            values[known[id(d)]] = v
            seen.add(id(d))
        missing = [d.name for d in self.spec.datas if id(d) not in seen]
        if missing:
            raise ValueError(f"FlowGraph {self.name!r}: no value fed for inputs {missing}")
        return values

    def _feed(self, values: list[Any] | None, info: FlowInfo, timeout: int) -> int:
        ex = self._ensure_started()
        with self._lock:
            tid = info.transaction_id or self._next_tid
            if tid < self._next_tid:
                raise ValueError(
                    f"transaction id {tid} is not after the last one ({self._next_tid - 1})"
                )
            if values is None:  # end of stream: nothing to run, it is fetched in order
                self._fed.append((tid, FlowInfo(0, 0, info.flow_flags, tid, info.user_data)))
                self._next_tid = tid + 1
                return SUCCESS
            meta = (info.flow_flags, info.start_time or _now_us(), info.user_data)
            ex.submit(tid, values, meta, _timeout_s(timeout))
            self._fed.append((tid, None))
            self._next_tid = tid + 1
        return SUCCESS

    def feed_data(
        self,
        feed_dict: dict[FlowData, Any],
        flow_info: FlowInfo | None = None,
        timeout: int = -1,
        partial_inputs: bool = False,
    ) -> int:
        """Feed tensors (torch or numpy) as one transaction.

        Args:
            feed_dict: ``{FlowData: tensor}``; an empty dict needs the EOS flag in `flow_info`.
            flow_info: The transaction's flags and user data.
            timeout: Milliseconds the feed may wait; -1 waits as long as it takes.
            partial_inputs: Feed only some of the graph's inputs.

        Returns:
            The return code, 0 on success.
        """
        info = flow_info or FlowInfo()
        if not feed_dict:
            if not info.flow_flags & FlowFlag.DATA_FLOW_FLAG_EOS:
                raise ValueError("feed_data: an empty feed_dict is allowed only with the EOS flag")
            return self._feed(None, info, timeout)
        values = self._values(feed_dict, partial_inputs)
        for i, v in enumerate(values):
            if isinstance(v, np.ndarray):
                values[i] = torch.from_numpy(v)
            elif not isinstance(v, torch.Tensor):
                raise TypeError(
                    f"feed_data: input {self.spec.datas[i].name} is a {type(v).__name__}; "
                    "feed_data takes tensors (use feed for Python objects)"
                )
        return self._feed(values, info, timeout)

    def feed(
        self, feed_dict: dict[FlowData, Any], timeout: int = -1, partial_inputs: bool = False
    ) -> int:
        """Feed Python objects (tensors, arrays, anything picklable) as one transaction.

        Args:
            feed_dict: ``{FlowData: object}``.
            timeout: Milliseconds the feed may wait; -1 waits as long as it takes.
            partial_inputs: Feed only some of the graph's inputs.

        Returns:
            The return code, 0 on success.
        """
        return self._feed(self._values(feed_dict, partial_inputs), FlowInfo(), timeout)

    # ---- fetch ---------------------------------------------------------------------------
    def _next(self, timeout: int) -> tuple[list[Any], FlowInfo, int]:
        # after finalize, what was fed can still be fetched (as failed)
        ex = self._executor if self._executor is not None else self._ensure_started()
        t = _timeout_s(timeout)
        with self._lock:
            if not self._fed:
                raise RuntimeError(f"FlowGraph {self.name!r}: fetch with nothing fed")
            tid, eos = self._fed[0]
        if eos is not None:
            with self._lock:
                self._fed.popleft()
            eos.end_time = _now_us()
            return [], eos, SUCCESS
        res = ex.result(tid, t)  # FlowTimeout leaves the transaction for a later fetch
        with self._lock:
            self._fed.popleft()
        if isinstance(res, TransactionFailed):
            self.last_error = res
            if self.exception_catch:
                return [], FlowInfo(transaction_id=tid, end_time=_now_us()), FAILED
            raise res
        outs, (flags, start, user) = res
        return outs, FlowInfo(start, _now_us(), flags, tid, user), SUCCESS

    @staticmethod
    def _select(outs: list[Any], indexes: list[int] | None) -> list[Any]:
        if indexes is None:
            return outs
        if len(set(indexes)) != len(indexes) or any(not 0 <= i < len(outs) for i in indexes):
            raise ValueError(f"fetch: indexes must be distinct and in 0..{len(outs) - 1}")
        return [outs[i] for i in indexes]

    def fetch_data(
        self, indexes: list[int] | None = None, timeout: int = -1
    ) -> tuple[list[torch.Tensor], FlowInfo, int]:
        """The next transaction's output tensors, in transaction order.

        Args:
            indexes: The outputs to return, by index. Default: all.
            timeout: Milliseconds to wait; -1 waits as long as it takes.

        Returns:
            The tensors, the transaction's `FlowInfo`, and the return code.

        Raises:
            TransactionFailed: A node failed the transaction; the message names it and why.
            FlowTimeout: Nothing arrived within `timeout`.
        """
        outs, info, code = self._next(timeout)
        outs = [torch.from_numpy(o) if isinstance(o, np.ndarray) else o for o in outs]
        return self._select(outs, indexes) if outs else outs, info, code

    def fetch(self, indexes: list[int] | None = None, timeout: int = -1) -> tuple[list[Any], int]:
        """The next transaction's outputs as Python objects.

        Args:
            indexes: The outputs to return, by index. Default: all.
            timeout: Milliseconds to wait; -1 waits as long as it takes.

        Returns:
            The outputs and the return code.
        """
        outs, _, code = self._next(timeout)
        return (self._select(outs, indexes) if outs else outs), code
