"""`tessel.build(..., optimizer=opt)`: one offline model holding a partitioned training step.

The step (forward, backward, and the optimizer's update) is planned for one data-parallel
replica's tensor-parallel devices on its share of the batch (with pipeline stages, on one
micro-batch of it, then cut into the stages' programs by `lower.training_stages`); every
replica runs that program on its own rows, each gradient returned placed like its weight.
Workers then exchange each layer's
gradients over the data-parallel axis as the backward pass makes them and update their shards
with torch's optimizer; the sharding levels (ZeRO's three stages, chosen here: as the policy
asks, or the least that fits under `auto`) and the prefetch buffer are recorded in the
manifest, and `tessel.runtime.step` carries them out. The package holds fp32 master weights;
the program computes in the model's dtype or `param_dtype`.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from tessel.builder.fit import Level, fit
from tessel.builder.mesh_choice import batch_rows, first_devices, replica_batch
from tessel.builder.model_record import CONFIG_MEMBER, GENERATION_CONFIG_MEMBER, model_record
from tessel.builder.packing import pack
from tessel.builder.stages import (
    build_training_stages,
    default_micro_batches,
    stage_lines,
    stage_planner,
)
from tessel.capture import capture_training
from tessel.capture.export import split_inputs
from tessel.capture.training import GradientOutputs, gradient_outputs, mark_gradients
from tessel.config.cluster import ClusterConfig
from tessel.config.errors import ConfigError
from tessel.config.mesh import ParallelDims, parallel_dims
from tessel.config.optimizer import (
    STEP_NAME,
    OptimizerSpec,
    optimizer_spec,
    state_keys,
    state_name,
)
from tessel.config.parallel_option import ParallelOption
from tessel.dtypes import dtype_name
from tessel.lower.program import RankProgram, move_groups
from tessel.lower.trace import weight_inputs
from tessel.package.manifest import Manifest, TensorSpec, Training
from tessel.package.plan_report import MemoryLine, TrainingLine, Verified
from tessel.plan import Plan, cost, has_rule
from tessel.plan.planner import device_rates, run_seconds
from tessel.progress import phase
from tessel.sharding.placements import local_shard_shape

MB = 2**20  # the policy's prefetch buffer is in MB

log = logging.getLogger(__name__)


def build_training(
    model: torch.nn.Module,
    example_inputs: Any,
    example_kwargs: dict | None,
    optimizer: Any,
    cluster: ClusterConfig,
    policy: ParallelOption,
    soc_version: str,
    time_limit: float,
    param_dtype: torch.dtype | str | None = None,
) -> tuple[Manifest, dict, dict[str, float]]:
    """The manifest, members and timings of a training package (see the module docstring):
    the build's own recipe, check, capture, fit, pack, for a training step."""
    args, kwargs = split_inputs(example_inputs, example_kwargs)
    step = _check(model, args, kwargs, optimizer, cluster, policy, param_dtype)
    timings: dict[str, float] = {}
    t = time.perf_counter()
    captured = _capture(model, args, kwargs, step, policy)
    timings["capture"] = time.perf_counter() - t
    fitted = _fit(model, captured, step, cluster, policy, time_limit, timings)
    t = time.perf_counter()
    manifest, members = _pack(model, captured, step, fitted, cluster, policy, soc_version)
    timings["pack"] = time.perf_counter() - t
    return manifest, members, timings


@dataclass(frozen=True)
class _Step:
    """What the checks settle before a training step is captured: its mesh, its optimizer as
    data, the weights it trains, the dtype it computes in, and the micro-batches a stage
    runs."""

    dims: ParallelDims
    spec: OptimizerSpec
    trainable: tuple[str, ...]
    own_dtype: torch.dtype  # the model's weights'
    compute: torch.dtype  # what the program computes in
    micro_batches: int

    @property
    def mixed(self) -> bool:
        return self.compute != torch.float32


