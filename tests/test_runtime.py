"""Workers that die or hang make run_graph fail fast; several nodes meet at the head's address;
misuse of the runtime and a worker's failure each read as one clear line."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import zipfile

import psutil
import pytest
import torch
from tests.conftest import (
    ctrl_c_as_in_a_terminal,
    small_gpt2,
    small_llama,
    subprocess_env,
    token_ids,
)

import tessel
from tessel.errors import TesselError
from tessel.package import Package, PackageError
from tessel.runtime.worker import collective_timeout_s


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("rt")
    model = small_llama(layers=1)
    ids = token_ids()
    return model, ids, tessel.save(tessel.build(model, (ids,), cluster=2), d / "tp2")


@pytest.fixture
def session():
    tessel.initialize()
    yield tessel.Session()
    tessel.finalize()


def test_session_needs_initialize():
    tessel.finalize()
    with pytest.raises(tessel.SessionError, match="call tessel.initialize"):
        tessel.Session()
    assert issubclass(tessel.SessionError, TesselError)


def test_misuse_of_a_session_is_a_tessel_error(model_file, session, tmp_path):
    _, ids, path = model_file
    with pytest.raises(tessel.ConfigError, match="graph 0 is not loaded"):
        session.run_graph(0, [ids])
    with pytest.raises(PackageError, match="file not found"):
        session.load_graph(0, {}, tmp_path / "missing.tessel")
    with pytest.raises(tessel.ConfigError, match="path: expected a file path, found NoneType"):
        session.load_graph(0, {}, None)
    with pytest.raises(tessel.ConfigError, match="options: expected a dict, found int"):
        session.load_graph(0, 5, path)
    with pytest.raises(tessel.ConfigError, match="graph_id: expected an integer"):
        session.load_graph("first", {}, path)
    session.load_graph(0, {}, path)
    for bad in (5, "ids", None, ids):  # a bare tensor is not a list of them either
        with pytest.raises(tessel.ConfigError, match="inputs: expected a list of tensors"):
            session.run_graph(0, bad)
    with pytest.raises(tessel.ConfigError, match="input_0: expected a tensor, found int"):
        session.run_graph(0, [5])
    tessel.finalize()
    with pytest.raises(tessel.SessionError, match="finalize"):
        session.load_graph(1, {}, path)


def test_an_option_tessel_does_not_read_is_refused_by_name(model_file, session):
    """GEInitialize's config and the Session's load options: a key tessel reads nothing from
    is refused at the first call, never accepted and ignored; a near miss names the key."""
    _, _, path = model_file
    with pytest.raises(tessel.ConfigError, match="did you mean 'tessel.load_timeout_s'"):
        session.load_graph(0, {"tessel.load_timeout": 5}, path)
    with pytest.raises(tessel.ConfigError, match="Session\\(\\): tessel.threads: unknown key"):
        tessel.Session({"tessel.threads": 2})
    with pytest.raises(tessel.ConfigError, match="ge.exec.deviceId: each rank runs on the device"):
        tessel.initialize({"ge.exec.deviceId": "0", "ge.graphRunMode": "0"})
    with pytest.raises(tessel.ConfigError, match="allowed keys here: ge.graphRunMode$"):
        tessel.initialize({"ge.graphRunmode": "0"})
    tessel.initialize({"ge.graphRunMode": "0"})
    session.load_graph(0, {"tessel.load_timeout_s": 60.0, "ge.graphRunMode": 0}, path)


def _altered(path, tmp_path):
    """The package with a byte of a weights member every rank reads flipped."""
    shared = set.intersection(*(set(s.weights) for s in Package.open(path).manifest.submodels))
    target = sorted(shared)[0]
    bad = tmp_path / "altered.tessel"
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(bad, "w") as zout:
        for name in zin.namelist():
            data = bytearray(zin.read(name))
            if name == target:
                data[-1] ^= 0xFF
            zout.writestr(name, bytes(data))
    return bad, target


def test_a_worker_error_is_one_line_naming_the_rank_and_the_cause(
    model_file, session, tmp_path, caplog
):
    _, _, path = model_file
    bad, target = _altered(path, tmp_path)
    with caplog.at_level(logging.DEBUG, logger="tessel.runtime.session"):
        with pytest.raises(tessel.WorkerError) as info:
            session.load_graph(0, {}, bad)
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith(f"rank {info.value.rank} failed: PackageError: "), message
    assert message.endswith(f"member '{target}' fails its checksum: the file was altered")
    assert "Traceback (most recent call last)" in info.value.worker_traceback
    assert "Traceback (most recent call last)" in caplog.text  # shown at --log=debug


def test_wrong_inputs_are_named(model_file, session):
    _, ids, path = model_file
    session.load_graph(0, {}, path)
    with pytest.raises(
        tessel.ConfigError,
        match=r"input_0 \(input_ids\): expected shape \[2, 16\] int64, found \[3, 16\]",
    ):
        session.run_graph(0, [torch.zeros(3, 16, dtype=torch.int64)])
    with pytest.raises(tessel.ConfigError, match="graph 5 is not loaded"):
        session.run_graph(5, [ids])


def test_dead_worker_is_reported(model_file, session):
    _, ids, path = model_file
    session.load_graph(0, {}, path)
    session.run_graph(0, [ids])
    victim = session._graphs[0].procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    t = time.monotonic()
    with pytest.raises(tessel.WorkerError, match=r"rank 1 died of SIGKILL \(exit code -9\)"):
        session.run_graph(0, [ids])
    assert time.monotonic() - t < 60


def test_a_worker_that_crashes_in_native_code_says_where_it_was(model_file, session, capfd):
    """A rank killed by a fatal signal (glibc aborting on a corrupt heap, a segfault) is reported
    by its signal, and its stderr holds each of its threads' Python stacks."""
    _, ids, path = model_file
    session.load_graph(0, {}, path)
    session.run_graph(0, [ids])
    victim = session._graphs[0].procs[1]
    os.kill(victim.pid, signal.SIGABRT)
    victim.join(30)
    with pytest.raises(
        tessel.WorkerError,
        match=r"rank 1 died of SIGABRT \(exit code -6\); its stderr shows each thread's Python",
    ):
        session.run_graph(0, [ids])
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err and "tessel/runtime/worker.py" in err, err


