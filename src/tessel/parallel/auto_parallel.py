"""`AutoParallel`: mindspore.parallel's wrapper of a network, for a PyTorch training loop.

    parallel_net = AutoParallel(network_with_loss, parallel_mode="recursive_programming")
    optimizer = torch.optim.AdamW(parallel_net.parameters())
    loss = parallel_net(input_ids=ids, labels=ids)   # plans on the first call
    loss.backward(); optimizer.step()

The settings methods record what the first call plans with; each is honoured or refused by
name with the reason. The network returns its loss (a scalar, or an output with `.loss`, as
`transformers` models given labels do): tessel plans its joint forward and backward graph
(`tessel.parallel.planned`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from tessel._torch import tree_flatten, tree_map, tree_unflatten
from tessel.arguments import integer
from tessel.atomic import replace_atomically
from tessel.checkpoint.dtensor import layout_from_dtensor
from tessel.checkpoint.errors import StrategyError
from tessel.checkpoint.layout import Layout
from tessel.checkpoint.mindspore_proto import strategy_to_protobuf, write_group_info
from tessel.checkpoint.strategy import Strategy, load_strategy, param_from_layout, write_strategy
from tessel.config.cluster import ClusterConfig
from tessel.dtypes import dtype_name
from tessel.parallel.annotate import (
    check_kinds,
    check_layout,
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
from tessel.runtime.exchange import DEFAULT_FUSION, all_reduce_in_buckets
from tessel.sharding.placements import placement_str

PARALLEL_MODES = ("semi_auto", "sharding_propagation", "recursive_programming")
OPTIMIZER_LEVELS = ("level1", "level2", "level3")
SCHEDULERS = ("1f1b", "gpipe")
FUSION_MODES = ("auto", "size", "index")


def _path_argument(method: str, file_path: Any) -> str:
    if not isinstance(file_path, (str, os.PathLike)):
        raise TypeError(f"{method}: file_path must be a str, found {type(file_path).__name__}")
    path = os.fspath(file_path)
    if not path.strip() or path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise ValueError(f"{method}: file_path must name a file, found {path!r}")
    return path


class AutoParallel(torch.nn.Module):
    """`network` planned over the job's ranks on its first call (see the module docstring).

    `parallel_mode`: "recursive_programming" (tessel's planner decides every placement),
    "sharding_propagation" (the planner keeps the parameters' `shard` annotations and decides
    the rest); "semi_auto" runs the network with its `shard` annotations, DTensor carrying
    them out, and the rest of the network data parallel over every rank
    (`annotate.data_parallel`). Communication must already be initialised.
    `cluster` (tessel's addition) is the cluster config the planner costs and fits the plan
    on: a path, its JSON as a dict, or a ClusterConfig; by default local devices of the job's
    device type, one per rank.
    """

    def __init__(
        self,
        network: torch.nn.Module,
        parallel_mode: str = "semi_auto",
        *,
        cluster: ClusterConfig | str | os.PathLike | dict | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(network, torch.nn.Module):
            raise TypeError(
                f"AutoParallel: network must be a torch.nn.Module, found {type(network).__name__}"
            )
        if parallel_mode not in PARALLEL_MODES:
            raise ValueError(
                f"AutoParallel: parallel_mode must be one of {list(PARALLEL_MODES)}, found "
                f"{parallel_mode!r}"
            )
        if not dist.is_initialized():
            raise ParallelError(
                "AutoParallel needs torch.distributed initialised first (dist."
                "init_process_group, as torchrun scripts do)"
            )
        inner = [n for n, m in network.named_modules() if n and isinstance(m, Pipeline)]
        if inner or (isinstance(network, Pipeline) and parallel_mode != "semi_auto"):
            found = f"one at {inner[0]!r}" if inner else repr(parallel_mode)
            raise ParallelError(
                "AutoParallel: a Pipeline network runs as the network AutoParallel wraps, in "
                f"'semi_auto'; found {found} "
                "(wrap the AutoParallel in GradAccumulation instead; 'recursive_programming' "
                "cuts a plain network into stages itself with pipeline(stages=N))"
            )
        self.network = network
        self.cluster = cluster
        self.parallel_mode = parallel_mode
        self._dataset: str | tuple = "data_parallel"
        self._hsdp: dict | None = None
        self._stages = 1
        self._strategy_save: str | None = None
        self._strategy_load: str | None = None
        self._fusion: tuple[str, Any] = DEFAULT_FUSION
        self._group_save: str | None = None
        self._planned: PlannedNetwork | None = None
        self._form: tuple | None = None
        self._placed = False  # the parameters are placed: the first call has run
        self._scheduler = "1f1b"  # of the stages the planner cuts

    @property
    def mesh(self) -> Any:
        """The DeviceMesh the plan runs on (its dims named, `dp` first where there are
        data-parallel replicas; `pp` x `dp` for pipeline stages); None before the first call,
        and in semi_auto without stages (each parameter's DTensor carries its own)."""
        if self._planned is not None:
            return self._planned.mesh
        return getattr(self.network, "mesh", None) if isinstance(self.network, Pipeline) else None

    # -- settings -----------------------------------------------------------------------

    def no_init_parameters_in_compile(self) -> None:
        """Accepted: the plan's weights come from rank 0's network, whatever the others hold."""

    def load_param_strategy_file(self, file_path: str) -> None:
        """Plan with the parameters' layouts from a strategy file (tessel JSON, MindSpore JSON
        or protobuf) kept as given, the rest decided around them (not semi_auto). Each layout
        splits over one device-matrix dim of all ranks, or is a dp x tp matrix whose dp splits
        nothing (its size becomes the plan's replica count), as AutoParallel's plans save."""
        path = _path_argument("load_param_strategy_file", file_path)
        if self.parallel_mode == "semi_auto":
            raise ParallelError(
                "load_param_strategy_file: semi_auto runs the network's own `shard` "
                "annotations; load a strategy with 'sharding_propagation'"
            )
        self._strategy_load = path

    def save_param_strategy_file(self, file_path: str) -> None:
        """Write the trained parameters' layouts on the first call: tessel JSON for a `.json`
        path, MindSpore's protobuf otherwise; `tessel ckpt` reads both."""
        path = _path_argument("save_param_strategy_file", file_path)
        self._refuse_for_stages("save_param_strategy_file")
        self._strategy_save = path
        if self._placed:
            self._save_strategy()

    def set_group_ckpt_save_file(self, file_path: str) -> None:
        """Write the communication groups (MindSpore's group-info protobuf) on the first call:
        the groups of the plan's program, or (semi_auto) of each mesh dim the parameters are
        placed on, and the ranks holding the same shards as this one."""
        path = _path_argument("set_group_ckpt_save_file", file_path)
        self._refuse_for_stages("set_group_ckpt_save_file")
        self._group_save = path
        if self._placed:
            self._save_groups()

    def _refuse_for_stages(self, method: str, stages: int | None = None) -> None:
        """Strategy and group files with pipeline stages (`stages`, or those set)."""
        if isinstance(self.network, Pipeline) or (stages or self._stages) > 1:
            raise ParallelError(
                f"{method}: in pipeline stages each rank holds its stages' parameters as "
                "plain tensors, which no layout over the job's ranks describes; strategy and "
                "group files are not built for pipeline stages"
            )

    def dataset_strategy(self, config: str | tuple) -> None:
        """ "data_parallel": each rank's call holds its slice of the batch, rank order;
        "full_batch": every rank's call holds the whole batch; a tuple of per-input split
        counts (one tuple per input, each splitting it over every rank or none), or of
        `Layout`s (called with a tensor map: each rank's part of each input, ranks along a
        dim the layout does not split holding the same part)."""
        if config is None:
            raise ValueError("dataset_strategy: config must not be None")
        if isinstance(config, str):
            if config not in ("data_parallel", "full_batch"):
                raise ValueError(
                    "dataset_strategy: a string config must be 'data_parallel' or 'full_batch', "
                    f"found {config!r}"
                )
        elif isinstance(config, tuple):
            if not config:
                raise ValueError(
                    "dataset_strategy: config is an empty tuple; give one strategy per input"
                )
            world = dist.get_world_size()
            check_kinds(list(config), "dataset_strategy: config")
            for i, entry in enumerate(config):
                if isinstance(entry, Layout):
                    check_layout(entry, world, f"dataset_strategy: entry {i}")
                    continue
                if not isinstance(entry, tuple) or not all(
                    isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in entry
                ):
                    raise TypeError(
                        f"dataset_strategy: entry {i} must be a tuple of split counts (ints "
                        f">= 1) or a Layout, found {entry!r}"
                    )
                count = 1
                for c in entry:
                    count *= c
                if count not in (1, world):
                    raise ValueError(
                        f"dataset_strategy: entry {i} {entry} splits an input {count} ways; "
                        f"allowed: over all {world} ranks or none"
                    )
        else:
            raise TypeError(
                "dataset_strategy: config must be 'data_parallel', 'full_batch' or a tuple of "
                f"split counts or of Layouts, found {type(config).__name__}"
            )
        self._dataset = config

    def hsdp(
        self, shard_size: int = -1, threshold: int = 64, optimizer_level: str = "level1"
    ) -> None:
        """Store every weight of at least `threshold` KB sharded on dim 0 over the ranks the
        plan replicates it on (`shard_size` of them: the mesh dims whose ranks number that,
        neighbouring ranks first; -1: all), its optimizer states with it. level1: its gradient is reduced
        whole, then sliced; level2: reduce-scattered over the data-parallel replicas (over the
        tensor-parallel ranks a gradient leaves the program whole, and is sliced); level3: as
        level2, and the program gathers each such weight just before the nodes that read it,
        in the forward pass and again in the backward, freeing it between."""
        if self.parallel_mode == "semi_auto":
            raise ParallelError(
                "hsdp: semi_auto runs the network's `shard` annotations and keeps every other "
                "weight whole on each rank; weights stored sharded are built for planned "
                "networks ('recursive_programming', 'sharding_propagation')"
            )
        if isinstance(shard_size, bool) or not isinstance(shard_size, int):
            raise TypeError(f"hsdp: shard_size must be an int, found {type(shard_size).__name__}")
        world = dist.get_world_size()
        if shard_size != -1 and not 0 < shard_size <= world:
            raise ValueError(
                f"hsdp: shard_size must be -1 (every rank replicating a weight) or in "
                f"(0, {world}], found {shard_size}"
            )
        integer("hsdp", "threshold", threshold, 0)
        if optimizer_level not in OPTIMIZER_LEVELS:
            raise ValueError(
                f"hsdp: optimizer_level must be one of {list(OPTIMIZER_LEVELS)}, found "
                f"{optimizer_level!r}"
            )
        self._hsdp = {
            "threshold_bytes": threshold * 1024,
            "level": optimizer_level,
            "shard_size": shard_size,
        }

    def pipeline(
        self,
        stages: int = 1,
        output_broadcast: bool = False,
        interleave: bool = False,
        scheduler: str = "1f1b",
    ) -> None:
        """Run the network in `stages` pipeline stages under `scheduler`, data parallel over
        the rest of the ranks. semi_auto: a `Pipeline` network, cut by its stage_config; with
        `interleave`, that may give a multiple of `stages` stages: pipeline rank r runs stages
        r, r + stages, ... under 1F1B interleaved ("1f1b") or looped breadth-first ("gpipe").
        recursive_programming: a plain network, which the first call cuts into stages of
        about equal work (`stage_cuts`), in as few micro-batches as cover the stages; it then
        returns the whole batch's mean loss, and the optimizer is made over this rank's
        stage's parameters after it. The loss reaches every stage whatever
        `output_broadcast` says."""
        integer("pipeline", "stages", stages, 1)
        if scheduler not in SCHEDULERS:
            raise ValueError(
                f"pipeline: scheduler must be one of {list(SCHEDULERS)}, found {scheduler!r}"
            )
        planner_cuts = self.parallel_mode == "recursive_programming" and not isinstance(
            self.network, Pipeline
        )
        if planner_cuts and interleave:
            raise ParallelError(
                "pipeline: the planner cuts one stage per pipeline rank; for interleaved "
                "stages give a Pipeline network a stage_config, in 'semi_auto'"
            )
        if planner_cuts and stages > 1:
            if self._planned is not None:
                raise ParallelError("pipeline: the network is already planned without stages")
            self._scheduler = scheduler
        elif stages > 1 or interleave:
            if self.parallel_mode != "semi_auto" or not isinstance(self.network, Pipeline):
                raise ParallelError(
                    "pipeline: stages in AutoParallel run a tessel.parallel.nn.Pipeline "
                    "network in 'semi_auto' mode, or a plain network the planner cuts in "
                    "'recursive_programming'"
                )
            cut = self.network.stages
            if interleave and cut % stages:
                raise ValueError(
                    f"pipeline: interleave runs the Pipeline's {cut} stages (its stage_config) "
                    f"looped over the pipeline ranks; {cut} is not a multiple of stages={stages}"
                )
            if not interleave and cut != stages:
                raise ValueError(
                    f"pipeline: stages={stages}, but the Pipeline's stage_config gives {cut} "
                    "(several stages per rank need interleave=True)"
                )
            self.network.scheduler = scheduler
            self.network.pipeline_ranks = stages
        if self._strategy_save or self._group_save:
            self._refuse_for_stages("pipeline", stages)
        self._stages = stages

    def get_pipeline_stages(self) -> int:
        return self._stages

    def enable_gradients_mean(self) -> None:
        """Accepted: gradients are those of the loss returned, the mean over the whole batch."""

    def disable_gradient_fp32_sync(self) -> None:
        """Accepted: gradients are reduced in the dtype the program computes them in."""

    def disable_loss_repeated_mean(self) -> None:
        raise ParallelError(
            "disable_loss_repeated_mean: the loss is computed once over the whole batch; a "
            "repeated loss to leave unaveraged does not arise and is not built"
        )

    def comm_fusion(self, config: dict) -> None:
        """How the replicas' gradient all-reduce is fused: `{"openstate": False}` reduces each
        gradient alone; `{"allreduce": {"mode": "auto"}}` in buckets of 25 MB (the default),
        `"size"` with `"config"` MB, `"index"` with `"config"` the parameter indices where
        buckets start. A planned network starts each bucket's all-reduce as soon as its
        program has made the bucket's gradients, while the backward pass goes on ("size"
        buckets gather gradients in the order they are made, as DDP's do). The program's own
        collectives, and hsdp's gathers and reduce-scatters (one per weight), are not fused:
        `allgather` and `reducescatter` are refused."""
        if not isinstance(config, dict):
            raise TypeError(f"comm_fusion: config must be a dict, found {type(config).__name__}")
        unknown = sorted(set(config) - {"openstate", "allreduce", "allgather", "reducescatter"})
        if unknown:
            raise KeyError(
                f"comm_fusion: unknown keys {unknown}; allowed: openstate, allreduce, "
                "allgather, reducescatter"
            )
        for key in ("allgather", "reducescatter"):
            if key in config:
                raise ParallelError(
                    f"comm_fusion: {key!r} is not built: hsdp's gathers and reduce-scatters "
                    "run one per weight"
                )
        openstate = config.get("openstate", True)
        if not isinstance(openstate, bool):
            raise TypeError(f"comm_fusion: openstate must be a bool, found {openstate!r}")
        allreduce = config.get("allreduce", {"mode": "auto"})
        if not isinstance(allreduce, dict) or allreduce.get("mode") not in FUSION_MODES:
            raise ValueError(
                f"comm_fusion: allreduce must be a dict whose mode is one of "
                f"{list(FUSION_MODES)}, found {allreduce!r}"
            )
        mode, value = allreduce["mode"], allreduce.get("config")
        if mode == "size" and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
        ):
            raise ValueError(f"comm_fusion: allreduce size config must be MB > 0, found {value!r}")
        if mode == "index" and (
            not isinstance(value, (list, tuple))
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
        ):
            raise ValueError(
                f"comm_fusion: allreduce index config must be a list of parameter indices, "
                f"found {value!r}"
            )
        if not openstate:
            self._fusion = ("each", None)  # every gradient alone
        elif mode == "auto":
            self._fusion = DEFAULT_FUSION
        else:
            self._fusion = (mode, value)

    def enable_fp32_communication(self) -> None:
        if any(p.dtype != torch.float32 for p in self.network.parameters()):
            raise ParallelError(
                "enable_fp32_communication: reductions run in the dtype the program computes "
                "in; for a network not in float32 that is not built"
            )

    # -- running ------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The loss of the whole batch (recursive_programming, sharding_propagation), or the
        network's output (semi_auto)."""
        leaves, spec = tree_flatten((args, kwargs))
        if self.parallel_mode == "semi_auto" and isinstance(self.network, Pipeline):
            self.network.fusion = self._fusion  # its replicas' gradients, in these buckets
            args, kwargs = self._replica_batch(leaves, spec)
            return self.network(*args, **kwargs)
        if self.parallel_mode == "semi_auto":
            return self._data_parallel(leaves, spec)
        if self._stages > 1:
            return self._in_stages(leaves, spec)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        whole = iter([self._whole_batch(i, x) for i, x in enumerate(tensors)])
        leaves = [next(whole) if isinstance(x, torch.Tensor) else x for x in leaves]
        # the program holds what the first call passed besides tensors (flags such as
        # use_cache=False): later calls must pass the same
        form = (spec, [x for x in leaves if not isinstance(x, torch.Tensor)])
        inputs = [x for x in leaves if isinstance(x, torch.Tensor)]
        if self._planned is None:
            kept = (
                _annotations(self.network)
                if self.parallel_mode == "sharding_propagation"
                else _Kept()
            )
            if self._strategy_load is not None:
                kept = kept.merged(_loaded(self._strategy_load, self.network))
            if self.parallel_mode == "recursive_programming" and _annotated(self.network):
                raise ParallelError(
                    "AutoParallel(parallel_mode='recursive_programming') decides every "
                    "placement: drop the `shard` annotations, or plan around them with "
                    "'sharding_propagation'"
                )
            args, kwargs = tree_unflatten(leaves, spec)
            device = inputs[0].device if inputs else torch.device("cpu")
            hsdp = self._hsdp or {"threshold_bytes": None, "level": None, "shard_size": -1}
            level = hsdp["level"]
            with planned_package(
                self.network, args, kwargs, device, self.cluster, kept.placements, kept.replicas
            ) as package:
                self._planned = PlannedNetwork(
                    self.network,
                    package,
                    device,
                    hsdp["threshold_bytes"],
                    shard_size=hsdp["shard_size"],
                    shard_gradients=level in ("level2", "level3"),
                    gather_in_program=level == "level3",
                    fusion=self._fusion,
                )
            self._form = form
            self._first_call_done()
        if form != self._form:
            raise ParallelError(
                f"AutoParallel: the network was planned for a call of the form {self._form}; "
                f"this call is {form}"
            )
        found = [(tuple(x.shape), dtype_name(x.dtype)) for x in inputs]
        wanted = [(tuple(s.shape), s.dtype) for s in self._planned.inputs]
        if found != wanted:
            raise ParallelError(
                f"AutoParallel: the network was planned for inputs {wanted} (whole batch); "
                f"this call gives {found}"
            )
        return self._planned(self._micro_batch_order(inputs, self._planned.dp))

    def _micro_batch_order(self, batch: list[torch.Tensor], replicas: int) -> list[torch.Tensor]:
        """The whole batch's rows in the order in which `replicas`, each cutting its rows into
        the micro-batches of the network's GradAccumulation or MicroBatchInterleaved, run
        micro-batch i as: every rank's slice i with "data_parallel" (each rank cuts its own
        rows, as MindSpore's wrappers do), the whole batch's slice i otherwise."""
        micro = micro_batch_count(self.network)
        if micro == 1:
            return batch
        world = dist.get_world_size()
        ordered = []
        for x in batch:
            if self._dataset == "data_parallel" and x.shape[0] % (world * micro) == 0:
                x = regroup_rows(x, world, micro)  # gathered in rank order
            if x.shape[0] % (micro * replicas) == 0:
                x = regroup_rows(x, micro, replicas)
            ordered.append(x)
        return ordered

    def _replica_batch(self, leaves: list, spec: Any) -> tuple[tuple, dict]:
        """A Pipeline network's call on this rank: its replica's batch. "data_parallel": the
        call's own; "full_batch": the replica's rows of the whole batch, micro-batch k of the
        pipeline holding the whole batch's slice k, its rows split over the replicas."""
        if self._dataset == "data_parallel":
            return tree_unflatten(leaves, spec)
        if self._dataset != "full_batch":
            raise ParallelError(
                "dataset_strategy: a Pipeline network takes 'data_parallel' (each rank passing "
                "its replica's batch) or 'full_batch'; per-input strategies are not built for "
                "pipeline stages"
            )
        pipeline = self.network
        assert isinstance(pipeline, Pipeline)
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

    def _in_stages(self, leaves: list, spec: Any) -> torch.Tensor:
        """recursive_programming in pipeline stages: the first call cuts the network (rank 0
        weighs it, every rank takes its cut) and runs it as a `Pipeline` on the pipeline
        ranks, data parallel over the rest; each replica passes its rows of the whole batch.
        Returns the whole batch's mean loss (the mean of the micro-batches' losses)."""
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        whole = [self._whole_batch(i, x) for i, x in enumerate(tensors)]
        world = dist.get_world_size()
        if world % self._stages:
            raise ParallelError(f"pipeline: {self._stages} stages do not divide the {world} ranks")
        dp = world // self._stages
        if not whole or any(x.dim() == 0 or x.shape[0] % dp for x in whole):
            raise ParallelError(
                f"AutoParallel: pipeline stages give each of {dp} data-parallel replicas its "
                f"rows of the whole batch; the inputs {[tuple(x.shape) for x in whole]} do "
                "not split so"
            )
        micro = micro_batches_for(whole[0].shape[0] // dp, self._stages)
        if self._dataset == "full_batch":  # micro-batch k: the whole batch's slice k
            whole = [regroup_rows(x, micro, dp) for x in whole]
        mine = iter([x.chunk(dp)[dist.get_rank() % dp] for x in whole])
        args, kwargs = tree_unflatten(
            [next(mine) if isinstance(x, torch.Tensor) else x for x in leaves], spec
        )
        if not isinstance(self.network, Pipeline):
            for asked, method in (
                (self._hsdp, "hsdp"),
                (self._strategy_load, "load_param_strategy_file"),
            ):
                if asked is not None:
                    raise ParallelError(
                        f"{method}: not built for the pipeline stages the planner cuts (they "
                        "run data parallel, each rank holding its stages' whole parameters)"
                    )
            config = self._stage_config(args, kwargs, micro, tensors[0].device)
            pipeline = Pipeline(self.network, micro, config)
            pipeline.scheduler = self._scheduler
            pipeline.pipeline_ranks = self._stages
            self.network = pipeline  # what this rank trains: its stage's modules
        self.network.fusion = self._fusion
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
                    config = balanced_stage_config(self.network, *one, self._stages)
            except Exception as exc:  # every rank must hear of it, or they wait forever
                failure = (
                    str(exc) if isinstance(exc, ParallelError) else f"{type(exc).__name__}: {exc}"
                )
        failure = broadcast_bytes(failure.encode(), device).decode()
        if failure:
            raise ParallelError(failure)
        return json.loads(broadcast_bytes(json.dumps(config).encode(), device))

    def _data_parallel(self, leaves: list, spec: Any) -> Any:
        """semi_auto: the network run on DTensors, its annotated regions as `shard` placed
        them, the rest data parallel over every rank (`annotate.data_parallel`). Its outputs
        come back whole."""
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        device_type = tensors[0].device.type if tensors else "cpu"
        mesh = world_mesh(device_type)
        # the unannotated parameters, replicated
        distribute_parameters(self.network, {}, mesh, "AutoParallel's first call")
        if self._dataset == "data_parallel":
            placed = self._rows_of_ranks(tensors, mesh)
        else:
            parts = [self._batch_part(i, x) for i, x in enumerate(tensors)]
            if self._dataset == "full_batch":
                parts = self._micro_batch_order(parts, mesh.size())
            placed = [rows(x, mesh) for x in parts]
        placed_iter = iter(placed)
        leaves = [next(placed_iter) if isinstance(x, torch.Tensor) else x for x in leaves]
        args, kwargs = tree_unflatten(leaves, spec)
        if not self._placed:
            self._first_call_done()
        with data_parallel(mesh):
            out = self.network(*args, **kwargs)
        return whole(out, self._reduce_gradients)

    def _first_call_done(self) -> None:
        """The parameters are placed: the files asked for are written."""
        self._placed = True
        if self._strategy_save is not None:
            self._save_strategy()
        if self._group_save is not None:
            self._save_groups()

    @staticmethod
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
        dist.all_gather(seen, counts)
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
            all_reduce_in_buckets(self._fusion, local, list(range(len(params))), mesh.get_group())
            for p, summed in zip(params, local):
                p.grad = DTensor.from_local(
                    summed, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )

    def _whole_batch(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Input `index` of the whole batch, from this rank's part of it."""
        whole = self._batch_part(index, x)
        return whole.full_tensor() if isinstance(whole, DTensor) else whole

    def _batch_part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Input `index` from this rank's part of it: a DTensor where a Layout places it, else
        the whole batch."""
        world = dist.get_world_size()
        config = self._dataset
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
        dist.all_gather(parts, x.contiguous())
        return _assemble(parts, counts)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The network's state under its own names (DTensors where planned or annotated), as
        torch.distributed.checkpoint saves it and the strategy file names it."""
        return self.network.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.network.load_state_dict(state_dict, strict=strict, assign=assign)

    # -- files --------------------------------------------------------------------------

    def _trained(self) -> list[tuple[str, DTensor]]:
        """The trained parameters, each a DTensor on its mesh, under the network's names."""
        if self._planned is not None:
            return [(t.name, t.parameter) for t in self._planned.trained]
        return [
            (name, p)
            for name, p in self.network.named_parameters()
            if isinstance(p, DTensor) and p.requires_grad
        ]

    def _strategy(self) -> Strategy:
        params = {}
        for name, value in self._trained():
            layout = layout_from_dtensor(value.device_mesh, value.placements, value.dim())
            params[name] = param_from_layout(
                name, layout, tuple(value.shape), value.dtype, 0, 0, 0, "AutoParallel"
            )
        return Strategy(params, "AutoParallel", {"world_size": dist.get_world_size()})

    def _save_strategy(self) -> None:
        path = self._strategy_save
        assert path is not None
        strategy = self._strategy()
        if Path(path).suffix == ".json":
            write_strategy(strategy, path)
            return
        data = strategy_to_protobuf(strategy)
        with replace_atomically(path) as tmp:
            tmp.write_bytes(data)

    def _save_groups(self) -> None:
        path = self._group_save
        assert path is not None
        trained = [p for _, p in self._trained()]
        if self._planned is not None:
            comm_groups = self._planned.comm_groups
        else:
            comm_groups = mesh_dim_groups(p.device_mesh for p in trained)
        groups = {f"group_{i}": list(g) for i, g in enumerate(comm_groups)}
        data = write_group_info(groups, identical_ranks(trained, dist.get_rank()))
        with replace_atomically(path) as tmp:
            tmp.write_bytes(data)


def mesh_dim_groups(meshes: Iterable[DeviceMesh]) -> list[tuple[int, ...]]:
    """The groups of ranks along each dim of several ranks of `meshes`, in order."""
    found = set()
    for mesh in meshes:
        for d, size in enumerate(mesh.shape):
            if size > 1:
                along = mesh.mesh.movedim(d, -1).reshape(-1, size)
                found.update(tuple(int(r) for r in row) for row in along)
    return sorted(found)


def identical_ranks(parameters: Sequence[DTensor], rank: int) -> list[int]:
    """The ranks holding the same shard of every parameter as `rank`: any of their
    checkpoints stands in for its."""

    def coordinate(mesh: DeviceMesh, r: int) -> tuple[int, ...] | None:
        found = (mesh.mesh == r).nonzero()
        return tuple(found[0].tolist()) if len(found) else None

    held = [(p, coordinate(p.device_mesh, rank)) for p in parameters]

    def same_shard(p: DTensor, mine: tuple[int, ...] | None, r: int) -> bool:
        theirs = coordinate(p.device_mesh, r)
        if mine is None or theirs is None:
            return mine == theirs  # neither holds any of it
        return all(a == b for x, a, b in zip(p.placements, mine, theirs) if isinstance(x, Shard))

    return [r for r in range(dist.get_world_size()) if all(same_shard(p, m, r) for p, m in held)]


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
