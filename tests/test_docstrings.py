"""The public API's docstrings use one style (Google's `Args:`, `Returns:`, `Raises:`, which
the site's API pages render) and document every public parameter; `Session.generate`'s
sampling settings say what `tessel.config.sampling.Sampling`, their one source, says.

The core API is held to it: building, saving, the runtime, `Generation`, the serving engine,
`tessel.checkpoint`'s functions, `tessel.parallel`'s training API and DataFlow's graph.
DataFlow's nodes and process points, and `Layout`, are not yet."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

import tessel
from tessel.checkpoint import api as checkpoint_api
from tessel.config.sampling import Sampling
from tessel.dataflow import graph as flow_graph
from tessel.dataflow import session as flow_session
from tessel.dataflow.pyflow import pyflow as flow_pyflow
from tessel.parallel import annotate, auto_parallel, micro_batches, pipeline
from tessel.runtime.session import Session
from tessel.serving.engine import Engine

CORE = {
    "tessel.build": tessel.build,
    "tessel.save": tessel.save,
    "tessel.initialize": tessel.initialize,
    "tessel.finalize": tessel.finalize,
    "tessel.load_model": tessel.load_model,
    "tessel.Generation": tessel.Generation,
    "tessel.Session": Session,
    **{
        f"tessel.Session.{name}": getattr(Session, name)
        for name in (
            "load_graph", "run_graph", "generate", "save_checkpoint", "training_stats",
            "set_learning_rate", "remove_graph", "close",
        )
    },
    "tessel.serving.engine.Engine": Engine,
    **{
        f"tessel.serving.engine.Engine.{name}": getattr(Engine, name)
        for name in ("request", "submit", "stop_admitting", "drain", "close")
    },
    **{
        f"tessel.checkpoint.{name}": getattr(checkpoint_api, name)
        for name in (
            "rank_list_for_convert", "convert_checkpoint_by_rank", "convert_checkpoints",
            "unified_safetensors", "shard_checkpoint", "build_searched_strategy",
            "merge_pipeline_strategys", "restore_group_info_list", "parameter_broadcast",
            "load_segmented_checkpoints", "load_distributed_checkpoint",
        )
    },
    "tessel.dataflow.init": flow_session.init,
    "tessel.dataflow.finalize": flow_session.finalize,
    "tessel.dataflow.FlowGraph": flow_graph.FlowGraph,
    "tessel.dataflow.pyflow": flow_pyflow,
    **{
        f"tessel.dataflow.FlowGraph.{name}": getattr(flow_graph.FlowGraph, name)
        for name in ("feed_data", "feed", "fetch_data", "fetch")
    },
    "tessel.parallel.AutoParallel": auto_parallel.AutoParallel,
    **{
        f"tessel.parallel.AutoParallel.{name}": getattr(auto_parallel.AutoParallel, name)
        for name in (
            "load_param_strategy_file", "save_param_strategy_file", "set_group_ckpt_save_file",
            "dataset_strategy", "hsdp", "pipeline", "comm_fusion",
        )
    },
    "tessel.parallel.shard": annotate.shard,
    "tessel.parallel.reshard": annotate.reshard,
    "tessel.parallel.nn.GradAccumulation": micro_batches.GradAccumulation,
    "tessel.parallel.nn.MicroBatchInterleaved": micro_batches.MicroBatchInterleaved,
    "tessel.parallel.nn.Pipeline": pipeline.Pipeline,
    "tessel.parallel.nn.PipelineGradReducer": pipeline.PipelineGradReducer,
    "tessel.parallel.sync_pipeline_shared_parameters": pipeline.sync_pipeline_shared_parameters,
}  # fmt: skip


def _documented(doc: str) -> set[str]:
    """The names the `Args:` section of a (dedented) docstring has entries for."""
    names: set[str] = set()
    inside = False
    for line in doc.splitlines():
        if not line.startswith(" ") and line.strip():
            inside = line == "Args:"
            continue
        entry = re.match(r"    (\w+)(?: \([^)]*\))?: ", line)
        if inside and entry:
            names.add(entry[1])
    return names


def _parameters(obj) -> list[inspect.Parameter]:
    signature = inspect.signature(obj)
    return [
        p
        for p in signature.parameters.values()
        if p.name != "self"
        and not p.name.startswith("_")  # a decorator's positional target
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


@pytest.mark.parametrize("name", list(CORE))
def test_every_public_parameter_has_an_entry(name) -> None:
    obj = CORE[name]
    doc = inspect.getdoc(obj) or ""
    assert doc, f"{name} has no docstring"
    wanted = {p.name for p in _parameters(obj)}
    missing = wanted - _documented(doc)
    assert not missing, f"{name}'s docstring has no Args entry for {sorted(missing)}"
    extra = _documented(doc) - wanted
    assert not extra, f"{name}'s docstring documents {sorted(extra)}, which it does not take"
    returns = None if inspect.isclass(obj) else inspect.signature(obj).return_annotation
    if returns not in (None, "None", inspect.Signature.empty):
        assert "\nReturns:\n" in doc, f"{name} returns {returns} but says nothing of it"


def test_generates_sampling_settings_say_what_sampling_says() -> None:
    doc = " ".join((inspect.getdoc(Session.generate) or "").split())
    for f in dataclasses.fields(Sampling):
        assert f"{f.name}: {f.metadata['help']}" in doc, f.name


def test_a_parameter_left_out_is_found() -> None:
    def documented(a: int, b: int) -> int:
        """Add.

        Args:
            a: One.

        Returns:
            The sum.
        """
        return a + b

    assert _documented(inspect.getdoc(documented) or "") == {"a"}
