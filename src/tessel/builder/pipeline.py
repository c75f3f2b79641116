"""`tessel.build`: a model, a cluster and a policy become one offline model."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from tessel._torch import tree_leaves
from tessel.builder.fit import Level, fit
from tessel.builder.generation import build_generation
from tessel.builder.mesh_choice import (
    batch_rows,
    choose_mesh,
    first_devices,
    gather_seconds,
    gathered_bytes,
    replica_batch,
    wants_choice,
)
from tessel.builder.packing import pack
from tessel.builder.stages import (
    build_stages,
    default_micro_batches,
    send_seconds,
    stage_lines,
    stage_planner,
)
from tessel.builder.training import build_training
from tessel.builder.verify import check_against_eager, check_generation, worth_checking
from tessel.builder.weights import streamed_weights
from tessel.capture import CapturedModel, capture
from tessel.capture.export import program_example, split_inputs
from tessel.capture.held import check_weights_present
from tessel.config.cluster import (
    ClusterConfig,
    cluster_from_dict,
    local_cluster,
    read_cluster_config,
)
from tessel.config.errors import ConfigError
from tessel.config.generation import Generation
from tessel.config.mesh import POLICY_KEYS, ParallelDims, parallel_dims
from tessel.config.parallel_option import ParallelOption, read_parallel_option
from tessel.decoding import check_request
from tessel.log_levels import torch_kept_quiet
from tessel.lower.estimate import program_seconds
from tessel.lower.program import RankProgram
from tessel.package.format import BuiltPackage, Manifest, Member, write_package
from tessel.package.plan_report import MemoryLine, ShapeWeighed, Verified
from tessel.plan import Plan, has_rule
from tessel.plan.planner import run_seconds
from tessel.progress import phase
from tessel.summary import build_summary

log = logging.getLogger(__name__)


@dataclass
class BuiltModel:
    """An offline model held in memory until `save` writes it."""

    manifest: Manifest
    members: dict[str, Member]  # bytes, or tensors that `save` streams as safetensors
    timings: dict[str, float] = field(default_factory=dict)

    @classmethod
    def checked(
        cls, manifest: Manifest, members: dict[str, Member], timings: dict[str, float]
    ) -> BuiltModel:
        """The built model, its manifest checked as a loader checks it (from its JSON), so a
        model that would be refused is never saved."""
        manifest = replace(manifest, timings=timings)
        return cls(
            Manifest.from_json(manifest.to_json(), "the built model", members), members, timings
        )

    def save(self, path: str | Path) -> Path:
        t = time.perf_counter()
        with phase(f"writing {path}"):
            out = write_package(path, self.manifest, self.members)
        self.timings["save"] = time.perf_counter() - t
        self.manifest = replace(self.manifest, timings=dict(self.timings))  # for the report
        return out

    def __repr__(self) -> str:
        return build_summary(self.manifest)


def save(model: BuiltModel, path: str | Path) -> Path:
    """Write an offline model to `path`, published in one step when complete.

    Args:
        model: What `build` returned.
        path: Where to write it; the `.tessel` suffix is added if missing.

    Returns:
        The path written.
    """
    return model.save(path)


@contextlib.contextmanager
def _cycle_collection_paused() -> Iterator[None]:
    """Python's collector of reference cycles paused while a build runs.

    A build makes millions of objects that live as long as it does (graph nodes, fake tensors,
    DTensor specs); every full collection walks all of them and frees little (a tenth of the
    training build of a 32-layer GPT-2 went to them). What cycles a build leaves behind are
    collected after it, as usual.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@_cycle_collection_paused()
