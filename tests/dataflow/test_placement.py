"""Placement rules: each has a test showing its own error (node, file and rule named)."""

from __future__ import annotations

import pytest

import tessel.dataflow as df
from tessel.dataflow.errors import (
    RULE_ALL_PLACED,
    RULE_CAN_RUN,
    RULE_HOST_AND_DEVICE,
    RULE_IN_CLUSTER,
    RULE_INVOKED_COUNT,
    RULE_NESTED_PARENT,
    RULE_ONCE,
    RULE_UNKNOWN_NODE,
)

from .conftest import write_cluster, write_json


@df.pyflow
def ident(x):
    return x


@df.pyflow(resources={"num_gpus": 1})
def needs_gpu(x):
    return x


class CallsModel:
    def __call__(self, x):
        return df.get_run_context().run_flow_model("model", [x])[0]


def two_nodes(tmp_path, entries, alias=None):
    x = df.FlowData()
    a = ident.fnode(name="a")
    if alias:
        a.set_alias(alias)
    out = ident.fnode(name="b")(a(x))
    path = write_json(tmp_path / "deploy.json", {"batch_deploy_info": entries})
    return df.FlowGraph([out], {df.DEPLOY_INFO_OPTION: path}), path


def expect(graph, rule, node, path):
    with pytest.raises(df.DeployError) as e:
        graph.plan()
    msg = str(e.value)
    assert e.value.rule == rule, msg
    assert e.value.node == node, msg
    assert str(path) in msg and rule in msg and repr(node) in msg
    return msg


def test_every_node_must_be_placed(tmp_path, cluster4):
    g, p = two_nodes(tmp_path, [{"flow_node_list": ["a"], "logic_device_list": "0:0:0:0"}])
    expect(g, RULE_ALL_PLACED, "b", p)


def test_no_node_twice_by_name_and_alias(tmp_path, cluster4):
    g, p = two_nodes(
        tmp_path,
        [
            {"flow_node_list": ["a", "b"], "logic_device_list": "0:0:0:0"},
            {"flow_node_list": ["pre"], "logic_device_list": "0:0:1:0"},
        ],
        alias="pre",
    )
    expect(g, RULE_ONCE, "pre", p)


def test_names_the_graph_lacks_are_rejected(tmp_path, cluster4):
    g, p = two_nodes(
        tmp_path, [{"flow_node_list": ["a", "b", "zzz"], "logic_device_list": "0:0:0"}]
    )
    expect(g, RULE_UNKNOWN_NODE, "zzz", p)


@pytest.mark.parametrize("dev", ["0:1:0:0", "0:0:4:0", "1:0:0:0"])
def test_device_must_be_in_the_cluster_config(tmp_path, cluster4, dev):
    g, p = two_nodes(tmp_path, [{"flow_node_list": ["a", "b"], "logic_device_list": dev}])
    msg = expect(g, RULE_IN_CLUSTER, "a", p)
    assert "numa_config.json" in msg


def test_node_on_host_and_device(tmp_path, cluster4):
    g, p = two_nodes(
        tmp_path,
        [
            {"flow_node_list": ["a"], "logic_device_list": "0:0:-1:0,0:0:1:0"},
            {"flow_node_list": ["b"], "logic_device_list": "0:0:0:0"},
        ],
    )
    expect(g, RULE_HOST_AND_DEVICE, "a", p)


def test_udf_needing_a_gpu_on_a_cpu_device(tmp_path, cluster4):
    x = df.FlowData()
    out = needs_gpu.fnode(name="g")(x)
    p = write_json(
        tmp_path / "d.json",
        {"batch_deploy_info": [{"flow_node_list": ["g"], "logic_device_list": "0:0:-1"}]},
    )
    msg = expect(df.FlowGraph([out], {df.DEPLOY_INFO_OPTION: p}), RULE_CAN_RUN, "g", p)
    assert "num_gpus=1" in msg and "host" in msg


def test_model_targeting_another_kind_of_device(tmp_path, pt2_model):
    # A cluster of CUDA devices (soc H100); the .pt2 was exported on CPU.
    cfg = write_cluster(tmp_path / "numa_config.json", [2], soc_type="H100")
    df.init({"ge.resourceConfigPath": str(cfg), "ge.socVersion": "H100"})
    x = df.FlowData()
    out = df.GraphProcessPoint(df.Framework.PYTORCH, str(pt2_model), name="m").fnode()(x)
    p = write_json(
        tmp_path / "d.json",
        {"batch_deploy_info": [{"flow_node_list": ["m"], "logic_device_list": "0:0:1"}]},
    )
    msg = expect(df.FlowGraph([out], {df.DEPLOY_INFO_OPTION: p}), RULE_CAN_RUN, "m", p)
    assert "targets cpu" in msg and "cuda" in msg
    # ... while on the host (a CPU) it can run
    p2 = write_json(
        tmp_path / "d2.json",
        {"batch_deploy_info": [{"flow_node_list": ["m"], "logic_device_list": "0:0:-1"}]},
    )
    placed = df.FlowGraph([out], {df.DEPLOY_INFO_OPTION: p2}).plan()
    assert placed.nodes["m"].instances[0].device.is_host


def test_tessel_model_targeting_another_kind_of_device(tmp_path, tessel_model):
    cfg = write_cluster(tmp_path / "numa_config.json", [2], soc_type="H100")
    df.init({"ge.resourceConfigPath": str(cfg), "ge.socVersion": "H100"})
    x = df.FlowData()
    out = df.GraphProcessPoint(df.Framework.TESSEL, str(tessel_model), name="om").fnode()(x)
    p = write_json(
        tmp_path / "d.json",
        {"batch_deploy_info": [{"flow_node_list": ["om"], "logic_device_list": "0:0:0"}]},
    )
    msg = expect(df.FlowGraph([out], {df.DEPLOY_INFO_OPTION: p}), RULE_CAN_RUN, "om", p)
    assert "targets cpu" in msg


