"""Helpers: write a deploy template that places every node on the first device.

The first device is the one placement.py uses without a deploy file (`first_device`): device 0 of
the first node of the cluster config, so the template and the default placement agree even when
that node's `node_id` is not 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from tessel.config.cluster import ClusterConfig, local_cluster
from tessel.dataflow import session
from tessel.dataflow.placement import first_device

if TYPE_CHECKING:
    from tessel.dataflow.graph import FlowGraph


def _cluster() -> ClusterConfig:
    """The current session's cluster, or (before `init`) the local default's (node_id 0)."""
    return session.cluster() if session.is_initialized() else local_cluster(1, "cpu")


def deploy_template(graph: FlowGraph, device: str | None = None) -> dict:
    """The deploy-info object placing each node (by alias, else name) on `device` (default: the
    first device of the session's cluster)."""
    where = device or str(first_device(_cluster()))
    return {
        "batch_deploy_info": [
            {"flow_node_list": [n.deploy_name], "logic_device_list": where}
            for n in graph.spec.nodes
        ]
    }


def generate_deploy_template(
    graph: FlowGraph, file_path: str | Path, cluster: ClusterConfig | None = None
) -> None:
    """Write a data_flow_deploy_info.json with every node on the first device, ready to edit.

    The first device is that of `cluster`, else of the cluster `df.init` read."""
    device = str(first_device(cluster)) if cluster is not None else None
    Path(file_path).write_text(
        json.dumps(deploy_template(graph, device), indent=2) + "\n", encoding="utf-8"
    )
