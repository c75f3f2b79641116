"""Running graphs on the local executor: order, instances, failures, models, closures."""

from __future__ import annotations

import os
import pickle
import signal
import time

import numpy as np
import pytest
import torch

import tessel.dataflow as df
from tessel.dataflow.transport import Channel

from .conftest import affine_reference, write_json


@df.pyflow
def add(a, b):
    return a + b


@df.pyflow
def inc(x):
    return x + 1


@df.pyflow
def flaky(x):
    """Fails on multiples of 7; records which instance ran it."""
    if int(x) % 7 == 0:
        raise ValueError(f"bad input {int(x)}")
    return (int(x) * 10, df.get_running_instance_id())


@df.pyflow
def mortal(x):
    if int(x) == 5:
        os._exit(3)
    return int(x)


@df.pyflow(num_returns=2)
def split(x):
    return x * 2, x * 3


def deploy(tmp_path, entries):
    return {
        df.DEPLOY_INFO_OPTION: write_json(tmp_path / "deploy.json", {"batch_deploy_info": entries})
    }


def drain(graph, n):
    """Fetch n transactions: (ok values, failures), each in transaction order."""
    ok, failed = [], []
    for _ in range(n):
        try:
            outs, _ = graph.fetch(timeout=60_000)
            ok.append(outs[0])
        except df.TransactionFailed as exc:
            failed.append(exc)
    return ok, failed


def test_objects_and_tensors_round_trip(cluster4):
    a, b = df.FlowData(), df.FlowData()
    g = df.FlowGraph([inc.fnode()(add.fnode()(a, b))])
    g.feed({a: 1, b: 2})
    assert g.fetch() == ([4], 0)
    g.feed({a: np.arange(3), b: np.ones(3, dtype=np.int64)})
    g.feed({a: "x", b: "y"})
    g.feed_data({a: torch.arange(6.0).reshape(2, 3), b: torch.ones(2, 3)})
    assert np.array_equal(g.fetch()[0][0], np.arange(3) + 2)
    with pytest.raises(df.TransactionFailed, match="inc"):  # "xy" + 1 fails in node inc
        g.fetch()
    outs, info, code = g.fetch_data()
    assert code == 0 and info.transaction_id == 4
    assert torch.equal(outs[0], torch.arange(6.0).reshape(2, 3) + 2)


def test_multi_instance_keeps_order_and_loses_nothing(tmp_path, cluster4):
    x = df.FlowData()
    node = flaky.fnode(name="flaky")
    g = df.FlowGraph(
        [node(x)], deploy(tmp_path, [{"flow_node_list": ["flaky"], "logic_device_list": "0:0:0~2"}])
    )
    n = 60
    for i in range(1, n + 1):
        g.feed({x: i})
    ok, failed = drain(g, n)
    expected_ok = [i for i in range(1, n + 1) if i % 7]
    assert [v for v, _ in ok] == [i * 10 for i in expected_ok]
    # round-robin by transaction id: transaction t ran on instance (t - 1) % 3
    assert [inst for _, inst in ok] == [(i - 1) % 3 for i in expected_ok]
    assert [f.transaction_id for f in failed] == [i for i in range(1, n + 1) if i % 7 == 0]
    assert all(f.node == "flaky" and "ValueError: bad input" in f.error for f in failed)
    assert "raise ValueError" in failed[0].traceback


def test_join_after_multi_instance_fan_out_with_failures(tmp_path, cluster4):
    x = df.FlowData()
    left = flaky.fnode(name="left")(x)
    right = inc.fnode(name="right")(x)

    @df.pyflow
    def pair(a, b):
        return (a[0], int(b))

    out = pair.fnode(name="pair")(left, right)
    g = df.FlowGraph(
        [out],
        deploy(
            tmp_path,
            [
                {"flow_node_list": ["left"], "logic_device_list": "0:0:0~1"},
                {"flow_node_list": ["right", "pair"], "logic_device_list": "0:0:2,0:0:3"},
            ],
        ),
    )
    for i in range(1, 31):
        g.feed({x: i})
    ok, failed = drain(g, 30)
    assert ok == [(i * 10, i + 1) for i in range(1, 31) if i % 7]
    assert [f.transaction_id for f in failed] == [7, 14, 21, 28]


