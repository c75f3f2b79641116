"""`AutoParallel`: mindspore.parallel's wrapper of a network, for a PyTorch training loop.

    parallel_net = AutoParallel(network_with_loss, parallel_mode="recursive_programming")
    optimizer = torch.optim.AdamW(parallel_net.parameters())
    loss = parallel_net(input_ids=ids, labels=ids)   # plans on the first call
    loss.backward(); optimizer.step()

The settings methods record what the first call plans with (`runners.Settings`); each is
honoured or refused by name with the reason. The first call hands the network to the runner
the settings ask for (`tessel.parallel.runners`), which runs every call after. The network
returns its loss (a scalar, or an output with `.loss`, as `transformers` models given labels
do): tessel plans its joint forward and backward graph (`tessel.parallel.planned`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from tessel._torch import tree_flatten
from tessel.arguments import integer
from tessel.atomic import replace_atomically
from tessel.checkpoint.dtensor import layout_from_dtensor
from tessel.checkpoint.layout import Layout
from tessel.checkpoint.mindspore_proto import strategy_to_protobuf, write_group_info
from tessel.checkpoint.strategy import Strategy, param_from_layout, write_strategy
from tessel.config.cluster import ClusterConfig
from tessel.parallel.annotate import (
    check_kinds,
    check_layout,
)
from tessel.parallel.errors import ParallelError
from tessel.parallel.pipeline import Pipeline
from tessel.parallel.planned import PlannedNetwork
from tessel.parallel.runners import (
    Hsdp,
    PipelineNetworkRunner,
    PlannedRunner,
    SemiAutoRunner,
    Settings,
    StagedRunner,
)
from tessel.runtime.exchange import DEFAULT_FUSION
from tessel.schedules import SCHEDULES

PARALLEL_MODES = ("semi_auto", "sharding_propagation", "recursive_programming")
OPTIMIZER_LEVELS = ("level1", "level2", "level3")
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

    Args:
        network: The network to train; it returns its loss (planned modes).
        parallel_mode: `"recursive_programming"`, `"sharding_propagation"` or `"semi_auto"`.
        cluster: The cluster config the planner costs and fits the plan on.

    Raises:
        ParallelError: torch.distributed is not initialised, or a `Pipeline` is wrapped in
            another mode than semi_auto.
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
        self.settings = Settings(parallel_mode, cluster)
        self._strategy_save: str | None = None
        self._group_save: str | None = None
        self._runner: Any = None  # chosen by the first call (`runners`)
        self._placed = False  # the parameters are placed: the first call has run

    @property
    def parallel_mode(self) -> str:
        return self.settings.parallel_mode

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
        nothing (its size becomes the plan's replica count), as AutoParallel's plans save.

        Args:
            file_path: The strategy file.

        Raises:
            ParallelError: In semi_auto, or after the first call.
        """
        path = _path_argument("load_param_strategy_file", file_path)
        self._refuse_once_planned("load_param_strategy_file")
        if self.parallel_mode == "semi_auto":
            raise ParallelError(
                "load_param_strategy_file: semi_auto runs the network's own `shard` "
                "annotations; load a strategy with 'sharding_propagation'"
            )
        self.settings.strategy_load = path

    def save_param_strategy_file(self, file_path: str) -> None:
        """Write the trained parameters' layouts on the first call: tessel JSON for a `.json`
        path, MindSpore's protobuf otherwise; `tessel ckpt` reads both.

        Args:
            file_path: Where to write the strategy file.

        Raises:
            ParallelError: With pipeline stages, where no layout over the job's ranks applies.
        """
        path = _path_argument("save_param_strategy_file", file_path)
        self._refuse_for_stages("save_param_strategy_file")
        self._strategy_save = path
        if self._placed:
            self._save_strategy()

    def set_group_ckpt_save_file(self, file_path: str) -> None:
        """Write the communication groups (MindSpore's group-info protobuf) on the first call:
        the groups of the plan's program, or (semi_auto) of each mesh dim the parameters are
        placed on, and the ranks holding the same shards as this one.

        Args:
            file_path: Where to write the group-info file.

        Raises:
            ParallelError: With pipeline stages.
        """
        path = _path_argument("set_group_ckpt_save_file", file_path)
        self._refuse_for_stages("set_group_ckpt_save_file")
        self._group_save = path
        if self._placed:
            self._save_groups()

    def _refuse_once_planned(self, method: str) -> None:
        """A setting the first call reads when it plans or cuts the network: later, it would
        be recorded and never read."""
        if self._runner is not None:
            raise ParallelError(
                f"{method}: the first call has run the network already; call {method} before it"
            )

    def _refuse_for_stages(self, method: str, stages: int | None = None) -> None:
        """Strategy and group files with pipeline stages (`stages`, or those set)."""
        if isinstance(self.network, Pipeline) or (stages or self.settings.stages) > 1:
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
        dim the layout does not split holding the same part).

        Args:
            config: `"data_parallel"`, `"full_batch"`, or a tuple as above.
        """
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
        self.settings.dataset = config

    def hsdp(
        self, shard_size: int = -1, threshold: int = 64, optimizer_level: str = "level1"
    ) -> None:
        """Store every weight of at least `threshold` KB sharded on dim 0 over the ranks the
        plan replicates it on (`shard_size` of them: the mesh dims whose ranks number that,
        neighbouring ranks first; -1: all), its optimizer states with it. level1: its gradient is reduced
        whole, then sliced; level2: reduce-scattered over the data-parallel replicas (over the
        tensor-parallel ranks a gradient leaves the program whole, and is sliced); level3: as
        level2, and the program gathers each such weight just before the nodes that read it,
        in the forward pass and again in the backward, freeing it between.

        Args:
            shard_size: The ranks a weight is stored sharded over; -1: all that replicate it.
            threshold: The smallest weight stored sharded, in KB.
            optimizer_level: `"level1"`, `"level2"` or `"level3"`, as above.

        Raises:
            ParallelError: In semi_auto, or after the first call.
        """
        self._refuse_once_planned("hsdp")
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
        self.settings.hsdp = Hsdp(threshold * 1024, optimizer_level, shard_size)

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
        `output_broadcast` says.

        Args:
            stages: The pipeline stages (pipeline ranks).
            output_broadcast: MindSpore's switch; the loss reaches every stage either way.
            interleave: semi_auto: run a multiple of `stages` stages looped over the pipeline
                ranks.
            scheduler: `"1f1b"` or `"gpipe"`.

        Raises:
            ParallelError: Stages for a network this mode cannot cut, or a change after the
                first call.
        """
        integer("pipeline", "stages", stages, 1)
        if scheduler not in SCHEDULES:
            raise ValueError(
                f"pipeline: scheduler must be one of {list(SCHEDULES)}, found {scheduler!r}"
            )
        planner_cuts = self.parallel_mode == "recursive_programming" and not isinstance(
            self.network, Pipeline
        )
        if planner_cuts and interleave:
            raise ParallelError(
                "pipeline: the planner cuts one stage per pipeline rank; for interleaved "
                "stages give a Pipeline network a stage_config, in 'semi_auto'"
            )
        if self._runner is not None and stages != self.settings.stages:
            raise ParallelError(
                "pipeline: the network is already planned without stages"
                if self._planned is not None
                else "pipeline: the first call has chosen how the network runs "
                f"({self.settings.stages} stage(s)); set the stages before it"
            )
        if planner_cuts and stages > 1:
            self.settings.scheduler = scheduler
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
        self.settings.stages = stages

    def get_pipeline_stages(self) -> int:
        return self.settings.stages

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
        `allgather` and `reducescatter` are refused.

        Args:
            config: The fusion, as above.
        """
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
        if isinstance(self._runner, PlannedRunner):
            self._refuse_once_planned("comm_fusion")  # its units are in the planned program
        if not openstate:
            self.settings.fusion = ("each", None)  # every gradient alone
        elif mode == "auto":
            self.settings.fusion = DEFAULT_FUSION
        else:
            self.settings.fusion = (mode, value)

    def enable_fp32_communication(self) -> None:
        if any(p.dtype != torch.float32 for p in self.network.parameters()):
            raise ParallelError(
                "enable_fp32_communication: reductions run in the dtype the program computes "
                "in; for a network not in float32 that is not built"
            )

    # -- running ------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The loss of the whole batch (recursive_programming, sharding_propagation), or the
        network's output (semi_auto). The first call chooses the runner the settings ask for;
        every call after runs on it."""
        leaves, spec = tree_flatten((args, kwargs))
        if self._runner is None:
            self._runner = self._first_runner()
        out = self._runner(leaves, spec)
        if not self._placed and isinstance(self._runner, (SemiAutoRunner, PlannedRunner)):
            self._first_call_done()
        return out

    def _first_runner(self) -> Any:
        settings = self.settings
        if settings.parallel_mode == "semi_auto" and isinstance(self.network, Pipeline):
            return PipelineNetworkRunner(self.network, settings)
        if settings.parallel_mode == "semi_auto":
            return SemiAutoRunner(self.network, settings)
        if settings.stages > 1:
            return StagedRunner(self.network, settings, self._trains_its_stage)
        return PlannedRunner(self.network, settings)

    def _trains_its_stage(self, pipeline: Pipeline) -> None:
        self.network = pipeline  # what this rank trains: its stage's modules

    @property
    def _planned(self) -> PlannedNetwork | None:
        """The planned network, where the first call planned one."""
        return self._runner.planned if isinstance(self._runner, PlannedRunner) else None

    def _first_call_done(self) -> None:
        """The parameters are placed: the files asked for are written."""
        self._placed = True
        if self._strategy_save is not None:
            self._save_strategy()
        if self._group_save is not None:
            self._save_groups()

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
