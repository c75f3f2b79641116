"""The partitioning policy file (`--graph_parallel_option_path`): `graph_parallel_option` with
`auto`, `opt_level`, `tensor_parallel_option` and `tensor_sharding`, as CANN's examples write it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessel.config.fields import MAX_ID, Fields, describe
from tessel.config.jsonfile import load_json

OPT_LEVELS = ("O2", "O1")
SHARDING_SWITCHES = (
    "optimizer_state_sharding",
    "gradient_sharding",
    "model_weight_sharding",
    "model_weight_prefetch",
)
MAX_PREFETCH_MB = 2**20  # the weight prefetch buffer, in MB (1 TiB)
_NOT_BUILT = (
    "is not built yet in tessel (it belongs to a later capability); remove it from the policy"
)


@dataclass(frozen=True)
class ParallelOption:
    auto: bool = True
    opt_level: str = "O2"
    tensor_parallel_size: int | None = None
    optimizer_state_sharding: bool = False
    gradient_sharding: bool = False
    model_weight_sharding: bool = False
    model_weight_prefetch: bool = False
    model_weight_prefetch_buffer_size: int = 0
    source: str = "<default>"


def read_parallel_option(path: str | Path, world_size: int | None = None) -> ParallelOption:
    """Read and check a policy file; `world_size` is the cluster's device count."""
    return parallel_option_from_dict(load_json(path), str(path), world_size)


def parallel_option_from_dict(
    data: Any, source: str, world_size: int | None = None
) -> ParallelOption:
    """Validate the policy; `world_size` is the cluster's device count it must agree with."""
    top = Fields(data, source)
    top.check_keys(("graph_parallel_option",))
    g = top.child("graph_parallel_option")
    not_built = {
        k: f"'{k}' {_NOT_BUILT}"
        for k in (
            "data_parallel_option",
            "pipeline_parallel_option",
            "optimizer_offload_option",
            "engine_parallel_option",
        )
    }
    g.check_keys(("auto", "opt_level", "tensor_parallel_option", "tensor_sharding"), not_built)
    auto = g.boolean("auto", True)
    opt_level = g.get("opt_level", str, "O2")
    if opt_level not in OPT_LEVELS:
        raise g.error(
            f"found {describe(opt_level)}; allowed: 'O2' (ILP, the default) or 'O1' (DP)",
            "opt_level",
        )
    if opt_level == "O1":
        raise g.error(
            "'O1' (the dynamic-programming solver) is not built yet; use 'O2' (ILP) or leave it out",
            "opt_level",
        )
    tp_size = None
    tpo = g.child("tensor_parallel_option", None)
    if tpo is not None:
        tpo.check_keys(("tensor_parallel_size",))
        tp_size = tpo.integer("tensor_parallel_size", 1, MAX_ID)
        if world_size is not None and tp_size != world_size:
            raise tpo.error(
                f"is {tp_size} but the cluster config has {world_size} devices; they must be equal",
                "tensor_parallel_size",
            )
    switches: dict[str, Any] = {}
    ts = g.child("tensor_sharding", None)
    if ts is not None:
        ts.check_keys((*SHARDING_SWITCHES, "model_weight_prefetch_buffer_size"))
        for key in SHARDING_SWITCHES:
            switches[key] = ts.boolean(key, False)
            if switches[key]:
                raise ts.error(
                    "is true, but tensor sharding belongs to training, which tessel does not build "
                    "yet; set it to false or remove it",
                    key,
                )
        switches["model_weight_prefetch_buffer_size"] = ts.integer(
            "model_weight_prefetch_buffer_size", 0, MAX_PREFETCH_MB, 0
        )
    return ParallelOption(auto, opt_level, tp_size, source=source, **switches)