def test_a_dead_worker_is_reported_and_the_graph_keeps_serving(tmp_path, cluster4):
    x = df.FlowData()
    g = df.FlowGraph(
        [mortal.fnode(name="mortal")(x)],
        deploy(tmp_path, [{"flow_node_list": ["mortal"], "logic_device_list": "0:0:0~1"}]),
    )
    for i in range(1, 21):
        g.feed({x: i})
    ok, failed = drain(g, 20)
    assert len(ok) + len(failed) == 20
    died = [f for f in failed if f.transaction_id == 5]
    assert died and died[0].node == "mortal" and "exit code 3" in died[0].error
    assert ok == sorted(ok) and set(ok) | {f.transaction_id for f in failed} == set(range(1, 21))
    for i in range(21, 31):  # the surviving instance takes everything now
        g.feed({x: i})
    assert drain(g, 10) == (list(range(21, 31)), [])


def test_udf_invokes_a_pt2_model(tmp_path, cluster4, pt2_model):
    class Pre:
        def __call__(self, x):
            y = df.get_run_context().run_flow_model("affine", [x * 2])[0]
            return y - 1

    pp = df.FuncProcessPoint(py_func=Pre, name="pre")
    pp.add_invoked_closure("affine", df.GraphProcessPoint(df.Framework.PYTORCH, str(pt2_model)))
    x = df.FlowData()
    out = df.FlowNode(1, 1, name="pre").add_process_point(pp)(x)
    g = df.FlowGraph(
        [out], deploy(tmp_path, [{"flow_node_list": ["pre"], "logic_device_list": "0:0:0,0:0:1"}])
    )
    inputs = [torch.randn(2, 4) for _ in range(6)]
    for t in inputs:
        g.feed_data({x: t})
    for t in inputs:
        outs, _, _ = g.fetch_data()
        torch.testing.assert_close(outs[0], affine_reference(t * 2) - 1)


def test_model_node_with_two_instances_between_udfs(tmp_path, cluster4, pt2_model):
    x = df.FlowData()
    model = df.GraphProcessPoint(df.Framework.PYTORCH, str(pt2_model), name="model").fnode()
    out = inc.fnode(name="post")(model(inc.fnode(name="pre")(x)))
    g = df.FlowGraph(
        [out],
        deploy(
            tmp_path,
            [
                {"flow_node_list": ["pre", "post"], "logic_device_list": "0:0:0"},
                {"flow_node_list": ["model"], "logic_device_list": "0:0:1~2"},
            ],
        ),
    )
    inputs = [torch.randn(2, 4) for _ in range(10)]
    for t in inputs:
        g.feed_data({x: t})
    for t in inputs:
        outs, _, _ = g.fetch_data(timeout=60_000)
        torch.testing.assert_close(outs[0], affine_reference(t + 1) + 1)


def test_pyflow_class_with_methods_and_two_outputs(cluster4):
    @df.pyflow
    class Calc:
        def __init__(self, base):
            self.base = base

        @df.method
        def plus(self, a, b):
            return a + b + self.base

        @df.method(num_returns=2)
        def both(self, c):
            return c * self.base, df.get_running_instance_num()

    a, b, c = df.FlowData(), df.FlowData(), df.FlowData()
    node = Calc.fnode(100)
    s = node.plus(a, b)
    m, num = node.both(c)
    two = split.fnode()(a)
    g = df.FlowGraph([s, m, num, *two])
    g.feed({a: 1, b: 2, c: 3})
    assert g.fetch() == ([103, 300, 1, 2, 3], 0)
    g.feed({a: 1, b: 2, c: 3})
    assert g.fetch(indexes=[3, 0]) == ([2, 103], 0)


def test_func_process_point_class_with_init_params_and_mapping(cluster4):
    class Scaler:
        def init_flow_func(self, params):
            self.k = params.get_attr("k")
            self.n_in = params.get_input_num()

        def proc(self, a, b):
            return a * self.k - b, self.n_in

    pp = df.FuncProcessPoint(py_func=Scaler).set_init_param("k", 10)
    node = df.FlowNode(2, 2, name="scaler")
    node.map_input(0, pp, 1).map_input(1, pp, 0).map_output(0, pp, 1).map_output(1, pp, 0)
    a, b = df.FlowData(), df.FlowData()
    g = df.FlowGraph([*node(a, b)])
    g.feed({a: 1, b: 2})  # pp gets (b, a) = (2, 1): 2 * 10 - 1 = 19; outputs swapped
    assert g.fetch() == ([2, 19], 0)