@torch_kept_quiet()
def build(
    model: torch.nn.Module | torch.export.ExportedProgram,
    example_inputs: Any = None,
    *,
    cluster: ClusterConfig | str | Path | dict | int | None = None,
    policy: ParallelOption | str | Path | None = None,
    soc_version: str = "cpu",
    graph_parallel: bool = True,
    example_kwargs: dict | None = None,
    time_limit: float = 60.0,
    reuse_layers: bool = True,
    verify: bool | None = None,
    weights: str | Path | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    param_dtype: torch.dtype | str | None = None,
    generation: Generation | None = None,
) -> BuiltModel:
    """Build an offline model for `cluster`: capture, plan, lower every rank, check, pack.

    With `graph_parallel` the planner shards every node over the cluster's devices (ATC's
    algorithm-based partitioning, `--enable_graph_parallel`). Without it the whole model is
    deployed to every device, and runs are load-balanced over the replicas.

    Args:
        model: The module to build, or a `torch.export` program. With `generation`, a
            `transformers` causal LM or an encoder-decoder such as T5.
        example_inputs: The inputs of one run (a tuple, a tensor or a dict). With
            `generation` they are optional: the prompt the built gears are checked on.
        cluster: A cluster config (a path, a dict or a `ClusterConfig`), or a device count
            for a local cluster of CPU devices. Default: one local device.
        policy: The partitioning policy (a path or a `ParallelOption`). Default: `auto`.
        soc_version: The device kind the cluster's defaults come from (`cpu`, `H100`, ...).
        graph_parallel: Shard every node over the devices (True), or replicate the model.
        example_kwargs: Keyword inputs of one run, beside `example_inputs`.
        time_limit: Seconds the planner's search may take before it settles for its best.
        reuse_layers: Trace one layer of a stack of identical layers and copy it (True), or
            trace every layer.
        verify: Run the built model here and refuse to return it unless it agrees with the
            eager model (True); skip the check (False); or check where the cost model puts
            it below what the build took (None), the plan saying when it was skipped. The
            check costs about three forward passes. A generation package is checked against
            `transformers`' own `generate`.
        weights: A checkpoint directory as `save_pretrained` writes it, or a safetensors
            file. The model may then hold its parameters on the meta device
            (`tessel.empty_weights()`), and each rank's slices are read as the package is
            written. `verify` must not be True.
        optimizer: A `torch.optim` SGD, Adam or AdamW over the model's parameters. The
            package then holds a training step: the forward returns a scalar loss, and each
            `Session.run_graph` runs forward, backward and the update.
        param_dtype: A training step's compute dtype (`torch.bfloat16`), over fp32 master
            weights, optimizer states and gradient exchange, as FSDP2's mixed precision
            does. Default: the parameters' dtype.
        generation: A `tessel.Generation`: the package holds prefill and decode gears over a
            KV cache on the devices, for `Session.generate`.

    Returns:
        The built model: its manifest (the plan), and `save` writes it as one `.tessel` file.

    Raises:
        ConfigError: An argument, a config file or a policy key is wrong.
        PlanError: No plan fits the devices; the message names the size that would.
        CaptureError: The model calls an operator tessel cannot lower.
        VerifyError: The built model disagrees with its reference; nothing is returned.
    """
    timings: dict[str, float] = {}
    stored, verify = _streamed(model, weights, verify)
    cluster = cluster_config(cluster, soc_version)
    if isinstance(policy, (str, Path)):
        policy = read_parallel_option(policy, cluster.world_size)
    policy = policy or ParallelOption()
    if generation is not None:
        if optimizer is not None or param_dtype is not None or weights is not None:
            given = "weights" if weights is not None else "optimizer"
            raise ConfigError(
                "build()", given, "is not taken with generation= (a generation build)"
            )
        if not graph_parallel:
            raise ConfigError("build()", "graph_parallel", "must be True for a generation build")
        manifest, members, timings = build_generation(
            model, generation, cluster, policy, soc_version, time_limit, reuse_layers
        )
        checked = Verified(skipped="not asked for (verify=False)")
        if verify is not False:
            prompt = _generation_prompt(manifest, example_inputs, example_kwargs)
            t = time.perf_counter()
            with phase("checking the gears against the eager model"):
                checked = check_generation(BuiltPackage(manifest, members), model, prompt)
            timings["verify"] = time.perf_counter() - t
        manifest = replace(manifest, plan=replace(manifest.plan, verify=checked))
        return BuiltModel.checked(manifest, members, timings)
    if optimizer is not None or param_dtype is not None:
        _check_training(optimizer, weights, verify, graph_parallel)
        return BuiltModel.checked(
            *build_training(
                model,
                example_inputs,
                example_kwargs,
                optimizer,
                cluster,
                policy,
                soc_version,
                time_limit,
                param_dtype,
            )
        )
    _check_inference(model, cluster, policy, graph_parallel)

    t = time.perf_counter()
    shape = _capture_or_choose(
        model,
        example_inputs,
        example_kwargs,
        cluster,
        policy,
        graph_parallel,
        reuse_layers,
        time_limit,
    )
    timings["capture"] = time.perf_counter() - t
    fitted = _fit(
        shape, cluster, policy, graph_parallel, soc_version, time_limit, reuse_layers, timings
    )
    t = time.perf_counter()
    with phase("packing"):
        manifest, members = _pack(shape, fitted, cluster, soc_version, graph_parallel, stored)
    timings["pack"] = time.perf_counter() - t
    checked = None
    if stored is not None:
        checked = Verified(
            skipped=f"weights streamed from {weights}: the build never held the model"
        )
    elif verify is not False and shape.captured.source is not None:
        checked = _verify(shape, manifest, members, verify, timings)
    manifest = replace(manifest, plan=replace(manifest.plan, verify=checked))
    return BuiltModel.checked(manifest, members, timings)


