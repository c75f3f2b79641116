"""CANN's IR build API names (aclgrphBuildInitialize, aclgrphBuildModel, aclgrphSaveModel,
aclgrphBuildFinalize) and its option keys (`ge.cluster_config`, ...), over `tessel.build`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tessel.builder.options import check_build_options
from tessel.builder.pipeline import BuiltModel, build
from tessel.builder.pipeline import save as _save
from tessel.config.cluster import local_cluster, read_cluster_config
from tessel.config.errors import ConfigError
from tessel.config.fields import Fields

CLUSTER_CONFIG = "ge.cluster_config"
DISTRIBUTED_CLUSTER_BUILD = "ge.distributed_cluster_build"
ENABLE_GRAPH_PARALLEL = "ge.enableGraphParallel"
GRAPH_PARALLEL_OPTION_PATH = "ge.graphParallelOptionPath"
SOC_VERSION = "ge.socVersion"
MODEL_RELATION_CONFIG = "ge.offline_model_relation"

_NAMES = {
    "distributed_cluster_build": DISTRIBUTED_CLUSTER_BUILD,
    "enable_graph_parallel": ENABLE_GRAPH_PARALLEL,
    "cluster_config": CLUSTER_CONFIG,
    "graph_parallel_option_path": GRAPH_PARALLEL_OPTION_PATH,
}
_global: dict[str, str] = {}
# the option keys build_initialize and build_model read (MODEL_RELATION_CONFIG is refused with
# its own message: pre-sliced models have a build of their own)
_OPTIONS = frozenset(
    {CLUSTER_CONFIG, DISTRIBUTED_CLUSTER_BUILD, ENABLE_GRAPH_PARALLEL, GRAPH_PARALLEL_OPTION_PATH}
    | {SOC_VERSION, MODEL_RELATION_CONFIG}
)


def _checked(options: dict[str, str] | None, call: str) -> dict[str, str]:
    """`options`, refused where one is a key neither call reads: a setting accepted and
    ignored would be a no-op."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ConfigError(
            f"{call} options", None, f"expected a dict, found {type(options).__name__}"
        )
    Fields(options, f"{call} options").check_keys(_OPTIONS)
    return options


def build_initialize(options: dict[str, str] | None = None) -> None:
    """aclgrphBuildInitialize: global options, CLUSTER_CONFIG among them."""
    checked = _checked(options, "build_initialize")
    _global.clear()
    _global.update(checked)


def build_model(
    model: torch.nn.Module, example_inputs: Any, options: dict[str, str] | None = None
) -> BuiltModel:
    """aclgrphBuildModel: DISTRIBUTED_CLUSTER_BUILD, ENABLE_GRAPH_PARALLEL, GRAPH_PARALLEL_OPTION_PATH."""
    merged = {**_global, **_checked(options, "build_model")}
    if MODEL_RELATION_CONFIG in merged:
        raise ConfigError(
            "build options",
            MODEL_RELATION_CONFIG,
            "pre-sliced models are built from their directory: `tessel build --shard_model_dir "
            "DIR --model_relation_config FILE` or `tessel.build_from_slices(DIR, FILE, cluster)`; "
            "build_model takes one complete model",
        )
    checked = check_build_options(
        distributed_cluster_build=merged.get(DISTRIBUTED_CLUSTER_BUILD, "0"),
        enable_graph_parallel=merged.get(ENABLE_GRAPH_PARALLEL, "0"),
        cluster_config=merged.get(CLUSTER_CONFIG),
        graph_parallel_option_path=merged.get(GRAPH_PARALLEL_OPTION_PATH),
        soc_version=merged.get(SOC_VERSION, "cpu"),
        source="build options",
        names=_NAMES,
    )
    soc = checked.soc_version
    if checked.cluster_config:
        cluster = read_cluster_config(checked.cluster_config, soc)
    else:
        cluster = local_cluster(4 if checked.distributed_cluster_build else 1, soc)
    return build(
        model,
        example_inputs,
        cluster=cluster,
        policy=checked.graph_parallel_option_path,
        soc_version=soc,
        graph_parallel=checked.enable_graph_parallel,
    )


def save_model(path: str | Path, model: BuiltModel) -> Path:
    """aclgrphSaveModel: serialise the offline model to a file."""
    return _save(model, path)


def build_finalize() -> None:
    """aclgrphBuildFinalize."""
    _global.clear()