def test_flow_info_user_data_eos_and_timeouts(cluster4):
    @df.pyflow
    def slow(x):
        import time

        time.sleep(0.5)
        return x

    x = df.FlowData()
    g = df.FlowGraph([slow.fnode()(x)])
    info = df.FlowInfo(flow_flags=df.FlowFlag.DATA_FLOW_FLAG_SEG)
    info.set_user_data(b"hello", 2)
    g.feed_data({x: torch.ones(2)}, info)
    g.feed_data({}, df.FlowInfo(flow_flags=df.FlowFlag.DATA_FLOW_FLAG_EOS))
    with pytest.raises(df.FlowTimeout):
        g.fetch_data(timeout=10)
    outs, got, code = g.fetch_data()
    assert (
        code == 0 and got.transaction_id == 1 and got.flow_flags == df.FlowFlag.DATA_FLOW_FLAG_SEG
    )
    assert got.get_user_data(5, 2) == b"hello" and got.end_time >= got.start_time > 0
    outs, got, code = g.fetch_data()
    assert outs == [] and got.eos and got.transaction_id == 2
    with pytest.raises(ValueError, match="EOS"):
        g.feed_data({})
    with pytest.raises(ValueError):
        info.set_user_data(b"x" * 65)


def test_exception_catch_returns_a_code(cluster4):
    x = df.FlowData()
    g = df.FlowGraph([flaky.fnode()(x)]).set_exception_catch(True)
    g.feed({x: 7})
    g.feed({x: 8})
    outs, code = g.fetch()
    assert (outs, code) == ([], df.FAILED) and "bad input 7" in g.last_error.error
    assert g.fetch() == ([(80, 0)], 0)


def test_nested_flow_graph_as_invoked_closure(cluster4):
    y = df.FlowData()
    inner = df.FlowGraph([inc.fnode(name="inner_inc")(inc.fnode(name="inner_inc0")(y))])

    class Outer:
        def __call__(self, v):
            return df.get_run_context().run_flow_model("sub", [v * 10])[0]

    pp = df.FuncProcessPoint(py_func=Outer).add_invoked_closure(
        "sub", df.FlowGraphProcessPoint(inner)
    )
    x = df.FlowData()
    g = df.FlowGraph([df.FlowNode(1, 1, "outer").add_process_point(pp)(x)])
    g.feed({x: 4})
    assert g.fetch() == ([42], 0)


@pytest.mark.parametrize("how", ["scatter", "dynamic_schedule"])
def test_balance_scatter_delivers_everything_in_order(tmp_path, cluster4, how):
    x = df.FlowData()
    src = inc.fnode(name="src")
    if how == "scatter":
        src.set_balance_scatter()
    out = flaky.fnode(name="work")(src(x))
    entries = [
        {"flow_node_list": ["src"], "logic_device_list": "0:0:0"},
        {"flow_node_list": ["work"], "logic_device_list": "0:0:1~3"},
    ]
    path = tmp_path / "deploy.json"
    data = {"batch_deploy_info": entries, "dynamic_schedule_enable": how == "dynamic_schedule"}
    g = df.FlowGraph([out], {df.DEPLOY_INFO_OPTION: write_json(path, data)})
    assert g.plan().dynamic_schedule == (how == "dynamic_schedule")
    for i in range(40):
        g.feed({x: i})
    ok, failed = drain(g, 40)
    assert [v for v, _ in ok] == [(i + 1) * 10 for i in range(40) if (i + 1) % 7]
    assert len(failed) == 5


def test_udf_that_fails_to_start_names_its_node(cluster4):
    class Broken:
        def __init__(self):
            raise OSError("no such resource")

        def __call__(self, x):
            return x

    x = df.FlowData()
    pp = df.FuncProcessPoint(py_func=Broken)
    g = df.FlowGraph([df.FlowNode(1, 1, "broken").add_process_point(pp)(x)])
    with pytest.raises(RuntimeError, match="'broken'.*no such resource"):
        g.feed({x: 1})