def test_hung_worker_times_out(model_file, session, capfd):
    """A stopped rank is reported by the session's run deadline, always: the workers' collectives
    wait twice as long, so rank 0 never gives up on its peer first. The ranks still running print
    where they wait."""
    _, ids, path = model_file
    deadline = 3.0
    assert collective_timeout_s(deadline) > deadline
    session.load_graph(0, {"tessel.run_timeout_s": deadline}, path)
    session.run_graph(0, [ids])
    procs = list(session._graphs[0].procs)
    os.kill(procs[1].pid, signal.SIGSTOP)
    t = time.monotonic()
    with pytest.raises(tessel.WorkerError, match=r"^no answer from ranks \[0\] in time$"):
        session.run_graph(0, [ids])
    waited = time.monotonic() - t
    assert deadline <= waited < collective_timeout_s(deadline)
    # the failed run stopped every worker, the stopped one included, without waiting for it
    assert not any(p.is_alive() for p in procs)
    assert time.monotonic() - t < deadline + 5
    err = capfd.readouterr().err
    assert "most recent call first" in err and "tessel/runtime/worker.py" in err, err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_with_node_1_served(session, path, model, ids, while_loaded=None) -> str:
    """Run `path` with node 1's workers started by `tessel serve` in another process, check
    the output against eager, and check that the server ends cleanly with the graph; returns
    what the server wrote. `while_loaded(server)` runs once the graph is loaded, before it runs."""
    remote = subprocess.Popen(
        [sys.executable, "-m", "tessel.cli", "serve", str(path), "--node-id", "1"],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        session.load_graph(0, {}, path)
        if while_loaded is not None:
            while_loaded(remote)
        (out,) = session.run_graph(0, [ids])
        with torch.no_grad():
            assert (out - model(ids)).abs().max().item() <= 1e-4
        session.remove_graph(0)
        written, _ = remote.communicate(timeout=60)
        assert remote.returncode == 0, written
        return written
    finally:
        if remote.poll() is None:
            remote.kill()
            remote.wait()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A model, its input and its package for two loopback nodes of one device each."""
    tmp_path = tmp_path_factory.mktemp("nodes")
    port = _free_port()
    node = lambda i: {
        "node_id": i,
        "node_type": "CPU",
        "ipaddr": "127.0.0.1",
        "port": port,  # noqa: E731
        "is_local": i == 0,
        "item_list": [{"item_id": 0}],
    }
    cluster = {
        "cluster": [{"cluster_nodes": [node(0), node(1)]}],
        "item_def": [{"item_type": "cpu"}],
    }
    (tmp_path / "numa_config_2node.json").write_text(json.dumps(cluster))
    model = small_llama(layers=1)
    ids = token_ids()
    path = tessel.save(
        tessel.build(model, (ids,), cluster=str(tmp_path / "numa_config_2node.json")),
        tmp_path / "two",
    )
    return model, ids, path


_PR_SET_CHILD_SUBREAPER = 36


@pytest.fixture
def orphans_come_here():
    """Processes orphaned during the test become this process's children (Linux), so the check
    that no worker is left behind also sees the workers of a `tessel serve` that has exited."""
    import ctypes

    libc = ctypes.CDLL(None) if sys.platform.startswith("linux") else None
    if libc is not None:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1)
    yield
    if libc is not None:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 0)


def test_two_nodes_on_loopback_where_a_second_claim_of_either_id_is_refused_by_name(
    two_nodes, session, orphans_come_here, monkeypatch
):
    """Beside a running head and node 1, `tessel serve --node-id 0` and a second
    `tessel serve --node-id 1` are refused within 10 s, naming the id and the process holding
    it, before they start a worker; so are a second head and a second node 1 in this process.
    The head and the rightful node 1 keep working."""
    from tessel.runtime import session as session_module

    model, ids, path = two_nodes
    port = Package.open(path).manifest.cluster["cluster"][0]["cluster_nodes"][0]["port"]
    host = re.escape(socket.gethostname())

    def refused(rightful: subprocess.Popen) -> None:
        said = [
            rf"node 0 \(the head\) is already running at 127\.0\.0\.1:{port}: process "
            rf"{os.getpid()} on host {host}, loading two\.tessel\. Each node runs once: stop "
            r"that head first, or start this host with another node's id \(the cluster "
            r"config's nodes are 0, the head, and 1\) as --node-id or the option tessel\.node_id",
            rf"node 1 is already running: process {rightful.pid} on host {host}, loading "
            rf"two\.tessel, which joined the head at 127\.0\.0\.1:{port}\. Each node runs "
            r"once: stop that one first",
        ]
        for node_id, words in enumerate(said):  # one at a time: each has the cores to start
            intruder = _serve(path, node_id)
            try:
                _, err = intruder.communicate(timeout=10)  # refused within 10 s, or this fails
            finally:
                if intruder.poll() is None:
                    intruder.kill()
                    intruder.wait()
            assert intruder.returncode == 1, err
            assert re.fullmatch(rf"tessel: error: {words}.*\n", err), err
        monkeypatch.setattr(session_module, "_start_workers", _no_workers)
        for node_id, words in enumerate(said):
            with pytest.raises(tessel.NodeError, match=f"^{words}"):
                tessel.Session().load_graph(0, {"tessel.node_id": node_id}, path)
        monkeypatch.undo()

    _run_with_node_1_served(session, path, model, ids, while_loaded=refused)


def _serve(path, node_id: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tessel.cli", "serve", str(path), "--node-id", str(node_id)],
        env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _no_workers(*args, **kwargs):
    raise AssertionError("workers were started for a node whose id another holds")


def test_a_head_whose_address_another_program_holds_is_refused_by_name(two_nodes, session):
    _, _, path = two_nodes
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            tessel.NodeError,
            match=rf"^node 0 \(the head\) cannot listen at 127\.0\.0\.1:{port} \(node 0's "
            r"ipaddr and port in the cluster config, or the option tessel\.master_port\): "
            r"another program, not a tessel head, holds that port",
        ):
            session.load_graph(0, {"tessel.master_port": port}, path)


def test_a_node_whose_head_never_answers_is_refused_after_the_load_timeout(two_nodes, session):
    _, _, path = two_nodes
    port = _free_port()
    with pytest.raises(
        tessel.NodeError,
        match=rf"^node 1: no tessel head answered at 127\.0\.0\.1:{port} .* within 1 s "
        r"\(tessel\.load_timeout_s\)",
    ):
        session.load_graph(
            0, {"tessel.node_id": 1, "tessel.master_port": port, "tessel.load_timeout_s": 1}, path
        )


def test_ctrl_c_ends_a_node_waiting_for_its_head(two_nodes):
    """A `tessel serve` waiting at the head's address, where what listens never answers as a
    store, ends at Ctrl-C, having started no worker."""
    _, _, path = two_nodes
    port = Package.open(path).manifest.cluster["cluster"][0]["cluster_nodes"][0]["port"]
    with socket.socket() as silent:
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        silent.bind(("127.0.0.1", port))
        silent.listen()
        node = subprocess.Popen(
            [sys.executable, "-m", "tessel.cli", "serve", str(path), "--node-id", "1"],
            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=ctrl_c_as_in_a_terminal,
        )  # fmt: skip
        try:
            silent.settimeout(60)
            waiting, _ = silent.accept()  # the node is waiting for the head's answer
            with waiting:
                node.send_signal(signal.SIGINT)
                _, err = node.communicate(timeout=10)
        finally:
            if node.poll() is None:
                node.kill()
                node.wait()
    assert node.returncode == 130 and err == "tessel: interrupted\n", (node.returncode, err)


def test_a_claim_left_by_a_process_gone_from_this_host_is_taken_over():
    """A node killed before it could give its id back leaves its claim; the next claimant on
    its host finds the process gone and takes the id, while a live holder's stays refused."""
    import datetime

    import torch.distributed as dist

    from tessel.runtime.rendezvous import _claim, _pid_space

    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    host, pids = socket.gethostname(), _pid_space()
    if pids is None:
        pytest.skip("no /proc/self/ns/pid: a claim is never known gone here")
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    claims = {
        "live": {"host": host, "pids": pids, "pid": os.getppid()},
        "gone": {"host": host, "pids": pids, "pid": gone.pid},
        # the same host name and pid, in another container's pid namespace: not known gone
        "elsewhere": {"host": host, "pids": "pid:[1]", "pid": gone.pid},
    }
    for key, claim in claims.items():
        store.set(key, json.dumps(claim))
    mine = json.dumps({"host": host, "pids": pids, "pid": os.getpid()})
    assert _claim(store, "live", mine) == claims["live"]
    assert _claim(store, "elsewhere", mine) == claims["elsewhere"]
    assert _claim(store, "gone", mine) is None
    assert store.get("gone").decode() == mine
    assert _claim(store, "free", mine) is None


def test_nodes_given_different_packages_refuse_them_on_both_sides(tmp_path, session):
    """The head and a `tessel serve` compare the package's digest as they join: a node serving
    another file is refused on both sides within seconds, naming both files."""
    port = _free_port()
    node = lambda i: {
        "node_id": i, "node_type": "CPU", "ipaddr": "127.0.0.1", "port": port,
        "is_local": i == 0, "item_list": [{"item_id": 0}],
    }  # noqa: E731  # fmt: skip
    config = tmp_path / "numa_config_2node.json"
    config.write_text(json.dumps({
        "cluster": [{"cluster_nodes": [node(0), node(1)]}], "item_def": [{"item_type": "cpu"}],
    }))  # fmt: skip
    ids = token_ids()
    ours = tessel.save(tessel.build(small_llama(layers=1), (ids,), cluster=str(config)),
                       tmp_path / "ours")  # fmt: skip
    theirs = tessel.save(tessel.build(small_llama(layers=2), (ids,), cluster=str(config)),
                         tmp_path / "theirs")  # fmt: skip
    remote = subprocess.Popen(
        [sys.executable, "-m", "tessel.cli", "serve", str(theirs), "--node-id", "1"],
        env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        with pytest.raises(tessel.WorkerError, match="every node must serve the same") as refused:
            session.load_graph(0, {"tessel.load_timeout_s": 60}, ours)
        assert "theirs.tessel" in str(refused.value) and "ours.tessel" in str(refused.value)
        _, err = remote.communicate(timeout=60)
        assert remote.returncode != 0
        assert "every node must serve the same file" in err and "ours.tessel" in err, err
    finally:
        if remote.poll() is None:
            remote.kill()
            remote.wait()


def _build_on_two_nodes_of_two(tmp_path, model, ids, least_over: int, sizes: dict):
    """`model` built from the policy `sizes` for 2 loopback nodes of 2 devices each, whose
    memory is a quarter above what the plan needing least memory holds over `least_over`
    devices on half the batch."""
    from tessel.capture import capture
    from tessel.demo import tight_cluster
    from tessel.plan import has_rule

    port = _free_port()
    least = tight_cluster(capture(model, (ids[:2],), keep=has_rule), least_over)
    least_bytes = int(least["item_def"][0]["memory"].removeprefix("[DDR:")[:-2])
    node = lambda i: {  # noqa: E731
        "node_id": i,
        "node_type": "CPU",
        "ipaddr": "127.0.0.1",
        "port": port,
        "is_local": i == 0,
        "item_list": [{"item_id": 0}, {"item_id": 1}],
    }
    cluster = {
        "cluster": [{"cluster_nodes": [node(0), node(1)]}],
        "item_def": [{"item_type": "cpu", "memory": f"[DDR:{int(1.25 * least_bytes)}B]"}],
    }
    (tmp_path / "numa_config_2x2.json").write_text(json.dumps(cluster))
    (tmp_path / "policy.json").write_text(json.dumps({"graph_parallel_option": sizes}))
    return tessel.build(
        model,
        (ids,),
        cluster=str(tmp_path / "numa_config_2x2.json"),
        policy=str(tmp_path / "policy.json"),
    )


def test_two_nodes_of_two_devices_with_data_and_tensor_parallel_axes(tmp_path, session):
    """dp 2 across the nodes, tp 2 within each: each node's pair shards its half of the batch
    on devices too small for the replicated weights (with room on rank 0 for the rows the
    other replica sends it), and the halves are gathered to rank 0."""
    from tessel.report import inspect_json

    model = small_llama(layers=1)
    sizes = {
        "tensor_parallel_option": {"tensor_parallel_size": 2},
        "data_parallel_option": {"data_parallel_size": 2},
    }
    built = _build_on_two_nodes_of_two(tmp_path, model, token_ids(batch=4), 2, sizes)
    groups = {g for s in built.manifest.submodels for g in s.comm_groups}
    assert {(0, 1), (2, 3), (0, 2)} <= groups and (1, 3) not in groups
    rank0 = inspect_json(built.manifest)["ranks"][0]  # what tessel inspect shows
    assert {c["axis"] for c in rank0["collectives"]} == {"dp", "tp"}
    across = [c["bytes"] for c in rank0["collectives"] if c["axis"] == "dp"]
    assert rank0["bytes_between_nodes"] == sum(across) > 0  # only replica 1's rows
    path = tessel.save(built, tmp_path / "dp2tp2")
    _run_with_node_1_served(session, path, model, token_ids(batch=4, seed=3))


# what torch writes when it warns: its log records (`[rank0]:W1126 ... torch/....py:390] ...`)
# and Python warnings (`...: UserWarning: ...`)
_TORCH_WARNING = re.compile(r"torch/\S+\.py:\d+\]|\w+Warning: |sequential all_gather")
# what lies between a gather and what reads its result when nothing is computed on it
_PASSED_THROUGH = {
    "getitem", "_c10d_functional.wait_tensor.default", "aten.view.default",
    "aten._unsafe_view.default", "aten.reshape.default", "aten.permute.default",
    "aten.clone.default", "aten.contiguous.default", "aten.split.Tensor", "aten.chunk.default",
    "aten.cat.default",
}  # fmt: skip


def _sources(value) -> list[str]:
    """The names of the nodes an argument (or a list of them) reads."""
    if isinstance(value, dict) and "$node" in value:
        return [value["$node"]]
    return [n for v in value for n in _sources(v)] if isinstance(value, list) else []


def _gathers_of_gathers(program: dict) -> list[tuple[str, str]]:
    """(gather, earlier gather) for each all-gather of a program whose input is, but for views
    and waits, another all-gather's result over another group along the same tensor dim: one
    move in two collectives. (A block of a weight cut along two dims is gathered one dim per
    axis: no one collective does that.)"""
    nodes = {n["name"]: n for n in program["nodes"] if "name" in n}
    readers: dict[str, list[dict]] = {}
    for n in nodes.values():
        for name in _sources(n.get("args", [])):
            readers.setdefault(name, []).append(n)

    def gathered_dim(name: str) -> int:
        """The dim a gather joins its blocks along: 0, or the dim of the cat of the pieces its
        wait's result is split into."""
        for wait in readers.get(name, []):
            for split in readers.get(wait["name"], []):
                if split.get("target") != "aten.split.Tensor":
                    continue
                for piece in readers.get(split["name"], []):
                    for cat in readers.get(piece["name"], []):
                        if cat.get("target") == "aten.cat.default":
                            return cat["args"][1] if len(cat["args"]) > 1 else 0
        return 0

    def group(node: dict) -> list[int] | None:
        return next((a["$group"] for a in node["args"] if isinstance(a, dict) and "$group" in a),
                    None)  # fmt: skip

    found = []
    for node in program["nodes"]:
        if not node.get("target", "").startswith("_c10d_functional.all_gather"):
            continue
        seen, todo = set(), _sources(node["args"][0])
        while todo:
            before = nodes.get(todo.pop())
            if before is None or before["name"] in seen:
                continue
            seen.add(before["name"])
            target = before.get("target", "")
            if target.startswith("_c10d_functional.all_gather"):
                if group(before) != group(node) and gathered_dim(before["name"]) == gathered_dim(
                    node["name"]
                ):
                    found.append((node["name"], before["name"]))
            elif target in _PASSED_THROUGH:
                todo += _sources(before["args"])
    return found


def test_gathers_of_gathers_are_found():
    """The check below finds a gather over one axis of a gather over the other, through the
    wait and views between them, and passes gathers with computation between them."""
    group = lambda ranks: {"$group": ranks}  # noqa: E731
    call = lambda name, target, *args: {"op": "call", "name": name, "target": target,
                                        "args": list(args), "kwargs": {}}  # noqa: E731  # fmt: skip
    gather = "_c10d_functional.all_gather_into_tensor.default"
    wait = "_c10d_functional.wait_tensor.default"
    program = {"nodes": [
        {"op": "input", "name": "x"},
        call("g0", gather, {"$node": "x"}, 2, group([0, 1])),
        call("w0", wait, {"$node": "g0"}),
        call("v0", "aten.view.default", {"$node": "w0"}, [4, 8]),
        call("g1", gather, {"$node": "v0"}, 2, group([0, 2])),
        call("w1", wait, {"$node": "g1"}),
        call("m", "aten.mul.Tensor", {"$node": "w1"}, {"$node": "w1"}),
        call("g2", gather, {"$node": "m"}, 2, group([0, 1])),
        # a block cut along dims 0 and 1: dim 1 joined over one axis, then dim 0 over the other
        call("w2", wait, {"$node": "g2"}),
        call("s", "aten.split.Tensor", {"$node": "w2"}, 4),
        call("p0", "getitem", {"$node": "s"}, 0),
        call("p1", "getitem", {"$node": "s"}, 1),
        call("c", "aten.cat.default", [{"$node": "p0"}, {"$node": "p1"}], 1),
        call("g3", gather, {"$node": "c"}, 2, group([0, 2])),
        {"op": "output", "args": [{"$node": "g3"}]},
    ]}  # fmt: skip
    assert _gathers_of_gathers(program) == [("g1", "g0")]


def test_two_nodes_of_two_devices_as_one_tensor_parallel_mesh_of_two_axes(tmp_path, session, capfd):
    """tp 4 over both nodes is planned on a 2 x 2 mesh (tp_node x tp) of devices too small for
    the replicated weights: the weights are cut per axis, collectives run over the node's pair
    and over the nodes, a move over both axes is one collective over their joined group (never a
    gather of a gather), nothing of torch's warnings reaches the output of the build, the
    workers or the server at the default log level, and the output equals eager's."""
    from tessel.report import inspect_json

    model = small_llama(layers=1)
    sizes = {"tensor_parallel_option": {"tensor_parallel_size": 4}}
    built = _build_on_two_nodes_of_two(tmp_path, model, token_ids(batch=4), 4, sizes)
    data = inspect_json(built.manifest)
    assert [(a["name"], a["link"]) for a in data["mesh"]["axes"]] == [
        ("tp_node", "between nodes"),
        ("tp", "within a node"),
    ]
    axes = {c["axis"] for r in data["ranks"] for c in r["collectives"]}
    assert {"tp", "tp_node", "tp_node+tp"} <= axes
    for sub in built.manifest.submodels:
        program = json.loads(built.members[sub.program])
        assert _gathers_of_gathers(program) == [], sub.rank
    path = tessel.save(built, tmp_path / "tp2x2")
    served = _run_with_node_1_served(session, path, model, token_ids(batch=4, seed=3))
    out, err = capfd.readouterr()
    for written in (out, err, served):
        assert not _TORCH_WARNING.search(written), written


def test_two_nodes_of_two_devices_with_pipeline_stages_across_the_nodes(tmp_path, session):
    """pp 2 across the nodes, tp 2 within each: node 0 holds layers 0-1 and node 1 layers 2-3,
    sharded over each node's pair (the whole model barely fits the four devices); two
    micro-batches flow through, activations sent between the nodes, and rank 0 returns the
    whole batch."""
    from tessel.report import inspect_json

    model = small_llama(layers=4)
    sizes = {
        "tensor_parallel_option": {"tensor_parallel_size": 2},
        "pipeline_parallel_option": {"pipe_stage_num": 2, "micro_batch_num": 2},
    }
    built = _build_on_two_nodes_of_two(tmp_path, model, token_ids(batch=4), 4, sizes)
    data = inspect_json(built.manifest)
    assert [s["ranks"] for s in data["stages"]] == [[0, 1], [2, 3]]
    for r in data["ranks"]:  # each pair shards its layers; only the stages' sends cross nodes
        assert any(c["axis"] == "tp" for c in r["collectives"])
        across = [c for c in r["collectives"] if c["axis"] == "pp"]
        assert across and r["bytes_between_nodes"] == sum(c["bytes"] for c in across)
    path = tessel.save(built, tmp_path / "pp2tp2")
    _run_with_node_1_served(session, path, model, token_ids(batch=4, seed=3))


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """A GPT-2 built for 2 devices and for 3."""
    d = tmp_path_factory.mktemp("rt_gpt2")
    model = small_gpt2(layers=1)
    ids = token_ids()
    return model, {
        n: tessel.save(tessel.build(model, (ids,), cluster=n), d / f"tp{n}") for n in (2, 3)
    }


def _pids(session, graph_id):
    return [p.pid for p in session._graphs[graph_id].procs]


def _assert_matches(session, graph_id, model, ids):
    (out,) = session.run_graph(graph_id, [ids])
    with torch.no_grad():
        assert (out - model(ids)).abs().max().item() <= 1e-4


def _gone(pids):
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], 10)
    return not alive


