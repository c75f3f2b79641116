"""The runners of `AutoParallel`'s calls: its first call hands the network to one of them.

- `PipelineNetworkRunner` (semi_auto, a `tessel.parallel.nn.Pipeline` network): each replica
  runs its rows through the stages its stage_config cuts;
- `SemiAutoRunner` (semi_auto): the network on DTensors, its `shard` annotations as placed and
  the rest data parallel over every rank;
- `PlannedRunner` (recursive_programming, sharding_propagation): tessel's planner on the first
  call, its program run on every rank after (`tessel.parallel.planned`);
- `StagedRunner` (recursive_programming with `pipeline(stages=N)`): the planner's balanced cut
  into stages, run as a `Pipeline`, data parallel over the rest.

Each reads the settings `AutoParallel`'s methods record (`Settings`) when it runs, so a setting
made between calls that the runner can honour is honoured.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from tessel._torch import tree_map, tree_unflatten
from tessel.checkpoint.errors import StrategyError
from tessel.checkpoint.layout import Layout
from tessel.checkpoint.strategy import load_strategy
from tessel.dtypes import dtype_name
from tessel.parallel.annotate import (
    data_parallel,
    distribute_parameters,
    rows,
    shard_of,
    whole,
    world_mesh,
)
from tessel.parallel.errors import ParallelError
from tessel.parallel.micro_batches import micro_batch_count, regroup_rows
from tessel.parallel.pipeline import Pipeline
from tessel.parallel.planned import PlannedNetwork, broadcast_bytes, planned_package
from tessel.parallel.stage_cuts import balanced_stage_config, micro_batches_for
from tessel.runtime.exchange import DEFAULT_FUSION, all_reduce_in_buckets, hold
from tessel.sharding.placements import placement_str


def _all_gather(parts: list[torch.Tensor], x: torch.Tensor) -> None:
    """`dist.all_gather(parts, x)`, its handle held (`tessel.runtime.exchange.hold`)."""
    work = dist.all_gather(parts, x, async_op=True)
    assert work is not None
    work.wait()
    hold(work)


@dataclass(frozen=True)
class Hsdp:
    """`hsdp`'s setting: weights of at least `threshold_bytes` stored sharded over
    `shard_size` ranks (-1: all), and how their gradients and gathers run (`level`)."""

    threshold_bytes: int
    level: str
    shard_size: int = -1


@dataclass
class Settings:
    """What `AutoParallel`'s settings methods recorded, for its runners."""

    parallel_mode: str
    cluster: Any
    dataset: str | tuple = "data_parallel"  # dataset_strategy
    hsdp: Hsdp | None = None
    stages: int = 1  # pipeline
    scheduler: str = "1f1b"  # of the stages the planner cuts
    strategy_load: str | None = None  # load_param_strategy_file
    fusion: tuple[str, Any] = DEFAULT_FUSION  # comm_fusion


