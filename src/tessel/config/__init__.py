"""The JSON inputs: cluster config and partitioning policy, parsed into frozen dataclasses."""

from tessel.config.cluster import (
    ClusterConfig,
    Device,
    Node,
    cluster_from_dict,
    local_cluster,
    read_cluster_config,
)
from tessel.config.errors import ConfigError
from tessel.config.jsonfile import load_json
from tessel.config.parallel_option import ParallelOption, read_parallel_option
from tessel.config.soc import SocProfile, soc_profile

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "Device",
    "Node",
    "ParallelOption",
    "SocProfile",
    "cluster_from_dict",
    "load_json",
    "local_cluster",
    "read_cluster_config",
    "read_parallel_option",
    "soc_profile",
]