def test_udf_invokes_a_tessel_offline_model(tmp_path, cluster4, tessel_model):
    class Pre:
        def __call__(self, x):
            return df.get_run_context().run_flow_model("om", [x])[0]

    pp = df.FuncProcessPoint(py_func=Pre, name="pre")
    om = df.GraphProcessPoint(df.Framework.TESSEL, str(tessel_model))
    assert om.target_device_type() == "cpu"
    pp.add_invoked_closure("om", om)
    x = df.FlowData()
    model_node = df.GraphProcessPoint(df.Framework.TESSEL, str(tessel_model), name="om2").fnode()
    g = df.FlowGraph([model_node(df.FlowNode(1, 1, name="pre").add_process_point(pp)(x))])
    ts = [torch.randn(2, 4) for _ in range(3)]
    for t in ts:
        g.feed_data({x: t})
    for t in ts:
        outs, _, _ = g.fetch_data(timeout=60_000)
        torch.testing.assert_close(outs[0], affine_reference(affine_reference(t)))


def test_a_file_that_is_no_tessel_model_is_refused(tmp_path, cluster4):
    bogus = tmp_path / "m.tessel"
    bogus.write_bytes(b"not a zip")
    x = df.FlowData()
    with pytest.raises(ValueError, match="m.tessel"):
        df.FlowGraph([df.GraphProcessPoint(df.Framework.TESSEL, str(bogus)).fnode(1, 1)(x)]).plan()


@df.pyflow
def sleepy(x):
    import time

    time.sleep(0.5)
    return x


def test_finalize_stops_workers_and_graph_refuses_feeds(cluster4):
    x = df.FlowData()
    g = df.FlowGraph([sleepy.fnode()(x)])
    g.feed({x: 1})
    df.finalize()
    with pytest.raises(df.TransactionFailed, match="finalized"):
        g.fetch()
    with pytest.raises(RuntimeError):
        g.feed({x: 1})


def test_channel_moves_tensors_through_shared_pages():
    import multiprocessing as mp

    ch = Channel(mp.get_context("fork"), 2, 2 << 20, "test")
    t = torch.randn(512, 512)  # 1 MiB
    assert ch.acquire(None)
    ch.put(7, 0, t, ())
    msg = ch.reader.recv()
    assert len(pickle.dumps(msg)) < 512  # the pipe carries a header, not the tensor
    tid, _, slot, meta, _ = msg
    view = ch.read(slot, meta, copy=False)
    assert tid == 7 and torch.equal(view, t)
    base = np.frombuffer(ch._mm, dtype=np.uint8).ctypes.data
    assert base <= view.data_ptr() < base + len(ch._mm)
    ch.release(slot)
    assert ch.free.get_value() == 2


def test_values_larger_than_a_slot_still_arrive(cluster4):
    x = df.FlowData()
    g = df.FlowGraph([inc.fnode(name="big")(x)], {"tessel.dataflow.slot_bytes": "1024"})
    big = torch.arange(10_000, dtype=torch.float64)  # 80 kB: torch's shared-memory path
    g.feed_data({x: big})
    g.feed({x: np.arange(5000)})  # 40 kB array: pickled through the pipe
    torch.testing.assert_close(g.fetch_data()[0][0], big + 1)
    assert np.array_equal(g.fetch()[0][0], np.arange(5000) + 1)


def test_a_range_of_devices_and_of_ids_gives_four_running_instances(tmp_path, cluster4):
    @df.pyflow
    def where(v):
        return df.get_running_instance_id(), df.get_running_device_id()

    x = df.FlowData()
    g = df.FlowGraph(
        [where.fnode(name="w")(x)],
        deploy(tmp_path, [{"flow_node_list": ["w"], "logic_device_list": "0:0:0~1:0~1"}]),
    )
    placed = g.plan()
    assert [str(i.device) for i in placed.nodes["w"].instances] == [
        "0:0:0:0",
        "0:0:0:1",
        "0:0:1:0",
        "0:0:1:1",
    ]
    for i in range(8):
        g.feed({x: i})
    got = [g.fetch()[0][0] for _ in range(8)]
    assert got == [(k % 4, [0, 0, 1, 1][k % 4]) for k in range(8)]
    assert len(g.worker_pids()) == 4


