"""The partitioning policy file (`--graph_parallel_option_path`): `graph_parallel_option` with
`auto`, `opt_level`, `global_batch_size`, `tensor_parallel_option`, `data_parallel_option`,
`pipeline_parallel_option` and `tensor_sharding`, as CANN's examples and option structs write it.

The axis sizes are read here; whether they fit the cluster (CANN's rule EF1012, `check_sizes`)
is checked once the cluster's device count is known (here when it is given, and by
`tessel.config.mesh`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessel.config.errors import ConfigError
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
    data_parallel_size: int | None = None
    pipe_stage_num: int | None = None
    micro_batch_num: int | None = None  # tessel's key: CANN's documents spell none
    global_batch_size: int | None = None
    optimizer_state_sharding: bool = False
    gradient_sharding: bool = False
    model_weight_sharding: bool = False
    model_weight_prefetch: bool = False
    model_weight_prefetch_buffer_size: int = 0
    tensor_sharding_given: bool = False  # the policy has a tensor_sharding section
    optimizer_offload: str | None = None  # optimizer_offload_option.offload: "cpu"
    # weights whose placements on the tensor-parallel mesh are given, not solved: (FQN,
    # placements as `S(d)`/`R`, one per mesh dim) pairs (tessel.parallel's annotations)
    fixed_placements: tuple[tuple[str, tuple[str, ...]], ...] = ()
    source: str = "<default>"

    @property
    def training_keys(self) -> list[str]:
        """The policy's keys that only a training build honours, as the file spells them."""
        keys = [f"tensor_sharding.{k}" for k in SHARDING_SWITCHES if getattr(self, k)]
        if self.optimizer_offload is not None:
            keys.append("optimizer_offload_option.offload")
        return keys


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
    not_built = {k: f"'{k}' {_NOT_BUILT}" for k in ("engine_parallel_option", "mode", "work_dir")}
    g.check_keys(
        (
            "auto",
            "opt_level",
            "global_batch_size",
            "tensor_parallel_option",
            "data_parallel_option",
            "pipeline_parallel_option",
            "tensor_sharding",
            "optimizer_offload_option",
        ),
        not_built,
    )
    auto = g.boolean("auto", True)
    opt_level = g.get("opt_level", str, "O2")
    if opt_level not in OPT_LEVELS:
        raise g.error(
            f"found {describe(opt_level)}; allowed: 'O2' (ILP, the default) or 'O1' (DP)",
            "opt_level",
        )
    sizes: dict[str, int | None] = {}
    tpo = g.child("tensor_parallel_option", None)
    sizes["tensor_parallel_size"] = None
    if tpo is not None:
        tpo.check_keys(
            ("tensor_parallel_size", "inter_batch_flow_num"),
            {"inter_batch_flow_num": f"'inter_batch_flow_num' {_NOT_BUILT}"},
        )
        sizes["tensor_parallel_size"] = tpo.integer("tensor_parallel_size", 1, MAX_ID)
    dpo = g.child("data_parallel_option", None)
    sizes["data_parallel_size"] = None
    if dpo is not None:
        dpo.check_keys(("data_parallel_size",))
        sizes["data_parallel_size"] = dpo.integer("data_parallel_size", 1, MAX_ID)
    ppo = g.child("pipeline_parallel_option", None)
    sizes["pipe_stage_num"] = sizes["micro_batch_num"] = None
    if ppo is not None:
        ppo.check_keys(
            ("pipe_stage_num", "micro_batch_num"),
            {
                k: f"'{k}' {_NOT_BUILT}"
                for k in ("pipeline_strategy", "schedule_opt_virtual_stage_num")
            },
        )
        sizes["pipe_stage_num"] = ppo.integer("pipe_stage_num", 1, MAX_ID, None)
        sizes["micro_batch_num"] = ppo.integer("micro_batch_num", 1, MAX_ID, None)
        if (sizes["micro_batch_num"] or 1) > 1 and (sizes["pipe_stage_num"] or 1) == 1:
            raise ppo.error(
                f"is {sizes['micro_batch_num']}, but micro-batches feed pipeline stages and "
                "pipe_stage_num is not above 1; leave it out or set it to 1",
                "micro_batch_num",
            )
    sizes["global_batch_size"] = g.integer("global_batch_size", 1, MAX_ID, None)
    dp = sizes["data_parallel_size"]
    if sizes["global_batch_size"] is not None and dp and sizes["global_batch_size"] % dp:
        raise g.error(
            f"is {sizes['global_batch_size']}, which data_parallel_size {dp} does not divide; "
            "each data-parallel replica takes an equal part of the batch",
            "global_batch_size",
        )
    if world_size is not None:
        check_sizes(sizes, world_size, g.error)
    switches: dict[str, Any] = {}
    ts = g.child("tensor_sharding", None)
    if ts is not None:
        ts.check_keys((*SHARDING_SWITCHES, "model_weight_prefetch_buffer_size"))
        switches["tensor_sharding_given"] = True
        for key in SHARDING_SWITCHES:
            switches[key] = ts.boolean(key, False)
        switches["model_weight_prefetch_buffer_size"] = ts.integer(
            "model_weight_prefetch_buffer_size", 0, MAX_PREFETCH_MB, 0
        )
    offload = g.child("optimizer_offload_option", None)
    if offload is not None:
        offload.check_keys(
            ("offload",), {"offload_path": f"'offload_path' (NVMe offload) {_NOT_BUILT}"}
        )
        where = offload.get("offload", str)
        if where.lower() != "cpu":
            raise offload.error(
                f"found {describe(where)}; tessel offloads optimizer states to 'cpu' only "
                "(CANN reserves 'NVME')",
                "offload",
            )
        switches["optimizer_offload"] = "cpu"
    return ParallelOption(
        auto,
        opt_level,
        tensor_parallel_size=sizes["tensor_parallel_size"],
        data_parallel_size=sizes["data_parallel_size"],
        pipe_stage_num=sizes["pipe_stage_num"],
        micro_batch_num=sizes["micro_batch_num"],
        global_batch_size=sizes["global_batch_size"],
        source=source,
        **switches,
    )


