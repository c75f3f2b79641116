"""`tessel.build(..., optimizer=opt)`: one offline model holding a partitioned training step.

The step (forward, backward, and the optimizer's update) is planned for one data-parallel
replica's tensor-parallel devices on its share of the batch; every replica runs that program on
its own rows, each gradient returned placed like its weight. Workers then average the
gradients over the data-parallel axis (or reduce-scatter them: gradient sharding) and update
their shards with torch's optimizer (each rank a 1/dp part of every shard with optimizer state
sharding, the parts then all-gathered), see `tessel.runtime.step`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from typing import Any

import torch

from tessel.builder.mesh_choice import first_devices, replica_batch
from tessel.capture import capture_training
from tessel.capture.export import split_inputs
from tessel.capture.training import gradient_outputs
from tessel.config.cluster import ClusterConfig
from tessel.config.errors import ConfigError
from tessel.config.mesh import parallel_dims
from tessel.config.optimizer import (
    STEP_NAME,
    OptimizerSpec,
    optimizer_spec,
    state_keys,
    state_name,
)
from tessel.config.parallel_option import ParallelOption
from tessel.lower.program import move_groups
from tessel.plan import has_rule

log = logging.getLogger(__name__)

_NOT_BUILT = "is not built yet for training in tessel; set it to false or remove it"


def build_training(
    model: torch.nn.Module,
    example_inputs: Any,
    example_kwargs: dict | None,
    optimizer: Any,
    cluster: ClusterConfig,
    policy: ParallelOption,
    soc_version: str,
    time_limit: float,
) -> tuple[dict, dict, dict[str, float]]:
    """The manifest, members and timings of a training package (see the module docstring)."""
    from tessel.builder.pipeline import _pack, plan_and_lower

    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            "model", None, f"a training step needs an nn.Module, found {type(model).__name__}"
        )
    dims = parallel_dims(cluster, policy)
    dp, tp, pp = dims.size("dp"), dims.size("tp"), dims.size("pp")
    if pp > 1:
        raise ConfigError(
            policy.source,
            "graph_parallel_option.pipeline_parallel_option.pipe_stage_num",
            f"is {pp}: pipeline stages {_NOT_BUILT}",
        )
    for key in ("model_weight_sharding", "model_weight_prefetch"):
        if getattr(policy, key):
            raise ConfigError(
                policy.source, f"graph_parallel_option.tensor_sharding.{key}", _NOT_BUILT
            )
    if policy.optimizer_offload is not None and cluster.soc.device_type != "cpu":
        raise ConfigError(
            policy.source,
            "graph_parallel_option.optimizer_offload_option",
            f"offloads optimizer states from {cluster.soc.device_type} devices, which {_NOT_BUILT}",
        )
    sharded_states = dp > 1 and (policy.optimizer_state_sharding or policy.gradient_sharding)
    trainable = tuple(n for n, p in model.named_parameters() if p.requires_grad)
    for name, p in model.named_parameters():
        if p.requires_grad and p.dtype != torch.float32:
            raise ConfigError(
                "model",
                name,
                f"is {str(p.dtype).removeprefix('torch.')}: a training step takes fp32 weights "
                "(bf16 weights with fp32 optimizer states and gradient reduction are not built "
                "yet in tessel); build from model.float()",
            )
    names = {id(p): n for n, p in model.named_parameters()}
    spec = optimizer_spec(optimizer, names, trainable)

    timings: dict[str, float] = {}
    t = time.perf_counter()
    args, kwargs = split_inputs(example_inputs, example_kwargs)
    split = replica_batch(args, kwargs, dp, policy.source) if dp > 1 else (args, kwargs)
    state = spec.state_per_weight / (dp if sharded_states else 1)
    captured = capture_training(model, *split, keep=has_rule, state_factor=state)
    timings["capture"] = time.perf_counter() - t

    plan, programs = plan_and_lower(
        captured,
        first_devices(cluster, tp) if dp > 1 else cluster,
        policy,
        time_limit=time_limit,
        reuse_layers=False,
        timings=timings,
    )
    # replica d runs the first replica's programs on ranks d*tp ..., its groups moved there
    every = [
        rp
        if rank < tp
        else replace(
            rp,
            program=move_groups(rp.program, lambda q, base=rank - rank % tp: q + base),
        )
        for rank in range(cluster.world_size)
        for rp in (programs[rank % tp],)
    ]
    t = time.perf_counter()
    manifest, members = _pack(captured, plan, every, cluster, soc_version, True, dp)
    members["strategy.json"] = _with_optimizer_states(members["strategy.json"], spec)
    manifest["mode"] = "training"
    manifest["outputs"] = [{"shape": [], "dtype": "float32"}]
    manifest["training"] = {
        "optimizer": spec.to_json(),
        "gradients": list(captured_gradients(captured)),
        "data_parallel": dp,
        "tensor_parallel": tp,
        # a rank keeping 1/dp of the gradients can only update that part: ZeRO's stage 2
        "optimizer_state_sharding": sharded_states,
        "gradient_sharding": dp > 1 and policy.gradient_sharding,
        "optimizer_offload": policy.optimizer_offload or "none",
    }
    manifest["plan"]["training"] = _explain(manifest["training"], cluster, policy)
    manifest["plan"]["verify"] = {
        "skipped": "a training step changes the weights; tests check steps against torch"
    }
    timings["pack"] = time.perf_counter() - t
    return manifest, members, timings


def _with_optimizer_states(strategy_json: bytes, spec: OptimizerSpec) -> bytes:
    """The package's strategy file plus the optimizer's states, each laid out like its weight
    (`optimizer.<key>.<weight>`), and Adam's step count: what `save_checkpoint` writes."""
    strategy = json.loads(strategy_json)
    params = strategy["params"]
    for group in spec.groups:
        for key in state_keys(spec.name, group.options):
            for weight in group.params:
                if weight in params:
                    params[state_name(key, weight)] = dict(params[weight])
    if spec.name != "SGD":
        any_weight = next(iter(params.values()))
        params[STEP_NAME] = {
            **any_weight,
            "tensor_map": [],
            "shape": [],
            "dtype": "float32",
        }
    return json.dumps(strategy).encode()


def captured_gradients(captured: Any) -> tuple[str, ...]:
    marks = gradient_outputs(captured.program.graph_module.graph)
    return marks.names if marks is not None else ()


def _explain(training: dict, cluster: ClusterConfig, policy: ParallelOption) -> dict:
    """What `tessel inspect` says of the step: the optimizer, the levels and the offload."""
    dp = training["data_parallel"]
    levels = []
    if training["optimizer_state_sharding"]:
        levels.append(f"optimizer states sharded over dp {dp}")
    if training["gradient_sharding"]:
        levels.append(f"gradients reduce-scattered over dp {dp}")
    asked = [k for k in ("optimizer_state_sharding", "gradient_sharding") if getattr(policy, k)]
    if dp == 1 and asked:
        levels.append(f"{', '.join(asked)} asked, but there is no data-parallel axis to shard over")
    offload = training["optimizer_offload"]
    if offload == "cpu" and cluster.soc.device_type == "cpu":
        offload = "cpu (the devices are the host's CPU: nothing moves)"
    return {
        "optimizer": training["optimizer"]["type"],
        "param_groups": len(training["optimizer"]["param_groups"]),
        "sharding": levels or ["none: every replica holds whole optimizer states and gradients"],
        "optimizer_offload": offload,
    }