def test_many_failures_before_a_join_do_not_exhaust_its_queues(tmp_path, cluster4):
    @df.pyflow
    def odd_only(v):
        if v % 2 == 0:
            raise ValueError("even")
        return v

    @df.pyflow
    def slow_copy(v):
        import time

        time.sleep(0.002)
        return v

    @df.pyflow
    def join(a, b):
        return a + b

    x = df.FlowData()
    out = join.fnode(name="join")(odd_only.fnode(name="odd")(x), slow_copy.fnode(name="slow")(x))
    g = df.FlowGraph([out]).set_exception_catch(True)
    n = 100  # 50 failures, far more than a queue's 8 slots
    for i in range(n):
        g.feed({x: i}, timeout=30_000)
    codes = [g.fetch(timeout=30_000) for _ in range(n)]
    assert [c for _, c in codes] == [df.FAILED if i % 2 == 0 else 0 for i in range(n)]
    assert [o[0] for o, c in codes if c == 0] == [2 * i for i in range(1, n, 2)]


def test_cpu_devices_can_pin_their_workers_to_cores(tmp_path, cluster4):
    @df.pyflow
    def cores(v):
        return sorted(os.sched_getaffinity(0))

    x = df.FlowData()
    opts = deploy(tmp_path, [{"flow_node_list": ["c"], "logic_device_list": "0:0:0~1"}])
    g = df.FlowGraph([cores.fnode(name="c")(x)], {**opts, "tessel.dataflow.pin_cpu_devices": "1"})
    g.feed({x: 0})
    g.feed({x: 1})
    mine = sorted(os.sched_getaffinity(0))
    got = [g.fetch()[0][0] for _ in range(2)]
    assert got == [[mine[0]], [mine[1 % len(mine)]]]


@df.pyflow
def tagged(v):
    """(value, instance that ran it), after a delay that varies with the value."""
    import time

    time.sleep(0.002 * (int(v) % 5))
    return int(v), df.get_running_instance_id()


@df.pyflow
def pair_up(worked, original):
    return worked, int(original)


def test_balance_gather_aligns_the_scattered_instances(tmp_path, cluster4):
    x = df.FlowData()
    src = inc.fnode(name="src").set_balance_scatter()
    fed = src(x)
    gather = pair_up.fnode(name="gather").set_balance_gather()
    out = gather(tagged.fnode(name="work")(fed), fed)
    g = df.FlowGraph(
        [out],
        deploy(
            tmp_path,
            [
                {"flow_node_list": ["src"], "logic_device_list": "0:0:0"},
                {"flow_node_list": ["work"], "logic_device_list": "0:0:1~3"},
                {"flow_node_list": ["gather"], "logic_device_list": "0:0:0~1"},
            ],
        ),
    )
    n = 60
    for i in range(n):
        g.feed({x: i}, timeout=30_000)
    got = [g.fetch(timeout=30_000)[0][0] for _ in range(n)]
    # complete, in order, and each gathered pair belongs to one transaction
    assert [(w[0], o) for w, o in got] == [(i + 1, i + 1) for i in range(n)]
    assert len({w[1] for w, _ in got}) > 1  # the scatter really spread the work


def test_balance_gather_needs_a_scatter_upstream(cluster4):
    x = df.FlowData()
    plain = inc.fnode(name="plain")(x)
    gather = pair_up.fnode(name="lonely").set_balance_gather()
    with pytest.raises(ValueError, match="'lonely'.*no balance-scatter node is upstream"):
        df.FlowGraph([gather(tagged.fnode()(plain), plain)])


@df.pyflow
def slow_second(v):
    import time

    time.sleep(1.0)
    return v