def check_sizes(sizes: dict[str, Any], world_size: int, fail: Callable[..., ConfigError]) -> None:
    """CANN's rule EF1012, with pipeline stages: the sizes the policy sets multiply to the
    device count (tensor x data parallel x stages when both are set; the one set x stages when
    one is), and the stage count divides it. `fail(message, key)` makes the error."""
    tp, dp = sizes.get("tensor_parallel_size"), sizes.get("data_parallel_size")
    pp = sizes.get("pipe_stage_num") or 1
    if world_size % pp:
        raise fail(
            f"is {pp}, which does not divide the cluster's {world_size} devices",
            "pipeline_parallel_option.pipe_stage_num",
        )
    given = {k: v for k, v in (("tensor_parallel_size", tp), ("data_parallel_size", dp)) if v}
    if not given:
        return
    product = math.prod(given.values()) * pp
    if product != world_size:
        terms = " x ".join(f"{k} {v}" for k, v in given.items())
        if pp > 1:
            terms += f" x pipe_stage_num {pp}"
        rule = (
            "when both tensor_parallel_option and data_parallel_option are set, their sizes"
            if len(given) == 2
            else "the size that is set"
        )
        key = (
            "tensor_parallel_option.tensor_parallel_size"
            if tp
            else "data_parallel_option.data_parallel_size"
        )
        found = f"{terms} is {product}" if len(given) + (pp > 1) > 1 else f"is {product}"
        raise fail(
            f"{found} but the cluster config has {world_size} devices; {rule} (times the stage "
            "count) must equal the device count (CANN's EF1012)",
            key,
        )
