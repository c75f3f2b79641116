"""Placement rules: each has a test showing its own error (node, file and rule named)."""

from __future__ import annotations

import pytest

import tessel.dataflow as df
from tessel.config.cluster import read_cluster_config
from tessel.dataflow.errors import (
    RULE_ALL_PLACED,
    RULE_CAN_RUN,
    RULE_HOST_AND_DEVICE,
    RULE_IN_CLUSTER,
    RULE_INVOKED_COUNT,
    RULE_NESTED_INLINE,
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


@df.pyflow(resources={"num_gpus": 2})
def needs_two_gpus(x):
    return x


@df.pyflow
def first_of(pair):
    return tuple(pair)


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


def _udf_invoking_a_nested_graph():
    """The output of UDF node `u`, which invokes (as `model`) a graph of one node `inner`."""
    y = df.FlowData()
    sub = df.FlowGraph([ident.fnode(name="inner")(y)])
    x = df.FlowData()
    pp = df.FuncProcessPoint(py_func=CallsModel, name="u")
    pp.add_invoked_closure("model", df.FlowGraphProcessPoint(sub))
    return df.FlowNode(1, 1, name="u").add_process_point(pp)(x)


def test_nested_graph_parent_cannot_have_several_instances(tmp_path, cluster4):
    out = _udf_invoking_a_nested_graph()
    p = write_json(
        tmp_path / "d.json",
        {"batch_deploy_info": [{"flow_node_list": ["u"], "logic_device_list": "0:0:0~1:0"}]},
    )
    expect(df.FlowGraph([out], {df.DEPLOY_INFO_OPTION: p}), RULE_NESTED_PARENT, "u", p)


def test_nested_deploy_file_is_checked_against_the_nested_graph(tmp_path, cluster4):
    out = _udf_invoking_a_nested_graph()
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


def test_udf_asking_for_two_gpus_is_refused_on_one_gpu_device(tmp_path):
    cfg = write_cluster(tmp_path / "numa_config.json", [2], soc_type="H100")
    df.init({"ge.resourceConfigPath": str(cfg), "ge.socVersion": "H100"})
    x = df.FlowData()
    p = write_json(
        tmp_path / "d.json",
        {"batch_deploy_info": [{"flow_node_list": ["g"], "logic_device_list": "0:0:0"}]},
    )
    two = df.FlowGraph([needs_two_gpus.fnode(name="g")(x)], {df.DEPLOY_INFO_OPTION: p})
    msg = expect(two, RULE_CAN_RUN, "g", p)
    assert "num_gpus=2" in msg and "one accelerator" in msg
    # one GPU on the same device is fine
    one = df.FlowGraph([needs_gpu.fnode(name="g")(df.FlowData())], {df.DEPLOY_INFO_OPTION: p})
    assert one.plan().nodes["g"].instances[0].kind == "cuda"


def _nested_graph(tmp_path, invoke: dict, parent_dev: str = "0:0:0"):
    """Node u (on `parent_dev`) invokes a graph of one node `inner`, placed by `invoke`."""
    out = _udf_invoking_a_nested_graph()
    entry = {
        "flow_node_list": ["u"],
        "logic_device_list": parent_dev,
        "invoke_list": [{"invoke_name": "model", **invoke}],
    }
    p = write_json(tmp_path / "d.json", {"batch_deploy_info": [entry]})
    return df.FlowGraph([out], {df.DEPLOY_INFO_OPTION: p}), p


def _nested_file(tmp_path, devices: str) -> str:
    return write_json(
        tmp_path / "nested.json",
        {"batch_deploy_info": [{"flow_node_list": ["inner"], "logic_device_list": devices}]},
    )


@pytest.mark.parametrize("devices", ["0:0:1", "0:0:0~1", "0:0:0:1", "0:0:-1"])
def test_nested_deploy_file_must_keep_inner_nodes_on_the_udf_device(tmp_path, cluster4, devices):
    nested = _nested_file(tmp_path, devices)
    g, _ = _nested_graph(tmp_path, {"deploy_info_file": nested})
    msg = expect(g, RULE_NESTED_INLINE, "inner", nested)
    assert "'u'" in msg and "0:0:0:0" in msg and "flow_node_list" in msg


def test_invoke_device_list_for_a_nested_graph_must_be_the_udf_device(tmp_path, cluster4):
    g, p = _nested_graph(tmp_path, {"logic_device_list": "0:0:2"})
    msg = expect(g, RULE_NESTED_INLINE, "inner", p)
    assert "0:0:2:0" in msg and "invoke_list[0]" in msg


@pytest.mark.parametrize("parent_dev", ["0:0:3", "0:0:-1"])
def test_nested_graph_placed_with_its_udf_is_accepted(tmp_path, cluster4, parent_dev):
    g, _ = _nested_graph(
        tmp_path, {"deploy_info_file": _nested_file(tmp_path, parent_dev)}, parent_dev
    )
    inner = g.plan().nodes["u"].invoked["model"].nodes["inner"]
    assert [str(i.device) for i in inner.instances] == [f"{parent_dev}:0"]
    g2, _ = _nested_graph(tmp_path, {"logic_device_list": parent_dev}, parent_dev)
    inner = g2.plan().nodes["u"].invoked["model"].nodes["inner"]
    assert [str(i.device) for i in inner.instances] == [f"{parent_dev}:0"]


def test_deploy_template_uses_the_clusters_first_device(tmp_path):
    # the cluster's first node has node_id 3: the template must say 0:3:0:0, not 0:0:0:0
    cfg = write_cluster(tmp_path / "numa_config.json", [2, 2], node_ids=[3, 5])
    df.init({"ge.resourceConfigPath": str(cfg)})
    g, _ = two_nodes(tmp_path, [], alias="pre")
    path = tmp_path / "template.json"
    df.utils.generate_deploy_template(g, path)
    info = df.read_deploy_info(path)
    assert [(e.nodes, [str(d) for d in e.devices]) for e in info.entries] == [
        (["pre"], ["0:3:0:0"]),
        (["b"], ["0:3:0:0"]),
    ]
    g.graph_options[df.DEPLOY_INFO_OPTION] = str(path)
    placed = g.plan()  # every node placed, no error
    assert {n: [str(i.device) for i in p.instances] for n, p in placed.nodes.items()} == {
        "a": ["0:3:0:0"],
        "b": ["0:3:0:0"],
    }
    # an explicit cluster wins over the session's
    other = write_cluster(tmp_path / "other.json", [1], node_ids=[7])
    df.utils.generate_deploy_template(g, path, read_cluster_config(other))
    assert [str(d) for e in df.read_deploy_info(path).entries for d in e.devices] == [
        "0:7:0:0",
        "0:7:0:0",
    ]


def test_node_placed_by_its_alias_runs_there(tmp_path, cluster4):
    @df.pyflow
    def where(v):
        return v, df.get_running_device_id()

    x = df.FlowData()
    a = where.fnode(name="a").set_alias("pre")
    out = first_of.fnode(name="b")(a(x))
    p = write_json(
        tmp_path / "d.json",
        {
            "batch_deploy_info": [
                {"flow_node_list": ["pre"], "logic_device_list": "0:0:2"},
                {"flow_node_list": ["b"], "logic_device_list": "0:0:1"},
            ]
        },
    )
    g = df.FlowGraph([out], {df.DEPLOY_INFO_OPTION: p})
    placed = g.plan()
    assert [str(i.device) for i in placed.nodes["a"].instances] == ["0:0:2:0"]
    assert [str(i.device) for i in placed.nodes["b"].instances] == ["0:0:1:0"]
    g.feed({x: 5})
    assert g.fetch(timeout=60_000) == ([(5, 2)], 0)
