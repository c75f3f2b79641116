"""Placement: a graph + a deploy file + a cluster config -> the devices of every node instance.

Applies DataFlow's placement rules, each with its own error (rule names in errors.py), and its
policies for invoked models: a UDF on the host puts the model on the first device of its server, a UDF on a
device puts it on the same device. A nested flow graph runs inline in the invoking UDF's process
(node_runtime.InlineGraph), so its nodes must sit on that UDF's device with one instance each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tessel.config.cluster import ClusterConfig
from tessel.dataflow.deploy import DeployEntry, DeployInfo, InvokeEntry, LogicDevice
from tessel.dataflow.errors import (
    RULE_ALL_PLACED,
    RULE_CAN_RUN,
    RULE_HOST_AND_DEVICE,
    RULE_IN_CLUSTER,
    RULE_INVOKED_COUNT,
    RULE_NESTED_INLINE,
    RULE_NESTED_PARENT,
    RULE_ONCE,
    RULE_ONE_SESSION,
    RULE_SYNTAX,
    RULE_UNKNOWN_NODE,
    DeployError,
)
from tessel.dataflow.process_points import FlowGraphProcessPoint, Framework, GraphProcessPoint
from tessel.dataflow.runners import runs_in_session, tessel_package_mode
from tessel.dataflow.spec import GraphSpec, NodeSpec

_RESOURCE_KIND = {"num_gpus": "cuda", "num_npus": "npu"}


@dataclass
class Instance:
    """One node instance: its logical device, the torch device it binds, the host it runs on."""

    device: LogicDevice
    torch_device: str
    kind: str  # cpu | cuda | npu
    ipaddr: str = "127.0.0.1"


@dataclass
class NodePlacement:
    name: str
    instances: list[Instance]
    # invoke key -> one Instance per parent instance (models) or a nested GraphPlacement
    invoked: dict[str, list[Instance] | GraphPlacement] = field(default_factory=dict)


@dataclass
class GraphPlacement:
    source: str
    nodes: dict[str, NodePlacement]
    dynamic_schedule: bool = False  # deploy file's dynamic_schedule_enable: least-loaded routing

    @property
    def servers(self) -> set[int]:
        out = {i.device.server for n in self.nodes.values() for i in n.instances}
        for n in self.nodes.values():
            for inv in n.invoked.values():
                out |= inv.servers if isinstance(inv, GraphPlacement) else set()
        return out


def first_device(cluster: ClusterConfig) -> LogicDevice:
    """Where everything goes without a deploy file: `0:<first node>:0:0`."""
    head = cluster.nodes[0]
    return LogicDevice(head.devices[0].cluster_id, head.node_id, 0, 0)


class Placer:
    """Checks one graph's placement against one cluster."""

    def __init__(self, cluster: ClusterConfig) -> None:
        self.cluster = cluster

    def instance(self, dev: LogicDevice, source: str, key: str, node: str) -> Instance:
        """Resolve a logical device in the cluster config, or fail naming node and file."""
        try:
            n = self.cluster.node(dev.server)
        except KeyError:
            ids = [x.node_id for x in self.cluster.nodes]
            raise DeployError(
                source,
                key,
                RULE_IN_CLUSTER,
                f"device {dev}: server {dev.server} is not a node_id of the cluster config "
                f"{self.cluster.source} (node_ids: {ids})",
                node,
            ) from None
        cluster_id = n.devices[0].cluster_id
        if dev.cluster != cluster_id:
            raise DeployError(
                source,
                key,
                RULE_IN_CLUSTER,
                f"device {dev}: cluster {dev.cluster} does not hold server {dev.server} in "
                f"{self.cluster.source} (it is in cluster {cluster_id})",
                node,
            )
        if dev.is_host:
            return Instance(dev, "cpu", "cpu", n.ipaddr)
        items = sorted({d.item_index for d in n.devices})
        if dev.device not in items:
            raise DeployError(
                source,
                key,
                RULE_IN_CLUSTER,
                f"device {dev}: server {dev.server} has devices 0..{len(items) - 1} in its "
                f"item_list in {self.cluster.source}; {dev.device} is not one of them",
                node,
            )
        phys = next(d for d in n.devices if d.item_index == dev.device)
        kind = self.cluster.soc.device_type
        torch_dev = "cpu" if kind == "cpu" else f"{kind}:{phys.device_id}"
        return Instance(dev, torch_dev, kind, n.ipaddr)

    def check_runs(self, node: NodeSpec | None, pp: Any, inst: Instance, source: str, key: str):
        """A node must be placed where it can run: model device kind, UDF resources (a logical
        device is one accelerator, so a UDF may ask for at most one GPU or NPU)."""
        name = node.deploy_name if node else pp.name
        if isinstance(pp, GraphProcessPoint):
            if pp.framework is Framework.TESSEL and tessel_package_mode(pp.graph_file)[0] == (
                "training"
            ):
                raise DeployError(
                    source,
                    key,
                    RULE_CAN_RUN,
                    f"model {pp.graph_file} is a training package; a model node runs inference "
                    "packages (built without an optimizer)",
                    name,
                )
            target = pp.target_device_type()
            if target is not None and target != inst.kind:
                where = "the host" if inst.device.is_host else f"a {inst.kind} device"
                raise DeployError(
                    source,
                    key,
                    RULE_CAN_RUN,
                    f"model {pp.graph_file} targets {target} devices but is placed on {where} "
                    f"({inst.device}); place it on a {target} device",
                    name,
                )
            return
        resources = getattr(pp, "resources", {}) or {}
        for res, kind in _RESOURCE_KIND.items():
            want = resources.get(res) or 0
            if isinstance(want, int | float) and want > 1:
                raise DeployError(
                    source,
                    key,
                    RULE_CAN_RUN,
                    f"the UDF asks for {res}={want} but a logical device ({inst.device}) is one "
                    f"accelerator; ask for {res}=1 and place more instances to use more devices",
                    name,
                )
            if want and inst.kind != kind:
                where = "the host" if inst.device.is_host else f"a {inst.kind} device"
                raise DeployError(
                    source,
                    key,
                    RULE_CAN_RUN,
                    f"the UDF asks for {res}={want} but is placed on {where} ({inst.device}), "
                    f"which has no {kind} device; place it on a {kind} device",
                    name,
                )

    def check_one_session(
        self, name: str, pp: Any, insts: list[Instance], source: str, key: str
    ) -> None:
        """A partitioned model runs through one Session whose workers take the package's own
        devices: a second instance would load every rank again on the same devices."""
        if not isinstance(pp, GraphProcessPoint) or len(insts) < 2:
            return
        world = runs_in_session(pp)
        if world:
            raise DeployError(
                source,
                key,
                RULE_ONE_SESSION,
                f"model {pp.graph_file} is partitioned over {world} devices; its instance runs "
                f"it through a tessel Session on the {world} devices of the package's cluster "
                f"config, so it takes one instance, found {len(insts)} "
                f"({', '.join(str(i.device) for i in insts)}). Place it on one device, or build "
                "it replicated (--distributed_cluster_build=1 without --enable_graph_parallel) "
                "to run several instances",
                name,
            )

    def place(self, spec: GraphSpec, info: DeployInfo | None, source: str) -> GraphPlacement:
        """Place every node of `spec`; without `info`, everything on the first device."""
        by_name: dict[str, NodeSpec] = {}
        for n in spec.nodes:
            by_name[n.name] = n
            by_name[n.deploy_name] = n
        chosen: dict[str, tuple[list[LogicDevice], DeployEntry | None, str]] = {}
        if info is None:
            for n in spec.nodes:
                chosen[n.name] = ([first_device(self.cluster)], None, "<default>")
        else:
            source = info.source
            for written, (entry, key) in info.placements().items():
                node = by_name.get(written)
                if node is None:
                    raise DeployError(
                        source,
                        key,
                        RULE_UNKNOWN_NODE,
                        f"graph {spec.name!r} has no node or alias {written!r}; its nodes: "
                        f"{sorted({n.deploy_name for n in spec.nodes})}",
                        written,
                    )
                if node.name in chosen:
                    raise DeployError(
                        source,
                        key,
                        RULE_ONCE,
                        f"is placed twice (by name and alias; first at {chosen[node.name][2]})",
                        node.deploy_name,
                    )
                chosen[node.name] = (entry.devices, entry, key)
            for n in spec.nodes:
                if n.name not in chosen:
                    raise DeployError(
                        source,
                        "batch_deploy_info",
                        RULE_ALL_PLACED,
                        "is not placed; list it (or its alias) in a flow_node_list",
                        n.deploy_name,
                    )
        out: dict[str, NodePlacement] = {}
        for n in spec.nodes:
            devs, entry, key = chosen[n.name]
            out[n.name] = self._place_node(n, devs, entry, source, key)
        return GraphPlacement(source, out, bool(info and info.dynamic_schedule_enable))

    def _place_node(
        self, n: NodeSpec, devs: list[LogicDevice], entry: DeployEntry | None, source: str, key: str
    ) -> NodePlacement:
        hosts = [d for d in devs if d.is_host]
        if hosts and len(hosts) != len(devs):
            raise DeployError(
                source,
                key,
                RULE_HOST_AND_DEVICE,
                f"is placed on the host ({hosts[0]}) and on a device "
                f"({next(d for d in devs if not d.is_host)}); choose one",
                n.deploy_name,
            )
        insts = [self.instance(d, source, key, n.deploy_name) for d in devs]
        for inst in insts:
            self.check_runs(n, n.pp, inst, source, key)
        self.check_one_session(n.deploy_name, n.pp, insts, source, key)
        placed = NodePlacement(n.name, insts)
        invokes = entry.invokes if entry else {}
        for written in invokes:
            if written not in n.invoked:
                raise DeployError(
                    source,
                    invokes[written].key_path,
                    RULE_SYNTAX,
                    f"invoke_name {written!r} is not an invoked closure of this node "
                    f"(it has {sorted(n.invoked)})",
                    n.deploy_name,
                )
        for k, pp in n.invoked.items():
            placed.invoked[k] = self._place_invoked(n, k, pp, insts, invokes.get(k), source, key)
        return placed

    def _place_invoked(
        self,
        n: NodeSpec,
        k: str,
        pp: Any,
        parents: list[Instance],
        entry: InvokeEntry | None,
        source: str,
        key: str,
    ) -> list[Instance] | GraphPlacement:
        if isinstance(pp, FlowGraphProcessPoint):
            if len(parents) > 1:
                raise DeployError(
                    source,
                    key,
                    RULE_NESTED_PARENT,
                    f"invokes flow graph {k!r} and so cannot have several instances; it has "
                    f"{len(parents)} ({', '.join(str(p.device) for p in parents)})",
                    n.deploy_name,
                )
            sub = pp.flow_graph.spec
            if entry is not None and entry.nested is not None:
                nested = self.place(sub, entry.nested, entry.nested.source)
                self._check_inline(sub, nested, n, parents[0], entry.nested)
                return nested
            devs = entry.devices if entry is not None and entry.devices else [parents[0].device]
            placed = {}
            for sn in sub.nodes:
                placed[sn.name] = self._place_node(sn, devs, None, source, key)
            inline = GraphPlacement(source, placed)
            where = f"{entry.key_path}.logic_device_list" if entry is not None else key
            self._check_inline(sub, inline, n, parents[0], None, where)
            return inline
        # an invoked model: one instance per parent instance
        if entry is not None and entry.nested is not None:
            raise DeployError(
                source,
                entry.key_path,
                RULE_SYNTAX,
                f"invoke {k!r} is a model; deploy_info_file is only for invoked flow graphs",
                n.deploy_name,
            )
        if entry is not None and entry.devices:
            if len(entry.devices) != len(parents):
                raise DeployError(
                    source,
                    entry.key_path,
                    RULE_INVOKED_COUNT,
                    f"invoked model {k!r} has {len(entry.devices)} instances but its parent has "
                    f"{len(parents)}; list as many devices as the parent",
                    n.deploy_name,
                )
            devs = entry.devices
            where = entry.key_path
        else:
            # not in the deploy file: a host UDF's model goes to the first device of its server,
            # a device UDF's model to the UDF's own device
            devs = [
                LogicDevice(p.device.cluster, p.device.server, 0, 0)
                if p.device.is_host
                else p.device
                for p in parents
            ]
            where = key
        insts = [self.instance(d, source, where, f"{n.deploy_name}/{k}") for d in devs]
        for inst in insts:
            self.check_runs(None, pp, inst, source, where)
        self.check_one_session(f"{n.deploy_name}/{k}", pp, insts, source, where)
        return insts

    def _check_inline(
        self,
        sub: GraphSpec,
        placed: GraphPlacement,
        parent: NodeSpec,
        at: Instance,
        info: DeployInfo | None,
        key: str = "batch_deploy_info",
    ) -> None:
        """A nested graph runs in its invoking UDF's process (node_runtime.InlineGraph): refuse
        a placement of its nodes elsewhere or with several instances, instead of ignoring it."""
        where = info.placements() if info is not None else {}
        for sn in sub.nodes:
            devs = [i.device for i in placed.nodes[sn.name].instances]
            if devs == [at.device]:
                continue
            found = where.get(sn.deploy_name) or where.get(sn.name)
            raise DeployError(
                placed.source,
                found[1] if found else key,
                RULE_NESTED_INLINE,
                f"is placed on {', '.join(str(d) for d in devs)}, but node "
                f"{parent.deploy_name!r} that invokes its graph {sub.name!r} runs on "
                f"{at.device}; place it on {at.device} with one instance",
                sn.deploy_name,
            )