def test_a_removed_graphs_workers_serve_the_next_package_of_their_shape(
    model_file, gpt2_files, session
):
    llama, ids, llama_path = model_file
    gpt2, paths = gpt2_files
    session.load_graph(0, {}, llama_path)
    _assert_matches(session, 0, llama, ids)
    first = _pids(session, 0)
    session.remove_graph(0)
    session.load_graph(1, {}, paths[2])
    assert _pids(session, 1) == first
    _assert_matches(session, 1, gpt2, ids)
    _assert_matches(session, 1, gpt2, token_ids(seed=7))
    session.remove_graph(1)
    session.load_graph(2, {}, llama_path)  # and back: the groups made first serve again
    assert _pids(session, 2) == first
    _assert_matches(session, 2, llama, ids)
    session.remove_graph(2)
    session.load_graph(3, {}, paths[3])  # another world size: new workers, the idle ones stop
    assert len(_pids(session, 3)) == 3 and not set(_pids(session, 3)) & set(first)
    assert _gone(first)
    _assert_matches(session, 3, gpt2, ids)


def test_a_loaded_graph_keeps_its_workers_to_itself(model_file, gpt2_files, session):
    llama, ids, llama_path = model_file
    gpt2, paths = gpt2_files
    session.load_graph(0, {}, llama_path)
    session.load_graph(1, {}, paths[2])
    assert not set(_pids(session, 0)) & set(_pids(session, 1))
    _assert_matches(session, 0, llama, ids)
    _assert_matches(session, 1, gpt2, ids)


