"""Helpers: write a deploy template that places every node on the first device."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tessel.dataflow.graph import FlowGraph


def deploy_template(graph: FlowGraph, device: str = "0:0:0:0") -> dict:
    """The deploy-info object placing each node (by alias, else name) on `device`."""
    return {
        "batch_deploy_info": [
            {"flow_node_list": [n.deploy_name], "logic_device_list": device}
            for n in graph.spec.nodes
        ]
    }


def generate_deploy_template(graph: FlowGraph, file_path: str | Path) -> None:
    """Write a data_flow_deploy_info.json with every node on device 0:0:0:0, ready to edit."""
    Path(file_path).write_text(
        json.dumps(deploy_template(graph), indent=2) + "\n", encoding="utf-8"
    )