def _check(
    model: Any,
    args: tuple,
    kwargs: dict,
    optimizer: Any,
    cluster: ClusterConfig,
    policy: ParallelOption,
    param_dtype: torch.dtype | str | None,
) -> _Step:
    """Refuse what a training step cannot take; settle what the later phases read."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            "model", None, f"a training step needs an nn.Module, found {type(model).__name__}"
        )
    if policy.model_weight_prefetch and not policy.model_weight_sharding:
        raise ConfigError(
            policy.source,
            "graph_parallel_option.tensor_sharding.model_weight_prefetch",
            "fetches sharded weights ahead, but model_weight_sharding is off; turn both on, or "
            "prefetch off",
        )
    dims = parallel_dims(cluster, policy)
    dp, pp = dims.size("dp"), dims.size("pp")
    trainable = tuple(n for n, p in model.named_parameters() if p.requires_grad)
    own_dtype = _dtype_of(model)
    names = {id(p): n for n, p in model.named_parameters()}
    # the rows a step takes: the policy's global batch, or the example's
    rows = policy.global_batch_size or batch_rows(args, kwargs)
    micro_batches = 1
    if pp > 1:
        micro_batches = policy.micro_batch_num or default_micro_batches(pp, rows // dp)
    return _Step(
        dims,
        optimizer_spec(optimizer, names, trainable),
        trainable,
        own_dtype,
        _compute_dtype(own_dtype, param_dtype),
        micro_batches,
    )


def _capture(
    model: torch.nn.Module, args: tuple, kwargs: dict, step: _Step, policy: ParallelOption
) -> Any:
    """The step of one replica's micro-batch, captured in the dtype it computes in."""
    dp, micro_batches = step.dims.size("dp"), step.micro_batches
    split = (
        replica_batch(args, kwargs, dp, policy.source, micro_batches, policy.global_batch_size)
        if dp * micro_batches > 1 or policy.global_batch_size is not None
        else (args, kwargs)
    )
    traced = copy.deepcopy(model).to(step.compute) if step.own_dtype != step.compute else model
    with phase("capturing the training step"):
        return capture_training(traced, *split, keep=has_rule)


@dataclass
class _Fitted:
    """The plan of one replica's step that fits, its programs (or, with stages, every rank's
    stage program), the sharding level that fits and the levels weighed to find it."""

    plan: Plan
    programs: list[RankProgram]
    level: Sharding
    weighed: list[str]
    gradients: tuple[str, ...]
    auto: bool
    staged: list | None = None
    weight_stage: dict[str, int] = field(default_factory=dict)
    stages: Any = None


