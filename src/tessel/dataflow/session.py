"""Process-wide DataFlow state: `init` options, the cluster config, and every running executor.

`finalize` (also run at exit) stops every executor so no worker outlives the program; workers
also die with their parent (PR_SET_PDEATHSIG and a parent-pid check) and ignore Ctrl-C, which is
the parent's to handle.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from typing import Any

from tessel.config.cluster import ClusterConfig, local_cluster, read_cluster_config

RESOURCE_CONFIG_OPTION = "ge.resourceConfigPath"
RESOURCE_CONFIG_ENV = "RESOURCE_CONFIG_PATH"
SOC_OPTION = "ge.socVersion"
LOCAL_DEVICES_OPTION = "tessel.dataflow.local_devices"

_lock = threading.RLock()
_options: dict[str, str] | None = None
_cluster: ClusterConfig | None = None
_executors: weakref.WeakSet = weakref.WeakSet()


def init(flow_options: dict[str, str] | None = None) -> None:
    """Start DataFlow with GE-style options.

    Args:
        flow_options: `ge.resourceConfigPath` (the cluster config; else the environment's
            `RESOURCE_CONFIG_PATH`; with neither, a local cluster of CPU devices),
            `ge.socVersion`, and `tessel.dataflow.local_devices` (the local cluster's devices,
            default the CPU count, at least 2).
    """
    global _options, _cluster
    opts = {str(k): str(v) for k, v in (flow_options or {}).items()}
    opts["ge.graphRunMode"] = "0"
    soc = opts.get(SOC_OPTION, "cpu")
    path = opts.get(RESOURCE_CONFIG_OPTION) or os.environ.get(RESOURCE_CONFIG_ENV)
    if path:
        cluster = read_cluster_config(path, soc)
    else:
        n = int(opts.get(LOCAL_DEVICES_OPTION, max(2, os.cpu_count() or 1)))
        cluster = local_cluster(n, "cpu")
    with _lock:
        _options, _cluster = opts, cluster


def finalize() -> None:
    """Stop every graph's workers and forget the options."""
    global _options, _cluster
    with _lock:
        executors = list(_executors)
        _options, _cluster = None, None
    for ex in executors:
        try:
            ex.close()
        except Exception:  # noqa: BLE001 - finalize must reach every executor
            pass


def options() -> dict[str, str]:
    if _options is None:
        raise RuntimeError("tessel.dataflow: call df.init(options) before running a graph")
    return dict(_options)


def cluster() -> ClusterConfig:
    if _cluster is None:
        raise RuntimeError("tessel.dataflow: call df.init(options) before running a graph")
    return _cluster


def is_initialized() -> bool:
    return _options is not None


def register_executor(ex: Any) -> None:
    with _lock:
        _executors.add(ex)


def _close_all() -> None:
    for ex in list(_executors):
        try:
            ex.close()
        except Exception:  # noqa: BLE001
            pass


atexit.register(_close_all)