@pytest.mark.timeout(120)
def test_a_session_hands_tensors_over_after_the_sharing_thread_ended(model_file, session):
    """A tensor reaches a worker as a file descriptor that multiprocessing's resource sharer,
    one thread of the session's process, hands over. With that thread ended (its listener
    left open), the next run would wait for ever; the session starts it again."""
    from multiprocessing import connection, current_process, resource_sharer

    llama, ids, path = model_file
    session.load_graph(0, {}, path)
    _assert_matches(session, 0, llama, ids)
    sharer = resource_sharer._resource_sharer
    ending = connection.Client(sharer._address, authkey=current_process().authkey)
    ending.send(None)  # what ends the thread: it serves nothing after
    ending.close()
    sharer._thread.join(10)
    assert not sharer._thread.is_alive()
    _assert_matches(session, 0, llama, ids)


def test_reuse_can_be_turned_off(model_file, session):
    _, _, path = model_file
    session.load_graph(0, {"tessel.reuse_workers": "false"}, path)
    first = _pids(session, 0)
    session.remove_graph(0)
    assert _gone(first)
    session.load_graph(1, {}, path)
    assert not set(_pids(session, 1)) & set(first)
    with pytest.raises(tessel.ConfigError, match="tessel.reuse_workers: expected true or false"):
        session.load_graph(2, {"tessel.reuse_workers": "maybe"}, path)


