"""The cluster config (CANN's numa_config format): nodes, devices, memory and links.

Reads `cluster[].cluster_nodes[]`, `item_def`, `node_def` and `nodes_topology` as the CANN documents
write them. Device memory and link bandwidths come from the file; where it is silent, the soc's
documented defaults apply.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from tessel.config.errors import ConfigError
from tessel.config.fields import (
    MAX_ID,
    Fields,
    Unique,
    describe,
    int_value,
    is_hostname,
    is_ip,
    str_value,
    suggest,
)
from tessel.config.jsonfile import load_json
from tessel.config.soc import SOCS, GiB, SocProfile, is_known_soc, soc_profile

_MEMORY = re.compile(
    r"\s*\[?\s*(?:[A-Za-z0-9_]+\s*:)?\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?B)\s*\]?\s*", re.I
)
_BANDWIDTH = re.compile(r"\s*([A-Za-z0-9_]+)?\s*:?\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT])b\s*")
# A bare protocol name or list of them ("RDMA", "[HCCS,PCIE,ROCE]"): no figure, use the default.
_NAMES = re.compile(r"\s*\[?\s*[A-Za-z0-9_]+(?:\s*,\s*[A-Za-z0-9_]+)*\s*\]?\s*")
_AIC_TYPE = re.compile(
    r"\s*\[?\s*[A-Za-z0-9_]+\s*:\s*[1-9][0-9]{0,5}"
    r"(?:\s*,\s*[A-Za-z0-9_]+\s*:\s*[1-9][0-9]{0,5})*\s*\]?\s*"
)
_MEMORY_MODE = re.compile(r"\s*\[?\s*(?:NUMA|UMA)\s*\]?\s*", re.I)
_PORTS = re.compile(r"\s*([0-9]{1,5})\s*(?:[~-]\s*([0-9]{1,5}))?\s*")
_UNITS = {"B": 1, "KB": 1024, "MB": 1024**2, "GB": GiB, "TB": 1024**4}
_BITS = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
# Upper bounds far above any real device and far below an overflow.
_MAX_MEMORY = (2**60, "1048576TB")
_MAX_BITS = (10**18, "1000000Tb")  # per second
MAX_HOST_MEMORY = 2**50  # a node's `memory` (CANN documents GB; its example looks like KB)
RESOURCE_TYPES = ("X86", "Aarch")
Fail = Callable[[str], Exception]

# The keys CANN's files carry at each level (tessel reads some and checks all). Torchair's
# generator writes `nodes_toplogy`, so the misspelling is accepted as a synonym.
_TOP_KEYS = ("cluster", "item_def", "node_def")
_CLUSTER_KEYS = ("cluster_nodes", "nodes_topology", "nodes_toplogy")
_NODE_KEYS = (
    "node_id",
    "node_type",
    "ipaddr",
    "port",
    "data_panel",
    "memory",
    "is_local",
    "auth_lib_path",
    "deploy_res_path",
    "item_list",
)
_ITEM_KEYS = ("item_id", "device_id", "ipaddr", "plane_id")
_TOPOLOGY_KEYS = ("type", "protocol", "topos")
_PLANE_KEYS = ("plane_id", "devices")
_NODE_DEF_KEYS = (
    "node_type",
    "resource_type",
    "support_links",
    "item_type",
    "inter_item_memory_access_mode",
    "h2d_bw",
    "item_topology",
    "item",
)
_ITEM_TOPOLOGY_KEYS = ("links_mode", "links")
_ITEM_PAIR_KEYS = ("item_id", "pair_item_id")
_ITEM_DEF_KEYS = ("item_type", "memory", "aic_type", "resource_type", "device_list", "links_mode")
_RANK_TABLE = (
    "belongs to the RankTable cluster config of HCCL offline compilation, which tessel does not "
    "read; write the numa_config format (cluster, item_def, node_def)"
)


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


def _amount(text: str, number: str, scale: int, limit: tuple[int, str], fail: Fail) -> Decimal:
    """`number` (ASCII digits, maybe a fraction, from `text`) times `scale`, refused unless more
    than 0 and at most `limit` (a value and how to write it). Decimal: no float overflow."""
    value = Decimal(number) * scale
    if not 0 < value <= limit[0]:
        raise fail(f"found {describe(text)}; allowed: more than 0, at most {limit[1]}")
    return value


def parse_memory(text: str, source: Any, key: str) -> int:
    """`"[DDR:64GB]"` (or `"64GB"`, `"512MB"`, `"1024B"`) -> bytes, at least 1."""
    fail: Fail = lambda message: ConfigError(source, key, message)
    m = _MEMORY.fullmatch(text)
    if not m:
        raise fail(f'expected a memory size like "[DDR:64GB]", found {describe(text)}')
    value = _amount(text, m.group(1), _UNITS[m.group(2).upper()], _MAX_MEMORY, fail)
    if value < 1:
        raise fail(f"found {describe(text)}; that is less than one byte")
    return int(value)


def parse_bandwidth(text: str, source: Any, key: str) -> float | None:
    """`"HCCS:128Gb"` -> bytes/s; a bare protocol name (`"RDMA"`) -> None (use the default)."""
    if _NAMES.fullmatch(text) and not re.search(r"[0-9]\s*[KMGT]b", text):
        return None
    fail: Fail = lambda message: ConfigError(source, key, message)
    m = _BANDWIDTH.fullmatch(text)
    if not m:
        raise fail(f'expected a link like "HCCS:128Gb", found {describe(text)}')
    return float(_amount(text, m.group(2), _BITS[m.group(3)], _MAX_BITS, fail) / 8)


def _address(f: Fields, key: str, hostname: bool) -> str | None:
    """An IP address (or with `hostname`, a DNS name; without, a subnet) at `key`, if present."""
    text = f.string(key, None)
    if text is None:
        return None
    ok = is_ip(text) or (is_hostname(text) if hostname else is_ip(text, network=True))
    if not ok:
        allowed = "an IP address or a host name" if hostname else "an IP address or subnet"
        raise f.error(f"found {describe(text)}; expected {allowed}", key)
    return text


@dataclass
class _ItemDef:
    """What tessel takes from one item_def entry."""

    memory: int | None
    physical: list[int]  # item_def.device_list: the physical devices in one item


def _item_type_ref(f: Fields, key: str, item_defs: dict[str, _ItemDef]) -> str:
    """An item_type that must name an item_def entry or, with none there, a known soc."""
    name = f.string(key)
    if name not in item_defs and not is_known_soc(name):
        known = sorted(item_defs) or sorted(SOCS)
        raise f.error(
            f"found {describe(name)}, which no item_def entry defines; "
            f"{suggest(name, known)}defined: {', '.join(known)}",
            key,
        )
    return name


def _item_defs(top: Fields) -> dict[str, _ItemDef]:
    """Check item_def; its entries by item_type (each type defined once)."""
    out: dict[str, _ItemDef] = {}
    types = Unique("item_type")
    for d in top.children("item_def", []):
        d.check_keys(_ITEM_DEF_KEYS)
        name = d.string("item_type")
        types.add(name, d, "item_type")
        memory = None
        if d.has("memory"):
            memory = parse_memory(d.string("memory"), d.source, d.path("memory"))
        d.string("aic_type", None, pattern=_AIC_TYPE, example="[DAVINCI_V100:32]")
        d.string("resource_type", None, pattern=_NAMES, example="Ascend")
        if d.has("links_mode"):
            parse_bandwidth(d.string("links_mode"), d.source, d.path("links_mode"))
        physical = []
        ids = Unique("device_id")
        for dev in d.children("device_list", []):
            dev.check_keys(("device_id",))
            physical.append(dev.integer("device_id"))
            ids.add(physical[-1], dev, "device_id")
        out[name] = _ItemDef(memory, physical)
    return out


def _link(topo: Fields, index: int, value: Any, seen: Unique) -> None:
    """One item_topology link: `[a, b]` or `{"item_id": a, "pair_item_id": b}`, a != b, each
    pair once."""
    path = f"{topo.path('links')}[{index}]"
    if isinstance(value, dict):
        pair = topo.at(value, "links", index)
        pair.check_keys(_ITEM_PAIR_KEYS)
        ends = [pair.integer("item_id"), pair.integer("pair_item_id")]
    elif isinstance(value, list) and len(value) == 2:
        ends = [int_value(v, 0, MAX_ID, topo.error_at(f"{path}[{i}]")) for i, v in enumerate(value)]
    else:
        raise topo.error_at(path)(
            f"expected a pair of item ids like [0, 1], found {describe(value)}"
        )
    if ends[0] == ends[1]:
        raise topo.error_at(path)(f"links item {ends[0]} to itself")
    seen.add(tuple(sorted(ends)), topo.at({}, "links", index), None)


def _node_defs(
    top: Fields, item_defs: dict[str, _ItemDef]
) -> dict[str, tuple[Fields, float | None]]:
    """node_def entries by node_type (or by item type when the 1.1 form has no node_type), each
    with the bandwidth its item_topology declares."""
    out: dict[str, tuple[Fields, float | None]] = {}
    keys = Unique("node_def for")
    for d in top.children("node_def", []):
        d.check_keys(_NODE_DEF_KEYS)
        node_type = d.string("node_type", None)
        item_types = []
        if d.has("item_type"):
            item_types.append(_item_type_ref(d, "item_type", item_defs))
        for it in d.children("item", []):
            it.check_keys(("item_type",))
            item_types.append(_item_type_ref(it, "item_type", item_defs))
        d.string("resource_type", None, choices=RESOURCE_TYPES)
        d.string("support_links", None, pattern=_NAMES, example="[HCCS,PCIE,ROCE]")
        d.string("inter_item_memory_access_mode", None, pattern=_MEMORY_MODE, example="[NUMA]")
        if d.has("h2d_bw"):
            parse_bandwidth(d.string("h2d_bw"), d.source, d.path("h2d_bw"))
        bandwidth = None
        for topo in d.children("item_topology", []):
            topo.check_keys(_ITEM_TOPOLOGY_KEYS)
            bw = parse_bandwidth(topo.string("links_mode"), topo.source, topo.path("links_mode"))
            bandwidth = bw or bandwidth
            pairs = Unique("link between items")
            for i, link in enumerate(topo.get("links", list, [])):
                _link(topo, i, link, pairs)
        key = node_type or (item_types[0] if item_types else "")
        keys.add(key, d, "node_type" if node_type else "item")
        out[key] = (d, bandwidth)
    return out


def _nodes_topology(t: Fields) -> float | None:
    """Check a nodes_topology; returns the bandwidth its protocol declares, if any."""
    t.check_keys(_TOPOLOGY_KEYS)
    if not t.obj:  # torchair's generator writes an empty object
        return None
    t.string("type", choices=("star",))
    bandwidth = None
    if t.has("protocol"):
        bandwidth = parse_bandwidth(t.string("protocol"), t.source, t.path("protocol"))
    planes = Unique("plane_id")
    for plane in t.children("topos"):
        plane.check_keys(_PLANE_KEYS)
        planes.add(plane.integer("plane_id"), plane, "plane_id")
        plane.int_list("devices", unique=True)
    return bandwidth


def _data_panel(panel: Fields) -> None:
    """A node's data_panel: `avail_ports`, a list of ports or port ranges ("16666~32767")."""
    panel.check_keys(("avail_ports",))
    for i, text in enumerate(panel.get("avail_ports", list, [])):
        fail = panel.error_at(f"{panel.path('avail_ports')}[{i}]")
        m = _PORTS.fullmatch(str_value(text, fail))
        lo, hi = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
        if not (m and 1 <= lo <= hi <= 65535):
            raise fail(f"found {describe(text)}; expected a port or range like '16666~32767'")


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
    """Check a loaded numa_config object in full and turn it into a ClusterConfig."""
    top = Fields(data, source)
    top.check_keys(_TOP_KEYS, {"RankTable": _RANK_TABLE, "HcclCommConfig": _RANK_TABLE})
    soc = soc_profile(soc_version)
    item_defs = _item_defs(top)
    node_defs = _node_defs(top, item_defs)
    clusters = top.children("cluster", nonempty=True)

    link_bw = soc.link_bandwidth
    for _, bandwidth in node_defs.values():
        link_bw = bandwidth or link_bw
    net_bw = soc.network_bandwidth

    nodes: list[Node] = []
    rank = 0
    node_ids = Unique("node_id")
    local: list[str] = []  # where is_local is true
    for ci, cluster in enumerate(clusters):
        cluster.check_keys(_CLUSTER_KEYS)
        for key in ("nodes_topology", "nodes_toplogy"):
            topo = cluster.child(key, None)
            bw = _nodes_topology(topo) if topo is not None else None
            net_bw = bw or net_bw
        cnodes = cluster.children("cluster_nodes", nonempty=True)
        for cn in cnodes:
            cn.check_keys(_NODE_KEYS)
            node_id = cn.integer("node_id")
            node_ids.add(node_id, cn, "node_id")
            node_type = cn.string("node_type", "LOCAL")
            ndef = node_defs.get(node_type, (None, None))[0]
            ipaddr = _address(cn, "ipaddr", hostname=True)
            port = cn.integer("port", 1, 65535, None)
            cn.integer("memory", 1, MAX_HOST_MEMORY, None)
            is_local = cn.boolean("is_local", len(cnodes) == 1)
            if cn.get("is_local", bool, False):
                if local:
                    raise cn.error(
                        f"is true here and at {local[0]}; at most one node is the local machine",
                        "is_local",
                    )
                local.append(cn.path("is_local"))
            cn.string("auth_lib_path", None)
            cn.string("deploy_res_path", None)
            panel = cn.child("data_panel", None)
            if panel is not None:
                _data_panel(panel)
            # The item type of this node: its node_def's, else the one item_def, else the soc.
            item_type = soc_version
            if ndef is not None and ndef.has("item_type"):
                item_type = ndef.string("item_type")
            elif ndef is not None and ndef.get("item", list, []):
                item_type = ndef.children("item")[0].string("item_type")
            elif len(item_defs) == 1:
                item_type = next(iter(item_defs))
            idef = item_defs.get(item_type)
            memory = idef.memory if idef and idef.memory else soc.memory_bytes
            devices = []
            item_ids = Unique("item_id")
            device_ids = Unique("device_id")
            for index, it in enumerate(cn.children("item_list", nonempty=True)):
                it.check_keys(_ITEM_KEYS)
                item_id = it.integer("item_id")
                item_ids.add(item_id, it, "item_id")
                device_id = it.integer("device_id", default=item_id)
                device_ids.add(device_id, it, "device_id" if it.has("device_id") else None)
                _address(it, "ipaddr", hostname=False)
                it.integer("plane_id", default=None)
                # Inference products: one item holds several physical devices (device_list).
                for sub in (idef.physical if idef else None) or [device_id]:
                    devices.append(
                        Device(rank, node_id, index, item_id, sub, item_type, memory, cluster_id=ci)
                    )
                    rank += 1
            nodes.append(
                Node(
                    node_id=node_id,
                    node_type=node_type,
                    ipaddr=ipaddr or "127.0.0.1",
                    port=port if port is not None else 29500,
                    is_local=is_local,
                    devices=tuple(devices),
                    resource_type=(ndef.string("resource_type", "X86") if ndef else "X86"),
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