def _fit(
    model: torch.nn.Module,
    captured: Any,
    step: _Step,
    cluster: ClusterConfig,
    policy: ParallelOption,
    time_limit: float,
    timings: dict[str, float],
) -> _Fitted:
    """The least sharding level among those the policy allows (`_sharding_choices`) whose
    plan fits the devices (`builder/fit.py`), each level's weight bytes counted for the memory
    model; with stages, every rank's stage program cut from one replica's."""
    dp, pp = step.dims.size("dp"), step.dims.size("pp")
    # offloaded optimizer states live in host memory, not on the devices
    offloaded = policy.optimizer_offload is not None and cluster.soc.device_type != "cpu"
    # the sharding levels asked for, or (auto, the policy silent) the least that fits
    choices = _sharding_choices(policy, dp)
    auto = len(choices) > 1
    ratio = 4 / step.compute.itemsize  # fp32 bytes per byte the program reads
    # gathered units are held beside the program's own values: the largest, whole (an upper
    # bound: tensor parallelism may shard it), and as much again fetched ahead
    size = dict(model.named_parameters())
    largest_unit = max(
        (
            sum(size[n].numel() * step.compute.itemsize for n in u)
            for u in weight_units(step.trainable)
        ),
        default=0,
    )
    gradients = captured_gradients(captured)
    graph = captured.program.graph_module.graph

    def holding(level: Sharding) -> Callable[[], None]:
        # per byte of a weight as the program reads it: the fp32 master (and its compute copy,
        # mixed precision without weight sharding) and the optimizer's fp32 states
        states = 0 if offloaded else step.spec.state_per_weight * ratio
        held = (
            ratio / (dp if level.weights else 1)
            + (1 if step.mixed and not level.weights else 0)
            + states / (dp if level.states else 1)
        )
        return lambda: mark_gradients(graph, GradientOutputs(gradients, held))

    levels = [
        Level(level.name, _gathered_reserve(level, largest_unit, policy, auto), holding(level))
        for level in choices
    ]
    cut = None
    if pp > 1:  # a stage's program holds its micro-batches' activations: it must fit

        def cut(plan: Plan, programs: list[RankProgram]) -> Any:
            return build_training_stages(
                captured,
                plan,
                programs,
                cluster,
                step.dims,
                gradients,
                step.micro_batches,
                policy.source,
            )

    fitted = fit(
        captured,
        cluster,
        policy,
        step.dims,
        levels,
        stages=stage_planner(captured, cluster, step.dims, policy.source) if pp > 1 else None,
        cut=cut,
        time_limit=time_limit,
        reuse_layers=True,
        timings=timings,
    )
    level = choices[levels.index(fitted.level)]
    weighed = fitted.weighed
    if auto:
        weighed.append(f"{level.name}: chosen, the least sharding that fits")
    out = _Fitted(fitted.plan, fitted.programs, level, weighed, gradients, auto)
    if fitted.cut is not None:
        out.staged, out.weight_stage, out.stages = fitted.cut
    return out


def _pack(
    model: torch.nn.Module,
    captured: Any,
    step: _Step,
    fitted: _Fitted,
    cluster: ClusterConfig,
    policy: ParallelOption,
    soc_version: str,
) -> tuple[Manifest, dict]:
    """The package of the fitted step: every rank's program, the fp32 master weights, the
    optimizer's states laid out like their weights, the model's own files, and the step's
    account (its sharding, its stages, its estimated time)."""
    dims, spec, level, plan = step.dims, step.spec, fitted.level, fitted.plan
    dp, tp, pp = dims.size("dp"), dims.size("tp"), dims.size("pp")
    staged, stages = fitted.staged, fitted.stages
    if staged is not None:
        every = [sp.program for sp in staged]
    else:  # replica d runs the first replica's programs on ranks d*tp ..., groups moved there
        every = [
            rp
            if rank < tp
            else replace(
                rp,
                program=move_groups(rp.program, lambda q, base=rank - rank % tp: q + base),
            )
            for rank in range(cluster.world_size)
            for rp in (fitted.programs[rank % tp],)
        ]
    units = weight_units(fitted.gradients)
    prefetch = 0
    if _prefetches(level, policy, fitted.auto):
        prefetch = _prefetch_bytes(policy, _largest_gathered_unit(captured, plan, units, dp, tp))
    # the package holds fp32 master weights; the program computes in `step.compute`
    master = None
    if step.mixed:
        fp32: dict[int, torch.Tensor] = {}
        master = {  # a tied weight's names share one tensor, as the model's do
            n: fp32.setdefault(id(p), p.detach().float())
            for n, p in model.named_parameters(remove_duplicate=False)
            if p.requires_grad
        }
    manifest, members = pack(
        captured,
        plan,
        every,
        cluster,
        soc_version,
        True,
        dp,
        staged=staged,
        pp=pp,
        micro_batches=step.micro_batches,
        stored=master,
    )
    members["strategy.json"] = _with_optimizer_states(
        members["strategy.json"], spec, fitted.weight_stage, pp
    )
    record = model_record(model, json.loads(members["strategy.json"])["params"])
    config_files = {}
    for member, data in (
        (CONFIG_MEMBER, record.config),
        (GENERATION_CONFIG_MEMBER, record.generation_config),
    ):
        if data is not None:
            members[member] = config_files[member] = data
    training = Training(
        optimizer=spec.to_json(),
        gradients=tuple(fitted.gradients),
        optimizer_state_sharding=level.states,
        gradient_sharding=level.gradients,
        weight_sharding=level.weights,
        weight_prefetch_bytes=prefetch,
        units=tuple(map(tuple, units)),
        compute_dtype=dtype_name(step.compute),
        optimizer_offload=policy.optimizer_offload or "none",
        micro_batches=step.micro_batches,
        state_dict=record.state_dict,
        model_config=CONFIG_MEMBER if CONFIG_MEMBER in config_files else None,
        generation_config=GENERATION_CONFIG_MEMBER
        if GENERATION_CONFIG_MEMBER in config_files
        else None,
    )
    account = replace(
        manifest.plan,
        training=replace(
            _explain(training, dims, cluster, policy), levels_weighed=tuple(fitted.weighed)
        ),
        verify=Verified(
            skipped="a training step changes the weights; tests check steps against torch"
        ),
    )
    if staged is not None:
        account = replace(
            account,
            stages=stage_lines(stages, staged),
            micro_batches=step.micro_batches,
            memory=MemoryLine(  # what the stages' programs hold
                weight_bytes=max(sp.program.weight_bytes for sp in staged),
                peak_bytes=max(sp.program.peak_bytes for sp in staged),
                device_bytes=min(d.memory_bytes for d in cluster.devices),
            ),
        )
    # what a step costs beside its program: the exchange and the update, and the session's
    # pipe and rank 0's broadcasts
    seconds = (
        (account.estimated_time_s or 0.0)
        + _exchange_and_update_seconds(
            captured, plan, units, first_devices(cluster, tp), dims, level, spec
        )
        + run_seconds(captured, cluster)
    )
    manifest = replace(
        manifest,
        mode="training",
        outputs=(TensorSpec((), "float32"),),
        training=training,
        plan=replace(account, estimated_time_s=seconds),
    )
    return manifest, members