class Batch:
    """The call's inputs as the dataset strategy says each rank holds them (`settings.dataset`),
    and the whole batch's rows in the order the runners take them."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def micro_batch_order(
        self, network: torch.nn.Module, batch: list[torch.Tensor], replicas: int
    ) -> list[torch.Tensor]:
        """The whole batch's rows in the order in which `replicas`, each cutting its rows into
        the micro-batches of the network's GradAccumulation or MicroBatchInterleaved, run
        micro-batch i as: every rank's slice i with "data_parallel" (each rank cuts its own
        rows, as MindSpore's wrappers do), the whole batch's slice i otherwise."""
        micro = micro_batch_count(network)
        if micro == 1:
            return batch
        world = dist.get_world_size()
        ordered = []
        for x in batch:
            if self.settings.dataset == "data_parallel" and x.shape[0] % (world * micro) == 0:
                x = regroup_rows(x, world, micro)  # gathered in rank order
            if x.shape[0] % (micro * replicas) == 0:
                x = regroup_rows(x, micro, replicas)
            ordered.append(x)
        return ordered

    def replica_batch(self, pipeline: Pipeline, leaves: list, spec: Any) -> tuple[tuple, dict]:
        """A Pipeline network's call on this rank: its replica's batch. "data_parallel": the
        call's own; "full_batch": the replica's rows of the whole batch, micro-batch k of the
        pipeline holding the whole batch's slice k, its rows split over the replicas."""
        if self.settings.dataset == "data_parallel":
            return tree_unflatten(leaves, spec)
        if self.settings.dataset != "full_batch":
            raise ParallelError(
                "dataset_strategy: a Pipeline network takes 'data_parallel' (each rank passing "
                "its replica's batch) or 'full_batch'; per-input strategies are not built for "
                "pipeline stages"
            )
        replicas = dist.get_world_size() // pipeline.pipeline_ranks
        replica = dist.get_rank() % replicas
        mine = []
        for x in leaves:
            if isinstance(x, torch.Tensor) and replicas > 1:
                if x.dim() == 0 or x.shape[0] % (replicas * pipeline.micro_size):
                    raise ParallelError(
                        f"dataset_strategy 'full_batch': an input of shape {tuple(x.shape)} "
                        f"does not split into {pipeline.micro_size} micro-batches of "
                        f"{replicas} replicas' rows"
                    )
                x = regroup_rows(x, pipeline.micro_size, replicas).chunk(replicas)[replica]
            mine.append(x)
        return tree_unflatten(mine, spec)

    def whole_batch(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Input `index` of the whole batch, from this rank's part of it."""
        whole = self.batch_part(index, x)
        return whole.full_tensor() if isinstance(whole, DTensor) else whole

    def batch_part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Input `index` from this rank's part of it: a DTensor where a Layout places it, else
        the whole batch."""
        world = dist.get_world_size()
        config = self.settings.dataset
        if config == "full_batch" or world == 1:
            return x
        if config == "data_parallel":
            counts: tuple[int, ...] = (world,)
        else:
            if index >= len(config):
                raise ParallelError(
                    f"dataset_strategy gives {len(config)} inputs' strategies; the call has "
                    f"input {index} too"
                )
            if isinstance(config[index], Layout):
                return shard_of(x, config[index], f"dataset_strategy: entry {index}")
            counts = config[index]
            if all(c == 1 for c in counts):
                return x
        parts = [torch.empty_like(x) for _ in range(world)]
        _all_gather(parts, x.contiguous())
        return _assemble(parts, counts)


class PipelineNetworkRunner:
    """semi_auto with a `Pipeline` network: each replica's batch through its stages."""

    def __init__(self, network: Pipeline, settings: Settings) -> None:
        self.network, self.settings, self.batch = network, settings, Batch(settings)

    def __call__(self, leaves: list, spec: Any) -> Any:
        self.network.fusion = self.settings.fusion  # its replicas' gradients, in these units
        args, kwargs = self.batch.replica_batch(self.network, leaves, spec)
        return self.network(*args, **kwargs)


class SemiAutoRunner:
    """semi_auto: the network run on DTensors, its annotated regions as `shard` placed them,
    the rest data parallel over every rank (`annotate.data_parallel`); its outputs come back
    whole, and its replicated weights' gradients are summed in `comm_fusion`'s units."""

    def __init__(self, network: torch.nn.Module, settings: Settings) -> None:
        self.network, self.settings, self.batch = network, settings, Batch(settings)

    def __call__(self, leaves: list, spec: Any) -> Any:
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        device_type = tensors[0].device.type if tensors else "cpu"
        mesh = world_mesh(device_type)
        # the unannotated parameters, replicated
        distribute_parameters(self.network, {}, mesh, "AutoParallel's first call")
        if self.settings.dataset == "data_parallel":
            placed = _rows_of_ranks(tensors, mesh)
        else:
            parts = [self.batch.batch_part(i, x) for i, x in enumerate(tensors)]
            if self.settings.dataset == "full_batch":
                parts = self.batch.micro_batch_order(self.network, parts, mesh.size())
            placed = [rows(x, mesh) for x in parts]
        placed_iter = iter(placed)
        leaves = [next(placed_iter) if isinstance(x, torch.Tensor) else x for x in leaves]
        args, kwargs = tree_unflatten(leaves, spec)
        with data_parallel(mesh):
            out = self.network(*args, **kwargs)
        return whole(out, self._reduce_gradients)

    def _reduce_gradients(self) -> None:
        """semi_auto: each gradient brought to its parameter's placement. Those left as partial
        sums over the ranks (replicated weights the data-parallel part reads) are summed in
        the all-reduce buckets `comm_fusion` sets; any other is redistributed alone."""
        partial: dict[Any, list[torch.nn.Parameter]] = {}
        for p in self.network.parameters():
            g = p.grad
            if not isinstance(g, DTensor) or g.placements == p.placements:
                continue
            if (
                g.device_mesh == p.device_mesh
                and p.placements == (Replicate(),)
                and g.placements == (Partial(),)
            ):
                partial.setdefault(p.device_mesh, []).append(p)
            else:
                p.grad = g.redistribute(p.device_mesh, p.placements)
        for mesh, params in partial.items():
            local = [p.grad.to_local() for p in params]
            all_reduce_in_buckets(
                self.settings.fusion, local, list(range(len(params))), mesh.get_group()
            )
            for p, summed in zip(params, local):
                p.grad = DTensor.from_local(
                    summed, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )


def _rows_of_ranks(tensors: list[torch.Tensor], mesh: Any) -> list[DTensor]:
    """Each rank's inputs as its rows of the whole batch's, in rank order (every rank
    holding as many rows: checked, all inputs in one gather of their row counts)."""
    world = mesh.size()
    if not tensors:
        return []
    if any(x.dim() == 0 for x in tensors):
        raise ParallelError(
            "AutoParallel: dataset_strategy 'data_parallel' splits every input's dim 0; "
            "the call has a 0-dim tensor (pass it as a Python number, or use 'full_batch')"
        )
    counts = torch.tensor([x.shape[0] for x in tensors], device=tensors[0].device)
    seen = [torch.empty_like(counts) for _ in range(world)]
    _all_gather(seen, counts)
    placed = []
    for i, x in enumerate(tensors):
        held = [int(c[i]) for c in seen]
        if len(set(held)) > 1:
            raise ParallelError(
                f"AutoParallel: input {i} has {held} rows on the ranks; data_parallel "
                "needs as many on every rank"
            )
        shape = (sum(held), *x.shape[1:])
        placed.append(
            DTensor.from_local(
                x.contiguous(),
                mesh,
                [Shard(0)],
                run_check=False,
                shape=torch.Size(shape),
                stride=torch.empty(shape, device="meta").stride(),
            )
        )
    return placed


class PlannedRunner:
    """recursive_programming and sharding_propagation without stages: the network planned on
    the first call (rank 0 plans, every rank loads its program), run by its program after,
    on calls of the form and shapes it was planned for."""

    def __init__(self, network: torch.nn.Module, settings: Settings) -> None:
        self.network, self.settings, self.batch = network, settings, Batch(settings)
        self.planned: PlannedNetwork | None = None
        self.form: tuple | None = None

    def __call__(self, leaves: list, spec: Any) -> Any:
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        whole_batch = iter([self.batch.whole_batch(i, x) for i, x in enumerate(tensors)])
        leaves = [next(whole_batch) if isinstance(x, torch.Tensor) else x for x in leaves]
        # the program holds what the first call passed besides tensors (flags such as
        # use_cache=False): later calls must pass the same
        form = (spec, [x for x in leaves if not isinstance(x, torch.Tensor)])
        inputs = [x for x in leaves if isinstance(x, torch.Tensor)]
        if self.planned is None:
            self.planned = self._plan(leaves, spec, inputs)
            self.form = form
        if form != self.form:
            raise ParallelError(
                f"AutoParallel: the network was planned for a call of the form {self.form}; "
                f"this call is {form}"
            )
        found = [(tuple(x.shape), dtype_name(x.dtype)) for x in inputs]
        wanted = [(tuple(s.shape), s.dtype) for s in self.planned.inputs]
        if found != wanted:
            raise ParallelError(
                f"AutoParallel: the network was planned for inputs {wanted} (whole batch); "
                f"this call gives {found}"
            )
        return self.planned(self.batch.micro_batch_order(self.network, inputs, self.planned.dp))

    def _plan(self, leaves: list, spec: Any, inputs: list[torch.Tensor]) -> PlannedNetwork:
        settings = self.settings
        kept = (
            _annotations(self.network)
            if settings.parallel_mode == "sharding_propagation"
            else _Kept()
        )
        if settings.strategy_load is not None:
            kept = kept.merged(_loaded(settings.strategy_load, self.network))
        if settings.parallel_mode == "recursive_programming" and _annotated(self.network):
            raise ParallelError(
                "AutoParallel(parallel_mode='recursive_programming') decides every "
                "placement: drop the `shard` annotations, or plan around them with "
                "'sharding_propagation'"
            )
        args, kwargs = tree_unflatten(leaves, spec)
        device = inputs[0].device if inputs else torch.device("cpu")
        hsdp = settings.hsdp
        level = hsdp.level if hsdp is not None else None
        with planned_package(
            self.network, args, kwargs, device, settings.cluster, kept.placements, kept.replicas
        ) as package:
            return PlannedNetwork(
                self.network,
                package,
                device,
                hsdp.threshold_bytes if hsdp is not None else None,
                shard_size=hsdp.shard_size if hsdp is not None else -1,
                shard_gradients=level in ("level2", "level3"),
                gather_in_program=level == "level3",
                fusion=settings.fusion,
            )


class StagedRunner:
    """recursive_programming in pipeline stages: the first call cuts the network (rank 0
    weighs it, every rank takes its cut) and runs it as a `Pipeline` on the pipeline ranks,
    data parallel over the rest; each replica passes its rows of the whole batch. Returns the
    whole batch's mean loss (the mean of the micro-batches' losses). `cut` hands the
    `Pipeline` over as what this rank trains: its stage's modules."""

    def __init__(
        self, network: torch.nn.Module, settings: Settings, cut: Callable[[Pipeline], None]
    ) -> None:
        self.network, self.settings, self.batch = network, settings, Batch(settings)
        self.cut = cut

    def __call__(self, leaves: list, spec: Any) -> torch.Tensor:
        settings = self.settings
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        batch = [self.batch.whole_batch(i, x) for i, x in enumerate(tensors)]
        world = dist.get_world_size()
        if world % settings.stages:
            raise ParallelError(
                f"pipeline: {settings.stages} stages do not divide the {world} ranks"
            )
        dp = world // settings.stages
        if not batch or any(x.dim() == 0 or x.shape[0] % dp for x in batch):
            raise ParallelError(
                f"AutoParallel: pipeline stages give each of {dp} data-parallel replicas its "
                f"rows of the whole batch; the inputs {[tuple(x.shape) for x in batch]} do "
                "not split so"
            )
        micro = micro_batches_for(batch[0].shape[0] // dp, settings.stages)
        if settings.dataset == "full_batch":  # micro-batch k: the whole batch's slice k
            batch = [regroup_rows(x, micro, dp) for x in batch]
        mine = iter([x.chunk(dp)[dist.get_rank() % dp] for x in batch])
        args, kwargs = tree_unflatten(
            [next(mine) if isinstance(x, torch.Tensor) else x for x in leaves], spec
        )
        if not isinstance(self.network, Pipeline):
            for asked, method in (
                (settings.hsdp, "hsdp"),
                (settings.strategy_load, "load_param_strategy_file"),
            ):
                if asked is not None:
                    raise ParallelError(
                        f"{method}: not built for the pipeline stages the planner cuts (they "
                        "run data parallel, each rank holding its stages' whole parameters)"
                    )
            config = self._stage_config(args, kwargs, micro, tensors[0].device)
            pipeline = Pipeline(self.network, micro, config)
            pipeline.scheduler = settings.scheduler
            pipeline.pipeline_ranks = settings.stages
            self.network = pipeline
            self.cut(pipeline)
        self.network.fusion = settings.fusion
        return self.network(*args, **kwargs) / self.network.micro_size

    def _stage_config(self, args: tuple, kwargs: dict, micro: int, device: torch.device) -> dict:
        """Rank 0's balanced cut of the network, on one micro-batch, on every rank."""
        config, failure = {}, ""
        if dist.get_rank() == 0:
            one = tree_map(
                lambda x: x.chunk(micro)[0] if isinstance(x, torch.Tensor) else x, (args, kwargs)
            )
            try:
                with torch.random.fork_rng(devices=[]):
                    config = balanced_stage_config(self.network, *one, self.settings.stages)
            except Exception as exc:  # every rank must hear of it, or they wait forever
                failure = (
                    str(exc) if isinstance(exc, ParallelError) else f"{type(exc).__name__}: {exc}"
                )
        failure = broadcast_bytes(failure.encode(), device).decode()
        if failure:
            raise ParallelError(failure)
        return json.loads(broadcast_bytes(json.dumps(config).encode(), device))


def _annotated(network: torch.nn.Module) -> bool:
    """Whether `shard` placed any of the network's parameters."""
    return any(isinstance(p, DTensor) for p in network.parameters())


@dataclass(frozen=True)
class _Kept:
    """Placements given to weights (by annotations, or a loaded strategy file), for the
    planner to keep: each on the tensor-parallel mesh dim of a plan with `replicas`
    data-parallel replicas (None: the planner chooses)."""

    placements: tuple[tuple[str, tuple[str, ...]], ...] = ()
    replicas: int | None = None

    def merged(self, other: _Kept) -> _Kept:
        """Both together; a weight given two placements, or two replica counts, is refused."""
        given = dict(self.placements)
        for name, placements in other.placements:
            if given.get(name, placements) != placements:
                raise ParallelError(
                    f"{name}: annotated {list(given[name])} and loaded {list(placements)} from "
                    "the strategy file"
                )
            given[name] = placements
        replicas = {r for r in (self.replicas, other.replicas) if r is not None}
        if len(replicas) > 1:
            raise ParallelError(
                f"the annotations and the strategy file give {sorted(replicas)} data-parallel "
                "replicas; the plan has one count"
            )
        return _Kept(tuple(given.items()), replicas.pop() if replicas else None)


def _replicas_of(found: dict[str, int], where: str) -> int | None:
    """The one data-parallel size that every weight's layout in `found` gives."""
    sizes = sorted(set(found.values()))
    if len(sizes) > 1:
        example = {size: next(n for n, s in found.items() if s == size) for size in sizes}
        raise ParallelError(
            f"{where}: the layouts give different data-parallel sizes ({example}); the plan has one"
        )
    return sizes[0] if sizes else None


def _annotations(network: torch.nn.Module) -> _Kept:
    """The placements `shard` gave the network's parameters, for the planner to keep: on a
    mesh of every rank in order, of one dim (no replicas) or two (`dp` x `tp`, the weights
    replicated over the first: its size is the plan's replica count)."""
    fixed, replicas = [], {}
    world = dist.get_world_size()
    for name, p in network.named_parameters():
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        in_order = mesh.mesh.flatten().tolist() == list(range(world))
        if mesh.ndim > 2 or not in_order:
            raise ParallelError(
                f"sharding_propagation: {name} is annotated on a mesh of shape "
                f"{tuple(mesh.shape)} over ranks {mesh.mesh.tolist()}; the planner keeps "
                f"annotations on all {world} ranks in order, over one mesh dim or two (dp x tp)"
            )
        placements = p.placements
        if mesh.ndim == 2:
            if not isinstance(placements[0], Replicate):
                raise ParallelError(
                    f"sharding_propagation: {name} is split over the first dim of its layout "
                    f"({placement_str(placements[0])}); the planner's replicas each hold the "
                    "whole of a weight's tensor-parallel shards"
                )
            replicas[name], placements = mesh.shape[0], placements[1:]
        else:
            replicas[name] = 1
        fixed.append((name, tuple(placement_str(x) for x in placements)))
    return _Kept(tuple(fixed), _replicas_of(replicas, "sharding_propagation"))


def _loaded(path: str, network: torch.nn.Module) -> _Kept:
    """The placements a strategy file gives the network's parameters, each layout over one
    device-matrix dim of every rank, or two whose outer one (the replicas) splits nothing."""
    strategy = load_strategy(path)
    world = dist.get_world_size()
    names = {n for n, _ in network.named_parameters()}
    unknown = sorted(set(strategy.params) - names)
    if unknown:
        raise StrategyError(
            path, unknown[0], f"names parameters the network does not have: {unknown[:5]}"
        )
    fixed, replicas = [], {}
    for name, p in strategy.params.items():
        dev = p.dev_matrix
        split = [i for i, n in enumerate(dev) if n > 1]
        # tensor-map axes count from the device matrix's last dim
        used = {a for axes in p.tensor_map for a in axes}
        outer_unused = len(split) == 2 and len(dev) - 1 - split[0] not in used
        if math.prod(dev) != world or len(split) > 2 or (len(split) == 2 and not outer_unused):
            raise StrategyError(
                path,
                name,
                f"the device matrix {list(dev)} (tensor map {list(p.tensor_map)}) is not one "
                f"dimension of all {world} ranks, or a dp x tp matrix whose dp splits nothing",
            )
        replicas[name] = dev[split[0]] if len(split) == 2 else 1
        axis = len(dev) - 1 - split[-1] if split else None
        dims = [d for d, axes in enumerate(p.tensor_map) if axis in axes]
        fixed.append((name, (f"S({dims[0]})",) if dims else ("R",)))
    return _Kept(tuple(fixed), _replicas_of(replicas, path))


def _assemble(parts: list[torch.Tensor], counts: tuple[int, ...], dim: int = 0) -> torch.Tensor:
    """The tensor that `counts` split (dim i into counts[i] pieces; rank coordinates row-major,
    the last dim fastest) from its pieces `parts`, in rank order."""
    if len(counts) == 1:
        return torch.cat(parts, dim=dim)
    inner = len(parts) // counts[0]
    blocks = [
        _assemble(parts[i * inner : (i + 1) * inner], counts[1:], dim + 1) for i in range(counts[0])
    ]
    return torch.cat(blocks, dim=dim)