def test_workers_that_reuse_freed_memory_equal_eager_and_are_pooled_apart(model_file, session):
    model, ids, path = model_file
    session.load_graph(0, {"tessel.reuse_freed_memory": True}, path)
    for _ in range(2):  # the second run takes memory the first one freed
        _assert_matches(session, 0, model, ids)
    reusing = _pids(session, 0)
    session.remove_graph(0)
    session.load_graph(1, {}, path)  # the default returns freed memory: other workers
    assert not set(_pids(session, 1)) & set(reusing)
    _assert_matches(session, 1, model, ids)
    with pytest.raises(tessel.ConfigError, match="tessel.reuse_freed_memory: expected true or"):
        session.load_graph(2, {"tessel.reuse_freed_memory": "sometimes"}, path)


def test_after_a_worker_error_the_next_load_starts_fresh_workers(
    model_file, gpt2_files, session, tmp_path
):
    llama, ids, path = model_file
    gpt2, paths = gpt2_files
    # a run that fails: the workers are stopped, the graph says so, and nothing is reused
    session.load_graph(0, {}, path)
    first = _pids(session, 0)
    os.kill(first[1], signal.SIGKILL)
    with pytest.raises(tessel.WorkerError, match=r"rank 1 died"):
        session.run_graph(0, [ids])
    assert _gone(first)
    with pytest.raises(tessel.WorkerError, match="stopped after an error"):
        session.run_graph(0, [ids])
    session.remove_graph(0)
    session.load_graph(1, {}, paths[2])
    second = _pids(session, 1)
    assert not set(second) & set(first)
    _assert_matches(session, 1, gpt2, ids)
    # a load that fails on reused workers: they are stopped, and the next load starts anew
    session.remove_graph(1)
    bad, _ = _altered(path, tmp_path)
    with pytest.raises(tessel.WorkerError, match="fails its checksum"):
        session.load_graph(2, {}, bad)
    assert _gone(second)
    session.load_graph(3, {}, path)
    assert not set(_pids(session, 3)) & set(second)
    _assert_matches(session, 3, llama, ids)


