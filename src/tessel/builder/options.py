"""ATC's build flag rules (`--distributed_cluster_build`, `--enable_graph_parallel`, ...), shared by
the CLI and CANN's IR build API names (`tessel.builder.seed_api`)."""

from __future__ import annotations

from dataclasses import dataclass

from tessel.capture.export import framework_name
from tessel.config.errors import ConfigError
from tessel.log_levels import LOG_LEVELS, log_level  # noqa: F401 - still importable from here


@dataclass(frozen=True)
class BuildOptions:
    distributed_cluster_build: bool
    enable_graph_parallel: bool
    cluster_config: str | None
    graph_parallel_option_path: str | None
    soc_version: str = "cpu"
    shard_model_dir: str | None = None
    model_relation_config: str | None = None
    framework: str = "pytorch"  # or "onnx" (ATC's 5)


def _switch(value: object, name: str, source: str) -> bool:
    text = str(value).strip().strip('"')
    if text not in ("0", "1"):
        raise ConfigError(source, name, f"expected 0 or 1, found {value!r}")
    return text == "1"


def check_build_options(
    *,
    distributed_cluster_build: object = 0,
    enable_graph_parallel: object = 0,
    cluster_config: str | None = None,
    graph_parallel_option_path: str | None = None,
    framework: str = "pytorch",
    soc_version: str = "cpu",
    shard_model_dir: str | None = None,
    model_relation_config: str | None = None,
    source: str = "command line",
    names: dict[str, str] | None = None,
) -> BuildOptions:
    """Validate the build switches as ATC does; errors name the flag (or option key)."""
    names = {
        "distributed_cluster_build": "--distributed_cluster_build",
        "enable_graph_parallel": "--enable_graph_parallel",
        "cluster_config": "--cluster_config",
        "graph_parallel_option_path": "--graph_parallel_option_path",
        "framework": "--framework",
        "shard_model_dir": "--shard_model_dir",
        "model_relation_config": "--model_relation_config",
        **(names or {}),
    }
    framework = framework_name(framework, source, names["framework"])
    dcb = _switch(distributed_cluster_build, names["distributed_cluster_build"], source)
    egp = _switch(enable_graph_parallel, names["enable_graph_parallel"], source)
    if shard_model_dir or model_relation_config:
        _check_slice_options(
            source, names, dcb, egp, cluster_config, graph_parallel_option_path,
            shard_model_dir, model_relation_config,
        )  # fmt: skip
    if egp and not dcb:
        raise ConfigError(
            source,
            names["enable_graph_parallel"],
            f"=1 needs {names['distributed_cluster_build']}=1",
        )
    if egp and not cluster_config:
        raise ConfigError(
            source, names["enable_graph_parallel"], f"=1 needs {names['cluster_config']}"
        )
    if egp and not graph_parallel_option_path:
        raise ConfigError(
            source,
            names["graph_parallel_option_path"],
            f"is mandatory when {names['enable_graph_parallel']}=1 (the partitioning policy file)",
        )
    if graph_parallel_option_path and not egp:
        raise ConfigError(
            source,
            names["graph_parallel_option_path"],
            f"is only used with {names['distributed_cluster_build']}=1 and {names['enable_graph_parallel']}=1",
        )
    return BuildOptions(
        dcb,
        egp,
        cluster_config,
        graph_parallel_option_path,
        soc_version,
        shard_model_dir,
        model_relation_config,
        framework,
    )


def _check_slice_options(
    source: str,
    names: dict[str, str],
    dcb: bool,
    egp: bool,
    cluster_config: str | None,
    graph_parallel_option_path: str | None,
    shard_model_dir: str | None,
    model_relation_config: str | None,
) -> None:
    """Pre-sliced models: the slice directory and its relation config together, for a
    distributed build on a given cluster, never partitioned again."""
    slices, relation = names["shard_model_dir"], names["model_relation_config"]
    if not shard_model_dir:
        raise ConfigError(source, relation, f"is used only with {slices} (the slices it relates)")
    if not model_relation_config:
        raise ConfigError(
            source, slices, f"needs {relation} (which slice runs on which device as which rank)"
        )
    if not dcb:
        raise ConfigError(source, slices, f"needs {names['distributed_cluster_build']}=1")
    if egp or graph_parallel_option_path:
        raise ConfigError(
            source,
            names["enable_graph_parallel"] if egp else names["graph_parallel_option_path"],
            f"partitions a complete model; the slices of {slices} are partitioned already",
        )
    if not cluster_config:
        raise ConfigError(
            source, names["cluster_config"], f"is required with {slices} (the slices' devices)"
        )
