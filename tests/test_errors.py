"""tessel's errors pickle, whatever their constructors take, so a worker process can send one."""

from __future__ import annotations

import multiprocessing
import pickle
import sys

import pytest

from tessel.checkpoint.errors import (
    CheckpointError,
    LayoutError,
    LayoutTypeError,
    NotExpressibleError,
    StrategyError,
)
from tessel.config.errors import ConfigError
from tessel.errors import TesselError
from tessel.package.manifest import PackageError


def _heavy(module: str, name: str):
    """An error class from a module that imports torch, imported when a test needs it: the
    spawned worker below imports this file, and starts faster without torch."""
    import importlib

    return getattr(importlib.import_module(module), name)


EXAMPLES = {
    "TesselError": lambda: TesselError("plain"),
    "ConfigError": lambda: ConfigError("numa_config.json", "cluster[0].port", "found 'x'"),
    "ConfigError-bare": lambda: ConfigError(None, None, "no source"),
    "LayoutError": lambda: LayoutError("tensor_map", "out of range"),
    "LayoutTypeError": lambda: LayoutTypeError("device_matrix", "expected a tuple"),
    "CheckpointError": lambda: CheckpointError("ckpt/rank_0", None, "missing"),
    "StrategyError": lambda: StrategyError("s.json", "params.w", "bad"),
    "NotExpressibleError": lambda: NotExpressibleError("Layout", None, "interleaved"),
    "DeployError": lambda: _heavy("tessel.dataflow.errors", "DeployError")(
        "deploy.json", "batch_deploy_info[0]", "a node may be placed only once", "twice", node="a"
    ),
    "TransactionFailed": lambda: _heavy("tessel.dataflow.errors", "TransactionFailed")(
        3, "flaky", 1, "ValueError: bad", "Traceback"
    ),
    "FlowTimeout": lambda: _heavy("tessel.dataflow.errors", "FlowTimeout")("no result in 10 ms"),
    "PackageError": lambda: PackageError("m.tessel", "fails its checksum"),
    "ProgramError": lambda: _heavy("tessel.lower.program", "ProgramError")("unknown operator"),
    "PlanError": lambda: _heavy("tessel.plan", "PlanError")("the model does not fit"),
    "VerifyError": lambda: _heavy("tessel.builder.verify", "VerifyError")("differs"),
    "WorkerError": lambda: _heavy("tessel.runtime.session", "WorkerError")(
        "rank 1 failed: ValueError: x", 1, "Traceback ..."
    ),
    "SessionError": lambda: _heavy("tessel.runtime.session", "SessionError")("initialize"),
    "NodeError": lambda: _heavy("tessel.runtime.rendezvous", "NodeError")("node 1 is running"),
}


def _same(a: BaseException, b: BaseException) -> None:
    assert type(a) is type(b)
    assert a.args == b.args
    assert str(a) == str(b)
    assert vars(a) == vars(b)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_every_error_pickles(name):
    error = EXAMPLES[name]()
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        _same(pickle.loads(pickle.dumps(error, protocol)), error)


def test_a_config_error_keeps_its_parts_and_its_notes():
    error = ConfigError("numa_config.json", "cluster[0].port", "expected an integer")
    if sys.version_info >= (3, 11):
        error.add_note("while loading graph 0")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.source, copy.key, copy.detail) == ("numa_config.json", "cluster[0].port",
                                                    "expected an integer")  # fmt: skip
    assert str(copy) == "numa_config.json: cluster[0].port: expected an integer"
    assert isinstance(copy, ValueError)
    if sys.version_info >= (3, 11):
        assert copy.__notes__ == ["while loading graph 0"]


def _raise_strategy_error(conn) -> None:
    try:
        raise StrategyError("strategy.json", "params.w.tensor_map", "out of range")
    except TesselError as exc:
        conn.send(exc)
    conn.close()


def test_a_worker_process_can_send_the_error_it_raised():
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_raise_strategy_error, args=(child,))
    proc.start()
    child.close()
    try:
        assert parent.poll(60), "the worker sent nothing"
        got = parent.recv()
    finally:
        proc.join(60)
    assert proc.exitcode == 0
    assert isinstance(got, StrategyError) and isinstance(got, ConfigError)
    assert (got.source, got.key, got.detail) == ("strategy.json", "params.w.tensor_map",
                                                 "out of range")  # fmt: skip
    assert str(got) == "strategy.json: params.w.tensor_map: out of range"