def _with_optimizer_states(
    strategy_json: bytes, spec: OptimizerSpec, weight_stage: dict[str, int], pp: int
) -> bytes:
    """The package's strategy file plus the optimizer's states, each laid out like its weight
    (`optimizer.<key>.<weight>`), and Adam's step count: what `save_checkpoint` writes. With
    pipeline stages each weight is held by its stage's ranks, the step count by every rank."""
    strategy = json.loads(strategy_json)
    params = strategy["params"]
    for name, stage in weight_stage.items():
        if name in params:
            params[name]["stages"] = [stage]
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
            "stages": list(range(pp)),
        }
    return json.dumps(strategy).encode()


@dataclass(frozen=True)
class Sharding:
    """ZeRO's stages over the data-parallel axis; each level takes the ones below it."""

    states: bool = False
    gradients: bool = False
    weights: bool = False

    @property
    def name(self) -> str:
        if self.weights:
            return "weight sharding"
        if self.gradients:
            return "gradient sharding"
        return "optimizer state sharding" if self.states else "no sharding"


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _dtype_of(model: torch.nn.Module) -> torch.dtype:
    """The one dtype of a model's trained weights (fp32 or bf16), or a ConfigError."""
    found = {p.dtype for p in model.parameters() if p.requires_grad}
    if len(found) > 1:
        kinds = sorted(dtype_name(d) for d in found)
        raise ConfigError(
            "model", None, f"trains weights of several dtypes ({', '.join(kinds)}); use one"
        )
    dtype = found.pop() if found else torch.float32
    if dtype not in _DTYPES.values():
        name = next(n for n, p in model.named_parameters() if p.requires_grad)
        raise ConfigError(
            "model",
            name,
            f"is {dtype_name(dtype)}: a training step takes float32 or bfloat16 "
            "weights (float16 would need loss scaling)",
        )
    return dtype