def _generation_prompt(
    manifest: Manifest, example_inputs: Any, example_kwargs: dict | None
) -> torch.Tensor | None:
    """The token ids a generation build is checked on: its example input, where given."""
    args, kwargs = split_inputs(example_inputs, example_kwargs)
    given = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if not given:
        return None
    try:
        check_request(manifest.generation, given[0], None, 1)
    except ConfigError as exc:
        raise ConfigError("build()", "example_inputs", exc.detail) from None
    return given[0]


def _streamed(model: Any, weights: str | Path | None, verify: bool | None) -> tuple[Any, Any]:
    """The checkpoint a meta-device model's weights stream from (None: the model holds them),
    and `verify` as it stands with it (streamed weights leave no eager model to check)."""
    if weights is None:
        if isinstance(model, torch.nn.Module):
            check_weights_present(model)
        return None, verify
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            "weights", None, "streams into an nn.Module (its parameters on the meta device)"
        )
    if verify:
        raise ConfigError(
            "verify", None, "needs the model's weights in memory; they are streamed here"
        )
    return streamed_weights(model, weights), False


def _check_training(
    optimizer: Any, weights: str | Path | None, verify: bool | None, graph_parallel: bool
) -> None:
    """Refuse what a training step cannot take."""
    if optimizer is None:
        raise ConfigError("build()", "param_dtype", "is taken with optimizer= (a training step)")
    if weights is not None or verify or not graph_parallel:
        given = "weights" if weights is not None else "verify" if verify else "graph_parallel"
        raise ConfigError("build()", given, "is not taken with optimizer= (a training step)")


def _check_inference(
    model: Any, cluster: ClusterConfig, policy: ParallelOption, graph_parallel: bool
) -> None:
    """Refuse what an inference build cannot take: training settings, and replicas or stages
    without the planner or without the model whose example batch they split."""
    if policy.training_keys:
        raise ConfigError(
            policy.source,
            f"graph_parallel_option.{policy.training_keys[0]}",
            "is a training setting: build a training step (tessel.build(..., optimizer=opt), or "
            "a --model function returning (module, example_inputs, optimizer)), or remove it",
        )
    dims = parallel_dims(cluster, policy)
    for axis in ("dp", "pp"):
        size = dims.size(axis)
        if size > 1 and (not graph_parallel or isinstance(model, CapturedModel)):
            raise ConfigError(
                policy.source,
                f"graph_parallel_option.{POLICY_KEYS[axis]}",
                f"is {size}: {'data parallelism' if axis == 'dp' else 'pipeline stages'} need "
                "graph_parallel and the model itself (not a captured model), whose example batch "
                "it splits",
            )


@dataclass
class _Shape:
    """The mesh a build runs on and the capture of what one of its replicas runs: one
    micro-batch of its share of the batch."""

    dims: ParallelDims
    captured: CapturedModel
    micro_batches: int = 1
    whole_batch: tuple[tuple, dict] | None = None  # the example, where a replica takes part
    weighed: list[ShapeWeighed] | None = None  # the shapes `auto` weighed, where it chose
    plan: Plan | None = None  # the plan weighed for this shape, where `auto` made one
    programs: list[RankProgram] | None = None  # and its programs, where it lowered them

    @property
    def dp(self) -> int:
        return self.dims.size("dp")

    @property
    def pp(self) -> int:
        return self.dims.size("pp")