def _udf_with_model(pt2_model, invoked=None):
    x = df.FlowData()
    pp = df.FuncProcessPoint(py_func=CallsModel, name="u")
    pp.add_invoked_closure(
        "model", invoked or df.GraphProcessPoint(df.Framework.PYTORCH, str(pt2_model))
    )
    node = df.FlowNode(1, 1, name="u").add_process_point(pp)
    return node(x)


def test_invoked_model_count_must_equal_parent(tmp_path, cluster4, pt2_model):
    out = _udf_with_model(pt2_model)
    p = write_json(
        tmp_path / "d.json",
        {
            "batch_deploy_info": [
                {
                    "flow_node_list": ["u"],
                    "logic_device_list": "0:0:0~1:0",
                    "invoke_list": [{"invoke_name": "model", "logic_device_list": "0:0:2:0"}],
                }
            ]
        },
    )
    msg = expect(df.FlowGraph([out], {df.DEPLOY_INFO_OPTION: p}), RULE_INVOKED_COUNT, "u", p)
    assert "1 instances" in msg and "has 2" in msg


def test_nested_graph_parent_cannot_have_several_instances(tmp_path, cluster4):
    y = df.FlowData()
    sub = df.FlowGraph([ident.fnode(name="inner")(y)])
    x = df.FlowData()
    pp = df.FuncProcessPoint(py_func=CallsModel, name="u")
    pp.add_invoked_closure("model", df.FlowGraphProcessPoint(sub))
    out = df.FlowNode(1, 1, name="u").add_process_point(pp)(x)
    p = write_json(
        tmp_path / "d.json",
        {"batch_deploy_info": [{"flow_node_list": ["u"], "logic_device_list": "0:0:0~1:0"}]},
    )
    expect(df.FlowGraph([out], {df.DEPLOY_INFO_OPTION: p}), RULE_NESTED_PARENT, "u", p)


def test_nested_deploy_file_is_checked_against_the_nested_graph(tmp_path, cluster4):
    y = df.FlowData()
    sub = df.FlowGraph([ident.fnode(name="inner")(y)])
    x = df.FlowData()
    pp = df.FuncProcessPoint(py_func=CallsModel, name="u")
    pp.add_invoked_closure("model", df.FlowGraphProcessPoint(sub))
    out = df.FlowNode(1, 1, name="u").add_process_point(pp)(x)
    nested = write_json(
        tmp_path / "nested.json",
        {"batch_deploy_info": [{"flow_node_list": ["inner"], "logic_device_list": "0:0:7"}]},
    )
    p = write_json(
        tmp_path / "d.json",
        {
            "batch_deploy_info": [
                {
                    "flow_node_list": ["u"],
                    "logic_device_list": "0:0:0",
                    "invoke_list": [{"invoke_name": "model", "deploy_info_file": nested}],
                }
            ]
        },
    )
    expect(df.FlowGraph([out], {df.DEPLOY_INFO_OPTION: p}), RULE_IN_CLUSTER, "inner", nested)


def test_invoked_model_policies(tmp_path, cluster4, pt2_model):
    out = _udf_with_model(pt2_model)
    p = write_json(
        tmp_path / "d.json",
        {"batch_deploy_info": [{"flow_node_list": ["u"], "logic_device_list": "0:0:-1"}]},
    )
    placed = df.FlowGraph([out], {df.DEPLOY_INFO_OPTION: p}).plan()
    assert [str(i.device) for i in placed.nodes["u"].invoked["model"]] == ["0:0:0:0"]
    p = write_json(
        tmp_path / "d.json",
        {"batch_deploy_info": [{"flow_node_list": ["u"], "logic_device_list": "0:0:3,0:0:2:1"}]},
    )
    placed = df.FlowGraph([out], {df.DEPLOY_INFO_OPTION: p}).plan()
    assert [str(i.device) for i in placed.nodes["u"].invoked["model"]] == ["0:0:2:1", "0:0:3:0"]


def test_without_a_deploy_file_everything_goes_to_the_first_device(tmp_path, cluster4):
    g, _ = two_nodes(tmp_path, [])
    g.graph_options.pop(df.DEPLOY_INFO_OPTION)
    placed = g.plan()
    assert {n: [str(i.device) for i in p.instances] for n, p in placed.nodes.items()} == {
        "a": ["0:0:0:0"],
        "b": ["0:0:0:0"],
    }
    # the template says the same, by alias where one is set
    g.spec.nodes[0].deploy_name = "a"
    path = tmp_path / "template.json"
    df.utils.generate_deploy_template(g, path)
    info = df.read_deploy_info(path)
    assert [(e.nodes, [str(d) for d in e.devices]) for e in info.entries] == [
        (["a"], ["0:0:0:0"]),
        (["b"], ["0:0:0:0"]),
    ]


def test_cluster_from_env_and_local_default(tmp_path, monkeypatch):
    monkeypatch.setenv("RESOURCE_CONFIG_PATH", str(write_cluster(tmp_path / "c.json", [3, 1])))
    df.init({})
    from tessel.dataflow import session

    assert [len(n.devices) for n in session.cluster().nodes] == [3, 1]
    monkeypatch.delenv("RESOURCE_CONFIG_PATH")
    df.init({"tessel.dataflow.local_devices": "2"})
    assert session.cluster().soc.device_type == "cpu" and session.cluster().world_size == 2
