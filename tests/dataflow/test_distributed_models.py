"""Model nodes of distributed tessel packages: a partitioned one runs through a Session on the
package's devices (one instance), a replicated one loads the whole model per instance."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import small_llama, token_ids
from tests.dataflow.conftest import _Affine, affine_reference, write_json

import tessel
import tessel.dataflow as df
from tessel.capture import capture
from tessel.config import cluster_from_dict
from tessel.dataflow.errors import RULE_CAN_RUN, RULE_ONE_SESSION
from tessel.demo import tight_cluster
from tessel.package import Package
from tessel.plan import has_rule


@pytest.fixture(scope="module")
def llama_tp2(tmp_path_factory):
    """A 1-layer Llama partitioned over 2 CPU devices too small for its whole weights."""
    model = small_llama(layers=1, hidden=256, heads=8, kv_heads=8, vocab=8192)
    path = tmp_path_factory.mktemp("models") / "llama_tp2"
    ids = token_ids(1, 8, 8192)
    tight = tight_cluster(capture(model, (ids,), keep=has_rule), 2)
    cluster = cluster_from_dict(tight, "tight.json")
    built = tessel.build(model, (ids,), cluster=cluster, verify=False)
    return model, tessel.save(built, path)


@pytest.fixture(scope="module")
def affine_replicated(tmp_path_factory):
    """The affine model built replicated over 2 CPU devices (no graph parallelism)."""
    path = tmp_path_factory.mktemp("models") / "affine_r2"
    built = tessel.build(_Affine(), (torch.ones(2, 4),), cluster=2, graph_parallel=False)
    return tessel.save(built, path)


def test_a_model_node_runs_a_partitioned_package(llama_tp2, cluster4):
    model, path = llama_tp2
    manifest = Package.open(path).manifest
    # the ranks exchange activations: rank 0's program alone would not give the logits
    assert manifest.mode == "partitioned" and manifest.world_size == 2
    assert any(s.comm_groups for s in manifest.submodels)
    x = df.FlowData(name="ids")
    llm = df.GraphProcessPoint(df.Framework.TESSEL, str(path), name="llm").fnode()
    g = df.FlowGraph([llm(x)])
    batches = [token_ids(1, 8, 8192, seed) for seed in (2, 3)]
    for ids in batches:
        g.feed_data({x: ids})
    for ids in batches:
        (logits,), _, code = g.fetch_data(timeout=120_000)
        assert code == df.SUCCESS
        with torch.no_grad():
            torch.testing.assert_close(logits, model(ids), rtol=1e-4, atol=1e-4)


def test_a_partitioned_package_is_refused_on_several_instances(llama_tp2, tmp_path, cluster4):
    _, path = llama_tp2
    deploy = write_json(
        tmp_path / "deploy.json",
        {"batch_deploy_info": [{"flow_node_list": ["llm"], "logic_device_list": "0:0:0~1"}]},
    )
    x = df.FlowData()
    llm = df.GraphProcessPoint(df.Framework.TESSEL, str(path), name="llm").fnode()
    g = df.FlowGraph([llm(x)], {df.DEPLOY_INFO_OPTION: deploy})
    with pytest.raises(df.DeployError) as caught:
        g.plan()
    err = caught.value
    assert err.rule == RULE_ONE_SESSION and err.node == "llm"
    assert str(path) in str(err) and "deploy.json" in str(err) and "one instance" in str(err)
    assert g.worker_pids() == []


def test_a_partitioned_package_is_refused_on_ray(llama_tp2, cluster4):
    _, path = llama_tp2
    x = df.FlowData()
    llm = df.GraphProcessPoint(df.Framework.TESSEL, str(path), name="llm").fnode()
    g = df.FlowGraph([llm(x)], {"tessel.dataflow.backend": "ray"})
    with pytest.raises(df.DeployError, match="local executor") as caught:
        g.start()
    assert caught.value.rule == RULE_CAN_RUN and caught.value.node == "llm"
    assert str(path) in str(caught.value)


def test_a_replicated_package_runs_on_every_instance(affine_replicated, tmp_path, cluster4):
    assert Package.open(affine_replicated).manifest.world_size == 2
    deploy = write_json(
        tmp_path / "deploy.json",
        {"batch_deploy_info": [{"flow_node_list": ["affine"], "logic_device_list": "0:0:0~1"}]},
    )
    x = df.FlowData()
    node = df.GraphProcessPoint(df.Framework.TESSEL, str(affine_replicated), name="affine")
    g = df.FlowGraph([node.fnode()(x)], {df.DEPLOY_INFO_OPTION: deploy})
    ts = [torch.randn(2, 4) for _ in range(4)]  # round-robin: two per instance
    for t in ts:
        g.feed_data({x: t})
    for t in ts:
        (y,), _, _ = g.fetch_data(timeout=60_000)
        torch.testing.assert_close(y, affine_reference(t))
    assert len(g.worker_pids()) == 2


class _Loss(torch.nn.Module):
    """A training step's model: a scalar loss."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).pow(2).mean()


def test_a_training_package_is_refused_as_a_model_node(tmp_path, cluster4):
    model = _Loss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    built = tessel.build(model, (torch.ones(2, 4),), cluster=1, optimizer=opt)
    path = built.save(tmp_path / "step")
    x = df.FlowData()
    node = df.GraphProcessPoint(df.Framework.TESSEL, str(path), name="step").fnode(1, 1)
    g = df.FlowGraph([node(x)])
    with pytest.raises(df.DeployError, match="training package") as caught:
        g.plan()
    assert caught.value.rule == RULE_CAN_RUN and caught.value.node == "step"
    assert str(path) in str(caught.value)
