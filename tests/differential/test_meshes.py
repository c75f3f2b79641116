"""Plans on a mesh of nodes x devices compute what eager computes.

A tensor-parallel group that spans nodes of several devices is planned on two mesh axes,
`tp_node` (across the nodes, on the network) and `tp` (within each node): each tensor takes a
placement per axis. Each run meets devices too small for the replicated weights, so weights are
cut on both axes, and an odd count on one axis (shards that do not divide).
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import record_memory_model

import tessel
from tessel.builder.verify import tolerance
from tessel.capture import capture
from tessel.config.cluster import cluster_from_dict, local_cluster_dict
from tessel.demo import tight_cluster, weight_bytes
from tessel.package.manifest import Mesh
from tessel.plan import has_rule

from .zoo import FAMILIES

RUNS = [("gpt2", 2, 2), ("llama", 3, 2), ("bert", 2, 3)]  # (family, nodes, devices per node)


def nodes_of_devices(nodes: int, per_node: int, memory: str) -> dict:
    """`nodes` local nodes of `per_node` devices, each device holding `memory`."""
    data = local_cluster_dict(per_node)
    first = data["cluster"][0]["cluster_nodes"][0]
    data["cluster"][0]["cluster_nodes"] = [
        {**first, "node_id": i, "ipaddr": f"127.0.0.{i + 1}", "is_local": i == 0}
        for i in range(nodes)
    ]
    data["item_def"][0]["memory"] = memory
    return data


@pytest.mark.parametrize("family,nodes,per_node", RUNS, ids=[f"{f}-{n}x{d}" for f, n, d in RUNS])
def test_a_plan_over_nodes_of_devices_equals_eager(family, nodes, per_node, record_property):
    spec = FAMILIES[family]
    model = spec.make()
    inputs = spec.inputs(per_node)  # a batch that the whole mesh does not divide
    captured = capture(model, inputs, keep=has_rule)
    # sized on one axis of every device, with room for what two axes cost in buffers
    tight = tight_cluster(captured, nodes * per_node, slack=0.5)["item_def"][0]["memory"]
    cluster = cluster_from_dict(nodes_of_devices(nodes, per_node, tight), "nodes.json")
    built = tessel.build(captured, cluster=cluster, verify=True)

    manifest = built.manifest
    assert manifest.mesh == Mesh((nodes, per_node), ("tp_node", "tp"))
    plan = manifest.plan
    assert plan.verify.max_relative_diff <= tolerance(torch.float32)
    record_memory_model(record_property, plan)
    for rank in plan.ranks:
        assert rank.peak_bytes <= plan.memory.device_bytes, rank.rank
        assert rank.weight_bytes < weight_bytes(captured)
    placements = [p for layer in plan.layers.values() for p in layer.values()]
    assert any(all(p.startswith("S") for p in ps) for ps in placements)  # cut on both axes
    # what a collective's group spans is what the plan's axis says: a `tp` group is one node's
    node_of = {s.rank: s.node_id for s in manifest.submodels}
    groups = {g for s in manifest.submodels for g in s.comm_groups}
    for g in groups:
        if len(g) == per_node and len({node_of[r] for r in g}) == 1:
            continue
        assert len(g) in (nodes, nodes * per_node), g  # across the nodes, or the whole mesh
