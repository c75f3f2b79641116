"""The cluster config and policy files, read as CANN's published examples write them, and their
errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessel.config import ConfigError, load_json, read_cluster_config, read_parallel_option
from tessel.config.cluster import cluster_from_dict, local_cluster_dict
from tessel.config.parallel_option import parallel_option_from_dict

DATA = Path(__file__).parent / "data"
GiB = 1024**3


def test_inference_example_with_comments_expands_device_list():
    cluster = read_cluster_config(DATA / "numa_config_inference.json", "Ascend910B")
    # one item holding two physical devices: device count = item_list x device_list
    assert cluster.world_size == 2
    assert [d.device_id for d in cluster.devices] == [0, 1]
    assert cluster.devices[0].logical_id == "0:0:0"


def test_a2_example_memory_and_links_come_from_the_file():
    cluster = read_cluster_config(DATA / "numa_config_a2.json", "Ascend910B")
    assert cluster.world_size == 4
    assert cluster.devices[2].memory_bytes == 64 * GiB
    assert cluster.link_bandwidth == pytest.approx(128e9 / 8)
    assert cluster.network_bandwidth == pytest.approx(200e9 / 8)
    assert cluster.nodes[0].resource_type == "Aarch"


def test_silent_file_uses_soc_defaults():
    cluster = cluster_from_dict(local_cluster_dict(2), "x", "H100")
    assert cluster.devices[0].memory_bytes == 80 * GiB
    assert cluster.soc.backend == "nccl"


def _two_nodes(**overrides) -> dict:
    node = lambda i: {
        "node_id": i,
        "node_type": "T",
        "ipaddr": "127.0.0.1",
        "port": 29000 + i,  # noqa: E731
        "item_list": [{"item_id": 0}, {"item_id": 1}],
    }
    data = {"cluster": [{"cluster_nodes": [node(0), node(1)]}], "item_def": [{"item_type": "cpu"}]}
    data["cluster"][0]["cluster_nodes"][1].update(overrides)
    return data


def test_two_nodes_give_ranks_in_node_order():
    cluster = cluster_from_dict(_two_nodes(), "two.json")
    assert [d.logical_id for d in cluster.devices] == ["0:0:0", "0:0:1", "0:1:0", "0:1:1"]
    assert [d.rank for d in cluster.devices] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "data, key, words",
    [
        ({"cluster": []}, "cluster", "at least one"),
        (
            {"cluster": [{"cluster_nodes": [{"node_type": "T", "item_list": [{"item_id": 0}]}]}]},
            "cluster[0].cluster_nodes[0].node_id",
            "required key is missing",
        ),
        (
            {"cluster": [{"cluster_nodes": [{"node_id": "0", "item_list": [{"item_id": 0}]}]}]},
            "cluster[0].cluster_nodes[0].node_id",
            "expected an integer in 0..2147483647, found string '0'",
        ),
        (
            {
                "cluster": [
                    {
                        "cluster_nodes": [
                            {"node_id": 0, "item_list": [{"item_id": 0}, {"item_id": 0}]}
                        ]
                    }
                ]
            },
            "cluster[0].cluster_nodes[0].item_list[1].item_id",
            "appears twice",
        ),
        (
            {
                "cluster": [{"cluster_nodes": [{"node_id": 0, "item_list": [{"item_id": 0}]}]}],
                "item_def": [{"item_type": "cpu", "memory": "lots"}],
            },
            "item_def[0].memory",
            "[DDR:64GB]",
        ),
        (_two_nodes(ipaddr=None) | {}, None, None),
    ],
)
def test_cluster_errors_name_key_and_rule(tmp_path, data, key, words):
    if key is None:  # multi-node without an address
        del data["cluster"][0]["cluster_nodes"][1]["ipaddr"]
        key, words = "cluster[0].cluster_nodes[1].ipaddr", "several nodes"
    path = tmp_path / "numa_config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        read_cluster_config(path)
    message = str(err.value)
    assert str(path) in message and key in message and words in message


def test_unparseable_file_names_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "cluster": [\n    {"cluster_nodes": ]\n}')
    with pytest.raises(ConfigError, match=r"bad.json: not valid JSON at line 3, column"):
        read_cluster_config(path)


def test_published_semi_auto_policy_is_read_as_written():
    # CANN's semi-auto example lacks a comma after "O1"; it is read as written, O1 accepted,
    # its tensor_sharding (training) read for a training build
    option = read_parallel_option(DATA / "parallel_option_semi_auto.json", world_size=2)
    assert option.opt_level == "O1" and option.optimizer_state_sharding
    assert "tensor_sharding.optimizer_state_sharding" in option.training_keys


def test_auto_policy_defaults_to_o2():
    option = parallel_option_from_dict({"graph_parallel_option": {"auto": True}}, "p.json")
    assert option.auto and option.opt_level == "O2" and option.tensor_parallel_size is None


@pytest.mark.parametrize(
    "inner, words",
    [
        ({"opt_level": "O3"}, "found string 'O3'; allowed: 'O2'"),
        (
            {"tensor_parallel_option": {"tensor_parallel_size": 8}},
            "is 8 but the cluster config has 4 devices",
        ),
        (
            {"tensor_sharding": {"model_weight_sharding": "yes"}},
            "tensor_sharding.model_weight_sharding: expected a boolean",
        ),
        (
            {"pipeline_parallel_option": {"pipeline_strategy": "1f1b"}},
            "'pipeline_strategy' is not built yet",
        ),
        (
            {"data_parallel_option": {"data_parallel_size": 3}},
            "data_parallel_size: is 3 but the cluster config has 4 devices",
        ),
        (
            {"optimizer_offload_option": {"offload": "NVME"}},
            "offload: found string 'NVME'; tessel offloads optimizer states to 'cpu' only",
        ),
        (
            {"optimizer_offload_option": {"offload": "cpu", "offload_path": "/nvme"}},
            "'offload_path' (NVMe offload) is not built yet",
        ),
        (
            {"autoo": True},
            "unknown key; did you mean 'auto'? allowed keys here: auto, data_parallel",
        ),
        ({"auto": "yes"}, "graph_parallel_option.auto: expected a boolean, found string 'yes'"),
    ],
)
def test_policy_errors(inner, words):
    with pytest.raises(ConfigError) as err:
        parallel_option_from_dict(
            {"graph_parallel_option": inner}, "parallel_option.json", world_size=4
        )
    assert "parallel_option.json" in str(err.value) and words in str(err.value)


def test_real_cann_files_keep_loading():
    # hicann/ge's two-server test file (two nodes, nodes_topology, node_def, item_def) and the
    # template torchair's exporter writes (its misspelt, empty "nodes_toplogy" included)
    two = read_cluster_config(DATA / "numa_config_2server.json", "Ascend910B")
    assert [len(n.devices) for n in two.nodes] == [2, 1] and two.nodes[0].is_local
    torchair = read_cluster_config(DATA / "numa_config_torchair.json", "Ascend910B")
    assert torchair.world_size == 2 and torchair.devices[1].item_type == "Ascend910"


def _a2() -> dict:
    """The A2 example (every documented key) as a mutable dict."""
    return load_json(DATA / "numa_config_a2.json")


def _node(d: dict, i: int = 0) -> dict:
    return d["cluster"][0]["cluster_nodes"][i]


NINES = "9" * 400


@pytest.mark.parametrize(
    "mutate, key, words",
    [
        (lambda d: _node(d).update(node_id=-1), "cluster_nodes[0].node_id", "found number -1"),
        (lambda d: _node(d).update(node_id=2**63), "node_id", "allowed: 0..2147483647"),
        (lambda d: _node(d)["item_list"][0].update(item_id=2**63), "item_list[0].item_id", "0.."),
        (lambda d: _node(d).update(node_id=True), "node_id", "found boolean true"),
        (lambda d: _node(d).update(node_id=1.0), "node_id", "found number 1.0"),
        (lambda d: _node(d).update(node_id="\u0663"), "node_id", "expected an integer"),
        (lambda d: _node(d).update(port=0), "cluster_nodes[0].port", "allowed: 1..65535"),
        (lambda d: _node(d).update(port=70000), "cluster_nodes[0].port", "allowed: 1..65535"),
        (lambda d: _node(d).update(ipaddr="not an ip"), "[0].ipaddr", "an IP address or a host"),
        (
            lambda d: _node(d)["item_list"][1].update(ipaddr="300.1.1.1"),
            "item_list[1].ipaddr",
            "an IP address or subnet",
        ),
        (
            lambda d: _node(d)["item_list"][2].update(device_id=1),
            "item_list[2].device_id",
            "device_id 1 appears twice (first at cluster[0].cluster_nodes[0].item_list[1]",
        ),
        (lambda d: d["item_def"][0].update(memory="[DDR:0GB]"), "item_def[0].memory", "than 0"),
        (
            lambda d: d["item_def"][0].update(memory=f"[DDR:{NINES}GB]"),
            "item_def[0].memory",
            "at most 1048576TB",
        ),
        (
            lambda d: d["node_def"][0]["item_topology"][0].update(links_mode="HCCS:0Gb"),
            "node_def[0].item_topology[0].links_mode",
            "found string 'HCCS:0Gb'; allowed: more than 0",
        ),
        (lambda d: d["node_def"][0].update(h2d_bw="PCIE:0Gb"), "node_def[0].h2d_bw", "than 0"),
        (
            lambda d: d["cluster"][0]["nodes_topology"].update(protocol=f"RDMA:{NINES}Gb"),
            "cluster[0].nodes_topology.protocol",
            "at most 1000000Tb",
        ),
        (
            lambda d: d["node_def"][0].update(item_type="Ascend999"),
            "node_def[0].item_type",
            "found string 'Ascend999', which no item_def entry defines",
        ),
        (
            lambda d: d["item_def"][0].update(item_type="AscendxxxB2"),
            "node_def[0].item_type",
            "did you mean 'AscendxxxB2'?",
        ),
        (lambda d: _node(d).update(prot=1), "cluster_nodes[0].prot", "did you mean 'port'?"),
        (lambda d: d.update(item_deff=[]), "item_deff", "did you mean 'item_def'?"),
        (lambda d: d.update(RankTable={}), "RankTable", "numa_config format"),
        (
            lambda d: _node(d).update(auth_lib_path="/lib/a\x00b.so"),
            "cluster_nodes[0].auth_lib_path",
            "control characters (such as NUL) are not allowed",
        ),
        (lambda d: _node(d).update(node_type=" ATLAS900"), "node_type", "trailing spaces"),
        (
            lambda d: d["node_def"][0]["item_topology"][0]["links"].append([1, 0]),
            "item_topology[0].links[6]",
            "link between items (0, 1) appears twice",
        ),
        (lambda d: d["node_def"].append(d["node_def"][0]), "node_def[1].node_type", "twice"),
        (
            lambda d: d["node_def"][0].update(resource_type="Arm"),
            "node_def[0].resource_type",
            "allowed: 'X86', 'Aarch'",
        ),
        (
            lambda d: d["cluster"][0]["nodes_topology"]["topos"][0]["devices"].append(3),
            "topos[0].devices",
            "lists 3 twice",
        ),
        (lambda d: _node(d).update(memory=0), "cluster_nodes[0].memory", "found number 0"),
    ],
)
def test_cluster_refuses_nonsense(mutate, key, words):
    data = _a2()
    mutate(data)
    with pytest.raises(ConfigError) as err:
        cluster_from_dict(data, "numa_config.json", "Ascend910B")
    message = str(err.value)
    assert message.startswith("numa_config.json: ") and key in message and words in message


def test_two_local_nodes_are_refused():
    data = load_json(DATA / "numa_config_2server.json")
    _node(data, 1)["is_local"] = True
    with pytest.raises(ConfigError, match=r"cluster_nodes\[1\].is_local: is true here and at"):
        cluster_from_dict(data, "numa_config.json")


def test_unreadable_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="NUL"):
        read_cluster_config(str(tmp_path / "a\x00b.json"))
    with pytest.raises(ConfigError, match="file not found"):
        read_cluster_config(tmp_path / ("x" * 300 + ".json"))
    huge = tmp_path / "huge.json"
    huge.write_text('{"cluster": [{"cluster_nodes": [{"node_id": ' + "9" * 5000 + "}]}]}")
    with pytest.raises(ConfigError, match="huge.json: not valid JSON"):
        read_cluster_config(huge)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    with pytest.raises(ConfigError, match="deep.json: not valid JSON"):
        read_cluster_config(deep)


@pytest.mark.parametrize(
    "inner, words",
    [
        (
            {"tensor_sharding": {"model_weight_prefetch_buffer_size": -1}},
            "tensor_sharding.model_weight_prefetch_buffer_size: found number -1; allowed: 0..1048576",
        ),
        (
            {"tensor_sharding": {"model_weight_prefetch_buffer_size": 10**20}},
            "model_weight_prefetch_buffer_size: found number 100000000000000000000",
        ),
        (
            {"tensor_sharding": {"model_weight_prefetch_buffer_size": "50"}},
            "expected an integer in 0..1048576, found string '50'",
        ),
        (
            {"tensor_parallel_option": {"tensor_parallel_size": 2**63}},
            "tensor_parallel_size: found number 9223372036854775808; allowed: 1..2147483647",
        ),
        (
            {"tensor_parallel_optoin": {}},
            "tensor_parallel_optoin: unknown key; did you mean 'tensor_parallel_option'?",
        ),
        (
            {"tensor_sharding": {"gradient_shard": False}},
            "tensor_sharding.gradient_shard: unknown key; did you mean 'gradient_sharding'?",
        ),
        (
            {"data_parallel_option": {"data_parallel_size": 0}},
            "data_parallel_option.data_parallel_size: found number 0; allowed: 1..2147483647",
        ),
        (
            {"pipeline_parallel_option": {"micro_batch_num": 4}},
            "micro_batch_num: is 4, but micro-batches feed pipeline stages",
        ),
        (
            {"pipeline_parallel_option": {"pipe_stage_num": "2"}},
            "pipe_stage_num: expected an integer in 1..2147483647, found string '2'",
        ),
    ],
)
def test_policy_refuses_nonsense(inner, words):
    with pytest.raises(ConfigError) as err:
        parallel_option_from_dict({"graph_parallel_option": inner}, "parallel_option.json")
    assert str(err.value).startswith("parallel_option.json: graph_parallel_option.")
    assert words in str(err.value)