def test_idle_workers_outlive_the_collective_timeout(model_file, gpt2_files, session):
    """Ranks other than 0 wait for rank 0's word inside a broadcast, which gloo fails after the
    group's timeout; rank 0 keeps them alive while a graph or the idle workers wait."""
    llama, ids, path = model_file
    gpt2, paths = gpt2_files
    options = {"tessel.run_timeout_s": 1.5}
    assert collective_timeout_s(1.5) < 4  # each wait below outlasts the collective timeout
    session.load_graph(0, options, path)
    first = _pids(session, 0)
    time.sleep(4)
    _assert_matches(session, 0, llama, ids)
    session.remove_graph(0)
    time.sleep(4)
    session.load_graph(1, options, paths[2])
    assert _pids(session, 1) == first
    _assert_matches(session, 1, gpt2, ids)


def _report_and_exit(conn) -> None:  # a worker that saw a broken connection
    conn.send(("error", 0, ("RuntimeError", "Connection reset by peer", "")))
    os._exit(1)


def _wait_for_the_session(conn) -> None:  # a worker blocked in a collective
    conn.recv()


@pytest.mark.parametrize("peer", ["killed", "alive"])
def test_a_peer_killed_outright_is_named_before_the_connection_it_broke(peer):
    # a killed worker's sockets and pipe close together: the session may read a peer's report
    # of the broken connection first, and must still name the death as the cause
    import multiprocessing as mp

    from tessel.runtime.session import _silent_death, _Workers

    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [
        ctx.Process(target=_report_and_exit, args=(pipes[0][1],), daemon=True),
        ctx.Process(target=_wait_for_the_session, args=(pipes[1][1],), daemon=True),
    ]
    for p in procs:
        p.start()
    try:
        assert pipes[0][0].recv()[0] == "error"  # the peer's report came first
        if peer == "killed":
            os.kill(procs[1].pid, signal.SIGKILL)
        workers = _Workers(procs, [parent for parent, _ in pipes], [0, 1], True, 10.0)
        found = _silent_death(workers, 0)
        if peer == "killed":
            assert found is not None and "rank 1 died" in str(found), found
        else:
            assert found is None
    finally:
        for p in procs:
            p.kill()
            p.join()
