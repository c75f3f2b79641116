"""The cluster config (CANN's numa_config format): nodes, devices, memory and links.

Reads `cluster[].cluster_nodes[]`, `item_def`, `node_def` and `nodes_topology` as the CANN documents
write them. Device memory and link bandwidths come from the file; where it is silent, the soc's
documented defaults apply.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessel.config.errors import ConfigError
from tessel.config.fields import Fields
from tessel.config.jsonfile import load_json
from tessel.config.soc import GiB, SocProfile, soc_profile

_MEMORY = re.compile(
    r"^\s*\[?\s*(?:[A-Za-z0-9_]+\s*:)?\s*(\d+(?:\.\d+)?)\s*([KMGT]?B)\s*\]?\s*$", re.I
)
_BANDWIDTH = re.compile(r"^\s*([A-Za-z0-9_]+)?\s*:?\s*(\d+(?:\.\d+)?)\s*([KMGT])b\s*$")
_UNITS = {"B": 1, "KB": 1024, "MB": 1024**2, "GB": GiB, "TB": 1024**4}
_BITS = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


@dataclass(frozen=True)
class Device:
    """One logical device: a rank of the mesh."""

    rank: int
    node_id: int
    item_index: int  # position in the node's item_list (DataFlow's `deviceid`)
    item_id: int
    device_id: int  # physical id on the host (CUDA ordinal, NPU id)
    item_type: str
    memory_bytes: int
    cluster_id: int = 0

    @property
    def logical_id(self) -> str:
        """`cluster:node:item`, as model_relation_config writes a deploy target."""
        return f"{self.cluster_id}:{self.node_id}:{self.item_id}"


@dataclass(frozen=True)
class Node:
    node_id: int
    node_type: str
    ipaddr: str
    port: int
    is_local: bool
    devices: tuple[Device, ...]
    resource_type: str = "X86"


@dataclass(frozen=True)
class ClusterConfig:
    """A parsed cluster: every device in rank order plus the figures the cost model needs."""

    nodes: tuple[Node, ...]
    soc: SocProfile
    link_bandwidth: float  # bytes/s within a node
    network_bandwidth: float  # bytes/s between nodes
    source: str = "<embedded>"
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def devices(self) -> tuple[Device, ...]:
        return tuple(d for n in self.nodes for d in n.devices)

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def head(self) -> Node:
        return self.nodes[0]

    def node(self, node_id: int) -> Node:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise KeyError(node_id)

    def bandwidth(self, ranks: list[int] | tuple[int, ...]) -> float:
        """The slowest link a collective over `ranks` crosses."""
        nodes = {self.devices[r].node_id for r in ranks}
        return self.link_bandwidth if len(nodes) <= 1 else self.network_bandwidth


def parse_memory(text: str, source: Any, key: str) -> int:
    m = _MEMORY.match(text)
    if not m:
        raise ConfigError(source, key, f'expected a memory size like "[DDR:64GB]", found {text!r}')
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_bandwidth(text: str, source: Any, key: str) -> float | None:
    """`"HCCS:128Gb"` -> bytes/s; a bare protocol name (`"RDMA"`) -> None (use the default)."""
    if re.fullmatch(r"\s*\[?[A-Za-z0-9_, ]+\]?\s*", text) and not re.search(r"\d+\s*[KMGT]b", text):
        return None
    m = _BANDWIDTH.match(text)
    if not m:
        raise ConfigError(source, key, f'expected a link like "HCCS:128Gb", found {text!r}')
    return float(m.group(2)) * _BITS[m.group(3)] / 8


def read_cluster_config(path: str | Path, soc_version: str = "cpu") -> ClusterConfig:
    """Parse a numa_config file."""
    return cluster_from_dict(load_json(path), str(path), soc_version)


def local_cluster(num_devices: int, soc_version: str = "cpu", port: int = 29500) -> ClusterConfig:
    """The embedded default: one local node with `num_devices` devices."""
    return cluster_from_dict(
        local_cluster_dict(num_devices, soc_version, port), "<embedded>", soc_version
    )


def local_cluster_dict(num_devices: int, soc_version: str = "cpu", port: int = 29500) -> dict:
    items = [{"item_id": i, "device_id": i} for i in range(num_devices)]
    node = {
        "node_id": 0,
        "node_type": "LOCAL",
        "ipaddr": "127.0.0.1",
        "port": port,
        "is_local": True,
    }
    return {
        "cluster": [{"cluster_nodes": [{**node, "item_list": items}]}],
        "item_def": [{"item_type": soc_version}],
    }


def cluster_from_dict(data: Any, source: str, soc_version: str = "cpu") -> ClusterConfig:
    top = Fields(data, source)
    soc = soc_profile(soc_version)

    item_defs: dict[str, Fields] = {}
    for d in top.children("item_def", []):
        item_defs[d.get("item_type", str)] = d
    node_defs: dict[str, Fields] = {}
    for d in top.children("node_def", []):
        item = d.children("item", [])
        node_type = d.get("node_type", str, None)
        key = node_type or (item[0].get("item_type", str) if item else "")
        node_defs[key] = d

    clusters = top.children("cluster")
    if not clusters:
        raise top.error("expected at least one entry in the list", "cluster")

    link_bw = soc.link_bandwidth
    for d in node_defs.values():
        for topo in d.children("item_topology", []):
            bw = parse_bandwidth(topo.get("links_mode", str), source, topo.path("links_mode"))
            link_bw = bw or link_bw
    net_bw = soc.network_bandwidth

    nodes: list[Node] = []
    rank = 0
    seen_ids: set[int] = set()
    for ci, cluster in enumerate(clusters):
        topo = cluster.child("nodes_topology", None) or cluster.child("nodes_toplogy", None)
        if topo is not None and topo.has("protocol"):
            bw = parse_bandwidth(topo.get("protocol", str), source, topo.path("protocol"))
            net_bw = bw or net_bw
        cnodes = cluster.children("cluster_nodes")
        if not cnodes:
            raise cluster.error("expected at least one node", "cluster_nodes")
        for cn in cnodes:
            node_id = cn.get("node_id", int)
            if node_id in seen_ids:
                raise cn.error(
                    f"node_id {node_id} appears twice; each node needs its own id", "node_id"
                )
            seen_ids.add(node_id)
            node_type = cn.get("node_type", str, "LOCAL")
            ndef = node_defs.get(node_type)
            items = cn.children("item_list")
            if not items:
                raise cn.error("expected at least one item (device)", "item_list")
            devices = []
            item_ids: set[int] = set()
            for index, it in enumerate(items):
                item_id = it.get("item_id", int)
                if item_id in item_ids:
                    raise it.error(f"item_id {item_id} appears twice in this node", "item_id")
                item_ids.add(item_id)
                item_type = soc_version
                if len(item_defs) == 1:
                    item_type = next(iter(item_defs))
                idef = item_defs.get(item_type)
                memory = soc.memory_bytes
                if idef is not None and idef.has("memory"):
                    memory = parse_memory(idef.get("memory", str), source, idef.path("memory"))
                # Inference products: one item holds several physical devices (item_def.device_list).
                physical = (
                    [d.get("device_id", int) for d in idef.children("device_list", [])]
                    if idef
                    else []
                )
                for sub in physical or [it.get("device_id", int, item_id)]:
                    devices.append(
                        Device(rank, node_id, index, item_id, sub, item_type, memory, cluster_id=ci)
                    )
                    rank += 1
            nodes.append(
                Node(
                    node_id=node_id,
                    node_type=node_type,
                    ipaddr=cn.get("ipaddr", str, "127.0.0.1"),
                    port=cn.get("port", int, 29500),
                    is_local=cn.get("is_local", bool, len(cnodes) == 1),
                    devices=tuple(devices),
                    resource_type=(ndef.get("resource_type", str, "X86") if ndef else "X86"),
                )
            )
    if len(nodes) > 1:
        for cn in (c for cl in clusters for c in cl.children("cluster_nodes")):
            for key in ("ipaddr", "port"):
                if not cn.has(key):
                    raise cn.error(
                        "required when the cluster has several nodes (rendezvous address)", key
                    )
    return ClusterConfig(tuple(nodes), soc, link_bw, net_bw, source, raw=data)
