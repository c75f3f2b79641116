"""The Ray executor: a graph whose cluster spans several hosts runs as Ray actors.

One actor per node instance, pinned to its server through a custom resource `tessel_node_<id>`
when the Ray cluster defines it (start each host's raylet with `--resources
'{"tessel_node_<id>": 1000}'`). Each transaction is submitted as a chain of actor calls whose
arguments are the upstream calls' object refs, so Ray moves the data (its object store is shared
memory on one host). Same semantics as the local executor (routing.py): round-robin by
transaction id, or the least-loaded instance (fewest unfinished calls) for a one-input node fed by
a balance-scatter node or under `dynamic_schedule_enable`; results in transaction order, failures
reported with the node's name, dead actors skipped.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections import OrderedDict
from typing import Any

from tessel.config.cluster import ClusterConfig
from tessel.dataflow.errors import RULE_CAN_RUN, DeployError, FlowTimeout, TransactionFailed
from tessel.dataflow.executors.routing import pick
from tessel.dataflow.placement import GraphPlacement, Instance
from tessel.dataflow.process_points import FlowGraphProcessPoint, GraphProcessPoint
from tessel.dataflow.runners import runs_in_session
from tessel.dataflow.spec import GraphSpec, NodeSpec

MAX_INFLIGHT_OPTION = "tessel.dataflow.ray_max_inflight"
RAY_ADDRESS_OPTION = "tessel.dataflow.ray_address"
NODE_RESOURCE = "tessel_node_{}"


class NodeFailure(Exception):
    """Raised inside an actor when the node's UDF or model fails; carries the node's name."""

    def __init__(self, node: str, instance: int, error: str, tb: str) -> None:
        super().__init__(node, instance, error, tb)
        self.node, self.instance, self.error, self.tb = node, instance, error, tb

    def __str__(self) -> str:
        return f"node {self.node!r} instance {self.instance}: {self.error}"


class _NodeActor:
    """Body of a node-instance actor (wrapped with ray.remote at start)."""

    def __init__(self, spec: NodeSpec, index: int, count: int, inst: Instance, invoked: Any):
        import torch

        from tessel.dataflow.node_runtime import NodeRuntime

        torch.set_num_threads(1)
        self.name, self.index = spec.deploy_name, index
        try:
            self.rt = NodeRuntime(spec, index, count, inst, invoked)
        except BaseException as exc:  # noqa: BLE001
            raise NodeFailure(
                self.name, index, f"{type(exc).__name__}: {exc}", traceback.format_exc()
            ) from None

    def ready(self) -> bool:
        return True

    def pid(self) -> int:
        return os.getpid()

    def run(self, *inputs: Any) -> Any:
        try:
            outs = self.rt.process(list(inputs))
        except BaseException as exc:  # noqa: BLE001
            raise NodeFailure(
                self.name, self.index, f"{type(exc).__name__}: {exc}", traceback.format_exc()
            ) from None
        return outs[0] if len(outs) == 1 else tuple(outs)


def _pickle_udfs_by_value(spec: NodeSpec) -> None:
    """UDFs from modules Ray workers cannot import (tests, scripts) travel by value."""
    import ray.cloudpickle as cp

    targets = []
    pp = spec.pp
    if hasattr(pp, "udf"):
        targets.append(pp.udf.target)
    for mod_name in {getattr(t, "__module__", None) for t in targets}:
        if not mod_name or mod_name == "__main__" or mod_name.startswith("tessel."):
            continue
        mod = sys.modules.get(mod_name)
        path = getattr(mod, "__file__", "") or ""
        if mod is not None and "site-packages" not in path:
            try:
                cp.register_pickle_by_value(mod)
            except ValueError:
                pass


class RayExecutor:
    """Runs a placed graph as Ray actors."""

    def __init__(
        self,
        spec: GraphSpec,
        placement: GraphPlacement,
        options: dict[str, str],
        cluster: ClusterConfig,
    ) -> None:
        self.spec = spec
        self.placement = placement
        self.options = options
        self.cluster = cluster
        self.max_inflight = int(options.get(MAX_INFLIGHT_OPTION, 64))
        self.actors: dict[str, list[Any]] = {}
        self.dead: set[tuple[str, int]] = set()
        self.inflight: OrderedDict[int, dict] = OrderedDict()
        self.balanced = {n.name for n in spec.nodes if self._balanced(n)}
        self.running: dict[tuple[str, int], list[Any]] = {}  # balanced nodes: unfinished calls
        self.closed = False
        self._owns_ray = False

    def _refuse_partitioned(self, spec: GraphSpec) -> None:
        """A partitioned tessel model runs through a Session that starts its own worker
        processes on the package's devices, which a Ray actor (given at most one GPU) cannot."""
        for n in spec.nodes:
            for key, pp in [("", n.pp), *n.invoked.items()]:
                if isinstance(pp, FlowGraphProcessPoint):
                    self._refuse_partitioned(pp.flow_graph.spec)
                elif isinstance(pp, GraphProcessPoint) and runs_in_session(pp):
                    raise DeployError(
                        self.placement.source,
                        None,
                        RULE_CAN_RUN,
                        f"model {pp.graph_file} is partitioned over {runs_in_session(pp)} "
                        "devices and runs through a tessel Session, which only the local "
                        "executor starts (tessel.dataflow.backend=local, the default for a cluster "
                        "config of one node); on Ray, use a replicated build",
                        f"{n.deploy_name}/{key}" if key else n.deploy_name,
                    )

    def start(self) -> None:
        self._refuse_partitioned(self.spec)
        import ray

        if not ray.is_initialized():
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            ray.init(
                address=self.options.get(RAY_ADDRESS_OPTION) or None,
                include_dashboard=False,
                log_to_driver=False,
            )
            self._owns_ray = True
        have = set(ray.cluster_resources())
        remote = ray.remote(_NodeActor)
        pending = []
        for n in self.spec.nodes:
            _pickle_udfs_by_value(n)
            np_ = self.placement.nodes[n.name]
            handles = []
            for i, inst in enumerate(np_.instances):
                opts: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}
                key = NODE_RESOURCE.format(inst.device.server)
                if key in have:
                    opts["resources"] = {key: 0.001}
                if inst.kind == "cuda":
                    opts["num_gpus"] = 1
                    inst = Instance(inst.device, "cuda:0", inst.kind, inst.ipaddr)
                a = remote.options(**opts).remote(n, i, len(np_.instances), inst, np_.invoked)
                handles.append(a)
                pending.append((n, i, a))
            self.actors[n.name] = handles
        for n, i, a in pending:
            try:
                ray.get(a.ready.remote())
            except Exception as exc:  # noqa: BLE001
                self.close()
                cause = getattr(exc, "cause", None) or exc
                raise RuntimeError(
                    f"node {n.deploy_name!r} instance {i} failed to start on Ray: {cause}"
                ) from None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        import ray

        for tid in list(self.inflight):
            self.inflight.pop(tid)
        if ray.is_initialized():
            for handles in self.actors.values():
                for a in handles:
                    try:
                        ray.kill(a)
                    except Exception:  # noqa: BLE001
                        pass
            if self._owns_ray:
                ray.shutdown()

    def _balanced(self, n: NodeSpec) -> bool:
        """Whether `n` takes its least-loaded instance: one input, fed by a balance-scatter
        node or with the deploy file's dynamic_schedule_enable (as the local executor)."""
        if n.n_in != 1:
            return False
        src = n.sources[0]
        return self.placement.dynamic_schedule or (
            src[0] == "node" and self.spec.node(src[1]).scatter
        )

    def _load(self, name: str, idx: int) -> int:
        """Unfinished calls of one actor of a balanced node (finished ones are dropped)."""
        import ray

        refs = self.running.get((name, idx), [])
        if refs:
            _, refs = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            self.running[(name, idx)] = refs
        return len(refs)

    def _choose(self, n: NodeSpec, tid: int) -> int | None:
        return pick(
            len(self.actors[n.name]),
            tid,
            lambda i: (n.name, i) not in self.dead,
            n.n_in == 1,
            n.name in self.balanced,
            lambda i: self._load(n.name, i),
        )

    def submit(self, tid: int, values: list[Any], info: tuple, timeout_s: float | None) -> None:
        import ray

        if self.closed:
            raise RuntimeError("the graph is finalized")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        unsettled = [e for e in self.inflight.values() if "fail" not in e and not e.get("settled")]
        while len(unsettled) >= self.max_inflight:  # bounded: wait for the oldest to finish
            oldest = unsettled[0]
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            n = len(oldest["outputs"])
            ready, _ = ray.wait(oldest["outputs"], num_returns=n, timeout=left, fetch_local=False)
            if len(ready) < n:
                raise FlowTimeout(f"feed: transaction {tid} found no room within {timeout_s} s")
            oldest["settled"] = True
            unsettled.pop(0)
        refs: dict[tuple, Any] = {("data", k): v for k, v in enumerate(values)}
        chain = []
        for n in self.spec.nodes:
            idx = self._choose(n, tid)
            if idx is None:
                self.inflight[tid] = {
                    "fail": TransactionFailed(
                        tid, n.deploy_name, -1, f"no live instance of node {n.deploy_name!r}"
                    ),
                    "outputs": [],
                    "info": info,
                }
                return
            args = [refs[s] for s in n.sources]
            out = self.actors[n.name][idx].run.options(num_returns=n.n_out).remote(*args)
            outs = [out] if n.n_out == 1 else list(out)
            if n.name in self.balanced:
                self.running.setdefault((n.name, idx), []).append(outs[0])
            chain.append((n.deploy_name, n.name, idx, outs))
            for o, r in enumerate(outs):
                refs[("node", n.name, o)] = r
        self.inflight[tid] = {
            "outputs": [refs[("node", name, o)] for name, o in self.spec.outputs],
            "chain": chain,
            "info": info,
        }

    def _failure(self, tid: int, entry: dict, exc: Exception) -> TransactionFailed:
        import ray

        for deploy_name, name, idx, outs in entry["chain"]:
            for r in outs:
                try:
                    ray.get(r, timeout=0)
                except ray.exceptions.RayActorError as e:
                    self.dead.add((name, idx))
                    return TransactionFailed(
                        tid, deploy_name, idx, f"actor died: {e.__class__.__name__}"
                    )
                except ray.exceptions.RayTaskError as e:
                    cause = e.cause
                    if isinstance(cause, NodeFailure):
                        return TransactionFailed(
                            tid, cause.node, cause.instance, cause.error, cause.tb
                        )
                    return TransactionFailed(tid, deploy_name, idx, str(cause))
                except Exception:  # noqa: BLE001
                    continue
        return TransactionFailed(tid, "<graph>", -1, f"{type(exc).__name__}: {exc}")

    def result(self, tid: int, timeout_s: float | None) -> Any:
        import ray

        entry = self.inflight.get(tid)
        if entry is None:
            return TransactionFailed(tid, "<graph>", -1, "the graph was finalized")
        if "fail" in entry:
            self.inflight.pop(tid)
            return entry["fail"]
        try:
            outs = ray.get(entry["outputs"], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise FlowTimeout(f"transaction {tid}: no result within {timeout_s} s") from None
        except Exception as exc:  # noqa: BLE001 - any failure of the chain fails the transaction
            self.inflight.pop(tid)
            return self._failure(tid, entry, exc)
        self.inflight.pop(tid)
        return outs, entry["info"]