@pytest.mark.parametrize("depth", [2, 3])
def test_flow_attr_depth_bounds_the_queue_and_feed_times_out(cluster4, depth):
    x = df.FlowData()
    node = slow_second.fnode(name="slow").set_attr("_flow_attr_depth", depth)
    g = df.FlowGraph([node(x)]).start()
    accepted = 0
    with pytest.raises(df.FlowTimeout, match="'slow' did not take transaction"):
        for i in range(depth + 5):
            g.feed({x: i}, timeout=200)
            accepted += 1
    assert accepted == depth  # the queue held exactly `depth` transactions
    assert [g.fetch(timeout=30_000)[0][0] for _ in range(depth)] == list(range(depth))
    g.feed({x: 99}, timeout=5_000)  # room again; the timed-out feed took no transaction id
    outs, info, _ = g.fetch_data(timeout=30_000)
    assert outs == [99] and info.transaction_id == depth + 1


def test_a_consumer_dying_while_a_feed_writes_fails_that_transaction(cluster4):
    x = df.FlowData()
    g = df.FlowGraph([inc.fnode(name="victim")(x)]).start()
    ex = g._executor
    worker = ex.workers[0]
    ch = ex.input_routes[0][0].channels[0]
    real_put = ch.put

    def put_after_death(*args):
        """The slot is taken; the consumer dies and is reclaimed before the value lands."""
        os.kill(worker.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while ex.alive[worker.gid] and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # the collector reclaims the dead worker's slots meanwhile
        return real_put(*args)

    ch.put = put_after_death  # the parent's copy only: the worker forked before
    g.feed({x: 1}, timeout=5_000)
    with pytest.raises(df.TransactionFailed) as failed:
        g.fetch(timeout=10_000)
    assert failed.value.transaction_id == 1 and failed.value.node == "victim"
    assert "died before taking it" in failed.value.error
    ch.put = real_put
    g.feed({x: 2}, timeout=5_000)  # no live instance left: reported, not lost
    with pytest.raises(df.TransactionFailed, match="no live instance of node 'victim'"):
        g.fetch(timeout=10_000)


def test_routing_shared_by_both_executors():
    from tessel.dataflow.executors.routing import pick

    def live(dead=()):
        return lambda i: i not in dead

    def flat(i):
        return 0

    assert [pick(3, t, live(), True, False, flat) for t in range(1, 7)] == [0, 1, 2, 0, 1, 2]
    # a dead instance's share goes to the next live one, unless a join waits for it there
    assert pick(3, 2, live({1}), True, False, flat) == 2
    assert pick(3, 2, live({1}), False, False, flat) is None
    # balanced: the least-loaded live instance; ties go round by transaction id
    loads = [3, 1, 2].__getitem__
    assert pick(3, 1, live(), True, True, loads) == 1
    assert pick(3, 1, live({1}), True, True, loads) == 2
    assert [pick(3, t, live(), True, True, flat) for t in range(3)] == [0, 1, 2]
    assert pick(3, 1, live(), False, True, loads) == 0  # a join routes round-robin


def test_a_node_runs_only_a_udf_or_a_model_itself():
    from tessel.dataflow.process_points import ProcessPoint

    sub = df.FlowGraph([inc.fnode(name="sub_inc")(df.FlowData())])
    with pytest.raises(ValueError, match="'n': a FlowGraphProcessPoint runs only as an invoked"):
        df.FlowNode(1, 1, "n").add_process_point(df.FlowGraphProcessPoint(sub))
    for other in (ProcessPoint("bare"), object()):
        with pytest.raises(TypeError, match="'n': not a process point"):
            df.FlowNode(1, 1, "n").add_process_point(other)
    node = df.FlowNode(1, 1, "n").add_process_point(df.FuncProcessPoint(py_func=lambda v: v))
    assert node.pp is not None and node.pp.name.startswith("FuncProcessPoint_")


@pytest.mark.parametrize(
    "setting",
    [
        {"stream_input": object()},
        {"choice_output": object()},
        {"visible_device_enable": True},
        {"env_hook_func": print},
    ],
    ids=lambda setting: next(iter(setting)),
)
def test_a_pyflow_setting_not_built_is_refused_by_name(setting):
    """CANN's @pyflow settings tessel does not build are refused, never accepted and ignored."""
    from tessel.config.errors import ConfigError

    key = next(iter(setting))
    with pytest.raises(ConfigError, match=f"@pyflow: {key}: is not built"):
        df.pyflow(**setting)(lambda x: x)
    with pytest.raises(ConfigError, match="@pyflow: resources: names unknown resources"):
        df.pyflow(resources={"num_tpus": 1})(lambda x: x)