def _compute_dtype(own: torch.dtype, param_dtype: torch.dtype | str | None) -> torch.dtype:
    """What the step computes in: `param_dtype` (FSDP2's name for it) or the weights' dtype
    `own`. Master weights, optimizer states and the gradient exchange are fp32 either way."""
    if param_dtype is None:
        return own
    dtype = (
        _DTYPES.get(param_dtype.removeprefix("torch."), None)
        if isinstance(param_dtype, str)
        else param_dtype
    )
    if dtype not in _DTYPES.values():
        raise ConfigError(
            "build()",
            "param_dtype",
            f"is {param_dtype!r}; a training step computes in {' or '.join(_DTYPES)}",
        )
    return dtype


def _prefetches(level: Sharding, policy: ParallelOption, auto: bool) -> bool:
    """Whether sharded weights are fetched ahead: as the policy says, always where chosen."""
    return level.weights and (policy.model_weight_prefetch or auto)


def _gathered_reserve(
    level: Sharding, largest_unit: int, policy: ParallelOption, auto: bool
) -> int:
    """Bytes to keep free for gathered weights: the unit in use and those fetched ahead."""
    if not level.weights:
        return 0
    if not _prefetches(level, policy, auto):
        return largest_unit
    return largest_unit + max(policy.model_weight_prefetch_buffer_size * MB, largest_unit)


def _sharding_choices(policy: ParallelOption, dp: int) -> list[Sharding]:
    """The levels to try in order: the policy's, or with `auto` and no `tensor_sharding`
    section each from none up (more sharding holds less and communicates more)."""
    if dp == 1:
        return [Sharding()]
    if policy.auto and not policy.tensor_sharding_given:
        return [
            Sharding(),
            Sharding(states=True),
            Sharding(states=True, gradients=True),
            Sharding(states=True, gradients=True, weights=True),
        ]
    weights = policy.model_weight_sharding
    gradients = policy.gradient_sharding or weights
    return [Sharding(policy.optimizer_state_sharding or gradients, gradients, weights)]


