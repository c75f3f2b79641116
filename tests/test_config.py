"""The cluster config and policy files, read as the seed documents write them, and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessel.config import ConfigError, read_cluster_config, read_parallel_option
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


def test_seed_semi_auto_policy_is_read_as_written():
    # the seed's example lacks a comma after "O1"; it is read, then O1 is refused as not built
    with pytest.raises(
        ConfigError, match=r"opt_level: 'O1' \(the dynamic-programming solver\) is not built yet"
    ):
        read_parallel_option(DATA / "parallel_option_semi_auto.json", world_size=2)


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
            {"tensor_sharding": {"model_weight_sharding": True}},
            "tensor_sharding.model_weight_sharding: is true",
        ),
        (
            {"tensor_sharding": {"gradient_sharding": True}},
            "gradient_sharding: is true, but tensor sharding belongs to training",
        ),
        ({"pipeline_parallel_option": {}}, "'pipeline_parallel_option' is not built yet"),
        ({"autoo": True}, "unknown key; did you mean 'auto'? allowed keys here: auto, opt_level"),
        ({"auto": "yes"}, "graph_parallel_option.auto: expected a boolean, found string 'yes'"),
    ],
)
def test_policy_errors(inner, words):
    with pytest.raises(ConfigError) as err:
        parallel_option_from_dict(
            {"graph_parallel_option": inner}, "parallel_option.json", world_size=4
        )
    assert "parallel_option.json" in str(err.value) and words in str(err.value)
