"""The Ray backend (a cluster of several hosts) on one local Ray session shared by the module."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch

import tessel.dataflow as df

from .conftest import affine_reference, write_cluster, write_json

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    tmp = tmp_path_factory.mktemp("ray")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=str(tmp),
        resources={"tessel_node_0": 100, "tessel_node_1": 100},
        log_to_driver=False,
    )
    yield
    ray.shutdown()


@pytest.fixture
def two_hosts(tmp_path, ray_session):
    """df.init on a cluster of two servers (so the graph runs on Ray), 2 devices each."""
    df.init({"ge.resourceConfigPath": str(write_cluster(tmp_path / "numa.json", [2, 2]))})
    yield
    df.finalize()


@df.pyflow
def flaky(x):
    if int(x) % 5 == 0:
        raise ValueError(f"bad input {int(x)}")
    return int(x) * 10, df.get_running_instance_id()


@df.pyflow
def mortal(x):
    if int(x) == 3:
        os._exit(3)
    return int(x)


@df.pyflow
def inc(x):
    return x + 1


@df.pyflow
def first_plus_one(pair):
    return pair[0] + 1


def deploy(tmp_path, entries):
    return {
        df.DEPLOY_INFO_OPTION: write_json(tmp_path / "deploy.json", {"batch_deploy_info": entries})
    }


def drain(g, n):
    ok, failed = [], []
    for _ in range(n):
        try:
            ok.append(g.fetch(timeout=60_000)[0][0])
        except df.TransactionFailed as exc:
            failed.append(exc)
    return ok, failed


def test_instances_on_two_servers_keep_order_under_failures(tmp_path, two_hosts):
    x = df.FlowData()
    out = first_plus_one.fnode(name="post")(flaky.fnode(name="flaky")(x))
    g = df.FlowGraph(
        [out],
        deploy(
            tmp_path,
            [
                {"flow_node_list": ["flaky"], "logic_device_list": "0:0:0,0:1:1"},
                {"flow_node_list": ["post"], "logic_device_list": "0:1:0"},
            ],
        ),
    )
    for i in range(1, 21):
        g.feed({x: i})
    ok, failed = drain(g, 20)
    from tessel.dataflow.executors.ray import RayExecutor

    assert isinstance(g._executor, RayExecutor)
    assert ok == [i * 10 + 1 for i in range(1, 21) if i % 5]
    assert [f.transaction_id for f in failed] == [5, 10, 15, 20]
    assert all(f.node == "flaky" and "bad input" in f.error for f in failed)


def test_udf_invoking_a_model_on_ray(tmp_path, two_hosts, pt2_model):
    class Pre:
        def __call__(self, v):
            return df.get_run_context().run_flow_model("m", [v])[0] * 2

    pp = df.FuncProcessPoint(py_func=Pre, name="pre")
    pp.add_invoked_closure("m", df.GraphProcessPoint(df.Framework.PYTORCH, str(pt2_model)))
    x = df.FlowData()
    g = df.FlowGraph(
        [df.FlowNode(1, 1, "pre").add_process_point(pp)(x)],
        deploy(tmp_path, [{"flow_node_list": ["pre"], "logic_device_list": "0:1:-1"}]),
    )
    ts = [torch.randn(2, 4) for _ in range(4)]
    for t in ts:
        g.feed_data({x: t})
    for t in ts:
        outs, info, code = g.fetch_data(timeout=60_000)
        torch.testing.assert_close(outs[0], affine_reference(t) * 2)


def test_dead_actor_is_reported_and_others_keep_serving(tmp_path, two_hosts):
    x = df.FlowData()
    g = df.FlowGraph(
        [mortal.fnode(name="mortal")(x)],
        deploy(tmp_path, [{"flow_node_list": ["mortal"], "logic_device_list": "0:0:0,0:1:0"}]),
    )
    for i in range(1, 7):
        g.feed({x: i})
    ok, failed = drain(g, 6)
    assert len(ok) + len(failed) == 6
    assert any(f.transaction_id == 3 and f.node == "mortal" for f in failed)
    for i in range(7, 11):
        g.feed({x: i})
    assert drain(g, 4) == ([7, 8, 9, 10], [])
    live = [a for (name, i), a in _actors(g) if (name, i) not in g._executor.dead]
    pids = ray.get([a.pid.remote() for a in live])
    df.finalize()
    for pid in pids:  # finalize kills every actor process
        try:
            psutil.Process(pid).wait(timeout=30)
        except psutil.NoSuchProcess:
            pass


def _actors(g):
    return [((n, i), a) for n, hs in g._executor.actors.items() for i, a in enumerate(hs)]


def test_nested_flow_graph_and_pyflow_class_on_ray(tmp_path, two_hosts):
    @df.pyflow
    class Offset:
        def __init__(self, k):
            self.k = k

        def __call__(self, v):
            inner = df.get_run_context().run_flow_model("sub", [v])[0]
            return inner + self.k

    y = df.FlowData()
    sub = df.FlowGraph([inc.fnode(name="inner")(y)])
    node = Offset.fnode(100, name="outer")
    node.pp.add_invoked_closure("sub", df.FlowGraphProcessPoint(sub))
    x = df.FlowData()
    g = df.FlowGraph(
        [node(x)], deploy(tmp_path, [{"flow_node_list": ["outer"], "logic_device_list": "0:1:1"}])
    )
    g.feed({x: 1})
    g.feed({x: 2})
    assert [g.fetch(timeout=60_000)[0][0] for _ in range(2)] == [102, 103]


@df.pyflow
def ident(x):
    return x


@df.pyflow
def slow_on_first(x):
    """Transaction 1 holds its actor for 5 s; the rest are quick. Returns the instance id."""
    if int(x) == 1:
        time.sleep(5)
    return df.get_running_instance_id()


@pytest.mark.parametrize("how", ["scatter", "dynamic_schedule"])
def test_balanced_node_takes_the_least_loaded_actor(tmp_path, two_hosts, how):
    x = df.FlowData()
    src = ident.fnode(name="src")
    if how == "scatter":
        src.set_balance_scatter()
    out = slow_on_first.fnode(name="work")(src(x))
    entries = [
        {"flow_node_list": ["src"], "logic_device_list": "0:0:0"},
        {"flow_node_list": ["work"], "logic_device_list": "0:0:1,0:1:0"},
    ]
    data = {"batch_deploy_info": entries, "dynamic_schedule_enable": how == "dynamic_schedule"}
    g = df.FlowGraph([out], {df.DEPLOY_INFO_OPTION: write_json(tmp_path / "d.json", data)})
    for i in range(1, 6):
        g.feed({x: i})
        time.sleep(0.7)  # each quick transaction is done before the next is fed
    got = [g.fetch(timeout=60_000)[0][0] for _ in range(5)]
    # round-robin would send transactions 3 and 5 to the actor still busy with 1
    assert all(inst != got[0] for inst in got[1:]), got