def weight_units(names: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The trained weights gathered and reduced together, in first-named order: a repeated
    layer's weights (the module path up to its first index, `model.layers.3`), or else one
    module's (`model.embed_tokens`)."""
    units: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        index = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        key = ".".join(parts[: index + 1] if index is not None else parts[:-1])
        units.setdefault(key, []).append(name)
    return [tuple(u) for u in units.values()]


def _largest_gathered_unit(captured: Any, plan: Any, units: list, dp: int, tp: int) -> int:
    """The most bytes a rank gathers for one unit: the unit's shards on its tensor-parallel
    rank, padded to a multiple of dp as the step lays them out."""
    local, size = _local_elements(captured, plan, tp)
    return size * max(
        (math.ceil(sum(local[n][r] for n in unit) / dp) * dp for unit in units for r in range(tp)),
        default=0,
    )


def _local_elements(captured: Any, plan: Any, tp: int) -> tuple[dict[str, list[int]], int]:
    """Each trained weight's elements on each tensor-parallel rank, and the bytes of one
    element as the program reads them (every trained weight in one dtype)."""
    placeholders = {n.name: n for n in captured.program.graph_module.graph.nodes}
    local: dict[str, list[int]] = {}
    size = 0
    for ph, fqn in weight_inputs(captured, plan):
        node = placeholders[ph]
        val, placements = node.meta["val"], plan.out_placements(node)
        size = val.element_size()
        local[fqn] = [
            math.prod(local_shard_shape(val.shape, placements, plan.mesh_shape, r))
            for r in range(tp)
        ]
    return local, size


def _exchange_and_update_seconds(
    captured: Any,
    plan: Any,
    units: list,
    devices: ClusterConfig,
    dims: Any,
    level: Any,
    spec: OptimizerSpec,
) -> float:
    """What a step costs a rank beside its program: each unit's gradients all-reduced (or
    reduce-scattered) over the replicas, and gathered again where states or weights are
    sharded (once per unit); the loss averaged over them; the optimizer's update of the weights
    the rank holds (a 1/dp part of each where states are sharded). Exchanges are counted in
    full, as if none overlapped the backward pass."""
    dp = dims.size("dp")
    _, bandwidth, overhead = device_rates(devices)
    local, _ = _local_elements(captured, plan, 1)
    grad_bytes = {fqn: 4 * ranks[0] for fqn, ranks in local.items()}  # fp32, on tensor rank 0
    seconds = 0.0
    if dp > 1:
        link = cost.Links(dims.axis("dp").bandwidth, devices.soc.link_latency)
        exchange = cost.reduce_scatter_time if level.gradients else cost.all_reduce_time
        for unit in units:
            size = sum(grad_bytes.get(n, 0) for n in unit)
            seconds += exchange(size, dp, link)
            if level.states or level.weights:
                seconds += cost.all_gather_time(size, dp, link)
        seconds += cost.all_reduce_time(4, dp, link)
    held = sum(grad_bytes.values()) / (dp if level.states else 1)
    return seconds + cost.update_time(
        spec.name, spec.state_per_weight, len(grad_bytes), held, bandwidth, overhead
    )


def _prefetch_bytes(policy: ParallelOption, largest: int) -> int:
    """The prefetch buffer in bytes: the policy's size in MB, at least the largest gathered
    unit (refused with both sizes where smaller); that unit's size where the policy is silent."""
    asked = policy.model_weight_prefetch_buffer_size * MB
    if not asked:
        return largest
    if asked < largest:
        raise ConfigError(
            policy.source,
            "graph_parallel_option.tensor_sharding.model_weight_prefetch_buffer_size",
            f"is {policy.model_weight_prefetch_buffer_size} MB ({asked} bytes), smaller than the "
            f"largest layer's gathered weights on one device ({largest} bytes, "
            f"{math.ceil(largest / MB)} MB); set at least that or turn model_weight_prefetch off",
        )
    return asked


def captured_gradients(captured: Any) -> tuple[str, ...]:
    marks = gradient_outputs(captured.program.graph_module.graph)
    return marks.names if marks is not None else ()


def _explain(
    training: Training, dims: ParallelDims, cluster: ClusterConfig, policy: ParallelOption
) -> TrainingLine:
    """What `tessel inspect` says of the step: the optimizer, the levels and the offload."""
    dp = dims.size("dp")
    levels = []
    if training.optimizer_state_sharding:
        levels.append(f"optimizer states sharded over dp {dp}")
    if training.gradient_sharding:
        levels.append(f"gradients reduce-scattered over dp {dp}")
    if training.weight_sharding:
        prefetch = training.weight_prefetch_bytes
        levels.append(
            f"weights sharded over dp {dp}, each layer gathered before its forward and again "
            "before its backward, "
            + (f"the next fetched ahead within {prefetch} bytes" if prefetch else "no prefetch")
        )
    switches = ("optimizer_state_sharding", "gradient_sharding", "model_weight_sharding")
    asked = [k for k in switches if getattr(policy, k)]
    if dp == 1 and asked:
        levels.append(f"{', '.join(asked)} asked, but there is no data-parallel axis to shard over")
    offload = training.optimizer_offload
    if offload == "cpu" and cluster.soc.device_type == "cpu":
        offload = "cpu (the devices are the host's CPU: nothing moves)"
    elif offload == "cpu":
        offload = (
            "cpu (each rank's optimizer states and an fp32 copy of the weights it updates in "
            "host memory; gradients go to the host and updated weights back every step)"
        )
    pp, micro_batches = dims.size("pp"), training.micro_batches
    return TrainingLine(
        optimizer=training.optimizer["type"],
        param_groups=len(training.optimizer["param_groups"]),
        pipeline=f"{pp} stages, {micro_batches} micro-batches in a 1F1B schedule, gradients "
        "summed over them before the update"
        if pp > 1
        else "none",
        sharding=tuple(levels)
        or ("none: every replica holds whole optimizer states and gradients",),
        optimizer_offload=offload,
        precision="float32"
        if training.compute_dtype == "float32"
        else f"{training.compute_dtype} compute over fp32 master weights, optimizer states "
        "and gradient exchange",
    )