def _capture_or_choose(
    model: Any,
    example_inputs: Any,
    example_kwargs: dict | None,
    cluster: ClusterConfig,
    policy: ParallelOption,
    graph_parallel: bool,
    reuse_layers: bool,
    time_limit: float,
) -> _Shape:
    """The model captured on the policy's mesh, or, where tessel chooses the mesh (`auto`, no
    sizes, several nodes), on the one it chose."""
    dims = parallel_dims(cluster, policy)
    if isinstance(model, CapturedModel):
        return _Shape(dims, model)
    args, kwargs = split_inputs(example_inputs, example_kwargs)
    if isinstance(model, torch.export.ExportedProgram) and not args and not kwargs:
        args, kwargs = program_example(model)  # a batch to split over replicas and stages
    if graph_parallel and wants_choice(cluster, policy, model):
        with phase("weighing the mesh shapes the cluster allows"):
            choice = choose_mesh(
                model,
                args,
                kwargs,
                cluster,
                policy,
                reuse_layers=reuse_layers,
                time_limit=time_limit,
            )
        parts = choice.dims.size("dp") * choice.micro_batches
        return _Shape(
            choice.dims,
            choice.captured,
            choice.micro_batches,
            (args, kwargs) if parts > 1 else None,
            choice.weighed,
            choice.plan,
            choice.programs,
        )
    dp, pp = dims.size("dp"), dims.size("pp")
    micro_batches = 1
    if pp > 1:
        rows = batch_rows(args, kwargs) // dp
        micro_batches = policy.micro_batch_num or default_micro_batches(pp, rows)
    parts = dp * micro_batches
    split = (
        replica_batch(args, kwargs, dp, policy.source, micro_batches)
        if parts > 1
        else (args, kwargs)
    )
    with phase("capturing the model"):
        captured = capture(model, *split, keep=has_rule, reuse_layers=reuse_layers)
    return _Shape(dims, captured, micro_batches, (args, kwargs) if parts > 1 else None)


@dataclass
class _Fitted:
    """The plan and every rank's program, with the stages cut from them where the mesh has
    replicas or stages."""

    plan: Plan
    programs: list[RankProgram]
    staged: list[Any] | None = None
    stages: Any = None


def _fit(
    shape: _Shape,
    cluster: ClusterConfig,
    policy: ParallelOption,
    graph_parallel: bool,
    soc_version: str,
    time_limit: float,
    reuse_layers: bool,
    timings: dict[str, float],
) -> _Fitted:
    """Plan and lower until every rank's program fits its device (`builder/fit.py`); with
    replicas or stages, every rank's program cut from one replica's. Rank 0 also holds the
    replicas' outputs: those bytes are kept free from the start."""
    captured, dims = shape.captured, shape.dims
    cut = None
    if shape.dp * shape.pp > 1:

        def cut(plan: Plan, programs: list[RankProgram]) -> Any:
            return build_stages(captured, plan, programs, cluster, dims, shape.micro_batches)

    fitted = fit(
        captured,
        cluster if graph_parallel else local_cluster(1, soc_version),
        policy,
        dims,
        [Level(reserve=gathered_bytes(captured, shape.dp, shape.micro_batches))],
        stages=stage_planner(captured, cluster, dims, policy.source) if shape.pp > 1 else None,
        cut=cut,
        time_limit=time_limit,
        reuse_layers=reuse_layers,
        timings=timings,
        first=shape.plan,  # the plan `auto` weighed, and its programs where it lowered them
        lowered=shape.programs,
    )
    if fitted.cut is None:
        return _Fitted(fitted.plan, fitted.programs)
    staged, stages = fitted.cut
    return _Fitted(fitted.plan, [sp.program for sp in staged], staged, stages)


