"""Build + run on local CPU devices gives the single-device model's outputs."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import small_gpt2, small_llama, token_ids

import tessel


@pytest.fixture
def session():
    tessel.initialize()
    sess = tessel.Session()
    yield sess
    tessel.finalize()


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("make", [small_llama, small_gpt2], ids=["llama", "gpt2"])
def test_partitioned_run_matches_single_device(make, devices, tmp_path, session):
    model = make()
    ids = token_ids()
    with torch.no_grad():
        reference = model(ids)
    built = tessel.build(model, (ids,), cluster=devices)
    path = tessel.save(built, tmp_path / "model")
    assert path.suffix == ".tessel"
    session.load_graph(0, {}, path)
    (out,) = session.run_graph(0, [ids])
    assert out.shape == reference.shape
    assert (out - reference).abs().max().item() <= 1e-4
    # a second run with other inputs gives the other answer
    other = token_ids(seed=7)
    with torch.no_grad():
        reference2 = model(other)
    (out2,) = session.run_graph(0, [other])
    assert (out2 - reference2).abs().max().item() <= 1e-4


def test_replicated_mode_balances_runs_over_replicas(tmp_path, session):
    model = small_llama()
    ids = token_ids()
    with torch.no_grad():
        reference = model(ids)
    built = tessel.build(model, (ids,), cluster=2, graph_parallel=False)
    assert built.manifest.mode == "replicated"
    session.load_graph(3, {}, tessel.save(built, tmp_path / "rep"))
    graph = session._graphs[3]
    for _ in range(4):
        (out,) = session.run_graph(3, [ids])
        assert (out - reference).abs().max().item() <= 1e-4
    assert graph.next_replica == 0  # 4 runs went round both replicas twice
    assert len(graph.procs) == 2


def test_cann_build_api_names(tmp_path):
    cluster = tmp_path / "numa_config_2p.json"
    cluster.write_text(
        '{"cluster": [{"cluster_nodes": [{"node_id": 0, "node_type": "ATLAS800", "ipaddr": "127.0.0.1",'
        ' "port": 2509, "is_local": true, "item_list": [{"item_id": 0}, {"item_id": 1}]}]}],'
        ' "item_def": [{"item_type": "cpu"}]}'
    )
    policy = tmp_path / "parallel_option.json"
    policy.write_text(
        '{"graph_parallel_option": {"auto": true, "tensor_parallel_option": {"tensor_parallel_size": 2}}}'
    )
    model = small_llama()
    ids = token_ids()
    tessel.build_initialize({tessel.CLUSTER_CONFIG: str(cluster)})
    built = tessel.build_model(
        model,
        (ids,),
        {
            tessel.DISTRIBUTED_CLUSTER_BUILD: "1",
            tessel.ENABLE_GRAPH_PARALLEL: "1",
            tessel.GRAPH_PARALLEL_OPTION_PATH: str(policy),
        },
    )
    path = tessel.save_model(tmp_path / "cann_api", built)
    tessel.build_finalize()
    manifest = built.manifest
    assert manifest.mode == "partitioned" and manifest.world_size == 2
    assert [s.logical_device for s in manifest.submodels] == ["0:0:0", "0:0:1"]
    assert path.exists()


def test_the_cann_build_api_refuses_an_option_it_does_not_read():
    """build_initialize's and build_model's options: a key neither reads is refused by name
    (with the closest known key) before anything is built, never accepted and ignored."""
    with pytest.raises(tessel.ConfigError, match="did you mean 'ge.enableGraphParallel'"):
        tessel.build_initialize({"ge.enableGraphParalel": "1"})
    with pytest.raises(tessel.ConfigError, match="build_model options: ge.precision_mode"):
        tessel.build_model(small_llama(), (token_ids(),), {"ge.precision_mode": "fp16"})
    with pytest.raises(tessel.ConfigError, match="expected a dict, found list"):
        tessel.build_initialize([tessel.CLUSTER_CONFIG])
    tessel.build_finalize()
