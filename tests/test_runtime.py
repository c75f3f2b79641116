"""Workers that die or hang make run_graph fail fast; several nodes meet at the head's address."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests.conftest import small_llama, token_ids

import tessel

ROOT = Path(__file__).resolve().parents[1]


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
    with pytest.raises(RuntimeError, match="initialize"):
        tessel.Session()


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
    with pytest.raises(tessel.WorkerError, match=r"rank 1 died \(exit code -9\)"):
        session.run_graph(0, [ids])
    assert time.monotonic() - t < 60


def test_hung_worker_times_out(model_file, session):
    _, ids, path = model_file
    session.load_graph(0, {"tessel.run_timeout_s": 5}, path)
    session.run_graph(0, [ids])
    victim = session._graphs[0].procs[1]
    os.kill(victim.pid, signal.SIGSTOP)
    t = time.monotonic()
    with pytest.raises(tessel.WorkerError, match=r"no answer from ranks \[0\] in time"):
        session.run_graph(0, [ids])
    assert time.monotonic() - t < 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback(tmp_path, session):
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
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    remote = subprocess.Popen(
        [sys.executable, "-m", "tessel.cli", "serve", str(path), "--node-id", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        session.load_graph(0, {}, path)
        (out,) = session.run_graph(0, [ids])
        with torch.no_grad():
            assert (out - model(ids)).abs().max().item() <= 1e-4
        session.remove_graph(0)
        assert remote.wait(timeout=60) == 0, remote.stderr.read()
    finally:
        if remote.poll() is None:
            remote.kill()
            remote.wait()