def _pack(
    shape: _Shape,
    fitted: _Fitted,
    cluster: ClusterConfig,
    soc_version: str,
    graph_parallel: bool,
    stored: Any,
) -> tuple[Manifest, dict]:
    """The manifest and members of the package, and the plan's account of a run: its stages,
    what their programs hold, and its estimated time (stages pipelined, the replicas' outputs
    gathered, the session's own cost), also as its programs price it once lowered."""
    captured, dims, dp, pp, micro = (
        shape.captured,
        shape.dims,
        shape.dp,
        shape.pp,
        shape.micro_batches,
    )
    plan, programs, staged, stages = fitted.plan, fitted.programs, fitted.staged, fitted.stages
    manifest, members = pack(
        captured,
        plan,
        programs,
        cluster,
        soc_version,
        graph_parallel,
        dp,
        staged=staged,
        pp=pp,
        micro_batches=micro,
        stored=stored,
    )
    account = manifest.plan
    seconds = account.estimated_time_s or 0.0
    if stages is not None:
        account = replace(
            account,
            stages=stage_lines(stages, staged),
            # what the stages' programs hold, not the whole model the planner weighed on pp x memory
            memory=MemoryLine(
                weight_bytes=max(rp.weight_bytes for rp in programs),
                peak_bytes=max(rp.peak_bytes for rp in programs),
                device_bytes=min(d.memory_bytes for d in cluster.devices),
            ),
            micro_batches=micro,
        )
        seconds = stages.pipelined_seconds(micro, send_seconds(staged, dims, cluster, micro))
    if dp > 1:  # the replicas run at once; then their outputs are gathered
        seconds += gather_seconds(captured, dims, cluster, micro)
    # what a run costs beside its programs: the session's pipe to rank 0, rank 0's broadcasts
    seconds += run_seconds(captured, cluster)
    lowered = None
    if pp == 1 and graph_parallel:  # the same run priced from the programs as lowered
        # replicas' programs gather their outputs over the whole cluster's ranks
        ranks = cluster if dp > 1 else first_devices(cluster, dims.size("tp"))
        slowest = max(program_seconds(rp, r, ranks) for r, rp in enumerate(programs))
        lowered = slowest + run_seconds(captured, cluster)
    account = replace(
        account,
        estimated_time_s=seconds,
        lowered_time_s=lowered,
        mesh_choices=tuple(shape.weighed or ()),
    )
    return replace(manifest, plan=account), members


def _verify(
    shape: _Shape, manifest: Manifest, members: dict, verify: bool | None, timings: dict[str, float]
) -> Verified:
    """The built model run on the example in this process against the eager model, where
    asked or where the cost model puts the check below what the build took; why not else."""
    captured = shape.captured
    skipped = (
        None
        if verify
        else worth_checking(captured, sum(timings.values()) / (shape.dp * shape.micro_batches))
    )
    if skipped is not None:
        log.info("not checked against the eager model: %s", skipped)
        return Verified(skipped=skipped)
    t = time.perf_counter()
    package = BuiltPackage(manifest, members)
    if shape.whole_batch is None:
        inputs, expected = captured.example_inputs, captured.eager_outputs()
    else:
        args, kwargs = shape.whole_batch
        inputs = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        with torch.no_grad():
            out = captured.source(*args, **kwargs)
        expected = [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
    with phase("checking the built model against the eager one"):
        result = check_against_eager(package, inputs, expected)
    timings["verify"] = time.perf_counter() - t
    return result


def cluster_config(cluster: Any, soc_version: str) -> ClusterConfig:
    """The cluster `build` takes (a config file, its JSON, a ClusterConfig, a device count or
    None: 4 local devices) as a ClusterConfig."""
    if cluster is None:
        return local_cluster(4, soc_version)
    if isinstance(cluster, ClusterConfig):
        return cluster
    if isinstance(cluster, int) and not isinstance(cluster, bool):
        if cluster < 1:
            raise ConfigError("build()", "cluster", f"is {cluster} devices; give at least 1")
        return local_cluster(cluster, soc_version)
    if isinstance(cluster, (str, Path)):
        return read_cluster_config(cluster, soc_version)
    if isinstance(cluster, dict):
        return cluster_from_dict(cluster, "the cluster argument", soc_version)
    raise ConfigError(
        "build()",
        "cluster",
        f"is a {type(cluster).__name__}; give a cluster config file, its parsed JSON (a dict), "
        "a ClusterConfig or a device count",
    )
