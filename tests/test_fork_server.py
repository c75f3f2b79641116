"""A session's workers are forked from one fork server that imported torch once: they run as
spawned workers do, take their session's environment, and leave with it; `finalize` stops the
server, and a process forked from the server's owner spawns its workers instead."""

from __future__ import annotations

import multiprocessing as mp

import psutil
import pytest
import torch
from tests.conftest import is_multiprocessing_helper, small_llama, token_ids

import tessel


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    model = small_llama(layers=1)
    ids = token_ids()
    path = tessel.save(tessel.build(model, (ids,), cluster=2), tmp_path_factory.mktemp("fs") / "m")
    with torch.no_grad():
        return ids, model(ids), path


def _fork_servers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children() if is_multiprocessing_helper(p)
            and "forkserver" in " ".join(p.cmdline())]  # fmt: skip


def _run(path, ids) -> tuple[torch.Tensor, set[int]]:
    """One session's output and its workers' parents."""
    with tessel.Session() as session:
        session.load_graph(0, {}, path)
        parents = {psutil.Process(proc.pid).ppid() for proc in session._graphs[0].procs}
        (out,) = session.run_graph(0, [ids])
    return out, parents


def test_sessions_fork_their_workers_from_one_server_that_finalize_stops(model_file):
    ids, want, path = model_file
    tessel.initialize()
    try:
        first, first_parents = _run(path, ids)
        second, second_parents = _run(path, ids)
        servers = _fork_servers()
        assert len(servers) == 1
        assert first_parents == second_parents == {servers[0].pid}
        torch.testing.assert_close(first, want)
        torch.testing.assert_close(second, want)
    finally:
        tessel.finalize()
    psutil.wait_procs(servers, timeout=10)
    assert _fork_servers() == []


def test_a_worker_takes_the_environment_its_session_has_when_it_starts(model_file, monkeypatch):
    """The server started before the variable was set; the workers still see it (here gloo,
    told to use an interface this machine does not have)."""
    ids, _, path = model_file
    tessel.initialize()
    try:
        _run(path, ids)  # the server runs
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "tessel-no-such-if")
        with pytest.raises(tessel.WorkerError, match="tessel-no-such-if"):
            _run(path, ids)
    finally:
        tessel.finalize()


def _in_forked_child(path, ids, results) -> None:
    tessel.initialize()
    try:
        out, parents = _run(path, ids)
        results.put((out.tolist(), parents))  # plain values: the child leaves before they are read
    finally:
        tessel.finalize()


def test_a_process_forked_from_the_servers_owner_spawns_its_own_workers(model_file):
    ids, want, path = model_file
    tessel.initialize()
    try:
        _run(path, ids)  # this process owns a running server
        fork = mp.get_context("fork")
        results = fork.SimpleQueue()
        child = fork.Process(target=_in_forked_child, args=(path, ids, results))
        child.start()
        out, parents = results.get()
        child.join(60)
        assert child.exitcode == 0
        assert parents == {child.pid}  # spawned by the child itself
        torch.testing.assert_close(torch.tensor(out), want)
    finally:
        tessel.finalize()
